// dp/runtime/staged_values.h — a few bytes of host values per step (an optimizer's learning rate and
// bias corrections, a model's dropout step) copied into device memory in stream order, so that the
// kernels reading them take no host value into their launch and a step captured into a graph reads
// the values of each replay.
#pragma once

#include <array>
#include <cstddef>

#include "dp/runtime/device.h"
#include "dp/runtime/memory.h"

namespace dp {

class StagedValues {
 public:
  // At most `max_bytes` per upload, on `device`.
  StagedValues(Device& device, std::size_t max_bytes);

  // `values` into the next of two pinned slots (once the copy out of it two uploads ago has run: an
  // upload made while the previous one's copy is still queued finds its slot free), then their copy
  // into device() on `stream`. While `stream` captures, nothing: a captured copy would read its slot
  // when the replay runs, by then maybe rewritten for a later step still to be submitted, so the
  // caller uploads again on the replay's stream just before each replay instead. Returns device().
  const void* upload(const Stream& stream, const void* values, std::size_t bytes);
  // What the kernels read: device memory of the device, max_bytes.
  void* device() const { return on_device_.data(); }

 private:
  static constexpr int kSlots = 2;
  std::size_t max_bytes_;
  PinnedBuffer slots_;  // kSlots x max_bytes_ (pinned: the copy is asynchronous)
  DeviceBuffer on_device_;
  std::array<Event, kSlots> slot_free_;  // recorded after each copy out of the slot
  std::array<bool, kSlots> slot_pending_{};
  int slot_ = 0;  // the slot written last
};

}  // namespace dp
