// bucket_slots.cpp — ZeRO-2's bucket slots (Note [bucket slots], bucket_slots.h).
#include "bucket_slots.h"

#include <algorithm>
#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp::engines {

BucketSlots::BucketSlots(Device& device, const std::vector<GradBucket>& buckets, std::size_t params)
    : device_(device), buckets_(buckets), held_(buckets.size(), kFree), plan_(buckets.size(), -1) {
  // The widest gap between the buckets (parameters in none).
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (const GradBucket& bucket : buckets_) ranges.emplace_back(bucket.offset, bucket.offset + bucket.count);
  std::ranges::sort(ranges);
  std::size_t widest_gap = 0, at = 0;
  for (const auto& [begin, end] : ranges) {
    widest_gap = std::max(widest_gap, begin - at);
    at = end;
  }
  widest_gap = std::max(widest_gap, params - at);
  if (widest_gap > 0) discard_ = device_.allocate(widest_gap * sizeof(float));
}

void BucketSlots::begin(const Stream& compute) {
  compute_ = &compute;
  std::ranges::fill(held_, kFree);
  released_.clear();
  for (Slot& slot : slots_) slot.busy = slot.released_here = false;
}

float* BucketSlots::gradient(std::size_t offset, std::size_t count) {
  const auto in = std::ranges::find_if(
      buckets_, [&](const GradBucket& b) { return offset >= b.offset && offset + count <= b.offset + b.count; });
  if (in == buckets_.end()) return discard_.as<float>();
  const auto b = static_cast<std::size_t>(in - buckets_.begin());
  if (held_[b] == kReduced)
    throw Error(fmt::format("ZeRO-2: a gradient of bucket {} was asked for after the bucket's reduction", b));
  if (held_[b] == kFree) {
    if (!compute_) throw Error("ZeRO-2: a backward wrote gradients outside a synchronised step");
    if (plan_[b] < 0) plan_[b] = static_cast<int>(take(in->count));
    Slot& slot = slots_[static_cast<std::size_t>(plan_[b])];
    if (slot.busy)
      throw Error(
          fmt::format("ZeRO-2: bucket {}'s slot is still held: this backward asked for gradients in "
                      "another order than the first",
                      b));
    if (slot.released_here) compute_->wait(slot.released);
    slot.busy = true;
    std::erase(released_, static_cast<std::size_t>(plan_[b]));
    held_[b] = plan_[b];
  }
  return slots_[static_cast<std::size_t>(held_[b])].memory.as<float>() + (offset - in->offset);
}

// The first backward's choice, which every later one repeats (Note [bucket slots]).
std::size_t BucketSlots::take(std::size_t count) {
  if (released_.size() < 2) {
    if (compute_->capturing()) throw Error("ZeRO-2: a captured step needs gradient slots its eager run did not make");
    slots_.push_back(Slot{device_.allocate(count * sizeof(float)), device_.create_event()});
    return slots_.size() - 1;
  }
  // The one released longest ago: its reduction overlapped the bucket written after it.
  const std::size_t i = released_.front();
  if (slots_[i].memory.size() < count * sizeof(float)) grow(slots_[i], count);
  return i;
}

void BucketSlots::grow(Slot& slot, std::size_t count) {
  if (compute_->capturing()) throw Error("ZeRO-2: a captured step needs larger gradient slots than its eager run made");
  slot.released.synchronize();  // its last reduction has read it (the first steps only: slots then stop growing)
  slot.memory = DeviceBuffer{};
  slot.memory = device_.allocate(count * sizeof(float));
}

float* BucketSlots::bucket(std::size_t b) const {
  if (held_.at(b) < 0) throw Error(fmt::format("ZeRO-2: bucket {} was reduced without a gradient written into it", b));
  return slots_[static_cast<std::size_t>(held_[b])].memory.as<float>();
}

void BucketSlots::release(std::size_t b, const Stream& stream) {
  const auto i = static_cast<std::size_t>(held_.at(b));
  stream.record(slots_.at(i).released);
  slots_[i].busy = false;
  slots_[i].released_here = true;
  released_.push_back(i);
  held_[b] = kReduced;
}

std::size_t BucketSlots::bytes() const {
  std::size_t bytes = discard_.size();
  for (const Slot& slot : slots_) bytes += slot.memory.size();
  return bytes;
}

}  // namespace dp::engines
