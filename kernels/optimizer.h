// optimizer.h — SGD step over a flat parameter buffer (PyTorch torch.optim.SGD semantics, one launch
// for all parameters): g = grad + weight_decay * p; with momentum: buf = first ? g : momentum*buf + g
// (dampening 0), g = nesterov ? g + momentum*buf : buf; p -= lr * g.
#pragma once

#include "dp/device.h"
#include "kernels/platform.h"

namespace dp::kernels {

struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// momentum_buffer may be null when options.momentum == 0. first_step: the buffer is initialised with g.
void sgd_step(const Stream& stream, index_t n, const SgdOptions& options, bool first_step, float* params,
              const float* grads, float* momentum_buffer);

}  // namespace dp::kernels
