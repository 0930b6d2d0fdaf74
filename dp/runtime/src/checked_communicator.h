// checked_communicator.h — every communicator Communicator::create makes is a backend's (NCCL, the
// device ring, the sim ring) inside this one: it numbers each rank's calls, notes them in the flight
// record, lets DP_FAULT's desync kinds act on them, and (unless DP_CHECK_COLLECTIVES=0) has every
// rank agree on the call's signature before the backend sees it.
#pragma once

#include <memory>

#include "dp/runtime/collectives.h"

namespace dp::detail {

// `index`: the communicator's number in this process (the same on every process: they create
// their communicators in the same order). Collective across processes (opens a channel).
std::unique_ptr<Communicator> make_checked_communicator(std::unique_ptr<Communicator> inner, const DeviceGroup& group,
                                                        std::shared_ptr<ProcessGroup> processes, int index);

}  // namespace dp::detail
