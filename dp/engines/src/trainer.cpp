// trainer.cpp — SingleDeviceTrainer: the whole step enqueued on one stream, one sync for the loss.
#include "dp/trainer.h"

#include <fmt/format.h>

#include "common.h"
#include "dp/error.h"

namespace dp {

SingleDeviceTrainer::SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step, bool graphs)
    : model_(model),
      step_options_(step),
      device_ids_{model.device().index()},
      optimizer_(make_optimizer(model.device(), model.param_count(), options)),
      loss_(model.device(), step.label_smoothing),
      stream_(model.device().create_stream()),
      batch_(std::make_unique<engines::StagedBatch>()),
      graphs_(std::make_unique<engines::StepGraphs>(graphs && model.capturable())),
      host_loss_(model.device().allocate_pinned(sizeof(float))),
      step_done_(model.device().create_event()) {}

SingleDeviceTrainer::~SingleDeviceTrainer() {
  try {
    stream_.synchronize();  // the staged batch and scratch die with us
  } catch (...) {           // a destructor never throws; the failure was reported by the step
  }
}

void SingleDeviceTrainer::enqueue_step(int batch) {
  Device& device = model_.device();
  const int classes = model_.output_features();
  float* grad_output = grad_output_.get<float>(device, static_cast<std::size_t>(batch) * classes);
  model_.set_random_context({step_options_.seed, static_cast<std::uint64_t>(optimizer_->steps()), 0});
  const float* logits = model_.forward(stream_, batch_->inputs(), batch, Mode::train);
  const float* loss = loss_.forward_backward(stream_, logits, batch_->targets(), batch, classes, grad_output, batch);
  model_.zero_grad(stream_);
  model_.backward(stream_, grad_output);
  optimizer_->step(stream_, model_.params_flat(), model_.grads_flat());
  stream_.copy(host_loss_.data(), loss, sizeof(float));  // pinned: asynchronous, capturable
}

float SingleDeviceTrainer::step(const float* inputs, const std::int64_t* targets, int batch) {
  if (!targets) throw InvalidArgument("training step without targets (null pointer)");
  Device& device = model_.device();
  const Batch host{inputs, targets, batch};
  const std::size_t floats = engines::sample_floats(model_);
  const engines::StepGraphs::Key key{batch};
  const auto memory = [&] { return engines::snapshot({&device}, batch_->growths()); };
  if (graphs_->enabled()) graphs_->begin_step(memory());
  switch (graphs_->plan(key)) {
    case engines::StepGraphs::Action::replay:
      batch_->write(device, host, floats);  // the previous replay has finished: step_done_
      optimizer_->replayed_step();
      graphs_->graphs(key)[0].replay();
      graphs_->count_replay();
      break;
    case engines::StepGraphs::Action::capture: {
      batch_->write(device, host, floats);
      const bool captured = graphs_->capture(key, {stream_}, {optimizer_.get()}, [&] {
        stream_.begin_capture();
        batch_->enqueue(device, stream_);
        enqueue_step(batch);
        return std::vector<Graph>{stream_.end_capture()};
      });
      if (!captured) return step(inputs, targets, batch);  // this batch size runs eagerly now
      graphs_->graphs(key)[0].replay();                    // this step
      graphs_->count_replay();
      break;
    }
    case engines::StepGraphs::Action::eager: {
      const auto before = memory();
      if (graphs_->enabled()) {  // through the pinned staging a later capture will copy from
        batch_->write(device, host, floats);
        batch_->enqueue(device, stream_);
      } else {
        batch_->stage(device, stream_, host, floats);
      }
      enqueue_step(batch);
      graphs_->eager_done(key, before, memory());
      break;
    }
  }
  if (graphs_->enabled()) graphs_->end_step(memory());
  // One wait for the whole step (the optimizer included: step() returns a finished step).
  stream_.record(step_done_);
  step_done_.synchronize();
  return *host_loss_.as<float>();
}

std::uint64_t SingleDeviceTrainer::graph_replays() const { return graphs_->replays(); }

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
