// check.h — the one macro every CUDA / cuBLAS / cuDNN / NCCL call goes through.
// It throws dp::Error carrying file:line, the call as written and the library's error string.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "dp/error.h"

namespace dp::cuda {

[[noreturn]] void throw_call_error(const char* library, int code, const char* message, const char* call,
                                   const char* file, int line);

inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) throw_call_error("CUDA", static_cast<int>(status), cudaGetErrorString(status), call, file, line);
}
inline void check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw_call_error("cuBLAS", static_cast<int>(status), cublasGetStatusString(status), call, file, line);
}

}  // namespace dp::cuda

// Overloads for cuDNN and NCCL statuses live in check_cudnn.h / check_nccl.h so that files not
// using those libraries need not include their headers.
#define DP_CUDA_CHECK(call) ::dp::cuda::check((call), #call, __FILE__, __LINE__)
