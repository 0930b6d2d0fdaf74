// dp/kernels/detail/launch.h — runs a __host__ __device__ functor over an index range on a dp stream.
// cuda: a grid-stride kernel (or the two stages of reduce_plan.h for reductions) on the stream;
// sim: the same functor in a loop on the stream's thread. The only place, besides the backend
// folders, that knows which compiler it is under.
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dp/kernels/detail/reduce_plan.h"
#include "dp/kernels/platform.h"
#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"

#if defined(__CUDACC__)
#include "dp/runtime/detail/cuda_status.h"
#endif

namespace dp::kernels {

using kernel_api::check_operands;

// ------------------------------------------------------------------------------------------------
// kernels

// sim: a functor may also give the host a body of its own for a whole launch, written for the CPU
// (a scatter in the gather's order, loops over planes instead of a division per element), where the
// GPU's one-thread-per-element form costs the host more than the arithmetic: F::host_run(n) for
// launch, F::host_run(rows, cols) for launch_2d. It must write exactly what f(i) for every i writes,
// bit for bit (tests/kernels/test_host_paths.cpp holds every one to the per-element loop), so that the sim
// still computes what the GPU does.
template <class F>
concept HasHostRun = requires(const F& f, index_t n) {
  f.host_run(n);
};
template <class F>
concept HasHostRun2d = requires(const F& f, index_t n) {
  f.host_run(n, n);
};
// A reduction map may add its terms to the lanes in one call, lanes[k] = lanes[k] + map(row, col + k)
// for k < count (host_add_terms), so the host walks the row's memory rather than re-deriving each
// term's address, and adds each term as it is read rather than from a copy.
// A map whose term k of reductions r, r + 1, ... lie side by side (a column sum): the sim sums a
// tile of reductions at once (host_tile_sums).
template <class Map, class T>
concept HasHostAddRow = requires(const Map& m, index_t i, T* lanes) {
  m.host_add_row(i, i, i, lanes);
};
template <class Map, class T>
concept HasHostAddTerms = requires(const Map& m, index_t i, T* lanes) {
  m.host_add_terms(i, i, i, lanes);
};

// sim: the body of a kernel is the functor run in a loop on the stream's thread. The loop runs a
// local copy: the functor's fields then cannot alias what it stores through its pointers, so the
// compiler keeps extents in registers instead of reloading them (and redividing) per element.
template <class F>
struct HostLoop {
  index_t n;
  F f;
  void operator()() const {
    const F local = f;
    if constexpr (HasHostRun<F>)
      local.host_run(n);
    else
      for (index_t i = 0; i < n; ++i) local(i);
  }
};

// sim: a nested loop, so per-row index work (which channel, which plane) is hoisted out of the
// inner loop, and the inner loop can vectorise.
template <class F>
struct HostLoop2d {
  index_t rows, cols;
  F f;
  void operator()() const {
    const F local = f;
    if constexpr (HasHostRun2d<F>)
      local.host_run(rows, cols);
    else
      for (index_t row = 0; row < rows; ++row)
        for (index_t col = 0; col < cols; ++col) local(row, col);
  }
};

// sim: one block of the plan (reduce_plan.h) — lane l sums terms l, l + L, ... of the block in
// order, then the lane tree. Written as passes over L consecutive terms so the inner loop vectorises;
// each lane still adds its own terms in increasing order.
template <class T, class Term>
T host_block_sum(index_t count, const Term& term) {
  T lanes[kReduceLanes]{};
  for (index_t base = 0; base < count; base += kReduceLanes) {
    const index_t width = std::min<index_t>(kReduceLanes, count - base);
    for (index_t lane = 0; lane < width; ++lane) lanes[lane] = lanes[lane] + term(base + lane);
  }
  return reduce_lane_tree(lanes);
}

// host_block_sum over map(row, begin + k), k < count, each pass of L terms added by the map's
// host_add_terms: the same terms added in the same order.
template <class T, class Map>
T host_block_sum_of_map(const Map& map, index_t row, index_t begin, index_t count) {
  if constexpr (HasHostAddTerms<Map, T>) {
    T lanes[kReduceLanes]{};
    for (index_t base = 0; base < count; base += kReduceLanes)
      map.host_add_terms(row, begin + base, std::min<index_t>(kReduceLanes, count - base), lanes);
    return reduce_lane_tree(lanes);
  } else {
    return host_block_sum<T>(count, [&](index_t k) { return map(row, begin + k); });
  }
}

// host_block_sum_of_map for a tile of reductions at once, for a map whose term k of consecutive
// reductions lie side by side: term by term, each added to its lane of every reduction of the tile,
// then the lane tree, pass by pass across the tile. Each reduction adds the same terms to the same
// lanes in the same order, and its lanes pair up as reduce_lane_tree pairs them: the same sums,
// from contiguous reads the compiler vectorises instead of one strided read per term (a column
// sum's every term a cache line of its own). emit(reduction, chunk, sum).
template <class T, class Map, class Emit>
void host_tile_sums(const Map& map, const ReducePlan& plan, const Emit& emit) {
  constexpr index_t kTile = 16;
  T lanes[kReduceLanes * kTile];  // lane l of the tile's reduction j at l * kTile + j
  for (index_t first = 0; first < plan.rows; first += kTile) {
    const index_t width = std::min<index_t>(kTile, plan.rows - first);
    for (index_t chunk = 0; chunk < plan.chunks_per_row; ++chunk) {
      const index_t begin = chunk * plan.chunk, count = std::min(plan.chunk, plan.cols - begin);
      std::fill(lanes, lanes + kReduceLanes * kTile, T{});
      for (index_t k = 0; k < count; ++k) map.host_add_row(begin + k, first, width, lanes + (k % kReduceLanes) * kTile);
      for (index_t half = kReduceLanes / 2; half > 0; half /= 2)
        for (index_t lane = 0; lane < half; ++lane) {
          T* into = lanes + lane * kTile;
          const T* from = lanes + (lane + half) * kTile;
          for (index_t j = 0; j < kTile; ++j) into[j] = into[j] + from[j];
        }
      for (index_t j = 0; j < width; ++j) emit(first + j, chunk, lanes[j]);
    }
  }
}

// No second reduction in launch_row_fused.
struct NoRowReduce {};

// sim: launch_row_fused's rows one after another, each as cuda's block runs it.
template <class T1, class Map1, class Fin1, class T2, class Map2, class Fin2, class Each>
struct HostRowFused {
  index_t rows, cols;
  Map1 map1;
  Fin1 finalize1;
  Map2 map2;
  Fin2 finalize2;
  Each each;
  void operator()() const {
    const Map1 m1 = map1;
    const Each e = each;
    for (index_t row = 0; row < rows; ++row) {
      finalize1(row, host_block_sum_of_map<T1>(m1, row, 0, cols));
      if constexpr (!std::is_same_v<Map2, NoRowReduce>) finalize2(row, host_block_sum_of_map<T2>(map2, row, 0, cols));
      for (index_t col = 0; col < cols; ++col) e(row, col);
    }
  }
};

// sim, stage 1: every chunk's sum, into the partials (two stages) or straight to finalize (one).
// Blocks run one after another here; each block's sum depends only on its own terms.
template <class T, class Map, class Finalize>
struct HostReduceChunks {
  ReducePlan plan;
  Map map;
  Finalize finalize;
  std::shared_ptr<std::vector<T>> partials;  // plan.partials() sums, shared with stage 2
  void operator()() const {
    const Map local = map;
    if constexpr (HasHostAddRow<Map, T>) {
      host_tile_sums<T>(local, plan, [&](index_t row, index_t chunk, T total) {
        if (plan.two_stage())
          (*partials)[static_cast<std::size_t>(row * plan.chunks_per_row + chunk)] = total;
        else
          finalize(row, total);
      });
    } else {
      for (index_t block = 0; block < plan.blocks(); ++block) {
        const index_t row = block / plan.chunks_per_row;
        const index_t begin = (block - row * plan.chunks_per_row) * plan.chunk;
        const index_t count = std::min(plan.chunk, plan.cols - begin);
        const T total = host_block_sum_of_map<T>(local, row, begin, count);
        if (plan.two_stage())
          (*partials)[static_cast<std::size_t>(block)] = total;
        else
          finalize(row, total);
      }
    }
  }
};

// sim, stage 2: each row's chunk sums, reduced in the same lane order, then finalize.
template <class T, class Finalize>
struct HostReducePartials {
  ReducePlan plan;
  Finalize finalize;
  std::shared_ptr<std::vector<T>> partials;
  void operator()() const {
    for (index_t row = 0; row < plan.rows; ++row) {
      const T* row_partials = partials->data() + row * plan.chunks_per_row;
      finalize(row, host_block_sum<T>(plan.chunks_per_row, [&](index_t k) { return row_partials[k]; }));
    }
  }
};

#if defined(__CUDACC__)
template <class F>
__global__ void grid_stride_kernel(index_t n, F f) {
  const index_t stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

// The flat index i = row * cols + col advances by the grid's stride; (row, col) follow it with one
// divide per thread and a carry per step rather than a 64-bit divide and modulo per element.
template <class F>
__global__ void grid_stride_kernel_2d(index_t rows, index_t cols, F f) {
  const index_t total = rows * cols, stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  const index_t stride_rows = stride / cols, stride_cols = stride - stride_rows * cols;
  index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  index_t row = i / cols, col = i - row * cols;
  for (; i < total; i += stride) {
    f(row, col);
    row += stride_rows;
    col += stride_cols;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
}

// reduce_lane_tree with one thread per lane, in shared memory: the same pairs added in the same
// steps as the sim (not cub, whose warp shuffles pair the lanes another way). Every thread of the
// block must call it; all get the sum.
template <class T>
__device__ T block_lane_tree(T value, T* lanes) {
  lanes[threadIdx.x] = value;
  __syncthreads();
  for (int width = kReduceLanes / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) lanes[threadIdx.x] = lanes[threadIdx.x] + lanes[threadIdx.x + width];
    __syncthreads();
  }
  const T total = lanes[0];
  __syncthreads();  // lanes is reused by the block's next chunk
  return total;
}

// host_block_sum_of_map on a block: lane = thread sums map(row, col) for its columns of [begin, end)
// in increasing order, then the lane tree. Every thread of the block must call it; all get the sum.
template <class T, class Map>
__device__ T block_sum_of_map(const Map& map, index_t row, index_t begin, index_t end, T* lanes) {
  T sum{};
#pragma unroll 4
  for (index_t col = begin + threadIdx.x; col < end; col += kReduceLanes) sum = sum + map(row, col);
  return block_lane_tree(sum, lanes);
}

// Stage 1 of the plan: block b sums chunk b (row b / chunks_per_row), lane = thread.
template <class T, class Map, class Finalize>
__global__ void __launch_bounds__(kReduceLanes)
    reduce_chunks_kernel(ReducePlan plan, Map map, Finalize finalize, T* partials) {
  __shared__ alignas(T) unsigned char storage[kReduceLanes * sizeof(T)];
  T* lanes = reinterpret_cast<T*>(storage);
  for (index_t block = blockIdx.x; block < plan.blocks(); block += gridDim.x) {
    const index_t row = block / plan.chunks_per_row;  // once per block, not per element
    const index_t begin = (block - row * plan.chunks_per_row) * plan.chunk;
    const index_t end = begin + (plan.chunk < plan.cols - begin ? plan.chunk : plan.cols - begin);
    const T total = block_sum_of_map<T>(map, row, begin, end, lanes);
    if (threadIdx.x == 0) {
      if (plan.two_stage())
        partials[block] = total;
      else
        finalize(row, total);
    }
  }
}

// Stage 2: block r sums row r's chunk sums in the same lane order, then finalizes the row.
template <class T, class Finalize>
__global__ void __launch_bounds__(kReduceLanes)
    reduce_partials_kernel(ReducePlan plan, const T* partials, Finalize finalize) {
  __shared__ alignas(T) unsigned char storage[kReduceLanes * sizeof(T)];
  T* lanes = reinterpret_cast<T*>(storage);
  for (index_t row = blockIdx.x; row < plan.rows; row += gridDim.x) {
    const T* row_partials = partials + row * plan.chunks_per_row;
    T sum{};
    for (index_t k = threadIdx.x; k < plan.chunks_per_row; k += kReduceLanes) sum = sum + row_partials[k];
    const T total = block_lane_tree(sum, lanes);
    if (threadIdx.x == 0) finalize(row, total);
  }
}

// launch_row_fused: block b takes rows b, b + grid, ...; each reduction is stage 1's block of a
// one-chunk plan (lane = thread, then the lane tree), its finalize on thread 0 and made visible to
// the block before the next step reads it.
template <class T1, class Map1, class Fin1, class T2, class Map2, class Fin2, class Each>
__global__ void __launch_bounds__(kReduceLanes)
    row_fused_kernel(index_t rows, index_t cols, Map1 map1, Fin1 finalize1, Map2 map2, Fin2 finalize2, Each each) {
  constexpr std::size_t kLaneBytes = sizeof(T1) > sizeof(T2) ? sizeof(T1) : sizeof(T2);
  __shared__ alignas(16) unsigned char storage[kReduceLanes * kLaneBytes];
  for (index_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T1 total = block_sum_of_map<T1>(map1, row, 0, cols, reinterpret_cast<T1*>(storage));
    if (threadIdx.x == 0) finalize1(row, total);
    __syncthreads();
    if constexpr (!std::is_same_v<Map2, NoRowReduce>) {
      const T2 total2 = block_sum_of_map<T2>(map2, row, 0, cols, reinterpret_cast<T2*>(storage));
      if (threadIdx.x == 0) finalize2(row, total2);
      __syncthreads();
    }
    for (index_t col = threadIdx.x; col < cols; col += kReduceLanes) each(row, col);
  }
}

#endif

// ------------------------------------------------------------------------------------------------
// launchers

// f(i) for i in [0, n).
template <class F>
void launch(const Stream& stream, const char* name, index_t n, const F& f, std::initializer_list<Operand> operands) {
  kernel_api::check_extents(name, n);
  check_operands(stream, name, operands);
  if (n == 0) return;
  kernel_api::count_traffic(stream, name, operands);
  if (stream.backend() == Backend::sim) {
    kernel_api::enqueue_host(stream, name, HostLoop<F>{n, f});
    return;
  }
#if defined(__CUDACC__)
  constexpr int block = 256;
  // Enough blocks to fill every SM several times over; the grid-stride loop covers the rest.
  const index_t grid =
      std::min<index_t>(ceil_div(n, block), static_cast<index_t>(kernel_api::multiprocessor_count(stream)) * 32);
  kernel_api::begin_launch(stream, name);
  grid_stride_kernel<<<static_cast<unsigned>(grid), block, 0,
                       static_cast<cudaStream_t>(kernel_api::native_handle(stream))>>>(n, f);
  DP_CUDA_CHECK(cudaGetLastError());
  kernel_api::end_launch(stream);
#else
  kernel_api::enqueue_host(stream, name, {});  // throws: this launch site was not compiled by nvcc
#endif
}

// f(row, col) for row in [0, rows), col in [0, cols): the same work as launch() over rows*cols
// elements, for functors that need the row (a channel, a plane) of each element.
template <class F>
void launch_2d(const Stream& stream, const char* name, index_t rows, index_t cols, const F& f,
               std::initializer_list<Operand> operands) {
  kernel_api::check_extents(name, rows, cols);
  check_operands(stream, name, operands);
  if (rows == 0 || cols == 0) return;
  kernel_api::count_traffic(stream, name, operands);
  if (stream.backend() == Backend::sim) {
    kernel_api::enqueue_host(stream, name, HostLoop2d<F>{rows, cols, f});
    return;
  }
#if defined(__CUDACC__)
  constexpr int block = 256;
  const index_t grid = std::min<index_t>(ceil_div(rows * cols, block),
                                         static_cast<index_t>(kernel_api::multiprocessor_count(stream)) * 32);
  kernel_api::begin_launch(stream, name);
  grid_stride_kernel_2d<<<static_cast<unsigned>(grid), block, 0,
                          static_cast<cudaStream_t>(kernel_api::native_handle(stream))>>>(rows, cols, f);
  DP_CUDA_CHECK(cudaGetLastError());
  kernel_api::end_launch(stream);
#else
  kernel_api::enqueue_host(stream, name, {});
#endif
}

// For each row in [0, rows): finalize(row, sum over col in [0, cols) of map(row, col)), summed in
// the order of plan_row_reduce(rows, cols) (reduce_plan.h) on both backends: same bits on cuda and
// sim. T needs a value-initialised zero and operator+. finalize runs once per row, on one thread.
// map runs exactly once per (row, col), on both backends, so a map may also write per-element
// results of its own (cross_entropy_forward_backward writes each sample's gradient row).
template <class T, class Map, class Finalize>
void launch_row_reduce(const Stream& stream, const char* name, index_t rows, index_t cols, const Map& map,
                       const Finalize& finalize, std::initializer_list<Operand> operands) {
  kernel_api::check_extents(name, rows, cols);
  check_operands(stream, name, operands);
  if (rows == 0) return;
  kernel_api::count_traffic(stream, name, operands);  // the partial sums stay in cache-sized scratch
  const ReducePlan plan = plan_row_reduce(rows, cols);
  if (stream.backend() == Backend::sim) {
    // Two queued bodies where cuda launches two kernels, so both count the same launches.
    auto partials = std::make_shared<std::vector<T>>(static_cast<std::size_t>(plan.partials()));
    kernel_api::enqueue_host(stream, name, HostReduceChunks<T, Map, Finalize>{plan, map, finalize, partials});
    if (plan.two_stage())
      kernel_api::enqueue_host(stream, name, HostReducePartials<T, Finalize>{plan, finalize, partials});
    return;
  }
#if defined(__CUDACC__)
  // The grid only bounds how many blocks are resident; the blocks' sums do not depend on it.
  constexpr index_t kMaxGrid = index_t{1} << 20;
  const auto cuda_stream = static_cast<cudaStream_t>(kernel_api::native_handle(stream));
  kernel_api::begin_launch(stream, name);
  // The partial sums live in the stream's grow-only kernel scratch: sized once per shape in warm-up,
  // so no launch allocates (and a captured step replays with the same buffer).
  T* partials =
      static_cast<T*>(kernel_api::kernel_scratch(stream, static_cast<std::size_t>(plan.partials()) * sizeof(T)));
  reduce_chunks_kernel<T><<<static_cast<unsigned>(std::min(plan.blocks(), kMaxGrid)), kReduceLanes, 0, cuda_stream>>>(
      plan, map, finalize, partials);
  DP_CUDA_CHECK(cudaGetLastError());
  kernel_api::end_launch(stream);
  if (plan.two_stage()) {
    kernel_api::begin_launch(stream, name);
    reduce_partials_kernel<T><<<static_cast<unsigned>(std::min(plan.rows, kMaxGrid)), kReduceLanes, 0, cuda_stream>>>(
        plan, static_cast<const T*>(partials), finalize);
    DP_CUDA_CHECK(cudaGetLastError());
    kernel_api::end_launch(stream);
  }
#else
  kernel_api::enqueue_host(stream, name, {});
#endif
}

// One launch per row (a block a row on cuda) of what launch_row_reduce and launch_2d would do in
// two or three: finalize1(row, sum of map1(row, ·)), then, unless Map2 is NoRowReduce,
// finalize2(row, sum of map2(row, ·)), which may read what finalize1 stored for the row, then
// each(row, col) for every col, which may read both. Each sum has launch_row_reduce's bits: the
// caller uses it only where plan_row_reduce(rows, cols) is one chunk a row (row_fusable), and
// keeps the separate launches otherwise. The row's inputs are read from memory once a pass, but
// counted once (`operands`): on a GPU the row's second and third reads hit the L1/L2 it just filled.
inline bool row_fusable(index_t rows, index_t cols) { return !plan_row_reduce(rows, cols).two_stage(); }

template <class T1, class T2 = float, class Map1, class Fin1, class Map2, class Fin2, class Each>
void launch_row_fused(const Stream& stream, const char* name, index_t rows, index_t cols, const Map1& map1,
                      const Fin1& finalize1, const Map2& map2, const Fin2& finalize2, const Each& each,
                      std::initializer_list<Operand> operands) {
  kernel_api::check_extents(name, rows, cols);
  check_operands(stream, name, operands);
  if (rows == 0) return;
  if (!row_fusable(rows, cols))
    throw InvalidArgument(std::string(name) + ": rows of " + std::to_string(cols) +
                          " values are reduced in several chunks, not one");
  kernel_api::count_traffic(stream, name, operands);
  if (stream.backend() == Backend::sim) {
    kernel_api::enqueue_host(
        stream, name,
        HostRowFused<T1, Map1, Fin1, T2, Map2, Fin2, Each>{rows, cols, map1, finalize1, map2, finalize2, each});
    return;
  }
#if defined(__CUDACC__)
  constexpr index_t kMaxGrid = index_t{1} << 20;
  kernel_api::begin_launch(stream, name);
  row_fused_kernel<T1, Map1, Fin1, T2, Map2, Fin2, Each>
      <<<static_cast<unsigned>(std::min(rows, kMaxGrid)), kReduceLanes, 0,
         static_cast<cudaStream_t>(kernel_api::native_handle(stream))>>>(rows, cols, map1, finalize1, map2, finalize2,
                                                                         each);
  DP_CUDA_CHECK(cudaGetLastError());
  kernel_api::end_launch(stream);
#else
  kernel_api::enqueue_host(stream, name, {});
#endif
}

}  // namespace dp::kernels
