// device_group.cpp — fan work out to the per-device workers, gather failures into one error.
#include "dp/device_group.h"

#include <fmt/format.h>
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

// Waits for every (rank, future) before reporting: the tasks borrow the caller's function.
void wait_all(const std::vector<int>& device_ids, std::vector<std::pair<int, std::future<void>>>& done) {
  int failed = 0, first_rank = -1;
  std::exception_ptr first;
  for (auto& [rank, future] : done) {
    try {
      future.get();
    } catch (...) {
      if (failed++ == 0) {
        first = std::current_exception();
        first_rank = rank;
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

void DeviceGroup::run_on(int rank, const std::function<void()>& task) const {
  std::vector<std::pair<int, std::future<void>>> done;
  done.emplace_back(rank, device(rank).submit(task));
  wait_all(device_ids_, done);
}

}  // namespace dp
