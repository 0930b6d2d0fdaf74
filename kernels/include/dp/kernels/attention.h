// dp/kernels/attention.h — causal multi-head self-attention's core, as nanoGPT's CausalSelfAttention
// computes it between its two Linears: from the QKV projection's output qkv (B, T, 3C), q, k and v
// side by side in each row, head h the columns [h*D, (h+1)*D) of each (C = H*D),
//   att = softmax(mask(q k^T / sqrt(D))) per (batch, head), the mask keeping key j <= query i,
//   y (B, T, C) = att v with the heads side by side again (torch's transpose(1, 2).view(B, T, C)).
// The products are kernels::gemm_batched (cuBLAS / OpenBLAS), one call per head over the batch;
// the softmax and its backward are one thread per row, summing the row in order: the same bits on
// both backends. fp32 throughout.
#pragma once

#include <cmath>

#include "dp/kernels/dropout.h"
#include "dp/kernels/platform.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

struct AttentionShape {
  int batch = 0, tokens = 0, heads = 0, head_dim = 0;                       // B, T, H, D
  index_t width() const { return static_cast<index_t>(heads) * head_dim; }  // C
  index_t probs() const { return static_cast<index_t>(batch) * heads * tokens * tokens; }
};

// nanoGPT's attn_dropout: Dropout(p) on the attention probabilities before they weight the values,
// drawn as dropout_forward draws (dropout.h) over the (B, H, T, T) probabilities, the batch's first
// element at `element_offset` of the step's; `dropped` (B*H*T*T floats) holds the dropped
// probabilities from the forward to the backward. p = 0: none (`dropped` unused).
struct AttentionDropout {
  double p = 0.0;
  DropoutKey key;
  index_t element_offset = 0;
  float* dropped = nullptr;
};

// y (B, T, C) and probs (B, H, T, T: att, kept for the backward; zeros above the diagonal).
void attention_forward(const Stream& stream, const AttentionShape& shape, const float* qkv, float* probs, float* y,
                       const AttentionDropout& dropout = {});

// dqkv (B, T, 3C) overwritten from dy (B, T, C); scratch: B*H*T*T floats. `dropout`: the forward's.
void attention_backward(const Stream& stream, const AttentionShape& shape, const float* qkv, const float* probs,
                        const float* dy, float* dqkv, float* scratch, const AttentionDropout& dropout = {});

// ------------------------------------------------------------------------------------------------
// functors: one thread per row of a (T, T) matrix; row r of the launch is query r % T.

// p[i, j] = exp(s[i, j] - max) / sum for j <= i (the scaled scores), 0 for j > i; in place.
struct CausalSoftmax {
  int tokens;
  float* scores;
  DP_HD void operator()(index_t row) const {
    const int i = static_cast<int>(row % tokens);
    float* s = scores + row * tokens;
    float m = s[0];
    for (int j = 1; j <= i; ++j) m = fmaxf(m, s[j]);
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) {
      s[j] = expf(s[j] - m);
      sum += s[j];
    }
    for (int j = 0; j <= i; ++j) s[j] = s[j] / sum;
    for (int j = i + 1; j < tokens; ++j) s[j] = 0.0f;
  }
};

// ds[i, j] = p[i, j] * (dp[i, j] - sum_k p[i, k] dp[i, k]) (softmax's backward), in place in dp.
struct CausalSoftmaxBackward {
  int tokens;
  const float* probs;
  float* grads;
  DP_HD void operator()(index_t row) const {
    const int i = static_cast<int>(row % tokens);
    const float* p = probs + row * tokens;
    float* g = grads + row * tokens;
    float dot = 0.0f;
    for (int j = 0; j <= i; ++j) dot += p[j] * g[j];
    for (int j = 0; j <= i; ++j) g[j] = p[j] * (g[j] - dot);
    for (int j = i + 1; j < tokens; ++j) g[j] = 0.0f;
  }
};

}  // namespace dp::kernels
