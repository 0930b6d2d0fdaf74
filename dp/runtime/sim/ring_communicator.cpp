// ring_communicator.cpp — collectives on simulated devices. Each call becomes a task on the rank's
// stream; when the tasks of all local ranks run, they meet (like NCCL kernels that wait for their
// peers) and move data in ring steps, each step a counted device-to-device copy into the
// receiver's staging memory followed by its reduction, with a barrier between steps. The ring runs
// over the global ranks of every process: where a neighbour lives in another process, the step's
// copy is a message on the process group's channel instead, carrying the same bytes, so P
// processes x K devices compute exactly what one process x P*K devices does.
#include <condition_variable>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <mutex>
#include <vector>

#include "backend.h"
#include "channel.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/scratch.h"

namespace dp::detail {
namespace {

struct RankCall {
  void* data = nullptr;        // all_reduce / broadcast / reduce: the buffer; all_gather: recv
  const void* send = nullptr;  // all_gather only
  void* staging = nullptr;     // receiver-side scratch on the rank's device
};

// ReduceOp::avg after the sum: times 1/n in fp32. The bf16 all-reduce only sums (never asked to
// average), so its overload has nothing to do.
void scale_to_mean(float* x, std::size_t count, int n) {
  const float scale = 1.0f / static_cast<float>(n);
  for (std::size_t i = 0; i < count; ++i) x[i] *= scale;
}
void scale_to_mean(std::uint16_t*, std::size_t, int) {}

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
  RingCommunicator(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes)
      : group_(group),
        processes_(std::move(processes)),
        local_(group.size()),
        process_(processes_->rank()),
        world_(group.size() * processes_->size()),
        first_(processes_->rank() * group.size()),
        calls_made_(group.size(), 0),
        turns_(group.size(), 0),
        host_calls_(group.size(), 0) {
    staging_.resize(static_cast<std::size_t>(local_));
    if (processes_->size() > 1) channel_ = processes_->open_channel();  // sizes checked by Communicator::create
  }
  ~RingCommunicator() override {
    // Tasks of this communicator may still sit in the ranks' streams: fail them rather than let
    // them wait for peers that will never come, then let them run before the state they use dies.
    abort();
    for (int r = 0; r < local_; ++r) {
      try {
        group_.device(r).synchronize();
      } catch (...) {
      }
    }
  }

  int size() const override { return world_; }
  int local_size() const override { return local_; }
  int first_rank() const override { return first_; }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    ring_all_reduce<float>(rank, stream, data, count, op, [](float a, float b) { return a + b; });
  }

  void all_reduce_bf16(int rank, const Stream& stream, std::uint16_t* data, std::size_t count) override {
    ring_all_reduce<std::uint16_t>(rank, stream, data, count, ReduceOp::sum, bf16_add);
  }

  // all_reduce's two phases apart: the same steps, so the same bits and bytes.
  void reduce_scatter(int rank, const Stream& stream, float* data, std::size_t count) override {
    ring_all_reduce<float>(
        rank, stream, data, count, ReduceOp::sum, [](float a, float b) { return a + b; }, Phases::reduce_scatter);
  }
  void all_gather_blocks(int rank, const Stream& stream, float* data, std::size_t count) override {
    ring_all_reduce<float>(
        rank, stream, data, count, ReduceOp::sum, [](float a, float b) { return a + b; }, Phases::all_gather);
  }

  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    check(rank, stream, data, bytes, "broadcast");
    check_root(root);
    const int n = world_, g = first_ + rank;
    // The chain: rank root+s+1 receives from rank root+s.
    const auto traffic = [this, g, n, root, bytes] {
      if (g != root) count_edge(g - 1, g, bytes);
      if ((g + 1) % n != root) count_edge(g, g + 1, 0, bytes);
    };
    enqueue(rank, stream, "broadcast", RankCall{data, nullptr, nullptr}, traffic,
            [this, bytes, root, n](int r, Round& round, int tag) {
              const int g = first_ + r;
              void* mine = round.calls[static_cast<std::size_t>(r)].data;
              for (int s = 0; s < n - 1; ++s) {
                const int receiver = (root + s + 1) % n, sender = (root + s) % n;
                std::vector<detail::Channel::Message> sends, receives;
                if (g == receiver) {
                  if (is_local(sender))
                    receive(mine, round.calls[static_cast<std::size_t>(sender - first_)].data, bytes);
                  else
                    receives.push_back({mine, bytes, process_of(sender), tag + sender % local_});
                }
                if (g == sender && !is_local(receiver))
                  sends.push_back({mine, bytes, process_of(receiver), tag + g % local_});
                exchange(sends, receives, "broadcast");
                step_barrier(round);
              }
            });
  }

  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    check(rank, stream, data, count * sizeof(float), "reduce");
    check_root(root);
    const int g = first_ + rank;
    float* staging = g == root ? staging_for(rank, count) : nullptr;
    // The root reads every buffer: a local one as a device copy (counted here), a remote one as a
    // message (counted by the root's side as it arrives, and by the sender's as it leaves).
    const auto traffic = [this, g, root, count] {
      if (g != root) count_edge(g, root, count * sizeof(float), count * sizeof(float));
      if (g == root)
        for (int other = 0; other < world_; ++other)
          if (!is_local(other)) count_edge(other, root, count * sizeof(float));
    };
    enqueue(rank, stream, "reduce", RankCall{data, nullptr, staging}, traffic,
            [this, count, root](int r, Round& round, int tag) {
              const int g = first_ + r;
              float* mine = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].data);
              const std::size_t bytes = count * sizeof(float);
              // The root receives every other rank's buffer in rank order and adds it (its own first).
              if (g == root) {
                auto* stage = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].staging);
                for (int other = 0; other < world_; ++other) {
                  if (other == root) continue;
                  if (is_local(other)) {
                    receive(stage, round.calls[static_cast<std::size_t>(other - first_)].data, bytes);
                  } else {
                    const detail::Channel::Message message{stage, bytes, process_of(other), tag + other % local_};
                    exchange({}, std::span(&message, 1), "reduce");
                  }
                  for (std::size_t i = 0; i < count; ++i) mine[i] += stage[i];
                }
              } else if (!is_local(root)) {
                const detail::Channel::Message message{mine, bytes, process_of(root), tag + g % local_};
                exchange(std::span(&message, 1), {}, "reduce");
              }
              step_barrier(round);  // nobody reuses its buffer before the root has read it
            });
  }

  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    check(rank, stream, send, count * sizeof(float), "all_gather send");
    check(rank, stream, recv, count * static_cast<std::size_t>(world_) * sizeof(float), "all_gather recv");
    const int n = world_, g = first_ + rank;
    const auto traffic = [this, n, g, count] {
      for (int s = 0; s < n - 1; ++s) {
        count_edge(g - 1, g, count * sizeof(float));
        count_edge(g, g + 1, 0, count * sizeof(float));
      }
    };
    enqueue(rank, stream, "all_gather", RankCall{recv, send, nullptr}, traffic,
            [this, count, n](int r, Round& round, int tag) {
              const int g = first_ + r;
              float* mine = static_cast<float*>(round.calls[static_cast<std::size_t>(r)].data);
              const auto block = [&](int b) { return static_cast<std::size_t>(((b % n) + n) % n) * count; };
              std::memcpy(mine + block(g), round.calls[static_cast<std::size_t>(r)].send, count * sizeof(float));
              step_barrier(round);
              for (int s = 0; s < n - 1; ++s) {
                transfer(round, r, mine + block(g - 1 - s), block(g - 1 - s) * sizeof(float), count * sizeof(float),
                         mine + block(g - s), count * sizeof(float), tag, "all_gather");
                step_barrier(round);
              }
            });
  }

  void abort() override {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    for (auto& [id, round] : rounds_) round->cv.notify_all();
    turn_cv_.notify_all();
    host_cv_.notify_all();
  }

 private:
  using Body = std::function<void(int rank, Round& round, int tag)>;
  enum class Phases { both, reduce_scatter, all_gather };

  // The ring all-reduce of `count` elements of T: reduce-scatter, each step adding the left
  // neighbour's partial sum to this rank's (add), then all-gather; or one of the two phases. Chunk
  // c is ring_block(c): rank g finishes chunk owned_block(g).
  template <class T, class Add>
  void ring_all_reduce(int rank, const Stream& stream, T* data, std::size_t count, ReduceOp op, Add add,
                       Phases phases = Phases::both) {
    const char* name = phases == Phases::both             ? "all_reduce"
                       : phases == Phases::reduce_scatter ? "reduce_scatter"
                                                          : "all_gather_blocks";
    const bool scatter = phases != Phases::all_gather, gather = phases != Phases::reduce_scatter;
    check(rank, stream, data, count * sizeof(T), name);
    const int n = world_, g = first_ + rank;
    auto* staging = reinterpret_cast<T*>(staging_for(
        rank,
        ((count + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n) * sizeof(T) + sizeof(float) - 1) /
            sizeof(float)));
    const auto chunk = [count, n](int c) {
      c = ((c % n) + n) % n;
      return std::pair{count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n),
                       count * static_cast<std::size_t>(c + 1) / static_cast<std::size_t>(n)};
    };
    const auto bytes_of = [](std::pair<std::size_t, std::size_t> range) {
      return (range.second - range.first) * sizeof(T);
    };
    // Counted when issued, like copies: this rank receives every chunk but its own once in
    // reduce-scatter, and every chunk but its right neighbour's once in all-gather.
    const auto traffic = [this, n, g, chunk, bytes_of, scatter, gather] {
      for (int s = 0; s < n - 1; ++s) {
        if (scatter) {
          count_edge(g - 1, g, bytes_of(chunk(g - 1 - s)));
          count_edge(g, g + 1, 0, bytes_of(chunk(g - s)));
        }
        if (gather) {
          count_edge(g - 1, g, bytes_of(chunk(g - s)));
          count_edge(g, g + 1, 0, bytes_of(chunk(g + 1 - s)));
        }
      }
    };
    enqueue(rank, stream, name, RankCall{data, nullptr, staging}, traffic,
            [this, count, op, n, chunk, add, scatter, gather, name](int r, Round& round, int tag) {
              const int g = first_ + r;
              T* mine = static_cast<T*>(round.calls[static_cast<std::size_t>(r)].data);
              T* stage = static_cast<T*>(round.calls[static_cast<std::size_t>(r)].staging);
              // Reduce-scatter: after step s, rank g holds the sum of s+2 contributions to chunk g-1-s.
              for (int s = 0; scatter && s < n - 1; ++s) {
                const auto [begin, end] = chunk(g - 1 - s);
                const auto [send_begin, send_end] = chunk(g - s);
                transfer(round, r, stage, begin * sizeof(T), (end - begin) * sizeof(T), mine + send_begin,
                         (send_end - send_begin) * sizeof(T), tag, name);
                for (std::size_t i = begin; i < end; ++i) mine[i] = add(mine[i], stage[i - begin]);
                step_barrier(round);
              }
              // All-gather: pass the finished chunks around the ring.
              for (int s = 0; gather && s < n - 1; ++s) {
                const auto [begin, end] = chunk(g - s);
                const auto [send_begin, send_end] = chunk(g + 1 - s);
                transfer(round, r, mine + begin, begin * sizeof(T), (end - begin) * sizeof(T), mine + send_begin,
                         (send_end - send_begin) * sizeof(T), tag, name);
                step_barrier(round);
              }
              if (op == ReduceOp::avg) scale_to_mean(mine, count, n);
            });
  }

  bool is_local(int global) const { return global >= first_ && global < first_ + local_; }
  int process_of(int global) const { return global / local_; }
  int wrap(int global) const { return ((global % world_) + world_) % world_; }

  void check(int rank, const Stream& stream, const void* ptr, std::size_t bytes, const char* op) {
    if (rank < 0 || rank >= local_) throw InvalidArgument(fmt::format("{}: local rank {} of {}", op, rank, local_));
    if (stream.device() != group_.device_ids()[static_cast<std::size_t>(rank)])
      throw DeviceMismatch(fmt::format("{}: rank {} is device {} but the stream is on device {}", op, rank,
                                       group_.device_ids()[static_cast<std::size_t>(rank)], stream.device()));
    if (bytes) Access::stream(stream).check_access(ptr, bytes, op);
  }
  void check_root(int root) const {
    if (root < 0 || root >= world_) throw InvalidArgument(fmt::format("collective root {} of {} ranks", root, world_));
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

  // One ring step of rank r: receive `bytes` at byte offset `at` of the left neighbour's buffer into dst
  // (a counted copy when it is local, a message when it lives in another process), and send
  // `send_bytes` from `send` when the right neighbour lives in another process.
  void transfer(Round& round, int r, void* dst, std::size_t at, std::size_t bytes, void* send, std::size_t send_bytes,
                int tag, const char* op) {
    const int g = first_ + r, left = wrap(g - 1), right = wrap(g + 1);
    std::vector<detail::Channel::Message> sends, receives;
    if (is_local(left)) {
      const auto* theirs = static_cast<const std::byte*>(round.calls[static_cast<std::size_t>(left - first_)].data);
      receive(dst, theirs + at, bytes);
    } else if (bytes) {
      receives.push_back({dst, bytes, process_of(left), tag + left % local_});
    }
    if (!is_local(right) && send_bytes) sends.push_back({send, send_bytes, process_of(right), tag + g % local_});
    exchange(sends, receives, op);
  }

  void exchange(std::span<const detail::Channel::Message> sends, std::span<const detail::Channel::Message> receives,
                const char* op) {
    if (sends.empty() && receives.empty()) return;
    channel_->exchange(
        sends, receives, [this] { return aborted(); }, op);
  }
  bool aborted() {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

  // Traffic of the directed edge from -> to (global ranks), counted on this process's side:
  // `received` bytes arriving at a local `to`, `sent` bytes leaving a local `from` for another
  // process (the network). Local-to-local edges count once, as the receiver's copy.
  void count_edge(int from, int to, std::size_t received, std::size_t sent = 0) {
    from = wrap(from);
    to = wrap(to);
    auto& runtime = Access::runtime(group_.runtime());
    const auto device = [this](int global) { return group_.device_ids()[static_cast<std::size_t>(global - first_)]; };
    if (received && is_local(to)) runtime.count_copy(is_local(from) ? device(from) : kNetwork, device(to), received);
    if (sent && is_local(from) && !is_local(to)) runtime.count_copy(device(from), kNetwork, sent);
  }

  // Issues the call on the rank's stream. Its sequence number and its traffic belong to each
  // execution, not to the host call: a graph that captured the call replays it as a new call of
  // the rank (as a captured NCCL kernel is a new operation of its communicator at every launch).
  void enqueue(int rank, const Stream& stream, const char* name, RankCall call, std::function<void()> traffic,
               Body body) {
    if (stream.capturing()) {
      std::lock_guard lock(mutex_);
      if (aborted_) throw CollectiveAborted(fmt::format("{}: communicator was aborted", name));
    } else {
      arrive_on_host(rank, name);  // refuses an aborted communicator too
    }
    auto issue = [this, rank, call, traffic = std::move(traffic), body = std::move(body),
                  name]() -> std::function<void()> {
      std::uint64_t id;
      {
        std::lock_guard lock(mutex_);
        if (aborted_) throw CollectiveAborted(fmt::format("{}: communicator was aborted", name));
        id = calls_made_[static_cast<std::size_t>(rank)]++;
      }
      traffic();
      // Every rank makes the same calls in the same order: the call's index tags its messages, one
      // tag per sending rank (tag + the sender's local index), as several threads of one process
      // may send to one peer at once, in no fixed order (reduce).
      const std::uint64_t tags =
          channel_ ? (static_cast<std::uint64_t>(channel_->max_tag()) + 1) / static_cast<std::uint64_t>(local_) : 1;
      const int tag = static_cast<int>(id % tags) * local_;
      return [this, id, rank, call, body, name, tag] {
        Round& round = join(id, rank, call, name);
        struct Leave {  // also when the body throws: the rank's next call gets its turn
          RingCommunicator& comm;
          std::uint64_t id;
          Round& round;
          int rank;
          ~Leave() { comm.leave(id, round, rank); }
        } leave{*this, id, round, rank};
        // A rank that fails mid-call (its peer process vanished in the middle of an exchange)
        // leaves its local peers in a ring step that can never complete: the communicator is
        // unusable from then on, as an NCCL communicator after an asynchronous error, and its
        // other ranks must fail now rather than wait for good.
        try {
          body(rank, round, tag);
        } catch (...) {
          abort();
          throw;
        }
      };
    };
    Access::stream(stream).enqueue_reissued(name, std::move(issue), SpanKind::collective);
  }
  // An eager call returns once every local rank has made it, as the cuda backend's device ring
  // launches the ranks' parts together (Note [implicit synchronization], launch_group.h) and as
  // NCCL may block within one process: a program that holds a rank's call back until a peer's has
  // returned hangs there, so it hangs here first. Captured calls do not wait: nothing runs then.
  void arrive_on_host(int rank, const char* name) {
    std::unique_lock lock(mutex_);
    if (aborted_) throw CollectiveAborted(fmt::format("{}: communicator was aborted", name));
    const std::uint64_t call = host_calls_[static_cast<std::size_t>(rank)]++;
    host_cv_.notify_all();
    host_cv_.wait(lock, [&] {
      if (aborted_) return true;
      for (const std::uint64_t made : host_calls_)
        if (made <= call) return false;
      return true;
    });
    if (aborted_)
      throw CollectiveAborted(
          fmt::format("{}: communicator aborted while rank {} waited for its peers' calls", name, rank));
  }

  Round& join(std::uint64_t id, int rank, const RankCall& call, const char* name) {
    std::unique_lock lock(mutex_);
    // A rank's calls run one at a time, in the order it made them, whatever streams they were
    // issued on (as NCCL's operations on one communicator): its staging memory and its messages'
    // tags belong to one call at a time.
    turn_cv_.wait(lock, [&] { return aborted_ || turns_[static_cast<std::size_t>(rank)] == id; });
    auto& slot = rounds_[id];
    if (!slot) {
      slot = std::make_unique<Round>();
      slot->calls.resize(static_cast<std::size_t>(local_));
      slot->left = local_;
    }
    Round& round = *slot;
    round.calls[static_cast<std::size_t>(rank)] = call;
    ++round.registered;
    round.cv.notify_all();
    round.cv.wait(lock, [&] { return aborted_ || round.registered == local_; });
    if (aborted_)
      throw CollectiveAborted(fmt::format("{}: communicator aborted while rank {} waited for its peers", name, rank));
    return round;
  }

  void step_barrier(Round& round) {
    std::unique_lock lock(mutex_);
    const std::uint64_t phase = round.phase;
    if (++round.waiting == local_) {
      round.waiting = 0;
      ++round.phase;
      round.cv.notify_all();
      return;
    }
    round.cv.wait(lock, [&] { return aborted_ || round.phase != phase; });
    if (aborted_) throw CollectiveAborted("collective aborted during a ring step");
  }

  void leave(std::uint64_t id, Round& round, int rank) {
    {
      std::lock_guard lock(mutex_);
      ++turns_[static_cast<std::size_t>(rank)];
      if (--round.left == 0) rounds_.erase(id);
    }
    turn_cv_.notify_all();
  }

  const DeviceGroup& group_;
  std::shared_ptr<ProcessGroup> processes_;
  const int local_, process_, world_, first_;  // local ranks, this process, global ranks, first global rank
  std::unique_ptr<detail::Channel> channel_;   // other processes (none when alone)
  std::mutex mutex_;
  bool aborted_ = false;
  std::vector<std::uint64_t> calls_made_;
  std::vector<std::uint64_t> turns_;  // per rank: the call that runs next
  std::condition_variable turn_cv_;
  std::vector<std::uint64_t> host_calls_;  // per rank: eager calls made on the host (arrive_on_host)
  std::condition_variable host_cv_;
  std::map<std::uint64_t, std::unique_ptr<Round>> rounds_;
  std::vector<Scratch> staging_;
  std::vector<DeviceBuffer> retired_;
  std::mutex staging_mutex_;
};

}  // namespace

std::unique_ptr<Communicator> make_ring_communicator(const DeviceGroup& group,
                                                     std::shared_ptr<ProcessGroup> processes) {
  return std::make_unique<RingCommunicator>(group, std::move(processes));
}

}  // namespace dp::detail
