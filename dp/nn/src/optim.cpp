// optim.cpp — Sgd: option checks, the momentum buffer, and the one-launch update.
#include "dp/optim.h"

#include "dp/kernels/ops.h"
#include "dp/kernels/optimizer.h"

namespace dp {

Sgd::Sgd(Device& device, std::size_t param_count, const SgdOptions& options)
    : device_(device), options_(options), param_count_(param_count) {
  kernels::validate(options);
  if (options.momentum > 0.0f) {
    momentum_ = device.allocate(param_count * sizeof(float));
    // Zeros until the first step sets it (buf = g, as torch): a state saved before any step then
    // holds zeros, not whatever the allocation held (which may well read as NaN).
    const Stream stream = device.create_stream();
    kernels::fill(stream, momentum_.as<float>(), static_cast<kernels::index_t>(param_count), 0.0f);
    stream.synchronize();
  }
}

void Sgd::set_lr(float lr) {
  SgdOptions options = options_;
  options.lr = lr;
  kernels::validate(options);
  options_ = options;
}

void Sgd::step(const Stream& stream, float* params, const float* grads) {
  kernels::sgd_step(stream, static_cast<kernels::index_t>(param_count_), options_, steps_ == 0, params, grads,
                    momentum_.as<float>());
  ++steps_;
}

}  // namespace dp
