// conv2d.h — Conv2d forward/backward (PyTorch semantics: weight (C_out, C_in, KH, KW), bias (C_out),
// any stride and zero padding, NCHW row-major). Shared path: im2col/col2im + GEMM, which both
// backends run; on cuda a cuDNN path is the default when available (set_conv_cudnn(false) turns it off).
#pragma once

#include <cstddef>

#include "dp/device.h"
#include "kernels/platform.h"

namespace dp::kernels {

struct Conv2dShape {
  int n = 0, c_in = 0, h = 0, w = 0;  // input  (N, C_in, H, W)
  int c_out = 0, kh = 0, kw = 0;      // weight (C_out, C_in, KH, KW)
  int stride = 1, pad = 0;
  DP_HD int h_out() const { return (h + 2 * pad - kh) / stride + 1; }
  DP_HD int w_out() const { return (w + 2 * pad - kw) / stride + 1; }
};

// Floats of scratch the caller provides to conv2d_forward / conv2d_backward for this shape.
std::size_t conv2d_workspace_floats(const Conv2dShape& shape);

// y (N, C_out, H_out, W_out) = conv(x, weight) + bias. bias may be null.
void conv2d_forward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                    const float* bias, float* y, float* workspace);

// Given dy (N, C_out, H_out, W_out): dx = dL/dx (overwritten; skipped when dx is null),
// dweight += dL/dweight, dbias += dL/dbias (accumulated, as PyTorch accumulates .grad; dbias may be null).
void conv2d_backward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                     const float* dy, float* dx, float* dweight, float* dbias, float* workspace);

// Whether conv2d_* use cuDNN on cuda streams (default: true when dp was built with cuDNN).
// The sim backend always runs the shared im2col path.
void set_conv_cudnn(bool enabled);
bool conv_cudnn_enabled();

}  // namespace dp::kernels
