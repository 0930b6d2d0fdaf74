// models.cpp — the reference MLP, ConvNet, ResNet-8 and torchvision's ResNet-18/34 as chains of
// dp::nn layers.
#include <array>
#include <cmath>
#include <fmt/format.h>
#include <numbers>
#include <optional>
#include <random>
#include <vector>

#include "dp/models/convnet.h"
#include "dp/models/gpt.h"
#include "dp/models/mlp.h"
#include "dp/models/registry.h"
#include "dp/models/resnet.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/error.h"
#include "model_layers.h"

namespace dp::models {

using namespace dp::nn;

namespace detail {

nn::Layers mlp_layers(const std::vector<int>& hidden, double dropout) {
  Layers layers;
  layers.push_back(make_flatten("flatten"));
  int in = 28 * 28;
  int index = 1;
  for (int h : hidden) {
    if (h < 1) throw InvalidArgument(fmt::format("MLP hidden sizes must be >= 1, got {}", h));
    layers.push_back(make_linear(fmt::format("fc{}", index), in, h));
    layers.push_back(make_relu(fmt::format("relu{}", index)));
    if (dropout > 0.0) layers.push_back(make_dropout(fmt::format("drop{}", index), dropout));
    in = h;
    ++index;
  }
  layers.push_back(make_linear(fmt::format("fc{}", index), in, 10));
  return layers;
}

nn::Layers convnet_layers() {
  Layers layers;
  int in = 1;
  for (int block = 1; block <= 2; ++block) {
    const int out = block == 1 ? 16 : 32;
    const std::string prefix = fmt::format("layer{}", block);
    layers.push_back(make_conv2d(prefix + ".0", in, out, 5, 1, 2));
    layers.push_back(make_batchnorm2d(prefix + ".1", out));
    layers.push_back(make_relu(prefix + ".2"));
    layers.push_back(make_maxpool2d(prefix + ".3", 2, 2));
    in = out;
  }
  layers.push_back(make_flatten("flatten"));
  layers.push_back(make_linear("fc", 7 * 7 * 32, 10));
  return layers;
}

}  // namespace detail

std::unique_ptr<Model> make_mlp(Device& device, const std::vector<int>& hidden, std::uint64_t seed, double dropout) {
  ModelArgs args;
  args.hidden = hidden;
  args.dropout = dropout;
  return model_spec("mlp").build(device, args, seed);
}

std::unique_ptr<Model> make_convnet(Device& device, std::uint64_t seed) {
  return model_spec("convnet").build(device, {}, seed);
}

namespace {

// torchvision's BasicBlock (expansion 1) named `name`: a downsample branch where the shape changes.
std::unique_ptr<Layer> basic_block(const std::string& name, int in, int out, int stride) {
  Layers body;
  body.push_back(make_conv2d("conv1", in, out, 3, stride, 1, false));
  body.push_back(make_batchnorm2d("bn1", out));
  body.push_back(make_relu("relu"));
  body.push_back(make_conv2d("conv2", out, out, 3, 1, 1, false));
  body.push_back(make_batchnorm2d("bn2", out));
  Layers shortcut;
  if (stride != 1 || in != out) {
    shortcut.push_back(make_conv2d("downsample.0", in, out, 1, stride, 0, false));
    shortcut.push_back(make_batchnorm2d("downsample.1", out));
  }
  return make_residual(name, std::move(body), std::move(shortcut));
}

// Re-initialises the parameters `std_of` gives a standard deviation with N(0, std^2) (0: zeros), in
// parameters() order; nullopt keeps a parameter as it is. Normals by Box-Muller from 24-bit uniforms of a seeded
// mt19937_64: the same values on every platform (std::normal_distribution's are the library's own). torch's generator
// differs, so the values do, not their distribution.
template <class StdOf>
void normal_init(Model& model, std::uint64_t seed, StdOf std_of) {
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ULL);
  const auto uniform = [&] { return (static_cast<double>(rng() >> 40) + 0.5) / 16777216.0; };  // (0, 1)
  const Stream stream = model.device().create_stream();
  for (const TensorRef& p : model.parameters()) {
    const std::optional<double> std_or = std_of(p);
    if (!std_or) continue;
    const double std = *std_or;
    std::vector<float> values(p.numel(), 0.0f);
    for (std::size_t i = 0; std > 0.0 && i < values.size(); i += 2) {
      const double r = std::sqrt(-2.0 * std::log(uniform())), angle = 2.0 * std::numbers::pi * uniform();
      values[i] = static_cast<float>(std * r * std::cos(angle));
      if (i + 1 < values.size()) values[i + 1] = static_cast<float>(std * r * std::sin(angle));
    }
    stream.copy(p.data, values.data(), p.bytes());
    stream.synchronize();
  }
}

}  // namespace

// torchvision's ResNet.__init__ re-initialises every convolution with
// kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, 2 / (out_channels * kh * kw)). Without
// it the 7x7 stem and 16 blocks of the default (fan-in uniform, a = sqrt(5)) init shrink the signal
// layer after layer.
void detail::torchvision_conv_init(Model& model, std::uint64_t seed) {
  normal_init(model, seed, [](const TensorRef& p) -> std::optional<double> {
    if (p.shape.size() != 4) return std::nullopt;  // the convolutions' weights: out x in x kh x kw
    return std::sqrt(2.0 / static_cast<double>(p.shape[0] * p.shape[2] * p.shape[3]));
  });
}

namespace detail {

nn::Layers basic_resnet_layers(const std::string& name, const std::array<int, 4>& blocks_per_stage, int num_classes,
                               int image_size) {
  if (num_classes < 1) throw InvalidArgument(fmt::format("{}: num_classes must be >= 1, got {}", name, num_classes));
  // Each of the five stride-2 stages (conv1, maxpool, layer2..4) maps a side h >= 1 to
  // (h - 1)/2 + 1 >= 1, so every positive size is a valid input; S <= 32 leaves layer4 1x1 planes.
  if (image_size < 1)
    throw InvalidArgument(fmt::format("{}: image_size must be >= 1 (inputs 3 x S x S), got {}", name, image_size));
  Layers layers;
  layers.push_back(make_conv2d("conv1", 3, 64, 7, 2, 3, false));
  layers.push_back(make_batchnorm2d("bn1", 64));
  layers.push_back(make_relu("relu"));
  layers.push_back(make_maxpool2d("maxpool", 3, 2, 1));
  int in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int width = 64 << stage;
    for (int block = 0; block < blocks_per_stage[stage]; ++block) {
      const int stride = stage > 0 && block == 0 ? 2 : 1;
      layers.push_back(basic_block(fmt::format("layer{}.{}", stage + 1, block), in, width, stride));
      in = width;
    }
  }
  layers.push_back(make_global_avgpool2d("avgpool"));
  layers.push_back(make_flatten("flatten"));
  layers.push_back(make_linear("fc", in, num_classes));
  return layers;
}

nn::Layers resnet8_layers() {
  Layers layers;
  layers.push_back(make_conv2d("conv1", 1, 16, 3, 1, 1, false));
  layers.push_back(make_batchnorm2d("bn1", 16));
  layers.push_back(make_relu("relu"));
  layers.push_back(basic_block("layer1.0", 16, 16, 1));
  layers.push_back(basic_block("layer2.0", 16, 32, 2));
  layers.push_back(basic_block("layer3.0", 32, 64, 2));
  layers.push_back(make_global_avgpool2d("avgpool"));
  layers.push_back(make_flatten("flatten"));
  layers.push_back(make_linear("fc", 64, 10));
  return layers;
}

}  // namespace detail

std::unique_ptr<Model> make_resnet18(Device& device, int num_classes, int image_size, std::uint64_t seed) {
  ModelArgs args;
  args.num_classes = num_classes;
  args.image_size = image_size;
  return model_spec("resnet18").build(device, args, seed);
}

std::unique_ptr<Model> make_resnet34(Device& device, int num_classes, int image_size, std::uint64_t seed) {
  ModelArgs args;
  args.num_classes = num_classes;
  args.image_size = image_size;
  return model_spec("resnet34").build(device, args, seed);
}

std::unique_ptr<Model> make_resnet8(Device& device, std::uint64_t seed) {
  return model_spec("resnet8").build(device, {}, seed);
}

std::unique_ptr<nn::Layer> gpt_block(const std::string& name, int width, int heads, double dropout, bool tanh_gelu,
                                     bool fused_attention) {
  Layers attn, mlp, branches;
  attn.push_back(make_layernorm("ln_1", width));
  attn.push_back(make_causal_self_attention("attn", width, heads, dropout, fused_attention));
  if (dropout > 0.0) attn.push_back(make_dropout("attn.resid_dropout", dropout));
  mlp.push_back(make_layernorm("ln_2", width));
  mlp.push_back(make_linear("mlp.c_fc", width, 4 * width));
  mlp.push_back(make_gelu("mlp.gelu", tanh_gelu));
  mlp.push_back(make_linear("mlp.c_proj", 4 * width, width));
  if (dropout > 0.0) mlp.push_back(make_dropout("mlp.dropout", dropout));
  // Unnamed residual branches with identity shortcuts and no ReLU: the Block's own names. nanoGPT's
  // `x = x + self.attn(...)` is an out-of-place add: under autocast the residual stream stays fp32.
  branches.push_back(make_residual("", std::move(attn), {}, false, ResidualAdd::promote));
  branches.push_back(make_residual("", std::move(mlp), {}, false, ResidualAdd::promote));
  return make_sequential(name, std::move(branches));
}

nn::Layers gpt_body(const GptConfig& c) {
  const auto positive = [](const char* field, int value) {
    if (value < 1) throw InvalidArgument(fmt::format("gpt: {} must be at least 1, got {}", field, value));
  };
  positive("vocab", c.vocab);
  positive("context", c.context);
  positive("layers", c.layers);
  positive("heads", c.heads);
  positive("width", c.width);
  if (c.vocab_rows != 0 && c.vocab_rows < c.vocab)
    throw InvalidArgument(
        fmt::format("gpt: the table's {} rows are fewer than the vocabulary's {}", c.vocab_rows, c.vocab));
  if (c.width % c.heads != 0)
    throw InvalidArgument(fmt::format("gpt: width {} is not a multiple of heads {}", c.width, c.heads));
  if (!(c.dropout >= 0.0 && c.dropout <= 1.0))
    throw InvalidArgument(fmt::format("gpt: dropout must be in [0, 1], got {}", c.dropout));
  Layers body;
  if (c.dropout > 0.0) body.push_back(make_dropout("transformer.drop", c.dropout));
  for (int i = 0; i < c.layers; ++i)
    body.push_back(
        gpt_block(fmt::format("transformer.h.{}", i), c.width, c.heads, c.dropout, c.tanh_gelu, c.fused_attention));
  body.push_back(make_layernorm("transformer.ln_f", c.width));
  return body;
}

namespace detail {

nn::Layers gpt_layers(const GptConfig& config) {
  Layers layers;
  layers.push_back(make_language_model(config.rows(), config.context, config.width, gpt_body(config), config.vocab));
  return layers;
}

}  // namespace detail

void detail::gpt_init(Model& model, const GptConfig& config, std::uint64_t seed) {
  const double residual_std = 0.02 / std::sqrt(2.0 * config.layers);
  normal_init(model, seed, [&](const TensorRef& p) -> std::optional<double> {
    if (p.shape.size() == 2) return p.name.ends_with(".c_proj.weight") ? residual_std : 0.02;
    if (p.name.find(".ln_") != std::string::npos) return std::nullopt;  // LayerNorms 1 and 0, as initialised
    return 0.0;                                                         // the Linears' biases
  });
}

std::unique_ptr<Model> make_gpt(Device& device, const GptConfig& config, std::uint64_t seed) {
  return model_spec("gpt").build(device, {.dropout = config.dropout, .gpt = config}, seed);
}

}  // namespace dp::models
