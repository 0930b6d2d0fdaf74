// registry.cpp — the reference models by name (dp/models/registry.h), each written once here: its
// arguments, layers, input shape and init, what make_* and the tools build, and the sizes and FLOPs
// its layers add up to.
#include "dp/models/registry.h"

#include <algorithm>
#include <array>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dp/models/gpt.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"
#include "model_layers.h"

namespace dp::models {
namespace {

std::vector<std::int64_t> grey_28x28(const ModelArgs&) { return {1, 28, 28}; }
std::vector<std::int64_t> rgb_square(const ModelArgs& args) { return {3, args.image_size, args.image_size}; }

std::vector<std::int64_t> tokens(const ModelArgs& args) { return {args.gpt.context}; }
// The GPT's configuration with the one dropout argument every model takes.
GptConfig gpt_config(const ModelArgs& args) {
  GptConfig config = args.gpt;
  config.dropout = args.dropout;
  return config;
}

// A function's static: the tools' own static tables may ask for it while they are initialised.
const std::array<ModelSpec, 6>& models() {
  static const std::array<ModelSpec, 6> specs = {{
      {"mlp",
       "Flatten, then Linear+ReLU per --hidden size (optional Dropout), Linear to 10 classes; 1x28x28 inputs",
       {ModelArg::hidden, ModelArg::dropout},
       [](const ModelArgs& a) { return detail::mlp_layers(a.hidden, a.dropout); },
       grey_28x28},
      {"convnet",
       "two Conv2d(5x5)+BatchNorm+ReLU+MaxPool blocks and a Linear to 10 classes; 1x28x28 inputs",
       {},
       [](const ModelArgs&) { return detail::convnet_layers(); },
       grey_28x28},
      {"resnet8",
       "a ResNet of three BasicBlocks (16, 32, 64 channels), 10 classes; 1x28x28 inputs",
       {},
       [](const ModelArgs&) { return detail::resnet8_layers(); },
       grey_28x28},
      {"resnet18",
       "torchvision.models.resnet18(num_classes=K); 3xSxS RGB inputs",
       {ModelArg::num_classes, ModelArg::image_size},
       [](const ModelArgs& a) {
         return detail::basic_resnet_layers("resnet18", {2, 2, 2, 2}, a.num_classes, a.image_size);
       },
       rgb_square,
       [](Model& m, const ModelArgs&, std::uint64_t seed) { detail::torchvision_conv_init(m, seed); }},
      {"resnet34",
       "torchvision.models.resnet34(num_classes=K); 3xSxS RGB inputs",
       {ModelArg::num_classes, ModelArg::image_size},
       [](const ModelArgs& a) {
         return detail::basic_resnet_layers("resnet34", {3, 4, 6, 3}, a.num_classes, a.image_size);
       },
       rgb_square,
       [](Model& m, const ModelArgs&, std::uint64_t seed) { detail::torchvision_conv_init(m, seed); }},
      {"gpt",
       "nanoGPT's GPT (GPT-2 init, tied lm_head) on byte tokens: --context, --layers, --heads, --width, --dropout",
       {ModelArg::gpt, ModelArg::dropout},
       [](const ModelArgs& a) { return detail::gpt_layers(gpt_config(a)); },
       tokens,
       [](Model& m, const ModelArgs& a, std::uint64_t seed) { detail::gpt_init(m, gpt_config(a), seed); }},
  }};
  return specs;
}

// One sample of (C), (C, H) or (C, H, W), as SequentialModel reads its input shape.
nn::ActShape input_act_shape(const std::vector<std::int64_t>& input) {
  const auto at = [&](std::size_t i) { return i < input.size() ? static_cast<int>(input[i]) : 1; };
  return {1, at(0), at(1), at(2)};
}

nn::ActShape output_act_shape(const ModelSpec::LayersFn layers, const ModelArgs& args,
                              const std::vector<std::int64_t>& input) {
  nn::ActShape shape = input_act_shape(input);
  for (const auto& layer : layers(args)) shape = layer->output_shape(shape);
  return shape;
}

std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, std::string_view model) {
  std::uint64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum))
    throw InvalidArgument(fmt::format("{}: the parameter count does not fit in 64 bits", model));
  return sum;
}

}  // namespace

std::unique_ptr<Model> ModelSpec::build(Device& device, const ModelArgs& args, std::uint64_t seed) const {
  auto model = std::make_unique<nn::SequentialModel>(std::string(name_), device, layers_(args), input_shape_(args));
  model->initialize(seed);
  if (init_) init_(*model, args, seed);
  return model;
}

bool ModelSpec::takes(ModelArg arg) const { return std::find(takes_.begin(), takes_.end(), arg) != takes_.end(); }

std::uint64_t ModelSpec::input_elements(const ModelArgs& args) const {
  return static_cast<std::uint64_t>(numel(input_shape(args)));
}

int ModelSpec::num_classes(const ModelArgs& args) const {
  return static_cast<int>(output_act_shape(layers_, args, input_shape(args)).row_features());
}

int ModelSpec::targets_per_sample(const ModelArgs& args) const {
  return output_act_shape(layers_, args, input_shape(args)).rows();
}

std::uint64_t ModelSpec::param_count(const ModelArgs& args) const {
  std::uint64_t count = 0;
  for (const auto& layer : layers_(args))
    for (const nn::TensorDecl& p : layer->params())
      count = checked_add(count, static_cast<std::uint64_t>(numel(p.shape)), name_);
  return count;
}

double ModelSpec::gemm_flops_per_sample(const ModelArgs& args) const {
  nn::ActShape shape = input_act_shape(input_shape(args));
  double total = 0, first = -1;
  for (const auto& layer : layers_(args)) {
    const auto multiply_adds = static_cast<double>(layer->multiply_adds(shape));
    if (first < 0 && multiply_adds > 0) first = static_cast<double>(layer->first_layer_skipped_multiply_adds(shape));
    total += multiply_adds;
    shape = layer->output_shape(shape);
  }
  return 2.0 * (3.0 * total - std::max(first, 0.0));
}

std::span<const ModelSpec> all_models() { return models(); }

const ModelSpec* find_model(std::string_view name) {
  for (const ModelSpec& spec : models())
    if (spec.name() == name) return &spec;
  return nullptr;
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const ModelSpec& spec : models()) names.emplace_back(spec.name());
  return names;
}

const ModelSpec& model_spec(std::string_view name) {
  if (const ModelSpec* spec = find_model(name)) return *spec;
  throw InvalidArgument(fmt::format("unknown model '{}' (expected {})", name, fmt::join(model_names(), ", ")));
}

}  // namespace dp::models
