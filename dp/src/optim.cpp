// optim.cpp — Sgd: option checks, the momentum buffer, and the one-launch update.
#include "dp/optim.h"

#include <cmath>
#include <fmt/format.h>

#include "dp/error.h"
#include "kernels/optimizer.h"

namespace dp {

Sgd::Sgd(Device& device, std::size_t param_count, const SgdOptions& options)
    : options_(options), param_count_(param_count) {
  if (!(options.lr >= 0.0f) || !std::isfinite(options.lr))
    throw InvalidArgument(fmt::format("SGD: invalid learning rate {}", options.lr));
  if (!(options.momentum >= 0.0f)) throw InvalidArgument(fmt::format("SGD: invalid momentum {}", options.momentum));
  if (!(options.weight_decay >= 0.0f))
    throw InvalidArgument(fmt::format("SGD: invalid weight_decay {}", options.weight_decay));
  if (options.nesterov && options.momentum <= 0.0f)
    throw InvalidArgument("SGD: nesterov momentum requires a momentum > 0 (and zero dampening)");
  if (options.momentum > 0.0f) momentum_ = device.allocate(param_count * sizeof(float));
}

void Sgd::step(const Stream& stream, float* params, const float* grads) {
  const kernels::SgdOptions k{options_.lr, options_.momentum, options_.weight_decay, options_.nesterov};
  kernels::sgd_step(stream, static_cast<kernels::index_t>(param_count_), k, steps_ == 0, params, grads,
                    momentum_.as<float>());
  ++steps_;
}

}  // namespace dp
