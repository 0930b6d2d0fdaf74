// ring_communicator.cpp — collectives on simulated devices. Each call becomes a task on the rank's
// stream; when the tasks of all ranks run, they meet (like NCCL kernels that wait for their peers)
// and move data in ring steps, each step a counted device-to-device copy into the receiver's
// staging memory followed by its reduction, with a barrier between steps.
#include <condition_variable>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <mutex>
#include <vector>

#include "backend.h"
#include "dp/scratch.h"

namespace dp::detail {
namespace {

struct RankCall {
  void* data = nullptr;        // all_reduce / broadcast / reduce: the buffer; all_gather: recv
  const void* send = nullptr;  // all_gather only
  float* staging = nullptr;    // receiver-side scratch on the rank's device
};

// One collective call: the ranks' buffers and a reusable barrier for its steps.
struct Round {
  std::vector<RankCall> calls;
  int registered = 0;
  int waiting = 0;
  std::uint64_t phase = 0;
  int left = 0;
  std::condition_variable cv;
};

class RingCommunicator final : public Communicator {
 public:
  explicit RingCommunicator(const DeviceGroup& group) : group_(group), calls_made_(group.size(), 0) {
    staging_.resize(static_cast<std::size_t>(group.size()));
  }
  ~RingCommunicator() override {
    // Tasks of this communicator may still sit in the ranks' streams: fail them rather than let
    // them wait for peers that will never come, then let them run before the state they use dies.
    abort();
    for (int r = 0; r < size(); ++r) {
      try {
        group_.device(r).synchronize();
      } catch (...) {
      }
    }
  }

  int size() const override { return group_.size(); }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    check(rank, stream, data, count * sizeof(float), "all_reduce");
    const int n = size();
    float* staging = staging_for(rank, (count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n));
    // Counted when issued, like copies: this rank receives every chunk but its own once in
    // reduce-scatter, and every chunk but its right neighbour's once in all-gather.
    const auto chunk_bytes = [count, n](int c) {
      return (count * static_cast<std::size_t>(c + 1) / static_cast<std::size_t>(n) -
              count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n)) *
             sizeof(float);
    };
    const int left = (rank + n - 1) % n;
    for (int s = 0; s < n - 1; ++s) {
      count_receive(left, rank, chunk_bytes(((rank - 1 - s) % n + n) % n));
      count_receive(left, rank, chunk_bytes(((rank - s) % n + n) % n));
    }
    enqueue(rank, stream, "all_reduce", RankCall{data, nullptr, staging}, [this, count, op, n](int r, Round& round) {
      const int left = (r + n - 1) % n;
      auto chunk = [&](int c) {
        const std::size_t begin = count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n);
        const std::size_t end = count * static_cast<std::size_t>(c + 1) / static_cast<std::size_t>(n);
        return std::pair{begin, end};
      };
      float* mine = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].data);
      const float* theirs = static_cast<const float*>(round.calls[static_cast<std::size_t>(left)].data);
      float* stage = round.calls[static_cast<std::size_t>(r)].staging;
      // Reduce-scatter: after step s, rank r holds the sum of s+2 contributions to chunk r-1-s.
      for (int s = 0; s < n - 1; ++s) {
        const auto [begin, end] = chunk(((r - 1 - s) % n + n) % n);
        receive(stage, theirs + begin, (end - begin) * sizeof(float));
        for (std::size_t i = begin; i < end; ++i) mine[i] += stage[i - begin];
        step_barrier(round);
      }
      // All-gather: pass the finished chunks around the ring.
      for (int s = 0; s < n - 1; ++s) {
        const auto [begin, end] = chunk(((r - s) % n + n) % n);
        receive(mine + begin, theirs + begin, (end - begin) * sizeof(float));
        step_barrier(round);
      }
      if (op == ReduceOp::avg) {
        const float scale = 1.0f / static_cast<float>(n);
        for (std::size_t i = 0; i < count; ++i) mine[i] *= scale;
      }
    });
  }

  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    check(rank, stream, data, bytes, "broadcast");
    check_root(root);
    const int n = size();
    if (rank != root) count_receive((rank + n - 1) % n, rank, bytes);  // the chain: from the previous rank
    enqueue(rank, stream, "broadcast", RankCall{data, nullptr, nullptr}, [this, bytes, root, n](int r, Round& round) {
      // A chain from the root: at step s, rank root+s+1 copies from rank root+s.
      for (int s = 0; s < n - 1; ++s) {
        const int receiver = (root + s + 1) % n, sender = (root + s) % n;
        if (r == receiver)
          receive(round.calls[static_cast<std::size_t>(r)].data, round.calls[static_cast<std::size_t>(sender)].data,
                  bytes);
        step_barrier(round);
      }
    });
  }

  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    check(rank, stream, data, count * sizeof(float), "reduce");
    check_root(root);
    const int n = size();
    float* staging = rank == root ? staging_for(rank, count) : nullptr;
    if (rank != root) count_receive(rank, root, count * sizeof(float));  // the root reads every buffer
    enqueue(rank, stream, "reduce", RankCall{data, nullptr, staging}, [this, count, root, n](int r, Round& round) {
      // The root receives every other rank's buffer in rank order and adds it (its own first).
      if (r == root) {
        float* mine = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].data);
        float* stage = round.calls[static_cast<std::size_t>(r)].staging;
        for (int other = 0; other < n; ++other) {
          if (other == root) continue;
          receive(stage, round.calls[static_cast<std::size_t>(other)].data, count * sizeof(float));
          for (std::size_t i = 0; i < count; ++i) mine[i] += stage[i];
        }
      }
      step_barrier(round);  // nobody reuses its buffer before the root has read it
    });
  }

  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    check(rank, stream, send, count * sizeof(float), "all_gather send");
    check(rank, stream, recv, count * static_cast<std::size_t>(size()) * sizeof(float), "all_gather recv");
    const int n = size();
    for (int s = 0; s < n - 1; ++s) count_receive((rank + n - 1) % n, rank, count * sizeof(float));
    enqueue(rank, stream, "all_gather", RankCall{recv, send, nullptr}, [this, count, n](int r, Round& round) {
      const int left = (r + n - 1) % n;
      float* mine = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].data);
      const float* theirs = static_cast<const float*>(round.calls[static_cast<std::size_t>(left)].data);
      std::memcpy(mine + static_cast<std::size_t>(r) * count, round.calls[static_cast<std::size_t>(r)].send,
                  count * sizeof(float));
      step_barrier(round);
      for (int s = 0; s < n - 1; ++s) {
        const std::size_t block = static_cast<std::size_t>(((r - 1 - s) % n + n) % n) * count;
        receive(mine + block, theirs + block, count * sizeof(float));
        step_barrier(round);
      }
    });
  }

  void abort() override {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    for (auto& [id, round] : rounds_) round->cv.notify_all();
  }

 private:
  using Body = std::function<void(int rank, Round& round)>;

  void check(int rank, const Stream& stream, const void* ptr, std::size_t bytes, const char* op) {
    if (rank < 0 || rank >= size()) throw InvalidArgument(fmt::format("{}: rank {} of {}", op, rank, size()));
    if (stream.device() != group_.device_ids()[static_cast<std::size_t>(rank)])
      throw DeviceMismatch(fmt::format("{}: rank {} is device {} but the stream is on device {}", op, rank,
                                       group_.device_ids()[static_cast<std::size_t>(rank)], stream.device()));
    if (bytes) Access::stream(stream).check_access(ptr, bytes, op);
  }
  void check_root(int root) const {
    if (root < 0 || root >= size()) throw InvalidArgument(fmt::format("collective root {} of {} ranks", root, size()));
  }

  // Receiver-side scratch, grown on the calling worker (allocation is device-memory accounting).
  // Queued collectives may still use an outgrown buffer, and freeing device memory waits for the
  // device to be idle -- which a collective waiting for its peers is not: outgrown buffers are kept
  // until the communicator dies (growth happens a handful of times, up to the largest bucket).
  float* staging_for(int rank, std::size_t floats) {
    std::lock_guard lock(staging_mutex_);
    return staging_[static_cast<std::size_t>(rank)].get<float>(group_.device(rank), floats, &retired_);
  }

  // A device-to-device copy performed by the receiver's stream (counted when the call was issued).
  static void receive(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void count_receive(int from_rank, int to_rank, std::size_t bytes) {
    if (bytes == 0) return;
    Access::runtime(group_.runtime())
        .count_copy(group_.device_ids()[static_cast<std::size_t>(from_rank)],
                    group_.device_ids()[static_cast<std::size_t>(to_rank)], bytes);
  }

  void enqueue(int rank, const Stream& stream, const char* name, RankCall call, Body body) {
    std::uint64_t id;
    {
      std::lock_guard lock(mutex_);
      if (aborted_) throw Error(fmt::format("{}: communicator was aborted", name));
      id = calls_made_[static_cast<std::size_t>(rank)]++;
    }
    auto task = [this, id, rank, call, body = std::move(body), name] {
      Round& round = join(id, rank, call, name);
      body(rank, round);
      leave(id, round);
    };
    Access::stream(stream).enqueue_kernel(name, std::move(task), SpanKind::collective);
  }

  Round& join(std::uint64_t id, int rank, const RankCall& call, const char* name) {
    std::unique_lock lock(mutex_);
    auto& slot = rounds_[id];
    if (!slot) {
      slot = std::make_unique<Round>();
      slot->calls.resize(static_cast<std::size_t>(size()));
      slot->left = size();
    }
    Round& round = *slot;
    round.calls[static_cast<std::size_t>(rank)] = call;
    ++round.registered;
    round.cv.notify_all();
    round.cv.wait(lock, [&] { return aborted_ || round.registered == size(); });
    if (aborted_) throw Error(fmt::format("{}: communicator aborted while rank {} waited for its peers", name, rank));
    return round;
  }

  void step_barrier(Round& round) {
    std::unique_lock lock(mutex_);
    const std::uint64_t phase = round.phase;
    if (++round.waiting == size()) {
      round.waiting = 0;
      ++round.phase;
      round.cv.notify_all();
      return;
    }
    round.cv.wait(lock, [&] { return aborted_ || round.phase != phase; });
    if (aborted_) throw Error("collective aborted during a ring step");
  }

  void leave(std::uint64_t id, Round& round) {
    std::lock_guard lock(mutex_);
    if (--round.left == 0) rounds_.erase(id);
  }

  const DeviceGroup& group_;
  std::mutex mutex_;
  bool aborted_ = false;
  std::vector<std::uint64_t> calls_made_;
  std::map<std::uint64_t, std::unique_ptr<Round>> rounds_;
  std::vector<Scratch> staging_;
  std::vector<DeviceBuffer> retired_;
  std::mutex staging_mutex_;
};

}  // namespace

std::unique_ptr<Communicator> make_ring_communicator(const DeviceGroup& group) {
  return std::make_unique<RingCommunicator>(group);
}

}  // namespace dp::detail
