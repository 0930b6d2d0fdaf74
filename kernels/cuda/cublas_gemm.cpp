// cublas_gemm.cpp — kernels::gemm on cuda streams: one cublasSgemm with the device's handle, which
// the runtime owns (pedantic fp32 math: no TF32, so results match the host within fp32 rounding).
#include "dp/runtime/detail/cuda_status.h"
#include "dp/runtime/detail/kernel_api.h"
#include "library_calls.h"

namespace dp::kernels::library {

void cublas_gemm(const Stream& stream, const GemmArgs& g) {
  // cuBLAS is column-major: row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T,
  // so swap the operands and the m/n extents; leading dimensions stay as they are.
  kernel_api::with_library(stream, kernel_api::Library::cublas, [&](kernel_api::LibraryCall& call) {
    DP_CUDA_CHECK(cublasSgemm(static_cast<cublasHandle_t>(call.handle), g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                              g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.n, g.m, g.k, &g.alpha, g.b, g.ldb, g.a, g.lda,
                              &g.beta, g.c, g.ldc));
  });
}

}  // namespace dp::kernels::library
