// dp/kernels/moments.h — the mean and variance pieces BatchNorm (per channel) and LayerNorm (per
// token) share: a mean stored from a row's sum, and the corrected two-pass variance from the
// deviations' plain and squared sums.
#pragma once

#include "dp/kernels/platform.h"

namespace dp::kernels {

// Two sums reduced in one pass (launch_row_reduce's T): value-initialised to zeros.
struct SumPair {
  float a, b;
  DP_HD SumPair operator+(const SumPair& o) const { return SumPair{a + o.a, b + o.b}; }
};

// Pass 1 of the statistics: a row's sum of x (a channel's over N*H*W, a token's over its
// features), times 1/M.
struct BnStoreMean {
  float* mean;
  float inv_count;  // 1/M
  DP_HD void operator()(index_t row, float sum) const { mean[row] = sum * inv_count; }
};

// The sum of squared deviations from the exact mean, from the deviations' plain (a) and squared (b)
// sums around a rounded mean over `count` values; rounding can push a constant set below 0.
DP_HD inline float centered_squares(SumPair s, float count) {
  const float centered = s.b - s.a * s.a / count;
  return centered < 0.0f ? 0.0f : centered;
}

}  // namespace dp::kernels
