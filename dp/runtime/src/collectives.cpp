// collectives.cpp — picks the communicator for the group's backend and GPUs.
#include "dp/runtime/collectives.h"

#include <set>

#include "backend.h"

namespace dp {

bool shares_a_gpu(const DeviceGroup& group) {
  std::set<int> gpus;
  for (int r = 0; r < group.size(); ++r)
    if (!gpus.insert(group.device(r).gpu()).second) return true;
  return false;
}

std::unique_ptr<Communicator> Communicator::create(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes) {
  if (!processes) processes = ProcessGroup::single();
  if (group.runtime().backend() == Backend::cuda)
    return shares_a_gpu(group) ? detail::make_device_ring_communicator(group, std::move(processes))
                               : detail::make_nccl_communicator(group, std::move(processes));
  return detail::make_ring_communicator(group, std::move(processes));
}

}  // namespace dp
