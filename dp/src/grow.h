// grow.h — device scratch that only ever grows: reallocated when a step needs more than it holds
// (a larger batch), reused otherwise. Shared by the engines.
#pragma once

#include <cstddef>

#include "dp/device.h"

namespace dp::detail {

inline void grow(DeviceBuffer& buffer, Device& device, std::size_t bytes) {
  if (buffer.size() < bytes) buffer = device.allocate(bytes);
}

}  // namespace dp::detail
