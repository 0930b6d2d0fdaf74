// dp/kernels/batchnorm.h — BatchNorm2d (PyTorch semantics: eps, momentum 0.1, biased batch variance for
// normalisation, unbiased for running_var, num_batches_tracked int64) over NCHW input.
// Per-channel reductions over N*H*W follow the reduction plan (launch_row_reduce, reduce_plan.h):
// split into many blocks, summed in one order on cuda and sim.
#pragma once

#include <cmath>
#include <cstdint>

#include "dp/kernels/elementwise.h"
#include "dp/kernels/moments.h"
#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

struct BatchNormShape {
  int n = 0, c = 0, h = 0, w = 0;
  float eps = 1e-5f;
  float momentum = 0.1f;
};

// Every entry point takes its activations (x, y, dy, dx, relu_y) in one storage type, fp32 or bf16
// bits (storage.h); statistics, parameters and sums are fp32 either way.

// Training forward: normalises with batch statistics, writes save_mean / save_invstd (C) for the
// backward, and updates running_mean / running_var (C) with momentum (running_var from the
// unbiased variance) and num_batches_tracked (one int64) += 1.
// Needs N*H*W >= 2: like torch.nn.BatchNorm2d ("Expected more than 1 value per channel when
// training") it throws InvalidArgument for one value per channel, where the unbiased variance
// would be 0/0 (aten's native_batch_norm, below the module check, writes NaN into running_var).
// relu = true fuses a following ReLU (torch.relu's bits, ReluForward): y = relu(batchnorm(x)).
void batchnorm_forward_train(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                             const float* beta, Out y, float* save_mean, float* save_invstd, float* running_mean,
                             float* running_var, std::int64_t* num_batches_tracked, bool relu = false);

// Eval forward: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
void batchnorm_forward_eval(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var, Out y,
                            bool relu = false);

// Training backward: dx overwritten (skipped when null); dgamma += sum(dy*xhat), dbeta += sum(dy)
// with `accumulate`, dgamma = ..., dbeta = ... without (the first backward after zero_grad).
// grad_sums: scratch of 2*C floats for this call's per-channel sums (dx needs them, not the
// accumulated dgamma/dbeta). Needs N*H*W >= 2, as the training forward does.
// relu_y: the output of a forward with relu = true, and dy then the gradient of that output: dy
// passes through ReLU's mask (ReluBackward's bits) as it is read, where an unfused ReLU backward
// would have written the masked gradient first. Null: no ReLU.
void batchnorm_backward(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                        const float* save_mean, const float* save_invstd, In dy, Out dx, float* dgamma, float* dbeta,
                        float* grad_sums, In relu_y = nullptr, bool accumulate = true);

// SyncBatchNorm (torch.nn.SyncBatchNorm): the statistics are those of every replica's batch
// together. The kernels stay pure: the caller (nn's BatchNorm2d) sums buffers over the replicas
// between them, as torch's module does between its statistics and normalisation kernels:
//   forward:  sync_batchnorm_sums -> all-reduce sums (C) -> sync_batchnorm_moments ->
//             all-reduce moments (2C) -> sync_batchnorm_normalize
//   backward: sync_batchnorm_backward_sums -> all-reduce grad_sums (2C) -> sync_batchnorm_backward_dx
// `global_count` is the sum of the replicas' N*H*W (>= 2, exact as a float, at least this replica's
// own), checked by every phase before it enqueues anything. The mean is the summed sums times 1/M
// (in place in `mean`, which the forward then keeps as save_mean); the variance comes from the
// centred moments around it (invstd and the running statistics, unbiased with the global count, as
// torch's batch_norm_gather_stats_with_counts). The backward adds this replica's own sum(dy),
// sum(dy*xhat) to dbeta, dgamma (stores them without `accumulate`; torch's SyncBatchNorm leaves the
// averaging over replicas to DDP's gradient all-reduce) and computes dx from the summed grad_sums.
void sync_batchnorm_sums(const Stream& stream, const BatchNormShape& shape, In x, float* sums, index_t global_count);
void sync_batchnorm_moments(const Stream& stream, const BatchNormShape& shape, In x, float* mean, float* moments,
                            index_t global_count);
void sync_batchnorm_normalize(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                              const float* beta, Out y, float* save_mean, float* save_invstd, float* running_mean,
                              float* running_var, std::int64_t* num_batches_tracked, const float* moments,
                              index_t global_count, bool relu = false);
void sync_batchnorm_backward_sums(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                                  const float* save_mean, const float* save_invstd, In dy, float* dgamma, float* dbeta,
                                  float* grad_sums, index_t global_count, In relu_y = nullptr, bool accumulate = true);
void sync_batchnorm_backward_dx(const Stream& stream, const BatchNormShape& shape, In x, const float* gamma,
                                const float* save_mean, const float* save_invstd, In dy, Out dx, const float* grad_sums,
                                index_t global_count, In relu_y = nullptr);

// ------------------------------------------------------------------------------------------------
// functors

// Pass 2: deviations from the pass-1 mean, summed plain (a) and squared (b). Squared deviations
// avoid E[x^2]-E[x]^2 cancellation; the plain sum corrects for the rounding of the mean itself
// (the "corrected two-pass" variance: sum d^2 - (sum d)^2 / M).
template <class T>
struct BnCenteredMoments {
  ChannelElement at;
  const T* x;
  const float* mean;
  DP_HD SumPair operator()(index_t c, index_t j) const {
    const float d = load(x, at(c, j)) - mean[c];
    return SumPair{d, d * d};
  }
  void host_add_terms(index_t c, index_t j, index_t count, SumPair* lanes) const {
    const float m = mean[c];
    at.host_walk(c, j, count, [&](index_t k, index_t i) {
      const float d = load(x, i) - m;
      lanes[k] = lanes[k] + SumPair{d, d * d};
    });
  }
};

// Finishes the statistics of channel c: invstd for this batch and the momentum update of the
// running statistics (unbiased variance, M/(M-1), as PyTorch). One thread per channel runs it;
// channel 0's also counts the batch (num_batches_tracked += 1): the counter lives on the device,
// like PyTorch's buffer, and needs no launch of its own.
struct BnStoreVariance {
  const float* mean;
  float* invstd;
  float* running_mean;
  float* running_var;
  std::int64_t* num_batches_tracked;
  float count;  // M as a float
  float eps, momentum;
  DP_HD void operator()(index_t c, SumPair s) const {
    if (c == 0) *num_batches_tracked += 1;
    const float centered = centered_squares(s, count);
    invstd[c] = 1.0f / sqrtf(centered / count + eps);
    running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean[c];
    running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (centered / (count - 1.0f));
  }
};

// SyncBatchNorm: a row reduction's pair kept for the all-reduce (a at [c], b at [C + c]), and the
// variance finished from the summed pairs.
struct BnStorePair {
  index_t channels;
  float* out;
  DP_HD void operator()(index_t c, SumPair s) const {
    out[c] = s.a;
    out[channels + c] = s.b;
  }
};
struct BnFinishVariance {
  BnStoreVariance store;
  index_t channels;
  const float* sums;
  DP_HD void operator()(index_t c) const { store(c, SumPair{sums[c], sums[channels + c]}); }
};

// y = (x - mean) * invstd * gamma + beta, channel of element i taken from the NCHW index.
template <class T>
struct BnNormalize {
  ChannelElement at;
  const T* x;
  const float* mean;
  const float* invstd;
  const float* gamma;
  const float* beta;
  T* y;
  bool relu;  // y = relu(batchnorm(x)): a following ReLU fused
  // plane_index = n*C + c: one (n, c) plane of H*W elements, j within it (launch_2d).
  DP_HD void operator()(index_t plane_index, index_t j) const {
    const index_t c = at.channel_of(plane_index), i = plane_index * at.plane + j;
    const float v = (load(x, i) - mean[c]) * invstd[c] * gamma[c] + beta[c];
    store(y, i, relu ? kernels::relu(v) : v);
  }
  // The sim: plane by plane, the channel's parameters read once per plane.
  void host_run(index_t rows, index_t cols) const {
    for (index_t row = 0; row < rows; ++row) {
      const index_t c = row % at.channels;
      const float m = mean[c], s = invstd[c], g = gamma[c], b = beta[c];
      const T* in = x + row * at.plane;
      T* out = y + row * at.plane;
      if (relu)
        for (index_t j = 0; j < cols; ++j) store(out, j, kernels::relu((load(in, j) - m) * s * g + b));
      else
        for (index_t j = 0; j < cols; ++j) store(out, j, (load(in, j) - m) * s * g + b);
    }
  }
};

// Eval: the running statistics, invstd recomputed per element (cheaper than another launch).
template <class T>
struct BnNormalizeEval {
  ChannelElement at;
  float eps;
  const T* x;
  const float* running_mean;
  const float* running_var;
  const float* gamma;
  const float* beta;
  T* y;
  bool relu;
  DP_HD void operator()(index_t plane_index, index_t j) const {
    const index_t c = at.channel_of(plane_index), i = plane_index * at.plane + j;
    const float v = (load(x, i) - running_mean[c]) / sqrtf(running_var[c] + eps) * gamma[c] + beta[c];
    store(y, i, relu ? kernels::relu(v) : v);
  }
};

// dy[i], or with a fused ReLU (relu_y, its output) the gradient ReLU's backward would have written.
template <class T>
DP_HD float bn_output_grad(const T* dy, const T* relu_y, index_t i) {
  return relu_y ? relu_grad(load(relu_y, i), load(dy, i)) : load(dy, i);
}

// Backward sums per channel: a = sum(dy), b = sum(dy * xhat).
template <class T>
struct BnGradTerms {
  ChannelElement at;
  const T* x;
  const T* dy;
  const float* mean;
  const float* invstd;
  const T* relu_y;  // null unless a ReLU was fused into the forward
  DP_HD SumPair operator()(index_t c, index_t j) const {
    const index_t i = at(c, j);
    const float g = bn_output_grad(dy, relu_y, i);
    return SumPair{g, g * (load(x, i) - mean[c]) * invstd[c]};
  }
  void host_add_terms(index_t c, index_t j, index_t count, SumPair* lanes) const {
    const float m = mean[c], s = invstd[c];
    at.host_walk(c, j, count, [&](index_t k, index_t i) {
      const float g = bn_output_grad(dy, relu_y, i);
      lanes[k] = lanes[k] + SumPair{g, g * (load(x, i) - m) * s};
    });
  }
};
// dbeta += a, dgamma += b (PyTorch accumulates .grad); this call's sums are also kept in
// grad_sums (sum(dy) at [c], sum(dy*xhat) at [C + c]) for the dx pass.
struct BnStoreGradSums {
  index_t channels;
  float* dgamma;
  float* dbeta;
  float* grad_sums;
  bool accumulate;  // add to the parameter gradients, or store (the first backward after zero_grad)
  DP_HD void operator()(index_t c, SumPair s) const {
    dbeta[c] = accumulate ? dbeta[c] + s.a : s.a;
    dgamma[c] = accumulate ? dgamma[c] + s.b : s.b;
    grad_sums[c] = s.a;
    grad_sums[channels + c] = s.b;
  }
};

// dx = gamma*invstd/M * (M*dy - sum(dy) - xhat*sum(dy*xhat)), written with the sums divided by M
// first so no term grows with M.
template <class T>
struct BnInputGradTerm {
  const T* x;
  const T* dy;
  const float* gamma;
  const float* mean;
  const float* invstd;
  float inv_count;  // 1/M
  const T* relu_y;  // as BnGradTerms
  DP_HD float operator()(index_t c, index_t i, float sum_dy, float sum_dy_xhat) const {
    const float xhat = (load(x, i) - mean[c]) * invstd[c];
    return gamma[c] * invstd[c] *
           (bn_output_grad(dy, relu_y, i) - sum_dy * inv_count - xhat * (sum_dy_xhat * inv_count));
  }
};
template <class T>
struct BnInputGrad {
  ChannelElement at;
  BnInputGradTerm<T> term;
  const float* grad_sums;
  T* dx;
  DP_HD void operator()(index_t plane_index, index_t j) const {
    const index_t c = at.channel_of(plane_index), i = plane_index * at.plane + j;
    store(dx, i, term(c, i, grad_sums[c], grad_sums[at.channels + c]));
  }
  // The sim: plane by plane, BnInputGradTerm's arithmetic with the channel's values read once.
  void host_run(index_t rows, index_t cols) const {
    for (index_t row = 0; row < rows; ++row) {
      const index_t c = row % at.channels, base = row * at.plane;
      const float m = term.mean[c], s = term.invstd[c], scale = term.gamma[c] * s;
      const float a = grad_sums[c] * term.inv_count, b = grad_sums[at.channels + c] * term.inv_count;
      const T* x = term.x + base;
      T* out = dx + base;
      for (index_t j = 0; j < cols; ++j) {
        const float xhat = (load(x, j) - m) * s;
        store(out, j, scale * (bn_output_grad(term.dy, term.relu_y, base + j) - a - xhat * b));
      }
    }
  }
};

}  // namespace dp::kernels
