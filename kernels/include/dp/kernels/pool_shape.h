// dp/kernels/pool_shape.h — the shape of a 2-d pooling layer (MaxPool2d, AvgPool2d: a square window, one stride
// and one padding for both axes, floor mode) and the windows that cover one input position.
#pragma once

#include "dp/kernels/platform.h"

namespace dp::kernels {

struct Pool2dShape {
  int n = 0, c = 0, h = 0, w = 0;
  int kernel = 2, stride = 2, pad = 0;
  DP_HD int h_out() const { return (h + 2 * pad - kernel) / stride + 1; }
  DP_HD int w_out() const { return (w + 2 * pad - kernel) / stride + 1; }
};

// Outputs [first, last) along one axis whose window covers input position `at`: window o spans
// o*stride - pad .. o*stride - pad + kernel - 1. Empty (first >= last) when the stride skips `at`.
struct WindowRange {
  int first, last;
};
DP_HD inline WindowRange covering_windows(int at, int kernel, int stride, int pad, int outputs) {
  // First: ceil((at + pad - kernel + 1) / stride), clamped at 0 before dividing (integer division
  // truncates toward zero for negatives).
  const int lo = at + pad - kernel + 1;
  const int first = lo <= 0 ? 0 : (lo + stride - 1) / stride;
  const int after_last = (at + pad) / stride + 1;
  return {first, after_last < outputs ? after_last : outputs};
}

}  // namespace dp::kernels
