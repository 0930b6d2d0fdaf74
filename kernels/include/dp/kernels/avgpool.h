// dp/kernels/avgpool.h — AvgPool2d (PyTorch semantics: floor mode, count_include_pad=True) and the global
// average pool AdaptiveAvgPool2d(1), forward and backward, with torch 1.13's CPU roundings.
#pragma once

#include "dp/kernels/platform.h"
#include "dp/kernels/pool_shape.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

using AvgPoolShape = Pool2dShape;

// y (N, C, H_out, W_out): each window's mean, padding counted as zeros (count_include_pad=True).
// As torch.nn.AvgPool2d (floor mode): kernel, stride >= 1, 0 <= pad <= kernel/2 and
// H + 2*pad >= kernel (likewise W), else InvalidArgument.
// torch's divisor is the window clipped to the padded input; in floor mode with pad <= kernel/2
// no window reaches past the padding, so it is always kernel*kernel. The sum runs over the
// window's real inputs in row-major order from 0, then is divided, as torch's CPU kernel does
// (cpu_avg_pool): the same bits as torch.
// Every entry point's x and y (dy and dx) of one storage type, fp32 or bf16 (storage.h).
void avgpool_forward(const Stream& stream, const AvgPoolShape& shape, In x, Out y);

// dx (N, C, H, W) overwritten: each input sums dy / (kernel*kernel) over the windows covering it,
// in row-major order of the windows, the order in which torch's backward scatters into a zeroed
// gradient: the same bits, as a gather per input (no atomics).
void avgpool_backward(const Stream& stream, const AvgPoolShape& shape, In dy, Out dx);

// AdaptiveAvgPool2d(1): y (N, C) = the sum of each plane of x (N, C, hw), divided by hw.
// n, c >= 0 and hw >= 1, else InvalidArgument. torch computes this as x.mean((-1, -2)): a sum
// then one division. Its CPU sum is a vectorised cascade whose order depends on the SIMD width it
// dispatches to; here one thread sums its plane in order, identical on sim and cuda. Either order
// is within hw * 2^-24 * mean|x| of the exact mean (at worst; a few ulp in practice).
void global_avgpool_forward(const Stream& stream, int n, int c, int hw, In x, Out y);

// dx (N, C, hw) = dy / hw over each plane: torch's mean backward (grad expanded, divided by hw),
// the same bits.
void global_avgpool_backward(const Stream& stream, int n, int c, int hw, In dy, Out dx);

// ------------------------------------------------------------------------------------------------
// functors

// Output element ((n*C + c)*H_out + oh)*W_out + ow, one row of outputs per launch_2d row.
template <class T = float>
struct AvgPoolForward {
  AvgPoolShape s;
  const T* x;
  T* y;
  DP_HD void operator()(index_t row, index_t col) const {
    const int ho = s.h_out();
    const index_t nc = row / ho;
    const int oh = static_cast<int>(row - nc * ho), ow = static_cast<int>(col);
    const T* in = x + nc * s.h * s.w;
    int h0 = oh * s.stride - s.pad, w0 = ow * s.stride - s.pad;
    const int h1 = h0 + s.kernel < s.h ? h0 + s.kernel : s.h, w1 = w0 + s.kernel < s.w ? w0 + s.kernel : s.w;
    if (h0 < 0) h0 = 0;
    if (w0 < 0) w0 = 0;
    float sum = 0.0f;
    for (int ih = h0; ih < h1; ++ih)
      for (int iw = w0; iw < w1; ++iw) sum += load(in, ih * s.w + iw);
    // torch zero-fills the output and adds the mean into it: `0.0f +` makes an underflowed -0 +0.
    store(y, row * s.w_out() + col, 0.0f + sum / static_cast<float>(s.kernel * s.kernel));
  }
};

// Input element ((n*C + c)*H + ih)*W + iw, one input row per launch_2d row.
template <class T = float>
struct AvgPoolBackward {
  AvgPoolShape s;
  const T* dy;
  T* dx;
  DP_HD void operator()(index_t row, index_t col) const {
    const int ho = s.h_out(), wo = s.w_out();
    const index_t nc = row / s.h;
    const int ih = static_cast<int>(row - nc * s.h), iw = static_cast<int>(col);
    const WindowRange rows = covering_windows(ih, s.kernel, s.stride, s.pad, ho);
    const WindowRange cols = covering_windows(iw, s.kernel, s.stride, s.pad, wo);
    const T* grad = dy + nc * ho * wo;
    const float divisor = static_cast<float>(s.kernel * s.kernel);
    float sum = 0.0f;  // torch's zeroed gradient, then one addition per window
    for (int oh = rows.first; oh < rows.last; ++oh)
      for (int ow = cols.first; ow < cols.last; ++ow) sum += load(grad, oh * wo + ow) / divisor;
    store(dx, row * s.w + col, sum);
  }
};

// One thread per (n, c) plane: a short plane (49 values for a 7x7 map) is summed serially, and
// the order is the same on every backend.
template <class T = float>
struct GlobalAvgPoolForward {
  index_t hw;
  const T* x;
  T* y;
  DP_HD void operator()(index_t plane) const {
    const T* in = x + plane * hw;
    float sum = 0.0f;
    for (index_t k = 0; k < hw; ++k) sum += load(in, k);
    store(y, plane, sum / static_cast<float>(hw));
  }
};

// row = plane, col = position within it.
template <class T = float>
struct GlobalAvgPoolBackward {
  index_t hw;
  const T* dy;
  T* dx;
  DP_HD void operator()(index_t row, index_t col) const {
    store(dx, row * hw + col, load(dy, row) / static_cast<float>(hw));
  }
};

}  // namespace dp::kernels
