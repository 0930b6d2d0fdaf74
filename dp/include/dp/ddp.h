// dp/ddp.h — torch.nn.parallel.DistributedDataParallel semantics in one process: one persistent
// replica and optimizer per device, parameters and buffers broadcast from rank 0 at construction,
// buffers broadcast before every forward (broadcast_buffers), gradients averaged by bucketed
// all-reduce launched on a communication stream as soon as each bucket's gradients are ready,
// overlapping the rest of backward; the optimizers wait for all buckets.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/collectives.h"
#include "dp/device_group.h"
#include "dp/loss.h"
#include "dp/model.h"
#include "dp/optim.h"

namespace dp {

struct DdpOptions {
  std::optional<std::vector<int>> device_ids;  // unset: every device; rank = position
  double bucket_cap_mb = 25.0;                 // MiB, as torch's bucket_cap_mb
  double first_bucket_mb = 1.0;                // torch's _DEFAULT_FIRST_BUCKET_BYTES
  bool broadcast_buffers = true;
  // Debug: after every step, verify that all replicas' parameters are bitwise identical.
  bool check_replicas = false;
};

// A bucket: a contiguous slice [offset, offset+count) of the flat gradient buffer.
struct GradBucket {
  std::size_t offset = 0;
  std::size_t count = 0;
  std::vector<std::string> parameters;  // in the order they were added (reverse parameter order)
};

// torch's steady-state assignment (the rebuilt buckets after the first iteration): parameters in
// reverse order; a bucket closes once its size reaches the current limit, the first limit being
// first_bucket_mb and every later one bucket_cap_mb.
std::vector<GradBucket> assign_buckets(const std::vector<TensorRef>& parameters, double first_bucket_mb,
                                       double bucket_cap_mb);

// One rank's share of a step: host inputs (size x input_shape floats) and int64 targets.
struct RankBatch {
  const float* inputs = nullptr;
  const std::int64_t* targets = nullptr;
  int size = 0;
};

class DistributedDataParallel {
 public:
  // `module` lives on device_ids[0] and becomes rank 0's replica; its values are broadcast.
  DistributedDataParallel(Runtime& runtime, Model& module, const SgdOptions& sgd, DdpOptions options = {});
  ~DistributedDataParallel();

  int world_size() const { return group_.size(); }
  const std::vector<int>& device_ids() const { return group_.device_ids(); }
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  Model& replica(int rank) const;
  Sgd& optimizer(int rank) const;

  // zero_grad + forward_backward + step. batches.size() == world_size(). Returns the loss averaged
  // over ranks (each rank's loss is the mean over its own batch).
  float train_step(const std::vector<RankBatch>& batches);

  // The pieces, for gradient accumulation: gradients of loss * loss_scale are accumulated; they are
  // averaged across ranks unless inside a no_sync() scope.
  void zero_grad();
  float forward_backward(const std::vector<RankBatch>& batches, float loss_scale = 1.0f);
  void step();

  // Steps return once the loss is known; the optimizer update may still run on the devices.
  // Call this before reading parameters from another stream (checkpoints, evaluation).
  void synchronize();

  // While alive, backward accumulates locally without communication (torch's ddp.no_sync()).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(&ddp) { ddp.sync_ = false; }
    ~NoSync() {
      if (ddp_) ddp_->sync_ = true;
    }
    NoSync(NoSync&& other) noexcept : ddp_(other.ddp_) { other.ddp_ = nullptr; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    DistributedDataParallel* ddp_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Throws Error naming the first parameter and rank whose values differ from rank 0's.
  void check_replicas_identical();

 private:
  struct Rank;
  void broadcast_from_rank0(bool parameters, bool buffers);
  void launch_ready_buckets(Rank& rank, int r);

  Runtime& runtime_;
  DeviceGroup group_;
  DdpOptions options_;
  std::unique_ptr<Communicator> comm_;
  std::vector<GradBucket> buckets_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  bool sync_ = true;
  bool require_forward_param_sync_ = true;
};

}  // namespace dp
