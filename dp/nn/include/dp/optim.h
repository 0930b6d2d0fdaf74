// dp/optim.h — SGD over a model's flat parameter buffer, torch.optim.SGD semantics (dampening 0):
// g = grad + weight_decay*p; buf = first step ? g : momentum*buf + g; g = nesterov ? g + momentum*buf : buf;
// p -= lr*g. One kernel for all parameters.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dp/device.h"
#include "dp/kernels/optimizer.h"

namespace dp {

// lr, momentum, weight_decay, nesterov: defined and validated once, beside the update kernel.
using SgdOptions = kernels::SgdOptions;
using kernels::validate;  // dp::validate(options): what torch.optim.SGD (and Sgd) refuse

class Sgd {
 public:
  // Validates the options (kernels::validate: what torch.optim.SGD rejects), and allocates the
  // momentum buffer on `device` when momentum > 0.
  Sgd(Device& device, std::size_t param_count, const SgdOptions& options);

  void step(const Stream& stream, float* params, const float* grads);

  Device& device() const { return device_; }
  const SgdOptions& options() const { return options_; }
  // Validated as the constructor does (InvalidArgument for a negative, NaN or infinite lr).
  void set_lr(float lr);
  std::int64_t steps() const { return steps_; }
  // Restoring a checkpoint: the momentum buffer is written by the caller, then the step count set.
  void set_steps(std::int64_t steps) { steps_ = steps; }
  float* momentum_flat() const { return momentum_.as<float>(); }  // null without momentum
  std::size_t param_count() const { return param_count_; }

 private:
  Device& device_;
  SgdOptions options_;
  std::size_t param_count_;
  DeviceBuffer momentum_;
  std::int64_t steps_ = 0;
};

}  // namespace dp
