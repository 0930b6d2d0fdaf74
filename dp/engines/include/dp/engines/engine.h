// dp/engines/engine.h — one interface over the three ways dp trains a model: on one device
// (SingleDeviceTrainer), DataParallel and DistributedDataParallel. A program picks its engine once
// (make_engine) with the optimizer of its choice and runs every step, evaluation and checkpoint through this interface.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/engines/reducer.h"
#include "dp/nn/batch.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device.h"
#include "dp/runtime/process_group.h"

namespace dp {

enum class EngineKind { single, dp, ddp };

// What a training step computes besides the optimizer's update, the same for every engine.
struct StepOptions {
  // CrossEntropyLoss(label_smoothing=...): targets (1 - s) * onehot + s / classes.
  double label_smoothing = 0.0;
  // What Dropout draws from (RandomContext): single and DP use it as is, DDP rank r uses seed + r.
  std::uint64_t seed = 0;
  // torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between the gradients' reduction
  // and the optimizer step (GradNormClipper: on the device, no host sync); 0: off.
  double clip_grad_norm = 0.0;
};

// Evaluation totals over some samples: summed cross-entropy, correct top-1 predictions, and the
// targets scored in `samples` (a sample's one; a sequence model's one per position: per token).
// Totals of batches (and of ranks) add up; divide only at the end.
struct EvalTotals {
  double loss_sum = 0.0;
  std::int64_t correct = 0;
  std::int64_t samples = 0;

  EvalTotals& operator+=(const EvalTotals& other);
  double mean_loss() const { return samples ? loss_sum / static_cast<double>(samples) : 0.0; }
  double accuracy() const { return samples ? static_cast<double>(correct) / static_cast<double>(samples) : 0.0; }
};

// "single", "dp", "ddp".
std::string_view to_string(EngineKind kind);
// The inverse of to_string; throws InvalidArgument naming the value otherwise.
EngineKind parse_engine_kind(std::string_view name);

// Note [step slots]
// An engine keeps at most kStepsInFlight training steps in flight (Engine::submit_step). Step k uses
// slot k % kStepsInFlight: its pinned inputs and loss, its device input buffers, its graph. Before a
// slot is used again, the step that used it last must have its loss: by then its inputs were copied
// out of the slot's pinned memory and its work on the device has run, so the slot's buffers are
// free (engines::StepPipeline keeps this; the engines record each slot's events).
inline constexpr int kStepsInFlight = 2;

namespace engines {
class StepPipeline;
}

// The mean loss of a training step that was enqueued but may still run (Engine::submit_step), like
// the loss tensor of a PyTorch step before `.item()`: get() waits for that step's loss only, never
// for later steps. A copy refers to the same loss. Valid after its engine is gone (the engine
// waits for the losses of its steps when it is destroyed).
class StepLoss {
 public:
  StepLoss() = default;  // no step: get() throws InvalidArgument
  // Waits for the loss; rethrows the failure of the step (a failed kernel, a failed collective).
  float get() const;
  // Whether get() would return without waiting.
  bool ready() const;

 private:
  friend class engines::StepPipeline;
  struct State {
    std::function<float()> wait;  // until resolved: waits for the loss, reads it
    std::function<bool()> query;  // until resolved: whether wait() would not block
    std::optional<float> value;
    std::exception_ptr error;
    bool reported = false;  // get() has thrown `error`: the engine does not throw it again
    void resolve();
  };
  explicit StepLoss(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // The kind it was made as (make_engine's EngineOptions::kind), whose launch rules it keeps.
  virtual EngineKind kind() const = 0;
  // What runs the steps: the kind's own engine ("single", "dp", "ddp"), or "fixed shards" (for
  // every kind with EngineOptions::shards).
  virtual std::string_view name() const { return to_string(kind()); }
  // The devices the engine drives, in rank order (single: the model's device).
  virtual const std::vector<int>& device_ids() const = 0;
  // Host batches one forward takes (predict, and each micro-batch of a step): 1 for single and DP
  // (the global batch, which DP scatters), one per local rank for DDP (each rank's shard, as its
  // DistributedSampler gives it), one per shard of this process with shards.
  virtual int batches_per_forward() const = 0;
  // Host batches one step takes: EngineOptions::accumulate micro-batches of batches_per_forward(),
  // in that order for single and DP, rank after rank for DDP (rank r's K micro-batches together).
  virtual int batches_per_step() const { return batches_per_forward(); }
  // The data's shards: DistributedSampler's num_replicas (DDP: the global ranks of every process)
  // and the global rank of this process's first batch. single and DP: 1 and 0.
  virtual int world_size() const { return 1; }
  virtual int first_rank() const { return 0; }

  // One training step (zero_grad, forward, loss, backward, optimizer step) over
  // batches_per_step() batches, enqueued: returns once the batches are copied (the caller may reuse
  // their memory; a lent batch, Batch::lease, is read in place later) and the step's work is on its
  // way, with its mean cross-entropy loss (DDP: averaged over ranks) to come. The host prepares the
  // next batch while the devices run this step, and that batch is copied in (a copy stream, into
  // the other of two device input buffers) while this step computes. At most two steps are in
  // flight: submitting a third waits for the loss of the first, and rethrows its failure. Steps run
  // in submission order, so their results are those of train_step one after another, bit for bit.
  // DDP across processes returns a loss already known.
  virtual StepLoss submit_step(std::span<const Batch> batches) = 0;
  // submit_step(batches).get(): one step, waiting for its loss.
  float train_step(std::span<const Batch> batches) { return submit_step(batches).get(); }
  // Eval-mode forward (BatchNorm uses its running statistics) over batches_per_step() batches;
  // returns the logits of every sample, batch after batch, as (samples, outputs) floats. DDP: a
  // rank's batch may be empty (an evaluation shard that ran out before the others).
  virtual std::vector<float> predict(std::span<const Batch> batches) = 0;
  // predict(), then per sample its plain cross-entropy against the target (in double; no label
  // smoothing, so test losses compare across runs) and whether the
  // arg-max logit (the first of equal maxima, as torch.argmax) is the target. With `predictions`,
  // each sample's arg-max class is appended there, batch after batch. DDP across processes: the
  // totals of every process's batches (each process passes its own; every process gets the sum);
  // predictions stay this process's.
  EvalTotals evaluate(std::span<const Batch> batches, std::vector<std::int32_t>* predictions = nullptr);
  // Steps may still run on the devices (submit_step; train_step returns once the loss is known, the
  // optimizer update may still run): waits for all of them. Call this before reading parameters or
  // optimizer state from another stream.
  virtual void synchronize() = 0;

  // What a checkpoint holds: the model whose parameters and buffers are the run's result (single:
  // the model; DP: the source module; DDP: rank 0's replica), and every optimizer in rank order
  // (one for single and DP; DDP's all have the same state, as their gradients are identical).
  virtual Model& model() const = 0;
  virtual std::vector<Optimizer*> optimizers() = 0;

  // Sets the learning rate of every optimizer (schedules, warm-up). With graphs, the next replay
  // reads it: no re-capture.
  void set_lr(double lr);
  // Keeps the flat parameters in `frozen` fixed (EngineOptions::frozen, as make_engine applies it):
  // no update, no optimizer state.
  virtual void freeze(const std::vector<Optimizer::ParamRange>& frozen);
  // Updates the flat parameters in `ranges` without weight decay (EngineOptions::weight_decay_on,
  // as make_engine applies it): Optimizer::exclude_from_weight_decay on every optimizer.
  virtual void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges);
  // The optimizer state as a checkpoint holds it, every parameter's: optimizers() (their first is
  // saved), or with ZeRO one whole optimizer gathered from the ranks' slices (a collective: every
  // process calls it, and waits for the steps in flight), on the first device until the next call
  // or the next training step, which frees it (a transient copy: ZeRO keeps no whole state).
  virtual std::vector<Optimizer*> whole_optimizers() { return optimizers(); }
  // After a checkpoint's state was loaded into whole_optimizers(): the ranks take their parts.
  virtual void whole_optimizers_loaded() {}
  // With StepOptions::clip_grad_norm: the total gradient norm of the last step, before clipping
  // (waits for the steps in flight: call it where the host may wait, a log line); else none.
  virtual std::optional<float> last_grad_norm() { return std::nullopt; }
  // The gradient memory one device keeps, in bytes: the model's flat gradients and what the engine
  // keeps of them beside (ZeRO: each rank's packed slice; a bf16 reduction: its bf16 copy).
  virtual std::size_t gradient_bytes() const { return model().param_count() * sizeof(float); }
  // Training steps that ran as a replay of a captured graph (EngineOptions::graphs), so far.
  virtual std::uint64_t graph_replays() const { return 0; }

  // After a step failed because a device was lost (DeviceLost) or another process was (PeerLost):
  // the state of the last step that completed on a surviving device of this process, where one
  // holds the whole state (a replica engine; under ZeRO in one process, made from the ranks' host
  // copies), else none. Parameters change only after a step's reduction, which needs every device's
  // gradients, so a survivor holds either the failed step's inputs or, when it already had every
  // gradient, its outputs; `steps` says which. The survivor's optimizer counts `steps` from here on.
  // Waits for the survivors' streams and reports none of their failures.
  struct Survivor {
    const Model* model = nullptr;
    const Optimizer* optimizer = nullptr;
    std::int64_t steps = 0;  // optimizer steps completed there
    int device = 0;
  };
  virtual std::optional<Survivor> survivor() { return std::nullopt; }

 protected:
  // evaluate()'s totals, one per batch of this process -> the totals of every process's batches,
  // added in global batch order (so that how batches are spread over processes changes no bit).
  virtual EvalTotals reduce_totals(std::span<const EvalTotals> per_batch);
};

// Which parameters an optimizer decays (EngineOptions::weight_decay_on).
enum class WeightDecayOn { all, matrices };

// The one configuration of every engine: make_engine's, and the DataParallel and
// DistributedDataParallel constructors' (which are their own kind and ignore `kind`). Each field
// says which engines it applies to. Setting output_device, sync_batchnorm, a bf16 grad_reduce or
// several processes for an engine they do not apply to is an InvalidArgument (check_applies); the
// other fields are tuning the other engines ignore, so one configuration serves a comparison of
// every kind.
struct EngineOptions {
  EngineKind kind = EngineKind::single;  // make_engine: which engine to build
  // Devices in rank order; unset: every device of the runtime (single: the model's device).
  std::optional<std::vector<int>> device_ids = {};
  std::optional<int> output_device = {};  // dp: gathers outputs, computes the loss (default device_ids[0])
  bool time_phases = false;               // dp: record phase times (DataParallel::last_phases)
  double bucket_cap_mb = 25.0;            // ddp: gradient bucket cap, MiB, as torch's bucket_cap_mb
  double first_bucket_mb = 1.0;           // ddp: the first bucket's cap, MiB (torch's _DEFAULT_FIRST_BUCKET_BYTES)
  bool broadcast_buffers = true;          // ddp: buffers broadcast from rank 0 before each forward
  // ddp: torch.nn.SyncBatchNorm.convert_sync_batchnorm: BatchNorm statistics over all ranks'
  // batches (forward and backward), so N ranks of b samples train as one device on N*b samples.
  bool sync_batchnorm = false;
  // ddp and shards: silent corruption caught. Every N steps each replica fingerprints its parameters
  // and optimizer state on its device (kernels::fingerprint: one read, no host copy) and the
  // replicas compare the fingerprints (8 bytes per device across processes); a difference throws
  // ReplicaMismatch naming the device that differs (the odd one out of three or more) and the first
  // tensor. Under ZeRO the parameters alone (each rank holds its own part of the state). 0: off.
  int check_replicas = 0;
  // shards: silent corruption in a step's arithmetic caught, which check_replicas cannot see (a
  // wrong gradient is summed into every replica's update alike). Every K steps one shard, rotating
  // over the devices and their shards, is computed a second time by the next device of its process
  // and the two gradients and losses compared bit for bit before the update (such a step runs
  // eagerly, waiting for the verdict between backward and update). On a mismatch a third device of
  // the process recomputes the shard and the one it disagrees with is dropped as lost (DeviceLost:
  // nothing was updated; the survivors redo the step); with no third device, or no majority,
  // ReplicaMismatch names both. Needs two devices in each process; not with sync_batchnorm
  // (Note [shadow shards], shadow_shards.cpp). 0: off.
  int shadow_shards = 0;
  // ddp: ZeRO stage 1 (DeepSpeed's stage 1, torch's ZeroRedundancyOptimizer) from 1: each global
  // rank keeps and updates the optimizer state of its block of every gradient bucket only (1/n of
  // it); the buckets are reduce-scattered as backward fills them and the updated blocks
  // all-gathered: plain DDP's bytes per step, and on the sim its bits (zero.cpp). Checkpoints stay
  // whole (whole_optimizers()). 2: stage 2, each rank also keeps only its blocks of the gradients
  // (and a few buckets' slots that the backward writes into), where the gradients need not stay
  // whole: not under bf16 compression, accumulate or shards, where it is stage 1 (Note [ZeRO-2's
  // gradients], zero.cpp; zero_stage()); needs a model that places its gradients
  // (Model::place_gradients), and no no_sync. 0: off.
  int zero = 0;
  // zero, in one process of several devices: each rank also copies its part to pinned host memory
  // after every step, so that a lost device's part survives it (survivor(); Note [ZeRO's host
  // copies], zero.cpp). Off: no host copies, and no survivor under ZeRO.
  bool zero_host_copies = true;
  // ddp: the gradient all-reduce in fp32, or in bf16 as torch's bf16_compress_hook (half the bytes).
  GradReduce grad_reduce = GradReduce::fp32;
  // Every kind: torch.autocast around the forward (Model::set_autocast, set on the model and so on
  // every replica): bf16 Linear/Conv2d and activations, fp32 loss, fp32 master weights.
  Autocast amp = Autocast::off;
  StepOptions step = {};  // loss and randomness, every kind
  // Every kind: capture each training step into a graph (CUDA graphs; emulated on sim) once per
  // batch size, after one eager step of that size, and replay it from then on -- the same work
  // with one launch per step, bit for bit the eager results. Steps run eagerly where a graph cannot
  // hold them: a model that is not capturable(), dp with time_phases, ddp across processes.
  bool graphs = false;
  // Every kind: parameters kept fixed, by name prefix ("layer1" holds layer1.0.weight, not
  // layer10.weight), as torch's requires_grad_(False) for fine-tuning: never updated, no optimizer
  // state, and DDP does not all-reduce their gradients (which are still computed). A prefix that
  // names no parameter is an InvalidArgument.
  std::vector<std::string> frozen = {};
  // Every kind: which parameters the optimizer's weight decay applies to: all of them
  // (torch.optim's default, one parameter group), or the matrices only -- the parameters of two
  // or more dimensions -- as nanoGPT's configure_optimizers groups them (biases and LayerNorm and
  // BatchNorm weights in a group of weight_decay 0).
  WeightDecayOn weight_decay_on = WeightDecayOn::all;
  // Every kind: gradient accumulation, K micro-batches per optimizer step (torch's loop of K
  // forward/backward with loss / K, DDP's no_sync for all but the last): a step takes K times
  // batches_per_forward() batches, each micro-batch's loss scaled by 1/K, the gradients summed in
  // micro-batch order, reduced once (ddp: after the last backward); the step's loss is the mean of
  // the K micro-batches'. With shards, K micro-batches of V shards are one step of K x V shards.
  int accumulate = 1;
  // Every kind: V > 0 fixes a step's result to V shards, whatever the devices, processes and kind
  // (Note [fixed shards], fixed_shards.cpp): a step takes V batches, one per shard (DistributedSampler's
  // rank = shard), each device runs its V/P shards as forwards and backwards of their own, and the
  // gradient is the sum of the V shards' gradients in shard order. P must divide V. 0: off.
  int shards = 0;
  // Every kind, with shards, in one process: a device count that does not divide V takes uneven
  // shares (the first ranks one shard more), the same bits at the pace of the busiest device: what
  // the survivors of a lost device go on with. Off, such a count is refused as a likely mistake.
  bool uneven_shards = false;
  // ddp: the processes of the job (ProcessGroup::from_environment() under mpirun); null: this one.
  // single and dp are single-process: a group of several processes is refused for them.
  std::shared_ptr<ProcessGroup> processes = {};
};

// Throws InvalidArgument naming the first field of `options` set for an engine of `kind` that it
// does not apply to (see EngineOptions), or a process group of several processes for a
// single-process kind; returns `options` (for the engines' member initializers).
const EngineOptions& check_applies(EngineKind kind, const EngineOptions& options);

// The ZeRO stage `options` runs (0: none): `zero`, but stage 2 runs as stage 1 where the gradients
// must stay whole (Note [ZeRO-2's gradients], zero.cpp), and then `why` says what keeps them whole.
struct ZeroStage {
  int stage = 0;
  std::string why;
};
ZeroStage zero_stage(const EngineOptions& options);

// `model` lives on device_ids[0] (the source, rank 0, or the one device of single). Throws
// InvalidArgument for options that do not apply to the kind (check_applies).
std::unique_ptr<Engine> make_engine(Runtime& runtime, Model& model, const OptimizerOptions& optimizer,
                                    const EngineOptions& options);

// Going on after a lost device, in one process (docs/training.md, "When a device fails"): the
// state of the last step the survivors hold whole (Engine::survivor) taken to the host, `failed`
// destroyed, and a new engine of `options` over the devices of `failed` that are not lost
// (uneven_shards: with --shards they share the shards as they can), its model built by `build` on
// the first of them and given that state, its optimizers too. None where no survivor holds the
// whole state, or no device survives. `build` makes the failed engine's model afresh.
struct Survivors {
  std::unique_ptr<Model> model;    // on devices.front()
  std::unique_ptr<Engine> engine;  // over `devices`
  std::vector<int> devices;        // the failed engine's devices that are not lost, in its order
  std::int64_t steps = 0;          // the optimizer steps the state holds
};
std::optional<Survivors> go_on_without_lost(Runtime& runtime, std::unique_ptr<Engine> failed,
                                            const std::function<std::unique_ptr<Model>(Device&)>& build,
                                            const OptimizerOptions& optimizer, EngineOptions options);

}  // namespace dp
