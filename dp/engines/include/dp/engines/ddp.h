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
#include "dp/nn/batch.h"
#include "dp/nn/loss.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/process_group.h"

namespace dp {

namespace engines {
class StepGraphs;
class StepPipeline;
class Replicas;
struct StepWork;
}  // namespace engines

class DistributedDataParallel final : public Engine {
 public:
  // `module` lives on device_ids[0] and becomes rank 0's replica; its values are broadcast. Rank r
  // = position in device_ids. Every process of `options.processes` constructs its DDP with the same
  // options and the same number of devices. Graphs capture each rank's train_step in one process
  // only; forward_backward/optimizer_step (no_sync loops) run eagerly. Frozen parameters' gradients
  // are not all-reduced (no bucket holds them), as torch's DDP leaves out those that do not
  // require grad; make_engine also keeps the optimizers off them.
  DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                          const EngineOptions& options = {});
  // make_engine's, with options.shards > 0: runs the sharded step (Note [fixed shards]) as an engine
  // of kind `as`, whose launch rules it keeps (check_applies).
  DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                          const EngineOptions& options, EngineKind as);
  ~DistributedDataParallel() override;

  // Global ranks over every process; this process's local rank r is global rank first_rank() + r.
  // With shards (EngineOptions::shards) the data's ranks are the V shards: this process's first
  // one is shard first_rank() and it takes batches_per_step() of them, V / size() per device.
  int world_size() const override { return options_.shards > 0 ? options_.shards : comm_->size(); }
  int first_rank() const override {
    return options_.shards > 0 ? comm_->first_rank() * batches_per_rank_ : comm_->first_rank();
  }
  ProcessGroup& processes() const;
  const std::vector<GradBucket>& buckets() const { return reducer_->buckets(); }
  Model& replica(int rank) const;
  Optimizer& optimizer(int rank) const;

  // Engine: one batch per local rank. train_step = zero_grad + forward_backward + step; the loss is
  // averaged over all global ranks (each rank's loss is the mean over its own batch), the same
  // value on every process. predict: each local rank's eval-mode forward of its batch, after the
  // buffer broadcast a forward does.
  // With shards: the kind it was made as (make_engine runs every kind's sharded step here).
  EngineKind kind() const override { return options_.shards > 0 ? options_.kind : EngineKind::ddp; }
  const std::vector<int>& device_ids() const override { return group_.device_ids(); }
  int batches_per_forward() const override { return group_.size() * forwards_per_rank(); }
  int batches_per_step() const override { return group_.size() * batches_per_rank_; }
  using Engine::train_step;
  StepLoss submit_step(std::span<const Batch> batches) override;
  std::vector<float> predict(std::span<const Batch> batches) override;
  // Steps return once the loss is known; the optimizer update may still run on the devices.
  // Call this before reading parameters from another stream (checkpoints, evaluation).
  void synchronize() override;
  Model& model() const override { return replica(0); }
  std::vector<Optimizer*> optimizers() override;

  // The pieces, for gradient accumulation: gradients of loss * loss_scale are accumulated; they are
  // averaged across ranks unless inside a no_sync() scope. Not with shards (InvalidArgument).
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

  // Throws Error naming the first parameter and rank whose values differ from rank 0's.
  void check_replicas_identical();
  std::uint64_t graph_replays() const override;
  std::optional<float> last_grad_norm() override;
  void freeze(const std::vector<Optimizer::ParamRange>& frozen) override;
  void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) override;
  std::vector<Optimizer*> whole_optimizers() override;
  void whole_optimizers_loaded() override;

 private:
  struct Rank;
  // Rank r's replica, optimizer (over its ZeRO slice, or all `params`), loss, streams and slots.
  std::unique_ptr<Rank> make_rank(int r, Runtime& runtime, const OptimizerOptions& optimizer, std::size_t params);
  void broadcast_from_rank0(bool parameters, bool buffers);
  // Rank r's share of broadcast_from_rank0, zero_grad and step, enqueued on its compute stream.
  void enqueue_broadcast(int r, bool parameters, bool buffers);
  void enqueue_zero_grad(int r);
  void enqueue_step(int r);
  static std::vector<Optimizer::ParamRange> in_slice(const Rank& rank,
                                                     const std::vector<Optimizer::ParamRange>& ranges);
  // ZeRO-1, on rank r's compute stream: every global rank's slice (rank r's is `slice`, zero_count
  // floats) gathered in rank order; returns the whole buffer (its first param_count() floats).
  const float* gather_slices(int r, const float* slice);
  // Before a forward, on the caller: whether buffers are broadcast first (torch 1.13: unless the
  // previous forward ran inside no_sync), and SyncBatchNorm's global sample count. Returns whether
  // this forward's backward all-reduces (not inside no_sync).
  // `stride`: rank r's (first) batch is batches[r * stride].
  bool begin_forward(std::span<const Batch> batches, bool& broadcast_buffers, int stride = 1);
  // Rank r's forward, loss, backward (its buckets all-reduced when `sync`) and the loss's copy to
  // pipeline slot `slot`'s pinned float, enqueued on its compute stream; records its loss_ready
  // event (not while capturing). `ring`: the batch is in the rank's ring, in `slot`; else staged now.
  // `index`: which of the rank's batches of the step (its ring, its loss's place).
  void enqueue_forward_backward(int r, const Batch& batch, float loss_scale, bool sync, int slot, bool ring,
                                int index = 0);
  // Batches a rank's forward (predict) takes: its shards, or one.
  int forwards_per_rank() const { return options_.shards > 0 ? batches_per_rank_ : 1; }
  // On the caller: the join stream waits for every rank's loss of `slot` (one host wait then).
  void join_losses(int slot);
  const Event& losses_ready(int slot) const;
  // On the caller: waits for every rank's loss of `slot` and returns the mean over all global ranks.
  float wait_for_loss(int slot);
  // Runs task(rank) on every rank; on a failure anywhere, aborts the communicator at once (peers
  // may be waiting in its collectives) and rethrows.
  void run_ranks(const std::function<void(int rank)>& task);
  void abort_communicators();
  void check_batches(std::span<const Batch> batches, bool training) const;
  // Rank r's whole train_step (zero_grad, forward, backward with its buckets, optimizer), enqueued.
  void enqueue_train_step(int r, std::span<const Batch> batches, bool sync, bool broadcast, int slot);
  // With shards: rank r's shards' forwards and backwards, the gradients' all-gather and their sum in
  // shard order (Note [fixed shards]), enqueued on its compute stream.
  void enqueue_sharded_forward_backward(int r, std::span<const Batch> shards, int slot);
  // Rank r's batches of a step's `batches` (one, or its shards).
  std::span<const Batch> batches_of(int r, std::span<const Batch> batches) const;
  // submit_step's work in its three forms (engines::StepGraphs::run picks one): every rank's step
  // captured on its own worker, the ranks' graphs replayed, or enqueued eagerly.
  engines::StepWork step_work(int slot, std::span<const Batch> batches, bool sync, bool broadcast);

  EvalTotals reduce_totals(std::span<const EvalTotals> per_batch) override;
  DeviceGroup group_;
  EngineOptions options_;
  int batches_per_rank_ = 1;
  OptimizerOptions optimizer_options_;
  // ZeRO-1: every global rank's slice of the flat parameters is [g * zero_chunk_, ...), the last
  // one shorter; whole_ is the checkpoint's whole optimizer, while one is asked for.
  std::size_t zero_chunk_ = 0;
  std::vector<Optimizer::ParamRange> trainable_;  // of the whole buffer (clipping), with ZeRO-1
  std::unique_ptr<Communicator> param_comm_;      // ZeRO-1's all-gathers, on the compute streams
  std::unique_ptr<Optimizer> whole_;
  std::vector<Optimizer::ParamRange> frozen_, no_decay_;  // of the whole buffer, with ZeRO-1
  std::shared_ptr<ProcessGroup> processes_;
  std::unique_ptr<engines::Replicas> replicas_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> bn_comm_;  // sync_batchnorm only
  std::unique_ptr<Reducer> reducer_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool sync_ = true;
  bool require_forward_param_sync_ = true;
  std::unique_ptr<engines::StepGraphs> graphs_;
  Stream loss_join_;                                 // on rank 0's device: waits for every rank's loss
  std::array<Event, kStepsInFlight> losses_ready_;   // per pipeline slot, recorded there once it has
  std::unique_ptr<engines::StepPipeline> pipeline_;  // last: waited for before the rest goes
};

}  // namespace dp
