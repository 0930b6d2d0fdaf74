// loss.cpp — CrossEntropyLoss: scratch management around the loss kernels.
#include "dp/nn/loss.h"

#include <fmt/format.h>

#include "dp/kernels/loss.h"
#include "dp/runtime/error.h"

namespace dp {

CrossEntropyLoss::CrossEntropyLoss(Device& device, double label_smoothing)
    : device_(device), label_smoothing_(label_smoothing) {
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    throw InvalidArgument(fmt::format("label_smoothing must be between 0.0 and 1.0, got {}", label_smoothing));
}

const float* CrossEntropyLoss::forward(const Stream& stream, const float* logits, const std::int64_t* targets, int n,
                                       int classes) {
  if (n < 1 || classes < 1) throw InvalidArgument(fmt::format("cross entropy over {} rows of {} classes", n, classes));
  float* loss = loss_.get<float>(device_, 1);
  kernels::cross_entropy_forward(stream, n, classes, logits, targets,
                                 per_sample_.get<float>(device_, static_cast<std::size_t>(n)), loss, label_smoothing_);
  return loss;
}

void CrossEntropyLoss::backward(const Stream& stream, const float* logits, const std::int64_t* targets, int n,
                                int classes, float* dlogits, int mean_over, float dloss) {
  if (n < 1 || mean_over < n) throw InvalidArgument(fmt::format("cross entropy backward: {} rows of {}", n, mean_over));
  kernels::cross_entropy_backward(stream, n, classes, logits, targets, dloss, mean_over, dlogits, label_smoothing_);
}

const float* CrossEntropyLoss::forward_backward(const Stream& stream, const void* logits, const std::int64_t* targets,
                                                int n, int classes, void* dlogits, int mean_over, float dloss,
                                                bool bf16) {
  if (n < 1 || classes < 1) throw InvalidArgument(fmt::format("cross entropy over {} rows of {} classes", n, classes));
  if (mean_over < n) throw InvalidArgument(fmt::format("cross entropy backward: {} rows of {}", n, mean_over));
  float* loss = loss_.get<float>(device_, 1);
  kernels::cross_entropy_forward_backward(stream, n, classes, kernels::In(logits, bf16), targets,
                                          per_sample_.get<float>(device_, static_cast<std::size_t>(n)), loss, dloss,
                                          mean_over, kernels::Out(dlogits, bf16), label_smoothing_);
  return loss;
}

}  // namespace dp
