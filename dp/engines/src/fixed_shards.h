// fixed_shards.h — the engine of EngineOptions::shards (Note [fixed shards], fixed_shards.cpp): a
// step is DataParallel's over V devices whatever devices and processes run it, for every kind.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "dp/engines/replica_engine.h"
#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"

namespace dp::engines {

class InputRing;

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
  // The ordered sum of the gathered shards' gradients (Note [fixed shards]).
  void enqueue_reduction(int r, int slot) override;
  // Shadow shards (EngineOptions::shadow_shards, shadow_shards.cpp): the steps they check, and the check.
  bool verifies_step(std::span<const Batch> batches, int slot) override;
  void verify_step(int slot) override;
  void check_batches(std::span<const Batch> batches, bool training) const override;
  // Every replica ends a step holding shard 0's running statistics (taken from rank 0 with the
  // gradients, or SyncBatchNorm's combined ones): nothing to broadcast before a forward.
  bool broadcasts_buffers() const override { return false; }
  bool replicas_share_buffers() const override { return true; }
  bool buffers_end_steps_as_rank0s() const override { return true; }

  // Rank r's block of the shards' all-gather (its shards' gradients, then its buffers) and the
  // gathered blocks of every rank.
  struct Layout {
    std::size_t n = 0, most = 0, buffer_floats = 0, block = 0;
    float* own = nullptr;
    float* all = nullptr;
    // Where global shard s's gradient lies among the gathered blocks.
    const float* shard_grads(const FixedShards& engine, int s) const;
  };
  Layout layout(int r);
  // Local rank r's first shard, as a global shard index.
  int first_shard_of(int r) const;
  // Global shard `shard`'s forward (then `after_forward`), loss and backward on rank r's replica,
  // its gradient left in the replica's gradients; returns the loss (device memory).
  const float* enqueue_shard(int r, int shard, int shard_size, Inputs inputs, const std::int64_t* targets,
                             const std::function<void()>& after_forward);

  // This step's shadow check (shadow_shards.cpp): the shard (a global index) computed twice, by
  // its owner and its twin (local ranks of this process), and the referee that recomputes it on a
  // mismatch (-1: the process has no third device).
  struct Shadow {
    std::int64_t step = 0;
    int shard = 0, owner = 0, index = 0, twin = 0, referee = -1;  // index: among the owner's shards
    Batch batch;  // the shard's host batch, alive while submit_step runs
  };
  struct ShadowRank {
    std::unique_ptr<InputRing> ring;  // the shard's inputs, on the twin and the referee
    Scratch fingerprint;              // device: its gradient's fingerprint
    PinnedBuffer out;                 // host: the fingerprint, then the loss
    Event ready;                      // `out` written
  };
  // Checks the layout and makes each rank's ShadowRank.
  void start_shadow_shards(Runtime& runtime);
  // The checked shard's batch into rank r's ShadowRank ring, slot `slot` (the twin's, the referee's).
  void push_shadow_batch(int r, int slot, const Batch& batch);
  // On the twin, before the all-gather: the checked shard recomputed and fingerprinted.
  void enqueue_shadow(int r, int slot);
  // Rank r's recomputation of `check`'s shard (twin or referee) from its pushed batch, its gradients
  // zeroed first, then enqueue_shadow_fingerprint.
  void enqueue_shadow_shard(int r, int slot, const Shadow& check);
  // Rank r's fingerprint of a shard's gradient `grads` and its loss (device memory) into its
  // ShadowRank's `out`, `ready` recorded: the owner's as computed, the twin's and referee's recomputed.
  void enqueue_shadow_fingerprint(int r, const float* grads, const float* loss);
  struct Result {
    std::uint64_t grads = 0;
    std::uint32_t loss = 0;  // the float's bits
    bool operator==(const Result&) const = default;
  };
  // Rank r's ShadowRank result, waited for.
  Result shadow_result(int r) const;

  struct Scratches {
    Scratch shard_grads, all_grads, saved_buffers;
  };
  EngineKind as_;
  int shards_ = 0;                        // per step: K x V
  std::vector<int> first_shard_;          // per local rank: its first shard's index in this process
  std::vector<Scratches> scratch_;        // per local rank
  std::optional<Shadow> shadow_;          // during a checked step whose shard this process owns
  std::vector<ShadowRank> shadow_ranks_;  // per local rank, with shadow shards
};

}  // namespace dp::engines
