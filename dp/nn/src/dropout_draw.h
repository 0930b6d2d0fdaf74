// dropout_draw.h — what a stochastic layer's masks are drawn from (dp/kernels/dropout.h's key): the
// run's seed, the layer's full name and the step, and the element of the step's batch a batch
// starts at, so every replica and DataParallel chunk draws the bits of one device on the whole batch.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "dp/kernels/dropout.h"
#include "dp/nn/layers.h"

namespace dp::nn::detail {

// The key of this step's masks for the layer `name`, and the index of the batch's first element
// (`per_sample` elements a sample) in the step's batch.
std::pair<kernels::DropoutKey, std::uint64_t> dropout_draw(const LayerContext& ctx, const std::string& name,
                                                           std::int64_t per_sample);

}  // namespace dp::nn::detail
