// optimizer.cu — launcher for dp/kernels/optimizer.h: one elementwise launch over every parameter
// of the model, which the engine keeps in one flat buffer (as it does their gradients and buffers).
#include <cmath>

#include "checks.h"
#include "dp/kernels/launch.h"
#include "dp/kernels/optimizer.h"

namespace dp::kernels {

void sgd_step(const Stream& stream, index_t n, const SgdOptions& options, bool first_step, float* params,
              const float* grads, float* momentum_buffer) {
  validate(options);
  checks::sgd_buffer(n, options.momentum, momentum_buffer);
  const bool with_momentum = options.momentum != 0.0f;
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(
      stream, "sgd_step", n,
      SgdUpdate{options.lr, options.momentum, options.weight_decay, options.nesterov, first_step, params, grads, buf},
      {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0)});
}

void adamw_step(const Stream& stream, index_t n, const AdamWOptions& options, std::int64_t step, float* params,
                const float* grads, float* exp_avg, float* exp_avg_sq) {
  validate(options);
  checks::adamw_step(step);
  const double bias_correction1 = 1.0 - std::pow(options.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(options.beta2, static_cast<double>(step));
  const AdamWUpdate update{static_cast<float>(1.0 - options.lr * options.weight_decay),
                           static_cast<float>(options.beta1),
                           static_cast<float>(1.0 - options.beta1),
                           static_cast<float>(options.beta2),
                           static_cast<float>(1.0 - options.beta2),
                           static_cast<float>(-(options.lr / bias_correction1)),
                           static_cast<float>(std::sqrt(bias_correction2)),
                           static_cast<float>(options.eps),
                           params,
                           grads,
                           exp_avg,
                           exp_avg_sq};
  launch(stream, "adamw_step", n, update,
         {operand(params, n), operand(grads, n), operand(exp_avg, n), operand(exp_avg_sq, n)});
}

}  // namespace dp::kernels
