// launch.h — runs a __host__ __device__ functor over an index range on a dp stream.
// cuda: a grid-stride kernel (or one block per row for reductions) on the stream;
// sim: the same functor in a loop on the stream's thread. The only place, besides the backend
// folders, that knows which compiler it is under.
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <utility>

#include "dp/device.h"
#include "dp/kernels/platform.h"
#include "dp/runtime/kernel_api.h"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>

#include "dp/runtime/cuda_status.h"
#endif

namespace dp::kernels {

using kernel_api::check_operands;

// Lanes each row reduction is split over: every block has this many threads on cuda, and the
// sim accumulates in as many interleaved partial sums, so both sum in a similar order.
constexpr int kReduceLanes = 256;

// ------------------------------------------------------------------------------------------------
// kernels

// sim: the body of a kernel is the functor run in a loop on the stream's thread.
template <class F>
struct HostLoop {
  index_t n;
  F f;
  void operator()() const {
    for (index_t i = 0; i < n; ++i) f(i);
  }
};

// sim: a nested loop, so per-row index work (which channel, which plane) is hoisted out of the
// inner loop, and the inner loop can vectorise.
template <class F>
struct HostLoop2d {
  index_t rows, cols;
  F f;
  void operator()() const {
    for (index_t row = 0; row < rows; ++row)
      for (index_t col = 0; col < cols; ++col) f(row, col);
  }
};

template <class T, class Map, class Finalize>
struct HostRowReduce {
  index_t rows, cols;
  Map map;
  Finalize finalize;
  void operator()() const {
    for (index_t row = 0; row < rows; ++row) {
      T lanes[kReduceLanes]{};
      for (index_t base = 0; base < cols; base += kReduceLanes) {
        const index_t width = std::min<index_t>(kReduceLanes, cols - base);
        for (index_t lane = 0; lane < width; ++lane) lanes[lane] = lanes[lane] + map(row, base + lane);
      }
      // Pairwise combine of the lanes, like the block-wide tree on the GPU.
      for (int width = kReduceLanes / 2; width > 0; width /= 2)
        for (int lane = 0; lane < width; ++lane) lanes[lane] = lanes[lane] + lanes[lane + width];
      finalize(row, lanes[0]);
    }
  }
};

struct Plus {
  template <class T>
  DP_HD T operator()(const T& a, const T& b) const {
    return a + b;
  }
};

#if defined(__CUDACC__)
template <class F>
__global__ void grid_stride_kernel(index_t n, F f) {
  const index_t stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class F>
__global__ void grid_stride_kernel_2d(index_t rows, index_t cols, F f) {
  const index_t total = rows * cols, stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    f(i / cols, i % cols);
}

// One block per row: each thread folds a strided slice of the row, then the block combines.
template <class T, class Map, class Finalize>
__global__ void row_reduce_kernel(index_t rows, index_t cols, Map map, Finalize finalize) {
  using BlockReduce = cub::BlockReduce<T, kReduceLanes>;
  __shared__ typename BlockReduce::TempStorage temp;
  for (index_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T partial{};
    for (index_t col = threadIdx.x; col < cols; col += kReduceLanes) partial = partial + map(row, col);
    const T total = BlockReduce(temp).Reduce(partial, Plus{});
    if (threadIdx.x == 0) finalize(row, total);
    __syncthreads();  // temp storage is reused by the next row
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

// For each row in [0, rows): finalize(row, sum over col in [0, cols) of map(row, col)).
// T needs a value-initialised zero and operator+. Large rows are split across kReduceLanes
// threads (cuda) or partial sums (sim) rather than summed serially by one thread.
template <class T, class Map, class Finalize>
void launch_row_reduce(const Stream& stream, const char* name, index_t rows, index_t cols, const Map& map,
                       const Finalize& finalize, std::initializer_list<Operand> operands) {
  kernel_api::check_extents(name, rows, cols);
  check_operands(stream, name, operands);
  if (rows == 0) return;
  if (stream.backend() == Backend::sim) {
    kernel_api::enqueue_host(stream, name, HostRowReduce<T, Map, Finalize>{rows, cols, map, finalize});
    return;
  }
#if defined(__CUDACC__)
  const index_t grid = std::min<index_t>(rows, static_cast<index_t>(kernel_api::multiprocessor_count(stream)) * 16);
  kernel_api::begin_launch(stream, name);
  row_reduce_kernel<T>
      <<<static_cast<unsigned>(grid), kReduceLanes, 0, static_cast<cudaStream_t>(kernel_api::native_handle(stream))>>>(
          rows, cols, map, finalize);
  DP_CUDA_CHECK(cudaGetLastError());
  kernel_api::end_launch(stream);
#else
  kernel_api::enqueue_host(stream, name, {});
#endif
}

}  // namespace dp::kernels
