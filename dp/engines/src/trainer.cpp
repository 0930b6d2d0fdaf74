// trainer.cpp — SingleDeviceTrainer: the whole step enqueued on one stream, one sync for the loss.
#include "dp/trainer.h"

#include <fmt/format.h>

#include "common.h"
#include "dp/error.h"

namespace dp {

SingleDeviceTrainer::SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step)
    : model_(model),
      step_options_(step),
      device_ids_{model.device().index()},
      optimizer_(make_optimizer(model.device(), model.param_count(), options)),
      loss_(model.device(), step.label_smoothing),
      stream_(model.device().create_stream()),
      batch_(std::make_unique<engines::StagedBatch>()),
      host_loss_(model.device().allocate_pinned(sizeof(float))),
      step_done_(model.device().create_event()) {}

SingleDeviceTrainer::~SingleDeviceTrainer() {
  try {
    stream_.synchronize();  // the staged batch and scratch die with us
  } catch (...) {           // a destructor never throws; the failure was reported by the step
  }
}

float SingleDeviceTrainer::step(const float* inputs, const std::int64_t* targets, int batch) {
  if (!targets) throw InvalidArgument("training step without targets (null pointer)");
  Device& device = model_.device();
  batch_->stage(device, stream_, Batch{inputs, targets, batch}, engines::sample_floats(model_));
  const int classes = model_.output_features();
  float* grad_output = grad_output_.get<float>(device, static_cast<std::size_t>(batch) * classes);
  model_.set_random_context({step_options_.seed, static_cast<std::uint64_t>(optimizer_->steps()), 0});
  const float* logits = model_.forward(stream_, batch_->inputs(), batch, Mode::train);
  const float* loss = loss_.forward(stream_, logits, batch_->targets(), batch, classes);
  loss_.backward(stream_, logits, batch_->targets(), batch, classes, grad_output, batch);
  model_.zero_grad(stream_);
  model_.backward(stream_, grad_output);
  optimizer_->step(stream_, model_.params_flat(), model_.grads_flat());
  // Into pinned memory, then one wait for the whole step (the optimizer included: step() returns
  // a finished step).
  stream_.copy(host_loss_.data(), loss, sizeof(float));
  stream_.record(step_done_);
  step_done_.synchronize();
  return *host_loss_.as<float>();
}

std::vector<float> SingleDeviceTrainer::predict(const float* inputs, int batch) {
  batch_->stage(model_.device(), stream_, Batch{inputs, nullptr, batch}, engines::sample_floats(model_));
  const float* logits = model_.forward(stream_, batch_->inputs(), batch, Mode::eval);
  std::vector<float> out(static_cast<std::size_t>(batch) * model_.output_features());
  stream_.copy(out.data(), logits, out.size() * sizeof(float));
  return out;
}

float SingleDeviceTrainer::train_step(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "single-device");
  return step(batches[0].inputs, batches[0].targets, batches[0].size);
}

std::vector<float> SingleDeviceTrainer::predict(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "single-device");
  return predict(batches[0].inputs, batches[0].size);
}

}  // namespace dp
