// reducer.cpp — bucket bookkeeping and the bucketed all-reduce of DDP's gradients.
#include "dp/engines/reducer.h"

#include <algorithm>
#include <fmt/format.h>

#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"

namespace dp {

std::vector<GradBucket> assign_buckets(const std::vector<TensorRef>& parameters, double first_bucket_mb,
                                       double bucket_cap_mb, const std::vector<std::string>& skipped) {
  if (!(bucket_cap_mb > 0.0) || !(first_bucket_mb > 0.0))
    throw InvalidArgument(
        fmt::format("bucket caps must be > 0 MiB (bucket_cap_mb {}, first bucket {})", bucket_cap_mb, first_bucket_mb));
  std::vector<GradBucket> buckets;
  GradBucket current;
  std::size_t bytes = 0;
  double limit = first_bucket_mb * 1024.0 * 1024.0;
  for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
    if (std::any_of(skipped.begin(), skipped.end(), [&](const std::string& p) { return is_under(it->name, p); })) {
      if (!current.parameters.empty()) {  // closed early: a bucket is one contiguous slice
        buckets.push_back(std::move(current));
        limit = bucket_cap_mb * 1024.0 * 1024.0;
      }
      current = GradBucket{};
      bytes = 0;
      continue;
    }
    // Reverse order: each parameter sits just before the previous one in the flat buffer.
    if (!current.parameters.empty() && it->offset + it->numel() != current.offset)
      throw InvalidArgument("assign_buckets: parameters are not contiguous in the flat buffer");
    current.offset = it->offset;
    current.count += it->numel();
    current.parameters.push_back(it->name);
    current.sizes.push_back(it->numel());
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

struct Reducer::Rank {
  Stream comm;
  std::vector<Event> bucket_ready;  // recorded on the compute stream once a bucket's gradients are final
  Event comm_done;
  const Stream* compute = nullptr;  // of the backward in progress
  float* grads = nullptr;
  DeviceBuffer compressed;           // GradReduce::bf16: the buckets' bf16 values, at their gradients' offsets
  std::vector<std::size_t> pending;  // per bucket: gradient elements not yet reported ready
  std::size_t next_bucket = 0;
};

Reducer::Reducer(Communicator& comm, const DeviceGroup& group, std::vector<GradBucket> buckets, GradReduce reduce,
                 BucketReduction reduction, BucketHome* home)
    : comm_(comm), buckets_(std::move(buckets)), reduce_(reduce), reduction_(reduction), home_(home) {
  if (home_ && reduce_ == GradReduce::bf16)
    throw InvalidArgument("a bf16 gradient reduction needs the whole gradient buffer: it has no bucket slots");
  if (reduction_ == BucketReduction::reduce_scatter && reduce_ == GradReduce::bf16)
    throw InvalidArgument("a bf16 gradient reduction has no reduce-scatter: all-reduce it");
  std::size_t covered = 0;
  for (const GradBucket& bucket : buckets_) covered = std::max(covered, bucket.offset + bucket.count);
  for (int r = 0; r < group.size(); ++r) {
    auto rank = std::make_unique<Rank>();
    Device& device = group.device(r);
    rank->comm = device.create_stream();
    if (reduce_ == GradReduce::bf16 && comm_.size() > 1 && covered > 0)
      rank->compressed = device.allocate(covered * sizeof(std::uint16_t));
    for (std::size_t b = 0; b < buckets_.size(); ++b) rank->bucket_ready.push_back(device.create_event());
    rank->comm_done = device.create_event();
    ranks_.push_back(std::move(rank));
  }
}

std::size_t Reducer::bytes_beside() const { return ranks_.empty() ? 0 : ranks_[0]->compressed.size(); }

Reducer::~Reducer() {
  for (auto& rank : ranks_) {
    try {
      rank->comm.synchronize();
    } catch (...) {  // a destructor never throws; the failure was reported by the step
    }
  }
}

void Reducer::prepare(int r, const Stream& compute, float* grads) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  rank.compute = &compute;
  rank.grads = grads;
  rank.pending.clear();
  for (const GradBucket& bucket : buckets_) rank.pending.push_back(bucket.count);
  rank.next_bucket = 0;
  if (home_) home_->begin(r, compute);
}

void Reducer::mark_ready(int r, std::size_t offset, std::size_t count) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const std::size_t lo = std::max(offset, buckets_[b].offset);
    const std::size_t hi = std::min(offset + count, buckets_[b].offset + buckets_[b].count);
    if (hi > lo) rank.pending[b] -= hi - lo;
  }
  launch_ready(r);
}

void Reducer::launch_ready(int r) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  // Strictly in bucket order, like c10d's reducer: a later bucket never overtakes an earlier one.
  while (rank.next_bucket < buckets_.size() && rank.pending[rank.next_bucket] == 0) {
    const std::size_t b = rank.next_bucket++;
    // One rank: x * (1/1) and a sum over one rank leave every bit as it is, so neither runs: DDP on
    // one device costs what one device costs.
    if (comm_.size() == 1) {
      if (home_) home_->reduced(r, b, *rank.compute);
      continue;
    }
    const GradBucket& bucket = buckets_[b];
    const CollectivePurpose purpose(fmt::format("bucket {}", b));
    rank.compute->record(rank.bucket_ready[b]);
    rank.comm.wait(rank.bucket_ready[b]);
    float* slice = home_ ? home_->bucket(r, b) : rank.grads + bucket.offset;
    const auto count = static_cast<kernels::index_t>(bucket.count);
    const float inverse = 1.0f / static_cast<float>(comm_.size());
    if (reduce_ == GradReduce::bf16) {
      std::uint16_t* packed = rank.compressed.as<std::uint16_t>() + bucket.offset;
      kernels::to_bf16_scaled(rank.comm, count, slice, inverse, packed);
      comm_.all_reduce_bf16(r, rank.comm, packed, bucket.count);
      kernels::from_bf16(rank.comm, count, packed, slice);
      continue;
    }
    // torch divides while copying into the bucket (grad * (1/world_size) in fp32), then sums.
    kernels::scale(rank.comm, count, inverse, slice);
    if (reduction_ == BucketReduction::reduce_scatter)
      comm_.reduce_scatter(r, rank.comm, slice, bucket.count);
    else
      comm_.all_reduce(r, rank.comm, slice, bucket.count, ReduceOp::sum);
    if (home_) home_->reduced(r, b, rank.comm);
  }
}

void Reducer::finish(int r) {
  Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  if (rank.next_bucket != buckets_.size())
    throw Error(fmt::format("rank {}: backward reported gradients for only {} of {} buckets", r, rank.next_bucket,
                            buckets_.size()));
  // The optimizer (on the compute stream) waits for every bucket. With one rank no bucket ran, and
  // the communication stream never joined a capture of this backward: waiting inside the capture
  // on its record, made outside, would fail it (cudaErrorStreamCaptureIsolation).
  if (comm_.size() > 1) {
    rank.comm.record(rank.comm_done);
    rank.compute->wait(rank.comm_done);
  }
  rank.compute = nullptr;
}

void Reducer::synchronize(int r) { ranks_[static_cast<std::size_t>(r)]->comm.synchronize(); }

}  // namespace dp
