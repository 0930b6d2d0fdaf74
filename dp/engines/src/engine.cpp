// engine.cpp — the Engine interface's shared pieces, make_engine, and the engines' common helpers.
#include "dp/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "common.h"
#include "dp/data_parallel.h"
#include "dp/ddp.h"
#include "dp/error.h"
#include "dp/shape.h"
#include "dp/trainer.h"

namespace dp {

std::string_view to_string(EngineKind kind) {
  switch (kind) {
    case EngineKind::single: return "single";
    case EngineKind::dp: return "dp";
    case EngineKind::ddp: return "ddp";
  }
  return "unknown";
}

EngineKind parse_engine_kind(std::string_view name) {
  for (EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp})
    if (name == to_string(kind)) return kind;
  throw InvalidArgument(fmt::format("unknown engine '{}' (expected single, dp or ddp)", name));
}

EvalTotals& EvalTotals::operator+=(const EvalTotals& other) {
  loss_sum += other.loss_sum;
  correct += other.correct;
  samples += other.samples;
  return *this;
}

EvalTotals Engine::evaluate(std::span<const Batch> batches, std::vector<std::int32_t>* predictions) {
  for (const Batch& batch : batches)
    if (batch.size > 0 && !batch.targets) throw InvalidArgument("evaluation batch without targets (null pointer)");
  const std::vector<float> logits = predict(batches);
  const auto classes = static_cast<std::size_t>(model().output_features());
  EvalTotals totals;
  std::size_t row = 0;
  for (const Batch& batch : batches) {
    for (int i = 0; i < batch.size; ++i, ++row) {
      const float* x = logits.data() + row * classes;
      const std::int64_t target = batch.targets[i];
      if (target < 0 || static_cast<std::size_t>(target) >= classes)
        throw InvalidArgument(fmt::format("evaluation target {} is outside [0, {})", target, classes));
      std::size_t best = 0;
      for (std::size_t c = 1; c < classes; ++c)
        if (x[c] > x[best]) best = c;  // strict: the first of equal maxima wins
      double sum = 0.0;
      for (std::size_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(x[c]) - x[best]);
      totals.loss_sum += std::log(sum) + x[best] - x[target];
      totals.correct += best == static_cast<std::size_t>(target) ? 1 : 0;
      if (predictions) predictions->push_back(static_cast<std::int32_t>(best));
      ++totals.samples;
    }
  }
  return reduce_totals(totals);
}

void StepLoss::State::resolve() {
  if (!wait) return;
  try {
    value = wait();
  } catch (...) {
    error = std::current_exception();
  }
  wait = nullptr;  // what it refers to (the engine's events and pinned loss) may go away now
  query = nullptr;
}

float StepLoss::get() const {
  if (!state_) throw InvalidArgument("StepLoss::get: this StepLoss belongs to no training step");
  state_->resolve();
  if (state_->error) {
    state_->reported = true;
    std::rethrow_exception(state_->error);
  }
  return *state_->value;
}

bool StepLoss::ready() const { return state_ && (!state_->query || state_->query()); }

void Engine::set_lr(double lr) {
  for (Optimizer* optimizer : optimizers()) optimizer->set_lr(lr);
}

std::unique_ptr<Engine> make_engine(Runtime& runtime, Model& model, const OptimizerOptions& optimizer,
                                    const EngineOptions& options) {
  if (options.sync_batchnorm && options.kind != EngineKind::ddp)
    throw InvalidArgument(fmt::format("sync_batchnorm applies to ddp, not {}", to_string(options.kind)));
  if (options.processes && options.processes->size() > 1 && options.kind != EngineKind::ddp)
    throw InvalidArgument(fmt::format(
        "{} is single-process by definition, but this job has {} processes: use ddp across processes (or run "
        "without mpirun)",
        options.kind == EngineKind::dp ? "DataParallel" : "single-device training", options.processes->size()));
  if (options.output_device && options.kind != EngineKind::dp)
    throw InvalidArgument(fmt::format("output_device applies to dp, not {}", to_string(options.kind)));
  switch (options.kind) {
    case EngineKind::single:
      if (options.device_ids && (options.device_ids->size() != 1 || (*options.device_ids)[0] != model.device().index()))
        throw InvalidArgument(fmt::format("single-device training runs on the model's device {}, not on [{}]",
                                          model.device().index(), fmt::join(*options.device_ids, ", ")));
      return std::make_unique<SingleDeviceTrainer>(model, optimizer, options.step, options.graphs);
    case EngineKind::dp: {
      DataParallelOptions dp_options;
      dp_options.step = options.step;
      dp_options.device_ids = options.device_ids;
      dp_options.output_device = options.output_device;
      dp_options.time_phases = options.time_phases;
      dp_options.graphs = options.graphs;
      return std::make_unique<DataParallel>(runtime, model, optimizer, dp_options);
    }
    case EngineKind::ddp: {
      DdpOptions ddp_options;
      ddp_options.step = options.step;
      ddp_options.device_ids = options.device_ids;
      ddp_options.bucket_cap_mb = options.bucket_cap_mb;
      ddp_options.first_bucket_mb = options.first_bucket_mb;
      ddp_options.broadcast_buffers = options.broadcast_buffers;
      ddp_options.sync_batchnorm = options.sync_batchnorm;
      ddp_options.processes = options.processes;
      ddp_options.graphs = options.graphs;
      return std::make_unique<DistributedDataParallel>(runtime, model, optimizer, ddp_options);
    }
  }
  throw InvalidArgument("unknown engine kind");
}

namespace engines {

void check_batch(const Batch& batch) {
  if (batch.size < 1) throw InvalidArgument(fmt::format("batch size must be at least 1, got {}", batch.size));
  if (!batch.inputs) throw InvalidArgument("batch has no inputs (null pointer)");
}

void abandon_capture(const Stream& stream) noexcept {
  try {
    if (stream.capturing()) (void)stream.end_capture();
  } catch (...) {  // an invalidated or unjoined capture: the error that made us abandon it is reported
  }
}

Graph capture_on(const Stream& stream, const std::function<void()>& enqueue) {
  stream.begin_capture();
  try {
    enqueue();
  } catch (...) {
    abandon_capture(stream);
    throw;
  }
  return stream.end_capture();  // a capture that cannot end is ended by the failing call itself
}

namespace {
// Whether a failed step failed for a reason a graph cannot hold (CaptureError), maybe inside the
// WorkerError of the device where it happened.
bool capture_failed(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CaptureError&) {
    return true;
  } catch (const WorkerError& e) {
    return e.cause() && capture_failed(e.cause());
  } catch (...) {
    return false;
  }
}
// At least `bytes` of pinned memory in `buffer`; true when it had to be reallocated.
bool reserve_pinned(Device& device, PinnedBuffer& buffer, std::size_t bytes) {
  if (buffer.size() >= bytes) return false;
  buffer = device.allocate_pinned(bytes);
  return true;
}
}  // namespace

std::size_t sample_floats(const Model& model) { return numel(model.input_shape()); }

Replicas::Replicas(Model& module, const DeviceGroup& group) : module_(module) {
  const int source = group.device_ids()[0];
  if (module.device().index() != source)
    throw InvalidArgument(
        fmt::format("module must have its parameters and buffers on device_ids[0] (device {}) "
                    "but they are on device {}",
                    source, module.device().index()));
  owned_.resize(static_cast<std::size_t>(group.size()));
  for (int rank = 1; rank < group.size(); ++rank)
    owned_[static_cast<std::size_t>(rank)] = module.replicate(group.device(rank));
}

void StagedBatch::stage(Device& device, const Stream& stream, const Batch& batch, std::size_t floats_per_sample) {
  check_batch(batch);
  const auto samples = static_cast<std::size_t>(batch.size);
  stream.copy(inputs_.get<float>(device, samples * floats_per_sample), batch.inputs,
              samples * floats_per_sample * sizeof(float));
  if (batch.targets)
    stream.copy(targets_.get<std::int64_t>(device, samples), batch.targets, samples * sizeof(std::int64_t));
}

StepPipeline::~StepPipeline() {
  for (auto& state : pending_)
    if (state) state->resolve();  // a failure stays in the state, for get()
}

int StepPipeline::next_slot() {
  if (refused_) std::rethrow_exception(refused_);
  const int slot = static_cast<int>(submitted_ % kSlots);
  auto& state = pending_[static_cast<std::size_t>(slot)];
  if (state) {
    std::shared_ptr<StepLoss::State> previous = std::move(state);
    previous->resolve();
    if (previous->error && !previous->reported) std::rethrow_exception(previous->error);
  }
  return slot;
}

StepLoss StepPipeline::submitted(int slot, std::function<float()> wait, std::function<bool()> query) {
  auto state = std::make_shared<StepLoss::State>();
  state->wait = std::move(wait);
  state->query = std::move(query);
  pending_[static_cast<std::size_t>(slot)] = state;
  ++submitted_;
  return StepLoss(std::move(state));
}

StepLoss StepPipeline::submitted(int slot, const Event& ready, const float* loss) {
  return submitted(
      slot,
      [ready, loss] {
        ready.synchronize();
        return *loss;
      },
      [ready] { return ready.query(); });
}

StepLoss StepPipeline::enqueue(const std::function<StepLoss()>& enqueue) {
  try {
    return enqueue();
  } catch (...) {
    refused_ = std::current_exception();
    throw;
  }
}

StepLoss StepPipeline::known(int slot, float loss) {
  auto state = std::make_shared<StepLoss::State>();
  state->value = loss;
  pending_[static_cast<std::size_t>(slot)].reset();
  ++submitted_;
  return StepLoss(std::move(state));
}

void StepPipeline::drain() {
  // Oldest first: the first failure is the one reported.
  std::exception_ptr first;
  for (std::uint64_t i = 0; i < kSlots; ++i) {
    auto& state = pending_[static_cast<std::size_t>((submitted_ + i) % kSlots)];
    if (!state) continue;
    std::shared_ptr<StepLoss::State> done = std::move(state);
    done->resolve();
    if (done->error && !done->reported && !first) first = done->error;
  }
  if (first) std::rethrow_exception(first);
}

InputRing::~InputRing() {
  try {
    if (copy_.valid()) copy_.synchronize();  // no copy still reads a lease's memory
  } catch (...) {                            // a failed copy reads nothing; the step reported the failure
  }
}

void InputRing::release_copied() {
  for (Slot& s : slots_) {
    if (!s.lease) continue;
    bool done = true;
    try {
      done = s.copied.query();
    } catch (...) {  // failed: the copy will never read the memory
    }
    if (done) s.lease.reset();
  }
}

void InputRing::push(Device& device, int slot, const float* inputs, std::size_t input_floats,
                     const std::int64_t* targets, std::size_t target_count, const Event& slot_free,
                     std::shared_ptr<const void> lease) {
  if (!copy_.valid()) copy_ = device.create_stream();
  const std::size_t input_bytes = inputs ? input_floats * sizeof(float) : 0;
  const std::size_t target_bytes = targets ? target_count * sizeof(std::int64_t) : 0;
  release_copied();
  // Lent pinned memory is read in place: the host's copy of a 3.2 MB batch (MLP b1024) would take
  // about as long as the whole step is meant to take on an H100 (a 183 us step at 5.6M samples/s).
  const bool in_place = lease && (!input_bytes || device.is_pinned(inputs, input_bytes)) &&
                        (!target_bytes || device.is_pinned(targets, target_bytes));
  // A larger batch sizes every slot at once, so that the other slot's first step with it moves no
  // memory (it would make the graphs of this one stale). Its device buffers are reallocated
  // (freeing waits for the device to be idle); its pinned staging too (its previous copy out has
  // run: the pipeline waited for the losses of the steps in flight before this push).
  for (Slot& s : slots_) {
    if (!s.copied.valid()) s.copied = device.create_event();
    const bool stage = !in_place && (s.host_inputs.size() < input_bytes || s.host_targets.size() < target_bytes);
    // The other slot's pinned memory may still be copied out (its step in flight).
    if (stage) s.copied.synchronize();
    if (s.inputs.size() < input_bytes || s.targets.size() < target_bytes) ++growths_;
    if (input_bytes) (void)s.inputs.get<float>(device, input_floats);
    if (target_bytes) (void)s.targets.get<std::int64_t>(device, target_count);
    if (stage && reserve_pinned(device, s.host_inputs, input_bytes)) ++growths_;
    if (stage && reserve_pinned(device, s.host_targets, target_bytes)) ++growths_;
  }
  Slot& s = slots_[idx(slot)];
  // Done already when the slot's last step has its loss (StepPipeline::next_slot); not when that
  // step failed after its push, before the pipeline knew of it.
  if (!s.copied.query()) s.copied.synchronize();
  s.lease.reset();
  const void* from_inputs = inputs;
  const void* from_targets = targets;
  if (in_place) {
    s.lease = std::move(lease);  // before the copies are enqueued: kept until they have run
  } else {
    if (input_bytes) from_inputs = std::memcpy(s.host_inputs.data(), inputs, input_bytes);
    if (target_bytes) from_targets = std::memcpy(s.host_targets.data(), targets, target_bytes);
  }
  copy_.wait(slot_free);
  if (input_bytes) copy_.copy(s.inputs.data(), from_inputs, input_bytes);
  if (target_bytes) copy_.copy(s.targets.data(), from_targets, target_bytes);
  copy_.record(s.copied);
}

void InputRing::acquire(int slot, const Stream& stream) const { stream.wait(slots_[idx(slot)].copied); }

void push_batch(InputRing& ring, Device& device, int slot, const Batch& batch, std::size_t floats_per_sample,
                const Event& slot_free) {
  check_batch(batch);
  const auto samples = static_cast<std::size_t>(batch.size);
  ring.push(device, slot, batch.inputs, samples * floats_per_sample, batch.targets, batch.targets ? samples : 0,
            slot_free, batch.lease);
}

bool MemorySnapshot::operator==(const MemorySnapshot& other) const {
  if (staging_growths != other.staging_growths || stats.size() != other.stats.size()) return false;
  for (std::size_t i = 0; i < stats.size(); ++i)
    if (stats[i].in_use != other.stats[i].in_use || stats[i].allocations_made != other.stats[i].allocations_made)
      return false;
  return true;
}

MemorySnapshot snapshot(const std::vector<Device*>& devices, std::uint64_t staging_growths) {
  MemorySnapshot out;
  for (Device* device : devices) out.stats.push_back(device->memory());
  out.staging_growths = staging_growths;
  return out;
}

StepGraphs::Action StepGraphs::plan(const Key& key, int slot) const {
  if (!enabled_ || refused_.count(key)) return Action::eager;
  const auto it = graphs_.find(key);
  if (it != graphs_.end() && !it->second[static_cast<std::size_t>(slot)].empty()) return Action::replay;
  return warmed_.count(key) ? Action::capture : Action::eager;
}

bool StepGraphs::capture(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
                         const std::function<std::vector<Graph>()>& record) {
  std::vector<std::int64_t> steps;
  for (const Optimizer* optimizer : optimizers) steps.push_back(optimizer->steps());
  const auto restore_steps = [&] {
    for (std::size_t i = 0; i < optimizers.size(); ++i) optimizers[i]->set_steps(steps[i]);
  };
  try {
    graphs_[key][static_cast<std::size_t>(slot)] = record();
    restore_steps();
    return true;
  } catch (...) {
    restore_steps();
    if (!capture_failed(std::current_exception())) throw;
    refused_.insert(key);
    return false;
  }
}

void StepGraphs::drop_graphs() {
  graphs_.clear();
  warmed_.clear();
}

bool StepGraphs::run(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
                     const std::function<MemorySnapshot()>& memory, const StepWork& work) {
  if (enabled_ && last_ && !(*last_ == memory())) drop_graphs();
  Action action = plan(key, slot);
  if (action == Action::capture) action = capture(key, slot, optimizers, work.capture) ? Action::replay : Action::eager;
  if (action == Action::replay) {
    work.replay(graphs_.at(key)[static_cast<std::size_t>(slot)]);
    ++replays_;
  } else if (!enabled_) {
    work.eager();
  } else {
    const MemorySnapshot before = memory();
    work.eager();
    if (!(before == memory())) drop_graphs();  // its own allocations sized its key's buffers
    warmed_.insert(key);
  }
  if (enabled_) last_ = memory();
  return action == Action::replay;
}

void expect_batches(std::size_t got, int expected, const char* engine) {
  if (got != static_cast<std::size_t>(expected))
    throw InvalidArgument(fmt::format("{} step needs {} batch(es), got {}", engine, expected, got));
}

}  // namespace engines
}  // namespace dp
