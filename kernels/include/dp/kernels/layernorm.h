// dp/kernels/layernorm.h — LayerNorm over the last dimension (torch.nn.LayerNorm(C): per row of C
// values, the biased variance, eps inside the square root, fp32 statistics, an elementwise affine
// gamma and beta), forward and backward, on a (rows, C) row-major tensor: a transformer's (B*T, C)
// activations. The row statistics, the row sums of the backward and the column sums of the
// parameter gradients follow the reduction plan (launch_row_reduce, reduce_plan.h): summed in one
// order on cuda and sim. Activations are fp32 or bf16 storage (storage.h): x and dx share one, y and
// dy each have their own (under autocast a LayerNorm of the fp32 residual stream whose reader rounds
// its output to bf16 writes that bf16 directly, and takes its gradient as bf16).
#pragma once

#include <cmath>

#include "dp/kernels/elementwise.h"
#include "dp/kernels/moments.h"
#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// y = (x - mean) * rstd * gamma + beta per row; mean and rstd (rows each) kept for the backward.
// rows >= 0, cols >= 1, eps >= 0, else InvalidArgument.
void layernorm_forward(const Stream& stream, index_t rows, index_t cols, In x, const float* gamma, const float* beta,
                       Out y, float* mean, float* rstd, float eps = 1e-5f);

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma (overwritten; skipped when
// null); dgamma (+)= sum over rows of dy * xhat, dbeta (+)= sum of dy (`accumulate`, else stored).
// row_sums: scratch of 2 * rows floats. `dx_add` (dx's storage, may be null): a gradient added to
// dx in the same pass, the bits of add(dx, dx_add) after it (a residual's shortcut: the stream's
// gradient is the block's input gradient plus the sum's). `dx_rounded` (bf16, may be null; only
// beside an fp32 dx): dx's values rounded in the same pass, the bits of to_bf16(dx) after it (under
// autocast the residual stream's gradient, which the branch below rounds for its bf16 Linear).
void layernorm_backward(const Stream& stream, index_t rows, index_t cols, In x, const float* gamma, const float* mean,
                        const float* rstd, In dy, Out dx, float* dgamma, float* dbeta, float* row_sums,
                        bool accumulate = true, In dx_add = nullptr, Out dx_rounded = nullptr);

// ------------------------------------------------------------------------------------------------
// functors

// The statistics are BatchNorm's over rows instead of channels: the row sums (RowElement) times 1/C
// (BnStoreMean), then the deviations from that mean, plain and squared (the corrected two-pass form).
template <class T>
DP_HD float ln_xhat(const T* x, index_t i, const float* mean, const float* rstd, index_t row) {
  return (load(x, i) - mean[row]) * rstd[row];
}
template <class T>
struct LnRowMoments {
  const T* x;
  index_t cols;
  const float* mean;
  DP_HD SumPair operator()(index_t row, index_t col) const {
    const float d = load(x, row * cols + col) - mean[row];
    return SumPair{d, d * d};
  }
};
struct LnStoreRstd {
  float* rstd;
  float cols, eps;
  DP_HD void operator()(index_t row, SumPair s) const {
    rstd[row] = 1.0f / sqrtf(centered_squares(s, cols) / cols + eps);
  }
};

template <class T, class U = T>
struct LnNormalize {
  index_t cols;
  const T* x;
  const float* mean;
  const float* rstd;
  const float* gamma;
  const float* beta;
  U* y;
  DP_HD void operator()(index_t row, index_t col) const {
    const index_t i = row * cols + col;
    store(y, i, ln_xhat(x, i, mean, rstd, row) * gamma[col] + beta[col]);
  }
};

// Backward row sums: a = sum(g), b = sum(g * xhat), g = dy * gamma.
template <class T, class D = T>
struct LnGradTerms {
  const T* x;
  const D* dy;
  const float* gamma;
  const float* mean;
  const float* rstd;
  index_t cols;
  DP_HD SumPair operator()(index_t row, index_t col) const {
    const index_t i = row * cols + col;
    const float g = load(dy, i) * gamma[col];
    return SumPair{g, g * ln_xhat(x, i, mean, rstd, row)};
  }
};
struct LnStoreRowSums {
  index_t rows;
  float* sums;
  DP_HD void operator()(index_t row, SumPair s) const {
    sums[row] = s.a;
    sums[rows + row] = s.b;
  }
};

template <class T, class D = T>
struct LnInputGrad {
  index_t rows, cols;
  const T* x;
  const D* dy;
  const float* gamma;
  const float* mean;
  const float* rstd;
  const float* sums;
  float inv_cols;
  T* dx;
  const T* add = nullptr;            // added to dx as stored, as a separate add would (null: none)
  std::uint16_t* rounded = nullptr;  // dx as stored, rounded to bf16 (null: none)
  DP_HD void operator()(index_t row, index_t col) const {
    const index_t i = row * cols + col;
    const float xhat = ln_xhat(x, i, mean, rstd, row);
    const float g = load(dy, i) * gamma[col];
    const float grad = rstd[row] * (g - sums[row] * inv_cols - xhat * (sums[rows + row] * inv_cols));
    T own[1];  // the gradient as dx would hold it, then the sum as add() forms it
    store(own, 0, grad);
    if (add != nullptr) store(own, 0, load(own, 0) + load(add, i));
    dx[i] = own[0];
    if (rounded != nullptr) store(rounded, i, load(own, 0));
  }
};

// Parameter gradients: column c's terms over the rows, a = dy * xhat (dgamma), b = dy (dbeta).
template <class T, class D = T>
struct LnParamTerms {
  const T* x;
  const D* dy;
  const float* mean;
  const float* rstd;
  index_t cols;
  DP_HD SumPair operator()(index_t col, index_t row) const {
    const index_t i = row * cols + col;
    const float g = load(dy, i);
    return SumPair{g * ln_xhat(x, i, mean, rstd, row), g};
  }
};
struct LnStoreParamGrads {
  float* dgamma;
  float* dbeta;
  bool accumulate;
  DP_HD void operator()(index_t col, SumPair s) const {
    dgamma[col] = accumulate ? dgamma[col] + s.a : s.a;
    dbeta[col] = accumulate ? dbeta[col] + s.b : s.b;
  }
};

}  // namespace dp::kernels
