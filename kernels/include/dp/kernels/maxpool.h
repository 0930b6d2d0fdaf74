// dp/kernels/maxpool.h — MaxPool2d (PyTorch semantics: any kernel/stride/padding, padding = -inf, first maximum
// in window scan order wins, NaN propagates) with an argmax-based backward.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dp/kernels/platform.h"
#include "dp/kernels/pool_shape.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

using MaxPoolShape = Pool2dShape;

// y (N, C, H_out, W_out); argmax holds, per output, the flat index h*W + w of the chosen input
// within its (n, c) plane. As torch.nn.MaxPool2d (floor mode, dilation 1): kernel, stride >= 1,
// 0 <= pad <= kernel/2 and H + 2*pad >= kernel (likewise W), else InvalidArgument.
// NaN: PyTorch's test is `val > max || isnan(val)`, so a window holding NaN yields NaN and the
// argmax of its LAST NaN in scan order (a later NaN replaces an earlier one).
// x and y (and dy, dx below) of one storage type, fp32 or bf16 (storage.h).
void maxpool_forward(const Stream& stream, const MaxPoolShape& shape, In x, Out y, std::int32_t* argmax);

// dx (N, C, H, W) overwritten: each input receives the sum of dy over the outputs that chose it
// (a gather per input, so overlapping windows need no atomics).
void maxpool_backward(const Stream& stream, const MaxPoolShape& shape, const std::int32_t* argmax, In dy, Out dx);

// ------------------------------------------------------------------------------------------------
// functors

// Written as a self-comparison rather than isnan: one spelling for host and device compilers
// (dp builds without fast-math, so it is not folded away).
DP_HD inline bool is_nan(float v) { return v != v; }

// Output element i = ((n*C + c)*H_out + oh)*W_out + ow scans its window clipped to the input:
// padding never wins, exactly as -inf never beats PyTorch's -inf start (which also leaves an
// all -inf window pointing at its first real element, as here).
template <class T = float>
struct MaxPoolForward {
  MaxPoolShape s;
  const T* x;
  T* y;
  std::int32_t* argmax;
  // row = (n*C + c)*H_out + oh, one row of outputs (launch_2d): the divisions happen once per row.
  DP_HD void operator()(index_t row, index_t col) const {
    const int ho = s.h_out();
    const index_t nc = row / ho;
    window(x + nc * s.h * s.w, static_cast<int>(row - nc * ho), static_cast<int>(col), row * s.w_out() + col);
  }
  // The sim: planes and rows walked in order, no division per output. Outputs whose window lies
  // inside the columns go in runs of up to 64 that scan their windows in lockstep, in scan order,
  // starting, as window() does, from the first element of the (row-clipped) window: the same
  // comparisons per output, as selects over a run the compiler vectorises instead of a branch per
  // element that random data mispredicts. The rest go through window().
  void host_run(index_t rows, index_t cols) const {
    if (s.kernel == 2 && s.stride == 2 && s.pad == 0) {
      host_2x2(rows, static_cast<int>(cols));
      return;
    }
    constexpr int kRun = 64;
    const int ho = s.h_out(), wo = static_cast<int>(cols);
    int lo = 0;
    while (lo < wo && lo * s.stride - s.pad < 0) ++lo;
    int hi = lo;
    while (hi < wo && hi * s.stride - s.pad + s.kernel <= s.w) ++hi;
    float values[kRun];
    std::int32_t chosen[kRun];
    for (index_t row = 0, nc = 0; row < rows; ++nc)
      for (int oh = 0; oh < ho && row < rows; ++oh, ++row) {
        const T* in = x + nc * s.h * s.w;
        const index_t out = row * wo;
        for (int ow = 0; ow < lo; ++ow) window(in, oh, ow, out + ow);
        for (int ow = hi; ow < wo; ++ow) window(in, oh, ow, out + ow);
        const int h0 = oh * s.stride - s.pad < 0 ? 0 : oh * s.stride - s.pad;
        const int h1 = oh * s.stride - s.pad + s.kernel < s.h ? oh * s.stride - s.pad + s.kernel : s.h;
        for (int first = lo; first < hi; first += kRun) {
          const int m = hi - first < kRun ? hi - first : kRun;
          const int w0 = first * s.stride - s.pad;
          for (int q = 0; q < m; ++q) {
            chosen[q] = h0 * s.w + w0 + q * s.stride;
            values[q] = load(in, chosen[q]);
          }
          for (int ih = h0; ih < h1; ++ih)
            for (int kj = 0; kj < s.kernel; ++kj) {
              const int base = ih * s.w + w0 + kj;
              for (int q = 0; q < m; ++q) {
                const int at = base + q * s.stride;
                const float v = load(in, at);
                const bool take = (v > values[q]) | is_nan(v);
                values[q] = take ? v : values[q];
                chosen[q] = take ? at : chosen[q];
              }
            }
          for (int q = 0; q < m; ++q) {
            store(y, out + first + q, values[q]);
            argmax[out + first + q] = chosen[q];
          }
        }
      }
  }
  // The sim, for 2x2 windows that tile the input (stride 2, no padding: the usual pooling; every
  // window inside, none overlapping): each output reads its window unrolled, in window()'s order with
  // its comparisons (the first element, then every one, strict > or NaN). Several times faster than
  // the lockstep runs, whose stride-2 gathers the compiler does not vectorise.
  void host_2x2(index_t rows, int wo) const {
    const int ho = s.h_out(), w = s.w;
    for (index_t row = 0, nc = 0; row < rows; ++nc)
      for (int oh = 0; oh < ho && row < rows; ++oh, ++row) {
        const T* in = x + nc * s.h * w;
        T* out = y + row * wo;
        std::int32_t* chosen = argmax + row * wo;
        for (int ow = 0, at = 2 * oh * w; ow < wo; ++ow, at += 2) {
          int best = at;
          float value = load(in, at);
          const auto take = [&](int i) {
            const float v = load(in, i);
            const bool better = (v > value) | is_nan(v);
            value = better ? v : value;
            best = better ? i : best;
          };
          take(at);
          take(at + 1);
          take(at + w);
          take(at + w + 1);
          store(out, ow, value);
          chosen[ow] = best;
        }
      }
  }
  // Output i at (oh, ow) of the plane `in`.
  DP_HD void window(const T* in, int oh, int ow, index_t i) const {
    int h0 = oh * s.stride - s.pad, w0 = ow * s.stride - s.pad;
    const int h1 = h0 + s.kernel < s.h ? h0 + s.kernel : s.h, w1 = w0 + s.kernel < s.w ? w0 + s.kernel : s.w;
    if (h0 < 0) h0 = 0;
    if (w0 < 0) w0 = 0;
    int best = h0 * s.w + w0;
    float best_value = load(in, best);
    for (int ih = h0; ih < h1; ++ih)
      for (int iw = w0; iw < w1; ++iw) {
        const int at = ih * s.w + iw;
        const float v = load(in, at);
        // strict: the first of equal maxima stays. Selects, not a branch: on random data the
        // host mispredicted it about every other element.
        const bool take = (v > best_value) | is_nan(v);
        best_value = take ? v : best_value;
        best = take ? at : best;
      }
    store(y, i, best_value);
    argmax[i] = best;
  }
};

// Input element i = ((n*C + c)*H + ih)*W + iw sums dy over the outputs whose window covers it and
// chose it; 0 when none did (`0.0f + dy` also turns a -0 gradient into +0, as PyTorch's
// scatter-add into a zeroed gradient does). One launch, no zero fill, no atomics.
template <class T = float>
struct MaxPoolBackward {
  MaxPoolShape s;
  const std::int32_t* argmax;
  const T* dy;
  T* dx;
  DP_HD void operator()(index_t i) const {
    const int ho = s.h_out(), wo = s.w_out();
    const index_t plane = static_cast<index_t>(s.h) * s.w;
    const index_t nc = i / plane;
    const int at = static_cast<int>(i - nc * plane);
    const int ih = at / s.w, iw = at % s.w;
    const WindowRange rows = covering_windows(ih, s.kernel, s.stride, s.pad, ho);
    const WindowRange cols = covering_windows(iw, s.kernel, s.stride, s.pad, wo);
    const std::int32_t* chosen = argmax + nc * ho * wo;
    const T* grad = dy + nc * ho * wo;
    float sum = 0.0f;
    for (int oh = rows.first; oh < rows.last; ++oh)  // row-major over outputs: PyTorch's accumulation order
      for (int ow = cols.first; ow < cols.last; ++ow)
        if (chosen[oh * wo + ow] == at) sum += load(grad, oh * wo + ow);
    store(dx, i, sum);
  }
  // The sim: a scatter. Each input starts at 0 and receives dy of the outputs that chose it in the
  // outputs' row-major order: the gather's sum, term for term, in one pass over the outputs instead
  // of a window search per input. (An argmax outside its plane, which the forward never writes, is
  // skipped, as the gather never matches it.) A bf16 dx holds sums rounded once: where windows
  // overlap (an input may sum several terms) the gather runs instead.
  void host_run(index_t n) const {
    if constexpr (!std::is_same_v<T, float>) {
      if (s.stride < s.kernel) {
        for (index_t i = 0; i < n; ++i) (*this)(i);
        return;
      }
    }
    const index_t plane = static_cast<index_t>(s.h) * s.w, outputs = static_cast<index_t>(s.h_out()) * s.w_out();
    for (index_t i = 0; i < n; ++i) store(dx, i, 0.0f);
    for (index_t base = 0, out = 0; base < n; base += plane, out += outputs)
      for (index_t o = 0; o < outputs; ++o) {
        const std::int32_t at = argmax[out + o];
        if (at >= 0 && at < plane) store(dx, base + at, load(dx, base + at) + load(dy, out + o));
      }
  }
};

}  // namespace dp::kernels
