// optimizer.h — SGD step over a flat parameter buffer (PyTorch torch.optim.SGD semantics, one launch
// for all parameters): g = grad + weight_decay * p; with momentum: buf = first ? g : momentum*buf + g
// (dampening 0), g = nesterov ? g + momentum*buf : buf; p -= lr * g.
#pragma once

#include <cmath>
#include <cstdint>

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

// torch.optim.AdamW's hyper-parameters (amsgrad off), with torch's defaults.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// Throws InvalidArgument for what torch.optim.AdamW rejects: lr < 0, eps < 0, betas outside
// [0, 1), weight_decay < 0 (and NaN or infinite values).
void validate(const AdamWOptions& options);

// One AdamW step over n parameters; `step` is the step being taken (1 for the first, as torch's
// state['step'] after its increment). exp_avg and exp_avg_sq start at zero.
void adamw_step(const Stream& stream, index_t n, const AdamWOptions& options, std::int64_t step, float* params,
                const float* grads, float* exp_avg, float* exp_avg_sq);

// ------------------------------------------------------------------------------------------------
// functors

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

// One element of torch 1.13's _single_tensor_adamw with its fp32 roundings. The per-step scalars
// are computed on the host in double, as Python does, and rounded to float once, as torch does
// when it hands a Python float to an fp32 kernel:
//   param.mul_(1 - lr*wd); exp_avg.mul_(b1).add_(g, alpha=1-b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)
//   denom = (exp_avg_sq.sqrt() / sqrt(1 - b2**step)).add_(eps); param.addcdiv_(exp_avg, denom, value=-lr/(1 -
//   b1**step))
// add(alpha) and addcmul round as one fused multiply-add in the torch build the goldens come from
// (as in SgdUpdate); addcdiv cannot (it divides), so it rounds three times, as ATen writes it.
struct AdamWUpdate {
  float decay;  // 1 - lr*wd
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1**step)
  float bias_correction2_sqrt;
  float eps;
  float* params;
  const float* grads;
  float* exp_avg;
  float* exp_avg_sq;
  DP_HD void operator()(index_t i) const {
    const float g = grads[i];
    const float p = mul_unfused(params[i], decay);
    const float m = fmaf(one_minus_beta1, g, mul_unfused(exp_avg[i], beta1));
    const float v = fmaf(mul_unfused(one_minus_beta2, g), g, mul_unfused(exp_avg_sq[i], beta2));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const float denom = sqrtf(v) / bias_correction2_sqrt + eps;
    // addcdiv as ATen writes it: self + value * t1 / t2, three roundings (no fused operation).
    params[i] = p + mul_unfused(neg_step_size, m) / denom;
  }
};

}  // namespace dp::kernels
