// input_ring.h — training batches on their way to one device, one slot per step in flight (See
// Note [step slots]): a copy stream moves each batch in while the step before computes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "batches.h"
#include "dp/nn/batch.h"
#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"
#include "step_pipeline.h"

namespace dp::engines {

// Training batches on their way to one device, for the steps of a StepPipeline: per slot, a copy
// stream moves the batch into the slot's device buffers, and the step's stream waits for that copy.
// So the next step's batch is copied in while this step computes (its forward and backward read
// their own slot). A lent batch (Batch::lease) in pinned memory is copied straight from where it
// is; any other is first copied by the host into the slot's pinned staging. The device buffers only
// grow; their addresses are what a graph captured for the slot reads.
class InputRing {
 public:
  InputRing() = default;
  // Copies on `copy` (a stream of the device pushed to), which the rings of one device share: one
  // copy stream per device, however many batches a step takes there.
  explicit InputRing(Stream copy) : copy_(std::move(copy)) {}
  InputRing(const InputRing&) = delete;
  InputRing& operator=(const InputRing&) = delete;
  // Lets go of the leases once the copies from them have run (a failure has been reported already).
  ~InputRing();

  // The inputs (`input_count` elements, may be null) and targets (`target_count`, may be null) into
  // `slot`'s device buffers, on the copy stream once `slot_free` has passed (recorded where the
  // slot's previous step ended: its reads of the slot are done). With a `lease` and both in pinned
  // memory the copy reads them in place and the slot keeps the lease until it has run; else the
  // host first copies them into the slot's pinned staging (whose previous copy out has run:
  // StepPipeline::next_slot waited for it).
  void push(Device& device, int slot, Inputs inputs, std::size_t input_count, const std::int64_t* targets,
            std::size_t target_count, const Event& slot_free, std::shared_ptr<const void> lease = {});
  // `stream` waits for `slot`'s copy. Never inside a capture: a graph's streams wait before it begins.
  void acquire(int slot, const Stream& stream) const;
  Inputs inputs(int slot) const { return {slots_[idx(slot)].inputs.data(), slots_[idx(slot)].dtype}; }
  const std::int64_t* targets(int slot) const {
    return static_cast<const std::int64_t*>(slots_[idx(slot)].targets.data());
  }
  // Lets go of every lease whose copy has run (push does it too): the lender may reuse its memory.
  void release_copied();
  // Reallocations of any slot's buffers (a graph that reads them is stale after one).
  std::uint64_t growths() const { return growths_; }

 private:
  struct Slot {
    PinnedBuffer host_inputs, host_targets;
    Scratch inputs, targets;
    Event copied;                       // on the copy stream: the slot's device buffers hold the pushed batch
    std::shared_ptr<const void> lease;  // of the memory `copied`'s copy reads in place, until it has run
    DType dtype = DType::f32;           // of the inputs pushed last
  };
  static std::size_t idx(int slot) { return static_cast<std::size_t>(slot); }
  std::array<Slot, StepPipeline::kSlots> slots_;
  Stream copy_;  // given, or created on the first push, on the device pushed to
  std::uint64_t growths_ = 0;
};

// A batch of a training step on one device: inputs and targets, pushed into `ring`'s `slot` (with
// its lease). The engine has checked it (check_batch) once, before waiting for anything.
void push_batch(InputRing& ring, Device& device, int slot, const Batch& batch, const SampleSize& sample,
                const Event& slot_free);

}  // namespace dp::engines
