// models.cpp — the reference MLP, ConvNet, ResNet-8 and torchvision's ResNet-18/34 as chains of
// dp::nn layers.
#include <array>
#include <cmath>
#include <fmt/format.h>
#include <numbers>
#include <random>
#include <vector>

#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
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

namespace {

// A SequentialModel of `layers` on `device`, initialised from `seed`.
std::unique_ptr<SequentialModel> initialized(const std::string& name, Device& device, Layers layers,
                                             std::vector<std::int64_t> input_shape, std::uint64_t seed) {
  auto model = std::make_unique<SequentialModel>(name, device, std::move(layers), std::move(input_shape));
  model->initialize(seed);
  return model;
}

}  // namespace

std::unique_ptr<Model> make_mlp(Device& device, const std::vector<int>& hidden, std::uint64_t seed, double dropout) {
  return initialized("mlp", device, detail::mlp_layers(hidden, dropout), {1, 28, 28}, seed);
}

std::unique_ptr<Model> make_convnet(Device& device, std::uint64_t seed) {
  return initialized("convnet", device, detail::convnet_layers(), {1, 28, 28}, seed);
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

// torchvision's ResNet.__init__ re-initialises every convolution with
// kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, 2 / (out_channels * kh * kw)). Without
// it the 7x7 stem and 16 blocks of the default (fan-in uniform, a = sqrt(5)) init shrink the signal
// layer after layer. Normals by Box-Muller from 24-bit uniforms of a seeded mt19937_64: the same
// values on every platform (std::normal_distribution's are the library's own). torch's generator
// differs, so the values do, not their distribution.
void torchvision_conv_init(Model& model, std::uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ULL);
  const auto uniform = [&] { return (static_cast<double>(rng() >> 40) + 0.5) / 16777216.0; };  // (0, 1)
  const Stream stream = model.device().create_stream();
  for (const TensorRef& p : model.parameters()) {
    if (p.shape.size() != 4) continue;  // the convolutions' weights: out x in x kh x kw
    const double std = std::sqrt(2.0 / static_cast<double>(p.shape[0] * p.shape[2] * p.shape[3]));
    std::vector<float> values(p.numel());
    for (std::size_t i = 0; i < values.size(); i += 2) {
      const double r = std::sqrt(-2.0 * std::log(uniform())), angle = 2.0 * std::numbers::pi * uniform();
      values[i] = static_cast<float>(std * r * std::cos(angle));
      if (i + 1 < values.size()) values[i + 1] = static_cast<float>(std * r * std::sin(angle));
    }
    stream.copy(p.data, values.data(), p.bytes());
    stream.synchronize();
  }
}

}  // namespace

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

namespace {

std::unique_ptr<Model> make_basic_resnet(const std::string& name, Device& device,
                                         const std::array<int, 4>& blocks_per_stage, int num_classes, int image_size,
                                         std::uint64_t seed) {
  auto model = initialized(name, device, detail::basic_resnet_layers(name, blocks_per_stage, num_classes, image_size),
                           {3, image_size, image_size}, seed);
  torchvision_conv_init(*model, seed);
  return model;
}

}  // namespace

std::unique_ptr<Model> make_resnet18(Device& device, int num_classes, int image_size, std::uint64_t seed) {
  return make_basic_resnet("resnet18", device, {2, 2, 2, 2}, num_classes, image_size, seed);
}

std::unique_ptr<Model> make_resnet34(Device& device, int num_classes, int image_size, std::uint64_t seed) {
  return make_basic_resnet("resnet34", device, {3, 4, 6, 3}, num_classes, image_size, seed);
}

std::unique_ptr<Model> make_resnet8(Device& device, std::uint64_t seed) {
  return initialized("resnet8", device, detail::resnet8_layers(), {1, 28, 28}, seed);
}

}  // namespace dp::models
