// dp/kernels/linear.h — nn.Linear forward and backward: y = x·W^T + b with W (out, in), PyTorch's layout.
// The products are kernels::gemm (cuBLAS / OpenBLAS); only the bias broadcast is a kernel here.
#pragma once

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// y (n, out) = x (n, in) · weight (out, in)^T + bias (out). bias may be null (no bias term).
// x and weight (and dy below) are fp32, or all bf16 storage (autocast: the GEMMs take bf16
// operands and accumulate in fp32). y and dx are fp32, or with bf16 operands also bf16 storage: the
// bias rounded to bf16 and the product added in fp32 and rounded once (torch's autocast addmm, whose
// bias is cast to bf16 too). The parameter gradients are fp32.
void linear_forward(const Stream& stream, int n, int in, int out, In x, In weight, const float* bias, Out y);

// Gradients of linear_forward given dy (n, out). With `accumulate`, dweight and dbias accumulate
// (+=), as autograd accumulates into .grad; without, they are overwritten (the first backward after
// zero_grad, as torch's set_to_none: nothing is read from them, so whatever they held is gone).
// dx is always overwritten. dx null: not computed (the first layer's input needs no gradient);
// dbias null: the layer has no bias. dweight may be bf16 storage where x and dy are (autocast's
// weight gradient, rounded once; it is then overwritten, never accumulated).
//   dx = dy · W,  dW (+)= dy^T · x,  db (+)= sum over the batch of dy.
void linear_backward(const Stream& stream, int n, int in, int out, In x, In weight, In dy, Out dx, Out dweight,
                     float* dbias, bool accumulate = true);

// ------------------------------------------------------------------------------------------------
// functors

// y[r, c] = bias[c]: the gemm then adds x·W^T onto it (beta = 1), which is how PyTorch's addmm
// composes the bias, so the one rounding of the sum happens in the same place.
// y of either storage (bf16: the bias rounded).
template <class T = float>
struct BroadcastBias {
  const float* bias;
  index_t out;
  T* y;
  DP_HD void operator()(index_t i) const { store(y, i, bias[i % out]); }
  // The sim: row by row, no modulo per element, each row's length known before its loop (a loop
  // with a second exit does not vectorise: 6x slower).
  void host_run(index_t n) const {
    for (index_t row = 0; row < n; row += out) {
      const index_t m = out < n - row ? out : n - row;
      for (index_t j = 0; j < m; ++j) store(y, row + j, bias[j]);
    }
  }
};

}  // namespace dp::kernels
