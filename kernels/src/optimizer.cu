// optimizer.cu — launcher for dp/kernels/optimizer.h: one elementwise launch over every parameter
// of the model, which the engine keeps in one flat buffer (as it does their gradients and buffers).
#include <cmath>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/optimizer.h"

namespace dp::kernels {
namespace {
// momentum != 0 needs a momentum buffer of the n parameters.
void check_sgd_buffer(std::int64_t n, float momentum, const float* buffer) {
  if (momentum != 0.0f && buffer == nullptr && n > 0)
    checks::fail({"sgd_step: momentum ", momentum, " needs a momentum buffer"});
}

SgdUpdate sgd_update(const SgdConstants& c, const SgdScalars& values, const SgdScalars* scalars, float* params,
                     const float* grads, float* buf) {
  return SgdUpdate{values.lr, c.momentum, c.weight_decay, c.nesterov, values.first_step != 0.0f, params,
                   grads,     buf,        scalars};
}

AdamWUpdate adamw_update(const AdamWConstants& c, const AdamWScalars& values, const AdamWScalars* scalars,
                         float* params, const float* grads, float* exp_avg, float* exp_avg_sq) {
  return AdamWUpdate{values.decay,
                     static_cast<float>(c.beta1),
                     static_cast<float>(1.0 - c.beta1),
                     static_cast<float>(c.beta2),
                     static_cast<float>(1.0 - c.beta2),
                     values.neg_step_size,
                     values.bias_correction2_sqrt,
                     static_cast<float>(c.eps),
                     params,
                     grads,
                     exp_avg,
                     exp_avg_sq,
                     scalars};
}
}  // namespace

SgdScalars sgd_scalars(float lr, bool first_step) { return {lr, first_step ? 1.0f : 0.0f}; }

void sgd_step(const Stream& stream, index_t n, const SgdConstants& constants, const SgdScalars& values, float* params,
              const float* grads, float* momentum_buffer) {
  check_sgd_buffer(n, constants.momentum, momentum_buffer);
  const bool with_momentum = constants.momentum != 0.0f;
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(stream, "sgd_step", n, sgd_update(constants, values, nullptr, params, grads, buf),
         {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0)});
}

void sgd_step_capturable(const Stream& stream, index_t n, const SgdConstants& constants, const SgdScalars* scalars,
                         float* params, const float* grads, float* momentum_buffer) {
  check_sgd_buffer(n, constants.momentum, momentum_buffer);
  checks::present("sgd_step", {{"scalars", scalars}});
  const bool with_momentum = constants.momentum != 0.0f;
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(stream, "sgd_step", n, sgd_update(constants, {0.0f, 0.0f}, scalars, params, grads, buf),
         {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0), operand(scalars, 1)});
}

AdamWScalars adamw_scalars(const AdamWConstants& constants, double lr, double weight_decay, std::int64_t step) {
  if (step < 1) checks::fail({"adamw_step: step must be >= 1 (the first is 1), got ", step});
  const double bias_correction1 = 1.0 - std::pow(constants.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(constants.beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(-(lr / bias_correction1)),
          static_cast<float>(std::sqrt(bias_correction2))};
}

void adamw_step(const Stream& stream, index_t n, const AdamWConstants& constants, const AdamWScalars& values,
                float* params, const float* grads, float* exp_avg, float* exp_avg_sq) {
  launch(stream, "adamw_step", n, adamw_update(constants, values, nullptr, params, grads, exp_avg, exp_avg_sq),
         {operand(params, n), operand(grads, n), operand(exp_avg, n), operand(exp_avg_sq, n)});
}

void adamw_step_capturable(const Stream& stream, index_t n, const AdamWConstants& constants,
                           const AdamWScalars* scalars, float* params, const float* grads, float* exp_avg,
                           float* exp_avg_sq) {
  checks::present("adamw_step", {{"scalars", scalars}});
  launch(stream, "adamw_step", n, adamw_update(constants, {}, scalars, params, grads, exp_avg, exp_avg_sq),
         {operand(params, n), operand(grads, n), operand(exp_avg, n), operand(exp_avg_sq, n), operand(scalars, 1)});
}

}  // namespace dp::kernels
