// dp/kernels/linear.h — nn.Linear forward and backward: y = x·W^T + b with W (out, in), PyTorch's layout.
// The products are kernels::gemm (cuBLAS / OpenBLAS); only the bias broadcast is a kernel here.
#pragma once

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// y (n, out) = x (n, in) · weight (out, in)^T + bias (out). bias may be null (no bias term).
// x and weight (and dy below) are fp32, or all bf16 storage (autocast: the GEMMs take bf16
// operands and accumulate in fp32); y, dx and the gradients are fp32, for the caller to round.
void linear_forward(const Stream& stream, int n, int in, int out, In x, In weight, const float* bias, float* y);

// Gradients of linear_forward given dy (n, out). With `accumulate`, dweight and dbias accumulate
// (+=), as autograd accumulates into .grad; without, they are overwritten (the first backward after
// zero_grad, as torch's set_to_none: nothing is read from them, so whatever they held is gone).
// dx is always overwritten. dx null: not computed (the first layer's input needs no gradient);
// dbias null: the layer has no bias.
//   dx = dy · W,  dW (+)= dy^T · x,  db (+)= sum over the batch of dy.
void linear_backward(const Stream& stream, int n, int in, int out, In x, In weight, In dy, float* dx, float* dweight,
                     float* dbias, bool accumulate = true);

// ------------------------------------------------------------------------------------------------
// functors

// y[r, c] = bias[c]: the gemm then adds x·W^T onto it (beta = 1), which is how PyTorch's addmm
// composes the bias, so the one rounding of the sum happens in the same place.
struct BroadcastBias {
  const float* bias;
  index_t out;
  float* y;
  DP_HD void operator()(index_t i) const { y[i] = bias[i % out]; }
  void host_run(index_t n) const {  // the sim: row by row, no modulo per element
    for (index_t row = 0; row < n; row += out)
      for (index_t j = 0; j < out && row + j < n; ++j) y[row + j] = bias[j];
  }
};

}  // namespace dp::kernels
