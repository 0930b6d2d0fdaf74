// mpi_process_group.cpp — the MPI world as a ProcessGroup. Every MPI call is nonblocking and
// completed by polling under one mutex: any worker thread may exchange messages at any time
// (the sim ring's transport runs on the streams' threads) while the main thread runs host
// collectives, and no thread ever blocks inside MPI holding the lock another one needs to make
// progress. Waits give up on abort or after the group's timeout, cancelling their receives.
#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <mpi.h>
#include <mutex>
#include <thread>

#include "beat_board.h"
#include "channel.h"
#include "dp/runtime/error.h"
#include "process_backend.h"

namespace dp::detail {
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(length));
}

void check(int code, std::string_view call) {
  if (code != MPI_SUCCESS) throw Error(fmt::format("{} failed: {}", call, mpi_error_text(code)));
}

// MPI counts are ints: larger messages travel as several, in order (same peer, same tag).
constexpr std::size_t kMaxPiece = std::size_t{1} << 30;

class MpiWorld;

class MpiChannel final : public Channel {
 public:
  MpiChannel(std::shared_ptr<MpiWorld> world, MPI_Comm comm, int max_tag);
  ~MpiChannel() override;
  int max_tag() const override { return max_tag_; }
  void exchange(std::span<const Message> sends, std::span<const Message> receives, const std::function<bool()>& aborted,
                std::string_view what) override;

 private:
  std::shared_ptr<MpiWorld> world_;
  MPI_Comm comm_;
  int max_tag_;
};

class MpiWorld final : public ProcessGroup, public std::enable_shared_from_this<MpiWorld> {
 public:
  MpiWorld() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) throw Error("MPI was initialised outside dp: use dp::ProcessGroup::mpi() to initialise it");
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    // Calls are serialised by mutex_, so SERIALIZED is enough.
    if (provided < MPI_THREAD_SERIALIZED) {
      MPI_Finalize();
      throw Error(fmt::format("MPI provides thread level {} (dp needs MPI_THREAD_SERIALIZED or more)", provided));
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check(MPI_Comm_dup(MPI_COMM_WORLD, &beat_comm_), "MPI_Comm_dup");  // while no other thread uses MPI
    MPI_Comm_set_errhandler(beat_comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(name, &length);
    host_.assign(name, static_cast<std::size_t>(length));
    int* upper = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &found);
    max_tag_ = found && upper ? *upper : 32767;  // the standard's guaranteed minimum
  }
  ~MpiWorld() override {
    stop_beats();
    MPI_Comm_free(&beat_comm_);
    MPI_Comm_free(&comm_);
    MPI_Finalize();
  }

  // The beats travel on a communicator of their own, one small message per peer and beat: each
  // peer has one receive posted and at most one send in flight, so a stopped peer costs nothing
  // but the beats it does not answer.
  void start_beats(std::function<std::string()> status) override {
    std::lock_guard lock(beat_mutex_);
    if (beat_thread_.joinable() || size_ == 1) return;
    board_.start(size_);
    links_ = std::vector<BeatLink>(static_cast<std::size_t>(size_));
    beat_thread_ = std::thread([this, status = std::move(status)] { beat(status); });
  }

  std::vector<PeerBeat> peer_beats() const override {
    std::lock_guard lock(beat_mutex_);
    return board_.peers(rank_, std::chrono::steady_clock::now());
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& host() const override { return host_; }

  // Host collectives work in buffers of their own: a collective that timed out cannot be taken
  // back (MPI forbids freeing its request), so its buffers stay alive for a late peer to write,
  // and the group refuses every later collective.
  void all_gather_bytes(const void* send, std::size_t bytes, void* recv) override {
    if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw InvalidArgument(fmt::format("all_gather of {} bytes per process is too large", bytes));
    auto buffers = std::make_shared<std::vector<unsigned char>>(bytes * (static_cast<std::size_t>(size_) + 1));
    std::memcpy(buffers->data(), send, bytes);
    collective("all_gather between processes", buffers, [&](MPI_Request* request) {
      return MPI_Iallgather(buffers->data(), static_cast<int>(bytes), MPI_BYTE, buffers->data() + bytes,
                            static_cast<int>(bytes), MPI_BYTE, comm_, request);
    });
    std::memcpy(recv, buffers->data() + bytes, bytes * static_cast<std::size_t>(size_));
  }

  void broadcast_bytes(void* data, std::size_t bytes, int root) override {
    if (root < 0 || root >= size_)
      throw InvalidArgument(fmt::format("broadcast root {} is not a process of {}", root, size_));
    if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw InvalidArgument(fmt::format("broadcast of {} bytes is too large", bytes));
    auto buffer = std::make_shared<std::vector<unsigned char>>(bytes);
    std::memcpy(buffer->data(), data, bytes);
    collective("broadcast between processes", buffer, [&](MPI_Request* request) {
      return MPI_Ibcast(buffer->data(), static_cast<int>(bytes), MPI_BYTE, root, comm_, request);
    });
    std::memcpy(data, buffer->data(), bytes);
  }

  [[noreturn]] void abort(int exit_code) override {
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);  // MPI_Abort does not return; if it did, still end this process
  }

  std::unique_ptr<Channel> open_channel() override {
    auto comm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    collective("opening a channel between processes", comm,
               [&](MPI_Request* request) { return MPI_Comm_idup(comm_, comm.get(), request); });
    std::lock_guard lock(mutex_);
    MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN);
    return std::make_unique<MpiChannel>(shared_from_this(), *comm, max_tag_);
  }

  // Starts a nonblocking collective with `start` and waits for it. On a timeout the group is
  // broken for good: the collective stays pending with `keep` (its buffers) alive.
  void collective(std::string_view what, std::shared_ptr<void> keep, const std::function<int(MPI_Request*)>& start) {
    MPI_Request request;
    {
      std::lock_guard lock(mutex_);
      if (broken_) throw Error(fmt::format("{}: the process group is unusable after a collective timed out", what));
      check(start(&request), what);
    }
    std::vector<MPI_Request> requests{request};
    try {
      wait(requests, {}, nullptr, what);
    } catch (...) {
      std::lock_guard lock(mutex_);
      broken_ = true;
      abandoned_.push_back(std::move(keep));
      throw;
    }
  }

  // Polls until every request completed. On abort or timeout of point-to-point messages, receives
  // (is_receive[i]) are cancelled and completed so their buffers are no longer written, sends are
  // released, and the wait throws naming `what`. Collectives (is_receive empty) are left pending:
  // MPI has no way to take one back (collective() keeps their buffers).
  void wait(std::vector<MPI_Request>& requests, const std::vector<bool>& is_receive,
            const std::function<bool()>* aborted, std::string_view what) {
    const auto start = std::chrono::steady_clock::now();
    for (int spin = 0;; ++spin) {
      int done = 0, code = MPI_SUCCESS;
      {
        std::lock_guard lock(mutex_);
        code = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
      }
      if (code != MPI_SUCCESS) {
        if (!is_receive.empty()) give_up(requests, is_receive);  // no buffer written after the throw
        check(code, "MPI_Testall");
      }
      if (done) return;
      const bool stop = aborted && *aborted && (*aborted)();
      const auto waited = std::chrono::steady_clock::now() - start;
      if (stop || waited > timeout()) {
        if (!is_receive.empty()) give_up(requests, is_receive);
        if (stop) throw CollectiveAborted(fmt::format("{}: aborted while waiting for another process", what));
        throw CollectiveTimeout(
            fmt::format("{}: process {} (host {}) waited {} s for its peers (timeout; DP_TIMEOUT_S sets it)", what,
                        rank_, host_, std::chrono::duration_cast<std::chrono::seconds>(waited).count()));
      }
      // Messages usually arrive within microseconds: spin briefly, then back off.
      if (spin < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 20 : 500));
    }
  }

  std::mutex& mutex() { return mutex_; }

 private:
  static constexpr int kBeatBytes = 256;
  // A peer's beats in flight: the receive posted for its next, this process's last one sent.
  struct BeatLink {
    std::array<char, kBeatBytes> in{}, out{};
    MPI_Request receive = MPI_REQUEST_NULL, send = MPI_REQUEST_NULL;
  };

  // About once a second: every arrived beat taken (the last one counts), this process's sent to
  // each peer whose previous one has left.
  void beat(const std::function<std::string()>& status) {
    long long count = 0;
    std::unique_lock lock(beat_mutex_);
    while (!closing_) {
      lock.unlock();
      const std::string mine = BeatBoard::text(++count, status()).substr(0, kBeatBytes - 1);
      lock.lock();
      const auto now = std::chrono::steady_clock::now();
      board_.round(now);
      {
        std::lock_guard mpi(mutex_);
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          BeatLink& link = links_[static_cast<std::size_t>(p)];
          for (;;) {
            int arrived = 0;
            if (link.receive != MPI_REQUEST_NULL && MPI_Test(&link.receive, &arrived, MPI_STATUS_IGNORE) != MPI_SUCCESS)
              break;
            if (arrived) board_.heard(p, std::string_view(link.in.data(), strnlen(link.in.data(), kBeatBytes)), now);
            if (link.receive != MPI_REQUEST_NULL) break;
            link.in.fill(0);
            if (MPI_Irecv(link.in.data(), kBeatBytes, MPI_CHAR, p, 0, beat_comm_, &link.receive) != MPI_SUCCESS) break;
          }
          board_.looked(p, now);
          int sent = 1;
          if (link.send != MPI_REQUEST_NULL && MPI_Test(&link.send, &sent, MPI_STATUS_IGNORE) != MPI_SUCCESS) continue;
          if (!sent) continue;
          link.out.fill(0);
          std::memcpy(link.out.data(), mine.data(), mine.size());
          MPI_Isend(link.out.data(), kBeatBytes, MPI_CHAR, p, 0, beat_comm_, &link.send);
        }
      }
      beat_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return closing_; });
    }
  }

  void stop_beats() {
    {
      std::lock_guard lock(beat_mutex_);
      closing_ = true;
    }
    beat_cv_.notify_all();
    if (!beat_thread_.joinable()) return;
    beat_thread_.join();
    std::lock_guard mpi(mutex_);
    for (BeatLink& link : links_) {
      if (link.receive != MPI_REQUEST_NULL) {
        MPI_Cancel(&link.receive);
        MPI_Wait(&link.receive, MPI_STATUS_IGNORE);  // a cancelled receive completes locally
      }
      if (link.send != MPI_REQUEST_NULL) MPI_Request_free(&link.send);
    }
  }

  void give_up(std::vector<MPI_Request>& requests, const std::vector<bool>& is_receive) {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (requests[i] == MPI_REQUEST_NULL) continue;
      if (i < is_receive.size() && is_receive[i]) {
        MPI_Cancel(&requests[i]);
        MPI_Wait(&requests[i], MPI_STATUS_IGNORE);  // a cancelled receive completes locally
      } else {
        MPI_Request_free(&requests[i]);
      }
    }
  }

  std::mutex mutex_;
  bool broken_ = false;                           // a host collective timed out
  std::vector<std::shared_ptr<void>> abandoned_;  // its buffers, which a late peer may still write
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, max_tag_ = 32767;
  std::string host_;
  mutable std::mutex beat_mutex_;  // before mutex_ where both are held
  std::condition_variable beat_cv_;
  bool closing_ = false;
  BeatBoard board_;
  std::vector<BeatLink> links_;  // by process
  MPI_Comm beat_comm_ = MPI_COMM_NULL;
  std::thread beat_thread_;
};

MpiChannel::MpiChannel(std::shared_ptr<MpiWorld> world, MPI_Comm comm, int max_tag)
    : world_(std::move(world)), comm_(comm), max_tag_(max_tag) {}

MpiChannel::~MpiChannel() {
  std::lock_guard lock(world_->mutex());
  MPI_Comm_free(&comm_);
}

void MpiChannel::exchange(std::span<const Message> sends, std::span<const Message> receives,
                          const std::function<bool()>& aborted, std::string_view what) {
  std::vector<MPI_Request> requests;
  std::vector<bool> is_receive;
  const auto post = [&](const Message& m, bool receive) {
    if (m.tag < 0 || m.tag > max_tag_) throw InvalidArgument(fmt::format("{}: tag {} out of range", what, m.tag));
    auto* bytes = static_cast<unsigned char*>(m.data);
    for (std::size_t done = 0; done < m.bytes || (m.bytes == 0 && done == 0);) {
      const std::size_t piece = std::min(kMaxPiece, m.bytes - done);
      MPI_Request request;
      const int count = static_cast<int>(piece);
      check(receive ? MPI_Irecv(bytes + done, count, MPI_BYTE, m.process, m.tag, comm_, &request)
                    : MPI_Isend(bytes + done, count, MPI_BYTE, m.process, m.tag, comm_, &request),
            receive ? "MPI_Irecv" : "MPI_Isend");
      requests.push_back(request);
      is_receive.push_back(receive);
      done += piece;
      if (m.bytes == 0) break;
    }
  };
  {
    std::lock_guard lock(world_->mutex());
    for (const Message& m : receives) post(m, true);
    for (const Message& m : sends) post(m, false);
  }
  world_->wait(requests, is_receive, &aborted, what);
}

std::mutex g_world_mutex;
std::weak_ptr<MpiWorld> g_world;
bool g_world_ended = false;

}  // namespace

std::shared_ptr<ProcessGroup> mpi_process_group() {
  std::lock_guard lock(g_world_mutex);
  if (auto world = g_world.lock()) return world;
  if (g_world_ended) throw Error("the MPI process group was already finalised in this process (MPI starts once)");
  auto world = std::make_shared<MpiWorld>();
  g_world = world;
  g_world_ended = true;  // once this one dies, MPI is finalised for good
  return world;
}

bool mpi_compiled() { return true; }

}  // namespace dp::detail
