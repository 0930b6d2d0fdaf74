// common.h — what the engines share (private to dp/engines): the model on each device of a group,
// and host batches staged into device memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "dp/batch.h"
#include "dp/device.h"
#include "dp/device_group.h"
#include "dp/engine.h"
#include "dp/model.h"
#include "dp/scratch.h"

namespace dp {
class Optimizer;
}

namespace dp::engines {

// Floats per sample of the model's input.
std::size_t sample_floats(const Model& model);

// The model on each device of `group`: rank 0 is `module` itself (it must live on device_ids[0],
// else InvalidArgument), the others are replicas whose values the engine broadcasts.
class Replicas {
 public:
  Replicas(Model& module, const DeviceGroup& group);
  Model& operator[](int rank) const { return rank == 0 ? module_ : *owned_[static_cast<std::size_t>(rank)]; }

 private:
  Model& module_;
  std::vector<std::unique_ptr<Model>> owned_;  // [0] stays empty
};

// A host batch copied to one device, into grow-only buffers (evaluation, DDP's forward_backward).
class StagedBatch {
 public:
  // Enqueues on `stream` the copies of batch.size samples of `floats_per_sample` inputs, and of the
  // targets when batch.targets is set. Throws InvalidArgument for an empty batch or null inputs.
  void stage(Device& device, const Stream& stream, const Batch& batch, std::size_t floats_per_sample);
  const float* inputs() const { return static_cast<const float*>(inputs_.data()); }
  const std::int64_t* targets() const { return static_cast<const std::int64_t*>(targets_.data()); }

 private:
  Scratch inputs_, targets_;
};

// The training steps an engine has submitted and not yet waited for (Engine::submit_step). Step k
// uses slot k % kSlots: its pinned inputs and loss, its device input buffers, its graph. Before a
// slot is used again, the step that used it last must have its loss — by then its inputs were
// copied out of the slot's pinned memory — so at most kSlots steps are ever in flight.
class StepPipeline {
 public:
  static constexpr int kSlots = 2;
  StepPipeline() = default;
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;
  // Waits for what is in flight; failures are dropped (a destructor never throws; get() of the
  // failed step's StepLoss still throws).
  ~StepPipeline();

  // The next step's slot, once the step that used it last has its loss (rethrows that step's
  // failure, unless its StepLoss::get() has reported it already).
  int next_slot();
  // The step just submitted in `slot` (next_slot()'s): `wait` waits for its loss and returns it,
  // `query` says whether `wait` would not block.
  StepLoss submitted(int slot, std::function<float()> wait, std::function<bool()> query);
  // The same for a loss that is the pinned float at `loss` once `ready` has passed.
  StepLoss submitted(int slot, const Event& ready, const float* loss);
  // A step whose loss is already known (DDP across processes): takes `slot` without anything in flight.
  StepLoss known(int slot, float loss);
  // Enqueues a step's work through `enqueue`, which returns submitted()'s or known()'s StepLoss. If
  // it throws, work it enqueued before may still read its slot, which the slot's events do not
  // cover (the step's last record never came), so every later step is refused with that failure
  // (next_slot rethrows it), as a CUDA context refuses work after a fault.
  StepLoss enqueue(const std::function<StepLoss()>& enqueue);
  // Waits for the loss of every step in flight; rethrows the first failure no get() has reported.
  void drain();

 private:
  std::array<std::shared_ptr<StepLoss::State>, kSlots> pending_;
  std::uint64_t submitted_ = 0;
  std::exception_ptr refused_;  // what a step failed with while it was being enqueued
};

// The engines' headers size their per-slot events and losses (std::array<Event, 2>) without this file.
static_assert(StepPipeline::kSlots == 2, "dp/trainer.h, dp/data_parallel.h and dp/ddp.h hold two slots");

// Training batches on their way to one device, for the steps of a StepPipeline: per slot, a copy
// stream moves the batch into the slot's device buffers, and the step's stream waits for that copy.
// So the next step's batch is copied in while this step computes (its forward and backward read
// their own slot). A lent batch (Batch::lease) in pinned memory is copied straight from where it
// is; any other is first copied by the host into the slot's pinned staging. The device buffers only
// grow; their addresses are what a graph captured for the slot reads.
class InputRing {
 public:
  InputRing() = default;
  InputRing(const InputRing&) = delete;
  InputRing& operator=(const InputRing&) = delete;
  // Lets go of the leases once the copies from them have run (a failure has been reported already).
  ~InputRing();

  // The inputs (`input_floats`, may be null) and targets (`target_count`, may be null) into
  // `slot`'s device buffers, on the copy stream once `slot_free` has passed (recorded where the
  // slot's previous step ended: its reads of the slot are done). With a `lease` and both in pinned
  // memory the copy reads them in place and the slot keeps the lease until it has run; else the
  // host first copies them into the slot's pinned staging (whose previous copy out has run:
  // StepPipeline::next_slot waited for it).
  void push(Device& device, int slot, const float* inputs, std::size_t input_floats, const std::int64_t* targets,
            std::size_t target_count, const Event& slot_free, std::shared_ptr<const void> lease = {});
  // `stream` waits for `slot`'s copy. Never inside a capture: a graph's streams wait before it begins.
  void acquire(int slot, const Stream& stream) const;
  const float* inputs(int slot) const { return static_cast<const float*>(slots_[idx(slot)].inputs.data()); }
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
  };
  static std::size_t idx(int slot) { return static_cast<std::size_t>(slot); }
  std::array<Slot, StepPipeline::kSlots> slots_;
  Stream copy_;  // created on the first push, on the device pushed to
  std::uint64_t growths_ = 0;
};

// Throws InvalidArgument for an empty batch or null inputs.
void check_batch(const Batch& batch);

// A batch of a training step on one device: inputs and targets (checked: check_batch), pushed into
// `ring`'s `slot` (with its lease).
void push_batch(InputRing& ring, Device& device, int slot, const Batch& batch, std::size_t floats_per_sample,
                const Event& slot_free);

// Device memory that graphs may refer to: a step that changes it (a scratch buffer grown for a
// larger batch frees the smaller one) makes every captured step stale.
struct MemorySnapshot {
  std::vector<MemoryStats> stats;
  std::uint64_t staging_growths = 0;
  bool operator==(const MemorySnapshot& other) const;
};
MemorySnapshot snapshot(const std::vector<Device*>& devices, std::uint64_t staging_growths);

// `enqueue` captured on `stream` (begin_capture .. end_capture) on the calling thread. If it throws,
// or the capture cannot end, the capture is ended here before the error goes on: on the thread that
// began it, as thread-local capture mode requires (ending it elsewhere fails and leaves the stream
// capturing, so every later use of it fails).
Graph capture_on(const Stream& stream, const std::function<void()>& enqueue);
// Ends what is left of a capture that failed part-way, on the thread that began it; nothing
// captured runs, and the error that made us abandon it is the one reported.
void abandon_capture(const Stream& stream) noexcept;

// What an engine's training step enqueues, in each of the forms StepGraphs::run gives it.
struct StepWork {
  // Captures the step on each of its streams (capture_on: a failed capture is ended on the thread
  // that began it) and returns the graphs, in the order `replay` gets them back.
  std::function<std::vector<Graph>()> capture;
  // Launches the step's graphs (and what must run around them outside the graphs).
  std::function<void(const std::vector<Graph>&)> replay;
  // Enqueues the step kernel by kernel.
  std::function<void()> eager;
};

// When a training step runs eagerly, is captured, or is replayed (EngineOptions::graphs): the one
// sequence every engine's step goes through. A step is captured once per key (the batch sizes and
// whatever else its enqueued work depends on) and pipeline slot (whose buffers it reads), after one
// eager step with that key has sized every grow-only buffer, and replayed from then on; an eager
// step that moved memory (MemorySnapshot) drops every graph; a key whose capture failed (the model
// did something a graph cannot hold) stays eager.
class StepGraphs {
 public:
  using Key = std::vector<std::int64_t>;

  explicit StepGraphs(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  // Runs one step of `key` in `slot` in the form its history allows and returns whether it was
  // replayed (its records then come from the graphs). `memory` snapshots what graphs may refer to:
  // memory that moved since the last step (an evaluation's larger batch grew a buffer) makes every
  // graph stale. A capture restores the step counts of `optimizers` (their step() counted a step
  // that did not run: the replay that runs it counts it); a CaptureError while capturing makes the
  // key eager from then on, and the step runs eagerly; any other failure is rethrown.
  bool run(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
           const std::function<MemorySnapshot()>& memory, const StepWork& work);
  std::uint64_t replays() const { return replays_; }

 private:
  enum class Action { eager, capture, replay };
  Action plan(const Key& key, int slot) const;
  bool capture(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
               const std::function<std::vector<Graph>()>& record);
  void drop_graphs();

  bool enabled_;
  std::map<Key, std::array<std::vector<Graph>, StepPipeline::kSlots>> graphs_;
  std::set<Key> warmed_, refused_;
  std::uint64_t replays_ = 0;
  std::optional<MemorySnapshot> last_;
};

// Throws InvalidArgument unless `batches` holds `expected` batches.
void expect_batches(std::size_t got, int expected, const char* engine);

}  // namespace dp::engines
