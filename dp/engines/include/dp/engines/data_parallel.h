// dp/engines/data_parallel.h — torch.nn.DataParallel semantics on persistent per-device workers:
// each step broadcasts parameters and buffers from device_ids[0], scatters the batch with
// torch.chunk rules, runs forward on every used device, gathers the outputs on output_device,
// computes the loss there, scatters the output gradient back, runs backward, reduce-adds the
// gradients onto device_ids[0] and steps the one optimizer there.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/nn/batch.h"
#include "dp/nn/loss.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/scratch.h"

namespace dp {

namespace engines {
class InputRing;
class Replicas;
class StepGraphs;
class DeviceUpdate;
class StepPipeline;
}  // namespace engines

// Where one DataParallel step spent its time, in ms. Per-device phases report the slowest device;
// gather and reduce include the wait for the slowest device (DP's load imbalance shows there).
struct DataParallelPhases {
  double broadcast = 0, scatter = 0, forward = 0, gather = 0, loss = 0, backward = 0, reduce = 0, update = 0;
};

// torch.chunk(batch, devices): chunks of ceil(batch/devices), the last one smaller, and fewer
// chunks than devices when the batch is small (only that many devices run).
std::vector<int> chunk_sizes(int batch, int devices);

class DataParallel final : public Engine {
 public:
  // `module` lives on device_ids[0] (the source): it holds the master parameters and buffers,
  // and the optimizer steps it. Throws InvalidArgument on a bad configuration, or for an option
  // that applies to another engine (EngineOptions, check_applies). Graphs are not captured with
  // time_phases, whose events a graph does not record.
  DataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer, const EngineOptions& options = {});
  ~DataParallel() override;

  // One training step on a global batch of host inputs (batch x module.input_shape() elements of its input_dtype()) and
  // int64 targets, read before it returns (submit_step also takes a lent batch: Batch::lease); the
  // step is enqueued (Engine::submit_step), its mean cross-entropy loss over the batch to come.
  StepLoss submit(Inputs inputs, const std::int64_t* targets, int batch);
  // submit(...).get(): returns the loss once known.
  float train_step(Inputs inputs, const std::int64_t* targets, int batch);

  // Eval-mode forward of a global batch; returns the gathered (batch, outputs) logits.
  std::vector<float> predict(Inputs inputs, int batch);

  // Engine: one global batch per step, scattered over the devices.
  EngineKind kind() const override { return EngineKind::dp; }
  const std::vector<int>& device_ids() const override { return group_.device_ids(); }
  int batches_per_forward() const override { return 1; }
  int batches_per_step() const override { return accumulate_; }  // EngineOptions::accumulate micro-batches
  using Engine::train_step;
  StepLoss submit_step(std::span<const Batch> batches) override;
  std::vector<float> predict(std::span<const Batch> batches) override;
  using Engine::predict;
  // train_step returns once the loss is known; the optimizer update may still run on the source.
  // Call this before reading parameters from another stream (checkpoints, evaluation).
  void synchronize() override;
  Model& model() const override { return module_; }
  std::vector<Optimizer*> optimizers() override { return {optimizer_}; }

  Optimizer& optimizer() { return *optimizer_; }
  int output_device() const { return output_device_; }
  int source_device() const { return group_.device_ids()[0]; }
  // Chunk sizes of the last step, in device_ids order (its length = devices used).
  const std::vector<int>& last_chunks() const { return chunks_; }
  // Phase times of the last train_step (needs options.time_phases; waits for the step to finish).
  DataParallelPhases last_phases() const;
  std::uint64_t graph_replays() const override;
  std::optional<float> last_grad_norm() override;
  // The source holds the whole state (the module, its buffers and its optimizer); after a device
  // other than the source was lost it is the state of the last update that ran there, its buffers
  // as they were then (restored from the copy each step takes before its forward moves them). None
  // when the source is the device lost.
  std::optional<Survivor> survivor() override;

 private:
  // submit (one batch), and submit_step's micro-batches (the same size)
  StepLoss submit_batches(std::span<const Batch> batches);
  struct Replica;
  void watch_workers();
  void keep_step_start_buffers();
  void plan_chunks(int batch);
  void receive_broadcast(int rank);
  void forward_chunk(int rank, Inputs inputs, Mode mode, int slot, int micro);
  void broadcast_and_forward(Inputs inputs, int batch, Mode mode);
  void gather_outputs();
  std::size_t output_element_size() const;  // bytes of an output element: 2 for bf16 logits, else 4
  // The step's work as phases on the device workers, on the batch in pipeline slot `slot`;
  // `capture`: recorded into a graph (returned) instead of run.
  Graph enqueue_step(int batch, int slot, bool capture);
  // enqueue_step's phases 2-6 of micro-batch `micro` on device `rank`, each through `run_phase`
  // (which runs it unless the step failed, then meets the other workers at the phase's barrier).
  void micro_batch_phases(int rank, int batch, int slot, bool capture, int micro,
                          const std::function<void(const std::function<void()>&)>& run_phase);
  // enqueue_step's phases 4-6: the loss on the output device, a device's backward, the reduction
  // onto the source and the optimizer step.
  void enqueue_loss(int batch, int slot, bool capture, int micro);
  void enqueue_backward(int rank, int micro);
  // The replicas' gradients reduce-added onto the source; `update`: then the optimizer step.
  void enqueue_reduce_and_update(int used, bool update);
  void wait_for_batches(int slot);
  std::uint64_t staging_growths() const;

  Model& module_;
  DeviceGroup group_;
  int output_device_;
  int output_rank_;
  std::unique_ptr<engines::DeviceUpdate> update_;   // clipping and the optimizer's update
  Optimizer* optimizer_;                            // update_'s
  std::unique_ptr<CrossEntropyLoss> loss_;          // on the output device
  std::unique_ptr<engines::Replicas> models_;       // by rank; rank 0 is `module`
  std::vector<std::unique_ptr<Replica>> replicas_;  // by rank: streams, events, staging
  std::vector<int> chunks_;
  std::vector<int> offsets_;  // first sample of each chunk
  int batch_ = 0;
  int accumulate_ = 1;  // micro-batches per step
  bool time_phases_ = false;
  std::uint64_t seed_ = 0;
  Event params_ready_, grad_output_ready_;
  Event grads_read_;  // on the source: the replicas' gradients of the micro-batch so far are reduced
  // On the source: updates that ran there since the first step, the 1 added per update (a count a
  // replayed graph keeps too), and the count when the buffers were last copied (-1: never);
  // counted_from_: the optimizer's steps at the first step.
  DeviceBuffer updates_done_;
  DeviceBuffer step_start_buffers_;  // the module's buffers as the step began (none without buffers)
  std::optional<std::int64_t> counted_from_;
  Event gather_start_, gather_end_, loss_end_, reduce_start_, reduce_end_, update_end_;
  Scratch gathered_, grad_output_;                // on the output device
  PinnedBuffer host_loss_;                        // a float per pipeline slot: the step's loss, without a pageable copy
  std::array<Event, kStepsInFlight> loss_ready_;  // per slot, on the output device: an eager step's loss written
  std::unique_ptr<engines::StepGraphs> graphs_;
  std::vector<std::unique_ptr<engines::InputRing>> targets_rings_;  // on the output device, per micro-batch
  std::array<Event, kStepsInFlight> step_done_;  // per slot, on the source: the whole step has run, its slot is free
  std::unique_ptr<engines::StepPipeline> pipeline_;  // last: waited for before the rest goes
};

}  // namespace dp
