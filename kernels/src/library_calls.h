// library_calls.h — what the launchers call in the kernels' cuda backend folder: cuBLAS GEMM and the
// cuDNN convolutions. No CUDA types here, so every launcher compiles with any compiler; builds
// without the cuda backend link cuda/stub.cpp instead, where cudnn_available() is false.
#pragma once

#include <functional>

#include "dp/device.h"
#include "dp/kernels/conv2d.h"

namespace dp::kernels::library {

// Row-major C(m,n) = alpha * op(A)(m,k) * op(B)(k,n) + beta * C, validated by kernels::gemm.
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const float* a = nullptr;
  int lda = 0;
  const float* b = nullptr;
  int ldb = 0;
  float beta = 0.0f;
  float* c = nullptr;
  int ldc = 0;
};

void cublas_gemm(const Stream& stream, const GemmArgs& args);

bool cudnn_available();
void cudnn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                          const float* bias, float* y);
// dx (when not null) and dweight (added to with `accumulate`, else overwritten); the bias gradient
// is the launchers' own reduction (channel_sum).
// dweight may be null: the caller computes the weight gradient itself (cudnn_conv2d_weight_grad_by_gemm).
void cudnn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                           const float* dy, float* dx, float* dweight, bool accumulate);
// Whether the weight gradient of `shape` is faster by `gemm_weight_grad` (the shared im2col + cuBLAS
// path, enqueued on `stream`, writing the dweight it is given) than by cuDNN's chosen algorithm.
// Decided on the first call per (shape, precision) per device, by timing both on the stream with x
// and dy into scratch (warm-up: it waits for the stream). A call while the stream is capturing
// answers cuDNN without deciding (it cannot time; engines capture only shapes they ran eagerly).
bool cudnn_conv2d_weight_grad_by_gemm(const Stream& stream, const Conv2dShape& shape, const float* x, const float* dy,
                                      const std::function<void(float* dweight)>& gemm_weight_grad);

}  // namespace dp::kernels::library
