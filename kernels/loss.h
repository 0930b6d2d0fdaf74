// loss.h — CrossEntropyLoss (mean over the batch, log-softmax computed stably: max-shifted
// log-sum-exp) forward and backward, for logits (N, C) and int64 targets (N).
#pragma once

#include <cstdint>

#include "dp/device.h"
#include "kernels/platform.h"

namespace dp::kernels {

// loss[0] = mean_i (logsumexp(logits_i) - logits_i[target_i]); per_sample (N) is scratch and
// receives each sample's term. Targets outside [0, C) make the kernel throw (sim) before running.
void cross_entropy_forward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                           float* per_sample, float* loss);

// dlogits (N, C) = (softmax(logits) - onehot(target)) * scale, where scale = dloss / N
// (pass the number of samples the mean runs over as `mean_over`, normally n).
void cross_entropy_backward(const Stream& stream, int n, int classes, const float* logits,
                            const std::int64_t* targets, float dloss, int mean_over, float* dlogits);

}  // namespace dp::kernels
