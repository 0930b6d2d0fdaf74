// optimizer.cu — launcher for dp/kernels/optimizer.h: one elementwise launch over every parameter
// of the model, which the engine keeps in one flat buffer (as it does their gradients and buffers).
#include <cmath>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/optimizer.h"

namespace dp::kernels {
void validate(const SgdOptions& o) {
  // torch.optim.SGD's constructor checks, with the same meaning; `!(x >= 0)` also rejects NaN, and
  // the learning rate must be finite.
  if (!(o.lr >= 0.0f) || !std::isfinite(o.lr)) checks::fail({"SGD: invalid learning rate ", o.lr});
  if (!(o.momentum >= 0.0f)) checks::fail({"SGD: invalid momentum ", o.momentum});
  if (!(o.weight_decay >= 0.0f)) checks::fail({"SGD: invalid weight_decay ", o.weight_decay});
  if (o.nesterov && o.momentum == 0.0f)
    checks::fail({"SGD: nesterov momentum requires a momentum > 0 (and zero dampening)"});
}

void validate(const AdamWOptions& o) {
  // torch.optim.AdamW's constructor checks, NaN and infinity refused too.
  const auto finite_at_least_0 = [](double v) { return std::isfinite(v) && v >= 0.0; };
  if (!finite_at_least_0(o.lr)) checks::fail({"AdamW: invalid learning rate ", o.lr});
  if (!finite_at_least_0(o.eps)) checks::fail({"AdamW: invalid epsilon value ", o.eps});
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) checks::fail({"AdamW: invalid beta parameter at index 0: ", o.beta1});
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) checks::fail({"AdamW: invalid beta parameter at index 1: ", o.beta2});
  if (!finite_at_least_0(o.weight_decay)) checks::fail({"AdamW: invalid weight_decay value ", o.weight_decay});
}

namespace {
// momentum != 0 needs a momentum buffer of the n parameters.
void check_sgd_buffer(std::int64_t n, float momentum, const float* buffer) {
  if (momentum != 0.0f && buffer == nullptr && n > 0)
    checks::fail({"sgd_step: momentum ", momentum, " needs a momentum buffer"});
}
// AdamW's step counts from 1.
void check_adamw_step(std::int64_t step) {
  if (step < 1) checks::fail({"adamw_step: step must be >= 1 (the first is 1), got ", step});
}
}  // namespace

void sgd_step(const Stream& stream, index_t n, const SgdOptions& options, bool first_step, float* params,
              const float* grads, float* momentum_buffer) {
  validate(options);
  check_sgd_buffer(n, options.momentum, momentum_buffer);
  const bool with_momentum = options.momentum != 0.0f;
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(
      stream, "sgd_step", n,
      SgdUpdate{options.lr, options.momentum, options.weight_decay, options.nesterov, first_step, params, grads, buf},
      {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0)});
}

SgdScalars sgd_scalars(const SgdOptions& options, bool first_step) { return {options.lr, first_step ? 1.0f : 0.0f}; }

void sgd_step_capturable(const Stream& stream, index_t n, const SgdOptions& options, const SgdScalars* scalars,
                         float* params, const float* grads, float* momentum_buffer) {
  validate(options);
  check_sgd_buffer(n, options.momentum, momentum_buffer);
  checks::present("sgd_step", {{"scalars", scalars}});
  const bool with_momentum = options.momentum != 0.0f;
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(stream, "sgd_step", n,
         SgdUpdate{0.0f, options.momentum, options.weight_decay, options.nesterov, false, params, grads, buf, scalars},
         {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0), operand(scalars, 1)});
}

AdamWScalars adamw_scalars(const AdamWOptions& options, std::int64_t step) {
  validate(options);
  check_adamw_step(step);
  const double bias_correction1 = 1.0 - std::pow(options.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(options.beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 - options.lr * options.weight_decay),
          static_cast<float>(-(options.lr / bias_correction1)), static_cast<float>(std::sqrt(bias_correction2))};
}

namespace {
AdamWUpdate adamw_update(const AdamWOptions& options, const AdamWScalars& values, const AdamWScalars* scalars,
                         float* params, const float* grads, float* exp_avg, float* exp_avg_sq) {
  return AdamWUpdate{values.decay,
                     static_cast<float>(options.beta1),
                     static_cast<float>(1.0 - options.beta1),
                     static_cast<float>(options.beta2),
                     static_cast<float>(1.0 - options.beta2),
                     values.neg_step_size,
                     values.bias_correction2_sqrt,
                     static_cast<float>(options.eps),
                     params,
                     grads,
                     exp_avg,
                     exp_avg_sq,
                     scalars};
}
}  // namespace

void adamw_step(const Stream& stream, index_t n, const AdamWOptions& options, std::int64_t step, float* params,
                const float* grads, float* exp_avg, float* exp_avg_sq) {
  const AdamWScalars values = adamw_scalars(options, step);
  launch(stream, "adamw_step", n, adamw_update(options, values, nullptr, params, grads, exp_avg, exp_avg_sq),
         {operand(params, n), operand(grads, n), operand(exp_avg, n), operand(exp_avg_sq, n)});
}

void adamw_step_capturable(const Stream& stream, index_t n, const AdamWOptions& options, const AdamWScalars* scalars,
                           float* params, const float* grads, float* exp_avg, float* exp_avg_sq) {
  validate(options);
  checks::present("adamw_step", {{"scalars", scalars}});
  launch(stream, "adamw_step", n, adamw_update(options, {}, scalars, params, grads, exp_avg, exp_avg_sq),
         {operand(params, n), operand(grads, n), operand(exp_avg, n), operand(exp_avg_sq, n), operand(scalars, 1)});
}

}  // namespace dp::kernels
