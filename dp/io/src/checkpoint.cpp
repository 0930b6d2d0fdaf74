// checkpoint.cpp — state dicts between models and safetensors files.
#include "dp/io/checkpoint.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp {
namespace {

std::vector<TensorRef> state_views(const Model& model) {
  auto views = model.parameters();
  for (auto& b : model.buffers()) views.push_back(b);
  return views;
}

}  // namespace

safetensors::File state_dict(const Model& model, const Stream& stream) {
  safetensors::File file;
  for (const TensorRef& view : state_views(model)) {
    safetensors::Tensor t{dtype_name(view.dtype), view.shape, {}};
    t.data.resize(view.bytes());
    stream.copy(t.data.data(), view.data, view.bytes());  // pageable destination: synchronous
    file.add(view.name, std::move(t));
  }
  return file;
}

void load_state_dict(Model& model, const Stream& stream, const safetensors::File& file, const std::string& prefix) {
  // Validate everything first, so a bad file leaves the model untouched.
  std::vector<std::pair<const TensorRef*, const safetensors::Tensor*>> plan;
  const auto views = state_views(model);
  for (const TensorRef& view : views) {
    const std::string plain = prefix + view.name, wrapped = prefix + "module." + view.name;
    const safetensors::Tensor* t = file.has(plain)     ? &file.tensors.at(plain)
                                   : file.has(wrapped) ? &file.tensors.at(wrapped)
                                                       : nullptr;
    if (!t) throw Error(fmt::format("checkpoint has no tensor '{}'", plain));
    if (t->dtype != dtype_name(view.dtype))
      throw Error(fmt::format("checkpoint tensor '{}' has dtype {}, the model expects {}", plain, t->dtype,
                              dtype_name(view.dtype)));
    if (const std::size_t at = t->first_non_finite(); at != safetensors::Tensor::npos)
      throw Error(fmt::format("checkpoint tensor '{}' holds a non-finite value ({}) at element {}", plain,
                              t->to_f32()[at], at));
    if (t->shape != view.shape)
      throw Error(fmt::format("checkpoint tensor '{}' has shape {}, the model expects {}", plain,
                              format_shape(t->shape), format_shape(view.shape)));
    plan.emplace_back(&view, t);
  }
  for (auto& [view, t] : plan) stream.copy(view->data, t->data.data(), view->bytes());
  stream.synchronize();
}

}  // namespace dp
