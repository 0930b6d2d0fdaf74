// dp/runtime/memory.h — move-only owners of device memory and pinned host memory.
// Freeing device memory waits for the device to be idle first (as cudaFree does), so a buffer
// dropped while a stream still uses it is not a use-after-free.
#pragma once

#include <cstddef>
#include <memory>

namespace dp {

namespace detail {
class DeviceImpl;
class RuntimeImpl;
}  // namespace detail

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t size() const noexcept { return bytes_; }
  int device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }
  void reset() noexcept;

 private:
  friend class detail::DeviceImpl;
  DeviceBuffer(detail::DeviceImpl* owner, int device, void* data, std::size_t bytes)
      : owner_(owner), device_(device), data_(data), bytes_(bytes) {}
  detail::DeviceImpl* owner_ = nullptr;
  int device_ = -1;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t size() const noexcept { return bytes_; }
  void reset() noexcept;

 private:
  friend class detail::RuntimeImpl;
  PinnedBuffer(detail::RuntimeImpl* owner, void* data, std::size_t bytes) : owner_(owner), data_(data), bytes_(bytes) {}
  detail::RuntimeImpl* owner_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace dp
