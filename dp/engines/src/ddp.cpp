// ddp.cpp — DistributedDataParallel: a ReplicaEngine whose ranks each forward their own batch; the
// Reducer all-reduces gradient buckets on a communication stream, launched from the backward's
// gradients-ready callback; no_sync and the accumulation loop; SyncBatchNorm's sample counts.
#include "dp/engines/ddp.h"

#include <fmt/format.h>

#include "batches.h"
#include "dp/runtime/error.h"
#include "dp/runtime/progress.h"
#include "replica_rank.h"

namespace dp {

DistributedDataParallel::DistributedDataParallel(Runtime& runtime, Model& module, const OptimizerOptions& optimizer,
                                                 const EngineOptions& options)
    : ReplicaEngine(runtime, module, check_applies(EngineKind::ddp, options), Step::per_rank) {
  std::vector<GradBucket> buckets = start(runtime, module, optimizer, options_.accumulate, 1, false);
  reducer_ = std::make_unique<Reducer>(*comm_, group_, std::move(buckets), options_.grad_reduce, bucket_reduction(),
                                       bucket_home());
}

// The ranks' compute streams wait for the reducer's events: idle before it goes (it then waits for
// its own streams).
DistributedDataParallel::~DistributedDataParallel() { quiesce(); }

void DistributedDataParallel::synchronize_rank(int r) { reducer_->synchronize(r); }

std::size_t DistributedDataParallel::gradient_bytes() const {
  return ReplicaEngine::gradient_bytes() + reducer_->bytes_beside();
}

void DistributedDataParallel::zero_grad() { zero_grads(); }

float DistributedDataParallel::forward_backward(std::span<const Batch> batches, float loss_scale) {
  if (options_.accumulate > 1)
    throw InvalidArgument(
        "forward_backward (gradient accumulation by hand) cannot be used with EngineOptions::accumulate: a step is "
        "train_step");
  check_batches(batches, true);
  drain();  // its loss goes through slot 0, which no step in flight holds then
  bool broadcast = false;
  const bool sync = begin_forward(batches, broadcast);
  run_ranks([&](int r) {
    if (broadcast) enqueue_broadcast(r, false, true);
    enqueue_forward_backward(r, batches[static_cast<std::size_t>(r)], loss_scale, sync, 0, false);
  });
  join_losses(0);
  return wait_for_loss(0);
}

void DistributedDataParallel::optimizer_step() {
  drain();
  release_whole_optimizers();
  group_.run([&](int r) { enqueue_step(r); });
  const std::int64_t step = optimizer(0).steps();
  if (options_.check_replicas > 0 && step % options_.check_replicas == 0) check_replica_fingerprints();
}

void DistributedDataParallel::enqueue_forward_backward_step(int r, std::span<const Batch> mine, bool sync, int slot) {
  // torch's accumulation loop: each micro-batch's loss / K backward, no_sync but for the last.
  const int micro = static_cast<int>(mine.size());
  for (int m = 0; m < micro; ++m)
    enqueue_forward_backward(r, mine[static_cast<std::size_t>(m)], 1.0f / static_cast<float>(micro),
                             sync && m + 1 == micro, slot, true, m);
}

void DistributedDataParallel::enqueue_forward_backward(int r, const Batch& batch, float loss_scale, bool sync, int slot,
                                                       bool ring, int index) {
  Rank& mine = rank(r);
  Model& m = *mine.model;
  Device& device = group_.device(r);
  const engines::SampleSize sample = engines::sample_size(m);
  const int rows = batch.size * static_cast<int>(sample.targets);
  if (!ring) mine.batch.stage(device, mine.compute, batch, sample);
  const auto i = static_cast<std::size_t>(index);
  const Inputs inputs = ring ? mine.rings[i]->inputs(slot) : mine.batch.inputs();
  const std::int64_t* targets = ring ? mine.rings[i]->targets(slot) : mine.batch.targets();
  float* grad_output = mine.grad_output.get<float>(device, static_cast<std::size_t>(batch.size) * sample.logits);
  // seed + global rank, as each torch process seeds itself; forwards accumulated without a step
  // (no_sync) continue the step's samples, as one larger batch would.
  m.set_random_context({options_.step.seed + static_cast<std::uint64_t>(comm_->first_rank() + r),
                        static_cast<std::uint64_t>(mine.optimizer->steps()), mine.accumulated_samples});
  mine.accumulated_samples += static_cast<std::uint64_t>(batch.size);
  progress::set_phase("forward");
  const Model::Output logits = m.forward_for_loss(mine.compute, inputs, batch.size);
  const float* loss = mine.loss->forward_backward(mine.compute, logits.data, targets, rows, sample.classes, grad_output,
                                                  rows, loss_scale, logits.bf16);
  GradientsReady on_ready;
  if (sync) {
    // Not grads_flat(): that would fill in a pending zero_grad the backward is about to overwrite.
    reducer_->prepare(r, mine.compute, bucket_home() ? nullptr : m.grads_address());
    on_ready = [&](std::size_t offset, std::size_t count) { reducer_->mark_ready(r, offset, count); };
  }
  progress::set_phase("backward");
  m.backward_from_loss(mine.compute, grad_output, logits.bf16, on_ready);
  if (sync) reducer_->finish(r);
  mine.compute.copy(mine.loss_slot(slot, index, batches_per_rank_), loss, sizeof(float));
  // Captured, a record is a dependency inside the graph: the replay records it after the graph.
  if (!mine.compute.capturing()) mine.compute.record(mine.loss_ready[static_cast<std::size_t>(slot)]);
}

void DistributedDataParallel::check_batches(std::span<const Batch> batches, bool training) const {
  const int expected = training ? batches_per_step() : batches_per_forward();
  if (training && options_.accumulate > 1 && static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(fmt::format("a DDP step of {} micro-batches takes {} per rank, {} in all: got {}",
                                      options_.accumulate, options_.accumulate, expected, batches.size()));
  if (static_cast<int>(batches.size()) != expected)
    throw InvalidArgument(
        fmt::format("DDP step needs one batch per rank: got {} for {} ranks", batches.size(), group_.size()));
  check_each_batch(batches, training);
}

}  // namespace dp
