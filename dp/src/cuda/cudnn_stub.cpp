// cudnn_stub.cpp — builds without the cuda backend have no cuDNN path.
#include "dp/error.h"
#include "cudnn_conv.h"

namespace dp::cuda {

bool cudnn_available() { return false; }
void cudnn_conv2d_forward(detail::StreamImpl&, const kernels::Conv2dShape&, const float*, const float*, const float*,
                          float*) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}
void cudnn_conv2d_backward(detail::StreamImpl&, const kernels::Conv2dShape&, const float*, const float*, const float*,
                           float*, float*, float*) {
  throw Error("cuDNN convolution requested, but dp was built without the cuda backend");
}

}  // namespace dp::cuda
