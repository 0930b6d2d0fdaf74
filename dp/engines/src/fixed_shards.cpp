// fixed_shards.cpp — the fixed-shards engine: every shard its own forward and backward, the shards'
// gradients all-gathered and added in shard order.
#include "fixed_shards.h"

#include <algorithm>
#include <fmt/format.h>

#include "batches.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/progress.h"
#include "replica_rank.h"

namespace dp::engines {

FixedShards::FixedShards(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                         const EngineOptions& options, EngineKind as)
    : ReplicaEngine(runtime, module, check_applies(as, options), Step::fixed_shards), as_(as) {
  const int devices = comm_->size();
  if (options_.shards <= 0) throw InvalidArgument(fmt::format("fixed shards need shards > 0, not {}", options_.shards));
  const bool uneven = options_.uneven_shards && processes_->size() == 1;
  if (options_.shards % devices != 0 && !uneven)
    throw InvalidArgument(
        fmt::format("{} shards cannot be spread evenly over {} device(s): the device count must divide the shards",
                    options_.shards, devices));
  if (options_.shards < devices)
    throw InvalidArgument(fmt::format("{} shards leave some of {} devices none", options_.shards, devices));
  shards_ = options_.shards * options_.accumulate;
  // SyncBatchNorm needs every shard's forward at each BatchNorm at once: a replica per shard.
  if (options_.sync_batchnorm && shards_ != devices)
    throw InvalidArgument(
        fmt::format("sync_batchnorm with {} shards needs a device per shard, not {}: {} dp devices (on fewer GPUs, "
                    "several on each: RuntimeOptions::devices_per_gpu)",
                    options_.shards, devices, options_.shards));
  // Consecutive shards per rank, the first ranks one more where the count does not divide them: the
  // sum runs in shard order whoever holds which (Note [fixed shards]).
  std::vector<int> counts;
  for (int r = 0; r < group_.size(); ++r) {
    counts.push_back(shards_ / devices + (r < shards_ % devices ? 1 : 0));
    first_shard_.push_back(r == 0 ? 0 : first_shard_.back() + counts[counts.size() - 2]);
  }
  scratch_.resize(static_cast<std::size_t>(group_.size()));
  (void)start(runtime, module, optimizer, counts, counts, true);
  if (options_.shadow_shards > 0) start_shadow_shards(runtime);
}

FixedShards::~FixedShards() { quiesce(); }

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
// a bit, on any backend. Rank 0's buffers ride in the same all-gather, so a step ends with every
// replica holding shard 0's running statistics, at the moment it holds every gradient: a rank has
// either all of a step or none of it (what a survivor of a lost device goes on from,
// ReplicaEngine::survivor). Cost per step and rank: V/P + V gradient copies of memory, an all-gather
// of V gradients (each rank receives (V - V/P) x 4 bytes per parameter, against 2(P-1)/P x 4 for a
// ring all-reduce: the same at V = P = 2) and V - 1 passes of additions. The sum is the fp32 sum
// of a sequential loop, as accurate as the ring's. The logged loss is the shards' losses, added in
// shard order. Running statistics are shard 0's, as DataParallel keeps the source replica's: rank 0
// saves them after shard 0's forward and puts them back after its other shards'; every replica
// takes them from the all-gather and starts the next step from them. SyncBatchNorm needs every shard's
// forward at each BatchNorm at once: there each rank holds one shard (a replica per shard, on fewer
// GPUs as virtual devices), and BatchNorm's sums over the ranks are order-free as the gradient's
// (BatchNormSync::ordered); the running statistics are then the combined ones, on every replica.

// Rank r's block of the shards' all-gather, and where shard s's gradient lands in the gathered
// blocks (s a global shard index).
FixedShards::Layout FixedShards::layout(int r) {
  Rank& mine = rank(r);
  Scratches& scratch = scratch_[static_cast<std::size_t>(r)];
  Model& m = *mine.model;
  Device& device = group_.device(r);
  Layout out;
  out.n = m.param_count();
  out.most = static_cast<std::size_t>(batches_per_rank_);
  // Each rank's block of the all-gather: its shards' gradients, then its buffers (rank 0's are
  // shard 0's statistics, which every rank takes with the gradients: Note [fixed shards]).
  out.buffer_floats = options_.sync_batchnorm ? 0 : (m.buffers_bytes() + sizeof(float) - 1) / sizeof(float);
  // Ranks with fewer shards than the most leave the rest of their block unused.
  out.block = out.most * out.n + out.buffer_floats;
  const auto ranks = static_cast<std::size_t>(comm_->size());
  out.own = scratch.shard_grads.get<float>(device, out.block);
  out.all = scratch.all_grads.get<float>(device, ranks * out.block);
  return out;
}

const float* FixedShards::Layout::shard_grads(const FixedShards& engine, int s) const {
  const auto k = static_cast<std::size_t>(s);
  if (engine.processes_->size() > 1) return all + (k / most) * block + (k % most) * n;  // even: checked above
  const auto& first = engine.first_shard_;
  const auto owner = static_cast<std::size_t>(std::upper_bound(first.begin(), first.end(), s) - first.begin() - 1);
  return all + owner * block + (k - static_cast<std::size_t>(first[owner])) * n;
}

int FixedShards::first_shard_of(int r) const {
  return comm_->first_rank() * batches_per_rank_ + first_shard_[static_cast<std::size_t>(r)];
}

void FixedShards::enqueue_forward_backward_step(int r, std::span<const Batch> shards, bool, int slot) {
  Rank& mine = rank(r);
  Scratches& scratch = scratch_[static_cast<std::size_t>(r)];
  Model& m = *mine.model;
  Device& device = group_.device(r);
  const Layout l = layout(r);
  const auto count = shards.size();
  const int shard_size = shards[0].size;
  const int first_shard = first_shard_of(r);
  const bool keep_shard0_buffers = first_shard == 0 && count > 1 && m.buffers_bytes() > 0;
  void* saved = keep_shard0_buffers ? scratch.saved_buffers.get<char>(device, m.buffers_bytes()) : nullptr;
  for (std::size_t i = 0; i < count; ++i) {
    if (i > 0) m.zero_grad(mine.compute);
    const float* loss = enqueue_shard(r, first_shard + static_cast<int>(i), shard_size, mine.rings[i]->inputs(slot),
                                      mine.rings[i]->targets(slot), [&] {
                                        if (saved && i == 0)
                                          mine.compute.copy(saved, m.buffers_flat(), m.buffers_bytes());
                                      });
    mine.compute.copy(mine.loss_slot(slot, static_cast<int>(i), batches_per_rank_), loss, sizeof(float));
    mine.compute.copy(l.own + i * l.n, m.grads_flat(), l.n * sizeof(float));
    if (shadow_ && shadow_->owner == r && shadow_->index == static_cast<int>(i))
      enqueue_shadow_fingerprint(r, l.own + i * l.n, loss);
  }
  if (saved) mine.compute.copy(m.buffers_flat(), saved, m.buffers_bytes());
  if (l.buffer_floats > 0) mine.compute.copy(l.own + l.most * l.n, m.buffers_flat(), m.buffers_bytes());
  // The twin recomputes the checked shard beside the other ranks' own shards, before the all-gather
  // that waits for them all (its buffers already in its block: the recompute's forward moves them).
  if (shadow_ && shadow_->twin == r) enqueue_shadow(r, slot);
  {
    const CollectivePurpose purpose("the shards' gradients");
    comm_->all_gather(r, mine.compute, l.own, l.all, l.block);
  }
  if (!mine.compute.capturing()) mine.compute.record(mine.loss_ready[static_cast<std::size_t>(slot)]);
}

const float* FixedShards::enqueue_shard(int r, int shard, int shard_size, Inputs inputs, const std::int64_t* targets,
                                        const std::function<void()>& after_forward) {
  Rank& mine = rank(r);
  Model& m = *mine.model;
  const SampleSize sample = sample_size(m);
  const int global_batch = shard_size * shards_;
  float* grad_output =
      mine.grad_output.get<float>(group_.device(r), static_cast<std::size_t>(shard_size) * sample.logits);
  m.set_random_context({options_.step.seed, static_cast<std::uint64_t>(mine.optimizer->steps()),
                        static_cast<std::uint64_t>(shard) * static_cast<std::uint64_t>(shard_size)});
  // Each shard its own passes (where a thread stands; DP_FAULT's flip-gemm strikes each pass).
  progress::set_phase("forward");
  const Model::Output logits = m.forward_for_loss(mine.compute, inputs, shard_size);
  after_forward();
  const float* loss = mine.loss->forward_backward(
      mine.compute, logits.data, targets, shard_size * static_cast<int>(sample.targets), sample.classes, grad_output,
      global_batch * static_cast<int>(sample.targets), 1.0f, logits.bf16);
  progress::set_phase("backward");
  m.backward_from_loss(mine.compute, grad_output, logits.bf16, {});
  return loss;
}

void FixedShards::enqueue_reduction(int r, int) {
  Rank& mine = rank(r);
  Model& m = *mine.model;
  const Layout l = layout(r);
  // Every replica takes rank 0's buffers from its block (after a shadow shard's forward, which
  // moved the twin's own).
  if (l.buffer_floats > 0) mine.compute.copy(m.buffers_flat(), l.all + l.most * l.n, m.buffers_bytes());
  float* grads = m.grads_flat();
  const auto elements = static_cast<kernels::index_t>(l.n);
  if (shards_ == 1)
    mine.compute.copy(grads, l.shard_grads(*this, 0), l.n * sizeof(float));
  else
    kernels::add(mine.compute, elements, l.shard_grads(*this, 0), l.shard_grads(*this, 1), grads);
  for (int s = 2; s < shards_; ++s) kernels::add(mine.compute, elements, grads, l.shard_grads(*this, s), grads);
}

void FixedShards::check_batches(std::span<const Batch> batches, bool training) const {
  const int expected = training ? batches_per_step() : batches_per_forward();
  if (static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(
        fmt::format("a step with {} shards on {} device(s) here takes {} batches, one per shard: got {}", shards_,
                    group_.size(), expected, batches.size()));
  // Every shard of a step the same size: the shards, and so the result, are those of every device count.
  if (training)
    for (std::size_t b = 1; b < batches.size(); ++b)
      if (batches[b].size != batches[0].size)
        throw InvalidArgument(
            fmt::format("the shards of a step must be the same size: shard {} has {} samples, shard {} has {}",
                        first_rank(), batches[0].size, first_rank() + static_cast<int>(b), batches[b].size));
  check_each_batch(batches, training);
}

}  // namespace dp::engines
