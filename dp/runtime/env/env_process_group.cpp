// env_process_group.cpp — the processes of a job started as torch.distributed's env:// launch
// (torchrun --no-python, a Kubernetes operator, or by hand): RANK of WORLD_SIZE processes meet
// through the TCP store process 0 serves on MASTER_ADDR:MASTER_PORT. Host collectives go through
// the store; the runtime's channels (the sim ring's transport) are gloo's point-to-point pairs,
// rendezvoused through the same store. Every wait has the group's timeout, and every wait also
// watches for a process that aborted or whose connection dropped, so one failing process ends the
// job within moments with a message naming it.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unistd.h>

#include "beat_board.h"
#include "channel.h"
#include "dp/runtime/error.h"
#include "process_backend.h"
#include "tcp_store.h"

namespace dp::detail {
namespace {

constexpr const char* kAbortKey = "dp/abort";

std::string text(const std::vector<char>& bytes) { return std::string(bytes.begin(), bytes.end()); }

class EnvGroup;

// gloo's rendezvous reads and writes keys through this (each channel under its own prefix).
class StoreForGloo final : public gloo::rendezvous::Store {
 public:
  explicit StoreForGloo(EnvGroup& group) : group_(group) {}
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override { wait(keys); }

 private:
  EnvGroup& group_;
};

// Note [one wait per message]
// gloo closes a pair whose wait times out ("Application timeout caused pair closure"), so a wait
// cut into slices ends the job the first time a peer is a slice late (a stopped process, a slow
// decode). Each message is therefore waited for in ONE wait of what is left of the job's timeout
// (DP_TIMEOUT_S), and the channel's watcher thread ends that wait early (abortWaitRecv/Send) when
// a process aborted, was refused or vanished, or the caller's `aborted` says so: a slow peer is
// waited for, a gone one ends the job within moments.
class GlooChannel final : public Channel {
 public:
  GlooChannel(std::shared_ptr<EnvGroup> group, std::shared_ptr<gloo::Context> context);
  ~GlooChannel() override;
  int max_tag() const override { return 1 << 30; }
  void exchange(std::span<const Message> sends, std::span<const Message> receives, const std::function<bool()>& aborted,
                std::string_view what) override;

 private:
  // The wait in progress, which the watcher may end early.
  struct Watched {
    gloo::transport::UnboundBuffer* buffer = nullptr;
    bool receive = false;
    std::function<bool()> aborted;
    std::string what;
    std::exception_ptr failure;  // why the watcher ended the wait
    int peer = -1;
  };
  void watch();
  // One message's wait (Note [one wait per message]); false, with `failure` set, when it failed.
  bool wait_for_message(gloo::transport::UnboundBuffer& buffer, bool receive, int peer,
                        std::chrono::steady_clock::time_point start, const std::function<bool()>& aborted,
                        std::string_view what, std::exception_ptr& failure);

  std::shared_ptr<EnvGroup> group_;
  std::shared_ptr<gloo::Context> context_;
  std::mutex abandoned_mutex_;
  // Buffers of an exchange given up on (abort, timeout): a late message may still land in them.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> abandoned_;
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  Watched watched_;
  bool closing_ = false;
  std::thread watcher_;
};

class EnvGroup final : public ProcessGroup, public std::enable_shared_from_this<EnvGroup> {
 public:
  EnvGroup(int rank, int size, const std::string& master, int port) : rank_(rank), size_(size) {
    const char* token = std::getenv("DP_JOB_TOKEN");
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    host_ = name;
    // The address this process's gloo pairs listen on: loopback when the job lives on this machine
    // (MASTER_ADDR is a loopback address: no name lookup needed), else this host's name.
    const bool local = master == "127.0.0.1" || master == "localhost" || master == "::1";
    pair_address_ = local ? "127.0.0.1" : host_;
    store_ = std::make_unique<TcpStore>(master, port, rank, size, token ? token : "", timeout());
    // Everyone says who they are; process 0 finds out here about one that never starts.
    store_->set(fmt::format("dp/host/{}", rank_), std::vector<char>(host_.begin(), host_.end()));
    for (int r = 0; r < size_; ++r) wait_for(fmt::format("dp/host/{}", r), "joining the job", r);
  }
  ~EnvGroup() override {
    // Everyone reaches the end before process 0 stops serving the store.
    try {
      barrier();
    } catch (...) {
    }
    {
      std::lock_guard lock(beat_mutex_);
      closing_ = true;
    }
    beat_cv_.notify_all();
    if (beat_thread_.joinable()) beat_thread_.join();
  }

  void start_beats(std::function<std::string()> status) override {
    std::lock_guard lock(beat_mutex_);
    if (beat_thread_.joinable() || size_ == 1) return;
    board_.start(size_);
    beat_thread_ = std::thread([this, status = std::move(status)] { beat(status); });
  }

  std::vector<PeerBeat> peer_beats() const override {
    std::lock_guard lock(beat_mutex_);
    const auto now = std::chrono::steady_clock::now();
    // Process 0 serves the store: requests it leaves unanswered are its silence too.
    const bool unanswered = unanswered_ && now - *unanswered_ > std::chrono::seconds(1);
    return board_.peers(rank_, now, unanswered ? 0 : -1);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& host() const override { return host_; }

  void all_gather_bytes(const void* send, std::size_t bytes, void* recv) override {
    const long seq = ++sequence_;
    const auto* data = static_cast<const char*>(send);
    store_->set(fmt::format("dp/ag/{}/{}", seq, rank_), std::vector<char>(data, data + bytes));
    for (int r = 0; r < size_; ++r) {
      const std::vector<char> value = wait_for(fmt::format("dp/ag/{}/{}", seq, r), "all_gather between processes", r);
      if (value.size() != bytes)
        throw Error(
            fmt::format("all_gather between processes: process {} gave {} bytes, not {}", r, value.size(), bytes));
      std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(r) * bytes, value.data(), bytes);
    }
    // Every process has read the collective before last by the time any reaches this one.
    if (seq > 2) store_->erase(fmt::format("dp/ag/{}/{}", seq - 2, rank_));
  }

  void broadcast_bytes(void* data, std::size_t bytes, int root) override {
    if (root < 0 || root >= size_)
      throw InvalidArgument(fmt::format("broadcast root {} is not a process of {}", root, size_));
    const long seq = ++sequence_;
    const std::string key = fmt::format("dp/bc/{}", seq);
    if (rank_ == root) {
      const auto* p = static_cast<const char*>(data);
      store_->set(key, std::vector<char>(p, p + bytes));
    } else {
      const std::vector<char> value = wait_for(key, "broadcast between processes", root);
      if (value.size() != bytes)
        throw Error(
            fmt::format("broadcast between processes: process {} sent {} bytes, not {}", root, value.size(), bytes));
      std::memcpy(data, value.data(), bytes);
    }
    if (rank_ == root && seq > 2) store_->erase(fmt::format("dp/bc/{}", seq - 2));
  }

  [[noreturn]] void abort(int exit_code) override {
    try {
      // Said within a second or not at all: process 0 may be the one that is frozen, and the
      // survivor's end must not wait DP_TIMEOUT_S again. Half a second for its turn on the socket
      // (the beats stop, and the lowered limit cuts a request under way), half for the answer.
      aborting_.store(true);
      store_->limit_wait(std::chrono::milliseconds(500));
      const std::string why = fmt::format("{} {}", rank_, exit_code);
      std::vector<std::optional<std::vector<char>>> none;
      store_->try_brief(kAbortKey, std::vector<char>(why.begin(), why.end()), {}, none, std::chrono::milliseconds(500));
    } catch (...) {
    }
    std::_Exit(exit_code);
  }

  std::unique_ptr<Channel> open_channel() override {
    std::lock_guard lock(channels_mutex_);
    if (!device_) {
      try {
        device_ = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr(pair_address_.c_str()));
      } catch (const gloo::Exception& e) {
        throw Error(fmt::format("process {}: cannot listen for its peers on {}: {}", rank_, pair_address_, e.what()));
      }
    }
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context->setTimeout(timeout());
    StoreForGloo store(*this);
    gloo::rendezvous::PrefixStore prefixed(fmt::format("dp/channel{}", channels_++), store);
    try {
      context->connectFullMesh(prefixed, device_);
    } catch (const gloo::Exception& e) {
      throw Error(fmt::format("connecting the processes' channels: {}", e.what()));
    }
    return std::make_unique<GlooChannel>(shared_from_this(), std::move(context));
  }

  // The value of `key` once some process set it; throws Error naming the process when one aborted
  // or dropped out first, or when the group's timeout passes (`waiting_for`: whose key it is).
  std::vector<char> wait_for(const std::string& key, std::string_view what, int waiting_for = -1) {
    const auto start = std::chrono::steady_clock::now();
    for (int poll = 0;; ++poll) {
      if (auto value = store_->try_get(key)) return *value;
      check_peers(what);
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > timeout())
        throw CollectiveTimeout(fmt::format("{}: process {} waited {} s for {} (timeout; DP_TIMEOUT_S sets it)", what,
                                            rank_, std::chrono::duration_cast<std::chrono::seconds>(waited).count(),
                                            waiting_for >= 0 ? fmt::format("process {}", waiting_for) : key));
      std::this_thread::sleep_for(std::chrono::microseconds(poll < 100 ? 200 : 5000));
    }
  }

  // Throws naming the process that aborted, was refused or whose connection to the store dropped.
  // Brief: a store that does not answer within half a second (process 0 frozen) is no news, and the
  // watcher that asks must get back to its other checks (an abort of the wait) soon.
  void check_peers(std::string_view what) {
    const std::vector<std::string> keys = {TcpStore::kRefusedKey, kAbortKey, TcpStore::kDeadKey};
    std::vector<std::optional<std::vector<char>>> read;
    const std::string mine = fmt::format("dp/watch/{}", rank_);
    if (!store_->try_brief(mine, {}, keys, read, std::chrono::milliseconds(500))) return;
    if (const auto& why = read[0])
      throw CollectiveAborted(fmt::format("{}: process 0 refused a process of this job: {}", what, text(*why)));
    if (const auto& why = read[1])
      throw CollectiveAborted(fmt::format("{}: process {} failed (exit code {})", what,
                                          text(*why).substr(0, text(*why).find(' ')),
                                          text(*why).substr(text(*why).find(' ') + 1)));
    if (const auto& dead = read[2])
      throw PeerLost(fmt::format("{}: process {} ended without leaving the job", what, text(*dead)),
                     std::atoi(text(*dead).c_str()));
  }

  TcpStore& store() { return *store_; }

  // A wait for `peer` that ran out its DP_TIMEOUT_S is the job's verdict on that process: a later
  // wait for it (another channel's, the next call's) fails at once instead of waiting the whole
  // timeout again.
  void peer_timed_out(int peer) {
    std::lock_guard lock(timed_out_mutex_);
    timed_out_.insert(peer);
  }
  bool has_timed_out(int peer) const {
    std::lock_guard lock(timed_out_mutex_);
    return timed_out_.count(peer) != 0;
  }

 private:
  // About once a second: this process's counter and status under dp/beat/<rank>, the others' read.
  // A failed request is no verdict (the collectives' own waits decide that): the next beat retries.
  void beat(const std::function<std::string()>& status) {
    std::vector<std::string> keys;
    std::vector<int> whose;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) {
        keys.push_back(fmt::format("dp/beat/{}", p));
        whose.push_back(p);
      }
    const std::string key = fmt::format("dp/beat/{}", rank_);
    long long count = 0;
    std::unique_lock lock(beat_mutex_);
    while (!closing_ && !aborting_.load()) {
      if (!unanswered_) unanswered_ = std::chrono::steady_clock::now();
      lock.unlock();
      const std::string mine = BeatBoard::text(++count, status());
      std::vector<std::optional<std::vector<char>>> read;
      // Brief: a beat never holds up the job's own requests, nor waits long for a silent process 0.
      const bool answered = store_->try_brief(key, std::vector<char>(mine.begin(), mine.end()), keys, read,
                                              std::chrono::milliseconds(500));
      lock.lock();
      const auto now = std::chrono::steady_clock::now();
      board_.round(now);
      if (answered) unanswered_.reset();
      for (std::size_t k = 0; answered && k < keys.size(); ++k)
        if (read[k]) board_.heard(whose[k], text(*read[k]), now);
      beat_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return closing_; });
    }
  }

  int rank_, size_;
  std::string host_, pair_address_;
  std::unique_ptr<TcpStore> store_;
  long sequence_ = 0;
  std::mutex channels_mutex_;
  int channels_ = 0;
  std::shared_ptr<gloo::transport::Device> device_;
  mutable std::mutex beat_mutex_;
  std::condition_variable beat_cv_;
  bool closing_ = false;
  BeatBoard board_;
  // Since when the store has not answered a beat (requests under way or failed since).
  std::optional<std::chrono::steady_clock::time_point> unanswered_;
  std::atomic<bool> aborting_{false};
  mutable std::mutex timed_out_mutex_;
  std::set<int> timed_out_;  // the processes a wait gave up on (peer_timed_out)
  std::thread beat_thread_;
};

void StoreForGloo::set(const std::string& key, const std::vector<char>& data) { group_.store().set(key, data); }
std::vector<char> StoreForGloo::get(const std::string& key) { return group_.wait_for(key, "connecting the channels"); }
void StoreForGloo::wait(const std::vector<std::string>& keys) {
  for (const auto& key : keys) group_.wait_for(key, "connecting the channels");
}

GlooChannel::GlooChannel(std::shared_ptr<EnvGroup> group, std::shared_ptr<gloo::Context> context)
    : group_(std::move(group)), context_(std::move(context)) {
  watcher_ = std::thread([this] { watch(); });
}

GlooChannel::~GlooChannel() {
  {
    std::lock_guard lock(watch_mutex_);
    closing_ = true;
  }
  watch_cv_.notify_all();
  watcher_.join();
}

// Every 100 ms while a wait is in progress: whether to end it (Note [one wait per message]).
void GlooChannel::watch() {
  std::unique_lock lock(watch_mutex_);
  while (!closing_) {
    watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (closing_ || !watched_.buffer || watched_.failure) continue;
    gloo::transport::UnboundBuffer* buffer = watched_.buffer;
    const std::function<bool()> aborted = watched_.aborted;
    const std::string what = watched_.what;
    const int peer = watched_.peer;
    lock.unlock();
    std::exception_ptr failure;
    try {
      if (group_->has_timed_out(peer))  // another wait already gave up on it
        throw CollectiveTimeout(fmt::format("{}: process {} waited for process {} (timeout; DP_TIMEOUT_S sets it)",
                                            what, group_->rank(), peer));
      group_->check_peers(what);  // a store request: not under the lock
      if (aborted && aborted())
        throw CollectiveAborted(fmt::format("{}: aborted while waiting for another process", what));
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure && watched_.buffer == buffer) {
      watched_.failure = failure;
      if (watched_.receive)
        buffer->abortWaitRecv();
      else
        buffer->abortWaitSend();
    }
  }
}

bool GlooChannel::wait_for_message(gloo::transport::UnboundBuffer& buffer, bool receive, int peer,
                                   std::chrono::steady_clock::time_point start, const std::function<bool()>& aborted,
                                   std::string_view what, std::exception_ptr& failure) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(group_->timeout() -
                                                                          (std::chrono::steady_clock::now() - start));
  const auto timed_out = [&] {
    group_->peer_timed_out(peer);
    return std::make_exception_ptr(CollectiveTimeout(fmt::format(
        "{}: process {} waited for process {} (timeout; DP_TIMEOUT_S sets it)", what, group_->rank(), peer)));
  };
  if (left.count() <= 0 || group_->has_timed_out(peer)) {
    failure = timed_out();
    return false;
  }
  {
    std::lock_guard lock(watch_mutex_);
    watched_ = Watched{&buffer, receive, aborted, std::string(what), nullptr, peer};
  }
  bool done = false;
  std::string io_error;
  try {
    done = receive ? buffer.waitRecv(nullptr, left) : buffer.waitSend(nullptr, left);
  } catch (const gloo::IoException& e) {
    io_error = e.what();
  }
  {
    std::lock_guard lock(watch_mutex_);
    failure = watched_.failure;
    watched_ = Watched{};
  }
  if (done) return true;
  if (!failure)
    failure = io_error.find("Timed out") != std::string::npos || io_error.find("timeout") != std::string::npos
                  ? timed_out()
                  : std::make_exception_ptr(PeerLost(fmt::format("{}: process {}: {}", what, peer,
                                                                 io_error.empty() ? "the wait was ended" : io_error),
                                                     peer));
  return false;
}

void GlooChannel::exchange(std::span<const Message> sends, std::span<const Message> receives,
                           const std::function<bool()>& aborted, std::string_view what) {
  struct Pending {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    bool receive;
    int peer;
  };
  std::vector<Pending> pending;
  try {
    for (const Message& m : receives) {
      if (m.bytes == 0) continue;  // both sides know the size: nothing travels
      pending.push_back({context_->createUnboundBuffer(m.data, m.bytes), true, m.process});
      pending.back().buffer->recv(m.process, static_cast<std::uint64_t>(m.tag));
    }
    for (const Message& m : sends) {
      if (m.bytes == 0) continue;
      pending.push_back({context_->createUnboundBuffer(m.data, m.bytes), false, m.process});
      pending.back().buffer->send(m.process, static_cast<std::uint64_t>(m.tag));
    }
  } catch (const gloo::Exception& e) {
    throw Error(fmt::format("{}: {}", what, e.what()));
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto& p : pending) {
    std::exception_ptr failure;
    if (wait_for_message(*p.buffer, p.receive, p.peer, start, aborted, what, failure)) {
      p.buffer.reset();
      continue;
    }
    std::lock_guard lock(abandoned_mutex_);
    for (auto& q : pending)
      if (q.buffer) abandoned_.push_back(std::move(q.buffer));
    std::rethrow_exception(failure);
  }
}

}  // namespace

bool env_compiled() { return true; }

std::shared_ptr<ProcessGroup> env_process_group(int rank, int size, const std::string& master, int port) {
  return std::make_shared<EnvGroup>(rank, size, master, port);
}

}  // namespace dp::detail
