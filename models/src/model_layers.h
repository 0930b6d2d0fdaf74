// model_layers.h — the reference models' layers, built without a device: what make_* hand to a
// SequentialModel, and what the registry counts parameters and multiply-adds of.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "dp/models/gpt.h"
#include "dp/nn/layers.h"

namespace dp::models::detail {

nn::Layers mlp_layers(const std::vector<int>& hidden, double dropout);
nn::Layers convnet_layers();
nn::Layers resnet8_layers();
// torchvision's ResNet of BasicBlocks, `blocks_per_stage` in layer1..layer4; `name` for messages.
nn::Layers basic_resnet_layers(const std::string& name, const std::array<int, 4>& blocks_per_stage, int num_classes,
                               int image_size);
// The GPT as one language-model layer (make_gpt's, without a device).
nn::Layers gpt_layers(const GptConfig& config);

}  // namespace dp::models::detail
