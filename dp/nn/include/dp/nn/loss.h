// dp/nn/loss.h — CrossEntropyLoss (mean over the batch, stable log-softmax, optional label smoothing
// with torch.nn.CrossEntropyLoss(label_smoothing=...)'s formula), on the device.
#pragma once

#include <cstdint>

#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"

namespace dp {

class CrossEntropyLoss {
 public:
  // label_smoothing in [0, 1] (InvalidArgument otherwise): the target distribution is
  // (1 - label_smoothing) * onehot + label_smoothing / classes.
  explicit CrossEntropyLoss(Device& device, double label_smoothing = 0.0);
  double label_smoothing() const { return label_smoothing_; }

  // Enqueues the mean loss of `n` rows of `classes` logits; returns a device pointer to one float,
  // valid until the next forward. Targets are int64 class indices in device memory.
  const float* forward(const Stream& stream, const float* logits, const std::int64_t* targets, int n, int classes);

  // dlogits = dloss * d(mean over `mean_over` rows)/dlogits for these n rows (mean_over = n for a
  // plain batch; DP passes the global batch when it splits the gradient across devices).
  void backward(const Stream& stream, const float* logits, const std::int64_t* targets, int n, int classes,
                float* dlogits, int mean_over, float dloss = 1.0f);

  // forward then backward on the same logits and targets in one kernel (the training step's pair):
  // the same loss and dlogits, bit for bit, as the two calls; returns forward's pointer. `bf16`:
  // logits and dlogits are bf16 storage (a model's output under autocast, Model::forward_for_loss),
  // the loss that of the widened logits and dlogits rounded once (torch: the fp32 loss of
  // `logits.float()`, the cast's backward).
  const float* forward_backward(const Stream& stream, const void* logits, const std::int64_t* targets, int n,
                                int classes, void* dlogits, int mean_over, float dloss = 1.0f, bool bf16 = false);

 private:
  Device& device_;
  double label_smoothing_;  // in double, as torch takes it from Python
  Scratch per_sample_, loss_;
};

}  // namespace dp
