// dp/runtime/scratch.h — device scratch that only grows: reallocated when a call needs more than it holds
// (a larger batch), reused otherwise. The one grow-only buffer of the layers above the runtime.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "dp/runtime/device.h"
#include "dp/runtime/memory.h"

namespace dp {

class Scratch {
 public:
  Scratch() = default;
  // A copy starts empty: scratch belongs to one owner (a layer and its replica on another device
  // each keep their own), so copying a layer must not share or duplicate it.
  Scratch(const Scratch&) noexcept {}
  Scratch& operator=(const Scratch&) noexcept { return *this; }
  Scratch(Scratch&&) noexcept = default;
  Scratch& operator=(Scratch&&) noexcept = default;

  // At least `count` elements of T (at least one) on `device`. Reallocated, contents lost, when the
  // buffer is smaller or lives on another device. Freeing the old buffer waits for the device to be
  // idle (as cudaFree does); where work queued on it may still wait for other devices (a
  // collective), pass `retired`: the outgrown buffer is kept there instead of freed.
  template <class T>
  T* get(Device& device, std::size_t count, std::vector<DeviceBuffer>* retired = nullptr) {
    const std::size_t bytes = std::max<std::size_t>(count, 1) * sizeof(T);
    if (buffer_.size() < bytes || buffer_.device() != device.index()) {
      if (retired && buffer_) retired->push_back(std::move(buffer_));
      buffer_ = device.allocate(bytes);
    }
    return buffer_.as<T>();
  }

  void* data() const noexcept { return buffer_.data(); }
  std::size_t size() const noexcept { return buffer_.size(); }

 private:
  DeviceBuffer buffer_;
};

}  // namespace dp
