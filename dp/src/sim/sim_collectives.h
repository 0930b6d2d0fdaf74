// sim_collectives.h — the simulator's ring communicator (see sim_collectives.cpp).
#pragma once

#include <memory>

#include "dp/collectives.h"

namespace dp::detail {

// `group` must outlive the communicator.
std::unique_ptr<Communicator> make_sim_communicator(const DeviceGroup& group);
// NCCL communicator (cuda builds), or an error naming the missing backend.
std::unique_ptr<Communicator> make_nccl_communicator(const DeviceGroup& group);

}  // namespace dp::detail
