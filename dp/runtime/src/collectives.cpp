// collectives.cpp — picks the communicator for the group's backend and GPUs.
#include "dp/runtime/collectives.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backend.h"
#include "checked_communicator.h"
#include "dp/runtime/error.h"

namespace dp {

bool shares_a_gpu(const DeviceGroup& group) {
  std::set<int> gpus;
  for (int r = 0; r < group.size(); ++r)
    if (!gpus.insert(group.device(r).gpu()).second) return true;
  return false;
}

BlockRange ring_block(int block, std::size_t count, int n) {
  const auto b = static_cast<std::size_t>(block), parts = static_cast<std::size_t>(n);
  return {count * b / parts, count * (b + 1) / parts};
}

// A reduce to each block's owner, then a broadcast from it: every backend's collectives, in the
// same order on every rank.
void Communicator::reduce_scatter(int rank, const Stream& stream, float* data, std::size_t count) {
  for_each_owned_block(count, size(), [&](int owner, BlockRange block) {
    reduce(rank, stream, data + block.begin, block.size(), owner);
  });
}

void Communicator::all_gather_blocks(int rank, const Stream& stream, float* data, std::size_t count) {
  for_each_owned_block(count, size(), [&](int owner, BlockRange block) {
    broadcast(rank, stream, data + block.begin, block.size() * sizeof(float), owner);
  });
}

namespace {

// What every communicator across processes needs of its processes, checked once here before one is
// made, on every process alike (each sees the same gathered values, so all refuse together): the same
// number of devices in each, and no GPU driven by two of them. NCCL refuses two ranks on one GPU with
// its own "Duplicate GPU detected" deep in its initialisation; devices that share a GPU belong in one
// process, whose devices_per_gpu puts them on the device ring.
void check_processes(const DeviceGroup& group, ProcessGroup& processes) {
  const int local = group.size();
  const std::vector<int> sizes = processes.all_gather(local);
  for (std::size_t p = 0; p < sizes.size(); ++p)
    if (sizes[p] != local)
      throw InvalidArgument(fmt::format(
          "every process must drive the same number of devices: process {} has {}, process {} (host {}) has {}", p,
          sizes[p], processes.rank(), processes.host(), local));
  struct Uuid {
    std::array<char, 96> text{};
  };
  std::vector<Uuid> mine(static_cast<std::size_t>(local));
  for (int r = 0; r < local; ++r) {
    const std::string uuid = group.device(r).gpu_uuid();
    std::memcpy(mine[static_cast<std::size_t>(r)].text.data(), uuid.data(),
                std::min(uuid.size(), mine[0].text.size() - 1));
  }
  const std::vector<Uuid> all = processes.all_gather(std::span<const Uuid>(mine));
  std::map<std::string, int> process_of;  // each GPU's first process
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::string uuid(all[i].text.data());
    const int process = static_cast<int>(i) / local;
    const auto [first, fresh] = process_of.emplace(uuid, process);
    if (fresh || first->second == process) continue;
    // Every process throws the same error here. A process that throws at once may end its part of
    // the job before a peer has read the gathered identities (process 0 serves env://'s store): a
    // barrier first, whose own failure (that peer gone after it) is no news.
    try {
      processes.barrier();
    } catch (const std::exception&) {
    }
    const bool here = process == processes.rank() || first->second == processes.rank();
    const int device_here = here ? group.device(static_cast<int>(i) % local).gpu() : -1;
    throw InvalidArgument(fmt::format(
        "processes {} and {} drive the same GPU {}{}: NCCL cannot put two ranks on one GPU. Run one process "
        "whose devices share the GPU (--devices-per-gpu N: dp's device ring between them), or give each process "
        "its own GPU (LOCAL_RANK under torchrun, CUDA_VISIBLE_DEVICES)",
        first->second, process, uuid,
        group.runtime().backend() == Backend::cuda && device_here >= 0 ? fmt::format(" (GPU {} here)", device_here)
                                                                       : std::string()));
  }
}

}  // namespace

std::unique_ptr<Communicator> Communicator::create(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes) {
  if (!processes) processes = ProcessGroup::single();
  if (processes->size() > 1) check_processes(group, *processes);
  std::unique_ptr<Communicator> inner;
  if (group.runtime().backend() == Backend::cuda)
    inner = shares_a_gpu(group) ? detail::make_device_ring_communicator(group, processes)
                                : detail::make_nccl_communicator(group, processes);
  else
    inner = detail::make_ring_communicator(group, processes);
  // Numbered in creation order, which every process follows (creation is collective).
  static std::atomic<int> created{0};
  return detail::make_checked_communicator(std::move(inner), group, std::move(processes), created++);
}

}  // namespace dp
