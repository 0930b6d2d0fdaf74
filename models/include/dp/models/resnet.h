// dp/models/resnet.h — torchvision's ResNet-18 and ResNet-34, and a small ResNet-8 for 1x28x28
// inputs, all with torchvision's module names so that state dicts load either way.
// ResNet-18/34 (torchvision.models.resnet18/34(num_classes=K)): input 3xSxS; conv1 Conv2d(3,64,7,2,3,
// bias=False), bn1, ReLU, maxpool MaxPool2d(3,2,1); layer1..layer4 of [2,2,2,2] / [3,4,6,3]
// BasicBlocks of widths 64, 128, 256, 512, the first block of layers 2-4 with stride 2 and a
// downsample Conv2d(in,out,1,2,bias=False) + BatchNorm2d(out); avgpool AdaptiveAvgPool2d(1), flatten,
// fc Linear(512,K). Every stride-2 stage maps a side of h to (h-1)/2+1 >= 1, so any S >= 1 is valid
// (S = 224 ends at 7x7; S <= 32 at 1x1, where layer4's train-mode BatchNorms see one value per sample).
// tests/golden/make_resnet18_goldens.py pins ResNet-18.
// ResNet-8: conv1 Conv2d(1,16,3,1,1,bias=False), bn1, ReLU; layer1.0 BasicBlock(16->16); layer2.0
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

// Throw dp::InvalidArgument unless num_classes >= 1 and image_size >= 1. Initialised as dp
// initialises every model (PyTorch's layer defaults), not with torchvision's kaiming_normal_.
std::unique_ptr<Model> make_resnet18(Device& device, int num_classes, int image_size, std::uint64_t seed = 0);
std::unique_ptr<Model> make_resnet34(Device& device, int num_classes, int image_size, std::uint64_t seed = 0);

}  // namespace dp::models
