// ddp.cpp — DistributedDataParallel: per-rank replicas and optimizers on persistent workers; the
// Reducer all-reduces gradient buckets on a communication stream, launched from the backward's
// gradients-ready callback.
#include "dp/engines/ddp.h"

#include <array>
#include <cstring>
#include <fmt/format.h>

#include "batches.h"
#include "dp/kernels/ops.h"
#include "dp/nn/clip.h"
#include "dp/runtime/error.h"
#include "input_ring.h"
#include "replicas.h"
#include "step_graphs.h"
#include "step_pipeline.h"

namespace dp {

struct DistributedDataParallel::Rank {
  Model* model = nullptr;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<GradNormClipper> clipper;  // StepOptions::clip_grad_norm
  std::unique_ptr<CrossEntropyLoss> loss;
  Stream compute;
  engines::StagedBatch batch;  // forward_backward's and evaluation's
  // train_step's batches, one slot per step in flight: one ring, or one per shard the rank runs.
  std::vector<std::unique_ptr<engines::InputRing>> rings;
  Scratch grad_output;
  Scratch shard_grads, all_grads, saved_buffers;  // shards: Note [fixed shards]
  std::size_t zero_begin = 0, zero_count = 0;     // ZeRO-1: this rank's slice of the flat parameters
  Scratch zero_send, zero_recv;
  std::uint64_t accumulated_samples = 0;         // forwarded since the last optimizer step
  BatchNormSync bn_sync;                         // sync_batchnorm: this rank's view of the BN collective
  PinnedBuffer host_loss;                        // a float per pipeline slot; pinned: the copy is asynchronous
  std::array<Event, kStepsInFlight> loss_ready;  // per slot: host_loss written
  std::array<Event, kStepsInFlight> step_done;   // per slot: the rank's step has run
};

DistributedDataParallel::DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                                 const EngineOptions& options)
    : DistributedDataParallel(runtime, module, optimizer, options, EngineKind::ddp) {}

DistributedDataParallel::DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                                 const EngineOptions& options, EngineKind as)
    : group_(runtime, options.device_ids.value_or(DeviceGroup::all_devices(runtime))),
      options_(check_applies(as, options)),
      processes_(options_.processes ? options_.processes : ProcessGroup::single()) {
  if (as != EngineKind::ddp && options_.shards == 0)
    throw InvalidArgument(
        fmt::format("DistributedDataParallel runs a {} engine's step with shards only", to_string(as)));
  options_.kind = as;
  replicas_ = std::make_unique<engines::Replicas>(module, group_);
  comm_ = Communicator::create(group_, processes_);
  if (options_.shards > 0) {
    if (options_.shards % comm_->size() != 0)
      throw InvalidArgument(
          fmt::format("{} shards cannot be spread evenly over {} device(s): the device count must "
                      "divide the shards",
                      options_.shards, comm_->size()));
    // K micro-batches of V shards are one step of K x V shards.
    options_.shards *= options_.accumulate;
    options_.accumulate = 1;
    batches_per_rank_ = options_.shards / comm_->size();
    // SyncBatchNorm needs every shard's forward at each BatchNorm at once: a replica per shard.
    if (options_.sync_batchnorm && batches_per_rank_ != 1)
      throw InvalidArgument(
          fmt::format("sync_batchnorm with {} shards needs a device per shard, not {}: {} dp devices (on fewer GPUs, "
                      "several on each: RuntimeOptions::devices_per_gpu)",
                      options_.shards, comm_->size(), options_.shards));
  } else {
    batches_per_rank_ = options_.accumulate;
  }
  // SyncBatchNorm's collectives run on the compute streams, the gradient buckets' on the
  // communication streams: each kind gets its own communicator, so the two sequences never
  // interleave on one (NCCL requires one order of collectives per communicator).
  if (options_.sync_batchnorm) bn_comm_ = Communicator::create(group_, processes_);
  optimizer_options_ = optimizer;
  const std::size_t n = module.param_count();
  if (options_.zero) {
    // Its own communicator: the all-gathers run on the compute streams, the buckets on the
    // communication streams (one order of collectives per communicator).
    param_comm_ = Communicator::create(group_, processes_);
    zero_chunk_ = (n + static_cast<std::size_t>(comm_->size()) - 1) / static_cast<std::size_t>(comm_->size());
    trainable_ = {{0, n}};
  }
  reducer_ = std::make_unique<Reducer>(
      *comm_, group_,
      assign_buckets(module.parameters(), options_.first_bucket_mb, options_.bucket_cap_mb, options_.frozen),
      options_.grad_reduce);
  for (int r = 0; r < group_.size(); ++r) ranks_.push_back(make_rank(r, runtime, optimizer, n));
  loss_join_ = group_.device(0).create_stream();
  for (Event& ready : losses_ready_) ready = group_.device(0).create_event();
  pipeline_ = std::make_unique<engines::StepPipeline>();
  graphs_ = std::make_unique<engines::StepGraphs>(options_.graphs && module.capturable() && processes_->size() == 1);
  broadcast_from_rank0(true, true);
  zero_grad();  // on each rank's worker: its device is the current one there
}

std::unique_ptr<DistributedDataParallel::Rank> DistributedDataParallel::make_rank(int r, Runtime& runtime,
                                                                                  const OptimizerOptions& optimizer,
                                                                                  std::size_t params) {
  auto rank = std::make_unique<Rank>();
  Device& device = group_.device(r);
  rank->model = &(*replicas_)[r];
  if (options_.zero) {
    const auto g = static_cast<std::size_t>(comm_->first_rank() + r);
    rank->zero_begin = std::min(params, g * zero_chunk_);
    rank->zero_count = std::min(zero_chunk_, params - rank->zero_begin);
    if (rank->zero_count == 0)
      throw InvalidArgument(fmt::format("ZeRO-1: the model's {} parameters leave global rank {} of {} no slice", params,
                                        g, comm_->size()));
  }
  rank->optimizer = make_optimizer(device, options_.zero ? rank->zero_count : params, optimizer);
  rank->loss = std::make_unique<CrossEntropyLoss>(device, options_.step.label_smoothing);
  if (options_.step.clip_grad_norm > 0.0)
    rank->clipper = std::make_unique<GradNormClipper>(device, options_.step.clip_grad_norm);
  rank->compute = device.create_stream();
  if (bn_comm_) {
    rank->bn_sync.comm = bn_comm_.get();
    rank->bn_sync.rank = r;
    rank->bn_sync.ordered = options_.shards > 0;
    rank->model->set_batchnorm_sync(&rank->bn_sync);
  }
  for (int i = 0; i < batches_per_rank_; ++i) rank->rings.push_back(std::make_unique<engines::InputRing>());
  rank->host_loss = runtime.allocate_pinned(engines::StepPipeline::kSlots * batches_per_rank_ * sizeof(float));
  for (Event& ready : rank->loss_ready) ready = device.create_event();
  for (Event& done : rank->step_done) done = device.create_event();
  return rank;
}

std::uint64_t DistributedDataParallel::graph_replays() const { return graphs_->replays(); }

std::optional<float> DistributedDataParallel::last_grad_norm() {
  if (!ranks_[0]->clipper) return std::nullopt;
  synchronize();
  return ranks_[0]->clipper->last_norm();
}

DistributedDataParallel::~DistributedDataParallel() {
  pipeline_.reset();  // the steps in flight keep their losses
  for (auto& rank : ranks_) {
    try {
      rank->compute.synchronize();
    } catch (...) {  // a destructor never throws; the failure was reported by the step
    }
  }
}

ProcessGroup& DistributedDataParallel::processes() const { return *processes_; }

Model& DistributedDataParallel::replica(int rank) const { return *ranks_.at(static_cast<std::size_t>(rank))->model; }
Optimizer& DistributedDataParallel::optimizer(int rank) const {
  return *ranks_.at(static_cast<std::size_t>(rank))->optimizer;
}

std::vector<Optimizer*> DistributedDataParallel::optimizers() {
  std::vector<Optimizer*> out;
  for (const auto& rank : ranks_) out.push_back(rank->optimizer.get());
  return out;
}

void DistributedDataParallel::run_ranks(const std::function<void(int rank)>& task) {
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

void DistributedDataParallel::abort_communicators() {
  comm_->abort();
  if (bn_comm_) bn_comm_->abort();
}

void DistributedDataParallel::broadcast_from_rank0(bool parameters, bool buffers) {
  if (comm_->size() == 1) return;  // rank 0 already holds what it would broadcast to itself
  run_ranks([&](int r) { enqueue_broadcast(r, parameters, buffers); });
}

void DistributedDataParallel::enqueue_broadcast(int r, bool parameters, bool buffers) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  Model& m = *rank.model;
  // On the compute stream: ordered after the forward that last touched the buffers.
  if (parameters) comm_->broadcast(r, rank.compute, m.params_flat(), m.param_count() * sizeof(float), 0);
  if (buffers && m.buffers_bytes()) comm_->broadcast(r, rank.compute, m.buffers_flat(), m.buffers_bytes(), 0);
}

void DistributedDataParallel::zero_grad() {
  if (pipeline_) pipeline_->drain();  // (the constructor zeroes before the pipeline exists)
  group_.run([&](int r) { enqueue_zero_grad(r); });
}

void DistributedDataParallel::enqueue_zero_grad(int r) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  rank.model->zero_grad(rank.compute);
  rank.accumulated_samples = 0;  // gradients thrown away: the next forward starts the step's samples
}

void DistributedDataParallel::enqueue_step(int r) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  Model& m = *rank.model;
  float* params = m.params_flat();
  float* grads = m.grads_flat();
  // Every rank's gradients are the same after the reduction: so are their norms and clipping.
  if (rank.clipper)
    rank.clipper->clip(rank.compute, m, options_.zero ? trainable_ : rank.optimizer->trainable(), grads);
  rank.accumulated_samples = 0;
  if (!options_.zero) {
    rank.optimizer->step(rank.compute, params, grads);
    return;
  }
  // ZeRO-1: this rank's slice updated, then every rank's slices gathered into every replica.
  rank.optimizer->step(rank.compute, params + rank.zero_begin, grads + rank.zero_begin);
  rank.compute.copy(params, gather_slices(r, params + rank.zero_begin), m.param_count() * sizeof(float));
}

const float* DistributedDataParallel::gather_slices(int r, const float* slice) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  Device& device = group_.device(r);
  const std::size_t chunk = zero_chunk_;
  // Every rank sends zero_chunk_ floats (all_gather's equal counts): the last, shorter slice padded.
  float* send = rank.zero_send.get<float>(device, chunk);
  rank.compute.copy(send, slice, rank.zero_count * sizeof(float));
  if (rank.zero_count < chunk)
    kernels::fill(rank.compute, send + rank.zero_count, static_cast<kernels::index_t>(chunk - rank.zero_count), 0.0f);
  float* recv = rank.zero_recv.get<float>(device, chunk * static_cast<std::size_t>(comm_->size()));
  param_comm_->all_gather(r, rank.compute, send, recv, chunk);
  return recv;
}

void DistributedDataParallel::freeze(const std::vector<Optimizer::ParamRange>& frozen) {
  if (!options_.zero) {
    Engine::freeze(frozen);
    return;
  }
  trainable_ = trainable_ranges(ranks_[0]->model->param_count(), frozen);
  frozen_ = frozen;
  for (auto& rank : ranks_) rank->optimizer->freeze(in_slice(*rank, frozen));
}

void DistributedDataParallel::exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) {
  if (!options_.zero) {
    Engine::exclude_from_weight_decay(ranges);
    return;
  }
  (void)trainable_ranges(ranks_[0]->model->param_count(), ranges);  // the bounds check, before any rank
  no_decay_ = ranges;
  for (auto& rank : ranks_) rank->optimizer->exclude_from_weight_decay(in_slice(*rank, ranges));
}

// ZeRO-1: each of the whole buffer's `ranges`' part inside the rank's slice, in the slice's offsets.
std::vector<Optimizer::ParamRange> DistributedDataParallel::in_slice(const Rank& rank,
                                                                     const std::vector<Optimizer::ParamRange>& ranges) {
  std::vector<Optimizer::ParamRange> mine;
  for (const Optimizer::ParamRange& f : ranges) {
    const std::size_t lo = std::max(f.offset, rank.zero_begin);
    const std::size_t hi = std::min(f.offset + f.count, rank.zero_begin + rank.zero_count);
    if (lo < hi) mine.push_back({lo - rank.zero_begin, hi - lo});
  }
  return mine;
}

std::vector<Optimizer*> DistributedDataParallel::whole_optimizers() {
  if (!options_.zero) return optimizers();
  synchronize();
  const std::size_t n = ranks_[0]->model->param_count();
  whole_ = make_optimizer(group_.device(0), n, optimizer_options_);
  whole_->freeze(frozen_);
  whole_->exclude_from_weight_decay(no_decay_);
  const std::size_t buffers = ranks_[0]->optimizer->state().size();
  for (std::size_t k = 0; k < buffers; ++k) {
    float* whole = whole_->state()[k].data;
    run_ranks([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      const float* all = gather_slices(r, rank.optimizer->state()[k].data);
      if (r == 0) rank.compute.copy(whole, all, n * sizeof(float));
      rank.compute.synchronize();
    });
  }
  whole_->set_steps(ranks_[0]->optimizer->steps());
  return {whole_.get()};
}

void DistributedDataParallel::whole_optimizers_loaded() {
  if (!options_.zero || !whole_) return;
  const std::size_t buffers = whole_->state().size();
  group_.run([&](int r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    for (std::size_t k = 0; k < buffers; ++k)
      rank.compute.copy(rank.optimizer->state()[k].data, whole_->state()[k].data + rank.zero_begin,
                        rank.zero_count * sizeof(float));
    rank.compute.synchronize();
    rank.optimizer->set_steps(whole_->steps());
  });
  whole_.reset();
}

std::span<const Batch> DistributedDataParallel::batches_of(int r, std::span<const Batch> batches) const {
  return batches.subspan(static_cast<std::size_t>(r * batches_per_rank_), static_cast<std::size_t>(batches_per_rank_));
}

void DistributedDataParallel::check_batches(std::span<const Batch> batches, bool training) const {
  const int expected = training ? batches_per_step() : batches_per_forward();
  if (options_.shards > 0 && static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(
        fmt::format("a step with {} shards on {} device(s) here takes {} batches, one per shard: got {}",
                    options_.shards, group_.size(), expected, batches.size()));
  if (training && options_.accumulate > 1 && static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(fmt::format("a DDP step of {} micro-batches takes {} per rank, {} in all: got {}",
                                      options_.accumulate, options_.accumulate, expected, batches.size()));
  if (static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(
        fmt::format("DDP step needs one batch per rank: got {} for {} ranks", batches.size(), group_.size()));
  // Every shard of a step the same size: the shards, and so the result, are those of every device count.
  if (options_.shards > 0 && training)
    for (std::size_t b = 1; b < batches.size(); ++b)
      if (batches[b].size != batches[0].size)
        throw InvalidArgument(
            fmt::format("the shards of a step must be the same size: shard {} has {} samples, shard "
                        "{} has {}",
                        first_rank(), batches[0].size, first_rank() + static_cast<int>(b), batches[b].size));
  for (std::size_t r = 0; r < batches.size(); ++r) {
    // A forward may find one rank's evaluation shard exhausted; a training step needs every rank.
    if (batches[r].size < (training ? 1 : 0))
      throw InvalidArgument(fmt::format("batch size must be at least 1, got {} on rank {}", batches[r].size, r));
    if (batches[r].size == 0) continue;
    if (!batches[r].inputs || (training && !batches[r].targets))
      throw InvalidArgument(fmt::format("rank {}: null inputs or targets", r));
  }
}

bool DistributedDataParallel::begin_forward(std::span<const Batch> batches, bool& broadcast_buffers, int stride) {
  // torch 1.13: buffers are broadcast before a forward unless the previous forward ran inside
  // no_sync (require_forward_param_sync).
  // With shards, rank 0 holds shard 0's statistics, which every replica starts the step from.
  broadcast_buffers =
      (options_.broadcast_buffers || options_.shards > 0) && require_forward_param_sync_ && comm_->size() > 1;
  const bool sync = sync_;
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
    for (auto& rank : ranks_) rank->bn_sync.global_samples = samples;
  }
  return sync;
}

void DistributedDataParallel::enqueue_forward_backward(int r, const Batch& batch, float loss_scale, bool sync, int slot,
                                                       bool ring, int index) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  Model& m = *rank.model;
  Device& device = group_.device(r);
  const engines::SampleSize sample = engines::sample_size(m);
  const int rows = batch.size * static_cast<int>(sample.targets);
  if (!ring) rank.batch.stage(device, rank.compute, batch, sample);
  const auto i = static_cast<std::size_t>(index);
  const float* inputs = ring ? rank.rings[i]->inputs(slot) : rank.batch.inputs();
  const std::int64_t* targets = ring ? rank.rings[i]->targets(slot) : rank.batch.targets();
  float* grad_output = rank.grad_output.get<float>(device, static_cast<std::size_t>(batch.size) * sample.logits);
  // seed + global rank, as each torch process seeds itself; forwards accumulated without a step
  // (no_sync) continue the step's samples, as one larger batch would.
  m.set_random_context({options_.step.seed + static_cast<std::uint64_t>(comm_->first_rank() + r),
                        static_cast<std::uint64_t>(rank.optimizer->steps()), rank.accumulated_samples});
  rank.accumulated_samples += static_cast<std::uint64_t>(batch.size);
  const float* logits = m.forward(rank.compute, inputs, batch.size, Mode::train);
  const float* loss =
      rank.loss->forward_backward(rank.compute, logits, targets, rows, sample.classes, grad_output, rows, loss_scale);
  GradientsReady on_ready;
  if (sync) {
    // Not grads_flat(): that would fill in a pending zero_grad the backward is about to overwrite.
    reducer_->prepare(r, rank.compute, m.grads_address());
    on_ready = [&](std::size_t offset, std::size_t count) { reducer_->mark_ready(r, offset, count); };
  }
  m.backward(rank.compute, grad_output, on_ready);
  if (sync) reducer_->finish(r);
  rank.compute.copy(rank.host_loss.as<float>() + static_cast<std::size_t>(slot * batches_per_rank_ + index), loss,
                    sizeof(float));
  // Captured, a record is a dependency inside the graph: the replay records it after the graph.
  if (!rank.compute.capturing()) rank.compute.record(rank.loss_ready[static_cast<std::size_t>(slot)]);
}

// Note [fixed shards]
// With EngineOptions::shards = V, a step is the step of DataParallel over V devices, whatever P
// devices (and processes) run it: shard s is its own forward and backward (BatchNorm statistics of
// its own samples, Dropout keyed by the shard's first sample in the step's batch, not by a rank),
// every shard's loss a mean over the global batch (so its gradient is its share of the global
// mean's), and the gradient the optimizer sees is
//     g = (...((g_0 + g_1) + g_2) + ... ) + g_{V-1}     in fp32, in shard order,
// a function of the V shard gradients alone. Each rank keeps its V/P shards' gradients, an
// all-gather gives every rank all V in shard order (global rank k holds shards [kV/P, (k+1)V/P)),
// and each rank adds them in that fixed order: no collective's algorithm or rank count can change
// a bit, on any backend. Cost per step and rank: V/P + V gradient copies of memory, an all-gather
// of V gradients (each rank receives (V - V/P) x 4 bytes per parameter, against 2(P-1)/P x 4 for a
// ring all-reduce: the same at V = P = 2) and V - 1 passes of additions. The sum is the fp32 sum
// of a sequential loop, as accurate as the ring's. The logged loss is the shards' losses, added in
// shard order. Running statistics are shard 0's, as DataParallel keeps the source replica's: rank 0
// saves them after shard 0's forward and puts them back after its other shards'; every replica
// starts the next step from them (buffers broadcast from rank 0). SyncBatchNorm needs every shard's
// forward at each BatchNorm at once: there each rank holds one shard (a replica per shard, on fewer
// GPUs as virtual devices), and BatchNorm's sums over the ranks are order-free as the gradient's
// (BatchNormSync::ordered); the running statistics are then the combined ones, on every replica.
void DistributedDataParallel::enqueue_sharded_forward_backward(int r, std::span<const Batch> shards, int slot) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  Model& m = *rank.model;
  Device& device = group_.device(r);
  const engines::SampleSize sample = engines::sample_size(m);
  const std::size_t n = m.param_count();
  const auto count = static_cast<std::size_t>(batches_per_rank_);
  const int shard_size = shards[0].size;
  const int global_batch = shard_size * options_.shards;
  const int first_shard = (comm_->first_rank() + r) * batches_per_rank_;
  float* grad_output = rank.grad_output.get<float>(device, static_cast<std::size_t>(shard_size) * sample.logits);
  const int rows = shard_size * static_cast<int>(sample.targets);
  float* mine = rank.shard_grads.get<float>(device, count * n);
  float* all = rank.all_grads.get<float>(device, static_cast<std::size_t>(options_.shards) * n);
  const bool keep_shard0_buffers = first_shard == 0 && count > 1 && m.buffers_bytes() > 0;
  void* saved = keep_shard0_buffers ? rank.saved_buffers.get<char>(device, m.buffers_bytes()) : nullptr;
  for (std::size_t i = 0; i < count; ++i) {
    const int shard = first_shard + static_cast<int>(i);
    if (i > 0) m.zero_grad(rank.compute);
    m.set_random_context({options_.step.seed, static_cast<std::uint64_t>(rank.optimizer->steps()),
                          static_cast<std::uint64_t>(shard) * static_cast<std::uint64_t>(shard_size)});
    const float* logits = m.forward(rank.compute, rank.rings[i]->inputs(slot), shard_size, Mode::train);
    if (saved && i == 0) rank.compute.copy(saved, m.buffers_flat(), m.buffers_bytes());
    const float* loss =
        rank.loss->forward_backward(rank.compute, logits, rank.rings[i]->targets(slot), rows, sample.classes,
                                    grad_output, global_batch * static_cast<int>(sample.targets), 1.0f);
    rank.compute.copy(rank.host_loss.as<float>() + static_cast<std::size_t>(slot) * count + i, loss, sizeof(float));
    m.backward(rank.compute, grad_output, {});
    rank.compute.copy(mine + i * n, m.grads_flat(), n * sizeof(float));
  }
  if (saved) rank.compute.copy(m.buffers_flat(), saved, m.buffers_bytes());
  comm_->all_gather(r, rank.compute, mine, all, count * n);
  float* grads = m.grads_flat();
  const auto elements = static_cast<kernels::index_t>(n);
  if (options_.shards == 1)
    rank.compute.copy(grads, all, n * sizeof(float));
  else
    kernels::add(rank.compute, elements, all, all + n, grads);
  for (int s = 2; s < options_.shards; ++s)
    kernels::add(rank.compute, elements, grads, all + static_cast<std::size_t>(s) * n, grads);
  if (!rank.compute.capturing()) rank.compute.record(rank.loss_ready[static_cast<std::size_t>(slot)]);
}

void DistributedDataParallel::join_losses(int slot) {
  if (ranks_.size() == 1) return;
  // One host wait for every rank: a stream of rank 0's device waits for the others' losses.
  for (auto& rank : ranks_) loss_join_.wait(rank->loss_ready[static_cast<std::size_t>(slot)]);
  loss_join_.record(losses_ready_[static_cast<std::size_t>(slot)]);
}

const Event& DistributedDataParallel::losses_ready(int slot) const {
  return ranks_.size() == 1 ? ranks_[0]->loss_ready[static_cast<std::size_t>(slot)]
                            : losses_ready_[static_cast<std::size_t>(slot)];
}

float DistributedDataParallel::wait_for_loss(int slot) {
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
    group_.for_each_on_caller(
        [&](int r) { ranks_[static_cast<std::size_t>(r)]->loss_ready[static_cast<std::size_t>(slot)].synchronize(); });
    throw;  // no rank's loss failed: the join's own failure
  }
  // The mean over every global rank, summed in global rank order: each process (and one process
  // with all the ranks) gets the same bits.
  std::vector<float> local;
  for (auto& rank : ranks_)
    for (int i = 0; i < batches_per_rank_; ++i)
      local.push_back(rank->host_loss.as<float>()[slot * batches_per_rank_ + i]);
  float total = 0.0f;
  for (const float loss : processes_->all_gather(std::span<const float>(local))) total += loss;
  return total / static_cast<float>(comm_->size() * batches_per_rank_);
}

float DistributedDataParallel::forward_backward(std::span<const Batch> batches, float loss_scale) {
  if (options_.shards > 0 || options_.accumulate > 1)
    throw InvalidArgument(
        fmt::format("forward_backward (gradient accumulation by hand) cannot be used with {}: a step "
                    "is train_step",
                    options_.shards > 0 ? "shards" : "EngineOptions::accumulate"));
  check_batches(batches, true);
  pipeline_->drain();  // its loss goes through slot 0, which no step in flight holds then
  bool broadcast = false;
  const bool sync = begin_forward(batches, broadcast);
  run_ranks([&](int r) {
    if (broadcast) enqueue_broadcast(r, false, true);
    enqueue_forward_backward(r, batches[static_cast<std::size_t>(r)], loss_scale, sync, 0, false);
  });
  join_losses(0);
  return wait_for_loss(0);
}

EvalTotals DistributedDataParallel::reduce_totals(std::span<const EvalTotals> per_batch) {
  if (processes_->size() == 1) return Engine::reduce_totals(per_batch);
  const std::vector<EvalTotals> all = processes_->all_gather(per_batch);
  return Engine::reduce_totals(all);
}

void DistributedDataParallel::optimizer_step() {
  pipeline_->drain();
  group_.run([&](int r) { enqueue_step(r); });
  if (options_.check_replicas) check_replicas_identical();
}

// zero_grad + forward_backward + step as one submission per device: each rank enqueues its whole
// step (the optimizer behind the loss's copy), and the returned loss waits for the losses only.
StepLoss DistributedDataParallel::submit_step(std::span<const Batch> batches) {
  check_batches(batches, true);
  const int slot = pipeline_->next_slot();
  return pipeline_->enqueue([&] {
    const engines::SampleSize sample = engines::sample_size(*ranks_[0]->model);
    for (int r = 0; r < group_.size(); ++r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      const auto mine = batches_of(r, batches);
      for (std::size_t i = 0; i < mine.size(); ++i)
        engines::push_batch(*rank.rings[i], group_.device(r), slot, mine[i], sample,
                            rank.step_done[static_cast<std::size_t>(slot)]);
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
      optimizers.push_back(ranks_[static_cast<std::size_t>(r)]->optimizer.get());
    }
    const auto memory = [&] {
      std::uint64_t growths = 0;
      for (auto& rank : ranks_)
        for (auto& ring : rank->rings) growths += ring->growths();
      return engines::snapshot(devices, growths);
    };
    graphs_->run(key, slot, optimizers, memory, step_work(slot, batches, sync, broadcast));
    join_losses(slot);
    // Across processes the mean loss is a collective of the hosts, which every process must call for
    // the same step in the same order: at once, then. And checking the replicas reads the parameters.
    if (processes_->size() > 1 || options_.check_replicas) {
      const float loss = wait_for_loss(slot);
      if (options_.check_replicas) check_replicas_identical();
      return pipeline_->known(slot, loss);
    }
    const Event ready = losses_ready(slot);
    return pipeline_->submitted(
        slot, [this, slot] { return wait_for_loss(slot); }, [ready] { return ready.query(); });
  });
}

void DistributedDataParallel::enqueue_train_step(int r, std::span<const Batch> batches, bool sync, bool broadcast,
                                                 int slot) {
  if (broadcast) enqueue_broadcast(r, false, true);
  enqueue_zero_grad(r);
  if (options_.shards > 0) {
    enqueue_sharded_forward_backward(r, batches, slot);
  } else {
    // torch's accumulation loop: each micro-batch's loss / K backward, no_sync but for the last.
    const int micro = static_cast<int>(batches.size());
    for (int m = 0; m < micro; ++m)
      enqueue_forward_backward(r, batches[static_cast<std::size_t>(m)], 1.0f / static_cast<float>(micro),
                               sync && m + 1 == micro, slot, true, m);
  }
  enqueue_step(r);
}

engines::StepWork DistributedDataParallel::step_work(int slot, std::span<const Batch> batches, bool sync,
                                                     bool broadcast) {
  engines::StepWork work;
  work.capture = [=, this] {
    std::vector<Graph> graphs(static_cast<std::size_t>(group_.size()));
    // Not run_ranks: a failed capture ran none of its collectives, so no peer waits in one and the
    // communicators stay usable. Each rank captures on its own worker, which also ends a failed capture.
    group_.run([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      graphs[static_cast<std::size_t>(r)] = engines::capture_on(
          rank.compute, [&] { enqueue_train_step(r, batches_of(r, batches), sync, broadcast, slot); });
    });
    return graphs;
  };
  work.replay = [=, this](const std::vector<Graph>& graphs) {
    run_ranks([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      for (auto& ring : rank.rings) ring->acquire(slot, rank.compute);
      engines::upload_replayed_step(*rank.model, *rank.optimizer, rank.compute);
      rank.accumulated_samples = 0;
      graphs[static_cast<std::size_t>(r)].replay();
      rank.model->replayed_backward();
      // Records captured into the graph are dependencies inside it: the loss is known, and the slot
      // free, once the graph has run.
      rank.compute.record(rank.loss_ready[static_cast<std::size_t>(slot)]);
      rank.compute.record(rank.step_done[static_cast<std::size_t>(slot)]);
    });
  };
  work.eager = [=, this] {
    run_ranks([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      for (auto& ring : rank.rings) ring->acquire(slot, rank.compute);
      enqueue_train_step(r, batches_of(r, batches), sync, broadcast, slot);
      rank.compute.record(rank.step_done[static_cast<std::size_t>(slot)]);
    });
  };
  return work;
}

std::vector<float> DistributedDataParallel::predict(std::span<const Batch> batches) {
  check_batches(batches, false);  // before any rank runs: a failing rank aborts the communicator
  pipeline_->drain();             // a failed step is reported here, not by a forward behind it
  // As torch's DDP forward: buffers (BatchNorm running statistics) come from rank 0 first.
  if ((options_.broadcast_buffers || options_.shards > 0) && require_forward_param_sync_)
    broadcast_from_rank0(false, true);
  const engines::SampleSize sample = engines::sample_size(*ranks_[0]->model);
  std::vector<std::size_t> offsets(batches.size() + 1, 0);
  for (std::size_t r = 0; r < batches.size(); ++r)
    offsets[r + 1] = offsets[r] + static_cast<std::size_t>(batches[r].size) * sample.logits;
  std::vector<float> out(offsets.back());
  run_ranks([&](int r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    for (int i = 0; i < forwards_per_rank(); ++i) {
      const auto b = static_cast<std::size_t>(r * forwards_per_rank() + i);
      const Batch& batch = batches[b];
      if (batch.size == 0) continue;
      rank.batch.stage(group_.device(r), rank.compute, Batch{batch.inputs, nullptr, batch.size}, sample);
      const float* logits = rank.model->forward(rank.compute, rank.batch.inputs(), batch.size, Mode::eval);
      // Pageable destination: the copy returns once written.
      rank.compute.copy(out.data() + offsets[b], logits,
                        static_cast<std::size_t>(batch.size) * sample.logits * sizeof(float));
    }
  });
  return out;
}

void DistributedDataParallel::synchronize() {
  pipeline_->drain();
  group_.run([&](int r) {
    ranks_[static_cast<std::size_t>(r)]->compute.synchronize();
    reducer_->synchronize(r);
    for (auto& ring : ranks_[static_cast<std::size_t>(r)]->rings)
      ring->release_copied();  // the lent batches' copies have run
  });
}

void DistributedDataParallel::check_replicas_identical() {
  const std::size_t n = ranks_[0]->model->param_count();
  std::vector<std::vector<float>> values(ranks_.size(), std::vector<float>(n));
  group_.run([&](int r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    rank.compute.copy(values[static_cast<std::size_t>(r)].data(), rank.model->params_flat(), n * sizeof(float));
  });
  for (std::size_t r = 1; r < ranks_.size(); ++r) {
    if (std::memcmp(values[0].data(), values[r].data(), n * sizeof(float)) == 0) continue;
    for (const TensorRef& p : ranks_[0]->model->parameters())
      for (std::size_t i = 0; i < p.numel(); ++i)
        if (std::memcmp(&values[0][p.offset + i], &values[r][p.offset + i], sizeof(float)) != 0)
          throw Error(
              fmt::format("DDP replicas diverged: '{}'[{}] is {} on rank 0 (device {}) but {} on rank {} "
                          "(device {})",
                          p.name, i, values[0][p.offset + i], group_.device_ids()[0], values[r][p.offset + i], r,
                          group_.device_ids()[r]));
  }
}

}  // namespace dp
