// dp/kernels/conv2d.h — Conv2d forward/backward (PyTorch semantics: weight (C_out, C_in, KH, KW), bias (C_out),
// any stride and zero padding, NCHW row-major). Shared path: im2col/col2im + GEMM, which both
// backends run. By default each backend's convolution library computes them instead (turned off by
// set_conv_library(false)): cuDNN on cuda, when dp was built with it, its weight gradients by cuDNN or
// by the shared im2col + cuBLAS GEMM, whichever is faster; oneDNN on the sim, the direct convolutions
// PyTorch's CPU convolutions are.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

struct Conv2dShape {
  int n = 0, c_in = 0, h = 0, w = 0;  // input  (N, C_in, H, W)
  int c_out = 0, kh = 0, kw = 0;      // weight (C_out, C_in, KH, KW)
  int stride = 1, pad = 0;
  DP_HD int h_out() const { return (h + 2 * pad - kh) / stride + 1; }
  DP_HD int w_out() const { return (w + 2 * pad - kw) / stride + 1; }
};

// Floats of scratch conv2d_forward / conv2d_backward may use for this shape: the shared path's
// lowered input and its GEMM output, what any path needs at the most.
std::size_t conv2d_workspace_floats(const Conv2dShape& shape);
// What a convolution of `shape` on `stream` needs as things are set now (the backend's library,
// the precision, autocast, the weight-gradient choice): the shared path's scratch where it may run,
// 0 where the library does all of it (oneDNN on the sim, cuDNN with ConvWeightGrad::library).
// The workspace argument may then be null: a layer keeps no scratch it does not use.
std::size_t conv2d_workspace_floats(const Stream& stream, const Conv2dShape& shape);

// y (N, C_out, H_out, W_out) = conv(x, weight) + bias. bias may be null. Returns whether the
// workspace now holds x lowered (the shared path's col, at its start): a conv2d_backward of the same
// x, shape and workspace, with nothing written to the workspace in between, may pass x_lowered and
// skip lowering x again.
// x, weight and y (dy and dx below) are fp32, or all bf16 bits (autocast's storage, storage.h):
// then the backend's library computes in fp32 on their values and rounds y and dx once, with no
// workspace (conv2d_supports_bf16 says where one takes them; elsewhere InvalidArgument); bias and
// dweight stay fp32.
bool conv2d_forward(const Stream& stream, const Conv2dShape& shape, In x, In weight, const float* bias, Out y,
                    float* workspace);

// Given dy (N, C_out, H_out, W_out): dx = dL/dx (overwritten; skipped when dx is null),
// dweight += dL/dweight, dbias += dL/dbias (dbias may be null): accumulated with `accumulate`, as
// PyTorch accumulates .grad, else overwritten (the first backward after zero_grad: what they held
// is never read, and an empty batch writes zeros). x_lowered: see conv2d_forward (the workspace
// no longer holds x lowered afterwards when dx is computed).
void conv2d_backward(const Stream& stream, const Conv2dShape& shape, In x, In weight, In dy, Out dx, float* dweight,
                     float* dbias, float* workspace, bool accumulate = true, bool x_lowered = false);

// Whether conv2d_* take bf16 storage for `shape` on `stream` as things are set now: the backend's
// convolution library is on and takes it for that shape (cuDNN's bf16 convolutions on cuda, where
// cuDNN reports a plan for the shape: fp32 compute on tensor cores, then the bias added by
// add_channel_bias: the output rounded twice with a bias, as torch's cuDNN convolution does; oneDNN
// on the sim, reordering bf16 into its fp32 blocked layouts and back,
// the bias added before the one rounding, as torch's CPU convolution does). Elsewhere a caller
// widens into fp32 and runs the fp32 path (Bf16Operands).
bool conv2d_supports_bf16(const Stream& stream, const Conv2dShape& shape);

// y (N, C, plane) += bias[c], each element computed in fp32 and stored in y's storage (bf16: rounded
// once).
void add_channel_bias(const Stream& stream, index_t n, index_t channels, index_t plane, Out y, const float* bias);

// Whether conv2d_* use the backend's convolution library (default: true). On cuda that is cuDNN,
// when dp was built with it (else the shared path); on the sim it is oneDNN, except under
// Precision::tf32, whose rounded operands only the shared path's GEMM computes on the sim. Under
// autocast (Bf16Operands) both backends run the shared path, its GEMMs on bf16 operands.
void set_conv_library(bool enabled);
bool conv_library_enabled(Backend backend);

// How the library path computes weight gradients. `timed` (the default), on cuda: in `strict`, a
// fixed choice, the shared im2col + cuBLAS GEMM where the shape fits it, since cuDNN may then only
// use its one deterministic dot-product algorithm, which took ~3.5x the time of im2col + GEMM for
// the ConvNet at batch 1024 on an H100 (../shared/perf/H100.md); fixed, so every device on a GPU
// computes the same bits. In `fast` and `tf32`, when the cuDNN plan of a shape is built (its first
// forward or backward, in warm-up), cuDNN's chosen algorithm and the GEMM are timed against each
// other on the stream and the GEMM is kept if it is clearly faster. `library` and `gemm` force one
// (tests). The sim times nothing: there `timed` is oneDNN's. No effect with the library off; shapes
// beyond the shared path's int range always use the library.
enum class ConvWeightGrad { timed, library, gemm };
void set_conv_weight_grad(ConvWeightGrad how);
ConvWeightGrad conv_weight_grad();

// ------------------------------------------------------------------------------------------------
// Arithmetic of the shared path, written once for host and device.
//
// The whole batch is lowered at once so that each pass is ONE large GEMM rather than N small
// ones: with P = N*H_out*W_out output pixels and T = C_in*KH*KW taps,
//   col (T, P):  column p = (n, oh, ow) holds the receptive field of output pixel p, row t = (c, ki, kj);
//   mat (C_out, P): the GEMM-side layout of y / dy, i.e. NCHW with N moved next to H*W.
// Indices are int: the shared path requires every tensor, col included, below 2^31 elements, so
// the index maps divide with FastDivmod (platform.h).

// Extents derived from a Conv2dShape, precomputed once per launch instead of once per element.
struct ConvGeometry {
  Conv2dShape s;
  int h_out = 0, w_out = 0;
  int hw = 0;        // H_out * W_out
  int cols = 0;      // P = N * hw
  int segments = 0;  // kPermuteSegment-float segments per run of hw
  FastDivmod by_n, by_w, by_h, by_c_in, by_c_out, by_kw, by_kh, by_stride, by_h_out, by_segments;
};
// The geometry of a valid shape (conv2d_* check the shape, and the int range, before building one).
ConvGeometry conv_geometry(const Conv2dShape& shape);

// col[t, p] = x[n, c, oh*stride - pad + ki, ow*stride - pad + kj]; taps in the zero padding are 0.
// One call per row (t, n, oh) of W_out outputs, which are contiguous in col: rows = T*N*H_out
// (358k for the reference model's conv2 at batch 64) is parallelism enough for a GPU, and the
// index arithmetic is paid once per row, so the host loop is a strided copy rather than five
// divisions per element (which made im2col, not the GEMM, the sim's bottleneck).
struct Im2col {
  ConvGeometry g;
  const float* x;
  float* col;
  DP_HD void operator()(index_t row) const {
    int oh, n;
    const int t = g.by_n.divmod(g.by_h_out.divmod(static_cast<int>(row), oh), n);
    int kj, ki;
    const int c = g.by_kh.divmod(g.by_kw.divmod(t, kj), ki);
    int lo, hi;
    span(kj, lo, hi);
    copy_row(n, c, oh * g.s.stride - g.s.pad + ki, kj, lo, hi, col + static_cast<index_t>(row) * g.w_out);
  }
  // The sim: rows in order, the tap's index work once per tap instead of once per row.
  void host_run(index_t rows) const {
    const int taps = g.s.c_in * g.s.kh * g.s.kw;
    float* out = col;
    for (int t = 0; t < taps && out < col + rows * g.w_out; ++t) {
      const int kj = t % g.s.kw, ki = (t / g.s.kw) % g.s.kh, c = t / (g.s.kw * g.s.kh);
      int lo, hi;
      span(kj, lo, hi);
      for (int n = 0; n < g.s.n; ++n)
        for (int oh = 0; oh < g.h_out; ++oh, out += g.w_out)
          copy_row(n, c, oh * g.s.stride - g.s.pad + ki, kj, lo, hi, out);
    }
  }
  // Outputs [lo, hi) of a row with tap column kj read inside the input row (when that row exists);
  // those before and after read the zero padding.
  DP_HD void span(int kj, int& lo, int& hi) const {
    const int first = g.s.pad - kj;             // ow * stride must be >= first ...
    const int last = g.s.w - 1 + g.s.pad - kj;  // ... and <= last
    lo = first > 0 ? g.by_stride.div(first + g.s.stride - 1) : 0;
    hi = last >= 0 ? g.by_stride.div(last) + 1 : 0;
    hi = hi < g.w_out ? hi : g.w_out;
    lo = lo < hi ? lo : hi;
  }
  // The W_out outputs of input row ih (padding when outside) of plane (n, c), tap column kj.
  DP_HD void copy_row(int n, int c, int ih, int kj, int lo, int hi, float* out) const {
    if (ih < 0 || ih >= g.s.h) lo = hi = 0;
    for (int ow = 0; ow < lo; ++ow) out[ow] = 0.0f;
    if (lo < hi) {
      const float* in = x + ((n * g.s.c_in + c) * g.s.h + ih) * g.s.w;
      const int shift = kj - g.s.pad;  // iw = ow * stride + shift
      if (g.s.stride == 1)             // a plain copy the host compiler vectorises
        for (int ow = lo; ow < hi; ++ow) out[ow] = in[ow + shift];
      else
        for (int ow = lo; ow < hi; ++ow) out[ow] = in[ow * g.s.stride + shift];
    }
    for (int ow = hi; ow < g.w_out; ++ow) out[ow] = 0.0f;
  }
};

// The taps k in [0, K) of one dimension that read input position i: k = i + pad - o*stride for an
// output position o in [0, out), i.e. k in [first, last] stepping by stride, o = o_first - step.
struct TapRange {
  int first = 0, last = -1, o_first = 0;
  DP_HD TapRange(int i, int pad, int k_size, int out, int stride, const FastDivmod& by_stride) {
    const int reach = i + pad;  // k + o*stride
    // Lowest tap: at least 0 and at least reach - (out-1)*stride, raised to reach's residue.
    int lo = reach - (out - 1) * stride;
    lo = lo > 0 ? lo : 0;
    int up;
    by_stride.divmod(reach - lo, up);
    if (up != 0) lo += up;
    first = lo;
    last = reach < k_size - 1 ? reach : k_size - 1;
    o_first = by_stride.div(reach - lo);
  }
};

// dx[n, c, ih, iw] = sum of dcol over every (tap, output pixel) that read x[n, c, ih, iw]. A gather:
// each thread owns one input element and writes it once, so no atomics and a fixed summation
// order (ki, then kj ascending). The tap ranges are computed up front, so the loops hold no tests.
struct Col2im {
  ConvGeometry g;
  const float* dcol;
  float* dx;
  DP_HD void operator()(index_t i) const {
    int iw, ih, c;
    const int n = g.by_c_in.divmod(g.by_h.divmod(g.by_w.divmod(static_cast<int>(i), iw), ih), c);
    const TapRange rh(ih, g.s.pad, g.s.kh, g.h_out, g.s.stride, g.by_stride);
    const TapRange rw(iw, g.s.pad, g.s.kw, g.w_out, g.s.stride, g.by_stride);
    const float* sample = dcol + n * g.hw;  // column block of sample n
    float sum = 0.0f;
    for (int ki = rh.first, oh = rh.o_first; ki <= rh.last; ki += g.s.stride, --oh) {
      const float* row = sample + ((c * g.s.kh + ki) * g.s.kw) * g.cols + oh * g.w_out;
      for (int kj = rw.first, ow = rw.o_first; kj <= rw.last; kj += g.s.stride, --ow) sum += row[kj * g.cols + ow];
    }
    dx[i] = sum;
  }
  // The sim: a scatter. Every input starts at 0 and receives its taps (ki, then kj ascending) one
  // tap row at a time: the gather's sum, term for term, with the inner loop a strided add over a
  // row instead of two tap searches per input. Each tap row of dcol is read once, start to end,
  // across the samples (channel c's planes of every sample stay in cache meanwhile).
  void host_run(index_t n) const {
    for (index_t i = 0; i < n; ++i) dx[i] = 0.0f;
    const index_t plane = static_cast<index_t>(g.s.h) * g.s.w, sample = plane * g.s.c_in;
    const int samples = static_cast<int>(n / sample);
    for (int c = 0; c < g.s.c_in; ++c)
      for (int ki = 0; ki < g.s.kh; ++ki)
        for (int kj = 0; kj < g.s.kw; ++kj) {
          const float* taps = dcol + ((c * g.s.kh + ki) * g.s.kw + kj) * static_cast<index_t>(g.cols);
          const int shift = kj - g.s.pad;  // iw = ow * stride + shift
          int lo = 0, hi = 0;              // outputs whose iw lies in [0, W)
          while (lo < g.w_out && lo * g.s.stride + shift < 0) ++lo;
          hi = lo;
          while (hi < g.w_out && hi * g.s.stride + shift < g.s.w) ++hi;
          for (int b = 0; b < samples; ++b) {
            float* out = dx + b * sample + c * plane;
            for (int oh = 0; oh < g.h_out; ++oh) {
              const int ih = oh * g.s.stride - g.s.pad + ki;
              if (ih < 0 || ih >= g.s.h) continue;
              float* row = out + static_cast<index_t>(ih) * g.s.w;
              const float* src = taps + b * g.hw + oh * g.w_out;
              if (g.s.stride == 1)
                for (int ow = lo; ow < hi; ++ow) row[ow + shift] += src[ow];
              else
                for (int ow = lo; ow < hi; ++ow) row[ow * g.s.stride + shift] += src[ow];
            }
          }
        }
  }
};

// The permutes between mat and NCHW move runs of hw contiguous floats. One call moves a segment
// of up to kPermuteSegment of them: a plain copy loop on the host (a per-element call pays two
// divisions per float and ran ~20x slower than the copy), while segments keep N*C_out*hw/32
// calls (25k for the reference model's conv1 at batch 64) to spread over the GPU.
constexpr int kPermuteSegment = 32;

// y (N, C_out, hw) = mat (C_out, N*hw) + bias[c] (bias may be null). For N = 1 the layouts agree
// and mat may be y itself: each element is read and written by the same call.
// Call k: segment k % segments of the y row (n, c) = k / segments.
struct MatToNchwBias {
  ConvGeometry g;
  const float* mat;
  const float* bias;
  float* y;
  DP_HD void operator()(index_t k) const {
    int seg, c;
    const int row = g.by_segments.divmod(static_cast<int>(k), seg);
    const int n = g.by_c_out.divmod(row, c);
    const int q0 = seg * kPermuteSegment, q1 = q0 + kPermuteSegment < g.hw ? q0 + kPermuteSegment : g.hw;
    const float b = bias ? bias[c] : 0.0f;
    const float* src = mat + c * g.cols + n * g.hw;
    float* dst = y + row * g.hw;
    for (int q = q0; q < q1; ++q) dst[q] = src[q] + b;
  }
};

// add_channel_bias: row = the plane n*C + c, col = the element within it.
template <class T = float>
struct AddChannelBias {
  index_t channels, plane;
  FastDivmod by_channels;
  const float* bias;
  T* y;
  DP_HD void operator()(index_t row, index_t col) const {
    int c = 0;
    by_channels.divmod(static_cast<int>(row), c);
    const index_t i = row * plane + col;
    store(y, i, load(y, i) + bias[c]);
  }
};

// mat (C_out, N*hw) = dy (N, C_out, hw). Call k: segment k % segments of the run (c, n) = k / segments,
// in mat's order, so consecutive calls write consecutive memory.
struct NchwToMat {
  ConvGeometry g;
  const float* dy;
  float* mat;
  DP_HD void operator()(index_t k) const {
    int seg, n;
    const int run = g.by_segments.divmod(static_cast<int>(k), seg);
    const int c = g.by_n.divmod(run, n);
    const int q0 = seg * kPermuteSegment, q1 = q0 + kPermuteSegment < g.hw ? q0 + kPermuteSegment : g.hw;
    const float* src = dy + (n * g.s.c_out + c) * g.hw;
    float* dst = mat + run * g.hw;  // = mat + c*cols + n*hw
    for (int q = q0; q < q1; ++q) dst[q] = src[q];
  }
};

}  // namespace dp::kernels
