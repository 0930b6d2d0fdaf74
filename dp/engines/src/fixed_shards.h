// fixed_shards.h — the engine of EngineOptions::shards (Note [fixed shards], fixed_shards.cpp): a
// step is DataParallel's over V devices whatever devices and processes run it, for every kind.
#pragma once

#include <span>
#include <vector>

#include "dp/engines/replica_engine.h"
#include "dp/runtime/scratch.h"

namespace dp::engines {

class FixedShards final : public ReplicaEngine {
 public:
  // `as`: the kind make_engine was asked for, whose launch rules the options were checked against
  // (check_applies) and which the engine answers to kind(). K micro-batches (accumulate) of V
  // shards are one step of K x V shards.
  FixedShards(Runtime& runtime, Model& module, const OptimizerOptions& optimizer, const EngineOptions& options,
              EngineKind as);
  ~FixedShards() override;

  EngineKind kind() const override { return as_; }
  std::string_view name() const override { return "fixed shards"; }
  // The data's ranks are the shards of a step: this process's first is shard first_rank() and it
  // takes batches_per_step() of them, V / devices per device.
  int world_size() const override { return shards_; }
  int first_rank() const override { return comm_->first_rank() * batches_per_rank_; }

 private:
  void enqueue_forward_backward_step(int r, std::span<const Batch> shards, bool sync, int slot) override;
  void check_batches(std::span<const Batch> batches, bool training) const override;
  // Every replica ends a step holding shard 0's running statistics (taken from rank 0 with the
  // gradients, or SyncBatchNorm's combined ones): nothing to broadcast before a forward.
  bool broadcasts_buffers() const override { return false; }
  bool replicas_share_buffers() const override { return true; }
  bool buffers_end_steps_as_rank0s() const override { return true; }

  struct Scratches {
    Scratch shard_grads, all_grads, saved_buffers;
  };
  EngineKind as_;
  int shards_ = 0;                  // per step: K x V
  std::vector<int> first_shard_;    // per local rank: its first shard's index in this process
  std::vector<Scratches> scratch_;  // per local rank
};

}  // namespace dp::engines
