// replica_engine.cpp — the replicas, ranks, pipeline, graphs and losses that DDP and fixed shards
// share; what a rank's forward and backward are is theirs.
#include "dp/engines/replica_engine.h"

#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <numeric>

#include "dp/engines/reducer.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/progress.h"
#include "rank_optimizers.h"
#include "replica_rank.h"
#include "replicas.h"
#include "step_graphs.h"
#include "step_pipeline.h"

namespace dp {

ReplicaEngine::ReplicaEngine(Runtime& runtime, Model& module, const EngineOptions& options, Step step)
    : group_(runtime, options.device_ids.value_or(DeviceGroup::all_devices(runtime))),
      options_(options),
      processes_(options_.processes ? options_.processes : ProcessGroup::single()) {
  if (step == Step::per_rank && options_.shards > 0)
    throw InvalidArgument(
        fmt::format("EngineOptions::shards ({}) is the fixed-shards engine's: make_engine builds it, for every kind",
                    options_.shards));
  replicas_ = std::make_unique<engines::Replicas>(module, group_);
  comm_ = Communicator::create(group_, processes_);
  // DP_FAULT's dN: device l of process p is p x (devices per process) + l, as --device-ids numbers
  // them (a process that lost devices keeps its numbering).
  const std::vector<int>& ids = group_.device_ids();
  const int devices_per_process = *std::max_element(ids.begin(), ids.end()) + 1;
  FaultPlan::from_environment().check_targets(processes_->size(), devices_per_process);
  // A second past the collectives' own timeout: a rank waiting in a call names the missing peer
  // first; this ends what no call waits for (a rank stuck while its peers replay a graph).
  group_.set_timeout(std::chrono::duration_cast<std::chrono::milliseconds>(processes_->timeout()) +
                     std::chrono::seconds(1));
  // Each worker's progress mark: the process's watch names a rank that stops moving, and a peer
  // process that gives no sign of life.
  for (const int id : ids) fault_devices_.push_back(processes_->rank() * devices_per_process + id);
  group_.run([&](int r) {
    progress::bind(comm_->first_rank() + r, processes_->rank(), &group_.device(r),
                   fault_devices_[static_cast<std::size_t>(r)]);
  });
  progress::start_watch();
  progress::watch_processes(processes_);
}

int ReplicaEngine::total(const std::vector<int>& counts) { return std::accumulate(counts.begin(), counts.end(), 0); }

std::size_t ReplicaEngine::first_of(const std::vector<int>& counts, int r) {
  return static_cast<std::size_t>(std::accumulate(counts.begin(), counts.begin() + r, 0));
}

std::vector<GradBucket> ReplicaEngine::start(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                             int batches_per_rank, int forwards_per_rank, bool ordered_batchnorm) {
  const auto ranks = static_cast<std::size_t>(group_.size());
  return start(runtime, module, optimizer, std::vector<int>(ranks, batches_per_rank),
               std::vector<int>(ranks, forwards_per_rank), ordered_batchnorm);
}

std::vector<GradBucket> ReplicaEngine::start(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                             std::vector<int> step_batches, std::vector<int> forward_batches,
                                             bool ordered_batchnorm) {
  step_batches_ = std::move(step_batches);
  forward_batches_ = std::move(forward_batches);
  batches_per_rank_ = *std::max_element(step_batches_.begin(), step_batches_.end());
  // SyncBatchNorm's collectives run on the compute streams, the gradient buckets' on the
  // communication streams: each kind gets its own communicator, so the two sequences never
  // interleave on one (NCCL requires one order of collectives per communicator).
  if (options_.sync_batchnorm) bn_comm_ = Communicator::create(group_, processes_);
  std::vector<GradBucket> buckets =
      assign_buckets(module.parameters(), options_.first_bucket_mb, options_.bucket_cap_mb, options_.frozen);
  updates_ = engines::make_rank_optimizers(group_, processes_, buckets, module.param_count(), optimizer, options_);
  for (int r = 0; r < group_.size(); ++r) ranks_.push_back(make_rank(r, runtime, ordered_batchnorm));
  for (int r = 0; r < group_.size(); ++r)
    if (GradientSlots* slots = updates_->gradient_slots(r); slots && !rank(r).model->place_gradients(slots))
      throw InvalidArgument(
          fmt::format("ZeRO-2 keeps no whole gradient buffer, but model '{}' cannot write its gradients elsewhere "
                      "(Model::place_gradients): use ZeRO-1",
                      module.name()));
  loss_join_ = group_.device(0).create_stream();
  for (Event& ready : losses_ready_) ready = group_.device(0).create_event();
  pipeline_ = std::make_unique<engines::StepPipeline>();
  // A desync or flip-gemm fault acts on a rank's host calls, which a replayed graph does not make.
  const FaultPlan& faults = FaultPlan::from_environment();
  const bool desync_faults = faults.has(FaultKind::desync_extra) || faults.has(FaultKind::desync_skip) ||
                             faults.has(FaultKind::desync_count) || faults.has(FaultKind::flip_gemm);
  graphs_ = std::make_unique<engines::StepGraphs>(options_.graphs && module.capturable() && processes_->size() == 1 &&
                                                  !desync_faults);
  broadcast_from_rank0(true, true);
  group_.run([&](int r) { enqueue_zero_grad(r); });  // on each rank's worker: its device is the current one there
  restart_update_counts(0);
  keep_updates();
  return buckets;
}

std::unique_ptr<ReplicaEngine::Rank> ReplicaEngine::make_rank(int r, Runtime& runtime, bool ordered_batchnorm) {
  auto rank = std::make_unique<Rank>();
  Device& device = group_.device(r);
  rank->model = &(*replicas_)[r];
  rank->optimizer = &updates_->optimizer(r);
  rank->loss = std::make_unique<CrossEntropyLoss>(device, options_.step.label_smoothing);
  rank->compute = device.create_stream();
  if (bn_comm_) {
    rank->bn_sync.comm = bn_comm_.get();
    rank->bn_sync.rank = r;
    rank->bn_sync.ordered = ordered_batchnorm;
    rank->model->set_batchnorm_sync(&rank->bn_sync);
  }
  const Stream copies = device.create_stream();  // the rank's batches' copies, on one stream
  for (int i = 0; i < step_batches_[static_cast<std::size_t>(r)]; ++i)
    rank->rings.push_back(std::make_unique<engines::InputRing>(copies));
  rank->host_loss = runtime.allocate_pinned(engines::StepPipeline::kSlots * batches_per_rank_ * sizeof(float));
  for (Event& ready : rank->loss_ready) ready = device.create_event();
  for (Event& done : rank->step_done) done = device.create_event();
  rank->updates_done = device.allocate(3 * sizeof(float));
  return rank;
}

ReplicaEngine::~ReplicaEngine() {
  quiesce();
  // The module (rank 0's model, the caller's) outlives the slots it writes into: its own buffer
  // back. The other replicas go with the engine.
  if (!ranks_.empty() && updates_->gradient_slots(0)) {
    try {
      rank(0).model->place_gradients(nullptr);
    } catch (...) {  // a destructor never throws; a device that failed keeps what it had
    }
  }
}

void ReplicaEngine::quiesce() noexcept {
  pipeline_.reset();  // the steps in flight keep their losses
  for (auto& r : ranks_) {
    try {
      r->compute.synchronize();
    } catch (...) {  // a destructor never throws; the failure was reported by the step
    }
  }
}

BucketReduction ReplicaEngine::bucket_reduction() const { return updates_->reduction(); }

BucketHome* ReplicaEngine::bucket_home() const { return updates_->bucket_home(); }

void ReplicaEngine::release_whole_optimizers() { updates_->release_whole(); }

std::uint64_t ReplicaEngine::graph_replays() const { return graphs_->replays(); }

std::optional<float> ReplicaEngine::last_grad_norm() {
  if (!updates_->clips()) return std::nullopt;  // no norm to wait for: the log line does not wait
  synchronize();
  return updates_->last_grad_norm();
}

ProcessGroup& ReplicaEngine::processes() const { return *processes_; }

Model& ReplicaEngine::replica(int rank) const { return *ranks_.at(static_cast<std::size_t>(rank))->model; }
Optimizer& ReplicaEngine::optimizer(int rank) const { return *ranks_.at(static_cast<std::size_t>(rank))->optimizer; }

std::vector<Optimizer*> ReplicaEngine::optimizers() {
  std::vector<Optimizer*> out;
  for (const auto& rank : ranks_) out.push_back(rank->optimizer);
  return out;
}

void ReplicaEngine::freeze(const std::vector<Optimizer::ParamRange>& frozen) { updates_->freeze(frozen); }

void ReplicaEngine::exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) {
  updates_->exclude_from_weight_decay(ranges);
}

std::vector<Optimizer*> ReplicaEngine::whole_optimizers() {
  synchronize();
  return updates_->whole();
}

void ReplicaEngine::whole_optimizers_loaded() {
  updates_->whole_loaded();
  restart_update_counts(rank(0).optimizer->steps());
  keep_updates();
}

void ReplicaEngine::run_ranks(const std::function<void(int rank)>& task) {
  try {
    group_.run([&](int r) {
      try {
        task(r);
      } catch (...) {
        // At once, not after the other ranks' tasks: they may be waiting on this rank's collectives.
        abort_communicators();
        throw;
      }
    });
  } catch (...) {
    abort_communicators();
    throw;
  }
}

void ReplicaEngine::abort_communicators() {
  comm_->abort();
  if (bn_comm_) bn_comm_->abort();
  updates_->abort();
}

void ReplicaEngine::broadcast_from_rank0(bool parameters, bool buffers) {
  if (comm_->size() == 1) return;  // rank 0 already holds what it would broadcast to itself
  run_ranks([&](int r) { enqueue_broadcast(r, parameters, buffers); });
}

void ReplicaEngine::enqueue_broadcast(int r, bool parameters, bool buffers) {
  Rank& mine = rank(r);
  Model& m = *mine.model;
  // On the compute stream: ordered after the forward that last touched the buffers.
  const CollectivePurpose purpose(parameters ? "parameters from rank 0" : "buffers from rank 0");
  if (parameters) comm_->broadcast(r, mine.compute, m.params_flat(), m.param_count() * sizeof(float), 0);
  if (buffers && m.buffers_bytes()) comm_->broadcast(r, mine.compute, m.buffers_flat(), m.buffers_bytes(), 0);
}

void ReplicaEngine::drain() {
  if (pipeline_) pipeline_->drain();
}

void ReplicaEngine::zero_grads() {
  drain();
  group_.run([&](int r) { enqueue_zero_grad(r); });
}

void ReplicaEngine::enqueue_zero_grad(int r) {
  Rank& mine = rank(r);
  mine.model->zero_grad(mine.compute);
  mine.accumulated_samples = 0;  // gradients thrown away: the next forward starts the step's samples
}

std::size_t ReplicaEngine::gradient_bytes() const {
  return (updates_->keeps_whole_gradients() ? Engine::gradient_bytes() : 0) + updates_->gradient_bytes_beside();
}

void ReplicaEngine::keep_updates() {
  if (updates_->keeps()) run_ranks([&](int r) { keep_update(r); });
}

void ReplicaEngine::keep_update(int r) {
  Rank& mine = rank(r);
  updates_->keep(r, mine.compute, *mine.model, mine.optimizer->steps());
}

void ReplicaEngine::enqueue_step(int r) {
  Rank& mine = rank(r);
  progress::set_phase("optimizer");
  mine.accumulated_samples = 0;
  updates_->step(r, mine.compute, *mine.model);
  float* count = mine.updates_done.as<float>();
  kernels::add(mine.compute, 1, count, count + 1, count);  // Note [a survivor's state], replica_health.cpp
}

void ReplicaEngine::check_each_batch(std::span<const Batch> batches, bool training) const {
  const DType dtype = rank(0).model->input_dtype();
  for (std::size_t r = 0; r < batches.size(); ++r) {
    if (batches[r].size < (training ? 1 : 0))
      throw InvalidArgument(fmt::format("batch size must be at least 1, got {} on rank {}", batches[r].size, r));
    if (batches[r].size == 0) continue;
    if (!batches[r].inputs || (training && !batches[r].targets))
      throw InvalidArgument(fmt::format("rank {}: null inputs or targets", r));
    engines::check_input_dtype(batches[r], dtype, fmt::format("rank {}: ", r));
  }
}

std::span<const Batch> ReplicaEngine::batches_of(int r, std::span<const Batch> batches) const {
  return batches.subspan(first_of(step_batches_, r),
                         static_cast<std::size_t>(step_batches_[static_cast<std::size_t>(r)]));
}

bool ReplicaEngine::begin_forward(std::span<const Batch> batches, bool& broadcast_buffers, int stride) {
  // torch 1.13: buffers are broadcast before a forward unless the previous forward ran inside
  // no_sync (require_forward_param_sync).
  const bool sync = sync_now();
  if (!sync && bucket_home())
    throw InvalidArgument(
        "no_sync accumulates gradients in the whole gradient buffer, which ZeRO-2 does not keep: use "
        "EngineOptions::accumulate (then ZeRO-2 keeps them whole) or ZeRO-1");
  broadcast_buffers = broadcasts_buffers() && require_forward_param_sync_ && comm_->size() > 1;
  require_forward_param_sync_ = sync;
  if (options_.sync_batchnorm) {
    // SyncBatchNorm normalises over all ranks' samples of this forward, in every process.
    std::int64_t local = 0;
    for (std::size_t b = 0; b < batches.size(); b += static_cast<std::size_t>(stride)) local += batches[b].size;
    // Every micro-batch of a step forwards with the count baked into its BatchNorm.
    for (std::size_t b = 0; b < batches.size(); ++b)
      if (batches[b].size != batches[b - b % static_cast<std::size_t>(stride)].size)
        throw InvalidArgument("sync_batchnorm with accumulation: every micro-batch of a rank must be the same size");
    std::int64_t samples = 0;
    for (const std::int64_t count : processes_->all_gather(local)) samples += count;
    for (auto& r : ranks_) r->bn_sync.global_samples = samples;
  }
  return sync;
}

void ReplicaEngine::join_losses(int slot) {
  if (ranks_.size() == 1) return;
  // One host wait for every rank: a stream of rank 0's device waits for the others' losses.
  for (auto& r : ranks_) loss_join_.wait(r->loss_ready[static_cast<std::size_t>(slot)]);
  loss_join_.record(losses_ready_[static_cast<std::size_t>(slot)]);
}

const Event& ReplicaEngine::losses_ready(int slot) const {
  return ranks_.size() == 1 ? ranks_[0]->loss_ready[static_cast<std::size_t>(slot)]
                            : losses_ready_[static_cast<std::size_t>(slot)];
}

float ReplicaEngine::wait_for_loss(int slot) {
  // On this thread, not the workers': a step is one submission per device. Only after every rank
  // has enqueued its work (run_ranks aborted the communicators had one failed: its peers'
  // collectives would never complete otherwise).
  try {
    // Behind every rank's loss: a failed kernel of any rank before its loss fails the step (a
    // later one surfaces at the next work enqueued on that rank's stream, as a sticky error).
    losses_ready(slot).synchronize();
  } catch (...) {
    abort_communicators();
    // Name the rank that failed: each rank's own loss event (done now: the collectives were
    // aborted), through the group, which reports a rank's own failure over the collectives aborted
    // because of it. The join meets the failed ranks in rank order and knows no device.
    group_.for_each_on_caller([&](int r) { rank(r).loss_ready[static_cast<std::size_t>(slot)].synchronize(); });
    throw;  // no rank's loss failed: the join's own failure
  }
  // The mean over every global rank's batches, summed in global rank order: each process (and one
  // process with all the ranks) gets the same bits.
  std::vector<float> local;
  for (int r = 0; r < group_.size(); ++r)
    for (int i = 0; i < step_batches_[static_cast<std::size_t>(r)]; ++i)
      local.push_back(*rank(r).loss_slot(slot, i, batches_per_rank_));
  float sum = 0.0f;
  const std::vector<float> all = processes_->all_gather(std::span<const float>(local));
  for (const float loss : all) sum += loss;
  return sum / static_cast<float>(all.size());
}

EvalTotals ReplicaEngine::reduce_totals(std::span<const EvalTotals> per_batch) {
  if (processes_->size() == 1) return Engine::reduce_totals(per_batch);
  const std::vector<EvalTotals> all = processes_->all_gather(per_batch);
  return Engine::reduce_totals(all);
}

// zero_grad + forward_backward + step as one submission per device: each rank enqueues its whole
// step (the optimizer behind the loss's copy), and the returned loss waits for the losses only.
StepLoss ReplicaEngine::submit_step(std::span<const Batch> batches) {
  check_batches(batches, true);
  release_whole_optimizers();  // a checkpoint's gathered state: written, or loaded, by now
  const int slot = pipeline_->next_slot();
  return pipeline_->enqueue([&] {
    const engines::SampleSize sample = engines::sample_size(*ranks_[0]->model);
    for (int r = 0; r < group_.size(); ++r) {
      Rank& mine = rank(r);
      const auto batches_of_r = batches_of(r, batches);
      for (std::size_t i = 0; i < batches_of_r.size(); ++i)
        engines::push_batch(*mine.rings[i], group_.device(r), slot, batches_of_r[i], sample,
                            mine.step_done[static_cast<std::size_t>(slot)]);
    }
    bool broadcast = false;
    const bool sync = begin_forward(batches, broadcast, batches_per_rank_);
    engines::StepGraphs::Key key;
    for (const Batch& batch : batches) key.push_back(batch.size);
    key.push_back(sync);
    key.push_back(broadcast);
    key.push_back(options_.sync_batchnorm ? ranks_[0]->bn_sync.global_samples : 0);  // baked into BatchNorm
    // Samples forwarded without a step (no_sync) before this one: baked into the dropout masks' offset.
    key.push_back(static_cast<std::int64_t>(ranks_[0]->accumulated_samples));
    std::vector<Device*> devices;
    std::vector<Optimizer*> optimizers;
    for (int r = 0; r < group_.size(); ++r) {
      devices.push_back(&group_.device(r));
      optimizers.push_back(rank(r).optimizer);
    }
    const auto memory = [&] {
      std::uint64_t growths = 0;
      for (auto& r : ranks_)
        for (auto& ring : r->rings) growths += ring->growths();
      return engines::snapshot(devices, growths);
    };
    engines::StepWork work;  // a verified step has no capture form: StepGraphs runs it eagerly, every time
    if (verifies_step(batches, slot))
      work.eager = [=, this] { run_eager_step(slot, batches, sync, broadcast, true); };
    else
      work = step_work(slot, batches, sync, broadcast);
    graphs_->run(key, slot, optimizers, memory, work);
    join_losses(slot);
    // Across processes the mean loss is a collective of the hosts, which every process must call for
    // the same step in the same order: at once, then. And checking the replicas reads the parameters.
    const std::int64_t step = rank(0).optimizer->steps();
    const bool check = options_.check_replicas > 0 && step % options_.check_replicas == 0;
    inject_update_faults();
    if (processes_->size() > 1 || check) {
      const float loss = wait_for_loss(slot);
      if (check) check_replica_fingerprints();
      return pipeline_->known(slot, loss);
    }
    const Event ready = losses_ready(slot);
    return pipeline_->submitted(
        slot, [this, slot] { return wait_for_loss(slot); }, [ready] { return ready.query(); });
  });
}

void ReplicaEngine::enqueue_train_step(int r, std::span<const Batch> batches, bool sync, bool broadcast, int slot) {
  enqueue_forward_backward_half(r, batches, sync, broadcast, slot);
  enqueue_update_half(r, slot);
}

void ReplicaEngine::enqueue_update_half(int r, int slot) {
  enqueue_reduction(r, slot);
  enqueue_step(r);
}

void ReplicaEngine::enqueue_forward_backward_half(int r, std::span<const Batch> batches, bool sync, bool broadcast,
                                                  int slot) {
  if (broadcast) enqueue_broadcast(r, false, true);
  if (Model& m = *rank(r).model; m.buffers_bytes() > 0) {
    // The buffers every rank begins the step with, and which step's they are (Note [a survivor's state]).
    Rank& mine = rank(r);
    mine.compute.copy(mine.step_start_buffers.get<char>(group_.device(r), m.buffers_bytes()), m.buffers_flat(),
                      m.buffers_bytes());
    float* count = mine.updates_done.as<float>();
    mine.compute.copy(count + 2, count, sizeof(float));
  }
  enqueue_zero_grad(r);
  enqueue_forward_backward_step(r, batches, sync, slot);
}

engines::StepWork ReplicaEngine::step_work(int slot, std::span<const Batch> batches, bool sync, bool broadcast) {
  engines::StepWork work;
  work.capture = [=, this] {
    std::vector<Graph> graphs(static_cast<std::size_t>(group_.size()));
    // Not run_ranks: a failed capture ran none of its collectives, so no peer waits in one and the
    // communicators stay usable. Each rank captures on its own worker, which also ends a failed capture.
    group_.run([&](int r) {
      graphs[static_cast<std::size_t>(r)] = engines::capture_on(
          rank(r).compute, [&] { enqueue_train_step(r, batches_of(r, batches), sync, broadcast, slot); });
    });
    return graphs;
  };
  work.replay = [=, this](const std::vector<Graph>& graphs) {
    run_ranks([&](int r) {
      Rank& mine = rank(r);
      progress::begin_step(mine.optimizer->steps() + 1);
      progress::fault_point(std::nullopt);  // a replayed step has no phases on the host
      for (auto& ring : mine.rings) ring->acquire(slot, mine.compute);
      engines::upload_replayed_step(*mine.model, *mine.optimizer, mine.compute);
      mine.accumulated_samples = 0;
      graphs[static_cast<std::size_t>(r)].replay();
      mine.model->replayed_backward();
      // Records captured into the graph are dependencies inside it: the loss is known, and the slot
      // free, once the graph has run.
      mine.compute.record(mine.loss_ready[static_cast<std::size_t>(slot)]);
      mine.compute.record(mine.step_done[static_cast<std::size_t>(slot)]);
      keep_update(r);
      progress::set_phase("idle");
    });
  };
  work.eager = [=, this] { run_eager_step(slot, batches, sync, broadcast, false); };
  return work;
}

void ReplicaEngine::run_eager_step(int slot, std::span<const Batch> batches, bool sync, bool broadcast, bool verified) {
  const auto finish = [&](int r) {
    Rank& mine = rank(r);
    enqueue_update_half(r, slot);
    comm_->end_of(r, "the step");
    mine.compute.record(mine.step_done[static_cast<std::size_t>(slot)]);
    keep_update(r);
    progress::set_phase("idle");
  };
  run_ranks([&](int r) {
    Rank& mine = rank(r);
    progress::begin_step(mine.optimizer->steps() + 1);
    for (auto& ring : mine.rings) ring->acquire(slot, mine.compute);
    enqueue_forward_backward_half(r, batches_of(r, batches), sync, broadcast, slot);
    if (verified)
      progress::set_phase("idle");
    else
      finish(r);
  });
  if (!verified) return;
  verify_step(slot);  // throws to end the step before any rank's update
  run_ranks(finish);
}

std::vector<float> ReplicaEngine::predict(std::span<const Batch> batches) {
  check_batches(batches, false);  // before any rank runs: a failing rank aborts the communicator
  pipeline_->drain();             // a failed step is reported here, not by a forward behind it
  // As torch's DDP forward: buffers (BatchNorm running statistics) come from rank 0 first.
  if (broadcasts_buffers() && require_forward_param_sync_) broadcast_from_rank0(false, true);
  const engines::SampleSize sample = engines::sample_size(*ranks_[0]->model);
  std::vector<std::size_t> offsets(batches.size() + 1, 0);
  for (std::size_t r = 0; r < batches.size(); ++r)
    offsets[r + 1] = offsets[r] + static_cast<std::size_t>(batches[r].size) * sample.logits;
  std::vector<float> out(offsets.back());
  run_ranks([&](int r) {
    Rank& mine = rank(r);
    for (int i = 0; i < forward_batches_[static_cast<std::size_t>(r)]; ++i) {
      const std::size_t b = first_of(forward_batches_, r) + static_cast<std::size_t>(i);
      const Batch& batch = batches[b];
      if (batch.size == 0) continue;
      mine.batch.stage(group_.device(r), mine.compute, Batch{batch.inputs, nullptr, batch.size}, sample);
      const float* logits = mine.model->forward(mine.compute, mine.batch.inputs(), batch.size, Mode::eval);
      // Pageable destination: the copy returns once written.
      mine.compute.copy(out.data() + offsets[b], logits,
                        static_cast<std::size_t>(batch.size) * sample.logits * sizeof(float));
    }
  });
  return out;
}

void ReplicaEngine::synchronize() {
  drain();
  group_.run([&](int r) {
    rank(r).compute.synchronize();
    synchronize_rank(r);
    for (auto& ring : rank(r).rings) ring->release_copied();  // the lent batches' copies have run
  });
}

}  // namespace dp
