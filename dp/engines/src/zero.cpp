// zero.cpp — ZeRO stages 1 and 2 (DeepSpeed's; stage 1 is torch's ZeroRedundancyOptimizer without
// its extra all-reduce): each global rank keeps and updates the optimizer state of its part of the parameters
// only. Its part is, in every gradient bucket, the block a reduce-scatter leaves summed on it
// (Communicator::reduce_scatter): the Reducer reduce-scatters each bucket as backward fills it
// (overlapped, as DDP's all-reduce), each rank updates its blocks (packed into one slice, so the
// optimizer's update is one call), and the ranks all-gather the updated blocks. Each rank sends
// 2(n-1)/n of the parameters per step, DDP's all-reduce volume, and keeps 1/n of the optimizer
// state (within a bucket's rounding). The sum of a block is all_reduce's on the sim ring and the
// update elementwise, so the parameters are plain DDP's bit for bit there; NCCL may sum a
// reduce-scatter in another order than its all-reduce. Clipping needs every tensor's whole
// averaged gradient (its per-tensor norms), and bf16 compression has no reduce-scatter: with either,
// the buckets are all-reduced as DDP's and each rank still updates its part only.
//
// Note [ZeRO-2's gradients]
// Stage 2 also gives up the whole gradient buffer: the model writes its gradients into bucket
// slots (BucketSlots, Model::place_gradients), the Reducer reduce-scatters each slot and copies the
// rank's block of it into the rank's packed slice of the gradients, and the slot goes to a later
// bucket. A device keeps 1/n of the gradients plus a few buckets' slots. It needs each backward's
// gradients reduced as they are written, so where they must stay whole it keeps them whole, as
// stage 1 does: under bf16 compression (above), gradient accumulation (the micro-batches add into
// the whole buffer, as DDP's no_sync) and fixed shards (each shard's gradients are kept apart and
// summed in shard order). Clipping all-reduces each slot whole (as stage 1 does), takes its
// tensors' sums of squares from it before the slot goes, and scales the rank's slice once the
// coefficient is known (GradNormClipper's pieces). The bits are stage 1's either way.
//
// Note [ZeRO's host copies]
// A lost device takes its rank's part of the optimizer state with it, and no other device holds it.
// In one process of several devices each rank therefore copies its part (its blocks' parameters and
// optimizer state, 1/n of the whole) to pinned host memory after every step, on its compute stream
// behind the step's all-gather: the device keeps 1/n of the state, the host one whole copy, twice
// (the two latest steps, alternately). A copy is marked unfinished by a host function before it is
// written and named by its step by one after, both under a mutex that the survivor holds while it
// reads, so a copy is read whole or not at all, even while the lost device's queued work still
// runs. The ranks' steps differ by at most one (a rank's next reduce-scatter needs every rank's
// all-gather of the step before), so the latest step every rank kept is in one of its two copies.
// The copies ride on the compute stream outside any captured graph (the step number is the host's),
// so the next update waits for them: the cost is one device-to-host copy of 1/n of the state per
// device per step, not overlapped. Across processes a lost process's host copies die with it: off.
#include <algorithm>
#include <array>
#include <atomic>
#include <fmt/format.h>
#include <functional>
#include <mutex>

#include "bucket_slots.h"
#include "device_update.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/scratch.h"
#include "rank_optimizers.h"

namespace dp::engines {
namespace {

// A rank's block of one bucket: `count` floats at `flat` in the whole buffer, at `packed` in its slice.
struct Block {
  std::size_t flat = 0, count = 0, packed = 0;
};

class ZeroUpdates final : public RankOptimizers, public BucketHome {
 public:
  ZeroUpdates(const DeviceGroup& group, const std::shared_ptr<ProcessGroup>& processes,
              const std::vector<GradBucket>& buckets, std::size_t params, const OptimizerOptions& optimizer,
              const EngineOptions& options)
      : group_(group),
        buckets_(buckets),
        params_(params),
        optimizer_options_(optimizer),
        // Its own communicator: the all-gathers run on the compute streams, the buckets' reductions
        // on the communication streams (one order of collectives per communicator).
        comm_(Communicator::create(group, processes)),
        trainable_{{0, params}} {
    const bool whole_gradients = options.step.clip_grad_norm > 0.0 || options.grad_reduce == GradReduce::bf16;
    reduction_ = whole_gradients ? BucketReduction::all_reduce : BucketReduction::reduce_scatter;
    slotted_ = zero_stage(options).stage == 2;  // Note [ZeRO-2's gradients]
    const int n = comm_->size();
    for (int r = 0; r < group.size(); ++r) {
      auto rank = std::make_unique<Rank>();
      const int g = comm_->first_rank() + r;
      rank->block_of.assign(buckets_.size(), -1);
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        const BlockRange block = ring_block(owned_block(g, n), buckets_[b].count, n);
        if (block.size() == 0) continue;
        rank->block_of[b] = static_cast<int>(rank->blocks.size());
        rank->blocks.push_back({buckets_[b].offset + block.begin, block.size(), rank->count});
        rank->count += block.size();
      }
      if (rank->count == 0)
        throw InvalidArgument(
            fmt::format("ZeRO: the model's {} trainable parameters in {} bucket(s) leave global "
                        "rank {} of {} nothing to update",
                        params, buckets_.size(), g, n));
      rank->update =
          std::make_unique<DeviceUpdate>(group.device(r), rank->count, optimizer, options.step.clip_grad_norm);
      rank->stream = group.device(r).create_stream();
      if (slotted_) {
        rank->slots = std::make_unique<BucketSlots>(group.device(r), buckets_, params);
        (void)rank->grads.get<float>(group.device(r), rank->count);  // written by the reductions
      }
      ranks_.push_back(std::move(rank));
    }
    if (options.zero_host_copies && processes->size() == 1 && group.size() > 1) {
      kept_ = std::make_shared<Kept>();
      const std::size_t floats_per_param = 1 + ranks_[0]->update->optimizer().state().size();
      for (const auto& rank : ranks_) {
        auto& copies = kept_->ranks.emplace_back();
        for (KeptCopy& copy : copies)
          copy.data = group.device(0).allocate_pinned(floats_per_param * rank->count * sizeof(float));
      }
    }
  }

  ~ZeroUpdates() override {
    // The engine waited for its streams, but not for a lost device's, whose queued copies and host
    // functions may still run: they keep their memory (freed here it would be written after; on
    // cuda a host function must not free pinned memory itself).
    if (!kept_ || kept_->pending.load() == 0) return;
    static std::mutex mutex;
    static auto* const outliving = new std::vector<std::shared_ptr<Kept>>();  // never freed, on purpose
    const std::lock_guard lock(mutex);
    outliving->push_back(kept_);
  }

  BucketReduction reduction() const override { return reduction_; }
  GradientSlots* gradient_slots(int r) override {
    return slotted_ ? ranks_.at(static_cast<std::size_t>(r))->slots.get() : nullptr;
  }
  BucketHome* bucket_home() override { return slotted_ ? this : nullptr; }

  void begin(int r, const Stream& compute) override { ranks_[static_cast<std::size_t>(r)]->slots->begin(compute); }
  float* bucket(int r, std::size_t b) override { return ranks_[static_cast<std::size_t>(r)]->slots->bucket(b); }
  void reduced(int r, std::size_t b, const Stream& stream) override {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    // Clipping: the bucket was all-reduced whole, so its tensors' norms are taken here, from the slot.
    if (GradNormClipper* clipper = rank.update->clipper()) {
      if (!rank.clipped_tensors) {
        clipper->set_tensors(bucket_tensors(), trainable_);
        rank.clipped_tensors = true;
      }
      clipper->sum_squares(stream, buckets_[b].offset, buckets_[b].count, rank.slots->bucket(b));
    }
    if (const int i = rank.block_of[b]; i >= 0) {
      const Block& block = rank.blocks[static_cast<std::size_t>(i)];
      stream.copy(rank.grads.get<float>(group_.device(r), rank.count) + block.packed,
                  rank.slots->bucket(b) + (block.flat - buckets_[b].offset), block.count * sizeof(float));
    }
    rank.slots->release(b, stream);
  }

  void step(int r, const Stream& stream, Model& model) override {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    Device& device = group_.device(r);
    float* params = model.params_flat();
    float* slice = rank.params.get<float>(device, rank.count);
    float* slice_grads = rank.grads.get<float>(device, rank.count);
    if (!slotted_) {
      rank.update->clip(stream, model, trainable_);
    } else if (GradNormClipper* clipper = rank.update->clipper()) {
      clipper->coefficient(stream);  // from the sums of squares the reductions took (reduced())
      clipper->scale(stream, slice_grads, rank.count);
    }
    const float* grads = slotted_ ? nullptr : model.grads_flat();
    for (const Block& b : rank.blocks) {
      stream.copy(slice + b.packed, params + b.flat, b.count * sizeof(float));
      if (!slotted_) stream.copy(slice_grads + b.packed, grads + b.flat, b.count * sizeof(float));
    }
    rank.update->optimizer().step(stream, slice, slice_grads);
    for (const Block& b : rank.blocks) stream.copy(params + b.flat, slice + b.packed, b.count * sizeof(float));
    gather(r, stream, params);
  }

  Optimizer& optimizer(int r) const override { return ranks_.at(static_cast<std::size_t>(r))->update->optimizer(); }
  bool clips() const override { return ranks_[0]->update->clips(); }
  std::optional<float> last_grad_norm() const override { return ranks_[0]->update->last_grad_norm(); }

  void freeze(const std::vector<Optimizer::ParamRange>& frozen) override {
    trainable_ = trainable_ranges(params_, frozen);
    frozen_ = frozen;
    for (auto& rank : ranks_) rank->update->optimizer().freeze(in_slice(*rank, frozen));
  }
  void exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) override {
    (void)trainable_ranges(params_, ranges);  // the bounds check, before any rank
    no_decay_ = ranges;
    for (auto& rank : ranks_) rank->update->optimizer().exclude_from_weight_decay(in_slice(*rank, ranges));
  }

  // Every state buffer of every rank's slice put at its blocks' places in a zeroed whole buffer (a
  // parameter in no bucket is frozen: plain DDP's state is zero there too) and gathered.
  std::vector<Optimizer*> whole() override {
    whole_ = make_optimizer(group_.device(0), params_, optimizer_options_);
    whole_->freeze(frozen_);
    whole_->exclude_from_weight_decay(no_decay_);
    const std::size_t buffers = ranks_[0]->update->optimizer().state().size();
    for (std::size_t k = 0; k < buffers; ++k) {
      float* whole = whole_->state()[k].data;
      run([&](int r) {
        Rank& rank = *ranks_[static_cast<std::size_t>(r)];
        float* all = rank.whole.get<float>(group_.device(r), params_);
        kernels::fill(rank.stream, all, static_cast<kernels::index_t>(params_), 0.0f);
        const float* state = rank.update->optimizer().state()[k].data;
        for (const Block& b : rank.blocks) rank.stream.copy(all + b.flat, state + b.packed, b.count * sizeof(float));
        gather(r, rank.stream, all);
        if (r == 0) rank.stream.copy(whole, all, params_ * sizeof(float));
        rank.stream.synchronize();
      });
    }
    whole_->set_steps(ranks_[0]->update->optimizer().steps());
    for (auto& rank : ranks_) rank->whole = Scratch{};  // the gather's buffers, idle now
    return {whole_.get()};
  }
  void release_whole() override { whole_.reset(); }

  void whole_loaded() override {
    if (!whole_) return;
    const std::size_t buffers = whole_->state().size();
    group_.run([&](int r) {
      Rank& rank = *ranks_[static_cast<std::size_t>(r)];
      Optimizer& mine = rank.update->optimizer();
      for (std::size_t k = 0; k < buffers; ++k)
        for (const Block& b : rank.blocks)
          rank.stream.copy(mine.state()[k].data + b.packed, whole_->state()[k].data + b.flat, b.count * sizeof(float));
      rank.stream.synchronize();
      mine.set_steps(whole_->steps());
    });
    whole_.reset();
  }

  void abort() override { comm_->abort(); }

  std::size_t gradient_bytes_beside() const override {
    std::size_t most = 0;
    for (const auto& rank : ranks_)
      most = std::max(most, rank->grads.size() + (rank->slots ? rank->slots->bytes() : 0));
    return most;
  }
  bool keeps_whole_gradients() const override { return !slotted_; }
  bool keeps() const override { return kept_ != nullptr; }
  void keep(int r, const Stream& stream, const Model& model, std::int64_t step) override {
    if (!kept_) return;
    const Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    KeptCopy& copy = kept_->ranks[static_cast<std::size_t>(r)][static_cast<std::size_t>(step % 2)];
    Kept* kept = kept_.get();
    kept->pending += 2;
    stream.launch_host_func([kept, &copy] {
      const std::lock_guard lock(kept->mutex);
      copy.step = -1;
      --kept->pending;
    });
    auto* host = copy.data.as<float>();
    const float* params = model.params_flat();
    for (const Block& b : rank.blocks) stream.copy(host + b.packed, params + b.flat, b.count * sizeof(float));
    std::size_t at = rank.count;
    for (const Optimizer::StateBuffer& state : rank.update->optimizer().state()) {
      stream.copy(host + at, state.data, rank.count * sizeof(float));
      at += rank.count;
    }
    stream.launch_host_func([kept, &copy, step] {
      const std::lock_guard lock(kept->mutex);
      copy.step = step;
      --kept->pending;
    });
  }

  std::vector<std::int64_t> kept_steps() const override {
    if (!kept_) return {};
    const std::lock_guard lock(kept_->mutex);
    std::vector<std::int64_t> steps;
    for (const KeptCopy& copy : kept_->ranks[0])
      if (copy.step >= 0 &&
          std::ranges::all_of(kept_->ranks, [&](const auto& copies) { return find(copies, copy.step); }))
        steps.push_back(copy.step);
    std::ranges::sort(steps, std::greater<>());
    return steps;
  }

  Optimizer* restore_kept(std::int64_t step, int r, Model& model) override {
    Device& device = group_.device(r);
    whole_ = make_optimizer(device, params_, optimizer_options_);
    whole_->freeze(frozen_);
    whole_->exclude_from_weight_decay(no_decay_);
    const Stream writer = device.create_stream();
    const std::vector<Optimizer::StateBuffer> state = whole_->state();
    for (const Optimizer::StateBuffer& buffer : state)
      kernels::fill(writer, buffer.data, static_cast<kernels::index_t>(params_), 0.0f);
    float* params = model.params_flat();
    // Held until the copies ran: the lost device's queued work may be about to rewrite a copy.
    const std::lock_guard lock(kept_->mutex);
    for (std::size_t q = 0; q < ranks_.size(); ++q) {
      const Rank& rank = *ranks_[q];
      const KeptCopy* copy = find(kept_->ranks[q], step);
      if (!copy) throw Error(fmt::format("ZeRO: rank {} kept no copy of step {}", q, step));
      const auto* host = copy->data.as<const float>();
      for (const Block& b : rank.blocks) {
        writer.copy(params + b.flat, host + b.packed, b.count * sizeof(float));
        for (std::size_t k = 0; k < state.size(); ++k)
          writer.copy(state[k].data + b.flat, host + (k + 1) * rank.count + b.packed, b.count * sizeof(float));
      }
    }
    writer.synchronize();
    whole_->set_steps(step);
    return whole_.get();
  }

 private:
  // A rank's part of the state after one step, in host memory (Note [ZeRO's host copies]): its
  // blocks' parameters, then each optimizer state buffer's, packed as its slice.
  struct KeptCopy {
    PinnedBuffer data;
    std::int64_t step = -1;  // -1: none, or being written
  };
  struct Kept {
    std::mutex mutex;
    std::vector<std::array<KeptCopy, 2>> ranks;
    std::atomic<int> pending{0};  // host functions enqueued and not yet run
  };
  static const KeptCopy* find(const std::array<KeptCopy, 2>& copies, std::int64_t step) {
    for (const KeptCopy& copy : copies)
      if (copy.step == step) return &copy;
    return nullptr;
  }

  struct Rank {
    std::vector<Block> blocks;  // in bucket order
    std::vector<int> block_of;  // per bucket: its block's index in `blocks`, or -1 (none)
    std::size_t count = 0;      // floats in all its blocks
    std::unique_ptr<DeviceUpdate> update;
    Scratch params, grads, whole;        // its slice of the parameters and gradients; a whole state buffer
    Stream stream;                       // checkpoints' gathers
    std::unique_ptr<BucketSlots> slots;  // stage 2: where the backward writes the gradients
    bool clipped_tensors = false;        // stage 2: the clipper knows the tensors
  };

  // The buckets' tensors, in parameter order.
  std::vector<Optimizer::ParamRange> bucket_tensors() const {
    std::vector<Optimizer::ParamRange> tensors;
    for (const GradBucket& bucket : buckets_) {
      std::size_t end = bucket.offset + bucket.count;  // added in reverse order, each before the last
      for (const std::size_t size : bucket.sizes) {
        end -= size;
        tensors.push_back({end, size});
      }
    }
    std::ranges::sort(tensors, {}, &Optimizer::ParamRange::offset);
    return tensors;
  }

  // Every rank's blocks of `data` (the whole flat buffer) into every rank's, bucket by bucket.
  void gather(int r, const Stream& stream, float* data) {
    if (comm_->size() == 1) return;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const CollectivePurpose purpose(fmt::format("ZeRO parameters of bucket {}", b));
      comm_->all_gather_blocks(r, stream, data + buckets_[b].offset, buckets_[b].count);
    }
  }

  // Each of the whole buffer's `ranges`' parts inside the rank's blocks, at their places in its slice.
  static std::vector<Optimizer::ParamRange> in_slice(const Rank& rank,
                                                     const std::vector<Optimizer::ParamRange>& ranges) {
    std::vector<Optimizer::ParamRange> mine;
    for (const Block& b : rank.blocks)
      for (const Optimizer::ParamRange& f : ranges) {
        const std::size_t lo = std::max(f.offset, b.flat), hi = std::min(f.offset + f.count, b.flat + b.count);
        if (lo < hi) mine.push_back({b.packed + (lo - b.flat), hi - lo});
      }
    return mine;
  }

  // task(rank) on every rank; a failure anywhere aborts the gathers its peers may wait in.
  void run(const std::function<void(int)>& task) {
    try {
      group_.run([&](int r) {
        try {
          task(r);
        } catch (...) {
          comm_->abort();
          throw;
        }
      });
    } catch (...) {
      comm_->abort();
      throw;
    }
  }

  const DeviceGroup& group_;
  std::vector<GradBucket> buckets_;
  std::size_t params_;
  OptimizerOptions optimizer_options_;
  std::unique_ptr<Communicator> comm_;
  BucketReduction reduction_ = BucketReduction::reduce_scatter;
  bool slotted_ = false;                                  // stage 2: no whole gradient buffer (BucketSlots)
  std::vector<Optimizer::ParamRange> trainable_;          // of the whole buffer (clipping)
  std::vector<Optimizer::ParamRange> frozen_, no_decay_;  // of the whole buffer: the whole optimizer's
  std::unique_ptr<Optimizer> whole_;                      // while a checkpoint asks for it
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::shared_ptr<Kept> kept_;  // null: no host copies (several processes, or one device)
};

}  // namespace

std::unique_ptr<RankOptimizers> make_zero_optimizers(const DeviceGroup& group,
                                                     const std::shared_ptr<ProcessGroup>& processes,
                                                     const std::vector<GradBucket>& buckets, std::size_t params,
                                                     const OptimizerOptions& optimizer, const EngineOptions& options) {
  return std::make_unique<ZeroUpdates>(group, processes, buckets, params, optimizer, options);
}

}  // namespace dp::engines
