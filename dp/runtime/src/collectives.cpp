// collectives.cpp — picks the communicator for the group's backend.
#include "dp/collectives.h"

#include "backend.h"

namespace dp {

std::unique_ptr<Communicator> Communicator::create(const DeviceGroup& group) {
  if (group.runtime().backend() == Backend::cuda) return detail::make_nccl_communicator(group);
  return detail::make_ring_communicator(group);
}

}  // namespace dp
