// device_ring.h — the kernels of the device ring (device_ring.cpp), for dp devices that share one
// GPU. Private to the cuda backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace dp::detail::ring {

inline constexpr int kMaxRanks = 64;

// Device memory shared by the ranks of one communicator, all on one GPU. `arrived[r]` counts the
// barriers rank r has passed since the communicator was made; every rank makes the same calls in
// the same order, so all ranks start each call at the same count. `buffers[r]` is the buffer rank r
// posted for the call in progress (read by the others after the call's first barrier, never after
// its last).
struct Shared {
  unsigned long long arrived[kMaxRanks];
  const void* buffers[kMaxRanks];
  const void* sends[kMaxRanks];  // all_gather's send buffers
};

enum class Op { all_reduce_sum, all_reduce_avg, all_reduce_bf16, broadcast, reduce, all_gather };

// One rank's part of one call: a single-block kernel on `stream`. `aborted` is mapped pinned
// memory the host sets to end every wait (Communicator::abort).
struct Call {
  Op op;
  int rank;
  int ranks;
  int root;
  void* data;         // all_reduce / broadcast / reduce: the buffer; all_gather: recv
  const void* send;   // all_gather only
  std::size_t count;  // floats (all_reduce_bf16: bf16 values; broadcast: bytes)
};
cudaError_t launch(const Call& call, Shared* shared, const volatile int* aborted, cudaStream_t stream);
// Loads the ring kernel now (cudaFuncGetAttributes), so that its first launch never needs the
// context synchronization a lazily loaded kernel may (See Note [rings and lazy loading]).
cudaError_t preload();

}  // namespace dp::detail::ring
