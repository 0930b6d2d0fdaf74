// cuda_stub.cpp — stands in for the cuda backend in builds without nvcc.
#include "backend.h"

namespace dp::detail {

int cuda_device_count_impl() { return 0; }
bool cuda_compiled_impl() { return false; }
std::unique_ptr<RuntimeImpl> make_cuda_runtime(const RuntimeOptions&) {
  throw Error(
      "cuda backend requested, but this build of dp has no cuda backend (nvcc was not found at configure time)");
}

}  // namespace dp::detail
