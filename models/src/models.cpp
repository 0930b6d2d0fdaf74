// models.cpp — the reference MLP, ConvNet and ResNet-8 as chains of dp::nn layers.
#include <fmt/format.h>

#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/error.h"

namespace dp::models {

using namespace dp::nn;

std::unique_ptr<Model> make_mlp(Device& device, const std::vector<int>& hidden, std::uint64_t seed, double dropout) {
  std::vector<std::unique_ptr<Layer>> layers;
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
  auto model =
      std::make_unique<SequentialModel>("mlp", device, std::move(layers), std::vector<std::int64_t>{1, 28, 28});
  model->initialize(seed);
  return model;
}

std::unique_ptr<Model> make_convnet(Device& device, std::uint64_t seed) {
  std::vector<std::unique_ptr<Layer>> layers;
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
  auto model =
      std::make_unique<SequentialModel>("convnet", device, std::move(layers), std::vector<std::int64_t>{1, 28, 28});
  model->initialize(seed);
  return model;
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

}  // namespace

std::unique_ptr<Model> make_resnet8(Device& device, std::uint64_t seed) {
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
  auto model =
      std::make_unique<SequentialModel>("resnet8", device, std::move(layers), std::vector<std::int64_t>{1, 28, 28});
  model->initialize(seed);
  return model;
}

}  // namespace dp::models
