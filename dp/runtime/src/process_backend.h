// process_backend.h — the MPI process group comes from dp/runtime/mpi (or its stub when dp is
// built without MPI). Private to the runtime.
#pragma once

#include <memory>

#include "dp/runtime/process_group.h"

namespace dp::detail {

std::shared_ptr<ProcessGroup> mpi_process_group();
bool mpi_compiled();

}  // namespace dp::detail
