// check_cudnn.h — the cuDNN overload of dp::cuda::check, so DP_CUDA_CHECK (check.h) takes cuDNN calls.
// Separate from check.h so that files not using cuDNN need not include its headers.
#pragma once

#include <cudnn.h>

#include "check.h"

namespace dp::cuda {

inline void check(cudnnStatus_t status, const char* call, const char* file, int line) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw_call_error("cuDNN", static_cast<int>(status), cudnnGetErrorString(status), call, file, line);
}

}  // namespace dp::cuda
