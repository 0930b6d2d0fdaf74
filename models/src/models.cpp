// models.cpp — the reference MLP and ConvNet as chains of layers.
#include <fmt/format.h>

#include "dp/error.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/nn/sequential.h"

namespace dp::models {

using namespace dp::nn;

std::unique_ptr<Model> make_mlp(Device& device, const std::vector<int>& hidden, std::uint64_t seed) {
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(make_flatten("flatten"));
  int in = 28 * 28;
  int index = 1;
  for (int h : hidden) {
    if (h < 1) throw InvalidArgument(fmt::format("MLP hidden sizes must be >= 1, got {}", h));
    layers.push_back(make_linear(fmt::format("fc{}", index), in, h));
    layers.push_back(make_relu(fmt::format("relu{}", index)));
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

}  // namespace dp::models
