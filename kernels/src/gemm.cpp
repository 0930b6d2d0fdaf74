// gemm.cpp — validates a row-major GEMM, checks its operands, and runs it: OpenBLAS on the stream's
// thread (sim), cuBLAS (cuda).
#include <algorithm>
#include <cblas.h>
#include <fmt/format.h>
#include <mutex>

#include "dp/kernels/ops.h"
#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/error.h"
#include "library_calls.h"

namespace dp::kernels {
namespace {

// The operand range a (rows, cols) matrix with row stride ld covers.
kernel_api::Operand matrix(const float* p, int rows, int cols, int ld) {
  if (rows <= 0 || cols <= 0) return {p, 0};
  return {p, (static_cast<std::size_t>(rows - 1) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(cols)) *
                 sizeof(float)};
}

}  // namespace

void gemm(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m < 0 || n < 0 || k < 0) throw InvalidArgument(fmt::format("gemm: negative extent m={} n={} k={}", m, n, k));
  const int a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < std::max(1, a_cols) || ldb < std::max(1, b_cols) || ldc < std::max(1, n))
    throw InvalidArgument(
        fmt::format("gemm: leading dimension too small (lda={} needs {}, ldb={} needs {}, ldc={} needs {})", lda,
                    a_cols, ldb, b_cols, ldc, n));
  if (m == 0 || n == 0) return;
  kernel_api::check_operands(
      stream, "gemm",
      {matrix(a, trans_a ? k : m, a_cols, lda), matrix(b, trans_b ? n : k, b_cols, ldb), matrix(c, m, n, ldc)});
  const library::GemmArgs g{trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc};
  if (stream.backend() == Backend::cuda) {
    library::cublas_gemm(stream, g);
    return;
  }
  // One BLAS thread per simulated device: the devices themselves are the parallelism.
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { openblas_set_num_threads(1); });
  kernel_api::enqueue_host(
      stream, "gemm",
      [g] {
        cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m,
                    g.n, g.k, g.alpha, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc);
      },
      SpanKind::gemm);
}

}  // namespace dp::kernels
