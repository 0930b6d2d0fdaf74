// dp/kernels/optimizer.h — SGD and AdamW steps over a flat parameter buffer, one launch for all
// parameters, with torch.optim's arithmetic. SGD: g = grad + weight_decay * p; with momentum:
// buf = first ? g : momentum*buf + g (dampening 0), g = nesterov ? g + momentum*buf : buf; p -= lr * g.
#pragma once

#include <cmath>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// The kernels take an update's hyper-parameters in two parts: its constants, fixed for a run, and
// the values that change from one step to the next (a schedule's lr, the first step's buffer
// initialisation, AdamW's bias corrections). A captured step bakes the constants in and reads the
// per-step values from device memory when it runs, so a replayed graph uses each step's values
// (CUDA graphs bake launch arguments in; torch's capturable=True). The user's options and what
// torch.optim refuses of them are dp::SgdOptions and dp::AdamWOptions (dp/nn/optim.h).

// torch.optim.SGD's constants (dampening 0).
struct SgdConstants {
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};
// SGD's per-step values.
struct SgdScalars {
  float lr;
  float first_step;  // 1: initialise the momentum buffer with g; 0: accumulate
};
SgdScalars sgd_scalars(float lr, bool first_step);

// One SGD step over n parameters with the per-step `values` given by the host. momentum_buffer may
// be null when momentum == 0 (InvalidArgument otherwise).
void sgd_step(const Stream& stream, index_t n, const SgdConstants& constants, const SgdScalars& values, float* params,
              const float* grads, float* momentum_buffer);
// sgd_step with the per-step values read from `scalars` (device memory of the stream's device) when
// the update runs: the same arithmetic, the same bits.
void sgd_step_capturable(const Stream& stream, index_t n, const SgdConstants& constants, const SgdScalars* scalars,
                         float* params, const float* grads, float* momentum_buffer);

// torch.optim.AdamW's constants (amsgrad off).
struct AdamWConstants {
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
};
// AdamW's per-step values, computed on the host in double as torch computes them in Python, and
// rounded to float once.
struct AdamWScalars {
  float decay;          // 1 - lr*wd
  float neg_step_size;  // -lr / (1 - beta1**step)
  float bias_correction2_sqrt;
};
// `step` is the step being taken (1 for the first, as torch's state['step'] after its increment);
// InvalidArgument below 1.
AdamWScalars adamw_scalars(const AdamWConstants& constants, double lr, double weight_decay, std::int64_t step);

// One AdamW step over n parameters with the per-step `values` given by the host. exp_avg and
// exp_avg_sq start at zero.
void adamw_step(const Stream& stream, index_t n, const AdamWConstants& constants, const AdamWScalars& values,
                float* params, const float* grads, float* exp_avg, float* exp_avg_sq);
// adamw_step with the per-step values read from `scalars` (device memory) when the update runs.
void adamw_step_capturable(const Stream& stream, index_t n, const AdamWConstants& constants,
                           const AdamWScalars* scalars, float* params, const float* grads, float* exp_avg,
                           float* exp_avg_sq);

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
