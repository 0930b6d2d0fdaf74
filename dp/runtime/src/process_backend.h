// process_backend.h — the MPI process group comes from dp/runtime/mpi, the env:// one from
// dp/runtime/env (or their stubs when dp is built without MPI or gloo). Private to the runtime.
#pragma once

#include <memory>
#include <string>

#include "dp/runtime/process_group.h"

namespace dp::detail {

std::shared_ptr<ProcessGroup> mpi_process_group();
bool mpi_compiled();

// The processes of an env:// launch (dp/runtime/env; its stub without gloo): RANK of WORLD_SIZE,
// meeting at MASTER_ADDR:MASTER_PORT.
std::shared_ptr<ProcessGroup> env_process_group(int rank, int size, const std::string& master, int port);
bool env_compiled();

}  // namespace dp::detail
