// cudnn_conv.h — the cuDNN convolution path (cuda backend only). No cuDNN types here, so kernels/
// can call it from any compiler; without cuDNN in the build, cudnn_available() is false.
#pragma once

#include "dp/src/backend.h"
#include "kernels/conv2d.h"

namespace dp::cuda {

bool cudnn_available();
void cudnn_conv2d_forward(detail::StreamImpl& stream, const kernels::Conv2dShape& shape, const float* x,
                          const float* weight, const float* bias, float* y);
void cudnn_conv2d_backward(detail::StreamImpl& stream, const kernels::Conv2dShape& shape, const float* x,
                           const float* weight, const float* dy, float* dx, float* dweight, float* dbias);

}  // namespace dp::cuda
