// cublas_gemm.cpp — kernels::gemm on cuda streams: one cublasSgemm (strided batched for a batch) with
// the device's handle, which the runtime owns (pedantic fp32 math: no TF32, so results match the
// host within fp32 rounding), or under autocast one cublasGemmEx on bf16 tensor cores.
#include "dp/runtime/detail/cuda_status.h"
#include "dp/runtime/detail/kernel_api.h"
#include "library_calls.h"

namespace dp::kernels::library {

void cublas_gemm(const Stream& stream, const GemmArgs& g) {
  // cuBLAS is column-major: row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T,
  // so swap the operands and the m/n extents; leading dimensions stay as they are.
  kernel_api::with_library(stream, kernel_api::Library::cublas, [&](kernel_api::LibraryCall& call) {
    auto handle = static_cast<cublasHandle_t>(call.handle);
    const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (!g.bf16_operands && !g.bf16_storage) {
      if (g.batch == 1)
        DP_CUDA_CHECK(cublasSgemm(handle, op_b, op_a, g.n, g.m, g.k, &g.alpha, static_cast<const float*>(g.b), g.ldb,
                                  static_cast<const float*>(g.a), g.lda, &g.beta, static_cast<float*>(g.c), g.ldc));
      else
        DP_CUDA_CHECK(cublasSgemmStridedBatched(handle, op_b, op_a, g.n, g.m, g.k, &g.alpha,
                                                static_cast<const float*>(g.b), g.ldb, g.stride_b,
                                                static_cast<const float*>(g.a), g.lda, g.stride_a, &g.beta,
                                                static_cast<float*>(g.c), g.ldc, g.stride_c, g.batch));
      return;
    }
    // Operands that are bf16 values (autocast): bf16 tensor cores, fp32 accumulation. bf16 storage
    // goes in as CUDA_R_16BF with fp32 compute and an fp32 or bf16 C (combinations cublasGemmEx lists); fp32
    // words holding bf16 values are converted down exactly by the FAST_16BF compute type. The
    // handle's pedantic math mode is lifted for this call only (it asks for the prescribed precision
    // in every phase), and restored whatever happens.
    cublasMath_t mode = CUBLAS_DEFAULT_MATH;
    DP_CUDA_CHECK(cublasGetMathMode(handle, &mode));
    DP_CUDA_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
    const cudaDataType operands = g.bf16_storage ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = g.bf16_storage ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_16BF;
    const cudaDataType output = g.c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasStatus_t status =
        g.batch == 1 ? cublasGemmEx(handle, op_b, op_a, g.n, g.m, g.k, &g.alpha, g.b, operands, g.ldb, g.a, operands,
                                    g.lda, &g.beta, g.c, output, g.ldc, compute, CUBLAS_GEMM_DEFAULT)
                     : cublasGemmStridedBatchedEx(handle, op_b, op_a, g.n, g.m, g.k, &g.alpha, g.b, operands, g.ldb,
                                                  g.stride_b, g.a, operands, g.lda, g.stride_a, &g.beta, g.c, output,
                                                  g.ldc, g.stride_c, g.batch, compute, CUBLAS_GEMM_DEFAULT);
    DP_CUDA_CHECK(cublasSetMathMode(handle, mode));
    DP_CUDA_CHECK(status);
  });
}

}  // namespace dp::kernels::library
