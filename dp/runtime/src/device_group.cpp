// device_group.cpp — fan work out to the per-device workers, gather failures into one error.
#include "dp/runtime/device_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <functional>
#include <future>
#include <optional>
#include <set>

namespace dp {

DeviceGroup::DeviceGroup(Runtime& runtime, std::vector<int> device_ids)
    : runtime_(runtime), device_ids_(std::move(device_ids)) {
  if (device_ids_.empty()) throw InvalidArgument("device_ids is empty: at least one device is needed");
  std::set<int> seen;
  for (int id : device_ids_) {
    if (id < 0 || id >= runtime_.device_count())
      throw InvalidArgument(fmt::format("device_ids lists device {}, but the {} backend has {} device(s)", id,
                                        to_string(runtime_.backend()), runtime_.device_count()));
    if (!seen.insert(id).second) throw InvalidArgument(fmt::format("device_ids lists device {} twice", id));
  }
}

namespace {

// Which of `errors` (null where a task succeeded) to report: the first cause, else the first
// collective aborted because of another failure; npos when none failed.
std::size_t reported(const std::vector<std::exception_ptr>& errors) {
  std::size_t consequence = std::string::npos;
  for (std::size_t k = 0; k < errors.size(); ++k) {
    if (!errors[k]) continue;
    try {
      std::rethrow_exception(errors[k]);
    } catch (const CollectiveAborted&) {
      if (consequence == std::string::npos) consequence = k;
    } catch (...) {
      return k;
    }
  }
  return consequence;
}

// Throws WorkerError for the reported one of `errors` (the k-th is ranks[k]'s), if any failed.
void throw_reported(const std::vector<int>& device_ids, const std::vector<int>& ranks,
                    const std::vector<std::exception_ptr>& errors) {
  const std::size_t k = reported(errors);
  if (k == std::string::npos) return;
  const auto failed = static_cast<int>(std::count_if(errors.begin(), errors.end(), [](const auto& e) { return e; }));
  const int device_id = device_ids[static_cast<std::size_t>(ranks[k])];
  throw WorkerError(device_id,
                    fmt::format("device {}: {}{}", device_id, message_of(errors[k]),
                                failed > 1 ? fmt::format(" (and {} more device(s) failed)", failed - 1) : ""),
                    errors[k], failed);
}

// Runs wait(k) for every k (the k-th of `ranks`), all of them, then throws as throw_reported.
void collect(const std::vector<int>& device_ids, const std::vector<int>& ranks,
             const std::function<void(std::size_t)>& wait) {
  std::vector<std::exception_ptr> errors(ranks.size());
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    try {
      wait(k);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  }
  throw_reported(device_ids, ranks, errors);
}

void default_stuck_worker_handler(const std::exception_ptr& failure, const std::string& stuck) {
  std::fprintf(stderr, "dp: error: %s; %s does not return (stuck for good): ending the process\n",
               message_of(failure).c_str(), stuck.c_str());
  std::fflush(nullptr);
  std::_Exit(exit_code(failure));
}

std::atomic<StuckWorkerHandler> stuck_worker_handler{default_stuck_worker_handler};

// Waits for every (rank, future) before reporting: the tasks borrow the caller's function. Once one
// failed, the others get kStuckWorkerGrace; a task still running then is stuck for good.
void wait_all(const std::vector<int>& device_ids, std::vector<std::pair<int, std::future<void>>>& done,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> ranks;
  for (const auto& entry : done) ranks.push_back(entry.first);
  std::vector<std::exception_ptr> errors(done.size());
  std::vector<bool> finished(done.size(), false);
  std::optional<std::chrono::steady_clock::time_point> deadline;
  for (std::size_t remaining = done.size(); remaining > 0;) {
    for (std::size_t k = 0; k < done.size(); ++k) {
      if (finished[k]) continue;
      // One future at a time, briefly: a failure of any is seen within a poll.
      if (done[k].second.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) continue;
      finished[k] = true;
      --remaining;
      try {
        done[k].second.get();
      } catch (...) {
        errors[k] = std::current_exception();
        if (!deadline) deadline = std::chrono::steady_clock::now() + kStuckWorkerGrace;
      }
    }
    const auto now = std::chrono::steady_clock::now();
    const bool timed_out = timeout.count() > 0 && now - start > timeout;
    if (remaining > 0 && ((deadline && now > *deadline) || timed_out)) {
      std::string stuck;
      for (std::size_t k = 0; k < done.size(); ++k)
        if (!finished[k])
          stuck +=
              fmt::format("{}device {}", stuck.empty() ? "" : ", ", device_ids[static_cast<std::size_t>(ranks[k])]);
      const std::size_t k = reported(errors);
      std::exception_ptr first = k == std::string::npos ? nullptr : errors[k];
      if (!first)
        first = std::make_exception_ptr(
            CollectiveTimeout(fmt::format("{} did not finish its work within {} s (timeout; DP_TIMEOUT_S sets it)",
                                          stuck, std::chrono::duration_cast<std::chrono::seconds>(timeout).count())));
      stuck_worker_handler.load()(first, stuck);
      std::_Exit(1);  // a handler must not return
    }
  }
  throw_reported(device_ids, ranks, errors);
}

}  // namespace

void set_stuck_worker_handler(StuckWorkerHandler handler) {
  stuck_worker_handler.store(handler ? handler : default_stuck_worker_handler);
}

std::vector<int> DeviceGroup::all_devices(const Runtime& runtime) {
  std::vector<int> ids(static_cast<std::size_t>(runtime.device_count()));
  for (int i = 0; i < runtime.device_count(); ++i) ids[static_cast<std::size_t>(i)] = i;
  return ids;
}

void DeviceGroup::run(const std::function<void(int rank)>& task, int count) const {
  if (count < 0 || count > size()) count = size();
  std::vector<std::pair<int, std::future<void>>> done;
  done.reserve(static_cast<std::size_t>(count));
  for (int rank = 0; rank < count; ++rank) done.emplace_back(rank, device(rank).submit([&task, rank] { task(rank); }));
  wait_all(device_ids_, done, timeout_);
}

void DeviceGroup::for_each_on_caller(const std::function<void(int rank)>& task) const {
  std::vector<int> ranks(device_ids_.size());
  for (std::size_t r = 0; r < ranks.size(); ++r) ranks[r] = static_cast<int>(r);
  collect(device_ids_, ranks, [&](std::size_t k) { task(ranks[k]); });
}

void DeviceGroup::run_on(int rank, const std::function<void()>& task) const {
  std::vector<std::pair<int, std::future<void>>> done;
  done.emplace_back(rank, device(rank).submit(task));
  wait_all(device_ids_, done);
}

}  // namespace dp
