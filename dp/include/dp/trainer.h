// dp/trainer.h — one training step on ONE device: copy in, forward, loss, backward, SGD.
// The unit DP and DDP compose; also the `single` mode of dp_train.
#pragma once

#include <cstdint>
#include <vector>

#include "dp/device.h"
#include "dp/loss.h"
#include "dp/model.h"
#include "dp/optim.h"

namespace dp {

class SingleDeviceTrainer {
 public:
  SingleDeviceTrainer(Model& model, const SgdOptions& options);

  // Host inputs (batch x model.input_shape() floats) and int64 targets; returns the batch's mean
  // loss (waits for the step to finish).
  float step(const float* inputs, const std::int64_t* targets, int batch);

  // Eval-mode forward of host inputs; returns the logits on the host.
  std::vector<float> predict(const float* inputs, int batch);

  // step() already waits for its own work; this is for work enqueued on stream() by the caller.
  void synchronize() { stream_.synchronize(); }

  Model& model() { return model_; }
  Sgd& optimizer() { return optimizer_; }
  const Stream& stream() const { return stream_; }

 private:
  void stage_inputs(const float* inputs, const std::int64_t* targets, int batch);

  Model& model_;
  Sgd optimizer_;
  CrossEntropyLoss loss_;
  Stream stream_;
  DeviceBuffer inputs_, targets_, grad_output_;
};

}  // namespace dp
