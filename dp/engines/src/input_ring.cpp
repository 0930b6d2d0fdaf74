// input_ring.cpp — batches copied into the slots of the steps in flight.
#include "input_ring.h"

#include <cstring>

namespace dp::engines {
namespace {
// At least `bytes` of pinned memory in `buffer`; true when it had to be reallocated.
bool reserve_pinned(Device& device, PinnedBuffer& buffer, std::size_t bytes) {
  if (buffer.size() >= bytes) return false;
  buffer = device.allocate_pinned(bytes);
  return true;
}
}  // namespace

InputRing::~InputRing() {
  try {
    if (copy_.valid()) copy_.synchronize();  // no copy still reads a lease's memory
  } catch (...) {                            // a failed copy reads nothing; the step reported the failure
  }
}

void InputRing::release_copied() {
  for (Slot& s : slots_) {
    if (!s.lease) continue;
    bool done = true;
    try {
      done = s.copied.query();
    } catch (...) {  // failed: the copy will never read the memory
    }
    if (done) s.lease.reset();
  }
}

void InputRing::push(Device& device, int slot, Inputs inputs, std::size_t input_count, const std::int64_t* targets,
                     std::size_t target_count, const Event& slot_free, std::shared_ptr<const void> lease) {
  if (!copy_.valid()) copy_ = device.create_stream();
  const std::size_t input_bytes = inputs ? input_count * dtype_size(inputs.dtype()) : 0;
  const std::size_t target_bytes = targets ? target_count * sizeof(std::int64_t) : 0;
  release_copied();
  // Lent pinned memory is read in place: the host's copy of a 3.2 MB batch (MLP b1024) would take
  // about as long as the whole step is meant to take on an H100 (a 183 us step at 5.6M samples/s).
  const bool in_place = lease && (!input_bytes || device.is_pinned(inputs.data(), input_bytes)) &&
                        (!target_bytes || device.is_pinned(targets, target_bytes));
  // A larger batch sizes every slot at once, so that the other slot's first step with it moves no
  // memory (it would make the graphs of this one stale). Its device buffers are reallocated
  // (freeing waits for the device to be idle); its pinned staging too (its previous copy out has
  // run: the pipeline waited for the losses of the steps in flight before this push).
  for (Slot& s : slots_) {
    if (!s.copied.valid()) s.copied = device.create_event();
    const bool stage = !in_place && (s.host_inputs.size() < input_bytes || s.host_targets.size() < target_bytes);
    // The other slot's pinned memory may still be copied out (its step in flight).
    if (stage) s.copied.synchronize();
    if (s.inputs.size() < input_bytes || s.targets.size() < target_bytes) ++growths_;
    if (input_bytes) (void)s.inputs.get<std::byte>(device, input_bytes);
    if (target_bytes) (void)s.targets.get<std::int64_t>(device, target_count);
    if (stage && reserve_pinned(device, s.host_inputs, input_bytes)) ++growths_;
    if (stage && reserve_pinned(device, s.host_targets, target_bytes)) ++growths_;
  }
  Slot& s = slots_[idx(slot)];
  // Done already when the slot's last step has its loss (StepPipeline::next_slot); not when that
  // step failed after its push, before the pipeline knew of it.
  if (!s.copied.query()) s.copied.synchronize();
  s.lease.reset();
  if (inputs) s.dtype = inputs.dtype();
  const void* from_inputs = inputs.data();
  const void* from_targets = targets;
  if (in_place) {
    s.lease = std::move(lease);  // before the copies are enqueued: kept until they have run
  } else {
    if (input_bytes) from_inputs = std::memcpy(s.host_inputs.data(), inputs.data(), input_bytes);
    if (target_bytes) from_targets = std::memcpy(s.host_targets.data(), targets, target_bytes);
  }
  copy_.wait(slot_free);
  if (input_bytes) copy_.copy(s.inputs.data(), from_inputs, input_bytes);
  if (target_bytes) copy_.copy(s.targets.data(), from_targets, target_bytes);
  copy_.record(s.copied);
}

void InputRing::acquire(int slot, const Stream& stream) const { stream.wait(slots_[idx(slot)].copied); }

void push_batch(InputRing& ring, Device& device, int slot, const Batch& batch, const SampleSize& sample,
                const Event& slot_free) {
  const auto samples = static_cast<std::size_t>(batch.size);
  ring.push(device, slot, batch.inputs, samples * sample.inputs, batch.targets,
            batch.targets ? samples * sample.targets : 0, slot_free, batch.lease);
}

}  // namespace dp::engines
