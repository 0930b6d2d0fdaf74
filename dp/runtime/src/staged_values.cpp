// staged_values.cpp — see dp/runtime/staged_values.h.
#include "dp/runtime/staged_values.h"

#include <cstring>

#include "dp/runtime/error.h"

namespace dp {

StagedValues::StagedValues(Device& device, std::size_t max_bytes)
    : max_bytes_(max_bytes),
      slots_(device.allocate_pinned(kSlots * max_bytes)),
      on_device_(device.allocate(max_bytes)) {
  for (Event& free : slot_free_) free = device.create_event();
}

const void* StagedValues::upload(const Stream& stream, const void* values, std::size_t bytes) {
  if (bytes > max_bytes_) throw InvalidArgument("staged values exceed their slot");
  if (stream.capturing()) return on_device_.data();
  slot_ = (slot_ + 1) % kSlots;
  const auto slot = static_cast<std::size_t>(slot_);
  if (slot_pending_[slot]) {
    // Rare: the copy of two uploads ago has not run yet.
    if (!slot_free_[slot].query()) slot_free_[slot].synchronize();
    slot_pending_[slot] = false;
  }
  std::byte* staged = slots_.as<std::byte>() + slot * max_bytes_;
  std::memcpy(staged, values, bytes);
  stream.copy(on_device_.data(), staged, bytes);
  stream.record(slot_free_[slot]);
  slot_pending_[slot] = true;
  return on_device_.data();
}

}  // namespace dp
