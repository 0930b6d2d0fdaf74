// optimizer.cu — launcher for dp/kernels/optimizer.h: one elementwise launch over every parameter
// of the model, which the engine keeps in one flat buffer (as it does their gradients and buffers).
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

}  // namespace dp::kernels
