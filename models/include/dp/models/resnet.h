// dp/models/resnet.h — ResNet-8 for 1x28x28 inputs, with torchvision's module names:
// conv1 Conv2d(1,16,3,1,1,bias=False), bn1, ReLU; layer1.0 BasicBlock(16->16); layer2.0
// BasicBlock(16->32, stride 2, downsample Conv2d(16,32,1,2,bias=False) + BatchNorm2d(32));
// layer3.0 BasicBlock(32->64, stride 2, likewise); avgpool AdaptiveAvgPool2d(1); fc Linear(64,10).
// A BasicBlock: conv1 3x3 (stride s, pad 1, no bias), bn1, ReLU, conv2 3x3 (pad 1, no bias), bn2,
// + shortcut, ReLU. State-dict names: conv1.weight, layer2.0.downsample.0.weight, ... — a
// checkpoint loads into torchvision.models.resnet's BasicBlock tree (tests/golden/make_resnet_goldens.py).
#pragma once

#include <cstdint>
#include <memory>

#include "dp/nn/model.h"

namespace dp::models {

std::unique_ptr<Model> make_resnet8(Device& device, std::uint64_t seed = 0);

}  // namespace dp::models
