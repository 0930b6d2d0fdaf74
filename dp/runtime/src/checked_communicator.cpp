// checked_communicator.cpp — agreement before the operation.
//
// Note [collective agreement]
// Before a call reaches the backend, the process's ranks meet on the host (as the sim ring's eager
// calls already do, and NCCL's kernels on the device): each deposits the call's signature under
// its sequence number, the last to arrive compares them and, with several processes, exchanges the
// process's verdict with every other process (one small message per call and process, on a channel
// of its own). Every rank of every process then learns the same answer: the call runs on all, or
// throws CollectiveMismatch on all, naming the ranks, step, sequence number, signatures and call
// sites, before any backend call of the mismatched operation is made (the backend's own failure
// modes for a desync are a hang or silently wrong sums). A rank that never arrives is waited for
// until DP_TIMEOUT_S (CollectiveTimeout naming it and where it is); abort() ends the wait.
// Captured calls are checked when captured; their replays repeat the same sequence on every rank.
#include "checked_communicator.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "backend.h"
#include "channel.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/progress.h"
#include "dp/runtime/scratch.h"

namespace dp::detail {
namespace {

// One process's verdict on a call, as it travels to the others.
struct Verdict {
  std::int32_t agreed = 1;       // 0: this process's ranks disagreed (text says how)
  std::int32_t global_rank = 0;  // the process's first rank
  std::int64_t step = 0;
  CollectiveSignature signature;  // its first rank's
  std::array<char, 1024> text{};
};

struct Call {
  std::vector<std::optional<CollectiveSignature>> signatures;
  std::vector<std::int64_t> steps;
  int arrived = 0, left = 0;
  bool decided = false;
  // The verdict, as what each rank throws its own copy of (no exception object is shared between
  // the ranks' threads): none when agreed.
  enum class Failure { none, mismatch, peer_lost, timeout, aborted, other } failure = Failure::none;
  std::string failure_text;
  int failure_process = -1;  // peer_lost: the process that is gone, where known
};

class CheckedCommunicator final : public Communicator {
 public:
  CheckedCommunicator(std::unique_ptr<Communicator> inner, const DeviceGroup& group,
                      std::shared_ptr<ProcessGroup> processes, int index)
      : inner_(std::move(inner)),
        group_(group),
        processes_(std::move(processes)),
        index_(index),
        checked_(collectives_checked()),
        seq_(static_cast<std::size_t>(group.size()), 0),
        extra_(static_cast<std::size_t>(group.size())) {
    if (checked_ && processes_->size() > 1) channel_ = processes_->open_channel();
  }

  int size() const override { return inner_->size(); }
  int local_size() const override { return inner_->local_size(); }
  int first_rank() const override { return inner_->first_rank(); }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    check(rank, stream, data, count * sizeof(float), "all_reduce");
    call(rank, stream, make_signature(op == ReduceOp::sum ? "all_reduce" : "all_reduce avg", "f32", count),
         count * sizeof(float), [&] { inner_->all_reduce(rank, stream, data, count, op); });
  }
  void all_reduce_bf16(int rank, const Stream& stream, std::uint16_t* data, std::size_t count) override {
    check(rank, stream, data, count * 2, "all_reduce_bf16");
    call(rank, stream, make_signature("all_reduce", "bf16", count), count * 2,
         [&] { inner_->all_reduce_bf16(rank, stream, data, count); });
  }
  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    check(rank, stream, data, bytes, "broadcast");
    check_root(root);
    call(rank, stream, make_signature("broadcast", "bytes", bytes, root), bytes,
         [&] { inner_->broadcast(rank, stream, data, bytes, root); });
  }
  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    check(rank, stream, data, count * sizeof(float), "reduce");
    check_root(root);
    call(rank, stream, make_signature("reduce", "f32", count, root), count * sizeof(float),
         [&] { inner_->reduce(rank, stream, data, count, root); });
  }
  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    check(rank, stream, send, count * sizeof(float), "all_gather");
    check(rank, stream, recv, count * sizeof(float) * static_cast<std::size_t>(size()), "all_gather");
    call(rank, stream, make_signature("all_gather", "f32", count), count * sizeof(float) * size(),
         [&] { inner_->all_gather(rank, stream, send, recv, count); });
  }
  void reduce_scatter(int rank, const Stream& stream, float* data, std::size_t count) override {
    check(rank, stream, data, count * sizeof(float), "reduce_scatter");
    call(rank, stream, make_signature("reduce_scatter", "f32", count), count * sizeof(float),
         [&] { inner_->reduce_scatter(rank, stream, data, count); });
  }
  void all_gather_blocks(int rank, const Stream& stream, float* data, std::size_t count) override {
    check(rank, stream, data, count * sizeof(float), "all_gather_blocks");
    call(rank, stream, make_signature("all_gather_blocks", "f32", count), count * sizeof(float),
         [&] { inner_->all_gather_blocks(rank, stream, data, count); });
  }
  void end_of(int rank, std::string_view what, CallSite where) override {
    if (!checked_) return;
    check_rank(rank, "end_of");
    const CollectivePurpose purpose(what, where);
    const std::uint64_t id = begin_call(rank, progress::current_step(), make_signature("end", "none", 0), 0);
    FlightRecorder::process().done(first_rank() + rank, id);  // nothing to run
  }
  void abort() override {
    {
      std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    cv_.notify_all();
    inner_->abort();
  }

 private:
  // The arguments the backends refuse, refused before the ranks meet (a rank that would fail in the
  // backend must not leave its peers waiting for it in the agreement): the sim ring's rules.
  void check_rank(int rank, const char* op) const {
    if (rank < 0 || rank >= local_size())
      throw InvalidArgument(fmt::format("{}: local rank {} of {}", op, rank, local_size()));
  }
  void check(int rank, const Stream& stream, const void* ptr, std::size_t bytes, const char* op) const {
    check_rank(rank, op);
    const int device = group_.device_ids()[static_cast<std::size_t>(rank)];
    if (stream.device() != device)
      throw DeviceMismatch(
          fmt::format("{}: rank {} is device {} but the stream is on device {}", op, rank, device, stream.device()));
    if (bytes) Access::stream(stream).check_access(ptr, bytes, op);
  }

  void check_root(int root) const {
    if (root < 0 || root >= size()) throw InvalidArgument(fmt::format("collective root {} of {} ranks", root, size()));
  }

  template <class Run>
  void call(int rank, const Stream& stream, CollectiveSignature signature, std::uint64_t bytes, Run&& run) {
    const int global = first_rank() + rank;
    const std::int64_t step = progress::current_step();
    progress::fault_point(FaultPhase::collective);
    FaultPlan& plan = FaultPlan::from_environment();
    if (!plan.empty()) {
      const int process = processes_->rank();
      const int device = progress::current_fault_device() >= 0 ? progress::current_fault_device() : global;
      if (std::string_view(signature.purpose.data()).starts_with("bucket") &&
          plan.take(FaultKind::desync_skip, process, device, step))
        return;  // the bucket's reduction never issued on this rank
      if (auto fault = plan.take(FaultKind::desync_extra, process, device, step)) issue_extra(rank, stream, *fault);
      // Only the signature grows: were the check off, the backend would overrun the buffer.
      if (plan.take(FaultKind::desync_count, process, device, step)) ++signature.count;
    }
    const std::uint64_t id = begin_call(rank, step, signature, bytes);
    FlightRecorder& record = FlightRecorder::process();
    try {
      run();
    } catch (...) {
      record.done(global, id, true);
      throw;
    }
    if (stream.capturing())
      record.captured(global, id);
    else
      stream.launch_host_func([global, id] { FlightRecorder::process().done(global, id); });
  }

  // Numbers the rank's next call, notes it in the flight record (issued) and, when checked, has the
  // ranks agree on it; a failed agreement is noted failed and rethrown. Returns the record's id.
  std::uint64_t begin_call(int rank, std::int64_t step, const CollectiveSignature& signature, std::uint64_t bytes) {
    const std::uint64_t seq = seq_[static_cast<std::size_t>(rank)]++;
    FlightEntry entry;
    entry.communicator = index_;
    entry.seq = seq;
    entry.global_rank = first_rank() + rank;
    entry.step = step;
    entry.signature = signature;
    entry.bytes = bytes;
    FlightRecorder& record = FlightRecorder::process();
    const std::uint64_t id = record.issued(entry);
    try {
      if (checked_) {
        const auto arrived = std::chrono::steady_clock::now();
        agree(rank, seq, step, signature);
        count_collective_check(static_cast<std::uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - arrived).count()));
      }
    } catch (...) {
      record.done(entry.global_rank, id, true);
      throw;
    }
    return id;
  }

  // DP_FAULT desync-extra: one all-reduce of one float more on this rank (not a template: call()
  // instantiates it).
  void issue_extra(int rank, const Stream& stream, const Fault& fault) {
    const CollectivePurpose purpose(fmt::format("DP_FAULT {}", fault.text()));
    float* one = extra_[static_cast<std::size_t>(rank)].get<float>(group_.device(rank), 1);
    call(rank, stream, make_signature("all_reduce", "f32", 1), sizeof(float),
         [&] { inner_->all_reduce(rank, stream, one, 1, ReduceOp::sum); });
  }

  void agree(int rank, std::uint64_t seq, std::int64_t step, const CollectiveSignature& signature) {
    const int local = local_size();
    std::unique_lock lock(mutex_);
    if (aborted_) throw CollectiveAborted(fmt::format("{}: communicator was aborted", signature.describe()));
    Call& c = calls_[seq];
    if (c.signatures.empty()) {
      c.signatures.resize(static_cast<std::size_t>(local));
      c.steps.resize(static_cast<std::size_t>(local));
      c.left = local;
    }
    c.signatures[static_cast<std::size_t>(rank)] = signature;
    c.steps[static_cast<std::size_t>(rank)] = step;
    if (++c.arrived == local) {
      const std::string local_failure = compare_local(c, seq);
      std::exception_ptr failure =
          local_failure.empty() ? nullptr : std::make_exception_ptr(CollectiveMismatch(local_failure));
      if (channel_) {
        lock.unlock();
        {
          const progress::Waiting waiting(fmt::format("{} #{} ({}): the other processes' verdicts", signature.op.data(),
                                                      seq, signature.purpose.data()));
          failure = compare_processes(c, seq, local_failure);  // this thread alone touches c until decided
        }
        lock.lock();
      }
      if (failure) {
        try {
          std::rethrow_exception(failure);
        } catch (const CollectiveMismatch& e) {
          c.failure = Call::Failure::mismatch, c.failure_text = e.what();
        } catch (const PeerLost& e) {
          c.failure = Call::Failure::peer_lost, c.failure_text = e.what(), c.failure_process = e.process();
        } catch (const CollectiveTimeout& e) {
          c.failure = Call::Failure::timeout, c.failure_text = e.what();
        } catch (const CollectiveAborted& e) {
          c.failure = Call::Failure::aborted, c.failure_text = e.what();
        } catch (const std::exception& e) {
          c.failure = Call::Failure::other, c.failure_text = e.what();
        }
      }
      c.decided = true;
      cv_.notify_all();
    } else {
      const progress::Waiting waiting(fmt::format("{} #{} ({})", signature.op.data(), seq, signature.purpose.data()));
      // A deadline only while a local rank has not arrived: once all have, the last one decides
      // (its exchange with the other processes has the timeout of its own), and the others wait for
      // that verdict rather than time out beside it.
      const auto deadline = std::chrono::steady_clock::now() + processes_->timeout();
      if (!cv_.wait_until(lock, deadline, [&] { return c.decided || aborted_ || c.arrived == local; })) {
        std::string missing;
        for (int r = 0; r < local; ++r)
          if (!c.signatures[static_cast<std::size_t>(r)]) missing += fmt::format(" {}", first_rank() + r);
        std::string where;
        for (const progress::Mark& m : progress::marks())
          if (m.waiting.empty() && m.process == processes_->rank()) where += "; " + progress::describe(m);
        throw CollectiveTimeout(fmt::format(
            "{} #{} of communicator {} (step {}): global rank {} waited {} s for rank(s){} to issue it (timeout; "
            "DP_TIMEOUT_S sets it){}",
            signature.op.data(), seq, index_, step, first_rank() + rank,
            std::chrono::duration_cast<std::chrono::seconds>(processes_->timeout()).count(), missing, where));
      }
      cv_.wait(lock, [&] { return c.decided || aborted_; });
      if (!c.decided) throw CollectiveAborted(fmt::format("{}: communicator was aborted", signature.describe()));
    }
    const Call::Failure failure = c.failure;
    const std::string text = c.failure_text;
    const int lost_process = c.failure_process;
    if (--c.left == 0) calls_.erase(seq);
    switch (failure) {
      case Call::Failure::none: return;
      case Call::Failure::mismatch: throw CollectiveMismatch(text);
      case Call::Failure::peer_lost: throw PeerLost(text, lost_process);
      case Call::Failure::timeout: throw CollectiveTimeout(text);
      case Call::Failure::aborted: throw CollectiveAborted(text);
      case Call::Failure::other: throw Error(text);
    }
  }

  std::string mismatch(std::uint64_t seq, int rank_a, std::int64_t step_a, const CollectiveSignature& a, int rank_b,
                       std::int64_t step_b, const CollectiveSignature& b) const {
    return fmt::format(
        "collectives desynchronized at call #{} of communicator {}: global rank {} (step {}) issued {}, but global "
        "rank {} (step {}) issued {}; no rank ran it",
        seq, index_, rank_a, step_a, a.describe(), rank_b, step_b, b.describe());
  }

  std::string compare_local(const Call& c, std::uint64_t seq) const {
    for (std::size_t r = 1; r < c.signatures.size(); ++r)
      if (!c.signatures[r]->matches(*c.signatures[0]))
        return mismatch(seq, first_rank(), c.steps[0], *c.signatures[0], first_rank() + static_cast<int>(r), c.steps[r],
                        *c.signatures[r]);
    return {};
  }

  // Every process's verdict on call `seq`; the first failure in process order, or the first process
  // whose ranks issued another call than process 0's (CollectiveMismatch), or the channel's failure
  // (a peer gone, a timeout); null when all agree. Every process computes the same answer.
  std::exception_ptr compare_processes(const Call& c, std::uint64_t seq, const std::string& local_failure) {
    const int processes = processes_->size(), me = processes_->rank();
    Verdict mine;
    mine.agreed = local_failure.empty() ? 1 : 0;
    mine.global_rank = first_rank();
    mine.step = c.steps[0];
    mine.signature = *c.signatures[0];
    std::memcpy(mine.text.data(), local_failure.data(), std::min(local_failure.size(), mine.text.size() - 1));
    std::vector<Verdict> all(static_cast<std::size_t>(processes));
    all[static_cast<std::size_t>(me)] = mine;
    const int tag = static_cast<int>(seq % (static_cast<std::uint64_t>(channel_->max_tag()) + 1));
    std::vector<Channel::Message> sends, receives;
    for (int p = 0; p < processes; ++p) {
      if (p == me) continue;
      sends.push_back({&mine, sizeof(Verdict), p, tag});
      receives.push_back({&all[static_cast<std::size_t>(p)], sizeof(Verdict), p, tag});
    }
    try {
      channel_->exchange(
          sends, receives,
          [this] {
            std::lock_guard lock(mutex_);
            return aborted_;
          },
          "checking a collective's signature with the other processes");
    } catch (...) {
      return std::current_exception();
    }
    for (const Verdict& v : all)
      if (!v.agreed) return std::make_exception_ptr(CollectiveMismatch(std::string(v.text.data())));
    for (std::size_t p = 1; p < all.size(); ++p)
      if (!all[p].signature.matches(all[0].signature))
        return std::make_exception_ptr(
            CollectiveMismatch(mismatch(seq, all[0].global_rank, all[0].step, all[0].signature, all[p].global_rank,
                                        all[p].step, all[p].signature)));
    return nullptr;
  }

  std::unique_ptr<Communicator> inner_;
  const DeviceGroup& group_;
  std::shared_ptr<ProcessGroup> processes_;
  const int index_;
  const bool checked_;
  std::unique_ptr<Channel> channel_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool aborted_ = false;
  std::map<std::uint64_t, Call> calls_;
  std::vector<std::uint64_t> seq_;  // per local rank: its next call's number
  std::vector<Scratch> extra_;      // DP_FAULT desync-extra's one float per rank
};

}  // namespace

std::unique_ptr<Communicator> make_checked_communicator(std::unique_ptr<Communicator> inner, const DeviceGroup& group,
                                                        std::shared_ptr<ProcessGroup> processes, int index) {
  return std::make_unique<CheckedCommunicator>(std::move(inner), group, std::move(processes), index);
}

}  // namespace dp::detail
