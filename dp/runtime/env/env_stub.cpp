// env_stub.cpp — dp built without gloo: no env:// process group (a job needs mpirun).
#include "dp/runtime/error.h"
#include "process_backend.h"

namespace dp::detail {

bool env_compiled() { return false; }

std::shared_ptr<ProcessGroup> env_process_group(int, int, const std::string&, int) {
  throw Error("dp was built without gloo, which an env:// launch needs: start the processes with mpirun");
}

}  // namespace dp::detail
