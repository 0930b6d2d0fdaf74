// data_parallel.cpp — the DataParallel step as phases fanned out to the device workers. Every
// cross-device dependency is an event recorded in an earlier phase, so a wait never refers to a
// record that has not been issued, and a failing device cannot leave the others blocked.
#include "dp/engines/data_parallel.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstring>
#include <fmt/format.h>

#include "batches.h"
#include "device_update.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/process_group.h"
#include "dp/runtime/progress.h"
#include "input_ring.h"
#include "replicas.h"
#include "step_graphs.h"
#include "step_pipeline.h"

namespace dp {

std::vector<int> chunk_sizes(int batch, int devices) {
  if (batch < 1) throw InvalidArgument(fmt::format("batch size must be at least 1, got {}", batch));
  if (devices < 1) throw InvalidArgument("no devices to scatter over");
  const int chunk = (batch + devices - 1) / devices;
  std::vector<int> sizes;
  for (int start = 0; start < batch; start += chunk) sizes.push_back(std::min(chunk, batch - start));
  return sizes;
}

struct DataParallel::Replica {
  Model* model = nullptr;
  Stream stream;
  Event forward_done, backward_done;
  Event broadcast_done;                            // this replica has read the source's state
  Event step_start, scatter_done, backward_start;  // phase timing only
  engines::StagedBatch inputs;                     // evaluation's
  // the training steps' chunks, one slot per step in flight: a ring per micro-batch
  std::vector<std::unique_ptr<engines::InputRing>> rings;
  Scratch grad_output;
  DeviceBuffer grad_staging;  // on the SOURCE, for this replica's gradients
  Model::Output output;       // fp32, or a training forward's bf16 logits under autocast
};

DataParallel::DataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                           const EngineOptions& options)
    : module_(module),
      // [] is an error, as in PyTorch
      group_(runtime, check_applies(EngineKind::dp, options).device_ids.value_or(DeviceGroup::all_devices(runtime))),
      output_device_(options.output_device.value_or(group_.device_ids()[0])),
      output_rank_(-1),
      update_(std::make_unique<engines::DeviceUpdate>(module.device(), module.param_count(), optimizer,
                                                      options.step.clip_grad_norm)),
      optimizer_(&update_->optimizer()) {
  const auto& ids = group_.device_ids();
  const auto it = std::find(ids.begin(), ids.end(), output_device_);
  if (it == ids.end())
    throw InvalidArgument(
        fmt::format("output_device {} is not one of device_ids [{}]", output_device_, fmt::join(ids, ", ")));
  output_rank_ = static_cast<int>(it - ids.begin());
  loss_ = std::make_unique<CrossEntropyLoss>(group_.device(output_rank_), options.step.label_smoothing);
  seed_ = options.step.seed;
  accumulate_ = options.accumulate;
  models_ = std::make_unique<engines::Replicas>(module, group_);
  Device& source = group_.device(0);
  for (int rank = 0; rank < group_.size(); ++rank) {
    auto replica = std::make_unique<Replica>();
    Device& device = group_.device(rank);
    replica->model = &(*models_)[rank];
    if (rank != 0) replica->grad_staging = source.allocate(module_.param_count() * sizeof(float));
    replica->stream = device.create_stream();
    replica->forward_done = device.create_event(EventTiming::on);
    replica->backward_done = device.create_event(EventTiming::on);
    replica->step_start = device.create_event(EventTiming::on);
    replica->broadcast_done = device.create_event(EventTiming::on);
    replica->scatter_done = device.create_event(EventTiming::on);
    replica->backward_start = device.create_event(EventTiming::on);
    const Stream copies = device.create_stream();  // every micro-batch's copies, on one stream
    for (int m = 0; m < accumulate_; ++m) replica->rings.push_back(std::make_unique<engines::InputRing>(copies));
    replicas_.push_back(std::move(replica));
  }
  params_ready_ = source.create_event();
  grads_read_ = source.create_event();
  Device& out = group_.device(output_rank_);
  grad_output_ready_ = out.create_event();
  time_phases_ = options.time_phases;
  gather_start_ = out.create_event(EventTiming::on);
  host_loss_ =
      out.allocate_pinned(engines::StepPipeline::kSlots * static_cast<std::size_t>(accumulate_) * sizeof(float));
  for (Event& ready : loss_ready_) ready = out.create_event();
  gather_end_ = out.create_event(EventTiming::on);
  loss_end_ = out.create_event(EventTiming::on);
  reduce_start_ = source.create_event(EventTiming::on);
  reduce_end_ = source.create_event(EventTiming::on);
  update_end_ = source.create_event(EventTiming::on);
  for (Event& done : step_done_) done = source.create_event();
  graphs_ = std::make_unique<engines::StepGraphs>(options.graphs && module.capturable() && !time_phases_);
  const Stream target_copies = out.create_stream();
  for (int m = 0; m < accumulate_; ++m) targets_rings_.push_back(std::make_unique<engines::InputRing>(target_copies));
  pipeline_ = std::make_unique<engines::StepPipeline>();
  updates_done_ = source.allocate(3 * sizeof(float));
  kernels::fill(replicas_[0]->stream, updates_done_.as<float>(), 1, 0.0f);
  kernels::fill(replicas_[0]->stream, updates_done_.as<float>() + 1, 1, 1.0f);
  kernels::fill(replicas_[0]->stream, updates_done_.as<float>() + 2, 1, -1.0f);
  if (module.buffers_bytes() > 0) step_start_buffers_ = source.allocate(module.buffers_bytes());
  watch_workers();
}

std::optional<Engine::Survivor> DataParallel::survivor() {
  Device& source = group_.device(0);
  if (source.lost()) return std::nullopt;
  // Parameters and optimizer state change only in the source's update, which waits for every
  // replica's gradients: the failed step's update did not run, and the count says which did. The
  // buffers change in the source's forwards, which follow the step's copy of them on its stream:
  // copied since the last update ran, the copy is that update's step's buffers; else no forward
  // has run since.
  try {
    replicas_[0]->stream.synchronize();  // its failure is the step's, reported there
  } catch (...) {
  }
  float counts[3] = {};
  try {
    const Stream reader = source.create_stream();
    reader.copy(counts, updates_done_.as<float>(), sizeof(counts));
    if (module_.buffers_bytes() > 0 && counts[2] == counts[0]) {
      reader.copy(module_.buffers_flat(), step_start_buffers_.data(), module_.buffers_bytes());
      reader.synchronize();
    }
  } catch (...) {
    return std::nullopt;
  }
  const std::int64_t steps = counted_from_.value_or(optimizer_->steps()) + static_cast<std::int64_t>(counts[0]);
  optimizer_->set_steps(steps);
  return Survivor{&module_, optimizer_, steps, source_device()};
}

// DP_FAULT's kinds that act on a device thread (dN: the device of --device-ids' number N), its
// progress marks (the watch names a device that stops moving) and DP_TIMEOUT_S for a step that
// never ends. DataParallel issues no collectives and keeps one replica: the kinds that desync a
// collective or flip a replica's bits have nothing to act on here and are refused.
void DataParallel::watch_workers() {
  FaultPlan& faults = FaultPlan::from_environment();
  const std::vector<int>& ids = group_.device_ids();
  for (const Fault& f : faults.faults()) {
    if (f.kind == FaultKind::lose && f.phase == FaultPhase::optimizer && !f.process_target && f.target != ids[0])
      throw InvalidArgument(fmt::format(
          "DP_FAULT {}: DataParallel's optimizer runs on the source device ({}) alone; device {} has no optimizer "
          "phase to be lost in",
          f.text(), ids[0], f.target));
    const bool device_thread = f.kind == FaultKind::hang || f.kind == FaultKind::stall || f.kind == FaultKind::exit ||
                               f.kind == FaultKind::throw_error ||
                               (f.kind == FaultKind::lose && f.phase != FaultPhase::collective);
    if (!device_thread)
      throw InvalidArgument(fmt::format(
          "DP_FAULT {}: DataParallel issues no collectives and keeps one replica, so the fault has nothing to act "
          "on (it acts in ddp, or in any mode under --shards)",
          f.text()));
  }
  faults.check_targets(1, *std::max_element(ids.begin(), ids.end()) + 1);
  group_.set_timeout(ProcessGroup::single()->timeout());
  group_.run([&](int r) { progress::bind(r, 0, &group_.device(r), ids[static_cast<std::size_t>(r)]); });
  progress::start_watch();
}

std::uint64_t DataParallel::graph_replays() const { return graphs_->replays(); }

std::optional<float> DataParallel::last_grad_norm() {
  if (!update_->clips()) return std::nullopt;  // no norm to wait for: the log line does not wait
  synchronize();
  return update_->last_grad_norm();
}
std::uint64_t DataParallel::staging_growths() const {
  std::uint64_t growths = 0;
  for (const auto& ring : targets_rings_) growths += ring->growths();
  for (const auto& replica : replicas_)
    for (const auto& ring : replica->rings) growths += ring->growths();
  return growths;
}

namespace {
// A device thread that makes no host calls in a step (a replayed step's, a device with no chunk)
// meets it all the same where faults are planned, so that a fault aimed at it fires as in an eager step.
void meet_step_faults(std::int64_t step) {
  progress::begin_step(step);
  progress::fault_point(std::nullopt);
  progress::set_phase("idle");
}

void mark(bool on, const Stream& stream, const Event& event) {
  if (on) stream.record(event);
}
}  // namespace

DataParallelPhases DataParallel::last_phases() const {
  if (!time_phases_) throw InvalidArgument("DataParallel::last_phases needs DataParallelOptions::time_phases");
  DataParallelPhases p;
  update_end_.synchronize();
  loss_end_.synchronize();
  const int used = static_cast<int>(chunks_.size());
  for (int rank = 0; rank < used; ++rank) {
    const Replica& r = *replicas_[static_cast<std::size_t>(rank)];
    r.backward_done.synchronize();
    p.broadcast = std::max(p.broadcast, Event::elapsed_ms(r.step_start, r.broadcast_done));
    p.scatter = std::max(p.scatter, Event::elapsed_ms(r.broadcast_done, r.scatter_done));
    p.forward = std::max(p.forward, Event::elapsed_ms(r.scatter_done, r.forward_done));
    p.backward = std::max(p.backward, Event::elapsed_ms(r.backward_start, r.backward_done));
  }
  p.gather = Event::elapsed_ms(gather_start_, gather_end_);
  p.loss = Event::elapsed_ms(gather_end_, loss_end_);
  p.reduce = Event::elapsed_ms(reduce_start_, reduce_end_);
  p.update = Event::elapsed_ms(reduce_end_, update_end_);
  return p;
}

DataParallel::~DataParallel() {
  pipeline_.reset();  // the steps in flight keep their losses
  // Streams may still run work that uses our buffers: finish it before they are freed.
  for (auto& replica : replicas_) {
    try {
      replica->stream.synchronize();
    } catch (...) {
    }
  }
}

void DataParallel::plan_chunks(int batch) {
  chunks_ = chunk_sizes(batch, group_.size());
  batch_ = batch;
  offsets_.assign(chunks_.size(), 0);
  for (std::size_t i = 1; i < chunks_.size(); ++i) offsets_[i] = offsets_[i - 1] + chunks_[i - 1];
}

// Phase 2, every used replica: receive the broadcast of parameters and buffers.
void DataParallel::receive_broadcast(int rank) {
  Replica& r = *replicas_[static_cast<std::size_t>(rank)];
  mark(time_phases_, r.stream, r.step_start);
  if (rank != 0) {
    r.stream.wait(params_ready_);
    r.stream.copy(r.model->params_flat(), module_.params_flat(), module_.param_count() * sizeof(float));
    if (module_.buffers_bytes())
      r.stream.copy(r.model->buffers_flat(), module_.buffers_flat(), module_.buffers_bytes());
    // The dropout step too: a captured replica forward reads it where the replay's own upload
    // (onto the source, before the graph) cannot reach; an eager forward uploads it again itself.
    if (const std::uint32_t* step = module_.random_step_on_device())
      r.stream.copy(r.model->random_step_on_device(), step, sizeof *step);
  }
  r.stream.record(r.broadcast_done);
}

// Phase 3, every used device: take its chunk, forward. The source first waits until every
// replica has read its parameters and buffers: its own forward updates the BatchNorm buffers.
// Evaluation stages `inputs`' chunk; a training step (null `inputs`) reads the chunk in its
// pipeline slot, copied in before the source began the step.
void DataParallel::forward_chunk(int rank, Inputs inputs, Mode mode, int slot, int micro) {
  const int used = static_cast<int>(chunks_.size());
  const engines::SampleSize sample = engines::sample_size(module_);
  Replica& r = *replicas_[static_cast<std::size_t>(rank)];
  Device& device = group_.device(rank);
  if (rank == 0)
    for (int other = 1; other < used; ++other)
      r.stream.wait(replicas_[static_cast<std::size_t>(other)]->broadcast_done);
  const int rows = chunks_[static_cast<std::size_t>(rank)];
  Inputs chunk_inputs;
  if (inputs) {
    const Inputs chunk =
        inputs.advanced(static_cast<std::size_t>(offsets_[static_cast<std::size_t>(rank)]) * sample.inputs);
    r.inputs.stage(device, r.stream, Batch{chunk, nullptr, rows}, sample);
    chunk_inputs = r.inputs.inputs();
  } else {
    chunk_inputs = r.rings[static_cast<std::size_t>(micro)]->inputs(slot);
  }
  mark(time_phases_, r.stream, r.scatter_done);
  // One seed for all replicas, each chunk at its samples' place in the batch: the masks of
  // single-device training on the whole batch.
  r.model->set_random_context({seed_, static_cast<std::uint64_t>(optimizer_->steps()),
                               static_cast<std::uint64_t>(micro) * static_cast<std::uint64_t>(batch_) +
                                   static_cast<std::uint64_t>(offsets_[static_cast<std::size_t>(rank)])});
  // Training hands the loss the logits as the model made them (bf16 under autocast: half the
  // gather's and the gradient's bytes); an evaluation's are fp32 (predict returns floats).
  r.output = mode == Mode::train ? r.model->forward_for_loss(r.stream, chunk_inputs, rows)
                                 : Model::Output{r.model->forward(r.stream, chunk_inputs, rows, mode), false};
  r.stream.record(r.forward_done);
}

void DataParallel::broadcast_and_forward(Inputs inputs, int batch, Mode mode) {
  plan_chunks(batch);
  const int used = static_cast<int>(chunks_.size());
  // Phase 1, source: parameters and buffers are final (last optimizer step) from here on.
  group_.run_on(0, [&] { replicas_[0]->stream.record(params_ready_); });
  group_.run([&](int rank) { receive_broadcast(rank); }, used);
  group_.run([&](int rank) { forward_chunk(rank, inputs, mode, 0, 0); }, used);
}

// Every replica's model is the same, so its outputs' storage is the source's (which always holds a
// chunk): bf16 logits of a training forward under autocast, else fp32.
std::size_t DataParallel::output_element_size() const { return replicas_[0]->output.bf16 ? 2 : sizeof(float); }

void DataParallel::gather_outputs() {
  const int used = static_cast<int>(chunks_.size());
  const std::size_t logits = engines::sample_size(module_).logits;
  Device& out_device = group_.device(output_rank_);
  const std::size_t element = output_element_size();
  auto* gathered = gathered_.get<std::byte>(out_device, static_cast<std::size_t>(batch_) * logits * sizeof(float));
  Replica& out = *replicas_[static_cast<std::size_t>(output_rank_)];
  mark(time_phases_, out.stream, gather_start_);
  for (int rank = 0; rank < used; ++rank) {
    const Replica& r = *replicas_[static_cast<std::size_t>(rank)];
    if (rank != output_rank_) out.stream.wait(r.forward_done);
    out.stream.copy(gathered + static_cast<std::size_t>(offsets_[static_cast<std::size_t>(rank)]) * logits * element,
                    r.output.data,
                    static_cast<std::size_t>(chunks_[static_cast<std::size_t>(rank)]) * logits * element);
  }
  mark(time_phases_, out.stream, gather_end_);
}

StepLoss DataParallel::submit(Inputs inputs, const std::int64_t* targets, int batch) {
  const Batch one{inputs, targets, batch};
  return submit_batches(std::span<const Batch>(&one, 1));
}

StepLoss DataParallel::submit_batches(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), accumulate_, "DataParallel");
  for (const Batch& micro : batches) {
    if (!micro.inputs || !micro.targets) throw InvalidArgument("DataParallel step: null inputs or targets");
    engines::check_batch(micro, engines::sample_size(module_));  // before waiting for the step in flight
    if (micro.size != batches[0].size)
      throw InvalidArgument(fmt::format("the micro-batches of a DataParallel step must be the same size: {} and {}",
                                        batches[0].size, micro.size));
  }
  const int batch = batches[0].size;
  const int slot = pipeline_->next_slot();  // a failure of the step before: nothing of this one planned yet
  if (!counted_from_) counted_from_ = optimizer_->steps();  // a resumed run's state is loaded by now
  plan_chunks(batch);
  return pipeline_->enqueue([&] {
    const Event& done = step_done_[static_cast<std::size_t>(slot)];
    // Every chunk into its device's ring, the targets into the output device's: copied in on their
    // copy streams while the step in flight computes, no later than this step's source waits for them.
    const engines::SampleSize sample = engines::sample_size(module_);
    for (std::size_t m = 0; m < batches.size(); ++m) {
      const Batch& micro = batches[m];
      for (std::size_t rank = 0; rank < chunks_.size(); ++rank)
        engines::push_batch(*replicas_[rank]->rings[m], group_.device(static_cast<int>(rank)), slot,
                            Batch{micro.inputs.advanced(static_cast<std::size_t>(offsets_[rank]) * sample.inputs),
                                  nullptr, chunks_[rank], micro.lease},
                            sample, done);
      targets_rings_[m]->push(group_.device(output_rank_), slot, nullptr, 0, micro.targets,
                              static_cast<std::size_t>(batch) * sample.targets, done, micro.lease);
    }

    std::vector<Device*> devices;
    for (int rank = 0; rank < group_.size(); ++rank) devices.push_back(&group_.device(rank));
    const Stream& source = replicas_[0]->stream;
    engines::StepWork work;
    work.capture = [&] { return std::vector<Graph>{enqueue_step(batch, slot, true)}; };
    work.replay = [&](const std::vector<Graph>& graphs) {
      if (!FaultPlan::from_environment().empty()) group_.run([&](int) { meet_step_faults(optimizer_->steps() + 1); });
      wait_for_batches(slot);
      engines::upload_replayed_step(module_, *optimizer_, source);
      graphs[0].replay();  // every device's part: one launch, from this thread
      for (std::size_t rank = 0; rank < chunks_.size(); ++rank) replicas_[rank]->model->replayed_backward();
    };
    work.eager = [&] { enqueue_step(batch, slot, false); };
    const bool replayed = graphs_->run(
        {batch}, slot, {optimizer_}, [&] { return engines::snapshot(devices, staging_growths()); }, work);
    // A record captured into the graph is a dependency inside it: the loss is known when the graph,
    // launched on the source's stream, has run there (its end there is the end of every device's part).
    const Event loss_ready = replayed ? done : loss_ready_[static_cast<std::size_t>(slot)];
    // The source's last work is the step's: every device's part of it has run (the reduction waited
    // for each backward, the backwards for the loss). See Note [step slots].
    source.record(done);
    const float* losses = host_loss_.as<float>() + static_cast<std::size_t>(slot * accumulate_);
    return pipeline_->submitted(slot, loss_ready, losses, accumulate_);
  });
}

float DataParallel::train_step(Inputs inputs, const std::int64_t* targets, int batch) {
  return submit(inputs, targets, batch).get();
}

// The source's stream waits for the step's chunks and targets to be copied in: every device's work
// of the step comes after it (the broadcast's event), so one stream waits, before any capture.
void DataParallel::wait_for_batches(int slot) {
  const Stream& source = replicas_[0]->stream;
  for (std::size_t rank = 0; rank < chunks_.size(); ++rank)
    for (const auto& ring : replicas_[rank]->rings) ring->acquire(slot, source);
  for (const auto& ring : targets_rings_) ring->acquire(slot, source);
}

Graph DataParallel::enqueue_step(int batch, int slot, bool capture) {
  const int used = static_cast<int>(chunks_.size());
  Graph graph;

  // One submission per device and step: each device's worker runs its part of every phase, and a
  // barrier between phases keeps the host order of the phases — every event a phase waits for was
  // recorded in an earlier one (a wait issued before its record would not wait, as in CUDA). Once a
  // worker fails, every worker skips the phases left but still meets the barriers, so no work of
  // the step is enqueued behind the failure and every worker is done before the capture ends.
  // On one device this is the module's own step in one submission (torch's DataParallel calls the
  // module directly then): nothing to broadcast or reduce, and the same results bit for bit.
  // Captured, the source's stream begins the capture and every other stream joins it through the
  // events it waits for (the broadcast, the gathered outputs), and is joined back by the reduction;
  // the source's worker, which began it, ends it after the last barrier. See Note [capture thread].
  const int participants = std::max(used, output_rank_ + 1);  // the output device may hold no chunk
  std::barrier<> phase(participants);
  std::atomic<bool> failed{false};
  // A device with no chunk of this step (a batch smaller than the devices) takes no part in it, as in
  // torch, but meets its faults.
  const int meeting = FaultPlan::from_environment().empty() ? participants : group_.size();
  const std::int64_t step = optimizer_->steps() + 1;  // read before the source's update counts it
  group_.run(
      [&](int rank) {
        if (rank >= participants) return meet_step_faults(step);
        std::exception_ptr error;
        const auto run_phase = [&](const auto& work) {
          if (!failed.load()) {
            try {
              work();
            } catch (...) {
              error = std::current_exception();
              failed.store(true);
            }
          }
          progress::Waiting waiting("the step's next phase");  // for the watch: a wait, not a stall
          phase.arrive_and_wait();
        };
        // Phase 1, source: parameters and buffers are final (last optimizer step) from here on.
        run_phase([&] {
          progress::begin_step(optimizer_->steps() + 1);  // where DP_FAULT's step faults fire
          if (rank != 0) return;
          wait_for_batches(slot);  // before the capture: those events are recorded outside it
          if (capture) replicas_[0]->stream.begin_capture();
          keep_step_start_buffers();
          replicas_[0]->stream.record(params_ready_);
        });
        // Phases 2-6 once per micro-batch (accumulation: torch's loop of DataParallel forwards, each
        // replicating the module afresh, the gradients adding up on the source; one update at the end).
        for (int micro = 0; micro < accumulate_; ++micro)
          micro_batch_phases(rank, batch, slot, capture, micro, run_phase);
        if (rank == 0 && capture) {
          if (failed.load()) {
            engines::abandon_capture(replicas_[0]->stream);
          } else {
            try {
              graph = replicas_[0]->stream.end_capture();
            } catch (...) {
              error = std::current_exception();
            }
          }
        }
        progress::set_phase("idle");
        if (error) std::rethrow_exception(error);
      },
      meeting);
  return graph;
}

void DataParallel::micro_batch_phases(int rank, int batch, int slot, bool capture, int micro,
                                      const std::function<void(const std::function<void()>&)>& run_phase) {
  const int used = static_cast<int>(chunks_.size());
  const bool has_chunk = rank < used;
  // The source's state as a later micro-batch's forwards must see it (its BatchNorm buffers move).
  if (micro > 0)
    run_phase([&] {
      if (rank == 0) replicas_[0]->stream.record(params_ready_);
    });
  run_phase([&] {
    if (has_chunk) receive_broadcast(rank);  // phase 2
  });
  run_phase([&] {
    if (has_chunk) forward_chunk(rank, nullptr, Mode::train, slot, micro);  // phase 3
  });
  // Phase 4, output device: gather, loss over the whole batch, its gradient, the loss out.
  run_phase([&] {
    if (rank == output_rank_) enqueue_loss(batch, slot, capture, micro);
  });
  // Phase 5, every used device: its slice of the output gradient, backward.
  run_phase([&] {
    if (has_chunk) enqueue_backward(rank, micro);
  });
  // Phase 6, source: reduce-add the replicas' gradients, then (after the last) the optimizer step.
  run_phase([&] {
    if (rank == 0) enqueue_reduce_and_update(used, micro + 1 == accumulate_);
  });
}

// The source's buffers before this step's forwards move them, and the update count they go with
// (DataParallel::survivor).
void DataParallel::keep_step_start_buffers() {
  if (module_.buffers_bytes() == 0) return;
  const Stream& source = replicas_[0]->stream;
  source.copy(step_start_buffers_.data(), module_.buffers_flat(), module_.buffers_bytes());
  source.copy(updates_done_.as<float>() + 2, updates_done_.as<float>(), sizeof(float));
}

void DataParallel::enqueue_loss(int batch, int slot, bool capture, int micro) {
  const engines::SampleSize sample = engines::sample_size(module_);
  const int rows = batch * static_cast<int>(sample.targets);
  Replica& out = *replicas_[static_cast<std::size_t>(output_rank_)];
  Device& device = group_.device(output_rank_);
  // The previous micro-batch's output gradient is read by every replica's backward: this one's
  // overwrites it after those.
  if (micro > 0)
    for (std::size_t rank = 0; rank < chunks_.size(); ++rank)
      if (static_cast<int>(rank) != output_rank_) out.stream.wait(replicas_[rank]->backward_done);
  gather_outputs();
  float* grad_output = grad_output_.get<float>(device, static_cast<std::size_t>(batch) * sample.logits);
  // torch's accumulation loop: (loss / K).backward().
  const float* loss_value = loss_->forward_backward(
      out.stream, gathered_.data(), targets_rings_[static_cast<std::size_t>(micro)]->targets(slot), rows,
      sample.classes, grad_output, rows, 1.0f / static_cast<float>(accumulate_), replicas_[0]->output.bf16);
  // Pinned: asynchronous; the slot's own floats, so a later step never overwrites them.
  out.stream.copy(host_loss_.as<float>() + static_cast<std::size_t>(slot * accumulate_ + micro), loss_value,
                  sizeof(float));
  if (!capture) out.stream.record(loss_ready_[static_cast<std::size_t>(slot)]);
  mark(time_phases_, out.stream, loss_end_);
  out.stream.record(grad_output_ready_);
}

void DataParallel::enqueue_backward(int rank, int micro) {
  const std::size_t logits = engines::sample_size(module_).logits;
  Replica& r = *replicas_[static_cast<std::size_t>(rank)];
  const std::size_t samples = static_cast<std::size_t>(chunks_[static_cast<std::size_t>(rank)]);
  const std::size_t element = output_element_size();
  const std::byte* slice = static_cast<const std::byte*>(grad_output_.data()) +
                           static_cast<std::size_t>(offsets_[static_cast<std::size_t>(rank)]) * logits * element;
  const void* dy = slice;
  if (rank != output_rank_) {
    r.stream.wait(grad_output_ready_);
    auto* local = r.grad_output.get<std::byte>(group_.device(rank), samples * logits * element);
    r.stream.copy(local, slice, samples * logits * element);
    dy = local;
  }
  mark(time_phases_, r.stream, r.backward_start);
  // The source's gradients are the module's, which add up over the micro-batches; a replica's are
  // reduce-added onto them after each one, once the source has read the previous ones.
  if (rank != 0 && micro > 0) r.stream.wait(grads_read_);
  if (rank != 0 || micro == 0) r.model->zero_grad(r.stream);
  r.model->backward_from_loss(r.stream, dy, r.output.bf16);
  r.stream.record(r.backward_done);
}

// The replicas' gradients reduce-added onto the source (source first, then device_ids order, as
// torch.cuda.comm.reduce_add sums), then the optimizer step there.
void DataParallel::enqueue_reduce_and_update(int used, bool update) {
  Replica& source = *replicas_[0];
  const std::size_t n = module_.param_count();
  mark(time_phases_, source.stream, reduce_start_);
  for (int other = 1; other < used; ++other) {
    Replica& r = *replicas_[static_cast<std::size_t>(other)];
    source.stream.wait(r.backward_done);
    source.stream.copy(r.grad_staging.data(), r.model->grads_flat(), n * sizeof(float));
    kernels::axpy(source.stream, static_cast<kernels::index_t>(n), 1.0f, r.grad_staging.as<float>(),
                  module_.grads_flat());
  }
  source.stream.record(grads_read_);
  // An output device without a chunk ends with the loss: the source joins it there too.
  if (output_rank_ >= used) source.stream.wait(grad_output_ready_);
  if (!update) return;
  mark(time_phases_, source.stream, reduce_end_);
  // The source holds the reduced gradients: clip_grad_norm_ on the module, as torch's loop calls it.
  progress::set_phase("optimizer");
  update_->run(source.stream, module_);
  float* count = updates_done_.as<float>();
  kernels::add(source.stream, 1, count, count + 1, count);  // DataParallel::survivor
  mark(time_phases_, source.stream, update_end_);
}

void DataParallel::synchronize() {
  pipeline_->drain();
  group_.run([&](int rank) { replicas_[static_cast<std::size_t>(rank)]->stream.synchronize(); });
  // The lent batches' copies have run (the steps waited for them).
  for (const auto& replica : replicas_)
    for (const auto& ring : replica->rings) ring->release_copied();
  for (const auto& ring : targets_rings_) ring->release_copied();
}

std::vector<float> DataParallel::predict(Inputs inputs, int batch) {
  engines::check_batch(Batch{inputs, nullptr, batch}, engines::sample_size(module_));  // before any replica runs
  pipeline_->drain();  // a failed step is reported here, not by a forward behind it
  broadcast_and_forward(inputs, batch, Mode::eval);
  std::vector<float> out(static_cast<std::size_t>(batch) * engines::sample_size(module_).logits);
  group_.run_on(output_rank_, [&] {
    gather_outputs();
    replicas_[static_cast<std::size_t>(output_rank_)]->stream.copy(out.data(), gathered_.data(),
                                                                   out.size() * sizeof(float));
  });
  return out;
}

StepLoss DataParallel::submit_step(std::span<const Batch> batches) { return submit_batches(batches); }

std::vector<float> DataParallel::predict(std::span<const Batch> batches) {
  engines::expect_batches(batches.size(), 1, "DataParallel");
  if (!batches[0].inputs) throw InvalidArgument("DataParallel forward: null inputs");
  return predict(batches[0].inputs, batches[0].size);
}

}  // namespace dp
