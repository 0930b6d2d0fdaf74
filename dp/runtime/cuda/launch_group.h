// launch_group.h — launching the parts of one device-ring call (or the replays of graphs that hold
// such calls) of every rank together, for dp devices that share a GPU. Private to the cuda backend.
#pragma once

#include <condition_variable>
#include <cuda_runtime.h>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace dp::detail {

// Note [implicit synchronization]
// "Two commands from different streams cannot run concurrently if any one of the following
// operations is issued in-between them by the host thread: a page-locked host memory allocation, a
// device memory allocation, a device memory set, a memory copy between two addresses to the same
// device memory, any CUDA command to the NULL stream" (CUDA Programming Guide, Implicit
// Synchronization). A ring kernel spins until its peers' kernels run; if rank 1's worker allocates
// after rank 0's kernel was launched and before its own, rank 1's kernel may only start once rank
// 0's has ended, which never happens: the first GPU run hung so. So the ranks' parts of a call are
// launched together: each rank's worker arrives with its launch, the last to arrive launches all of
// them back to back, and those operations (dp's device and pinned allocations and frees) take the
// same process-wide lock, so none comes between two launches of a group. The lock covers issuing
// them only, never a wait for the GPU (cudaFree, cudaFreeHost, a stream synchronization): the work
// waited for may need a host thread that is waiting for the lock (a host function, a group's
// launcher). A rank's worker returns once its part is launched, so its later
// work is ordered after it on its streams, as a direct launch would be.
std::mutex& implicit_sync_mutex();

class LaunchGroup {
 public:
  explicit LaunchGroup(int ranks) : pending_(static_cast<std::size_t>(ranks)) {}
  int size() const { return static_cast<int>(pending_.size()); }
  // Rank `rank`'s part, launched with the others' once all have arrived; returns its status.
  // Throws CollectiveAborted (with `what`) once the group is aborted.
  cudaError_t arrive(int rank, std::function<cudaError_t()> launch, const char* what);
  // Every waiting and later arrival throws.
  void abort();

 private:
  struct Pending {
    std::function<cudaError_t()> launch;
    cudaError_t status = cudaSuccess;
    bool waiting = false;
  };
  std::mutex mutex_;
  std::condition_variable launched_;
  std::vector<Pending> pending_;
  int arrived_ = 0;
  unsigned long long generation_ = 0;
  bool aborted_ = false;
};

// The replay group of a graph that captured device-ring calls, and its rank there: a replay
// arrives at the group (see Note [implicit synchronization]). Collected per capturing thread
// between begin_capture and end_capture.
struct CapturedRingCall {
  std::shared_ptr<LaunchGroup> replays;
  int rank = 0;
};
void note_captured_ring_call(CapturedRingCall call);

}  // namespace dp::detail
