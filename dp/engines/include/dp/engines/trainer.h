// dp/engines/trainer.h — one training step on ONE device: copy in, forward, loss, backward, optimizer step.
// The `single` engine of dp_train and dp_bench, and the baseline DP and DDP are compared with.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/nn/loss.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"

namespace dp {

namespace engines {
class InputRing;
class StagedBatch;
class StepGraphs;
class DeviceUpdate;
class StepPipeline;
}  // namespace engines

class SingleDeviceTrainer final : public Engine {
 public:
  // graphs, accumulate: EngineOptions::graphs and accumulate.
  SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step = {}, bool graphs = false,
                      int accumulate = 1);
  ~SingleDeviceTrainer() override;

  // Host inputs (batch x model.input_shape() elements of model.input_dtype()) and int64 targets, read before it returns
  // (submit_step also takes a lent batch: Batch::lease); the step is enqueued
  // (Engine::submit_step), its mean loss to come.
  StepLoss submit(Inputs inputs, const std::int64_t* targets, int batch);
  // submit(...).get(): returns the batch's mean loss, once the step has finished.
  float train_step(Inputs inputs, const std::int64_t* targets, int batch);

  // Eval-mode forward of host inputs; returns the logits on the host.
  std::vector<float> predict(Inputs inputs, int batch);

  // Engine: one batch per step.
  EngineKind kind() const override { return EngineKind::single; }
  const std::vector<int>& device_ids() const override { return device_ids_; }
  int batches_per_forward() const override { return 1; }
  int batches_per_step() const override { return accumulate_; }
  using Engine::train_step;
  StepLoss submit_step(std::span<const Batch> batches) override;
  std::vector<float> predict(std::span<const Batch> batches) override;
  // The steps in flight, and work enqueued on stream() by the caller.
  void synchronize() override;
  Model& model() const override { return model_; }
  std::vector<Optimizer*> optimizers() override { return {optimizer_}; }

  Optimizer& optimizer() { return *optimizer_; }
  const Stream& stream() const { return stream_; }
  std::uint64_t graph_replays() const override;
  std::optional<float> last_grad_norm() override;

 private:
  // submit (one batch), and submit_step's micro-batches
  StepLoss submit_batches(std::span<const Batch> batches);
  // forward, loss, backward of each micro-batch (of `sizes`), the optimizer step and the losses'
  // copies out, on stream_ (eager or captured), reading the micro-batches of pipeline slot `slot`.
  void enqueue_step(const std::vector<int>& sizes, int slot);

  Model& model_;
  StepOptions step_options_;
  std::vector<int> device_ids_;
  std::unique_ptr<engines::DeviceUpdate> update_;  // clipping and the optimizer's update
  Optimizer* optimizer_;                           // update_'s
  CrossEntropyLoss loss_;
  Stream stream_;
  std::unique_ptr<engines::StagedBatch> batch_;  // predict's
  int accumulate_ = 1;
  // the training steps' batches, one slot per step in flight: a ring per micro-batch
  std::vector<std::unique_ptr<engines::InputRing>> rings_;
  std::unique_ptr<engines::StepGraphs> graphs_;
  Scratch grad_output_;
  PinnedBuffer host_loss_;  // a float per slot: each step's loss, read back without a pageable copy
  std::array<Event, kStepsInFlight> step_done_;      // per slot: the step, its loss included, has run
  std::unique_ptr<engines::StepPipeline> pipeline_;  // last: waited for before the rest goes
};

}  // namespace dp
