// collectives.cpp — picks the communicator for the group's backend.
#include "dp/collectives.h"

#include "backend.h"

namespace dp {

std::unique_ptr<Communicator> Communicator::create(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes) {
  if (!processes) processes = ProcessGroup::single();
  if (group.runtime().backend() == Backend::cuda) return detail::make_nccl_communicator(group, std::move(processes));
  return detail::make_ring_communicator(group, std::move(processes));
}

}  // namespace dp
