// dp/kernels/loss.h — CrossEntropyLoss (mean over the batch, log-softmax computed stably: max-shifted
// log-sum-exp, optional label smoothing) forward and backward, for logits (N, C) and int64 targets (N).
#pragma once

#include <cmath>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/kernels/portable_math.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// loss[0] = mean_i (logsumexp(logits_i) - logits_i[target_i]); per_sample (N) is scratch and
// receives each sample's term. n = 0 gives NaN, as PyTorch's mean over nothing does.
// Targets outside [0, C): a kernel cannot throw, so that sample's term, and so the loss, is NaN
// (never an out-of-bounds read). sim also checks the targets on the stream, after the kernels
// (they are device memory, readable only in stream order): the stream fails with
// dp::InvalidArgument naming the target and the sample, sticky like a failed kernel, raised by the
// next synchronize / copy / launch on that stream. cuda reports nothing beyond the NaN.
//
// label_smoothing = eps in [0, 1] (else InvalidArgument) as torch.nn.functional.cross_entropy's:
// the target distribution becomes (1 - eps)*onehot + eps/C, and
//   loss[0] = (1 - eps) * mean_i nll_i + (mean_i smooth_i) * (eps / C),
// nll_i = -log p_i[t_i], smooth_i = -sum_c log p_i[c], in torch 1.13's order
// (cross_entropy_loss_label_smoothing, LossNLL.cpp): the two means apart, each a sum divided by N,
// then combined with the factors 1 - eps and eps / C computed in double and rounded to float.
// per_sample[i] then receives (1 - eps) * nll_i + smooth_i * (eps / C), torch's reduction='none'
// term. eps = 0 is the plain loss above, bit for bit.
void cross_entropy_forward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                           float* per_sample, float* loss, double label_smoothing = 0.0);

// dlogits (N, C) = (softmax(logits) - q) * scale, where scale = dloss / N (pass the number of
// samples the mean runs over as `mean_over`, normally n) and q the target distribution:
// onehot(target) without smoothing, (1 - eps)*onehot + eps/C with label_smoothing = eps.
// Invalid targets as in the forward: that sample's row is NaN, and the sim stream fails.
void cross_entropy_backward(const Stream& stream, int n, int classes, const float* logits, const std::int64_t* targets,
                            float dloss, int mean_over, float* dlogits, double label_smoothing = 0.0);

// Both of the above in one launch, for callers that run them back to back on the same logits
// (the engines' training step): loss[0] and per_sample exactly as cross_entropy_forward writes
// them, dlogits exactly as cross_entropy_backward(dloss, mean_over) writes it, bit for bit. The
// mean's reduction computes each sample's term (its map) and writes that sample's gradient row
// beside it, so the row max and exp sum are computed once and the logits read once. Logits and
// dlogits may both be bf16 storage (autocast's logits): the fp32 loss of the widened logits, its
// gradient rounded once, as torch's fp32 loss on `logits.float()` and the cast's backward give them.
void cross_entropy_forward_backward(const Stream& stream, int n, int classes, In logits, const std::int64_t* targets,
                                    float* per_sample, float* loss, float dloss, int mean_over, Out dlogits,
                                    double label_smoothing = 0.0);

// ------------------------------------------------------------------------------------------------
// functors: one thread per sample; a row of C (10 for the models here) is too short to split.

// Row maximum, subtracted before exp so logits of any magnitude (1e4 and beyond) cannot overflow.
template <class T>
DP_HD float row_max(const T* x, int classes) {
  float m = load(x, 0);
  for (int c = 1; c < classes; ++c) m = max_portable(m, load(x, c));
  return m;
}

// sum_c exp(x_c - max): in [1, C], so its log is well conditioned.
template <class T>
DP_HD float shifted_exp_sum(const T* x, int classes, float max) {
  float s = 0.0f;
  for (int c = 0; c < classes; ++c) s += exp_portable(load(x, c) - max);
  return s;
}

// per_sample[i] = logsumexp(x_i) - x_i[t] = log(sum) - (x_i[t] - max). Subtracting the logits first
// keeps the error relative to the term itself: (max + log(sum)) - x_i[t] would round at the
// magnitude of the logits (1e-3 at 1e4) and then cancel.
struct CrossEntropyRow {
  const float* logits;
  const std::int64_t* targets;
  int classes;
  float* per_sample;
  DP_HD void operator()(index_t i) const {
    const float* x = logits + i * classes;
    const std::int64_t t = targets[i];
    if (t < 0 || t >= classes) {
      per_sample[i] = NAN;  // never index out of bounds; sim also reports it (see cross_entropy_forward)
      return;
    }
    const float m = row_max(x, classes);
    per_sample[i] = log_portable(shifted_exp_sum(x, classes, m)) - (x[t] - m);
  }
};

// Mean of the per-sample terms as one row reduction: map(0, i) = per_sample[i].
struct PerSampleTerm {
  const float* per_sample;
  DP_HD float operator()(index_t, index_t i) const { return per_sample[i]; }
};
// Divides rather than multiplying by 1/n, as PyTorch's mean reduction does.
struct StoreMean {
  float* out;
  float count;
  DP_HD void operator()(index_t, float sum) const { out[0] = sum / count; }
};

// Label smoothing: both of torch's per-sample terms, -log p_t and -sum_c log p_c, each -log p_c
// written as CrossEntropyRow's term (so nll is that term's bits). Summed as a pair by one reduction.
struct SmoothedTerms {
  float nll = 0.0f, smooth = 0.0f;
  DP_HD SmoothedTerms operator+(const SmoothedTerms& o) const { return {nll + o.nll, smooth + o.smooth}; }
};
// From the row's max m and log_sum = log(shifted_exp_sum), for a valid target t.
template <class T>
DP_HD SmoothedTerms smoothed_terms_of_row(const T* x, int classes, std::int64_t t, float m, float log_sum) {
  float smooth = 0.0f;
  for (int c = 0; c < classes; ++c) smooth += log_sum - (load(x, c) - m);
  return {log_sum - (load(x, t) - m), smooth};
}
DP_HD inline SmoothedTerms smoothed_terms(const float* x, int classes, std::int64_t t) {
  if (t < 0 || t >= classes) return {NAN, NAN};
  const float m = row_max(x, classes);
  return smoothed_terms_of_row(x, classes, t, m, log_portable(shifted_exp_sum(x, classes, m)));
}

// per_sample[i] = (1 - eps) * nll_i + smooth_i * (eps / C), as torch's reduction='none' combines them.
struct SmoothedCrossEntropyRow {
  const float* logits;
  const std::int64_t* targets;
  int classes;
  float one_minus_eps, eps_over_classes;
  float* per_sample;
  DP_HD void operator()(index_t i) const {
    const SmoothedTerms t = smoothed_terms(logits + i * classes, classes, targets[i]);
    per_sample[i] = mul_unfused(one_minus_eps, t.nll) + mul_unfused(t.smooth, eps_over_classes);
  }
};

// The reduction's map(0, i): sample i's pair, recomputed from the logits (C exps: cheaper than a
// second N-float scratch for every caller).
struct SmoothedTermsOfSample {
  const float* logits;
  const std::int64_t* targets;
  int classes;
  DP_HD SmoothedTerms operator()(index_t, index_t i) const {
    return smoothed_terms(logits + i * classes, classes, targets[i]);
  }
};
// torch: nll_mean = sum / N; smooth_mean = sum / N; (1 - eps) * nll_mean + smooth_mean * (eps / C),
// each product a float multiplication of its own (never fused into the addition).
struct StoreSmoothedMean {
  float* out;
  float count;
  float one_minus_eps, eps_over_classes;
  DP_HD void operator()(index_t, const SmoothedTerms& sum) const {
    out[0] = mul_unfused(one_minus_eps, sum.nll / count) + mul_unfused(sum.smooth / count, eps_over_classes);
  }
};

// dx_c = (exp(x_c - m) / s - q_c) * scale for a valid target t: q_c = target_on at t, else target_off.
template <class T>
DP_HD void softmax_grad_row(const T* x, int classes, std::int64_t t, float m, float s, float scale, float target_on,
                            float target_off, T* dx) {
  for (int c = 0; c < classes; ++c)
    store(dx, c, (exp_portable(load(x, c) - m) / s - (c == t ? target_on : target_off)) * scale);
}

// A target outside [0, classes): the row's gradient is NaN instead of an out-of-bounds index (the
// launchers also report it). Returns whether it was.
template <class T>
DP_HD bool nan_row_if_bad_target(std::int64_t t, int classes, T* dx) {
  if (t >= 0 && t < classes) return false;
  for (int c = 0; c < classes; ++c) store(dx, c, NAN);
  return true;
}

// dlogits_i = (softmax(x_i) - q) * scale, softmax recomputed from the logits (C is small, so this
// is cheaper than storing it in the forward); q_c = target_on for c = t, else target_off (1 and 0
// without label smoothing: the plain loss's bits).
struct CrossEntropyBackwardRow {
  const float* logits;
  const std::int64_t* targets;
  int classes;
  float scale;
  float target_on, target_off;
  float* dlogits;
  DP_HD void operator()(index_t i) const {
    const float* x = logits + i * classes;
    float* dx = dlogits + i * classes;
    const std::int64_t t = targets[i];
    if (nan_row_if_bad_target(t, classes, dx)) return;
    const float m = row_max(x, classes);
    softmax_grad_row(x, classes, t, m, shifted_exp_sum(x, classes, m), scale, target_on, target_off, dx);
  }
};

// ------------------------------------------------------------------------------------------------
// fused forward + backward: launch_row_reduce maps, called exactly once per sample (its contract),
// that write the sample's per_sample term and gradient row and return what the mean sums.

// Without label smoothing: CrossEntropyRow's term (returned, and kept in per_sample) and
// CrossEntropyBackwardRow's row, from one row max and exp sum.
// Logits and dlogits of T: fp32, or bf16 storage (widened on load, each gradient rounded once).
template <class T = float>
struct CrossEntropyForwardBackwardTerm {
  const T* logits;
  const std::int64_t* targets;
  int classes;
  float scale;
  float target_on, target_off;
  float* per_sample;
  T* dlogits;
  DP_HD float operator()(index_t, index_t i) const {
    const T* x = logits + i * classes;
    T* dx = dlogits + i * classes;
    const std::int64_t t = targets[i];
    if (nan_row_if_bad_target(t, classes, dx)) {
      per_sample[i] = NAN;
      return NAN;
    }
    const float m = row_max(x, classes);
    const float s = shifted_exp_sum(x, classes, m);
    const float term = log_portable(s) - (load(x, t) - m);
    softmax_grad_row(x, classes, t, m, s, scale, target_on, target_off, dx);
    per_sample[i] = term;
    return term;
  }
};

// With label smoothing: SmoothedTermsOfSample's pair (returned), SmoothedCrossEntropyRow's
// per_sample term and CrossEntropyBackwardRow's row.
template <class T = float>
struct SmoothedCrossEntropyForwardBackwardTerm {
  const T* logits;
  const std::int64_t* targets;
  int classes;
  float one_minus_eps, eps_over_classes;
  float scale;
  float target_on, target_off;
  float* per_sample;
  T* dlogits;
  DP_HD SmoothedTerms operator()(index_t, index_t i) const {
    const T* x = logits + i * classes;
    T* dx = dlogits + i * classes;
    const std::int64_t t = targets[i];
    if (nan_row_if_bad_target(t, classes, dx)) {
      per_sample[i] = NAN;
      return {NAN, NAN};
    }
    const float m = row_max(x, classes);
    const float s = shifted_exp_sum(x, classes, m);
    const SmoothedTerms terms = smoothed_terms_of_row(x, classes, t, m, log_portable(s));
    softmax_grad_row(x, classes, t, m, s, scale, target_on, target_off, dx);
    per_sample[i] = mul_unfused(one_minus_eps, terms.nll) + mul_unfused(terms.smooth, eps_over_classes);
    return terms;
  }
};

}  // namespace dp::kernels
