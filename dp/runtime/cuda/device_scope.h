// device_scope.h — keeping the caller's current CUDA device: calls that may come from any thread
// (allocation, events, streams, copies, handle and communicator set-up) make the device they need
// current and leave the caller's current device as they found it. Private to the cuda backend.
#pragma once

#include <cuda_runtime.h>

#include "dp/runtime/detail/kernel_api.h"

namespace dp::detail {

// `device` current for a scope, the caller's device restored after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    DP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device)
      DP_CUDA_CHECK(cudaSetDevice(device));
    else
      previous_ = -1;  // nothing to restore
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);  // never throws from a destructor
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// The caller's current device restored at the end of a scope in which code switches devices
// itself (a loop over devices, NCCL's group initialisation).
class DeviceRestore {
 public:
  DeviceRestore() { DP_CUDA_CHECK(cudaGetDevice(&saved_)); }
  ~DeviceRestore() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != saved_) cudaSetDevice(saved_);  // never throws
  }
  DeviceRestore(const DeviceRestore&) = delete;
  DeviceRestore& operator=(const DeviceRestore&) = delete;

 private:
  int saved_ = 0;
};

}  // namespace dp::detail
