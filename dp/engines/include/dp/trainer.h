// dp/trainer.h — one training step on ONE device: copy in, forward, loss, backward, optimizer step.
// The `single` engine of dp_train and dp_bench, and the baseline DP and DDP are compared with.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dp/device.h"
#include "dp/engine.h"
#include "dp/loss.h"
#include "dp/model.h"
#include "dp/optim.h"
#include "dp/scratch.h"

namespace dp {

namespace engines {
class StagedBatch;
class StepGraphs;
}  // namespace engines

class SingleDeviceTrainer final : public Engine {
 public:
  // graphs: EngineOptions::graphs.
  SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step = {}, bool graphs = false);
  ~SingleDeviceTrainer() override;

  // Host inputs (batch x model.input_shape() floats) and int64 targets; returns the batch's mean
  // loss (waits for the step to finish).
  float step(const float* inputs, const std::int64_t* targets, int batch);

  // Eval-mode forward of host inputs; returns the logits on the host.
  std::vector<float> predict(const float* inputs, int batch);

  // Engine: one batch per step.
  EngineKind kind() const override { return EngineKind::single; }
  const std::vector<int>& device_ids() const override { return device_ids_; }
  int batches_per_step() const override { return 1; }
  float train_step(std::span<const Batch> batches) override;
  std::vector<float> predict(std::span<const Batch> batches) override;
  // step() already waits for its own work; this is for work enqueued on stream() by the caller.
  void synchronize() override { stream_.synchronize(); }
  Model& model() const override { return model_; }
  std::vector<Optimizer*> optimizers() override { return {optimizer_.get()}; }

  Optimizer& optimizer() { return *optimizer_; }
  const Stream& stream() const { return stream_; }
  std::uint64_t graph_replays() const override;

 private:
  // forward, loss, backward, optimizer step and the loss's copy out, on stream_ (eager or captured).
  void enqueue_step(int batch);

  Model& model_;
  StepOptions step_options_;
  std::vector<int> device_ids_;
  std::unique_ptr<Optimizer> optimizer_;
  CrossEntropyLoss loss_;
  Stream stream_;
  std::unique_ptr<engines::StagedBatch> batch_;
  std::unique_ptr<engines::StepGraphs> graphs_;
  Scratch grad_output_;
  PinnedBuffer host_loss_;  // the step's loss, read back without a pageable copy
  Event step_done_;
};

}  // namespace dp
