// conv2d.cu — launchers for dp/kernels/conv2d.h: the shared im2col + one-GEMM-per-pass path that every
// backend runs, and the dispatch to the backends' convolution libraries (cuDNN on cuda streams,
// oneDNN on sim streams).
#include <algorithm>
#include <atomic>
#include <limits>
#include <string>

#include "checks.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/fingerprint.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/shape.h"
#include "library_calls.h"

namespace dp::kernels {

ConvGeometry conv_geometry(const Conv2dShape& s) {
  ConvGeometry g;
  g.s = s;
  g.h_out = s.h_out();
  g.w_out = s.w_out();
  g.hw = g.h_out * g.w_out;
  g.cols = s.n * g.hw;
  g.by_n = FastDivmod(std::max(s.n, 1));
  g.by_w = FastDivmod(s.w);
  g.by_h = FastDivmod(s.h);
  g.by_c_in = FastDivmod(s.c_in);
  g.by_c_out = FastDivmod(s.c_out);
  g.by_kw = FastDivmod(s.kw);
  g.by_kh = FastDivmod(s.kh);
  g.by_stride = FastDivmod(s.stride);
  g.by_h_out = FastDivmod(g.h_out);
  g.segments = static_cast<int>(ceil_div(g.hw, kPermuteSegment));
  g.by_segments = FastDivmod(g.segments);
  return g;
}

namespace {
std::string describe(const Conv2dShape& s) {
  const std::int64_t x[] = {s.n, s.c_in, s.h, s.w}, weight[] = {s.c_out, s.c_in, s.kh, s.kw};
  return "x " + format_shape(x) + ", weight " + format_shape(weight) + ", stride " + std::to_string(s.stride) +
         ", pad " + std::to_string(s.pad);
}

// Shapes PyTorch rejects too: non-positive extents, stride < 1, negative padding, a kernel larger
// than the padded input (h_out() rounds toward zero, so it would yield a bogus 1-pixel output).
void check_conv2d(const char* op, const Conv2dShape& s) {
  const auto bad = [&](const char* why) { checks::fail({op, ": ", why, " for ", describe(s)}); };
  if (s.n < 0 || s.c_in <= 0 || s.h <= 0 || s.w <= 0 || s.c_out <= 0 || s.kh <= 0 || s.kw <= 0)
    bad("non-positive extent");
  if (s.stride <= 0 || s.pad < 0) bad("stride must be >= 1 and padding >= 0");
  if (s.h + 2 * s.pad < s.kh || s.w + 2 * s.pad < s.kw) bad("kernel larger than the padded input");
}

// The shared im2col path indexes with int: every tensor, col included, below 2^31 elements.
void check_int_range(const char* op, const Conv2dShape& s, std::int64_t largest_elements) {
  if (largest_elements > std::numeric_limits<int>::max())
    checks::fail({op, ": im2col path needs every tensor below 2^31 elements (col has ", largest_elements, ") for ",
                  describe(s), "; use a smaller batch"});
}
}  // namespace

namespace {

std::atomic<bool> use_library{true};
std::atomic<ConvWeightGrad> weight_grad_choice{ConvWeightGrad::timed};

index_t taps(const Conv2dShape& s) { return static_cast<index_t>(s.c_in) * s.kh * s.kw; }
index_t pixels(const Conv2dShape& s) { return static_cast<index_t>(s.n) * s.h_out() * s.w_out(); }  // P
index_t x_count(const Conv2dShape& s) { return static_cast<index_t>(s.n) * s.c_in * s.h * s.w; }
index_t w_count(const Conv2dShape& s) { return static_cast<index_t>(s.c_out) * taps(s); }
index_t y_count(const Conv2dShape& s) { return static_cast<index_t>(s.c_out) * pixels(s); }
index_t col_count(const Conv2dShape& s) { return taps(s) * pixels(s); }
index_t im2col_rows(const Conv2dShape& s) { return taps(s) * s.n * s.h_out(); }  // of W_out each
index_t permute_calls(const ConvGeometry& g) { return static_cast<index_t>(g.s.n) * g.s.c_out * g.segments; }

// The shared path indexes with int (and int GEMM extents): every tensor must stay below 2^31
// elements, col (8 GiB at that size) being the largest for any practical shape.
index_t largest_shared_tensor(const Conv2dShape& s) { return std::max({x_count(s), y_count(s), col_count(s)}); }
bool fits_shared_path(const Conv2dShape& s) { return largest_shared_tensor(s) <= std::numeric_limits<int>::max(); }
ConvGeometry shared_geometry(const Conv2dShape& s, const char* op) {
  check_int_range(op, s, largest_shared_tensor(s));
  return conv_geometry(s);
}

enum class ConvPath { shared, cudnn, onednn };

// Under autocast (Bf16Operands) the convolutions are im2col + bf16 tensor-core GEMMs. The sim's
// TF32 rounds the GEMM operands (gemm()): only its shared path computes what tf32 asks for.
ConvPath conv_path(const Stream& stream) {
  if (!conv_library_enabled(stream.backend()) || Bf16Operands::active()) return ConvPath::shared;
  if (stream.backend() == Backend::cuda) return ConvPath::cudnn;
  return kernel_api::precision(stream) == Precision::tf32 ? ConvPath::shared : ConvPath::onednn;
}

// Whether the weight gradient is forced to the shared im2col + GEMM (`how` says so and the shape is
// within its int range) rather than left to the library that computes the rest.
bool weight_grad_forced_to_gemm(ConvWeightGrad how, const Conv2dShape& shape) {
  return how == ConvWeightGrad::gemm && fits_shared_path(shape);
}

// The shared path's weight gradient: dweight (+)= mat . col^T with beta, leaving col (x lowered) in
// the workspace for the input gradient. Returns mat, dy in the GEMM's layout: dy itself for N = 1
// (dy (1, C_out, hw) already is (C_out, hw)), else dy permuted into the workspace after col.
const float* shared_weight_grad(const Stream& stream, const ConvGeometry& g, const float* x, const float* dy,
                                float* dweight, float beta, float* workspace, bool x_lowered = false) {
  const Conv2dShape& shape = g.s;
  const int t = static_cast<int>(taps(shape)), p = g.cols;
  float* col = workspace;
  const float* mat = dy;
  if (shape.n > 1) {
    float* permuted = workspace + col_count(shape);
    launch(stream, "conv2d_to_mat", permute_calls(g), NchwToMat{g, dy, permuted},
           {operand(dy, y_count(shape)), operand(permuted, y_count(shape))});
    mat = permuted;
  }
  if (!x_lowered)
    launch(stream, "conv2d_im2col", im2col_rows(shape), Im2col{g, x, col},
           {operand(x, x_count(shape)), operand(col, col_count(shape))});
  gemm(stream, false, true, shape.c_out, t, p, 1.0f, mat, p, col, p, beta, dweight, t);  // (+)= dy . col^T
  return mat;
}

// The shared weight gradient for the cuDNN path to time against its own (library::GemmWeightGrad),
// on `stream` with the caller's conv workspace.
struct SharedWeightGrad {
  const Stream& stream;
  Conv2dShape shape;
  float* workspace;
  // Called only while a plan is built: the geometry is made then, not on every call.
  void operator()(const float* x, const float* dy, float* dweight) const {
    shared_weight_grad(stream, shared_geometry(shape, "conv2d"), x, dy, dweight, 0.0f, workspace);
  }
  // Borrowed by the cuDNN call; empty beyond the shared path's int range.
  library::GemmWeightGrad borrow() const {
    return fits_shared_path(shape) ? library::GemmWeightGrad(*this) : library::GemmWeightGrad();
  }
};

}  // namespace

void set_conv_library(bool enabled) { use_library.store(enabled); }
void set_conv_weight_grad(ConvWeightGrad how) { weight_grad_choice.store(how); }
ConvWeightGrad conv_weight_grad() { return weight_grad_choice.load(); }

bool conv_library_enabled(Backend backend) {
  static const bool cudnn = library::cudnn_available();
  return (backend != Backend::cuda || cudnn) && use_library.load();
}

// col (T, P) followed by mat (C_out, P). The backward reuses col for dcol once dweight has read it.
std::size_t conv2d_workspace_floats(const Conv2dShape& shape) {
  check_conv2d("conv2d_workspace_floats", shape);
  return static_cast<std::size_t>((taps(shape) + shape.c_out) * pixels(shape));
}

std::size_t conv2d_workspace_floats(const Stream& stream, const Conv2dShape& shape) {
  const std::size_t most = conv2d_workspace_floats(shape);
  switch (conv_path(stream)) {
    case ConvPath::shared: return most;
    case ConvPath::cudnn:  // the weight gradient may go to the shared GEMM unless the library is forced
      return conv_weight_grad() == ConvWeightGrad::library || !fits_shared_path(shape) ? 0 : most;
    case ConvPath::onednn:
      return library::onednn_supports(shape) && !weight_grad_forced_to_gemm(conv_weight_grad(), shape) ? 0 : most;
  }
  return most;
}

bool conv2d_supports_bf16(const Stream& stream, const Conv2dShape& shape) {
  check_conv2d("conv2d_supports_bf16", shape);
  if (!conv_library_enabled(stream.backend())) return false;
  return stream.backend() == Backend::cuda ? library::cudnn_supports_bf16(stream, shape)
                                           : library::onednn_supports(shape, true);
}

void add_channel_bias(const Stream& stream, index_t n, index_t channels, index_t plane, Out y, const float* bias) {
  if (n < 0 || channels < 0 || plane < 0 || channels > std::numeric_limits<int>::max() ||
      n * channels > std::numeric_limits<int>::max())
    checks::fail({"add_channel_bias: extents n=", static_cast<long long>(n),
                  " channels=", static_cast<long long>(channels), " plane=", static_cast<long long>(plane),
                  ": need n, channels, plane >= 0 and n * channels below 2^31"});
  const FastDivmod by_channels(channels > 0 ? static_cast<int>(channels) : 1);
  with_storage(y.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "add_channel_bias", n * channels, plane,
              AddChannelBias<T>{channels, plane, by_channels, bias, y.as<T>()},
              {operand(bias, channels), operand(y.as<T>(), n * channels * plane)});
  });
}

namespace {

// bf16 storage: the library's convolution, its operands each once (Runtime::memory_traffic).
void check_bf16(const char* op, const Stream& stream, const Conv2dShape& shape, std::initializer_list<bool> bf16) {
  checks::same_storage(op, bf16);
  if (!conv2d_supports_bf16(stream, shape))
    checks::fail({op, ": no convolution library here takes bf16 storage for ", describe(shape),
                  " (widen to fp32 and run under Bf16Operands)"});
}
using bf16_bits = std::uint16_t;

bool forward_bf16(const Stream& stream, const Conv2dShape& shape, In x, In weight, const float* bias, Out y) {
  const char* op = "conv2d_forward";
  check_bf16(op, stream, shape, {x.bf16, weight.bf16, y.bf16});
  checks::present(op, {{"x", x.data}, {"weight", weight.data}, {"y", y.data}});
  const std::initializer_list<Operand> operands = {
      operand(x.as<bf16_bits>(), x_count(shape)), operand(weight.as<bf16_bits>(), w_count(shape)),
      operand(bias, bias ? shape.c_out : 0), operand(y.as<bf16_bits>(), y_count(shape))};
  check_operands(stream, op, operands);
  if (shape.n == 0) return false;
  if (stream.backend() == Backend::cuda) {
    library::cudnn_conv2d_forward_bf16(stream, shape, x.data, weight.data, y.data);
    kernel_api::count_traffic(stream, op, {operands.begin()[0], operands.begin()[1], operands.begin()[3]});
    if (bias)
      add_channel_bias(stream, shape.n, shape.c_out, static_cast<index_t>(shape.h_out()) * shape.w_out(), y, bias);
    return false;
  }
  library::onednn_conv2d_forward(stream, shape, true, x.data, weight.data, bias, y.data);
  kernel_api::count_traffic(stream, op, operands);
  return false;
}

void backward_bf16(const Stream& stream, const Conv2dShape& shape, In x, In weight, In dy, Out dx, float* dweight,
                   float* dbias, bool accumulate) {
  const char* op = "conv2d_backward";
  check_bf16(op, stream, shape, {x.bf16, weight.bf16, dy.bf16, dx ? dx.bf16 : x.bf16});
  checks::present(op, {{"x", x.data}, {"weight", weight.data}, {"dy", dy.data}, {"dweight", dweight}});
  const auto* xs = x.as<bf16_bits>();
  const auto* ws = weight.as<bf16_bits>();
  const auto* dys = dy.as<bf16_bits>();
  auto* dxs = dx.as<bf16_bits>();
  check_operands(stream, op,
                 {operand(xs, x_count(shape)), operand(ws, w_count(shape)), operand(dys, y_count(shape)),
                  operand(dxs, dxs ? x_count(shape) : 0), operand(dweight, w_count(shape)),
                  operand(dbias, dbias ? shape.c_out : 0)});
  if (shape.n == 0) {
    if (!accumulate) {
      fill(stream, dweight, w_count(shape), 0.0f);
      if (dbias) fill(stream, dbias, shape.c_out, 0.0f);
    }
    return;
  }
  if (dbias)
    channel_sum(stream, shape.n, shape.c_out, static_cast<index_t>(shape.h_out()) * shape.w_out(), dy, dbias,
                accumulate ? 1.0f : 0.0f);
  const std::initializer_list<Operand> operands = {operand(ws, dxs ? w_count(shape) : 0), operand(dys, y_count(shape)),
                                                   operand(dxs, dxs ? x_count(shape) : 0), operand(xs, x_count(shape)),
                                                   operand(dweight, w_count(shape))};
  if (stream.backend() == Backend::cuda) {
    // cuDNN writes the weight gradient as bf16; its widening after it counts itself.
    kernel_api::count_traffic(stream, op,
                              {operands.begin()[0], operands.begin()[1], operands.begin()[2], operands.begin()[3],
                               operand(reinterpret_cast<const bf16_bits*>(dweight), w_count(shape))});
    library::cudnn_conv2d_backward_bf16(stream, shape, xs, ws, dys, dxs, dweight, accumulate);
    return;
  }
  library::onednn_conv2d_backward(stream, shape, true, xs, ws, dys, dxs, dweight, accumulate);
  kernel_api::count_traffic(stream, op, operands);
}

bool conv2d_forward_unchecked_faults(const Stream& stream, const Conv2dShape& shape, In x_in, In weight_in,
                                     const float* bias, Out y_out, float* workspace) {
  const char* op = "conv2d_forward";
  check_conv2d(op, shape);
  if (x_in.bf16 || weight_in.bf16 || y_out.bf16) return forward_bf16(stream, shape, x_in, weight_in, bias, y_out);
  const float* x = x_in.as<float>();
  const float* weight = weight_in.as<float>();
  float* y = y_out.as<float>();
  const std::size_t workspace_floats = conv2d_workspace_floats(stream, shape);
  checks::present(op, {{"x", x}, {"weight", weight}, {"y", y}});
  if (workspace_floats) checks::present(op, {{"workspace", workspace}});
  // Every operand up front, not only per launch: a foreign pointer must throw before any pass is
  // enqueued, or an earlier pass would already have written y (or accumulated into dweight).
  check_operands(stream, op,
                 {operand(x, x_count(shape)), operand(weight, w_count(shape)), operand(bias, bias ? shape.c_out : 0),
                  operand(y, y_count(shape)), operand(workspace, static_cast<index_t>(workspace_floats))});
  if (shape.n == 0) return false;
  const ConvPath path = conv_path(stream);
  // A library's convolution: its operands, each once (Runtime::memory_traffic).
  const auto count_library = [&] {
    kernel_api::count_traffic(stream, "conv2d_forward",
                              {operand(x, x_count(shape)), operand(weight, w_count(shape)),
                               operand(bias, bias ? shape.c_out : 0), operand(y, y_count(shape))});
  };
  if (path == ConvPath::cudnn) {
    const SharedWeightGrad shared{stream, shape, workspace};
    library::cudnn_conv2d_forward(stream, shape, x, weight, bias, y, shared.borrow());
    count_library();
    return false;
  }
  if (path == ConvPath::onednn && library::onednn_conv2d_forward(stream, shape, false, x, weight, bias, y)) {
    count_library();
    return false;
  }
  const ConvGeometry g = shared_geometry(shape, op);
  const int t = static_cast<int>(taps(shape)), p = g.cols;
  float* col = workspace;
  // N = 1: mat (C_out, hw) already is NCHW, so the GEMM writes y and only the bias remains.
  float* mat = shape.n == 1 ? y : workspace + col_count(shape);
  launch(stream, "conv2d_im2col", im2col_rows(shape), Im2col{g, x, col},
         {operand(x, x_count(shape)), operand(col, col_count(shape))});
  gemm(stream, false, false, shape.c_out, p, t, 1.0f, weight, t, col, p, 0.0f, mat, p);  // W (C_out, T) . col
  if (shape.n > 1 || bias)
    launch(stream, "conv2d_to_nchw_bias", permute_calls(g), MatToNchwBias{g, mat, bias, y},
           {operand(mat, y_count(shape)), operand(bias, bias ? shape.c_out : 0), operand(y, y_count(shape))});
  return true;  // col (x lowered) stays at the start of the workspace; mat came after it
}
}  // namespace

bool conv2d_forward(const Stream& stream, const Conv2dShape& shape, In x_in, In weight_in, const float* bias, Out y_out,
                    float* workspace) {
  const bool lowered = conv2d_forward_unchecked_faults(stream, shape, x_in, weight_in, bias, y_out, workspace);
  if (y_count(shape) > 0)
    flip_if_faulty(stream, y_out.data, static_cast<std::size_t>(y_count(shape)) * (y_out.bf16 ? 2 : sizeof(float)));
  return lowered;
}

namespace {

// The shared path's backward: dweight (beta: added to or written), then dx (when not null) as
// col2im of W^T . dy, in the workspace where col was.
void shared_backward(const Stream& stream, const ConvGeometry& g, const float* x, const float* weight, const float* dy,
                     float* dx, float* dweight, float beta, float* workspace, bool x_lowered) {
  const Conv2dShape& shape = g.s;
  const int t = static_cast<int>(taps(shape)), p = g.cols;
  float* col = workspace;
  const float* mat = shared_weight_grad(stream, g, x, dy, dweight, beta, workspace, x_lowered);
  if (dx == nullptr) return;
  // dcol = W^T . dy overwrites col: stream order puts it after the dweight GEMM that reads col.
  gemm(stream, true, false, t, p, shape.c_out, 1.0f, weight, t, mat, p, 0.0f, col, p);
  launch(stream, "conv2d_col2im", x_count(shape), Col2im{g, col, dx},
         {operand(col, col_count(shape)), operand(dx, x_count(shape))});
}

void conv2d_backward_unchecked_faults(const Stream& stream, const Conv2dShape& shape, In x_in, In weight_in, In dy_in,
                                      Out dx_out, float* dweight, float* dbias, float* workspace, bool accumulate,
                                      bool x_lowered) {
  const char* op = "conv2d_backward";
  check_conv2d(op, shape);
  if (x_in.bf16 || weight_in.bf16 || dy_in.bf16 || dx_out.bf16) {
    backward_bf16(stream, shape, x_in, weight_in, dy_in, dx_out, dweight, dbias, accumulate);
    return;
  }
  const float* x = x_in.as<float>();
  const float* weight = weight_in.as<float>();
  const float* dy = dy_in.as<float>();
  float* dx = dx_out.as<float>();
  const std::size_t workspace_floats = conv2d_workspace_floats(stream, shape);
  checks::present(op, {{"x", x}, {"weight", weight}, {"dy", dy}, {"dweight", dweight}});
  if (workspace_floats) checks::present(op, {{"workspace", workspace}});
  check_operands(stream, op,
                 {operand(x, x_count(shape)), operand(weight, w_count(shape)), operand(dy, y_count(shape)),
                  operand(dx, dx ? x_count(shape) : 0), operand(dweight, w_count(shape)),
                  operand(dbias, dbias ? shape.c_out : 0), operand(workspace, static_cast<index_t>(workspace_floats))});
  if (shape.n == 0) {   // empty batch: dx is empty and the gradients gain nothing
    if (!accumulate) {  // but are written: a sum of no terms
      fill(stream, dweight, w_count(shape), 0.0f);
      if (dbias) fill(stream, dbias, shape.c_out, 0.0f);
    }
    return;
  }
  const float beta = accumulate ? 1.0f : 0.0f;  // only how the final sums are stored differs
  // The bias gradient on every path: the reduction plan's order, the same bits on cuda and sim
  // (cuDNN's own bias reduction orders its sums another way). Last on the cuDNN path, so that a
  // plan that fails to build has written no gradient.
  const auto bias_grad = [&] {
    if (dbias)
      channel_sum(stream, shape.n, shape.c_out, static_cast<index_t>(shape.h_out()) * shape.w_out(), dy, dbias, beta);
  };
  const ConvPath path = conv_path(stream);
  // A library's part of the backward: the input gradient's operands and, when it computes it too,
  // the weight gradient's, each once (Runtime::memory_traffic).
  const auto count_library = [&](bool weight_grad) {
    kernel_api::count_traffic(
        stream, "conv2d_backward",
        {operand(weight, dx ? w_count(shape) : 0), operand(dy, y_count(shape)), operand(dx, dx ? x_count(shape) : 0),
         operand(x, weight_grad ? x_count(shape) : 0), operand(dweight, weight_grad ? w_count(shape) : 0)});
  };
  if (path == ConvPath::cudnn) {
    // The input gradient stays with cuDNN; the weight gradient goes to cuDNN or to the shared
    // im2col + GEMM (set_conv_weight_grad), run here once cuDNN's handle is released.
    const ConvWeightGrad how = conv_weight_grad();
    const SharedWeightGrad shared_path{stream, shape, workspace};
    const library::GemmWeightGrad shared = shared_path.borrow();
    const bool forced_gemm = weight_grad_forced_to_gemm(how, shape);
    const bool by_gemm =
        forced_gemm && dx == nullptr  // nothing left for cuDNN to do
            ? true
            : library::cudnn_conv2d_backward(stream, shape, x, weight, dy, dx, dweight, accumulate, how, shared);
    if (dx || !by_gemm) count_library(!by_gemm);
    if (by_gemm) shared_weight_grad(stream, shared_geometry(shape, op), x, dy, dweight, beta, workspace);
    bias_grad();
    return;
  }
  bias_grad();
  // oneDNN, its weight gradient too unless forced to the shared path (the sim times nothing: `timed`
  // is oneDNN's).
  if (path == ConvPath::onednn) {
    const bool by_gemm = weight_grad_forced_to_gemm(conv_weight_grad(), shape);
    if (library::onednn_conv2d_backward(stream, shape, false, x, weight, dy, dx, by_gemm ? nullptr : dweight,
                                        accumulate)) {
      if (dx || !by_gemm) count_library(!by_gemm);
      if (by_gemm) shared_weight_grad(stream, shared_geometry(shape, op), x, dy, dweight, beta, workspace);
      return;
    }
  }
  shared_backward(stream, shared_geometry(shape, op), x, weight, dy, dx, dweight, beta, workspace, x_lowered);
}
}  // namespace

void conv2d_backward(const Stream& stream, const Conv2dShape& shape, In x_in, In weight_in, In dy_in, Out dx_out,
                     float* dweight, float* dbias, float* workspace, bool accumulate, bool x_lowered) {
  conv2d_backward_unchecked_faults(stream, shape, x_in, weight_in, dy_in, dx_out, dweight, dbias, workspace, accumulate,
                                   x_lowered);
  if (w_count(shape) > 0) flip_if_faulty(stream, dweight, sizeof(float) * static_cast<std::size_t>(w_count(shape)));
}

}  // namespace dp::kernels
