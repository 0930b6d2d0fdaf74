// checkpoint.cpp — state dicts between models and safetensors files.
#include "dp/io/checkpoint.h"

#include <cstdint>
#include <fmt/format.h>
#include <set>
#include <vector>

#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp {
namespace {

std::vector<TensorRef> state_views(const Model& model) {
  auto views = model.parameters();
  for (auto& b : model.buffers()) views.push_back(b);
  return views;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// What no training leaves in a buffer, so a file holding it was made or edited by hand: a negative
// running variance (BatchNorm divides by its square root in evaluation) or a negative count.
void check_buffer_values(const std::string& name, const safetensors::Tensor& t) {
  if (ends_with(name, "running_var") && t.dtype == "F32") {
    const std::vector<float> values = t.to_f32();
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!(values[i] >= 0.0f))
        throw Error(
            fmt::format("checkpoint tensor '{}' holds {} at element {}: an invalid state (a running variance "
                        "must be >= 0 and finite)",
                        name, values[i], i));
  }
  if (ends_with(name, "num_batches_tracked") && t.dtype == "I64")
    for (const std::int64_t count : t.to_i64())
      if (count < 0)
        throw Error(fmt::format("checkpoint tensor '{}' holds {}: an invalid state (a count of batches must be >= 0)",
                                name, count));
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
  for (const auto& [alias, name] : model.aliases()) {
    safetensors::Tensor copy = file.at(name);
    file.add(alias, std::move(copy));
  }
  return file;
}

StateDictKeys load_state_dict(Model& model, const Stream& stream, const safetensors::File& file,
                              const std::string& prefix, bool strict) {
  // Validate everything first, so a bad file leaves the model untouched.
  StateDictKeys keys;
  std::vector<std::pair<const TensorRef*, const safetensors::Tensor*>> plan;
  std::set<std::string> used;
  const auto views = state_views(model);
  const auto aliases = model.aliases();
  // The file's name for a model name: plain or under "module.", or "" when it has neither.
  const auto find = [&](const std::string& name) {
    const std::string plain = prefix + name, wrapped = prefix + "module." + name;
    if (file.has(plain)) return plain;
    if (file.has(wrapped)) {
      keys.module_prefix = true;
      return wrapped;
    }
    return std::string();
  };
  for (const TensorRef& view : views) {
    const std::string plain = prefix + view.name;
    std::string name = find(view.name);
    // A tied parameter under its alias alone (a file written by torch from another module's view).
    for (const auto& [alias, tied] : aliases)
      if (name.empty() && tied == view.name) name = find(alias);
    if (name.empty()) {
      keys.missing.push_back(view.name);
      continue;
    }
    used.insert(name);
    const safetensors::Tensor* t = &file.tensors.at(name);
    // torch's state dict holds a tied tensor under each name: the copies must be the same tensor.
    for (const auto& [alias, tied] : aliases) {
      if (tied != view.name) continue;
      const std::string other = find(alias);
      if (other.empty() || other == name) continue;
      used.insert(other);
      const safetensors::Tensor& copy = file.tensors.at(other);
      if (copy.dtype != t->dtype || copy.shape != t->shape || copy.data != t->data)
        throw Error(
            fmt::format("checkpoint tensors '{}' and '{}' differ, but the model ties them (one tensor)", name, other));
    }
    if (t->dtype != dtype_name(view.dtype))
      throw Error(fmt::format("checkpoint tensor '{}' has dtype {}, the model expects {}", plain, t->dtype,
                              dtype_name(view.dtype)));
    if (const std::size_t at = t->first_non_finite(); at != safetensors::Tensor::npos)
      throw Error(fmt::format("checkpoint tensor '{}' holds a non-finite value ({}) at element {}", plain,
                              t->to_f32()[at], at));
    if (t->shape != view.shape)
      throw Error(fmt::format("checkpoint tensor '{}' has shape {}, the model expects {}", plain,
                              format_shape(t->shape), format_shape(view.shape)));
    check_buffer_values(plain, *t);
    plan.emplace_back(&view, t);
  }
  for (const auto& [name, tensor] : file.tensors) {
    if (name.compare(0, prefix.size(), prefix) != 0 || used.count(name)) continue;
    if (name.compare(prefix.size(), 10, "optimizer.") == 0) continue;  // a training checkpoint's own state
    keys.unexpected.push_back(name.substr(prefix.size()));
  }
  if (strict && !keys.missing.empty())
    throw Error(fmt::format("checkpoint has no tensor '{}'{}", prefix + keys.missing.front(),
                            keys.missing.size() > 1 ? fmt::format(" (and {} more)", keys.missing.size() - 1) : ""));
  if (strict && !keys.unexpected.empty())
    throw Error(
        fmt::format("checkpoint tensor '{}' is not the model's (unexpected key{}; load it non-strictly to skip "
                    "what does not match)",
                    prefix + keys.unexpected.front(),
                    keys.unexpected.size() > 1 ? fmt::format(", and {} more", keys.unexpected.size() - 1) : ""));
  for (auto& [view, t] : plan) stream.copy(view->data, t->data.data(), view->bytes());
  stream.synchronize();
  return keys;
}

}  // namespace dp
