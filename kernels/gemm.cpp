// gemm.cpp — validates a row-major GEMM and hands it to the stream's backend (cuBLAS / OpenBLAS).
#include <fmt/format.h>

#include "dp/error.h"
#include "dp/src/backend.h"
#include "kernels/ops.h"

namespace dp::kernels {

void gemm(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m < 0 || n < 0 || k < 0) throw InvalidArgument(fmt::format("gemm: negative extent m={} n={} k={}", m, n, k));
  const int a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < std::max(1, a_cols) || ldb < std::max(1, b_cols) || ldc < std::max(1, n))
    throw InvalidArgument(fmt::format("gemm: leading dimension too small (lda={} needs {}, ldb={} needs {}, ldc={} needs {})",
                                      lda, a_cols, ldb, b_cols, ldc, n));
  if (m == 0 || n == 0) return;
  detail::GemmArgs args{trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc};
  stream.impl().gemm(args);
}

}  // namespace dp::kernels
