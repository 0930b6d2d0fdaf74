// dp/engines/replica_engine.h — what the engines with a persistent replica per device share (DDP,
// and fixed shards): the replicas, broadcast from rank 0 at construction; each rank's compute
// stream, input rings and losses on the group's persistent workers; the communicators; the ranks'
// updates (plain, or ZeRO's); the steps' pipeline and graphs; the loss averaged over every global
// rank's batches. A derived engine says what a rank's forward and backward of a step are.
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
class RankOptimizers;
struct StepWork;
struct ReplicaRank;
}  // namespace engines

class ReplicaEngine : public Engine {
 public:
  ~ReplicaEngine() override;

  ProcessGroup& processes() const;
  Model& replica(int rank) const;
  Optimizer& optimizer(int rank) const;

  const std::vector<int>& device_ids() const override { return group_.device_ids(); }
  int batches_per_forward() const override { return total(forward_batches_); }
  int batches_per_step() const override { return total(step_batches_); }
  using Engine::train_step;
  // zero_grad + forward and backward (the derived engine's) + the ranks' updates as one submission
  // per device; the loss is the mean over every global rank's batches, the same on every process.
  StepLoss submit_step(std::span<const Batch> batches) override;
  // Each local rank's eval-mode forward of its batches, after the buffers' broadcast from rank 0.
  std::vector<float> predict(std::span<const Batch> batches) override;
  // Steps return once the loss is known; the optimizer update may still run on the devices.
  // Call this before reading parameters from another stream (checkpoints, evaluation).
  void synchronize() override;
  Model& model() const override { return replica(0); }
  std::vector<Optimizer*> optimizers() override;
  std::uint64_t graph_replays() const override;
  std::optional<float> last_grad_norm() override;
  std::optional<Survivor> survivor() override;
  std::size_t gradient_bytes() const override;
  void freeze(const std::vector<Optimizer::ParamRange>& frozen) override;
  void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) override;
  std::vector<Optimizer*> whole_optimizers() override;
  void whole_optimizers_loaded() override;

  // Throws Error naming the first parameter and rank whose values differ from rank 0's.
  void check_replicas_identical();
  // EngineOptions::check_replicas: the replicas' fingerprints compared (every process calls it at
  // the same step); ReplicaMismatch names the device that differs and the first tensor.
  void check_replica_fingerprints();

 protected:
  using Rank = engines::ReplicaRank;
  // Whose step the engine runs: each rank's own batches' (DDP), or the fixed shards' (the only one
  // that takes EngineOptions::shards).
  enum class Step { per_rank, fixed_shards };
  // The group, the replicas and the gradients' communicator (collective across processes).
  ReplicaEngine(Runtime& runtime, Model& module, const EngineOptions& options, Step step);
  // The rest, once the derived engine knows its batches per rank: per step (batches_per_rank) and
  // per forward (forwards_per_rank); `ordered_batchnorm`: BatchNormSync::ordered. Broadcasts the
  // parameters and buffers from rank 0 and zeroes the gradients. Returns the gradient buckets.
  std::vector<GradBucket> start(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                int batches_per_rank, int forwards_per_rank, bool ordered_batchnorm);
  // The same with each local rank's own counts (fixed shards spread unevenly over the devices).
  std::vector<GradBucket> start(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                std::vector<int> step_batches, std::vector<int> forward_batches,
                                bool ordered_batchnorm);

  // Rank r's forward(s) and backward(s) of a training step's `mine` (its batches_of), reading its
  // rings' slot `slot`, each loss copied to the rank's host_loss floats of the slot and loss_ready
  // recorded (not while capturing). `sync`: the gradients are reduced (begin_forward's answer).
  virtual void enqueue_forward_backward_step(int r, std::span<const Batch> mine, bool sync, int slot) = 0;
  // Rank r's part of a training step between its forward and backward and its update: what
  // turns the gradients into the ones the update reads (fixed shards' ordered sum; DDP reduces
  // during backward and has none).
  virtual void enqueue_reduction(int /*r*/, int /*slot*/) {}
  // Whether this training step's gradients are checked before its update (fixed shards' shadow
  // shards), asked on the caller once the step's batches are pushed to slot `slot`, on every
  // process at the same steps. Such a step runs eagerly in two halves: every rank's forward and
  // backward (enqueue_forward_backward_step), then verify_step on the caller, then every rank's
  // reduction and update. verify_step throws to end the step before any update.
  virtual bool verifies_step(std::span<const Batch> /*batches*/, int /*slot*/) { return false; }
  virtual void verify_step(int /*slot*/) {}
  // DP_FAULT's dN of local rank r.
  int fault_device(int r) const { return fault_devices_[static_cast<std::size_t>(r)]; }
  // Throws InvalidArgument for batches a step (training) or a forward cannot take.
  virtual void check_batches(std::span<const Batch> batches, bool training) const = 0;
  // check_batches' part every replica engine shares: each batch at least one sample (a forward's
  // may be empty: that rank's evaluation data ran out), with inputs of the model's dtype, and targets
  // to train on.
  void check_each_batch(std::span<const Batch> batches, bool training) const;
  // Whether buffers are broadcast from rank 0 before a forward (torch's broadcast_buffers).
  virtual bool broadcasts_buffers() const = 0;
  // Whether every replica begins each step with rank 0's buffers (broadcast, or kept equal), and
  // whether it ends each step with them.
  virtual bool replicas_share_buffers() const { return broadcasts_buffers(); }
  virtual bool buffers_end_steps_as_rank0s() const { return false; }
  // Whether this forward's backward reduces the gradients (DDP's no_sync says not).
  virtual bool sync_now() const { return true; }
  // Work on rank r's side streams that synchronize() waits for too.
  virtual void synchronize_rank(int /*r*/) {}

  // Before a forward, on the caller: whether buffers are broadcast first (torch 1.13: unless the
  // previous forward ran inside no_sync), and SyncBatchNorm's global sample count. Returns whether
  // this forward's backward reduces. `stride`: rank r's (first) batch is batches[r * stride].
  bool begin_forward(std::span<const Batch> batches, bool& broadcast_buffers, int stride = 1);
  // Runs task(rank) on every rank; on a failure anywhere, aborts the communicators at once (peers
  // may be waiting in their collectives) and rethrows.
  void run_ranks(const std::function<void(int rank)>& task);
  void abort_communicators();
  void broadcast_from_rank0(bool parameters, bool buffers);
  // Rank r's share of broadcast_from_rank0, zero_grad and step, enqueued on its compute stream.
  void enqueue_broadcast(int r, bool parameters, bool buffers);
  void enqueue_zero_grad(int r);
  void enqueue_step(int r);
  void zero_grads();  // every rank's, after the steps in flight
  // On the caller: the join stream waits for every rank's loss of `slot` (one host wait then).
  void join_losses(int slot);
  const Event& losses_ready(int slot) const;
  // On the caller: waits for every rank's losses of `slot` and returns their mean over all global ranks.
  float wait_for_loss(int slot);
  // Rank r's batches of a step's `batches`.
  std::span<const Batch> batches_of(int r, std::span<const Batch> batches) const;
  // Rank r's local state.
  Rank& rank(int r) const { return *ranks_[static_cast<std::size_t>(r)]; }
  // Drains the steps in flight (their failures are reported here).
  void drain();
  // What the ranks' updates need of the gradients' reduction (ZeRO's blocks, or every gradient).
  BucketReduction bucket_reduction() const;
  // Where the buckets are when the ranks keep no whole gradient buffer (ZeRO-2's slots), or null.
  BucketHome* bucket_home() const;
  // Frees what whole_optimizers() gathered for a checkpoint, if the updates keep it apart; called
  // before a step, when the caller is done with it.
  void release_whole_optimizers();
  // The steps in flight ended and every rank's compute stream idle, reporting no failure (the steps
  // did): a derived engine's destructor calls it before its own members go.
  void quiesce() noexcept;

  EvalTotals reduce_totals(std::span<const EvalTotals> per_batch) override;

  DeviceGroup group_;
  EngineOptions options_;
  std::shared_ptr<ProcessGroup> processes_;
  // Before the communicators: they go first, aborting what still waits in them, before the
  // replicas' memory does.
  std::unique_ptr<engines::Replicas> replicas_;
  std::unique_ptr<Communicator> comm_;  // the gradients'
  int batches_per_rank_ = 1;            // the most any local rank takes per step (its losses' stride)

 private:
  std::unique_ptr<Rank> make_rank(int r, Runtime& runtime, bool ordered_batchnorm);
  // Rank r's whole train_step (zero_grad, forward, backward, update), enqueued.
  void enqueue_train_step(int r, std::span<const Batch> batches, bool sync, bool broadcast, int slot);
  // Its halves: up to the gradients of the step's batches, and from their reduction on.
  void enqueue_forward_backward_half(int r, std::span<const Batch> batches, bool sync, bool broadcast, int slot);
  void enqueue_update_half(int r, int slot);
  // submit_step's work in its three forms (engines::StepGraphs::run picks one): every rank's step
  // captured on its own worker, the ranks' graphs replayed, or enqueued eagerly.
  engines::StepWork step_work(int slot, std::span<const Batch> batches, bool sync, bool broadcast);
  // Every rank's step enqueued eagerly; `verified` (verifies_step's answer): in two halves, with
  // verify_step on the caller between them.
  void run_eager_step(int slot, std::span<const Batch> batches, bool sync, bool broadcast, bool verified);

  // What a surviving rank holds once its work ended (Note [a survivor's state]): its updates
  // completed, and the steps whose running statistics its own buffers and its step-start copy are
  // (rank 0's, or every rank's where they are the same).
  struct Holding {
    int r;
    std::int64_t done;
    std::optional<std::int64_t> own, copy;
  };
  std::vector<Holding> holdings();
  // Counts every rank's completed updates from zero, `steps` being the optimizers' count there.
  void restart_update_counts(std::int64_t steps);
  // What the ranks' updates keep of the state beyond the devices once the steps enqueued so far ran
  // (RankOptimizers::keep: ZeRO's host copies), on every rank's compute stream (keep_update: rank r's,
  // on its worker, after its step).
  void keep_updates();
  void keep_update(int r);
  // DP_FAULT's flip-param faults due at the step just enqueued, after its update.
  void inject_update_faults();
  // What every replica must hold the same bits of (parameters; optimizer state without ZeRO).
  struct Part {
    std::string name;
    const float* data;
  };
  std::vector<Part> fingerprint_parts(int r) const;
  // Every global rank's fingerprints of rank r's `per_rank` words (enqueued by `enqueue`), gathered.
  std::vector<std::uint64_t> gather_fingerprints(std::size_t per_rank,
                                                 const std::function<void(int r, std::uint64_t* out)>& enqueue);

  static int total(const std::vector<int>& counts);
  // The first of rank r's batches among `counts`' (a step's or a forward's).
  static std::size_t first_of(const std::vector<int>& counts, int r);

  std::vector<int> step_batches_ = {1}, forward_batches_ = {1};  // per local rank
  std::vector<int> fault_devices_;                               // per local rank: DP_FAULT's dN
  std::int64_t counted_from_ = 0;          // the optimizers' steps when the update counts were zero
  std::unique_ptr<Communicator> bn_comm_;  // sync_batchnorm only
  std::unique_ptr<engines::RankOptimizers> updates_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool require_forward_param_sync_ = true;
  std::unique_ptr<engines::StepGraphs> graphs_;
  Stream loss_join_;                                 // on rank 0's device: waits for every rank's loss
  std::array<Event, kStepsInFlight> losses_ready_;   // per pipeline slot, recorded there once it has
  std::unique_ptr<engines::StepPipeline> pipeline_;  // last: waited for before the rest goes
};

}  // namespace dp
