// dp/engines/reducer.h — DDP's gradient reducer, apart from DDP as c10d keeps it: the buckets (contiguous
// slices of the flat gradient buffer, filled in reverse parameter order), which gradients each is
// still waiting for, and their all-reduce on a communication stream, launched strictly in bucket
// order as soon as a bucket is complete, overlapping the rest of backward.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dp/nn/tensor.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device.h"
#include "dp/runtime/device_group.h"

namespace dp {

// A bucket: a contiguous slice [offset, offset+count) of the flat gradient buffer.
struct GradBucket {
  std::size_t offset = 0;
  std::size_t count = 0;
  std::vector<std::string> parameters;  // in the order they were added (reverse parameter order)
  std::vector<std::size_t> sizes;       // their element counts, in that order
};

// torch's steady-state assignment (the rebuilt buckets after the first iteration): parameters in
// reverse order; a bucket closes once its size reaches the current limit, the first limit being
// first_bucket_mb and every later one bucket_cap_mb. Parameters under a `skipped` prefix (frozen)
// go in no bucket, and a bucket closes before one, so that each stays a contiguous slice.
std::vector<GradBucket> assign_buckets(const std::vector<TensorRef>& parameters, double first_bucket_mb,
                                       double bucket_cap_mb, const std::vector<std::string>& skipped = {});

// What a bucket's all-reduce carries: fp32 gradients (torch's default allreduce_hook: divided by
// the world size, then summed), or bf16 (torch's bf16_compress_hook: rounded to bf16, divided in
// bf16, summed in bf16 as NCCL's ncclBfloat16 sum rounds every addition, widened back into the fp32
// gradients): half the bytes on the links, at bf16's 8-bit precision.
enum class GradReduce { fp32, bf16 };

// What a bucket's reduction leaves on each rank: the average of the whole bucket (all-reduce), or
// the average of the rank's own block of it only (Communicator::reduce_scatter, for an optimizer
// that updates those blocks): all-reduce's first half, half its bytes.
enum class BucketReduction { all_reduce, reduce_scatter };

// Where a rank's buckets are when its gradients are no whole buffer (ZeRO-2's slots, which a
// bucket holds from its first gradient to the end of its reduction), called on the rank's worker.
class BucketHome {
 public:
  virtual ~BucketHome() = default;
  // A synchronised backward of rank r is about to be enqueued on `compute`.
  virtual void begin(int rank, const Stream& compute) = 0;
  // Bucket b's gradients, as that backward wrote them.
  virtual float* bucket(int rank, std::size_t b) = 0;
  // Enqueued on `stream` right after bucket b's reduction: what the rank keeps of it taken, and its
  // memory handed on to the buckets after it.
  virtual void reduced(int rank, std::size_t b, const Stream& stream) = 0;
};

class Reducer {
 public:
  // One communication stream per rank of `group`; `comm` and `group` (and `home`, if any) must
  // outlive the reducer. With a `home`, prepare()'s `grads` is not used.
  Reducer(Communicator& comm, const DeviceGroup& group, std::vector<GradBucket> buckets,
          GradReduce reduce = GradReduce::fp32, BucketReduction reduction = BucketReduction::all_reduce,
          BucketHome* home = nullptr);
  ~Reducer();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Bytes a rank keeps beside the gradients (the bf16 copy a bf16 reduction sends).
  std::size_t bytes_beside() const;

  // Rank r's side of one synchronised backward, each called on rank r's worker:
  // prepare() before the backward is enqueued on `compute` (grads: the rank's flat gradients);
  // mark_ready() from the backward's GradientsReady callback; finish() after it, which checks
  // that every bucket was launched and makes `compute` wait for all of them (the optimizer runs
  // there). Gradients end up averaged over the ranks.
  void prepare(int rank, const Stream& compute, float* grads);
  void mark_ready(int rank, std::size_t offset, std::size_t count);
  void finish(int rank);

  // Blocks until rank r's communication stream is idle.
  void synchronize(int rank);

 private:
  struct Rank;
  void launch_ready(int rank);

  Communicator& comm_;
  std::vector<GradBucket> buckets_;
  GradReduce reduce_;
  BucketReduction reduction_;
  BucketHome* home_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace dp
