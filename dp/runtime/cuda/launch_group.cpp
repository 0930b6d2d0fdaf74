// launch_group.cpp — See Note [implicit synchronization] (launch_group.h).
#include "launch_group.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp::detail {

std::mutex& implicit_sync_mutex() {
  static std::mutex mutex;
  return mutex;
}

cudaError_t LaunchGroup::arrive(int rank, std::function<cudaError_t()> launch, const char* what) {
  if (size() == 1) {
    const std::lock_guard serial(implicit_sync_mutex());
    return launch();
  }
  std::unique_lock lock(mutex_);
  if (aborted_) throw CollectiveAborted(fmt::format("{}: communicator was aborted", what));
  Pending& mine = pending_[static_cast<std::size_t>(rank)];
  if (mine.waiting)
    throw InvalidArgument(fmt::format("{}: rank {} arrived twice at one call of the device ring", what, rank));
  mine.launch = std::move(launch);
  mine.waiting = true;
  const unsigned long long generation = generation_;
  if (++arrived_ < size()) {
    launched_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw CollectiveAborted(fmt::format("{}: communicator was aborted", what));
    return mine.status;  // written by the launcher before it advanced the generation
  }
  {
    const std::lock_guard serial(implicit_sync_mutex());
    for (Pending& p : pending_) p.status = p.launch();
  }
  for (Pending& p : pending_) {
    p.launch = nullptr;
    p.waiting = false;
  }
  arrived_ = 0;
  ++generation_;
  launched_.notify_all();
  return mine.status;
}

void LaunchGroup::abort() {
  {
    const std::lock_guard lock(mutex_);
    aborted_ = true;
  }
  launched_.notify_all();
}

}  // namespace dp::detail
