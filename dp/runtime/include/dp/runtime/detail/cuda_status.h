// dp/runtime/detail/cuda_status.h — how DP_CUDA_CHECK (kernel_api.h) reads the status of each CUDA
// library. For code built against the CUDA toolkit only: the cuda backends and nvcc launch sites.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>

#include "dp/runtime/detail/kernel_api.h"

namespace dp::cuda {

template <>
struct StatusTraits<cudaError_t> {
  static constexpr cudaError_t success = cudaSuccess;
  static constexpr const char* library = "CUDA";
  static const char* message(cudaError_t s) { return cudaGetErrorString(s); }
  // An error a runtime call returned stays in the thread's last-error slot, where the next launch
  // check would report it again: once reported, it is read out (See Note [last error]).
  static void reported() noexcept { (void)cudaGetLastError(); }
};
template <>
struct StatusTraits<cublasStatus_t> {
  static constexpr cublasStatus_t success = CUBLAS_STATUS_SUCCESS;
  static constexpr const char* library = "cuBLAS";
  static const char* message(cublasStatus_t s) { return cublasGetStatusString(s); }
};
template <>
struct StatusTraits<cudnnStatus_t> {
  static constexpr cudnnStatus_t success = CUDNN_STATUS_SUCCESS;
  static constexpr const char* library = "cuDNN";
  static const char* message(cudnnStatus_t s) { return cudnnGetErrorString(s); }
};
template <>
struct StatusTraits<ncclResult_t> {
  static constexpr ncclResult_t success = ncclSuccess;
  static constexpr const char* library = "NCCL";
  static const char* message(ncclResult_t s) { return ncclGetErrorString(s); }
};

}  // namespace dp::cuda
