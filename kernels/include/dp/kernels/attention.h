// dp/kernels/attention.h — causal multi-head self-attention's core, as nanoGPT's CausalSelfAttention
// computes it between its two Linears: from the QKV projection's output qkv (B, T, 3C), q, k and v
// side by side in each row, head h the columns [h*D, (h+1)*D) of each (C = H*D),
//   att = softmax(mask(q k^T / sqrt(D))) per (batch, head), the mask keeping key j <= query i,
//   y (B, T, C) = att v with the heads side by side again (torch's transpose(1, 2).view(B, T, C)).
// The products are kernels::gemm_batched (cuBLAS / OpenBLAS), one call per head over the batch;
// the softmax and its backward are one thread per row, summing the row in order. fp32 throughout.
//
// The fused form (attention_fused_*) never holds a (T, T) matrix: one thread per query row walks
// the keys in tiles of kAttentionKeyTile with an online softmax (a running max and sum), keeping
// only the output and each row's log-sum-exp; the backward recomputes each probability from it.
// Its arithmetic is one __host__ __device__ body with its own exp and log (exp_portable,
// log_portable): cuda and sim give the same bits. The unfused form is the reference it is tested against.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dp/kernels/dropout.h"
#include "dp/kernels/platform.h"
#include "dp/kernels/portable_math.h"
#include "dp/kernels/storage.h"
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

// The fused attention's rows, B * H * T: the size of its log-sum-exp (one float per query row,
// (B, H, T)) and of the backward's delta.
index_t attention_fused_rows(const AttentionShape& shape);

// y (B, T, C) and each query row's log-sum-exp lse = log sum_j exp(score_j); `dropout.dropped` is not
// used (the mask is recomputed where it is needed). Head dims above kAttentionMaxHeadDim:
// InvalidArgument (the unfused form takes any).
// qkv, y (and dy, dqkv) of one storage: fp32, or bf16 under autocast (torch runs
// scaled_dot_product_attention in bf16 there), read widened and computed in fp32, each output
// rounded once; lse and delta fp32.
void attention_fused_forward(const Stream& stream, const AttentionShape& shape, In qkv, Out y, float* lse,
                             const AttentionDropout& dropout = {});

// dqkv (B, T, 3C) overwritten from dy, from the forward's y and lse; `delta` (rows floats): scratch
// for each row's dy . y.
void attention_fused_backward(const Stream& stream, const AttentionShape& shape, In qkv, In y, const float* lse, In dy,
                              Out dqkv, float* delta, const AttentionDropout& dropout = {});

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
    for (int j = 1; j <= i; ++j) m = max_portable(m, s[j]);
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) {
      s[j] = exp_portable(s[j] - m);
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

// ------------------------------------------------------------------------------------------------
// the fused form's arithmetic: one body for both backends

inline constexpr int kAttentionKeyTile = 32;      // keys per online-softmax update
inline constexpr int kAttentionMaxHeadDim = 128;  // a row's q and accumulators live in registers
// The backward passes' tile on the host: their bits do not depend on the tile (each probability is
// recomputed from its row's log-sum-exp, and every sum runs in key or query order across tiles),
// so the sim takes longer tiles than a GPU thread's registers hold: fewer tiles a row, longer
// vector loops (10-13 % faster at T 64). The forward's tile is the online softmax's, part of its bits.
inline constexpr int kAttentionHostTile = 64;
static_assert(kAttentionKeyTile % 8 == 0 && kAttentionHostTile % 8 == 0, "ColumnDots writes whole blocks of 8");

// Where one (batch, head)'s rows lie in qkv, y and the statistics, and attn_dropout's draw: row r of
// the launch is query (or key) r % T of matrix r / T = b * H + h.
struct AttentionRows {
  int tokens, heads, head_dim;
  index_t width;  // C
  float scale;    // 1/sqrt(D)
  // attn_dropout: kept iff the element's 24-bit draw >= threshold, a kept one weighs noise_kept.
  bool dropping;
  DropoutKey key;
  std::uint32_t threshold;
  float noise_kept;
  index_t element_offset;

  DP_HD index_t token_row(index_t matrix, int t) const { return (matrix / heads) * tokens + t; }
  DP_HD index_t head_column(index_t matrix) const { return (matrix % heads) * head_dim; }
  template <class T>
  DP_HD T* q(T* qkv, index_t matrix, int t) const {
    return qkv + token_row(matrix, t) * 3 * width + head_column(matrix);
  }
  // attn_dropout's factor for probability (i, j) of `matrix`: the element (matrix, i, j) of the
  // (B, H, T, T) probabilities, as dropout_forward draws it over them.
  DP_HD float noise(index_t matrix, int i, int j) const {
    const auto e = static_cast<std::uint64_t>(element_offset + (matrix * tokens + i) * tokens + j);
    const auto words = dropout_words(key, e / 4);
    return dropout_noise(words.v[e % 4], threshold, noise_kept);
  }
};

// sum_k a[k] b[k] in feature order, each term one fused multiply-add; a in fp32, b either storage.
template <class T>
DP_HD float dot_in_order(const float* a, const T* b, int n) {
  float s = 0.0f;
  for (int k = 0; k < n; ++k) s = fmaf(a[k], load(b, k), s);
  return s;
}

// A head's row of either storage, widened into fp32 registers.
template <class T>
DP_HD void widen_row(const T* from, int n, float* to) {
  for (int k = 0; k < n; ++k) to[k] = load(from, k);
}

// The unscaled dots of a (fp32) with rows first..first+n-1 of one matrix's keys (values, queries,
// dy), into out. RowDots reads each row where it lies, in its storage (on the GPU a warp's threads
// read the same row at the same time); ColumnDots reads a (D, T) fp32 copy, n independent chains
// the host vectorises, 8 to 32 of them in registers at once. Both add each dot's terms in feature
// order, as dot_in_order does: the same bits.
template <class T>
struct RowDots {
  const T* base;   // row 0
  index_t stride;  // from one row to the next
  int d;
  DP_HD void operator()(const float* a, int first, int n, float* out) const {
    for (int j = 0; j < n; ++j) out[j] = dot_in_order(a, base + (first + j) * stride, d);
  }
};
struct ColumnDots {
  const float* columns;  // feature k of row j at columns[k * stride + j]: transpose_head's copy
  int stride, d;         // stride: the tokens and kColumnPadding zeros after them
  // The dots of blocks of 8 rows, up to four blocks at once, held in registers across the features
  // (a dot in memory waits on its own store every feature).
  template <int Blocks>
  DP_HD void blocks(const float* a, const float* first_column, float* out) const {
    float acc[8 * Blocks];
    for (int l = 0; l < 8 * Blocks; ++l) acc[l] = 0.0f;
    for (int k = 0; k < d; ++k) {
      const float ak = a[k];
      const float* column = first_column + static_cast<index_t>(k) * stride;
      for (int l = 0; l < 8 * Blocks; ++l) acc[l] = fmaf(ak, column[l], acc[l]);
    }
    for (int l = 0; l < 8 * Blocks; ++l) out[l] = acc[l];
  }
  // out holds n rounded up to 8: the last block's spare lanes are written too (dots with the
  // padding's zeros or the next rows, never read).
  DP_HD void operator()(const float* a, int first, int n, float* out) const {
    int j0 = 0;
    for (; n - j0 > 32; j0 += 32) blocks<4>(a, columns + first + j0, out + j0);
    switch ((n - j0 + 7) / 8) {
      case 4: blocks<4>(a, columns + first + j0, out + j0); break;
      case 3: blocks<3>(a, columns + first + j0, out + j0); break;
      case 2: blocks<2>(a, columns + first + j0, out + j0); break;
      case 1: blocks<1>(a, columns + first + j0, out + j0); break;
      default: break;
    }
  }
};

// sim: the (D, T) fp32 copy of one matrix's rows (q, k or v columns of qkv, or dy's), for ColumnDots.
// Each feature's row holds the tokens and then kColumnPadding zeros, so that ColumnDots' last block
// of 8 may read past the last token.
inline constexpr int kColumnPadding = 8;
template <class T>
void transpose_head(const T* row0, index_t stride, int tokens, int d, std::vector<float>& columns) {
  const std::size_t width = static_cast<std::size_t>(tokens) + kColumnPadding;
  columns.resize(width * d);
  for (int j = 0; j < tokens; ++j)
    for (int k = 0; k < d; ++k) columns[static_cast<std::size_t>(k) * width + j] = load(row0, j * stride + k);
  for (int k = 0; k < d; ++k)
    std::fill_n(columns.begin() + static_cast<std::ptrdiff_t>(k * width + tokens), kColumnPadding, 0.0f);
}

// One query row: the keys 0..i in tiles, each tile's scores, then the running max m, sum l and
// output o rescaled by e^(m_old - m_new) and the tile's exp(s - m_new) added. qkv and y in storage T
// (fp32, or bf16 under autocast: read widened, y rounded once), the arithmetic fp32.
template <class T = float>
struct AttentionFusedForward {
  AttentionRows rows;
  const T* qkv;
  T* y;
  float* lse;
  template <class Dots>
  DP_HD void row(index_t matrix, int i, const Dots& keys) const {
    const int d = rows.head_dim;
    const index_t c = rows.width;
    const T* head = rows.q(qkv, matrix, 0);  // the matrix's q of token 0: rows 3C apart
    float q[kAttentionMaxHeadDim], o[kAttentionMaxHeadDim];
    widen_row(head + i * 3 * c, d, q);
    for (int k = 0; k < d; ++k) o[k] = 0.0f;
    float m = -INFINITY, l = 0.0f, s[kAttentionKeyTile];
    for (int start = 0; start <= i; start += kAttentionKeyTile) {
      const int n = i + 1 - start < kAttentionKeyTile ? i + 1 - start : kAttentionKeyTile;
      keys(q, start, n, s);
      float tile_max = -INFINITY;
      for (int j = 0; j < n; ++j) {
        s[j] = mul_unfused(s[j], rows.scale);
        tile_max = max_portable(tile_max, s[j]);
      }
      const float m_new = max_portable(m, tile_max);
      const float correction = exp_portable(m - m_new);  // 0 for the first tile (m = -inf)
      l = mul_unfused(l, correction);
      for (int k = 0; k < d; ++k) o[k] = mul_unfused(o[k], correction);
      for (int j = 0; j < n; ++j) s[j] = exp_portable(s[j] - m_new);
      for (int j = 0; j < n; ++j) {
        const float p = s[j];
        l = l + p;
        const float w = rows.dropping ? mul_unfused(p, rows.noise(matrix, i, start + j)) : p;
        const T* v = head + (start + j) * 3 * c + 2 * c;
        for (int k = 0; k < d; ++k) o[k] = fmaf(w, load(v, k), o[k]);
      }
      m = m_new;
    }
    T* out = y + rows.token_row(matrix, i) * c + rows.head_column(matrix);
    for (int k = 0; k < d; ++k) store(out, k, o[k] / l);
    lse[matrix * rows.tokens + i] = m + log_portable(l);
  }
  DP_HD void operator()(index_t r) const {
    const index_t matrix = r / rows.tokens;
    row(matrix, static_cast<int>(r % rows.tokens),
        RowDots<T>{rows.q(qkv, matrix, 0) + rows.width, 3 * rows.width, rows.head_dim});
  }
  void host_run(index_t n) const {
    const int t = rows.tokens, d = rows.head_dim;
    std::vector<float> keys;
    for (index_t matrix = 0; matrix * t < n; ++matrix) {
      transpose_head(rows.q(qkv, matrix, 0) + rows.width, 3 * rows.width, t, d, keys);
      for (int i = 0; i < t; ++i) row(matrix, i, ColumnDots{keys.data(), t + kColumnPadding, d});
    }
  }
};

// p = exp(s - lse), the forward's probability recomputed from its row's log-sum-exp.
DP_HD inline float attention_probability(float score, float lse) { return exp_portable(score - lse); }

// Backward, per query row i: delta_i = dy_i . y_i, then over keys j <= i
//   ds = p (noise * (dy_i . v_j) - delta_i),  dq_i = scale * sum_j ds k_j.
// (delta = sum_j p_ij noise_ij (dy_i . v_j) = dy_i . y_i, with dropout too.)
template <class T = float>
struct AttentionFusedBackwardQuery {
  AttentionRows rows;
  const T *qkv, *y;
  const float* lse;
  const T* dy;
  T* dqkv;
  float* delta;
  template <int Tile, class Dots>
  DP_HD void row(index_t matrix, int i, const Dots& keys, const Dots& values) const {
    const int d = rows.head_dim;
    const index_t c = rows.width, r = matrix * rows.tokens + i;
    const index_t token = rows.token_row(matrix, i), column = rows.head_column(matrix);
    const T* head = rows.q(qkv, matrix, 0);  // the matrix's q of token 0: rows 3C apart
    float q[kAttentionMaxHeadDim], g[kAttentionMaxHeadDim], dq[kAttentionMaxHeadDim];
    widen_row(head + i * 3 * c, d, q);
    widen_row(dy + token * c + column, d, g);
    const float dl = dot_in_order(g, y + token * c + column, d);
    const float row_lse = lse[r];
    float s[Tile], dp[Tile];
    for (int k = 0; k < d; ++k) dq[k] = 0.0f;
    for (int start = 0; start <= i; start += Tile) {
      const int n = i + 1 - start < Tile ? i + 1 - start : Tile;
      keys(q, start, n, s);
      values(g, start, n, dp);
      for (int j = 0; j < n; ++j) s[j] = attention_probability(mul_unfused(s[j], rows.scale), row_lse);
      for (int j = 0; j < n; ++j) {
        const float p = s[j];
        const float dpj = rows.dropping ? mul_unfused(dp[j], rows.noise(matrix, i, start + j)) : dp[j];
        const float ds = mul_unfused(p, dpj - dl);
        const T* kj = head + (start + j) * 3 * c + c;
        for (int k = 0; k < d; ++k) dq[k] = fmaf(ds, load(kj, k), dq[k]);
      }
    }
    T* out = dqkv + token * 3 * c + column;
    for (int k = 0; k < d; ++k) store(out, k, mul_unfused(dq[k], rows.scale));
    delta[r] = dl;
  }
  DP_HD void operator()(index_t r) const {
    const index_t matrix = r / rows.tokens, c = rows.width;
    const T* k0 = rows.q(qkv, matrix, 0) + c;
    row<kAttentionKeyTile>(matrix, static_cast<int>(r % rows.tokens), RowDots<T>{k0, 3 * c, rows.head_dim},
                           RowDots<T>{k0 + c, 3 * c, rows.head_dim});
  }
  void host_run(index_t n) const {
    const int t = rows.tokens, d = rows.head_dim;
    const index_t c = rows.width;
    std::vector<float> keys, values;
    for (index_t matrix = 0; matrix * t < n; ++matrix) {
      transpose_head(rows.q(qkv, matrix, 0) + c, 3 * c, t, d, keys);
      transpose_head(rows.q(qkv, matrix, 0) + 2 * c, 3 * c, t, d, values);
      for (int i = 0; i < t; ++i)
        row<kAttentionHostTile>(matrix, i, ColumnDots{keys.data(), t + kColumnPadding, d},
                                ColumnDots{values.data(), t + kColumnPadding, d});
    }
  }
};

// Backward, per key row j, over queries i >= j: dv_j = sum_i noise p dy_i, dk_j = scale * sum_i ds q_i,
// with p and ds computed as the query pass computes them (the same bits).
template <class T = float>
struct AttentionFusedBackwardKey {
  AttentionRows rows;
  const T* qkv;
  const float* lse;
  const T* dy;
  const float* delta;
  T* dqkv;
  template <int Tile, class Dots>
  DP_HD void row(index_t matrix, int j, const Dots& queries, const Dots& grads) const {
    const int d = rows.head_dim, t = rows.tokens;
    const index_t c = rows.width, first = matrix * t;
    float kj[kAttentionMaxHeadDim], vj[kAttentionMaxHeadDim];
    const T* head = rows.q(qkv, matrix, 0);  // the matrix's q of token 0: rows 3C apart
    widen_row(head + j * 3 * c + c, d, kj);
    widen_row(head + j * 3 * c + 2 * c, d, vj);
    const T* g0 = dy + rows.token_row(matrix, 0) * c + rows.head_column(matrix);
    float dk[kAttentionMaxHeadDim], dv[kAttentionMaxHeadDim], s[Tile], dp[Tile];
    for (int k = 0; k < d; ++k) dk[k] = dv[k] = 0.0f;
    for (int start = j; start < t; start += Tile) {
      const int n = t - start < Tile ? t - start : Tile;
      queries(kj, start, n, s);
      grads(vj, start, n, dp);
      for (int u = 0; u < n; ++u) s[u] = attention_probability(mul_unfused(s[u], rows.scale), lse[first + start + u]);
      for (int u = 0; u < n; ++u) {
        const int i = start + u;
        const T* qi = head + i * 3 * c;
        const T* g = g0 + static_cast<index_t>(i) * c;
        const float p = s[u];
        float dpi = dp[u], w = p;
        if (rows.dropping) {
          const float noise = rows.noise(matrix, i, j);
          dpi = mul_unfused(dpi, noise);
          w = mul_unfused(p, noise);
        }
        const float ds = mul_unfused(p, dpi - delta[first + i]);
        for (int k = 0; k < d; ++k) {
          dv[k] = fmaf(w, load(g, k), dv[k]);
          dk[k] = fmaf(ds, load(qi, k), dk[k]);
        }
      }
    }
    T* out = dqkv + rows.token_row(matrix, j) * 3 * c + rows.head_column(matrix);
    for (int k = 0; k < d; ++k) {
      store(out, c + k, mul_unfused(dk[k], rows.scale));
      store(out, 2 * c + k, dv[k]);
    }
  }
  DP_HD void operator()(index_t r) const {
    const index_t matrix = r / rows.tokens, c = rows.width;
    row<kAttentionKeyTile>(matrix, static_cast<int>(r % rows.tokens),
                           RowDots<T>{rows.q(qkv, matrix, 0), 3 * c, rows.head_dim},
                           RowDots<T>{dy + rows.token_row(matrix, 0) * c + rows.head_column(matrix), c, rows.head_dim});
  }
  void host_run(index_t n) const {
    const int t = rows.tokens, d = rows.head_dim;
    const index_t c = rows.width;
    std::vector<float> queries, grads;
    for (index_t matrix = 0; matrix * t < n; ++matrix) {
      transpose_head(rows.q(qkv, matrix, 0), 3 * c, t, d, queries);
      transpose_head(dy + rows.token_row(matrix, 0) * c + rows.head_column(matrix), c, t, d, grads);
      for (int j = 0; j < t; ++j)
        row<kAttentionHostTile>(matrix, j, ColumnDots{queries.data(), t + kColumnPadding, d},
                                ColumnDots{grads.data(), t + kColumnPadding, d});
    }
  }
};

}  // namespace dp::kernels
