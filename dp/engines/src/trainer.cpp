// trainer.cpp — SingleDeviceTrainer: the whole step enqueued on one stream, its loss read when asked for.
#include "dp/engines/trainer.h"

#include "batches.h"
#include "dp/runtime/error.h"
#include "input_ring.h"
#include "replicas.h"
#include "step_graphs.h"
#include "step_pipeline.h"

namespace dp {

SingleDeviceTrainer::SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step, bool graphs)
    : model_(model),
      step_options_(step),
      device_ids_{model.device().index()},
      optimizer_(make_optimizer(model.device(), model.param_count(), options)),
      loss_(model.device(), step.label_smoothing),
      stream_(model.device().create_stream()),
      batch_(std::make_unique<engines::StagedBatch>()),
      ring_(std::make_unique<engines::InputRing>()),
      graphs_(std::make_unique<engines::StepGraphs>(graphs && model.capturable())),
      host_loss_(model.device().allocate_pinned(engines::StepPipeline::kSlots * sizeof(float))),
      pipeline_(std::make_unique<engines::StepPipeline>()) {
  for (Event& done : step_done_) done = model.device().create_event();
  if (step.clip_grad_norm > 0.0) clipper_ = std::make_unique<GradNormClipper>(model.device(), step.clip_grad_norm);
}

std::optional<float> SingleDeviceTrainer::last_grad_norm() {
  if (!clipper_) return std::nullopt;
  synchronize();
  return clipper_->last_norm();
}

SingleDeviceTrainer::~SingleDeviceTrainer() {
  try {
    pipeline_.reset();      // the steps in flight keep their losses
    stream_.synchronize();  // the staged batches and scratch die with us
  } catch (...) {           // a destructor never throws; the failure was reported by the step
  }
}

void SingleDeviceTrainer::enqueue_step(int batch, int slot) {
  Device& device = model_.device();
  const int classes = model_.output_features();
  float* grad_output = grad_output_.get<float>(device, static_cast<std::size_t>(batch) * classes);
  model_.set_random_context({step_options_.seed, static_cast<std::uint64_t>(optimizer_->steps()), 0});
  const float* logits = model_.forward(stream_, ring_->inputs(slot), batch, Mode::train);
  const float* loss = loss_.forward_backward(stream_, logits, ring_->targets(slot), batch, classes, grad_output, batch);
  model_.zero_grad(stream_);
  model_.backward(stream_, grad_output);
  if (clipper_) clipper_->clip(stream_, model_, *optimizer_, model_.grads_flat());
  optimizer_->step(stream_, model_.params_flat(), model_.grads_flat());
  // Pinned: asynchronous and capturable; the slot's own float, so a later step never overwrites it.
  stream_.copy(host_loss_.as<float>() + slot, loss, sizeof(float));
}

StepLoss SingleDeviceTrainer::submit(const float* inputs, const std::int64_t* targets, int batch) {
  return submit_batch(Batch{inputs, targets, batch});
}

StepLoss SingleDeviceTrainer::submit_batch(const Batch& step_batch) {
  const int batch = step_batch.size;
  if (!step_batch.targets) throw InvalidArgument("training step without targets (null pointer)");
  engines::check_batch(step_batch);  // before waiting for the step in flight
  Device& device = model_.device();
  const int slot = pipeline_->next_slot();
  return pipeline_->enqueue([&] {
    const Event& done = step_done_[static_cast<std::size_t>(slot)];
    engines::push_batch(*ring_, device, slot, step_batch, engines::sample_floats(model_), done);
    ring_->acquire(slot, stream_);  // before a capture begins: the graph itself reads the slot's buffers
    engines::StepWork work;
    work.capture = [&] { return std::vector<Graph>{engines::capture_on(stream_, [&] { enqueue_step(batch, slot); })}; };
    work.replay = [&](const std::vector<Graph>& graphs) {
      optimizer_->replayed_step(stream_);
      graphs[0].replay();
      model_.replayed_backward();
    };
    work.eager = [&] { enqueue_step(batch, slot); };
    graphs_->run(
        {batch}, slot, {optimizer_.get()}, [&] { return engines::snapshot({&device}, ring_->growths()); }, work);
    // The loss is the step's last work (the optimizer before it): one event says both.
    stream_.record(done);
    return pipeline_->submitted(slot, done, host_loss_.as<float>() + slot);
  });
}

float SingleDeviceTrainer::train_step(const float* inputs, const std::int64_t* targets, int batch) {
  return submit(inputs, targets, batch).get();
}

std::uint64_t SingleDeviceTrainer::graph_replays() const { return graphs_->replays(); }

std::vector<float> SingleDeviceTrainer::predict(const float* inputs, int batch) {
  pipeline_->drain();  // a failed step is reported here, not by a forward behind it
  batch_->stage(model_.device(), stream_, Batch{inputs, nullptr, batch}, engines::sample_floats(model_));
  const float* logits = model_.forward(stream_, batch_->inputs(), batch, Mode::eval);
  std::vector<float> out(static_cast<std::size_t>(batch) * model_.output_features());
  stream_.copy(out.data(), logits, out.size() * sizeof(float));
  return out;
}

StepLoss SingleDeviceTrainer::submit_step(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "single-device");
  return submit_batch(batches[0]);
}

void SingleDeviceTrainer::synchronize() {
  pipeline_->drain();
  stream_.synchronize();
  ring_->release_copied();  // the lent batches' copies have run (the steps waited for them)
}

std::vector<float> SingleDeviceTrainer::predict(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "single-device");
  return predict(batches[0].inputs, batches[0].size);
}

}  // namespace dp
