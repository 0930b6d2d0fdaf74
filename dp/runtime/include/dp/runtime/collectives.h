// dp/runtime/collectives.h — collectives over the devices of a DeviceGroup, one interface for both
// backends: NCCL on cuda (one communicator per device), a real ring over counted device-to-device
// copies on sim (so a rank sends and receives 2(N-1)/N of a buffer per all-reduce). With a
// ProcessGroup of several processes, the ranks are those of every process (global rank = process
// rank x devices per process + local rank): NCCL bootstraps through MPI, the sim ring passes its
// steps between processes as MPI messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "dp/runtime/call_site.h"
#include "dp/runtime/device.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/process_group.h"

namespace dp {

// Whether two devices of `group` run on one GPU (RuntimeOptions::devices_per_gpu > 1). On cuda
// their collectives then run on the device ring (kernels with the sim ring's algorithm and
// summation order: the same bits as the sim), as NCCL refuses two ranks on one GPU; otherwise on
// NCCL. The sim always runs its ring.
bool shares_a_gpu(const DeviceGroup& group);

// NCCL semantics: every rank calls the same collectives in the same order, each from its own
// worker thread, on a stream of its own device; calls are asynchronous for the host and complete
// in stream order. A rank whose peers never arrive waits (on its stream), as on a GPU — abort()
// turns such waits into errors.
class Communicator {
 public:
  // `group` (this process's devices, local rank = position) must outlive the communicator.
  // `processes` (default: this process alone): every process passes a group of the same size, and
  // creates its communicators in the same order (creation is collective across processes).
  static std::unique_ptr<Communicator> create(const DeviceGroup& group,
                                              std::shared_ptr<ProcessGroup> processes = nullptr);
  virtual ~Communicator() = default;

  // Global ranks: size() over all processes, local_size() of them here, local rank r is global
  // rank first_rank() + r. The `rank` argument of every call is the caller's local rank; `root`
  // is a global rank.
  virtual int size() const = 0;
  virtual int local_size() const = 0;
  virtual int first_rank() const = 0;
  // data (count floats on rank's device) = op over all ranks' data.
  virtual void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) = 0;
  // data (count bfloat16 values, as their bits: dp/runtime/bfloat16.h) = the sum over all ranks,
  // every addition made in fp32 and rounded to bf16 (NCCL's ncclBfloat16 sum; the sim ring and the
  // device ring add in their ring order, NCCL in its own). Half the bytes of the fp32 all_reduce.
  virtual void all_reduce_bf16(int rank, const Stream& stream, std::uint16_t* data, std::size_t count) = 0;
  // data (bytes on each rank's device) = root's data.
  virtual void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) = 0;
  // root's data = sum over all ranks' data; other ranks' data unchanged.
  virtual void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) = 0;
  // recv (size() * count floats) = the ranks' send buffers (count floats each), in rank order.
  virtual void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) = 0;
  // The two halves of all_reduce(sum), for an optimizer that updates a slice of the parameters on
  // each rank: `data` (count floats) is cut into size() blocks (ring_block); after reduce_scatter,
  // block owned_block(g) of global rank g holds the sum over all ranks and the other blocks are
  // undefined; all_gather_blocks then copies each rank's owned block into every rank's `data`. Each
  // rank sends (n-1)/n of the buffer in each half, all_reduce's volume in all. The sim ring runs
  // all_reduce's own two phases, so the summed block has all_reduce's bits; NCCL (grouped) and the
  // device ring run a reduce and a broadcast per block: maybe in another order than their all_reduce.
  virtual void reduce_scatter(int rank, const Stream& stream, float* data, std::size_t count);
  virtual void all_gather_blocks(int rank, const Stream& stream, float* data, std::size_t count);
  // Fails every pending and future collective instead of letting ranks wait for absent peers.
  virtual void abort() = 0;
  // Rank `rank` has issued every call of a unit of work (an optimizer step): with checked
  // collectives (flight_record.h) the ranks agree on that too, so a rank that issued fewer calls
  // than its peers is named at once instead of leaving them waiting. No backend call; host only.
  // `where`: the call site its signature names.
  virtual void end_of(int /*rank*/, std::string_view /*what*/, CallSite /*where*/ = CallSite::here()) {}
};

// Block b of a reduce_scatter of `count` elements over n ranks: [count*b/n, count*(b+1)/n), the
// ring all-reduce's chunks (sizes differ by at most one).
struct BlockRange {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};
BlockRange ring_block(int block, std::size_t count, int n);
// The block a reduce_scatter leaves summed on global rank g: a ring finishes each block on the rank
// before the one that started it, g + 1.
inline int owned_block(int global_rank, int n) { return (global_rank + 1) % n; }
// f(owner, block) for every global rank's non-empty block of `count` elements, in rank order: the
// order of the per-block collectives a reduce_scatter or all_gather_blocks may be made of.
template <class F>
void for_each_owned_block(std::size_t count, int n, F&& f) {
  for (int owner = 0; owner < n; ++owner) {
    const BlockRange block = ring_block(owned_block(owner, n), count, n);
    if (block.size()) f(owner, block);
  }
}

}  // namespace dp
