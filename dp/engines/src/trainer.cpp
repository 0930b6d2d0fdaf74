// trainer.cpp — SingleDeviceTrainer: the whole step enqueued on one stream, its loss read when asked for.
#include "dp/engines/trainer.h"

#include <fmt/format.h>

#include "batches.h"
#include "device_update.h"
#include "dp/runtime/error.h"
#include "input_ring.h"
#include "replicas.h"
#include "step_graphs.h"
#include "step_pipeline.h"

namespace dp {

SingleDeviceTrainer::SingleDeviceTrainer(Model& model, const OptimizerOptions& options, StepOptions step, bool graphs,
                                         int accumulate)
    : model_(model),
      step_options_(step),
      device_ids_{model.device().index()},
      update_(
          std::make_unique<engines::DeviceUpdate>(model.device(), model.param_count(), options, step.clip_grad_norm)),
      optimizer_(&update_->optimizer()),
      loss_(model.device(), step.label_smoothing),
      stream_(model.device().create_stream()),
      batch_(std::make_unique<engines::StagedBatch>()),
      accumulate_(accumulate),
      graphs_(std::make_unique<engines::StepGraphs>(graphs && model.capturable())),
      host_loss_(model.device().allocate_pinned(engines::StepPipeline::kSlots * static_cast<std::size_t>(accumulate) *
                                                sizeof(float))),
      pipeline_(std::make_unique<engines::StepPipeline>()) {
  if (accumulate < 1) throw InvalidArgument(fmt::format("accumulate must be at least 1, not {}", accumulate));
  const Stream copies = model.device().create_stream();  // every micro-batch's copies, on one stream
  for (int m = 0; m < accumulate; ++m) rings_.push_back(std::make_unique<engines::InputRing>(copies));
  for (Event& done : step_done_) done = model.device().create_event();
}

std::optional<float> SingleDeviceTrainer::last_grad_norm() {
  if (!update_->clips()) return std::nullopt;  // no norm to wait for: the log line does not wait
  synchronize();
  return update_->last_grad_norm();
}

SingleDeviceTrainer::~SingleDeviceTrainer() {
  try {
    pipeline_.reset();      // the steps in flight keep their losses
    stream_.synchronize();  // the staged batches and scratch die with us
  } catch (...) {           // a destructor never throws; the failure was reported by the step
  }
}

void SingleDeviceTrainer::enqueue_step(const std::vector<int>& sizes, int slot) {
  Device& device = model_.device();
  const engines::SampleSize sample = engines::sample_size(model_);
  const auto micro = static_cast<int>(sizes.size());
  std::uint64_t offset = 0;  // micro-batches continue the step's samples, as one larger batch would
  for (int m = 0; m < micro; ++m) {
    const int batch = sizes[static_cast<std::size_t>(m)];
    const int rows = batch * static_cast<int>(sample.targets);
    const engines::InputRing& ring = *rings_[static_cast<std::size_t>(m)];
    float* grad_output = grad_output_.get<float>(device, static_cast<std::size_t>(batch) * sample.logits);
    model_.set_random_context({step_options_.seed, static_cast<std::uint64_t>(optimizer_->steps()), offset});
    offset += static_cast<std::uint64_t>(batch);
    const Model::Output logits = model_.forward_for_loss(stream_, ring.inputs(slot), batch);
    // torch's accumulation loop: (loss / K).backward(), the gradients adding up in micro-batch order.
    const float* loss = loss_.forward_backward(stream_, logits.data, ring.targets(slot), rows, sample.classes,
                                               grad_output, rows, 1.0f / static_cast<float>(micro), logits.bf16);
    if (m == 0) model_.zero_grad(stream_);
    model_.backward_from_loss(stream_, grad_output, logits.bf16);
    // Pinned: asynchronous and capturable; the slot's own floats, so a later step never overwrites them.
    stream_.copy(host_loss_.as<float>() + static_cast<std::size_t>(slot * accumulate_ + m), loss, sizeof(float));
  }
  update_->run(stream_, model_);
}

StepLoss SingleDeviceTrainer::submit(Inputs inputs, const std::int64_t* targets, int batch) {
  const Batch one{inputs, targets, batch};
  return submit_batches(std::span<const Batch>(&one, 1));
}

StepLoss SingleDeviceTrainer::submit_batches(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), accumulate_, "single-device");
  const engines::SampleSize sample = engines::sample_size(model_);
  std::vector<int> sizes;
  for (const Batch& batch : batches) {
    if (!batch.targets) throw InvalidArgument("training step without targets (null pointer)");
    engines::check_batch(batch, sample);  // before waiting for the step in flight
    sizes.push_back(batch.size);
  }
  Device& device = model_.device();
  const int slot = pipeline_->next_slot();
  return pipeline_->enqueue([&] {
    const Event& done = step_done_[static_cast<std::size_t>(slot)];
    for (std::size_t m = 0; m < batches.size(); ++m) {
      engines::push_batch(*rings_[m], device, slot, batches[m], sample, done);
      rings_[m]->acquire(slot, stream_);  // before a capture begins: the graph itself reads the slot's buffers
    }
    engines::StepWork work;
    work.capture = [&] { return std::vector<Graph>{engines::capture_on(stream_, [&] { enqueue_step(sizes, slot); })}; };
    work.replay = [&](const std::vector<Graph>& graphs) {
      engines::upload_replayed_step(model_, *optimizer_, stream_);
      graphs[0].replay();
      model_.replayed_backward();
    };
    work.eager = [&] { enqueue_step(sizes, slot); };
    const auto growths = [&] {
      std::uint64_t total = 0;
      for (const auto& ring : rings_) total += ring->growths();
      return total;
    };
    graphs_->run(
        engines::StepGraphs::Key(sizes.begin(), sizes.end()), slot, {optimizer_},
        [&] { return engines::snapshot({&device}, growths()); }, work);
    // The losses are the step's last work (the optimizer before them): one event says both.
    stream_.record(done);
    const float* losses = host_loss_.as<float>() + static_cast<std::size_t>(slot * accumulate_);
    return pipeline_->submitted(slot, done, losses, accumulate_);
  });
}

float SingleDeviceTrainer::train_step(Inputs inputs, const std::int64_t* targets, int batch) {
  return submit(inputs, targets, batch).get();
}

std::uint64_t SingleDeviceTrainer::graph_replays() const { return graphs_->replays(); }

std::vector<float> SingleDeviceTrainer::predict(Inputs inputs, int batch) {
  pipeline_->drain();  // a failed step is reported here, not by a forward behind it
  const engines::SampleSize sample = engines::sample_size(model_);
  batch_->stage(model_.device(), stream_, Batch{inputs, nullptr, batch}, sample);
  const float* logits = model_.forward(stream_, batch_->inputs(), batch, Mode::eval);
  std::vector<float> out(static_cast<std::size_t>(batch) * sample.logits);
  stream_.copy(out.data(), logits, out.size() * sizeof(float));
  return out;
}

StepLoss SingleDeviceTrainer::submit_step(std::span<const Batch> batches) { return submit_batches(batches); }

void SingleDeviceTrainer::synchronize() {
  pipeline_->drain();
  stream_.synchronize();
  for (auto& ring : rings_) ring->release_copied();  // the lent batches' copies have run (the steps waited for them)
}

std::vector<float> SingleDeviceTrainer::predict(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "single-device");
  return predict(batches[0].inputs, batches[0].size);
}

}  // namespace dp
