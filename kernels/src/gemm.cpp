// gemm.cpp — validates a row-major GEMM, checks its operands, and runs it: OpenBLAS on the stream's
// thread (sim), cuBLAS (cuda).
#include <algorithm>
#include <cblas.h>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <mutex>
#include <vector>

#include "dp/kernels/fingerprint.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/error.h"
#include "library_calls.h"

namespace dp::kernels {
namespace {

thread_local bool bf16_operands = false;

// The operand range a (rows, cols) matrix of `element` bytes each with row stride ld covers.
kernel_api::Operand matrix(const void* p, int rows, int cols, int ld, std::size_t element = sizeof(float)) {
  if (rows <= 0 || cols <= 0) return {p, 0};
  return {p, (static_cast<std::size_t>(rows - 1) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(cols)) *
                 element};
}

// `rows` rows of `cols` floats at stride ld, rounded to TF32 into `out` (same layout).
const float* tf32_copy(const float* p, int rows, int cols, int ld, std::vector<float>& out) {
  const std::size_t span =
      static_cast<std::size_t>(rows - 1) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(cols);
  out.resize(span);
  for (std::size_t i = 0; i < span; ++i) out[i] = round_to_tf32(p[i]);
  return out.data();
}

// bf16 storage widened (exact) into `out`, the same layout: the host BLAS's operands.
const float* widened_copy(const void* bits, int rows, int cols, int ld, std::vector<float>& out) {
  const std::size_t span =
      static_cast<std::size_t>(rows - 1) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(cols);
  out.resize(span);
  const auto* p = static_cast<const std::uint16_t*>(bits);
  for (std::size_t i = 0; i < span; ++i) out[i] = bf16_to_float(p[i]);
  return out.data();
}

}  // namespace

Bf16Operands::Bf16Operands() : previous_(bf16_operands) { bf16_operands = true; }
Bf16Operands::~Bf16Operands() { bf16_operands = previous_; }
bool Bf16Operands::active() { return bf16_operands; }

float round_to_tf32(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // infinities and NaNs as they are
  u = (u + 0x1000u) & 0xffffe000u;                 // to nearest, ties away from zero; may reach infinity
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

namespace {
// The sim's products: OpenBLAS's sgemm per item of the batch, on fp32 operands (bf16 storage
// widened, exactly; under tf32 both rounded to TF32 as the tensor cores take them). A bf16 C is
// computed in fp32 (widened first, which beta may read) and rounded once.
void host_gemm(const library::GemmArgs& g, bool tf32) {
  const std::size_t element = g.bf16_storage ? 2 : sizeof(float);
  for (int item = 0; item < g.batch; ++item) {
    const void* a_at = static_cast<const std::byte*>(g.a) + static_cast<std::size_t>(item) * g.stride_a * element;
    const void* b_at = static_cast<const std::byte*>(g.b) + static_cast<std::size_t>(item) * g.stride_b * element;
    const std::size_t c_offset = static_cast<std::size_t>(item) * g.stride_c;
    float* c_at = static_cast<float*>(g.c) + c_offset;
    auto* c_bits = static_cast<std::uint16_t*>(g.c) + c_offset;
    thread_local std::vector<float> c_wide;
    if (g.c_bf16) {
      widened_copy(c_bits, g.m, g.n, g.ldc, c_wide);
      c_at = c_wide.data();
    }
    const auto* a = static_cast<const float*>(a_at);
    const auto* b = static_cast<const float*>(b_at);
    if (g.bf16_storage && g.k > 0) {  // bf16 values: exact in fp32 (and in TF32)
      thread_local std::vector<float> a_wide, b_wide;
      a = widened_copy(a_at, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, a_wide);
      b = widened_copy(b_at, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, b_wide);
    } else if (tf32 && g.k > 0) {  // the tensor cores' operands: both rounded to TF32 (dp/runtime/precision.h)
      thread_local std::vector<float> a_tf32, b_tf32;
      a = tf32_copy(a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, a_tf32);
      b = tf32_copy(b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, b_tf32);
    }
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n,
                g.k, g.alpha, a, g.lda, b, g.ldb, g.beta, c_at, g.ldc);
    if (g.c_bf16)  // C's own elements only: the gaps between its rows may be another tensor's
      for (int r = 0; r < g.m; ++r)
        for (int col = 0; col < g.n; ++col)
          c_bits[static_cast<std::size_t>(r) * g.ldc + col] =
              bf16_from_float(c_at[static_cast<std::size_t>(r) * g.ldc + col]);
  }
}

// The product alone; gemm_batched adds DP_FAULT flip-gemm's strike on its output.
void gemm_batched_unchecked_faults(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                   In a, int lda, std::int64_t stride_a, In b, int ldb, std::int64_t stride_b,
                                   float beta, Out c, int ldc, std::int64_t stride_c, int batch) {
  if (m < 0 || n < 0 || k < 0 || batch < 0)
    throw InvalidArgument(fmt::format("gemm: negative extent m={} n={} k={} batch={}", m, n, k, batch));
  if (stride_a < 0 || stride_b < 0 || stride_c < 0)
    throw InvalidArgument(fmt::format("gemm: negative stride {} {} {}", stride_a, stride_b, stride_c));
  if (a.bf16 != b.bf16) throw InvalidArgument("gemm: A and B of different storage (fp32 and bf16)");
  if (c.bf16 && !a.bf16) throw InvalidArgument("gemm: a bf16 C takes bf16 A and B");
  const int a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < std::max(1, a_cols) || ldb < std::max(1, b_cols) || ldc < std::max(1, n))
    throw InvalidArgument(
        fmt::format("gemm: leading dimension too small (lda={} needs {}, ldb={} needs {}, ldc={} needs {})", lda,
                    a_cols, ldb, b_cols, ldc, n));
  if (m == 0 || n == 0 || batch == 0) return;
  // Each operand's range over the batch: its first matrix, then batch - 1 strides further on.
  const auto over_batch = [batch](kernel_api::Operand o, std::int64_t stride, std::size_t element) {
    if (o.bytes) o.bytes += static_cast<std::size_t>(batch - 1) * static_cast<std::size_t>(stride) * element;
    return o;
  };
  const std::initializer_list<kernel_api::Operand> operands = {
      over_batch(matrix(a.data, trans_a ? k : m, a_cols, lda, a.element_size()), stride_a, a.element_size()),
      over_batch(matrix(b.data, trans_b ? n : k, b_cols, ldb, b.element_size()), stride_b, b.element_size()),
      over_batch(matrix(c.data, m, n, ldc, c.element_size()), stride_c, c.element_size())};
  kernel_api::check_operands(stream, "gemm", operands);
  // The traffic: each matrix's own elements once (rows x cols, not the rows' stride: a head's
  // columns of qkv are a third of a row's head), once per product, and never more than the span
  // (a shared operand, stride 0, is read once).
  const auto touched = [batch](kernel_api::Operand span, int rows, int cols, std::size_t element) {
    const std::size_t own = rows > 0 && cols > 0 ? static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) *
                                                       element * static_cast<std::size_t>(batch)
                                                 : 0;
    span.bytes = std::min(span.bytes, own);
    return span;
  };
  const auto* spans = operands.begin();
  kernel_api::count_traffic(
      stream, "gemm",
      {touched(spans[0], trans_a ? k : m, a_cols, a.element_size()),
       touched(spans[1], trans_b ? n : k, b_cols, b.element_size()), touched(spans[2], m, n, c.element_size())});
  library::GemmArgs g{trans_a, trans_b, m,    n,      k,   alpha,         a.data, lda,
                      b.data,  ldb,     beta, c.data, ldc, bf16_operands, a.bf16, c.bf16};
  g.batch = batch;
  g.stride_a = stride_a;
  g.stride_b = stride_b;
  g.stride_c = stride_c;
  if (stream.backend() == Backend::cuda) {
    library::cublas_gemm(stream, g);
    return;
  }
  // One BLAS thread per simulated device: the devices themselves are the parallelism.
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { openblas_set_num_threads(1); });
  const bool tf32 = kernel_api::precision(stream) == Precision::tf32;
  kernel_api::enqueue_host(
      stream, "gemm", [g, tf32] { host_gemm(g, tf32); }, SpanKind::gemm);
}
}  // namespace

void gemm(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, In a, int lda, In b,
          int ldb, float beta, Out c, int ldc) {
  gemm_batched(stream, trans_a, trans_b, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

void gemm_batched(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, In a, int lda,
                  std::int64_t stride_a, In b, int ldb, std::int64_t stride_b, float beta, Out c, int ldc,
                  std::int64_t stride_c, int batch) {
  gemm_batched_unchecked_faults(stream, trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
                                ldc, stride_c, batch);
  if (m > 0 && n > 0 && batch > 0)
    flip_if_faulty(stream, c.data, static_cast<std::size_t>(m) * static_cast<std::size_t>(n) * c.element_size());
}

}  // namespace dp::kernels
