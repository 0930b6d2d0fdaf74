// dp/models/convnet.h — the reference ConvNet (the seeds' MNIST model):
// layer1 = Conv2d(1,16,5,1,2) BatchNorm2d(16) ReLU MaxPool2d(2,2); layer2 = Conv2d(16,32,5,1,2)
// BatchNorm2d(32) ReLU MaxPool2d(2,2); fc = Linear(7*7*32, 10). PyTorch names: layer1.0.weight, ...
#pragma once

#include <cstdint>
#include <memory>

#include "dp/nn/model.h"

namespace dp::models {

std::unique_ptr<Model> make_convnet(Device& device, std::uint64_t seed = 0);

}  // namespace dp::models
