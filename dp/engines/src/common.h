// common.h — what the engines share (private to dp/engines): the model on each device of a group,
// and host batches staged into device memory.
#pragma once

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

// A host batch copied to one device, into grow-only buffers.
class StagedBatch {
 public:
  // Enqueues on `stream` the copies of batch.size samples of `floats_per_sample` inputs, and of the
  // targets when batch.targets is set. Throws InvalidArgument for an empty batch or null inputs.
  void stage(Device& device, const Stream& stream, const Batch& batch, std::size_t floats_per_sample);
  // The same in two halves, for steps that graphs replay: the host copies the batch into pinned
  // staging owned here (write; the previous copy out of it must have run), and the stream copies it
  // from there (enqueue; capturable, as its source never moves). Throws as stage() does.
  void write(Device& device, const Batch& batch, std::size_t floats_per_sample);
  void enqueue(Device& device, const Stream& stream);
  const float* inputs() const { return static_cast<const float*>(inputs_.data()); }
  const std::int64_t* targets() const { return static_cast<const std::int64_t*>(targets_.data()); }
  // Counts the reallocations of the pinned staging (a graph that copies from it is stale after one).
  std::uint64_t growths() const { return growths_; }

 private:
  Scratch inputs_, targets_;
  PinnedBuffer host_inputs_, host_targets_;
  std::size_t input_bytes_ = 0, target_bytes_ = 0;  // of the last write
  std::uint64_t growths_ = 0;
};

// Device memory that graphs may refer to: a step that changes it (a scratch buffer grown for a
// larger batch frees the smaller one) makes every captured step stale.
struct MemorySnapshot {
  std::vector<MemoryStats> stats;
  std::uint64_t staging_growths = 0;
  bool operator==(const MemorySnapshot& other) const;
};
MemorySnapshot snapshot(const std::vector<Device*>& devices, std::uint64_t staging_growths);

// When a training step runs eagerly, is captured, or is replayed (EngineOptions::graphs). A step is
// captured once per key (the batch sizes and whatever else its enqueued work depends on) after one
// eager step with that key has sized every grow-only buffer, and replayed from then on; an eager
// step that moved memory (MemorySnapshot) drops every graph; a key whose capture failed (the model
// did something a graph cannot hold) stays eager.
class StepGraphs {
 public:
  using Key = std::vector<std::int64_t>;
  enum class Action { eager, capture, replay };

  explicit StepGraphs(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  Action plan(const Key& key) const;
  // Before a step: memory that moved since the last step (an evaluation's larger batch grew a
  // buffer, anything allocated on the devices) makes every graph stale.
  void begin_step(const MemorySnapshot& now);
  // After an eager step that started at `before` (its own allocations size its key's buffers).
  void eager_done(const Key& key, const MemorySnapshot& before, const MemorySnapshot& after);
  // After any step: where the next begin_step compares from.
  void end_step(MemorySnapshot after) { last_ = std::move(after); }
  // Runs `record` (it begins the captures on `streams`, enqueues the step, ends them) and keeps its
  // graphs for `key`. When it fails, ends whatever capture is left on `streams` (nothing captured
  // ran) and restores the step counts of `optimizers` (their step() counted a step that did not
  // happen); then, when the failure was a CaptureError (the model did what a graph cannot hold),
  // refuses the key -- it runs eagerly from now on -- and returns false; anything else is rethrown.
  bool capture(const Key& key, const std::vector<Stream>& streams, const std::vector<Optimizer*>& optimizers,
               const std::function<std::vector<Graph>()>& record);
  const std::vector<Graph>& graphs(const Key& key) const { return graphs_.at(key); }
  void count_replay() { ++replays_; }
  std::uint64_t replays() const { return replays_; }

 private:
  bool enabled_;
  std::map<Key, std::vector<Graph>> graphs_;
  std::set<Key> warmed_, refused_;
  std::uint64_t replays_ = 0;
  std::optional<MemorySnapshot> last_;
};

// Throws InvalidArgument unless `batches` holds `expected` batches.
void expect_batches(std::size_t got, int expected, const char* engine);

}  // namespace dp::engines
