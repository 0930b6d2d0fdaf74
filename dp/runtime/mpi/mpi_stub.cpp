// mpi_stub.cpp — builds without MPI have only the one-process group.
#include "dp/runtime/error.h"
#include "process_backend.h"

namespace dp::detail {

std::shared_ptr<ProcessGroup> mpi_process_group() {
  throw Error("the MPI process group was requested, but dp was built without MPI (install libopenmpi-dev)");
}
bool mpi_compiled() { return false; }

}  // namespace dp::detail
