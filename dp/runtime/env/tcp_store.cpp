// tcp_store.cpp — a small blocking-socket server (a thread per connection) and its client; the
// wire format is store_protocol.h's, the security model Note [store security] (tcp_store.h).
#include "tcp_store.h"

#include <arpa/inet.h>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <poll.h>
#include <set>
#include <sys/socket.h>
#include <sys/time.h>
#include <thread>
#include <unistd.h>

#include "dp/runtime/error.h"
#include "store_protocol.h"

namespace dp::detail {

// A wait's end: `limit_ms` after `start`, read anew while it lasts, so that a limit lowered meanwhile
// (TcpStore::limit_wait, by a process that aborts) also cuts a wait already under way.
struct Limit {
  std::chrono::steady_clock::time_point start;
  const std::atomic<long long>* limit_ms = nullptr;
  long long cap_ms = 0;  // a shorter wait of the caller's own (0: none)
  std::chrono::steady_clock::time_point end() const {
    const long long ms = cap_ms > 0 ? std::min(cap_ms, limit_ms->load()) : limit_ms->load();
    return start + std::chrono::milliseconds(ms);
  }
};
namespace {

// Connections that have not said hello yet, at most: more are closed as they come (a flood).
constexpr int kMaxStrangers = 16;
// The store's total (keys and values): a job's host collectives keep a few small values at a time;
// a connection that would store more is dropped (a stranger in a free rank slot cannot fill memory).
constexpr std::size_t kMaxStoredBytes = std::size_t{64} << 20;

bool write_all(int fd, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

using Deadline = std::optional<Limit>;

// `bytes` bytes from `fd`; with a deadline, all of them before it (a peer that trickles a byte
// at a time gets no longer than one that is silent): false, errno EAGAIN, when it passes.
bool read_all(int fd, void* data, std::size_t bytes, Deadline deadline = std::nullopt) {
  auto* p = static_cast<char*>(data);
  constexpr long long kSliceMs = 100;  // how soon a lowered limit is seen
  while (bytes > 0) {
    if (deadline) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline->end() - std::chrono::steady_clock::now());
      pollfd ready{fd, POLLIN, 0};
      const int polled =
          left.count() > 0 ? ::poll(&ready, 1, static_cast<int>(std::min<long long>(left.count(), kSliceMs))) : 0;
      if (polled < 0 && errno == EINTR) continue;
      if (polled == 0 && left.count() > kSliceMs) continue;
      if (polled == 0) {
        errno = EAGAIN;
        return false;
      }
    }
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = ECONNRESET;  // the peer closed: a loss, never the EAGAIN an earlier call left
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool write_blob(int fd, const void* data, std::size_t bytes) {
  const auto length = static_cast<std::uint32_t>(bytes);
  return write_all(fd, &length, sizeof length) && write_all(fd, data, bytes);
}

store::ReadExact reader(int fd, Deadline deadline = std::nullopt) {
  return [fd, deadline](void* data, std::size_t bytes) { return read_all(fd, data, bytes, deadline); };
}

// Reads and writes on `fd` give up after `timeout` (0: never).
void set_timeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// A listening socket on host:port, the first of host's addresses that this machine has.
int listen_on(const std::string& host, int port) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  if (const int error = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); error != 0)
    throw Error(fmt::format("env:// store: process 0 cannot resolve MASTER_ADDR {}: {}", host, gai_strerror(error)));
  std::string why = "no address";
  int listener = -1;
  for (addrinfo* a = found; a && listener < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      listener = fd;
    } else {
      why = errno == EADDRNOTAVAIL ? "MASTER_ADDR is not an address of this machine, where process 0 runs"
                                   : std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  if (listener < 0)
    throw Error(
        fmt::format("env:// store: process 0 cannot listen on {}:{} (MASTER_ADDR:MASTER_PORT): {}", host, port, why));
  return listener;
}

}  // namespace

struct TcpStore::Server {
  std::mutex mutex;
  std::condition_variable ended;  // a connection's thread ended
  std::map<std::string, std::vector<char>> values;
  std::size_t stored_bytes = 0;  // of `values`, keys included
  int listener = -1;
  int world_size;
  std::string token;
  std::set<int> ranks_in;  // ranks that said hello and have not said goodbye
  std::set<int> fds;       // open connections
  int strangers = 0;       // connections that have not said hello
  // Each stranger's arrival: its whole hello must come within kHelloSeconds (a per-recv limit would
  // let one byte every few seconds hold a slot), and when the slots are full the oldest one leaves
  // for the newcomer, so that slow strangers cannot keep the job's processes out.
  std::map<int, std::chrono::steady_clock::time_point> stranger_since;
  int token_refusals = 0;  // warned about (the first few)
  int threads = 0;         // connection threads running
  std::thread acceptor;
  bool stopping = false;

  Server(const std::string& host, int port, int world, std::string job_token)
      : listener(listen_on(host, port)), world_size(world), token(std::move(job_token)) {
    if (host == "0.0.0.0" || host == "::" || host == "[::]")
      std::fprintf(stderr,
                   "dp: warning: MASTER_ADDR %s: process 0 listens for the job on every interface of this host%s\n",
                   host.c_str(), token.empty() ? "; anyone who reaches the port may join: set DP_JOB_TOKEN" : "");
    acceptor = std::thread([this] { accept_loop(); });
  }

  ~Server() {
    std::unique_lock lock(mutex);
    stopping = true;
    for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
    ::shutdown(listener, SHUT_RDWR);
    lock.unlock();
    acceptor.join();
    ::close(listener);
    lock.lock();
    ended.wait(lock, [this] { return threads == 0; });
  }

  // values[key] = value, counted in stored_bytes; false (nothing stored) when `bounded` and the
  // store would pass kMaxStoredBytes. Under the mutex.
  bool put(const std::string& key, std::vector<char> value, bool bounded) {
    const auto it = values.find(key);
    const std::size_t old = it == values.end() ? 0 : key.size() + it->second.size();
    const std::size_t total = stored_bytes - old + key.size() + value.size();
    if (bounded && total > kMaxStoredBytes) return false;
    stored_bytes = total;
    values[key] = std::move(value);
    return true;
  }
  void remove(const std::string& key) {
    if (const auto it = values.find(key); it != values.end()) {
      stored_bytes -= key.size() + it->second.size();
      values.erase(it);
    }
  }

  // Shuts the connections of strangers past their hello's deadline (their reads then fail).
  void expire_strangers() {
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [fd, since] : stranger_since)
      if (now - since > std::chrono::seconds(TcpStore::kHelloSeconds)) ::shutdown(fd, SHUT_RDWR);
  }

  void accept_loop() {
    for (;;) {
      pollfd ready{listener, POLLIN, 0};
      const int polled = ::poll(&ready, 1, 250);
      {
        std::lock_guard lock(mutex);
        expire_strangers();
        if (stopping) return;
      }
      if (polled == 0 || (polled < 0 && errno == EINTR)) continue;
      const int fd = ::accept(listener, nullptr, nullptr);
      std::lock_guard lock(mutex);
      if (stopping) {
        if (fd >= 0) ::close(fd);
        return;
      }
      if (fd < 0) {
        // Out of descriptors (or a connection gone before it was taken): later ones may be served.
        if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
            errno == ENOMEM || errno == EPROTO) {
          if (errno != EINTR && errno != ECONNABORTED) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          continue;
        }
        return;  // the listener was shut down
      }
      if (strangers >= kMaxStrangers && !stranger_since.empty()) {
        // The oldest stranger leaves: a newcomer (maybe a process of the job) always gets a slot.
        auto oldest = stranger_since.begin();
        for (auto it = stranger_since.begin(); it != stranger_since.end(); ++it)
          if (it->second < oldest->second) oldest = it;
        ::shutdown(oldest->first, SHUT_RDWR);
        stranger_since.erase(oldest);
      }
      ++strangers;
      stranger_since[fd] = std::chrono::steady_clock::now();
      ++threads;
      fds.insert(fd);
      std::thread([this, fd] { serve(fd); }).detach();
    }
  }

  // A refusal the connecting process reads before its connection closes.
  static void refuse(int fd, const std::string& reason) {
    if (write_all(fd, "r", 1)) write_blob(fd, reason.data(), std::min(reason.size(), store::kMaxReasonBytes));
  }

  // The connection's hello: its rank once accepted, or -1 (refused, or not a dp process at all).
  int hello(int fd) {
    set_timeouts(fd, std::chrono::seconds(kHelloSeconds));
    store::Request request;
    store::Hello hello;
    if (!store::read_request(reader(fd), true, request)) return -1;
    if (!token.empty() || !request.value.empty()) {
      if (!store::same_token(request.value, token)) {
        refuse(fd, "its DP_JOB_TOKEN differs from process 0's");
        // Said here too: a process of the job started without process 0's token (or with one that
        // process 0 lacks) would otherwise leave process 0 waiting silently until DP_TIMEOUT_S.
        std::lock_guard lock(mutex);
        if (token_refusals++ < 3)
          std::fprintf(stderr,
                       "dp: warning: env:// store: process 0 refused a connection whose DP_JOB_TOKEN %s (a process "
                       "of this job started with another DP_JOB_TOKEN, or a stranger)\n",
                       token.empty() ? "is set while process 0 has none" : "differs from process 0's");
        return -1;
      }
    }
    if (!store::parse_hello_key(request.key, hello)) return -1;
    std::string refused;
    {
      std::lock_guard lock(mutex);
      if (hello.world_size != world_size) {
        refused =
            fmt::format("process {} has WORLD_SIZE {}, process 0 has {}", hello.rank, hello.world_size, world_size);
        if (!values.count(kRefusedKey)) put(kRefusedKey, std::vector<char>(refused.begin(), refused.end()), false);
      } else if (hello.rank < 1 || hello.rank >= world_size) {
        refused =
            fmt::format("RANK {} is not a rank of a job of WORLD_SIZE {} served by process 0", hello.rank, world_size);
      } else if (!ranks_in.insert(hello.rank).second) {
        refused = fmt::format("RANK {} is already in the job: two processes were started with RANK={}", hello.rank,
                              hello.rank);
      }
    }
    if (!refused.empty()) {
      refuse(fd, refused);
      return -1;
    }
    set_timeouts(fd, std::chrono::milliseconds(0));  // a process may wait long between requests
    // A reply that cannot be sent leaves a connection that fails at its next read: the process is
    // in the job from here on, and then gone.
    if (write_all(fd, "h", 1)) write_blob(fd, store::kMagic, std::strlen(store::kMagic));
    return hello.rank;
  }

  // One connection: its hello, then its requests until it says goodbye or drops (then, if it was a
  // process of the job, it is dead).
  void serve(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const int rank = hello(fd);
    {
      std::lock_guard lock(mutex);
      --strangers;
      stranger_since.erase(fd);
    }
    const bool goodbye = rank >= 0 && serve_requests(fd);
    std::lock_guard lock(mutex);
    if (rank >= 0 && !goodbye && !stopping && !values.count(kDeadKey)) {
      const std::string who = std::to_string(rank);
      put(kDeadKey, std::vector<char>(who.begin(), who.end()), false);
    }
    if (rank >= 0 && goodbye) ranks_in.erase(rank);
    fds.erase(fd);
    ::close(fd);
    --threads;
    ended.notify_all();
  }

  // Serves requests until a goodbye (true) or the connection drops or breaks the protocol (false).
  bool serve_requests(int fd) {
    store::Request request;
    while (store::read_request(reader(fd), false, request)) {
      if (request.op == 'B') {
        write_all(fd, "k", 1);
        return true;
      }
      char reply = 'k';
      std::vector<char> found;
      {
        std::lock_guard lock(mutex);
        if (request.op == 'S') {
          if (!put(request.key, std::move(request.value), true)) return false;  // dropped: kMaxStoredBytes
        } else if (request.op == 'D') {
          remove(request.key);
        } else if (request.op == 'G') {
          const auto it = values.find(request.key);
          reply = it == values.end() ? 'n' : 'f';
          if (it != values.end()) found = it->second;
        }
      }
      if (!write_all(fd, &reply, 1) || (reply == 'f' && !write_blob(fd, found.data(), found.size()))) return false;
    }
    return false;
  }
};

TcpStore::TcpStore(const std::string& host, int port, int rank, int world_size, const std::string& token,
                   std::chrono::milliseconds timeout)
    : rank_(rank), timeout_ms_(timeout.count()) {
  if (rank == 0) {
    server_ = std::make_unique<Server>(host, port, world_size, token);
    return;
  }
  connect_to(host, port, timeout);
  try {
    say_hello(host, port, world_size, token);
  } catch (...) {
    ::close(socket_);
    socket_ = -1;
    throw;
  }
}

void TcpStore::connect_to(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last_error = "no address";
  while (socket_ < 0) {
    addrinfo hints{}, *found = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) == 0) {
      for (addrinfo* a = found; a && socket_ < 0; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          socket_ = fd;
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(found);
    } else {
      last_error = "cannot resolve the host";
    }
    if (socket_ >= 0) break;
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(fmt::format(
          "env:// store: process {} cannot reach process 0 at {}:{} (MASTER_ADDR:MASTER_PORT) "
          "within {} s: {}",
          rank_, host, port, std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  set_timeouts(socket_, timeout);  // every reply, from the hello on, within the job's timeout
}

void TcpStore::say_hello(const std::string& host, int port, int world_size, const std::string& token) {
  const std::string key = store::hello_key(rank_, world_size);
  char reply = 0;
  std::vector<char> text;
  const bool sent = write_all(socket_, "H", 1) && write_blob(socket_, key.data(), key.size()) &&
                    write_blob(socket_, token.data(), token.size());
  const Deadline deadline = Limit{std::chrono::steady_clock::now(), &timeout_ms_};
  const bool answered = sent && read_all(socket_, &reply, 1, deadline) && (reply == 'h' || reply == 'r') &&
                        store::read_blob(reader(socket_, deadline), store::kMaxReasonBytes, text);
  const std::string answer(text.begin(), text.end());
  if (answered && reply == 'h' && answer == store::kMagic) return;
  if (answered && reply == 'r')
    throw Error(fmt::format("env:// store: process 0 refused process {}: {}", rank_, answer));
  throw Error(fmt::format(
      "env:// store: process {} reached {}:{} (MASTER_ADDR:MASTER_PORT), but what answers there is not process 0 "
      "of a dp job{}: is the port another program's?",
      rank_, host, port,
      sent && reply == 0 ? fmt::format(" (no answer within {} s)", wait_limit().count() / 1000) : ""));
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) {
    try {
      request('B', "", {});
    } catch (...) {
    }
    ::close(socket_);
  }
}

// Under socket_mutex_: the answers that brief requests left unread, read and dropped, then this
// request sent and its answer read, all before `deadline`.
TcpStore::Answer TcpStore::ask(char op, const std::string& key, const std::vector<char>& value, const Limit& deadline) {
  Answer a;
  const auto read_answer = [&] {
    a.found.clear();
    const bool ok = read_all(socket_, &a.reply, 1, deadline) && (a.reply == 'k' || a.reply == 'n' || a.reply == 'f') &&
                    (a.reply != 'f' || store::read_blob(reader(socket_, deadline), store::kMaxValueBytes, a.found));
    a.timed_out = !ok && (errno == EAGAIN || errno == EWOULDBLOCK);
    return ok;
  };
  for (; owed_ > 0; --owed_)
    if (!read_answer()) return a;
  a.sent = write_all(socket_, &op, 1) && write_blob(socket_, key.data(), key.size()) &&
           (op != 'S' || write_blob(socket_, value.data(), value.size()));
  if (!a.sent) {
    a.timed_out = false;  // a request cut off midway: the connection is of no more use
    return a;
  }
  a.ok = read_answer();
  return a;
}

std::optional<std::vector<char>> TcpStore::request(char op, const std::string& key, const std::vector<char>& value) {
  std::lock_guard lock(socket_mutex_);
  Answer a = ask(op, key, value, Limit{std::chrono::steady_clock::now(), &timeout_ms_});
  if (!a.ok) {
    const std::string message = fmt::format(
        "env:// store: process {} {}", rank_,
        a.timed_out ? fmt::format("had no answer from process 0 within {} s (timeout; DP_TIMEOUT_S sets it)",
                                  wait_limit().count() / 1000)
                    : std::string("lost its connection to process 0"));
    if (a.timed_out) throw CollectiveTimeout(message);
    throw PeerLost(message, 0);  // the store is process 0's
  }
  if (a.reply == 'f') return std::move(a.found);
  return std::nullopt;
}

bool TcpStore::try_brief(const std::string& key, const std::vector<char>& value, const std::vector<std::string>& keys,
                         std::vector<std::optional<std::vector<char>>>& values, std::chrono::milliseconds limit) {
  values.assign(keys.size(), std::nullopt);
  if (server_) {
    set(key, value);
    for (std::size_t i = 0; i < keys.size(); ++i) values[i] = try_get(keys[i]);
    return true;
  }
  // Its turn, tried for `limit` (not std::timed_mutex: ThreadSanitizer does not see its
  // pthread_mutex_clocklock and reports every unlock as of an unlocked mutex).
  std::unique_lock lock(socket_mutex_, std::defer_lock);
  for (const auto until = std::chrono::steady_clock::now() + limit; !lock.try_lock();) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const Limit deadline{std::chrono::steady_clock::now(), &timeout_ms_, std::max<long long>(1, limit.count())};
  for (std::size_t i = 0; i <= keys.size(); ++i) {
    Answer a = i == 0 ? ask('S', key, value, deadline) : ask('G', keys[i - 1], {}, deadline);
    if (!a.ok) {
      if (a.sent && a.timed_out) ++owed_;  // its answer may still come: the next request drops it
      return false;
    }
    if (i > 0 && a.reply == 'f') values[i - 1] = std::move(a.found);
  }
  return true;
}

void TcpStore::limit_wait(std::chrono::milliseconds timeout) {
  // Not under socket_mutex_: a request may hold it, waiting for the process 0 this is about.
  timeout_ms_.store(std::min<long long>(timeout_ms_.load(), timeout.count()));
  if (socket_ >= 0) set_timeouts(socket_, wait_limit());
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  if (key.size() > store::kMaxKeyBytes || value.size() > store::kMaxValueBytes)
    throw InvalidArgument(fmt::format("env:// store: key '{}' of {} bytes is larger than the store takes",
                                      key.substr(0, 64), value.size()));
  if (server_) {
    std::lock_guard lock(server_->mutex);
    server_->put(key, value, false);  // process 0's own: the job's, unbounded
    return;
  }
  request('S', key, value);
}

std::optional<std::vector<char>> TcpStore::try_get(const std::string& key) {
  if (server_) {
    std::lock_guard lock(server_->mutex);
    const auto it = server_->values.find(key);
    if (it == server_->values.end()) return std::nullopt;
    return it->second;
  }
  return request('G', key, {});
}

void TcpStore::erase(const std::string& key) {
  if (server_) {
    std::lock_guard lock(server_->mutex);
    server_->remove(key);
    return;
  }
  request('D', key, {});
}

}  // namespace dp::detail
