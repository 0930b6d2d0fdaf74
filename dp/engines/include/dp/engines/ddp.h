// dp/engines/ddp.h — torch.nn.parallel.DistributedDataParallel semantics: one persistent replica and
// optimizer per device of this process (and, with a ProcessGroup of several processes started by
// mpirun, of every process: global rank = process rank x local devices + local rank), parameters and buffers broadcast
// from rank 0 at construction, buffers broadcast before every forward (broadcast_buffers), gradients averaged by
// bucketed all-reduce launched on a communication stream as soon as each bucket's gradients are ready, overlapping the
// rest of backward; the optimizers wait for all buckets.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/engines/reducer.h"
#include "dp/engines/replica_engine.h"
#include "dp/nn/batch.h"
#include "dp/nn/loss.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/process_group.h"

namespace dp {

class DistributedDataParallel final : public ReplicaEngine {
 public:
  // `module` lives on device_ids[0] and becomes rank 0's replica; its values are broadcast. Rank r
  // = position in device_ids. Every process of `options.processes` constructs its DDP with the same
  // options and the same number of devices. Graphs capture each rank's train_step in one process
  // only; forward_backward/optimizer_step (no_sync loops) run eagerly. Frozen parameters' gradients
  // are not all-reduced (no bucket holds them), as torch's DDP leaves out those that do not
  // require grad; make_engine also keeps the optimizers off them. EngineOptions::shards is
  // make_engine's other engine (InvalidArgument here).
  DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                          const EngineOptions& options = {});
  ~DistributedDataParallel() override;

  // Global ranks over every process; this process's local rank r is global rank first_rank() + r.
  int world_size() const override { return comm_->size(); }
  int first_rank() const override { return comm_->first_rank(); }
  const std::vector<GradBucket>& buckets() const { return reducer_->buckets(); }
  std::size_t gradient_bytes() const override;

  // Engine: one batch per local rank (K with EngineOptions::accumulate, rank after rank).
  // train_step = zero_grad + forward_backward + step; the loss is averaged over all global ranks
  // (each rank's loss is the mean over its own batch), the same value on every process. predict:
  // each local rank's eval-mode forward of its batch, after the buffer broadcast a forward does.
  EngineKind kind() const override { return EngineKind::ddp; }

  // The pieces, for gradient accumulation: gradients of loss * loss_scale are accumulated; they are
  // averaged across ranks unless inside a no_sync() scope. Not with EngineOptions::accumulate
  // (InvalidArgument).
  void zero_grad();
  float forward_backward(std::span<const Batch> batches, float loss_scale = 1.0f);
  // The optimizer's step on every rank (torch's optimizer.step()), after the gradients' all-reduce.
  void optimizer_step();

  // While alive, backward accumulates locally without communication (torch's ddp.no_sync()).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(&ddp) { ddp.sync_ = false; }
    ~NoSync() {
      if (ddp_) ddp_->sync_ = true;
    }
    NoSync(NoSync&& other) noexcept : ddp_(other.ddp_) { other.ddp_ = nullptr; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    DistributedDataParallel* ddp_;
  };
  NoSync no_sync() { return NoSync(*this); }

 private:
  void enqueue_forward_backward_step(int r, std::span<const Batch> mine, bool sync, int slot) override;
  void check_batches(std::span<const Batch> batches, bool training) const override;
  bool broadcasts_buffers() const override { return options_.broadcast_buffers; }
  bool sync_now() const override { return sync_; }
  void synchronize_rank(int r) override;
  // Rank r's forward, loss, backward (its buckets all-reduced when `sync`) and the loss's copy to
  // its `index`-th float of pipeline slot `slot`, enqueued on its compute stream; records its
  // loss_ready event (not while capturing). `ring`: the batch is in the rank's ring `index`, in
  // `slot`; else staged now.
  void enqueue_forward_backward(int r, const Batch& batch, float loss_scale, bool sync, int slot, bool ring,
                                int index = 0);

  std::unique_ptr<Reducer> reducer_;
  bool sync_ = true;
};

}  // namespace dp
