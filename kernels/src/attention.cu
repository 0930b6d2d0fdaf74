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

// Where each head's operands lie, as offsets from the tensors' starts in sample 0, and the strides
// that step a strided batched GEMM from one sample to the next: head h's q, k and v are columns
// [h*D, (h+1)*D) of qkv's rows (stride 3C) at column offsets 0, C and 2C, its columns of y (and dy)
// the same [h*D, (h+1)*D) of rows of C, its (T, T) matrix of probs the h-th of sample 0's H.
struct Layout {
  int t, d, c;
  std::int64_t qkv_stride, y_stride, p_stride;  // T*3C, T*C, H*T*T
  float scale;                                  // 1/sqrt(D)
  explicit Layout(const AttentionShape& s)
      : t(s.tokens),
        d(s.head_dim),
        c(static_cast<int>(s.width())),
        qkv_stride(static_cast<std::int64_t>(t) * 3 * c),
        y_stride(static_cast<std::int64_t>(t) * c),
        p_stride(static_cast<std::int64_t>(s.heads) * t * t),
        scale(1.0f / std::sqrt(static_cast<float>(d))) {}
  index_t column(int h) const { return static_cast<index_t>(h) * d; }
  index_t matrix(int h) const { return static_cast<index_t>(h) * t * t; }
};

}  // namespace

// One head's products over the whole batch: strided batched GEMMs (one launch each on cuda) whose
// batch index is the sample.
void attention_forward(const Stream& stream, const AttentionShape& s, const float* qkv, float* probs, float* y,
                       const AttentionDropout& dropout) {
  const char* op = "attention_forward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"y", y}});
  if (dropout.p > 0.0) checks::present(op, {{"dropout.dropped", dropout.dropped}});
  if (s.batch == 0) return;
  const Layout l(s);
  const int t = l.t, d = l.d, c = l.c;
  for (int h = 0; h < s.heads; ++h) {
    const float* q = qkv + l.column(h);
    // scores (T, T) = scale * q (T, D) . k^T
    gemm_batched(stream, false, true, t, t, d, l.scale, q, 3 * c, l.qkv_stride, q + c, 3 * c, l.qkv_stride, 0.0f,
                 probs + l.matrix(h), t, l.p_stride, s.batch);
  }
  launch(stream, "attention_softmax", static_cast<index_t>(s.batch) * s.heads * t, CausalSoftmax{t, probs},
         {operand(probs, s.probs())});
  // att = attn_dropout(att): what weights the values, the softmax's own output kept for its backward.
  const float* att = probs;
  if (dropout.p > 0.0) {
    dropout_forward(stream, s.probs(), dropout.p, dropout.key, dropout.element_offset, probs, dropout.dropped);
    att = dropout.dropped;
  }
  for (int h = 0; h < s.heads; ++h) {
    // y's head columns (T, D) = att (T, T) . v (T, D)
    gemm_batched(stream, false, false, t, d, t, 1.0f, att + l.matrix(h), t, l.p_stride, qkv + l.column(h) + 2 * c,
                 3 * c, l.qkv_stride, 0.0f, y + l.column(h), c, l.y_stride, s.batch);
  }
}

void attention_backward(const Stream& stream, const AttentionShape& s, const float* qkv, const float* probs,
                        const float* dy, float* dqkv, float* scratch, const AttentionDropout& dropout) {
  const char* op = "attention_backward";
  check_attention(op, s);
  checks::present(op, {{"qkv", qkv}, {"probs", probs}, {"dy", dy}, {"dqkv", dqkv}, {"scratch", scratch}});
  if (dropout.p > 0.0) checks::present(op, {{"dropout.dropped", dropout.dropped}});
  if (s.batch == 0) return;
  const Layout l(s);
  const int t = l.t, d = l.d, c = l.c;
  const float* att = dropout.p > 0.0 ? dropout.dropped : probs;  // what weighted the values
  for (int h = 0; h < s.heads; ++h) {
    const index_t col = l.column(h);
    // d att (T, T) = dy (T, D) . v^T
    gemm_batched(stream, false, true, t, t, d, 1.0f, dy + col, c, l.y_stride, qkv + col + 2 * c, 3 * c, l.qkv_stride,
                 0.0f, scratch + l.matrix(h), t, l.p_stride, s.batch);
    // dv (T, D) = att^T . dy
    gemm_batched(stream, true, false, t, d, t, 1.0f, att + l.matrix(h), t, l.p_stride, dy + col, c, l.y_stride, 0.0f,
                 dqkv + col + 2 * c, 3 * c, l.qkv_stride, s.batch);
  }
  // Through the dropout: d probs = d att * noise, the same mask.
  if (dropout.p > 0.0)
    dropout_backward(stream, s.probs(), dropout.p, dropout.key, dropout.element_offset, scratch, scratch);
  launch(stream, "attention_softmax_backward", static_cast<index_t>(s.batch) * s.heads * t,
         CausalSoftmaxBackward{t, probs, scratch}, {operand(probs, s.probs()), operand(scratch, s.probs())});
  for (int h = 0; h < s.heads; ++h) {
    const index_t col = l.column(h);
    // dq (T, D) = scale * d scores . k; dk (T, D) = scale * d scores^T . q
    gemm_batched(stream, false, false, t, d, t, l.scale, scratch + l.matrix(h), t, l.p_stride, qkv + col + c, 3 * c,
                 l.qkv_stride, 0.0f, dqkv + col, 3 * c, l.qkv_stride, s.batch);
    gemm_batched(stream, true, false, t, d, t, l.scale, scratch + l.matrix(h), t, l.p_stride, qkv + col, 3 * c,
                 l.qkv_stride, 0.0f, dqkv + col + c, 3 * c, l.qkv_stride, s.batch);
  }
}

// ------------------------------------------------------------------------------------------------
// fused

namespace {

AttentionRows attention_rows(const char* op, const AttentionShape& s, const AttentionDropout& dropout) {
  check_attention(op, s);
  if (s.head_dim > kAttentionMaxHeadDim)
    checks::fail({op, ": the fused attention takes head dims up to ", kAttentionMaxHeadDim, ", got D=", s.head_dim,
                  " (--attention unfused takes any)"});
  if (!(dropout.p >= 0.0 && dropout.p <= 1.0) || dropout.element_offset < 0)
    checks::fail({op, ": attn_dropout needs p in [0, 1] and element_offset >= 0, got p=", dropout.p,
                  " element_offset=", dropout.element_offset});
  const Layout l(s);
  return {s.tokens,
          s.heads,
          s.head_dim,
          s.width(),
          l.scale,
          dropout.p > 0.0,
          dropout.key,
          dropout_threshold(dropout.p),
          dropout_noise_kept(dropout.p),
          dropout.element_offset};
}

index_t row_count(const AttentionShape& s) { return static_cast<index_t>(s.batch) * s.heads * s.tokens; }

}  // namespace

index_t attention_fused_rows(const AttentionShape& s) { return row_count(s); }

// One thread per query row (rows of a warp are consecutive queries of one head, reading the same
// key and value rows at the same time).
void attention_fused_forward(const Stream& stream, const AttentionShape& s, In qkv, Out y, float* lse,
                             const AttentionDropout& dropout) {
  const char* op = "attention_fused_forward";
  const AttentionRows rows = attention_rows(op, s, dropout);
  checks::present(op, {{"qkv", qkv.data}, {"y", y.data}, {"lse", lse}});
  checks::same_storage(op, {qkv.bf16, y.bf16});
  if (s.batch == 0) return;
  const index_t n = row_count(s), tokens = static_cast<index_t>(s.batch) * s.tokens;
  with_storage(qkv.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, op, n, AttentionFusedForward<T>{rows, qkv.as<T>(), y.as<T>(), lse},
           {operand(qkv.as<T>(), tokens * 3 * s.width()), operand(y.as<T>(), tokens * s.width()), operand(lse, n),
            operand(dropout.key.step_on_device, rows.dropping && dropout.key.step_on_device ? 1 : 0)});
  });
}

// The query pass (dq and each row's delta), then the key pass (dk and dv): each sum has one owner
// and a fixed order, so the result does not depend on the launch (no atomics). Traffic as each pass
// moves it: the query pass writes dq's third of dqkv, the key pass dk's and dv's two thirds.
void attention_fused_backward(const Stream& stream, const AttentionShape& s, In qkv, In y, const float* lse, In dy,
                              Out dqkv, float* delta, const AttentionDropout& dropout) {
  const char* op = "attention_fused_backward";
  const AttentionRows rows = attention_rows(op, s, dropout);
  checks::present(
      op, {{"qkv", qkv.data}, {"y", y.data}, {"lse", lse}, {"dy", dy.data}, {"dqkv", dqkv.data}, {"delta", delta}});
  checks::same_storage(op, {qkv.bf16, y.bf16, dy.bf16, dqkv.bf16});
  if (s.batch == 0) return;
  const index_t n = row_count(s), tokens = static_cast<index_t>(s.batch) * s.tokens;
  const index_t wide = tokens * 3 * s.width(), narrow = tokens * s.width();
  const index_t step = rows.dropping && dropout.key.step_on_device ? 1 : 0;
  with_storage(qkv.bf16, [&](auto t) {
    using T = decltype(t);
    const T *q = qkv.as<T>(), *out = y.as<T>(), *g = dy.as<T>();
    T* dq = dqkv.as<T>();
    launch(stream, "attention_fused_backward_query", n, AttentionFusedBackwardQuery<T>{rows, q, out, lse, g, dq, delta},
           {operand(q, wide), operand(out, narrow), operand(lse, n), operand(g, narrow), operand(dq, narrow),
            operand(delta, n), operand(dropout.key.step_on_device, step)});
    launch(stream, "attention_fused_backward_key", n, AttentionFusedBackwardKey<T>{rows, q, lse, g, delta, dq},
           {operand(q, wide), operand(lse, n), operand(g, narrow), operand(delta, n), operand(dq, 2 * narrow),
            operand(dropout.key.step_on_device, step)});
  });
}

}  // namespace dp::kernels
