// dp/runtime/device_group.h — a set of devices driven together: each member's work runs on that device's
// persistent worker thread (created once with the runtime, never per step), and a failure on any
// member comes back to the caller as one error naming the device.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "dp/runtime/device.h"
#include "dp/runtime/error.h"

namespace dp {

// How long DeviceGroup::run waits for its other tasks once one failed, and what ends the process
// when one still runs then: the handler gets the failure and the stuck devices ("device 2") and
// must not return. The default prints both on stderr and calls std::_Exit(exit_code(failure)).
inline constexpr std::chrono::seconds kStuckWorkerGrace{2};
using StuckWorkerHandler = void (*)(const std::exception_ptr& failure, const std::string& stuck);
void set_stuck_worker_handler(StuckWorkerHandler handler);

class DeviceGroup {
 public:
  // device_ids: any subset of the runtime's devices, in any order ("rank" = position); must be
  // non-empty, without duplicates, and exist. Throws InvalidArgument naming the problem.
  DeviceGroup(Runtime& runtime, std::vector<int> device_ids);

  // The ids to use when the caller named none (PyTorch's device_ids=None): every device, in order.
  static std::vector<int> all_devices(const Runtime& runtime);

  int size() const { return static_cast<int>(device_ids_.size()); }
  const std::vector<int>& device_ids() const { return device_ids_; }
  Device& device(int rank) const { return runtime_.device(device_ids_.at(static_cast<std::size_t>(rank))); }
  Runtime& runtime() const { return runtime_; }
  // How long run() waits for its tasks before it counts the unfinished ones as stuck for good
  // (CollectiveTimeout to the stuck-worker handler): none by default; the engines give their
  // processes' DP_TIMEOUT_S.
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

  // Runs task(rank) for ranks [0, count) (default: all) concurrently, each on its device's worker;
  // returns when all have finished. If any threw, throws WorkerError for the lowest failing rank
  // after every task has ended — no worker is left blocked, and the group stays usable. A task
  // that has not ended kStuckWorkerGrace after another failed (a thread stuck for good: the failed
  // peers' collectives were aborted, so only a thread that waits on nothing dp can end stays)
  // cannot be taken back: the stuck-worker handler ends the process.
  void run(const std::function<void(int rank)>& task, int count = -1) const;
  // Runs task(rank) for every rank on the calling thread, in rank order (waiting for what the ranks
  // enqueued, without a submission to their workers); failures are reported as run() reports them.
  void for_each_on_caller(const std::function<void(int rank)>& task) const;
  // Runs task on one member's worker and waits for it.
  void run_on(int rank, const std::function<void()>& task) const;

 private:
  Runtime& runtime_;
  std::vector<int> device_ids_;
  std::chrono::milliseconds timeout_{0};  // 0: none
};

}  // namespace dp
