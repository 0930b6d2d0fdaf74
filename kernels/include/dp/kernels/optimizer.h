// dp/kernels/optimizer.h — SGD step over a flat parameter buffer (PyTorch torch.optim.SGD semantics, one launch
// for all parameters): g = grad + weight_decay * p; with momentum: buf = first ? g : momentum*buf + g
// (dampening 0), g = nesterov ? g + momentum*buf : buf; p -= lr * g.
#pragma once

#include <cmath>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/runtime/device.h"

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

// What changes from one SGD step to the next (a schedule's lr, the first step's buffer
// initialisation), as a block of device memory the update reads when it runs: a captured step
// then replays with each step's values (CUDA graphs bake launch arguments in).
struct SgdScalars {
  float lr;
  float first_step;  // 1: initialise the momentum buffer with g; 0: accumulate
};
SgdScalars sgd_scalars(const SgdOptions& options, bool first_step);
// sgd_step with `scalars` (device memory of the stream's device) in place of options.lr and
// first_step (torch's capturable=True): the same arithmetic, the same bits. options.lr is not used.
void sgd_step_capturable(const Stream& stream, index_t n, const SgdOptions& options, const SgdScalars* scalars,
                         float* params, const float* grads, float* momentum_buffer);

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

// What changes from one AdamW step to the next (see SgdScalars), computed on the host in double
// as torch computes it in Python, and rounded to float once.
struct AdamWScalars {
  float decay;          // 1 - lr*wd
  float neg_step_size;  // -lr / (1 - beta1**step)
  float bias_correction2_sqrt;
};
AdamWScalars adamw_scalars(const AdamWOptions& options, std::int64_t step);
// adamw_step with `scalars` (device memory) in place of the values that depend on lr and step.
void adamw_step_capturable(const Stream& stream, index_t n, const AdamWOptions& options, const AdamWScalars* scalars,
                           float* params, const float* grads, float* exp_avg, float* exp_avg_sq);

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
  float* buf;                           // null when momentum == 0
  const SgdScalars* scalars = nullptr;  // device memory: lr and first_step come from here instead
  DP_HD void operator()(index_t i) const {
    const float lr = scalars ? scalars->lr : this->lr;
    const bool first_step = scalars ? scalars->first_step != 0.0f : this->first_step;
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
  // The sim: the device scalars read once per launch rather than per element (a store to params
  // could alias them), so the loop over the same arithmetic vectorises.
  void host_run(index_t n) const {
    SgdUpdate f = *this;
    if (scalars) {
      f.lr = scalars->lr;
      f.first_step = scalars->first_step != 0.0f;
      f.scalars = nullptr;
    }
    for (index_t i = 0; i < n; ++i) f(i);
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
  const AdamWScalars* scalars = nullptr;  // device memory: decay, neg_step_size, bias_correction2_sqrt
  DP_HD void operator()(index_t i) const {
    const float decay = scalars ? scalars->decay : this->decay;
    const float neg_step_size = scalars ? scalars->neg_step_size : this->neg_step_size;
    const float bias_correction2_sqrt = scalars ? scalars->bias_correction2_sqrt : this->bias_correction2_sqrt;
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
  // The sim: as SgdUpdate::host_run.
  void host_run(index_t n) const {
    AdamWUpdate f = *this;
    if (scalars) {
      f.decay = scalars->decay;
      f.neg_step_size = scalars->neg_step_size;
      f.bias_correction2_sqrt = scalars->bias_correction2_sqrt;
      f.scalars = nullptr;
    }
    for (index_t i = 0; i < n; ++i) f(i);
  }
};

}  // namespace dp::kernels
