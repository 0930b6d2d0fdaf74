// optimizer.h — SGD step over a flat parameter buffer (PyTorch torch.optim.SGD semantics, one launch
// for all parameters): g = grad + weight_decay * p; with momentum: buf = first ? g : momentum*buf + g
// (dampening 0), g = nesterov ? g + momentum*buf : buf; p -= lr * g.
#pragma once

#include <cmath>

#include "dp/device.h"
#include "dp/kernels/platform.h"

namespace dp::kernels {

// torch.optim.SGD's hyper-parameters (dampening 0). The one definition: dp::SgdOptions is this.
struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// Throws InvalidArgument for what torch.optim.SGD rejects: a negative (or NaN) lr, momentum or
// weight_decay, nesterov without momentum; and a learning rate that is not finite.
void validate(const SgdOptions& options);

// momentum_buffer may be null when options.momentum == 0. first_step: the buffer is initialised with g.
// Validates the options, and rejects a null buffer when momentum != 0 (InvalidArgument).
void sgd_step(const Stream& stream, index_t n, const SgdOptions& options, bool first_step, float* params,
              const float* grads, float* momentum_buffer);

// ------------------------------------------------------------------------------------------------
// functors

// a*b rounded to fp32 on its own. nvcc contracts a*b + c into one FMA by default; __fmul_rn is
// never contracted. The host compiler does not contract: the build passes -ffp-contract=off for
// all host code (it also passes -mfma, so fmaf below is one instruction rather than a libm call).
DP_HD inline float mul_unfused(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// One element of torch's SGD step with torch's fp32 roundings, so results match it bit for bit:
// ATen's x.add(y, alpha=a) is one fused multiply-add x + a*y (vec::fmadd on CPU; nvcc contracts
// it on CUDA), while buf.mul_(momentum).add_(g) is two kernels, so two roundings.
struct SgdUpdate {
  float lr, momentum, weight_decay;
  bool nesterov, first_step;
  float* params;
  const float* grads;
  float* buf;  // null when momentum == 0
  DP_HD void operator()(index_t i) const {
    const float p = params[i];
    float g = grads[i];
    if (weight_decay != 0.0f) g = fmaf(weight_decay, p, g);  // d_p = d_p.add(p, alpha=wd)
    if (momentum != 0.0f) {
      // torch: buf = clone(d_p) on the first step, else buf.mul_(momentum).add_(d_p)
      const float b = first_step ? g : mul_unfused(momentum, buf[i]) + g;
      buf[i] = b;
      g = nesterov ? fmaf(momentum, b, g) : b;  // d_p.add(buf, alpha=momentum)
    }
    params[i] = fmaf(-lr, g, p);  // p.add_(d_p, alpha=-lr)
  }
};

}  // namespace dp::kernels
