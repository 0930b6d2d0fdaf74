// maxpool.h — MaxPool2d (PyTorch semantics: any kernel/stride/padding, padding = -inf, first maximum
// in window scan order wins, NaN propagates) with an argmax-based backward.
#pragma once

#include <cstdint>

#include "dp/device.h"
#include "kernels/platform.h"

namespace dp::kernels {

struct MaxPoolShape {
  int n = 0, c = 0, h = 0, w = 0;
  int kernel = 2, stride = 2, pad = 0;
  DP_HD int h_out() const { return (h + 2 * pad - kernel) / stride + 1; }
  DP_HD int w_out() const { return (w + 2 * pad - kernel) / stride + 1; }
};

// y (N, C, H_out, W_out); argmax holds, per output, the flat index h*W + w of the chosen input
// within its (n, c) plane.
void maxpool_forward(const Stream& stream, const MaxPoolShape& shape, const float* x, float* y, std::int32_t* argmax);

// dx (N, C, H, W) overwritten: each input receives the sum of dy over the outputs that chose it
// (a gather per input, so overlapping windows need no atomics).
void maxpool_backward(const Stream& stream, const MaxPoolShape& shape, const std::int32_t* argmax, const float* dy,
                      float* dx);

}  // namespace dp::kernels
