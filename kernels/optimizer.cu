// optimizer.cu — launcher for kernels/optimizer.h: one elementwise launch over every parameter
// of the model, which the engine keeps in one flat buffer (as it does their gradients and buffers).
#include <string>

#include "dp/error.h"
#include "kernels/launch.h"
#include "kernels/optimizer.h"

namespace dp::kernels {

void sgd_step(const Stream& stream, index_t n, const SgdOptions& options, bool first_step, float* params,
              const float* grads, float* momentum_buffer) {
  // The same checks, with the same meaning, as torch.optim.SGD's constructor. `!(x >= 0)` also
  // rejects NaN.
  if (!(options.lr >= 0.0f)) throw InvalidArgument("sgd_step: invalid learning rate " + std::to_string(options.lr));
  if (!(options.momentum >= 0.0f))
    throw InvalidArgument("sgd_step: invalid momentum " + std::to_string(options.momentum));
  if (!(options.weight_decay >= 0.0f))
    throw InvalidArgument("sgd_step: invalid weight_decay " + std::to_string(options.weight_decay));
  if (options.nesterov && options.momentum == 0.0f)
    throw InvalidArgument("sgd_step: nesterov momentum requires a momentum > 0");
  const bool with_momentum = options.momentum != 0.0f;
  if (with_momentum && momentum_buffer == nullptr && n > 0)
    throw InvalidArgument("sgd_step: momentum " + std::to_string(options.momentum) + " needs a momentum buffer");
  float* buf = with_momentum ? momentum_buffer : nullptr;
  launch(
      stream, "sgd_step", n,
      SgdUpdate{options.lr, options.momentum, options.weight_decay, options.nesterov, first_step, params, grads, buf},
      {operand(params, n), operand(grads, n), operand(buf, with_momentum ? n : 0)});
}

}  // namespace dp::kernels
