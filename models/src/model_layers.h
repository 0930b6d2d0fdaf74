// model_layers.h — the reference models' layers, built without a device: what make_* hand to a
// SequentialModel, and what the registry counts parameters and multiply-adds of.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dp/models/gpt.h"
#include "dp/nn/layers.h"
#include "dp/nn/model.h"

namespace dp::models::detail {

nn::Layers mlp_layers(const std::vector<int>& hidden, double dropout);
nn::Layers convnet_layers();
nn::Layers resnet8_layers();
// torchvision's ResNet of BasicBlocks, `blocks_per_stage` in layer1..layer4; `name` for messages.
nn::Layers basic_resnet_layers(const std::string& name, const std::array<int, 4>& blocks_per_stage, int num_classes,
                               int image_size);
// The GPT as one language-model layer (make_gpt's, without a device).
nn::Layers gpt_layers(const GptConfig& config);

// torchvision's ResNet.__init__: every convolution re-initialised with kaiming_normal_(mode="fan_out").
void torchvision_conv_init(Model& model, std::uint64_t seed);
// nanoGPT's _init_weights: N(0, 0.02) weights, the residual projections' scaled by 1/sqrt(2 layers),
// zero biases.
void gpt_init(Model& model, const GptConfig& config, std::uint64_t seed);

}  // namespace dp::models::detail
