// step_graphs.h — the one sequence every engine's training step goes through: run eagerly,
// captured into graphs once per batch shape and slot, or replayed, with the captures' rules kept.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "dp/runtime/device.h"
#include "step_pipeline.h"

namespace dp {
class Model;
class Optimizer;
}  // namespace dp

namespace dp::engines {

// Device memory that graphs may refer to: a step that changes it (a scratch buffer grown for a
// larger batch frees the smaller one) makes every captured step stale.
struct MemorySnapshot {
  std::vector<MemoryStats> stats;
  std::uint64_t staging_growths = 0;
  bool operator==(const MemorySnapshot& other) const;
};
MemorySnapshot snapshot(const std::vector<Device*>& devices, std::uint64_t staging_growths);

// Note [capture thread]
// Both backends capture in cudaStreamCaptureModeThreadLocal: only the thread that began a capture
// may end it (elsewhere the end is refused and the stream stays capturing, so every later use of it
// fails), and the calls a graph cannot hold fail on that thread alone. So each engine begins and
// ends every capture on one thread (DataParallel: the source's worker, for every device's part of
// the step; DDP: each rank's worker, for its own), and a capture that fails part-way is ended on
// that thread before the error goes on (capture_on, abandon_capture). Other threads (a loader's
// pinned buffers, another device's worker) may allocate meanwhile. docs/cuda-rules.md.

// What a replayed training step reads from device memory and no launch of the graph carries: the
// model's dropout step (Model::upload_random_step: the optimizer's count before this step, as an eager
// forward takes it) and the optimizer's scalars (Optimizer::replayed_step, which counts the step),
// copied on `stream` just before the replay is launched on it.
void upload_replayed_step(Model& model, Optimizer& optimizer, const Stream& stream);

// `enqueue` captured on `stream` (begin_capture .. end_capture) on the calling thread; a failure
// ends the capture here first. See Note [capture thread].
Graph capture_on(const Stream& stream, const std::function<void()>& enqueue);
// Ends what is left of a capture that failed part-way, on the thread that began it; nothing
// captured runs, and the error that made us abandon it is the one reported.
void abandon_capture(const Stream& stream) noexcept;

// What an engine's training step enqueues, in each of the forms StepGraphs::run gives it.
struct StepWork {
  // Captures the step on each of its streams (capture_on, See Note [capture thread]) and returns the
  // graphs, in the order `replay` gets them back.
  std::function<std::vector<Graph>()> capture;
  // Launches the step's graphs (and what must run around them outside the graphs).
  std::function<void(const std::vector<Graph>&)> replay;
  // Enqueues the step kernel by kernel.
  std::function<void()> eager;
  // (A step with no `capture` always runs eagerly.)
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

}  // namespace dp::engines
