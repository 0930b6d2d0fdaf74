// dp/kernels/detail/reduce_plan.h — the one summation order of every row reduction (launch_row_reduce), computed from
// the shape alone so that the GPU and the sim add the same terms in the same order and give the same bits.
#pragma once

#include "dp/kernels/platform.h"

namespace dp::kernels {

// Threads of a reduction block on cuda; partial sums of a block on the sim. Part of the summation
// order: changing it changes results (and the parity tests' last bits).
constexpr int kReduceLanes = 256;

// A block sums at least this many elements of a row (16 per lane) before its lane tree: a row is
// split only when each piece still amortises the tree and the partial it writes.
constexpr index_t kReduceMinChunk = 16 * kReduceLanes;

// Rows are split until there are this many blocks (if the rows are long enough): several waves on
// the largest GPUs (a 132-SM H100 holds ~1056 blocks of 256 threads at once). A constant, not the
// device's SM count, because the split decides the summation order.
constexpr index_t kReduceTargetBlocks = 8192;

// The summation order of `rows` sums of `cols` terms each. For each row:
//   stage 1 — the row is cut into chunks_per_row chunks of `chunk` consecutive columns (the last
//     may be shorter). In each chunk, lane l (0 <= l < kReduceLanes) sums, from a zero, the chunk's
//     columns l, l + L, l + 2L, ... in increasing order (L = kReduceLanes); then the lane tree
//     (reduce_lane_tree) combines the L lane sums into the chunk's sum.
//   stage 2 — only when chunks_per_row > 1: the row's chunk sums, in chunk order, are reduced the
//     same way (lane l sums partials l, l + L, ... from a zero, then the lane tree).
// Every step is fixed by (rows, cols), so the result does not depend on the grid, the device or the
// order in which blocks run, and a replay gives the same bits.
struct ReducePlan {
  index_t rows = 0;
  index_t cols = 0;
  index_t chunk = 0;           // columns of a row per stage-1 block (cols when one chunk)
  index_t chunks_per_row = 1;  // >= 1
  constexpr DP_HD index_t blocks() const { return rows * chunks_per_row; }  // stage-1 blocks
  constexpr DP_HD bool two_stage() const { return chunks_per_row > 1; }
  // Chunk sums kept between the stages (row-major: row, chunk); 0 when one stage suffices.
  constexpr DP_HD index_t partials() const { return two_stage() ? blocks() : 0; }
};

// The plan for `rows` x `cols`. Short rows (cols <= kReduceMinChunk) and many rows (rows alone
// reach kReduceTargetBlocks) are one chunk per row; otherwise each row is split into as many
// chunks as bring the total to kReduceTargetBlocks, none shorter than kReduceMinChunk, each a
// whole number of lane strides (so every lane of a full chunk sums as many terms). The partials
// never exceed kReduceTargetBlocks.
constexpr DP_HD ReducePlan plan_row_reduce(index_t rows, index_t cols) {
  ReducePlan plan;
  plan.rows = rows;
  plan.cols = cols;
  plan.chunk = cols;
  plan.chunks_per_row = 1;
  if (rows <= 0 || cols <= kReduceMinChunk) return plan;
  index_t chunks = cols / kReduceMinChunk;          // the most chunks of at least the minimum
  const index_t room = kReduceTargetBlocks / rows;  // chunks per row that keep to the target
  if (chunks > room) chunks = room;
  if (chunks <= 1) return plan;
  plan.chunk = ceil_div(ceil_div(cols, chunks), kReduceLanes) * kReduceLanes;
  plan.chunks_per_row = ceil_div(cols, plan.chunk);
  if (plan.chunks_per_row == 1) plan.chunk = cols;
  return plan;
}

// The fixed lane tree of both stages: lanes[l] += lanes[l + w] for w = L/2, L/4, ..., 1 (each step
// over l < w), leaving the sum in lanes[0]. The CUDA kernels run the same steps, one thread per lane.
template <class T>
DP_HD T reduce_lane_tree(T* lanes) {
  for (int width = kReduceLanes / 2; width > 0; width /= 2)
    for (int lane = 0; lane < width; ++lane) lanes[lane] = lanes[lane] + lanes[lane + width];
  return lanes[0];
}

}  // namespace dp::kernels
