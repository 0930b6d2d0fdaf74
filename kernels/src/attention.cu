// attention.cu — launchers for dp/kernels/attention.h: per head, the score and value GEMMs over the
// batch on strided views of qkv (row stride 3C), and the causal softmax and its backward.
#include <cmath>
#include <limits>

#include "checks.h"
#include "dp/kernels/attention.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/ops.h"

namespace dp::kernels {
namespace {

void check_attention(const char* op, const AttentionShape& s) {
  if (s.batch < 0 || s.tokens < 1 || s.heads < 1 || s.head_dim < 1 ||
      static_cast<index_t>(s.tokens) * s.width() * 3 > std::numeric_limits<int>::max())
    checks::fail({op, ": need batch >= 0, tokens, heads and head_dim >= 1 and 3*T*C below 2^31, got B=", s.batch,
                  " T=", s.tokens, " H=", s.heads, " D=", s.head_dim});
}

// Views of one (batch, head): q, k and v in qkv (row stride 3C), the head's columns of y (C).
struct Head {
  const float* q;
  const float* k;
  const float* v;
  index_t y;       // the head's first element in a (B, T, C) tensor
  index_t matrix;  // its (T, T) matrix's first element in probs
};
Head head(const AttentionShape& s, const float* qkv, int b, int h) {
  const index_t c = s.width(), row0 = static_cast<index_t>(b) * s.tokens;
  const float* base = qkv + row0 * 3 * c + static_cast<index_t>(h) * s.head_dim;
  return {base, base + c, base + 2 * c, row0 * c + static_cast<index_t>(h) * s.head_dim,
          (static_cast<index_t>(b) * s.heads + h) * s.tokens * s.tokens};
}

}  // namespace

// One head's products over the whole batch: strided batched GEMMs (one launch each on cuda) whose
// batch index is the sample b; qkv's samples lie T*3C apart, y's T*C, probs' H*T*T.
void attention_forward(const Stream& stream, const AttentionShape& s, const float* qkv, float* probs, float* y) {
  const char* op = "attention_forward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"y", y}});
  if (s.batch == 0) return;
  const int t = s.tokens, d = s.head_dim, c = static_cast<int>(s.width());
  const std::int64_t qkv_stride = static_cast<std::int64_t>(t) * 3 * c, y_stride = static_cast<std::int64_t>(t) * c,
                     p_stride = static_cast<std::int64_t>(s.heads) * t * t;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int h = 0; h < s.heads; ++h) {
    const Head at = head(s, qkv, 0, h);
    // scores (T, T) = scale * q (T, D) . k^T
    gemm_batched(stream, false, true, t, t, d, scale, at.q, 3 * c, qkv_stride, at.k, 3 * c, qkv_stride, 0.0f,
                 probs + at.matrix, t, p_stride, s.batch);
  }
  launch(stream, "attention_softmax", static_cast<index_t>(s.batch) * s.heads * t, CausalSoftmax{t, probs},
         {operand(probs, s.probs())});
  for (int h = 0; h < s.heads; ++h) {
    const Head at = head(s, qkv, 0, h);
    // y's head columns (T, D) = att (T, T) . v (T, D)
    gemm_batched(stream, false, false, t, d, t, 1.0f, probs + at.matrix, t, p_stride, at.v, 3 * c, qkv_stride, 0.0f,
                 y + at.y, c, y_stride, s.batch);
  }
}

void attention_backward(const Stream& stream, const AttentionShape& s, const float* qkv, const float* probs,
                        const float* dy, float* dqkv, float* scratch) {
  const char* op = "attention_backward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"dy", dy}, {"dqkv", dqkv}, {"scratch", scratch}});
  if (s.batch == 0) return;
  const int t = s.tokens, d = s.head_dim, c = static_cast<int>(s.width());
  const std::int64_t qkv_stride = static_cast<std::int64_t>(t) * 3 * c, y_stride = static_cast<std::int64_t>(t) * c,
                     p_stride = static_cast<std::int64_t>(s.heads) * t * t;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int h = 0; h < s.heads; ++h) {
    const Head at = head(s, qkv, 0, h);
    const index_t col = static_cast<index_t>(h) * d;  // the head's first column in a row of qkv
    // d att (T, T) = dy (T, D) . v^T
    gemm_batched(stream, false, true, t, t, d, 1.0f, dy + at.y, c, y_stride, at.v, 3 * c, qkv_stride, 0.0f,
                 scratch + at.matrix, t, p_stride, s.batch);
    // dv (T, D) = att^T . dy
    gemm_batched(stream, true, false, t, d, t, 1.0f, probs + at.matrix, t, p_stride, dy + at.y, c, y_stride, 0.0f,
                 dqkv + col + 2 * c, 3 * c, qkv_stride, s.batch);
  }
  launch(stream, "attention_softmax_backward", static_cast<index_t>(s.batch) * s.heads * t,
         CausalSoftmaxBackward{t, probs, scratch}, {operand(probs, s.probs()), operand(scratch, s.probs())});
  for (int h = 0; h < s.heads; ++h) {
    const Head at = head(s, qkv, 0, h);
    const index_t col = static_cast<index_t>(h) * d;
    // dq (T, D) = scale * d scores . k; dk (T, D) = scale * d scores^T . q
    gemm_batched(stream, false, false, t, d, t, scale, scratch + at.matrix, t, p_stride, at.k, 3 * c, qkv_stride, 0.0f,
                 dqkv + col, 3 * c, qkv_stride, s.batch);
    gemm_batched(stream, true, false, t, d, t, scale, scratch + at.matrix, t, p_stride, at.q, 3 * c, qkv_stride, 0.0f,
                 dqkv + col + c, 3 * c, qkv_stride, s.batch);
  }
}

}  // namespace dp::kernels
