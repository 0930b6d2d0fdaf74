// device_ring.cu — the device ring's kernels: one block per rank and call, the ranks meeting at
// barriers through flags in device memory (as NCCL's kernels meet), never through events, so each
// rank's part is captured into that rank's own graph and replays as a new call. The arithmetic is
// the sim ring's (dp/runtime/sim/ring_communicator.cpp): the same chunks, steps and order of
// additions, so both give the same bits. A rank reads its left neighbour's buffer in place: on one
// GPU that is the device-to-device copy the sim makes into its staging.
#include <cstdint>

#include "device_ring.h"
#include "dp/runtime/bfloat16.h"

namespace dp::detail::ring {
namespace {

constexpr int kThreads = 512;

// All ranks have passed barrier `target` (counted since the communicator was made). The block's
// writes before it are visible to every rank after it.
__device__ bool barrier(Shared* shared, int rank, int ranks, unsigned long long target, const volatile int* aborted) {
  __syncthreads();
  __shared__ int stop;
  if (threadIdx.x == 0) {
    __threadfence();  // this rank's writes before its arrival
    *reinterpret_cast<volatile unsigned long long*>(&shared->arrived[rank]) = target;
    stop = 0;
    for (int h = 0; h < ranks && !stop; ++h)
      while (*reinterpret_cast<volatile unsigned long long*>(&shared->arrived[h]) < target)
        if (*aborted) {
          stop = 1;
          break;
        }
    __threadfence();  // the others' writes before their arrivals
  }
  __syncthreads();
  return stop == 0;
}

// The sim ring's chunk c of `count` elements among n ranks: [count*c/n, count*(c+1)/n).
__device__ void chunk(std::size_t count, int n, int c, std::size_t& begin, std::size_t& end) {
  c = ((c % n) + n) % n;
  begin = count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n);
  end = count * static_cast<std::size_t>(c + 1) / static_cast<std::size_t>(n);
}

// The sim ring's all-reduce of `count` elements of T: reduce-scatter, after step s this rank
// holding the sum (add) of s+2 contributions to chunk r-1-s, its own plus the left neighbour's
// partial sum; then all-gather, the finished chunks around the ring. False when a barrier was
// aborted.
template <class T, class Add, class Meet>
__device__ bool all_reduce_steps(T* mine, const T* left, std::size_t count, int r, int n, Add add, const Meet& meet) {
  const std::size_t stride = blockDim.x;
  for (int s = 0; s < n - 1; ++s) {
    std::size_t begin = 0, end = 0;
    chunk(count, n, r - 1 - s, begin, end);
    for (std::size_t i = begin + threadIdx.x; i < end; i += stride) mine[i] = add(mine[i], left[i]);
    if (!meet()) return false;
  }
  for (int s = 0; s < n - 1; ++s) {
    std::size_t begin = 0, end = 0;
    chunk(count, n, r - s, begin, end);
    for (std::size_t i = begin + threadIdx.x; i < end; i += stride) mine[i] = left[i];
    if (!meet()) return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads) ring_kernel(Call call, Shared* shared, const volatile int* aborted) {
  const int r = call.rank, n = call.ranks;
  // The count of barriers before this call; only this rank writes its own, in stream order.
  const unsigned long long base = *reinterpret_cast<volatile unsigned long long*>(&shared->arrived[r]);
  unsigned long long passed = base;
  const auto meet = [&] { return barrier(shared, r, n, ++passed, aborted); };
  if (threadIdx.x == 0) {
    shared->buffers[r] = call.data;
    shared->sends[r] = call.send;
  }
  if (!meet()) return;
  const std::size_t stride = blockDim.x;
  auto* mine = static_cast<float*>(call.data);
  switch (call.op) {
    case Op::all_reduce_sum:
    case Op::all_reduce_avg: {
      const auto sum = [](float a, float b) { return a + b; };  // the sim's mine[i] += stage[i]
      if (!all_reduce_steps(mine, static_cast<const float*>(shared->buffers[(r - 1 + n) % n]), call.count, r, n, sum,
                            meet))
        return;
      if (call.op == Op::all_reduce_avg) {
        const float scale = 1.0f / static_cast<float>(n);
        for (std::size_t i = threadIdx.x; i < call.count; i += stride) mine[i] *= scale;
      }
      return;
    }
    case Op::all_reduce_bf16: {
      // Each addition rounded to bf16 (the sim's bf16_add).
      const auto sum = [](std::uint16_t a, std::uint16_t b) { return bf16_add(a, b); };
      all_reduce_steps(static_cast<std::uint16_t*>(call.data),
                       static_cast<const std::uint16_t*>(shared->buffers[(r - 1 + n) % n]), call.count, r, n, sum,
                       meet);
      return;
    }
    case Op::broadcast: {
      if (r != call.root) {
        const auto* from = static_cast<const unsigned char*>(shared->buffers[call.root]);
        auto* to = static_cast<unsigned char*>(call.data);
        for (std::size_t i = threadIdx.x; i < call.count; i += stride) to[i] = from[i];
      }
      meet();  // the root's buffer is read by all before anyone goes on
      return;
    }
    case Op::reduce: {
      if (r == call.root)  // every other rank's buffer in rank order, the root's own first
        for (std::size_t i = threadIdx.x; i < call.count; i += stride)
          for (int other = 0; other < n; ++other)
            if (other != r) mine[i] += static_cast<const float*>(shared->buffers[other])[i];
      meet();
      return;
    }
    case Op::all_gather: {
      for (int h = 0; h < n; ++h) {
        const auto* from = static_cast<const float*>(shared->sends[h]);
        for (std::size_t i = threadIdx.x; i < call.count; i += stride)
          mine[static_cast<std::size_t>(h) * call.count + i] = from[i];
      }
      meet();
      return;
    }
  }
}

}  // namespace

cudaError_t preload() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, ring_kernel);
}

cudaError_t launch(const Call& call, Shared* shared, const volatile int* aborted, cudaStream_t stream) {
  ring_kernel<<<1, kThreads, 0, stream>>>(call, shared, aborted);
  return cudaGetLastError();
}

}  // namespace dp::detail::ring
