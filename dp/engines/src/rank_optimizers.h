// rank_optimizers.h — how the ranks of a DDP engine turn their reduced gradients into parameters,
// behind one interface: each rank's own whole update (torch's DDP: every replica steps the same
// gradients), or each global rank updating its part only (ZeRO, zero.cpp). The engine calls these
// on each rank's worker and knows neither.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/engines/reducer.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/process_group.h"

namespace dp::engines {

class RankOptimizers {
 public:
  virtual ~RankOptimizers() = default;
  // What the Reducer does with each gradient bucket before step() runs.
  virtual BucketReduction reduction() const = 0;
  // Rank r's clipping and update, enqueued on `stream` (its compute stream) after the reduction.
  virtual void step(int r, const Stream& stream, Model& model) = 0;
  // Rank r's optimizer: the one whose steps() and lr the engine reads and sets.
  virtual Optimizer& optimizer(int r) const = 0;
  // Whether the ranks clip (then a step has a gradient norm to read).
  virtual bool clips() const = 0;
  // Gradient bytes a rank keeps beside the model's flat gradients (ZeRO: its packed slice; ZeRO-2:
  // and its bucket slots), and whether it keeps the model's flat gradients at all.
  virtual std::size_t gradient_bytes_beside() const { return 0; }
  virtual bool keeps_whole_gradients() const { return true; }
  // ZeRO-2: where rank r's backward writes its gradients (Model::place_gradients), and where the
  // Reducer finds each bucket (the same slots); null: in the model's flat gradient buffer.
  virtual GradientSlots* gradient_slots(int /*r*/) { return nullptr; }
  virtual BucketHome* bucket_home() { return nullptr; }
  // Rank 0's total gradient norm of the last step (the steps have run), or none unclipped.
  virtual std::optional<float> last_grad_norm() const = 0;
  // Engine::freeze and exclude_from_weight_decay, with ranges of the whole flat buffer.
  virtual void freeze(const std::vector<Optimizer::ParamRange>& frozen) = 0;
  virtual void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) = 0;
  // Engine::whole_optimizers and whole_optimizers_loaded (the steps have run).
  virtual std::vector<Optimizer*> whole() = 0;
  virtual void whole_loaded() {}
  // The whole state whole() gathered, which the caller is done with once it trains on (ZeRO's
  // transient copy; plain updates hand out their own).
  virtual void release_whole() {}
  // Fails the collectives of its own communicator, if it has one (a rank failed).
  virtual void abort() {}

  // What outlives a lost device where no device holds the whole state (ZeRO's parts: Note [ZeRO's
  // host copies], zero.cpp). keep: rank r's state once `step` (the optimizers' count) ran, enqueued
  // on `stream`, its compute stream, after the step (eager or replayed) or a load. kept_steps: the
  // steps whose every rank's part is kept, latest first. restore_kept: step `step`'s parameters
  // written into `model` (rank r's replica, on a surviving device) and the whole optimizer state of
  // that step, valid until the next call.
  virtual bool keeps() const { return false; }
  virtual void keep(int /*r*/, const Stream& /*stream*/, const Model& /*model*/, std::int64_t /*step*/) {}
  virtual std::vector<std::int64_t> kept_steps() const { return {}; }
  virtual Optimizer* restore_kept(std::int64_t /*step*/, int /*r*/, Model& /*model*/) { return nullptr; }
};

// The ranks' updates for `options` (EngineOptions::zero). Collective across processes when it makes
// a communicator (every process calls it at the same point). `group` must outlive it.
std::unique_ptr<RankOptimizers> make_rank_optimizers(const DeviceGroup& group,
                                                     const std::shared_ptr<ProcessGroup>& processes,
                                                     const std::vector<GradBucket>& buckets, std::size_t params,
                                                     const OptimizerOptions& optimizer, const EngineOptions& options);

// ZeRO stages 1 and 2 (zero.cpp).
std::unique_ptr<RankOptimizers> make_zero_optimizers(const DeviceGroup& group,
                                                     const std::shared_ptr<ProcessGroup>& processes,
                                                     const std::vector<GradBucket>& buckets, std::size_t params,
                                                     const OptimizerOptions& optimizer, const EngineOptions& options);

}  // namespace dp::engines
