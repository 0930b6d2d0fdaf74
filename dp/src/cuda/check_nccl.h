// check_nccl.h — NCCL statuses through the same DP_CUDA_CHECK macro as every other CUDA call.
#pragma once

#include <nccl.h>

#include "check.h"

namespace dp::cuda {

inline void check(ncclResult_t status, const char* call, const char* file, int line) {
  if (status != ncclSuccess) throw_call_error("NCCL", static_cast<int>(status), ncclGetErrorString(status), call, file, line);
}

}  // namespace dp::cuda
