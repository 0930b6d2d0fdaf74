// attention.cu — launchers for dp/kernels/attention.h: per (batch, head), the score and value GEMMs
// on strided views of qkv (row stride 3C), and the causal softmax and its backward.
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

void attention_forward(const Stream& stream, const AttentionShape& s, const float* qkv, float* probs, float* y) {
  const char* op = "attention_forward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"y", y}});
  if (s.batch == 0) return;
  const int t = s.tokens, d = s.head_dim, c = static_cast<int>(s.width());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Head at = head(s, qkv, b, h);
      // scores (T, T) = scale * q (T, D) . k^T
      gemm(stream, false, true, t, t, d, scale, at.q, 3 * c, at.k, 3 * c, 0.0f, probs + at.matrix, t);
    }
  launch(stream, "attention_softmax", static_cast<index_t>(s.batch) * s.heads * t, CausalSoftmax{t, probs},
         {operand(probs, s.probs())});
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Head at = head(s, qkv, b, h);
      // y's head columns (T, D) = att (T, T) . v (T, D)
      gemm(stream, false, false, t, d, t, 1.0f, probs + at.matrix, t, at.v, 3 * c, 0.0f, y + at.y, c);
    }
}

void attention_backward(const Stream& stream, const AttentionShape& s, const float* qkv, const float* probs,
                        const float* dy, float* dqkv, float* scratch) {
  const char* op = "attention_backward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"dy", dy}, {"dqkv", dqkv}, {"scratch", scratch}});
  if (s.batch == 0) return;
  const int t = s.tokens, d = s.head_dim, c = static_cast<int>(s.width());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Head at = head(s, qkv, b, h);
      const index_t row0 = static_cast<index_t>(b) * t * 3 * c + static_cast<index_t>(h) * d;
      // d att (T, T) = dy (T, D) . v^T
      gemm(stream, false, true, t, t, d, 1.0f, dy + at.y, c, at.v, 3 * c, 0.0f, scratch + at.matrix, t);
      // dv (T, D) = att^T . dy
      gemm(stream, true, false, t, d, t, 1.0f, probs + at.matrix, t, dy + at.y, c, 0.0f, dqkv + row0 + 2 * c, 3 * c);
    }
  launch(stream, "attention_softmax_backward", static_cast<index_t>(s.batch) * s.heads * t,
         CausalSoftmaxBackward{t, probs, scratch}, {operand(probs, s.probs()), operand(scratch, s.probs())});
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Head at = head(s, qkv, b, h);
      const index_t row0 = static_cast<index_t>(b) * t * 3 * c + static_cast<index_t>(h) * d;
      // dq (T, D) = scale * d scores . k; dk (T, D) = scale * d scores^T . q
      gemm(stream, false, false, t, d, t, scale, scratch + at.matrix, t, at.k, 3 * c, 0.0f, dqkv + row0, 3 * c);
      gemm(stream, true, false, t, d, t, scale, scratch + at.matrix, t, at.q, 3 * c, 0.0f, dqkv + row0 + c, 3 * c);
    }
}

}  // namespace dp::kernels
