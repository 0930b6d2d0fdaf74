// stub.cpp — builds without the cuda backend have no cuBLAS or cuDNN path (sim streams never ask).
#include "dp/runtime/error.h"
#include "library_calls.h"

namespace dp::kernels::library {

void cublas_gemm(const Stream&, const GemmArgs&) {
  throw Error("cuBLAS GEMM requested, but dp was built without the cuda backend");
}
bool cudnn_available() { return false; }
bool cudnn_supports_bf16(const Stream&, const Conv2dShape&) { return false; }
void cudnn_conv2d_forward(const Stream&, const Conv2dShape&, const float*, const float*, const float*, float*,
                          const GemmWeightGrad&) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}
bool cudnn_conv2d_backward(const Stream&, const Conv2dShape&, const float*, const float*, const float*, float*, float*,
                           bool, ConvWeightGrad, const GemmWeightGrad&) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}

void cudnn_conv2d_forward_bf16(const Stream&, const Conv2dShape&, const void*, const void*, void*) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}
void cudnn_conv2d_backward_bf16(const Stream&, const Conv2dShape&, const void*, const void*, const void*, void*, float*,
                                bool) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}

}  // namespace dp::kernels::library
