// ddp.cpp — DistributedDataParallel: per-rank replicas on persistent workers, bucketed all-reduce
// on a communication stream, launched from the backward's gradients-ready callback.
#include "dp/ddp.h"

#include <cstring>
#include <fmt/format.h>

#include "dp/error.h"
#include "grow.h"
#include "kernels/ops.h"

namespace dp {

using detail::grow;

std::vector<GradBucket> assign_buckets(const std::vector<TensorRef>& parameters, double first_bucket_mb,
                                       double bucket_cap_mb) {
  if (!(bucket_cap_mb > 0.0) || !(first_bucket_mb > 0.0))
    throw InvalidArgument(fmt::format("bucket caps must be > 0 MiB (bucket_cap_mb {}, first bucket {})",
                                      bucket_cap_mb, first_bucket_mb));
  std::vector<GradBucket> buckets;
  GradBucket current;
  std::size_t bytes = 0;
  double limit = first_bucket_mb * 1024.0 * 1024.0;
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    // Reverse order: each parameter sits just before the previous one in the flat buffer.
    if (!current.parameters.empty() && it->offset + it->numel() != current.offset)
      throw InvalidArgument("assign_buckets: parameters are not contiguous in the flat buffer");
    current.offset = it->offset;
    current.count += it->numel();
    current.parameters.push_back(it->name);
    bytes += it->bytes();
    if (static_cast<double>(bytes) >= limit) {
      buckets.push_back(std::move(current));
      current = GradBucket{};
      bytes = 0;
      limit = bucket_cap_mb * 1024.0 * 1024.0;
    }
  }
  if (!current.parameters.empty()) buckets.push_back(std::move(current));
  return buckets;
}

struct DistributedDataParallel::Rank {
  Model* model = nullptr;
  std::unique_ptr<Model> owned;
  std::unique_ptr<Sgd> optimizer;
  std::unique_ptr<CrossEntropyLoss> loss;
  Stream compute, comm;
  std::vector<Event> bucket_ready;
  Event comm_done;
  DeviceBuffer inputs, targets, grad_output;
  std::vector<std::size_t> pending;  // per bucket: gradient elements not yet reported ready
  std::size_t next_bucket = 0;
  PinnedBuffer host_loss;  // pinned: the copy is asynchronous, the worker never blocks on peers
};

namespace {

}  // namespace

DistributedDataParallel::DistributedDataParallel(Runtime& runtime, Model& module, const SgdOptions& sgd,
                                                 DdpOptions options)
    : runtime_(runtime), group_(runtime, options.device_ids.value_or(DeviceGroup::all_devices(runtime))), options_(std::move(options)) {
  if (module.device().index() != group_.device_ids()[0])
    throw InvalidArgument(fmt::format("module must be on device_ids[0] (device {}) but is on device {}",
                                      group_.device_ids()[0], module.device().index()));
  buckets_ = assign_buckets(module.parameters(), options_.first_bucket_mb, options_.bucket_cap_mb);
  comm_ = Communicator::create(group_);
  for (int r = 0; r < group_.size(); ++r) {
    auto rank = std::make_unique<Rank>();
    Device& device = group_.device(r);
    if (r == 0) {
      rank->model = &module;
    } else {
      rank->owned = module.replicate(device);
      rank->model = rank->owned.get();
    }
    rank->optimizer = std::make_unique<Sgd>(device, module.param_count(), sgd);
    rank->loss = std::make_unique<CrossEntropyLoss>(device);
    rank->compute = device.create_stream();
    rank->comm = device.create_stream();
    for (std::size_t b = 0; b < buckets_.size(); ++b) rank->bucket_ready.push_back(device.create_event());
    rank->comm_done = device.create_event();
    rank->host_loss = runtime.allocate_pinned(sizeof(float));
    ranks_.push_back(std::move(rank));
  }
  broadcast_from_rank0(true, true);
  zero_grad();  // on each rank's worker: its device is the current one there
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& rank : ranks_) {
    try {
      rank->compute.synchronize();
      rank->comm.synchronize();
    } catch (...) {
    }
  }
}

Model& DistributedDataParallel::replica(int rank) const { return *ranks_.at(static_cast<std::size_t>(rank))->model; }
Sgd& DistributedDataParallel::optimizer(int rank) const { return *ranks_.at(static_cast<std::size_t>(rank))->optimizer; }

void DistributedDataParallel::broadcast_from_rank0(bool parameters, bool buffers) {
  try {
    group_.run([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      Model& m = *rank.model;
      // On the compute stream: ordered after the forward that last touched the buffers.
      if (parameters) comm_->broadcast(r, rank.compute, m.params_flat(), m.param_count() * sizeof(float), 0);
      if (buffers && m.buffers_bytes()) comm_->broadcast(r, rank.compute, m.buffers_flat(), m.buffers_bytes(), 0);
    });
  } catch (...) {
    comm_->abort();  // peers of the failed rank would otherwise wait on their streams forever
    throw;
  }
}

void DistributedDataParallel::zero_grad() {
  group_.run([&](int r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    rank.model->zero_grad(rank.compute);
  });
}

void DistributedDataParallel::launch_ready_buckets(Rank& rank, int r) {
  // Strictly in bucket order, like the reducer: a later bucket never overtakes an earlier one.
  while (rank.next_bucket < buckets_.size() && rank.pending[rank.next_bucket] == 0) {
    const std::size_t b = rank.next_bucket++;
    const GradBucket& bucket = buckets_[b];
    rank.compute.record(rank.bucket_ready[b]);
    rank.comm.wait(rank.bucket_ready[b]);
    float* slice = rank.model->grads_flat() + bucket.offset;
    // torch divides while copying into the bucket (grad * (1/world_size) in fp32), then sums.
    kernels::scale(rank.comm, static_cast<kernels::index_t>(bucket.count), 1.0f / static_cast<float>(group_.size()),
                   slice);
    comm_->all_reduce(r, rank.comm, slice, bucket.count, ReduceOp::sum);
  }
}

float DistributedDataParallel::forward_backward(const std::vector<RankBatch>& batches, float loss_scale) {
  if (static_cast<int>(batches.size()) != group_.size())
    throw InvalidArgument(fmt::format("DDP step needs one batch per rank: got {} for {} ranks", batches.size(),
                                      group_.size()));
  for (std::size_t r = 0; r < batches.size(); ++r) {
    if (batches[r].size < 1)
      throw InvalidArgument(fmt::format("batch size must be at least 1, got {} on rank {}", batches[r].size, r));
    if (!batches[r].inputs || !batches[r].targets)
      throw InvalidArgument(fmt::format("rank {}: null inputs or targets", r));
  }
  // torch 1.13: buffers are broadcast before a forward unless the previous forward ran inside
  // no_sync (require_forward_param_sync).
  if (options_.broadcast_buffers && require_forward_param_sync_) broadcast_from_rank0(false, true);
  const bool sync = sync_;
  require_forward_param_sync_ = sync;
  try {
    group_.run([&](int r) {
     try {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      Model& m = *rank.model;
      Device& device = group_.device(r);
      const RankBatch& batch = batches[static_cast<std::size_t>(r)];
      std::size_t sample = 1;
      for (auto d : m.input_shape()) sample *= static_cast<std::size_t>(d);
      const int classes = m.output_features();
      grow(rank.inputs, device, sample * static_cast<std::size_t>(batch.size) * sizeof(float));
      grow(rank.targets, device, static_cast<std::size_t>(batch.size) * sizeof(std::int64_t));
      grow(rank.grad_output, device, static_cast<std::size_t>(batch.size) * static_cast<std::size_t>(classes) * sizeof(float));
      rank.compute.copy(rank.inputs.data(), batch.inputs, sample * static_cast<std::size_t>(batch.size) * sizeof(float));
      rank.compute.copy(rank.targets.data(), batch.targets, static_cast<std::size_t>(batch.size) * sizeof(std::int64_t));
      const float* logits = m.forward(rank.compute, rank.inputs.as<float>(), batch.size, Mode::train);
      const float* loss = rank.loss->forward(rank.compute, logits, rank.targets.as<std::int64_t>(), batch.size, classes);
      rank.loss->backward(rank.compute, logits, rank.targets.as<std::int64_t>(), batch.size, classes,
                          rank.grad_output.as<float>(), batch.size, loss_scale);
      rank.pending.clear();
      for (const GradBucket& bucket : buckets_) rank.pending.push_back(bucket.count);
      rank.next_bucket = 0;
      GradientsReady on_ready;
      if (sync) {
        on_ready = [&](std::size_t offset, std::size_t count) {
          for (std::size_t b = 0; b < buckets_.size(); ++b) {
            const std::size_t lo = std::max(offset, buckets_[b].offset);
            const std::size_t hi = std::min(offset + count, buckets_[b].offset + buckets_[b].count);
            if (hi > lo) rank.pending[b] -= hi - lo;
          }
          launch_ready_buckets(rank, r);
        };
      }
      m.backward(rank.compute, rank.grad_output.as<float>(), on_ready);
      if (sync) {
        if (rank.next_bucket != buckets_.size())
          throw Error(fmt::format("rank {}: backward reported gradients for only {} of {} buckets", r,
                                  rank.next_bucket, buckets_.size()));
        // The optimizer (on the compute stream) waits for every bucket.
        rank.comm.record(rank.comm_done);
        rank.compute.wait(rank.comm_done);
      }
      rank.compute.copy(rank.host_loss.data(), loss, sizeof(float));
     } catch (...) {
      // At once, not after the other ranks' tasks: they may be waiting on this rank's collectives.
      comm_->abort();
      throw;
     }
    });
    // Only now wait for the streams: had a rank failed above, its peers' collectives would never
    // complete, and the abort below must come first.
    group_.run([&](int r) { ranks_[static_cast<std::size_t>(r)]->compute.synchronize(); });
  } catch (...) {
    comm_->abort();
    throw;
  }
  float total = 0.0f;
  for (auto& rank : ranks_) total += *rank->host_loss.as<float>();
  return total / static_cast<float>(group_.size());
}

void DistributedDataParallel::step() {
  group_.run([&](int r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    rank.optimizer->step(rank.compute, rank.model->params_flat(), rank.model->grads_flat());
  });
  if (options_.check_replicas) check_replicas_identical();
}

float DistributedDataParallel::train_step(const std::vector<RankBatch>& batches) {
  zero_grad();
  const float loss = forward_backward(batches);
  step();
  return loss;
}

void DistributedDataParallel::synchronize() {
  group_.run([&](int r) {
    ranks_[static_cast<std::size_t>(r)]->compute.synchronize();
    ranks_[static_cast<std::size_t>(r)]->comm.synchronize();
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
          throw Error(fmt::format("DDP replicas diverged: '{}'[{}] is {} on rank 0 (device {}) but {} on rank {} "
                                  "(device {})",
                                  p.name, i, values[0][p.offset + i], group_.device_ids()[0], values[r][p.offset + i],
                                  r, group_.device_ids()[r]));
  }
}

}  // namespace dp
