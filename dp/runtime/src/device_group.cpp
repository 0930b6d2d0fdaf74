// device_group.cpp — fan work out to the per-device workers, gather failures into one error.
#include "dp/runtime/device_group.h"

#include <fmt/format.h>
#include <functional>
#include <future>
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

// Runs wait(k) for every k (the k-th of `ranks`), all of them, then throws WorkerError for the
// first failing one, preferring a cause to a collective aborted because of it.
void collect(const std::vector<int>& device_ids, const std::vector<int>& ranks,
             const std::function<void(std::size_t)>& wait) {
  int failed = 0, first_rank = -1;
  std::exception_ptr first;
  bool first_is_consequence = false;  // a CollectiveAborted: a failure found later is the cause
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const int rank = ranks[k];
    try {
      wait(k);
    } catch (const CollectiveAborted&) {
      ++failed;
      if (!first) {
        first = std::current_exception();
        first_rank = rank;
        first_is_consequence = true;
      }
    } catch (...) {
      ++failed;
      if (!first || first_is_consequence) {
        first = std::current_exception();
        first_rank = rank;
        first_is_consequence = false;
      }
    }
  }
  if (!first) return;
  const int device_id = device_ids[static_cast<std::size_t>(first_rank)];
  std::string what;
  try {
    std::rethrow_exception(first);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  throw WorkerError(device_id,
                    fmt::format("device {}: {}{}", device_id, what,
                                failed > 1 ? fmt::format(" (and {} more device(s) failed)", failed - 1) : ""),
                    first, failed);
}

// Waits for every (rank, future) before reporting: the tasks borrow the caller's function.
void wait_all(const std::vector<int>& device_ids, std::vector<std::pair<int, std::future<void>>>& done) {
  std::vector<int> ranks;
  for (const auto& entry : done) ranks.push_back(entry.first);
  collect(device_ids, ranks, [&](std::size_t k) { done[k].second.get(); });
}

}  // namespace

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
  wait_all(device_ids_, done);
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
