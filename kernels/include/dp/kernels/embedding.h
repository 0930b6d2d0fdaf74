// dp/kernels/embedding.h — torch.nn.Embedding: a gather forward, and a weight gradient whose every row
// sums its tokens' output gradients in token order: the tokens are sorted by id first (a stable
// counting sort), so no atomics, and cuda and the sim add the same terms in the same order.
#pragma once

#include <cstdint>
#include <vector>

#include "dp/kernels/platform.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// y (tokens, dim) = weight[ids] with weight (vocab, dim). Every id must lie in [0, vocab): the sim
// checks (InvalidArgument naming the first bad token, as torch's "index out of range"); cuda's
// kernel reads nothing for an id outside and writes NaN there, never memory outside the table.
void embedding_forward(const Stream& stream, index_t tokens, index_t vocab, index_t dim, const std::int32_t* ids,
                       const float* weight, float* y);

// dweight (vocab, dim) (+)= for each row v, the sum of dy[t] over the tokens t with ids[t] == v in
// increasing t (`accumulate`; else stored: rows no token names become 0). order (tokens) and
// offsets (vocab + 1): int32 scratch for the sort.
void embedding_backward(const Stream& stream, index_t tokens, index_t vocab, index_t dim, const std::int32_t* ids,
                        const float* dy, float* dweight, std::int32_t* order, std::int32_t* offsets,
                        bool accumulate = true);

// y (batch, tokens, dim) += positions (tokens, dim) for every sample: a position embedding.
void add_positions(const Stream& stream, index_t batch, index_t tokens, index_t dim, const float* positions, float* y);

// ------------------------------------------------------------------------------------------------
// functors

// row = b * tokens + t, col = c.
struct AddPositions {
  index_t tokens, dim;
  const float* positions;
  float* y;
  DP_HD void operator()(index_t row, index_t col) const {
    y[row * dim + col] = y[row * dim + col] + positions[(row % tokens) * dim + col];
  }
};

struct EmbeddingGather {
  index_t vocab, dim;
  const std::int32_t* ids;
  const float* weight;
  float* y;
  DP_HD void operator()(index_t t, index_t c) const {
    const std::int32_t v = ids[t];
    y[t * dim + c] = v >= 0 && v < vocab ? weight[static_cast<index_t>(v) * dim + c] : bf16_to_float(0x7fc0);  // NaN
  }
};

// The sort: offsets[v + 1] = how many tokens have id v (one thread per id, the tokens in order).
struct EmbeddingCount {
  index_t tokens;
  const std::int32_t* ids;
  std::int32_t* offsets;
  DP_HD void operator()(index_t v) const {
    std::int32_t count = 0;
    for (index_t t = 0; t < tokens; ++t) count += ids[t] == v ? 1 : 0;
    offsets[v + 1] = count;
  }
  // The sim: one pass over the tokens (what every thread's count gives; EmbeddingScan then runs).
  void host_run(index_t vocab) const {
    for (index_t v = 0; v <= vocab; ++v) offsets[v] = 0;
    for (index_t t = 0; t < tokens; ++t)
      if (ids[t] >= 0 && ids[t] < vocab) ++offsets[ids[t] + 1];
  }
};
// offsets[v + 1] += offsets[v] in order: one thread (vocab is a byte-level model's 256).
struct EmbeddingScan {
  index_t vocab;
  std::int32_t* offsets;
  DP_HD void operator()(index_t) const {
    offsets[0] = 0;
    for (index_t v = 0; v < vocab; ++v) offsets[v + 1] += offsets[v];
  }
};
// order[offsets[v] + k] = the k-th token with id v, in increasing t (one thread per id).
struct EmbeddingOrder {
  index_t tokens;
  const std::int32_t* ids;
  const std::int32_t* offsets;
  std::int32_t* order;
  DP_HD void operator()(index_t v) const {
    std::int32_t at = offsets[v];
    for (index_t t = 0; t < tokens; ++t)
      if (ids[t] == v) order[at++] = static_cast<std::int32_t>(t);
  }
  // The sim: one stable pass, each token to its id's next free slot.
  void host_run(index_t vocab) const {
    std::vector<std::int32_t> next(offsets, offsets + vocab);
    for (index_t t = 0; t < tokens; ++t)
      if (ids[t] >= 0 && ids[t] < vocab) order[next[static_cast<std::size_t>(ids[t])]++] = static_cast<std::int32_t>(t);
  }
};

// dweight[v, c] (+)= sum over k in [offsets[v], offsets[v + 1]) of dy[order[k], c], in k order.
struct EmbeddingGradRows {
  index_t dim;
  const std::int32_t* order;
  const std::int32_t* offsets;
  const float* dy;
  float* dweight;
  bool accumulate;
  DP_HD void operator()(index_t v, index_t c) const {
    float sum = 0.0f;
    for (std::int32_t k = offsets[v]; k < offsets[v + 1]; ++k) sum += dy[static_cast<index_t>(order[k]) * dim + c];
    dweight[v * dim + c] = accumulate ? dweight[v * dim + c] + sum : sum;
  }
};

}  // namespace dp::kernels
