// dp/kernels/elementwise.h — per-element arithmetic, written once for host and device.
// Each functor holds raw pointers of one device and computes element i.
#pragma once

#include <cmath>

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/bfloat16.h"

namespace dp::kernels {

struct Fill {
  float* x;
  float value;
  DP_HD void operator()(index_t i) const { x[i] = value; }
};

// y = x (fp32 or bf16 bits alike)
template <class T = float>
struct Copy {
  const T* x;
  T* y;
  DP_HD void operator()(index_t i) const { y[i] = x[i]; }
};

// y = alpha * x + y
struct Axpy {
  float alpha;
  const float* x;
  float* y;
  DP_HD void operator()(index_t i) const { y[i] = alpha * x[i] + y[i]; }
};

// x = alpha * x
struct Scale {
  float alpha;
  float* x;
  DP_HD void operator()(index_t i) const { x[i] = alpha * x[i]; }
};

// y = bf16(bf16(x) * scale): a gradient bucket compressed as torch's bf16_compress_hook compresses it
// (`buffer.to(torch.bfloat16).div_(world_size)`, which CUDA computes as a product with the fp32
// reciprocal of the world size, rounded to bf16 again).
struct ToBf16Scaled {
  const float* x;
  float scale;
  std::uint16_t* y;
  DP_HD void operator()(index_t i) const {
    y[i] = bf16_from_float(mul_unfused(bf16_to_float(bf16_from_float(x[i])), scale));
  }
};

// y = float(x): the hook's decompression (`bucket.buffer().copy_(bf16 result)`), exact.
struct FromBf16 {
  const std::uint16_t* x;
  float* y;
  DP_HD void operator()(index_t i) const { y[i] = bf16_to_float(x[i]); }
};

// y = bf16(x), as bits: an activation stored by autocast (round to nearest even).
struct ToBf16 {
  const float* x;
  std::uint16_t* y;
  DP_HD void operator()(index_t i) const { y[i] = bf16_from_float(x[i]); }
};

// y = float(bf16(x)): x rounded to a bf16 value kept in fp32 (autocast's cast of a weight or of an
// fp32 input before a Linear or Conv2d).
struct RoundToBf16 {
  const float* x;
  float* y;
  DP_HD void operator()(index_t i) const { y[i] = bf16_to_float(bf16_from_float(x[i])); }
};

// y = float(bf16(x)) (+ y when accumulating): an autocast layer's bf16 parameter gradient widened
// into the fp32 gradient buffer, as the backward of autocast's fp32 -> bf16 cast accumulates it. x
// fp32 (rounded here) or bf16 storage (a GEMM's rounded output: rounding it again changes nothing).
template <class T = float>
struct AddBf16Rounded {
  const T* x;
  float* y;
  bool accumulate;
  DP_HD void operator()(index_t i) const {
    const float g = bf16_to_float(bf16_from_float(load(x, i)));
    y[i] = accumulate ? y[i] + g : g;
  }
};

// out = a + b (each operand fp32 or bf16 bits: the fp32 sum, rounded once where out is bf16)
template <class A = float, class B = float, class O = float>
struct Add {
  const A* a;
  const B* b;
  O* out;
  DP_HD void operator()(index_t i) const { store(out, i, load(a, i) + load(b, i)); }
};

// torch.relu: NaN stays NaN (`x > 0 ? x : 0` would launder it to 0, hiding a diverged model from
// the loss), and -0 becomes +0.
DP_HD inline float relu(float v) { return v <= 0.0f ? 0.0f : v; }
template <class T = float>
struct ReluForward {
  const T* x;
  T* y;
  DP_HD void operator()(index_t i) const { store(y, i, relu(load(x, i))); }
};

// Add, then ReLU on the rounded sum: the two kernels' bits in one pass (bf16: the sum rounded
// once, ReLU of a bf16 value is one).
template <class A = float, class B = float, class O = float>
struct AddRelu {
  const A* a;
  const B* b;
  O* out;
  DP_HD void operator()(index_t i) const {
    const float sum = load(a, i) + load(b, i);
    store(out, i, relu(sum));
  }
};

// The gradient through ReLU at output (or input) y; g is read unconditionally so the host compiler
// can vectorise the select.
DP_HD inline float relu_grad(float y, float g) { return y <= 0.0f ? 0.0f : g; }

// PyTorch's threshold_backward(grad, result, 0): `result <= 0 ? 0 : grad`, so the gradient at
// exactly 0 is 0 and at NaN passes through (as torch does).
template <class T = float>
struct ReluBackward {
  const T* y;  // the forward output (or input: same sign test)
  const T* dy;
  T* dx;
  DP_HD void operator()(index_t i) const { store(dx, i, relu_grad(load(y, i), load(dy, i))); }
};

// Element j in [0, N*H*W) of channel `channel`: a channel is N planes of H*W, C planes apart.
// Every term of a per-channel reduction splits j by H*W, and every element of a per-plane launch
// finds its channel from the plane's index n*C + c: with FastDivmod while the dividend fits in an
// int (any practical tensor; the test is uniform across a launch), a 64-bit divide only beyond.
struct ChannelElement {
  index_t channels, plane;  // C, H*W
  FastDivmod by_plane, by_channels;
  ChannelElement(index_t channels_, index_t plane_)
      : channels(channels_), plane(plane_), by_plane(divisor(plane_)), by_channels(divisor(channels_)) {}
  DP_HD index_t operator()(index_t channel, index_t j) const {
    const index_t n = j <= kIntMax && plane <= kIntMax ? by_plane.div(static_cast<int>(j)) : j / plane;
    return (n * channels + channel) * plane + (j - n * plane);
  }
  // c of the plane n*C + c.
  DP_HD index_t channel_of(index_t plane_index) const {
    if (plane_index <= kIntMax && channels <= kIntMax) {
      int c = 0;
      by_channels.divmod(static_cast<int>(plane_index), c);
      return c;
    }
    return plane_index % channels;
  }
  // The sim: fn(k, (*this)(channel, j + k)) for k in [0, count), in order, walking the channel's
  // planes instead of dividing per element.
  template <class Fn>
  void host_walk(index_t channel, index_t j, index_t count, Fn&& fn) const {
    index_t n = j / plane, at = j - n * plane;
    for (index_t k = 0; k < count; ++n, at = 0) {
      const index_t run = plane - at < count - k ? plane - at : count - k;
      const index_t base = (n * channels + channel) * plane + at;
      for (index_t q = 0; q < run; ++q) fn(k + q, base + q);
      k += run;
    }
  }
  static constexpr index_t kIntMax = 2147483647;
  // A FastDivmod where the extent fits in an int (else unused: the 64-bit path runs).
  static FastDivmod divisor(index_t d) { return FastDivmod(d >= 1 && d <= kIntMax ? static_cast<int>(d) : 1); }
};
// Per-channel sum of an NCHW tensor seen as reductions over N*H*W for each channel.
template <class T = float>
struct ChannelValue {
  ChannelElement at;
  const T* x;
  DP_HD float operator()(index_t channel, index_t j) const { return load(x, at(channel, j)); }
  void host_add_terms(index_t channel, index_t j, index_t count, float* lanes) const {
    at.host_walk(channel, j, count, [&](index_t k, index_t i) { lanes[k] = lanes[k] + load(x, i); });
  }
};

// Row-wise sum of a (rows, cols) row-major matrix: map(row, col) = x[row*cols + col].
template <class T = float>
struct RowElement {
  const T* x;
  index_t cols;
  DP_HD float operator()(index_t row, index_t col) const { return load(x, row * cols + col); }
  void host_add_terms(index_t row, index_t col, index_t count, float* lanes) const {
    const T* at = x + row * cols + col;
    for (index_t k = 0; k < count; ++k) lanes[k] = lanes[k] + load(at, k);
  }
};
// Column-wise sum of a (rows, cols) matrix seen as reductions over rows for each column.
template <class T = float>
struct ColumnElement {
  const T* x;
  index_t cols;
  DP_HD float operator()(index_t col, index_t row) const { return load(x, row * cols + col); }
  // The sim: term `row` of columns [col, col + count) added to their lanes (host_tile_sums).
  void host_add_row(index_t row, index_t col, index_t count, float* lanes) const {
    const T* at = x + row * cols + col;
    for (index_t j = 0; j < count; ++j) lanes[j] = lanes[j] + load(at, j);
  }
};
// out[row] = beta * out[row] + sum   (beta = 0 overwrites, 1 accumulates gradients)
struct StoreSum {
  float* out;
  float beta;
  DP_HD void operator()(index_t row, float sum) const { out[row] = beta == 0.0f ? sum : beta * out[row] + sum; }
};

// torch.nn.utils.clip_grad_norm_'s pieces. A tensor's squared L2 norm: sum of x^2 (row_sum's plan).
struct SquareElement {
  const float* x;
  DP_HD float operator()(index_t, index_t col) const {
    const float v = x[col];
    return v * v;
  }
  void host_add_terms(index_t, index_t col, index_t count, float* lanes) const {
    const float* at = x + col;
    for (index_t k = 0; k < count; ++k) lanes[k] = lanes[k] + at[k] * at[k];
  }
};
// From the tensors' squared norms, in tensor order: norm_coef[0] = the total norm (the norm of the
// tensors' norms, as torch stacks them), norm_coef[1] = clamp(max_norm / (total + 1e-6), max=1),
// NaN when the norm is (torch.clamp keeps a NaN).
struct ClipCoefficient {
  const float* squares;
  index_t count;
  float max_norm;
  float* norm_coef;
  DP_HD void operator()(index_t) const {
    float total = 0.0f;
    for (index_t t = 0; t < count; ++t) {
      const float norm = sqrtf(squares[t]);
      total = total + norm * norm;
    }
    total = sqrtf(total);
    const float coef = max_norm / (total + 1e-6f);
    norm_coef[0] = total;
    norm_coef[1] = coef > 1.0f ? 1.0f : coef;
  }
};
// x *= *factor, the factor read from device memory when the kernel runs (a captured step replays it).
struct ScaleBy {
  const float* factor;
  float* x;
  DP_HD void operator()(index_t i) const { x[i] = *factor * x[i]; }
};

}  // namespace dp::kernels
