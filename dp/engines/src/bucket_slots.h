// bucket_slots.h — ZeRO-2's gradient memory on one rank: each gradient bucket in a slot of bucket
// size from the first gradient a backward writes into it until its reduce-scatter has run, instead
// of one whole gradient buffer.
#pragma once

#include <cstddef>
#include <vector>

#include "dp/engines/reducer.h"
#include "dp/nn/model.h"
#include "dp/runtime/device.h"
#include "dp/runtime/memory.h"

namespace dp::engines {

// Note [bucket slots]
// A backward asks for each parameter's gradient as its layer's backward is enqueued (Layer::grad).
// The first ask into a bucket gives it a slot, which it keeps until the reducer's reduce-scatter of
// it has run (release(), enqueued on the communication stream). Buckets fill in order, so a few
// slots serve a whole backward: a slot released by bucket b is taken again by bucket b + 2, whose
// gradients the compute stream then writes only after bucket b's reduction (double buffering: one
// bucket reduced while the next is written), plus a slot for a layer whose weight and bias fall in
// two buckets and one for a bucket held from the first layer of the backward to the last (a tied
// embedding, written by the output layer and by the input one). A slot is sized to the largest
// bucket it holds, so one large tensor (an embedding table) costs one slot of its size, not one per
// slot. The host's choices are the same at every step of a batch size, so a captured step replays
// them: the first backward chooses each bucket's slot and every later one takes the same, so slots
// are made and grown only in the first (growing waits for the slot's last reduction), never inside
// a capture. A backward starts with every slot free: the step before ended with the compute stream
// waiting for all its reductions (Reducer::finish). Parameters in no bucket (frozen) get one
// discard area, written and never read.
class BucketSlots final : public GradientSlots {
 public:
  BucketSlots(Device& device, const std::vector<GradBucket>& buckets, std::size_t params);

  void begin(const Stream& compute);  // a backward is about to be enqueued on `compute`
  float* gradient(std::size_t offset, std::size_t count) override;
  float* bucket(std::size_t b) const;                 // bucket b's slot (it must hold one)
  void release(std::size_t b, const Stream& stream);  // enqueued after bucket b's reduction
  std::size_t bytes() const;                          // the slots' and the discard area's

 private:
  struct Slot {
    DeviceBuffer memory;
    Event released;
    bool busy = false;
    bool released_here = false;  // in this backward: the next holder waits for `released`
  };
  static constexpr int kFree = -1, kReduced = -2;
  // The slot a bucket of `count` floats takes in the first backward (Note [bucket slots]).
  std::size_t take(std::size_t count);
  void grow(Slot& slot, std::size_t count);

  Device& device_;
  const std::vector<GradBucket>& buckets_;
  std::vector<Slot> slots_;
  std::vector<std::size_t> released_;  // free slots released in this backward, oldest first
  std::vector<int> held_;              // per bucket: its slot, kFree or kReduced
  std::vector<int> plan_;              // per bucket: the slot the first backward gave it (-1: none yet)
  DeviceBuffer discard_;
  const Stream* compute_ = nullptr;
};

}  // namespace dp::engines
