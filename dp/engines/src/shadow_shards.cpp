// shadow_shards.cpp — fixed shards' shadow shards (EngineOptions::shadow_shards): every K steps one
// shard computed twice, on two devices of its process, and compared bit for bit before the update.
#include <array>
#include <bit>
#include <cstring>
#include <fmt/format.h>

#include "dp/kernels/fingerprint.h"
#include "dp/runtime/error.h"
#include "fixed_shards.h"
#include "replica_rank.h"

namespace dp::engines {

// Note [shadow shards]
// A replica check (check_replicas) cannot see a wrong result of a step's arithmetic, a flipped bit
// in a GEMM's output: the wrong gradient is summed into every replica's update alike. Fixed shards
// make a shard's gradient a function of its samples and the step's parameters alone (Note [fixed
// shards]), the same bits on any device. So every K steps one shard is computed again by another
// device of its owner's process (its twin: the next one, or on uneven shares the next that holds
// fewer shards than the most), after the twin's own shards and before the all-gather,
// so that the recompute runs while the other ranks compute theirs; the owner fingerprints its
// gradient (kernels::fingerprint) as it keeps it for the all-gather, the twin its recomputed one,
// and the caller compares the two fingerprints and the two losses. Check c = step / K covers global
// rank c mod P's shard number (c / P) mod (its shard count): every device is checked once every P
// checks, every shard once every V. The step is eager and the caller waits for the two fingerprints
// (not for the all-gather) before any rank enqueues its reduction and update, so on a mismatch
// nothing has been updated anywhere. A third device of the process (the referee) then
// recomputes the shard: the one it disagrees with computes wrong and is dropped as a lost device
// (DeviceLost: under --shards the survivors redo the step, as after any lost device). Without a
// third device, or where the referee agrees with neither, ReplicaMismatch names both. Every process
// learns each verdict from one all-gather of three integers per check. Cost per check: one shard's
// forward and backward more on the twin (1/V of a step's compute, 1/(V K) per step; on a GPU the
// twin's V/P + 1 shards set the step's pace), two fingerprints, and the host's wait between the
// halves (a graph cannot wait for the host: a checked step runs eagerly).

void FixedShards::start_shadow_shards(Runtime& runtime) {
  if (group_.size() < 2)
    throw InvalidArgument(
        "shadow shards recompute a shard on a second device of its process, but this process drives one device");
  if (options_.sync_batchnorm)
    throw InvalidArgument(
        "shadow shards and sync_batchnorm: one shard's forward alone cannot join SyncBatchNorm's collectives");
  for (int r = 0; r < group_.size(); ++r) {
    Device& device = group_.device(r);
    ShadowRank mine;
    mine.ring = std::make_unique<InputRing>(device.create_stream());
    mine.out = runtime.allocate_pinned(sizeof(std::uint64_t) + sizeof(float));
    mine.ready = device.create_event();
    shadow_ranks_.push_back(std::move(mine));
  }
}

bool FixedShards::verifies_step(std::span<const Batch> batches, int slot) {
  shadow_.reset();
  const int every = options_.shadow_shards;
  if (every <= 0) return false;
  const std::int64_t step = rank(0).optimizer->steps() + 1;
  if (step % every != 0) return false;
  const std::int64_t check = step / every;
  const int ranks = comm_->size();
  const int owner = static_cast<int>(check % ranks) - comm_->first_rank();
  if (owner < 0 || owner >= group_.size()) return true;  // another process's check: it learns the verdict
  const int local = group_.size();
  const auto count = [&](int r) {
    const auto at = static_cast<std::size_t>(r);
    return (r + 1 < local ? first_shard_[at + 1] : batches_per_step()) - first_shard_[at];
  };
  Shadow shadow;
  shadow.step = step;
  shadow.owner = owner;
  shadow.index = static_cast<int>((check / ranks) % count(owner));
  shadow.shard = first_shard_of(owner) + shadow.index;
  // The twin: the first device after the owner that holds fewer shards than the first one (the
  // most), where the layout is uneven (a lost device's survivors): its extra shard then takes no
  // longer than the others' own. Else the next device; the referee is the next after both.
  shadow.twin = (owner + 1) % local;
  for (int k = 1; k < local; ++k)
    if (const int r = (owner + k) % local; count(r) < count(0)) {
      shadow.twin = r;
      break;
    }
  shadow.referee = -1;
  for (int k = 1; k < local && shadow.referee < 0; ++k)
    if (const int r = (owner + k) % local; r != shadow.twin) shadow.referee = r;
  shadow.batch = batches[static_cast<std::size_t>(first_shard_[static_cast<std::size_t>(owner)] + shadow.index)];
  push_shadow_batch(shadow.twin, slot, shadow.batch);
  shadow_ = shadow;
  return true;
}

void FixedShards::push_shadow_batch(int r, int slot, const Batch& batch) {
  const Rank& mine = rank(r);
  push_batch(*shadow_ranks_[static_cast<std::size_t>(r)].ring, group_.device(r), slot, batch, sample_size(*mine.model),
             mine.step_done[static_cast<std::size_t>(slot)]);
}

void FixedShards::enqueue_shadow(int r, int slot) { enqueue_shadow_shard(r, slot, *shadow_); }

void FixedShards::enqueue_shadow_shard(int r, int slot, const Shadow& check) {
  Rank& mine = rank(r);
  Model& m = *mine.model;
  const InputRing& ring = *shadow_ranks_[static_cast<std::size_t>(r)].ring;
  ring.acquire(slot, mine.compute);
  m.zero_grad(mine.compute);
  const float* loss = enqueue_shard(r, check.shard, check.batch.size, ring.inputs(slot), ring.targets(slot), [] {});
  enqueue_shadow_fingerprint(r, m.grads_flat(), loss);
}

void FixedShards::enqueue_shadow_fingerprint(int r, const float* grads, const float* loss) {
  Rank& mine = rank(r);
  ShadowRank& shadow = shadow_ranks_[static_cast<std::size_t>(r)];
  auto* fingerprint = shadow.fingerprint.get<std::uint64_t>(group_.device(r), 1);
  kernels::fingerprint(mine.compute, static_cast<kernels::index_t>(mine.model->param_count()),
                       reinterpret_cast<const std::uint32_t*>(grads), 0, fingerprint, false);
  mine.compute.copy(shadow.out.as<std::uint64_t>(), fingerprint, sizeof(std::uint64_t));
  mine.compute.copy(shadow.out.as<std::uint64_t>() + 1, loss, sizeof(float));
  mine.compute.record(shadow.ready);
}

FixedShards::Result FixedShards::shadow_result(int r) const {
  const ShadowRank& shadow = shadow_ranks_[static_cast<std::size_t>(r)];
  shadow.ready.synchronize();
  Result out;
  out.grads = shadow.out.as<std::uint64_t>()[0];
  std::memcpy(&out.loss, shadow.out.as<std::uint64_t>() + 1, sizeof(out.loss));
  return out;
}

void FixedShards::verify_step(int slot) {
  const std::optional<Shadow> shadow = shadow_;
  shadow_.reset();
  const auto name = [&](int r) {
    const int id = group_.device_ids()[static_cast<std::size_t>(r)];
    return processes_->size() > 1 ? fmt::format("device {} of process {}", id, processes_->rank())
                                  : fmt::format("device {}", id);
  };
  // What this process found: 0 nothing wrong (or not its check), 1 a device that computes wrong
  // (its dN, and its id), 2 a mismatch no referee settled (the two devices' dN).
  std::array<std::int64_t, 3> verdict{0, -1, -1};
  std::string message;
  int faulty = -1;
  if (shadow) {
    const Result owner = shadow_result(shadow->owner);
    const Result twin = shadow_result(shadow->twin);
    if (!(twin == owner)) {
      message = fmt::format(
          "silent corruption: shard {} of step {} computed by {} and again by {} differs (gradient fingerprints "
          "{:016x} and {:016x}, losses {} and {})",
          shadow->shard, shadow->step, name(shadow->owner), name(shadow->twin), owner.grads, twin.grads,
          std::bit_cast<float>(owner.loss), std::bit_cast<float>(twin.loss));
      if (shadow->referee >= 0) {
        const int referee = shadow->referee;
        group_.run_on(referee, [&] {
          push_shadow_batch(referee, slot, shadow->batch);
          enqueue_shadow_shard(referee, slot, *shadow);
        });
        const Result third = shadow_result(referee);
        faulty = third == owner ? shadow->twin : third == twin ? shadow->owner : -1;
        message += faulty >= 0
                       ? fmt::format(
                             "; {} recomputed it as {} did: {} computes wrong and is dropped before the "
                             "step's update",
                             name(referee), name(faulty == shadow->twin ? shadow->owner : shadow->twin), name(faulty))
                       : fmt::format("; {} recomputed it and agrees with neither", name(referee));
      } else {
        message += "; no third device in this process can tell which of the two computes wrong";
      }
      verdict = faulty >= 0 ? std::array<std::int64_t, 3>{1, fault_device(faulty),
                                                          group_.device_ids()[static_cast<std::size_t>(faulty)]}
                            : std::array<std::int64_t, 3>{2, fault_device(shadow->owner), fault_device(shadow->twin)};
    }
  }
  std::vector<std::array<std::int64_t, 3>> verdicts{verdict};
  if (processes_->size() > 1) verdicts = processes_->all_gather(verdict);
  for (std::size_t p = 0; p < verdicts.size(); ++p) {
    const auto& [kind, first, second] = verdicts[p];
    if (kind == 0) continue;
    const bool mine = static_cast<int>(p) == processes_->rank() && shadow;
    if (kind == 1) {
      if (!mine)
        throw DeviceLost(-1, fmt::format("silent corruption: process {} found that its device d{} computes wrong in "
                                         "step {} (a shadow shard); nothing was updated",
                                         p, first, rank(0).optimizer->steps() + 1));
      group_.device(faulty).lose(message);
      throw DeviceLost(static_cast<int>(second), message);
    }
    throw ReplicaMismatch(
        (mine ? message
              : fmt::format("silent corruption: process {} found a shadow shard of step {} differing between devices "
                            "d{} and d{}",
                            p, rank(0).optimizer->steps() + 1, first, second)) +
        "; nothing after this step is saved");
  }
}

}  // namespace dp::engines
