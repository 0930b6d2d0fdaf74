// batchnorm.h — BatchNorm2d (PyTorch semantics: eps, momentum 0.1, biased batch variance for
// normalisation, unbiased for running_var, num_batches_tracked int64) over NCHW input.
// Per-channel reductions over N*H*W are split (launch_row_reduce), never one serial thread each.
#pragma once

#include <cstdint>

#include "dp/device.h"
#include "kernels/platform.h"

namespace dp::kernels {

struct BatchNormShape {
  int n = 0, c = 0, h = 0, w = 0;
  float eps = 1e-5f;
  float momentum = 0.1f;
};

// Training forward: normalises with batch statistics, writes save_mean / save_invstd (C) for the
// backward, and updates running_mean / running_var (C) with momentum (running_var from the
// unbiased variance) and num_batches_tracked (one int64) += 1.
void batchnorm_forward_train(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                             const float* beta, float* y, float* save_mean, float* save_invstd, float* running_mean,
                             float* running_var, std::int64_t* num_batches_tracked);

// Eval forward: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
void batchnorm_forward_eval(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var, float* y);

// Training backward: dx overwritten (skipped when null); dgamma += sum(dy*xhat), dbeta += sum(dy).
void batchnorm_backward(const Stream& stream, const BatchNormShape& shape, const float* x, const float* gamma,
                        const float* save_mean, const float* save_invstd, const float* dy, float* dx, float* dgamma,
                        float* dbeta);

}  // namespace dp::kernels
