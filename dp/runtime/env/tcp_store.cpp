// tcp_store.cpp — a small blocking-socket server (a thread per connected process) and its client.
// Requests: op byte, key (u32 length + bytes), for 'S' a value (u32 length + bytes); replies: 'k',
// or for 'G' 'f' + value or 'n'. 'H' carries the connecting process's rank as its key, 'B' is its
// goodbye.
#include "tcp_store.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dp/runtime/error.h"

namespace dp::detail {
namespace {

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

bool read_all(int fd, void* data, std::size_t bytes) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
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

bool read_blob(int fd, std::vector<char>& out) {
  std::uint32_t length = 0;
  if (!read_all(fd, &length, sizeof length) || length > (1u << 30)) return false;
  out.resize(length);
  return read_all(fd, out.data(), length);
}

}  // namespace

struct TcpStore::Server {
  std::mutex mutex;
  std::map<std::string, std::vector<char>> values;
  int listener = -1;
  std::vector<int> clients;
  std::vector<std::thread> threads;
  std::thread acceptor;
  bool stopping = false;

  explicit Server(int port) {
    listener = ::socket(AF_INET6, SOCK_STREAM, 0);
    const bool v6 = listener >= 0;
    if (!v6) listener = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listener < 0) throw Error(fmt::format("env:// store: socket: {}", std::strerror(errno)));
    const int one = 1, zero = 0;
    ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int bound = -1;
    if (v6) {
      ::setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 clients too
      sockaddr_in6 address{};
      address.sin6_family = AF_INET6;
      address.sin6_addr = in6addr_any;
      address.sin6_port = htons(static_cast<std::uint16_t>(port));
      bound = ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address);
    } else {
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_ANY);
      address.sin_port = htons(static_cast<std::uint16_t>(port));
      bound = ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address);
    }
    if (bound != 0 || ::listen(listener, 128) != 0) {
      const std::string why = std::strerror(errno);
      ::close(listener);
      throw Error(fmt::format("env:// store: process 0 cannot listen on port {} (MASTER_PORT): {}", port, why));
    }
    acceptor = std::thread([this] { accept_loop(); });
  }

  ~Server() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
      for (int fd : clients) ::shutdown(fd, SHUT_RDWR);
    }
    ::shutdown(listener, SHUT_RDWR);
    ::close(listener);
    acceptor.join();
    for (auto& t : threads) t.join();
    for (int fd : clients) ::close(fd);
  }

  void accept_loop() {
    for (;;) {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) {
        if (errno == EINTR) continue;
        return;  // shut down
      }
      std::lock_guard lock(mutex);
      if (stopping) {
        ::close(fd);
        return;
      }
      clients.push_back(fd);
      threads.emplace_back([this, fd] { serve(fd); });
    }
  }

  // One process's requests until it says goodbye or its connection drops (then it is dead).
  void serve(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::string rank = "?";
    std::vector<char> key, value;
    for (;;) {
      char op = 0;
      if (!read_all(fd, &op, 1) || !read_blob(fd, key)) break;
      const std::string k(key.begin(), key.end());
      if (op == 'B') {
        write_all(fd, "k", 1);
        return;
      }
      if (op == 'S' && !read_blob(fd, value)) break;
      char reply = 'k';
      std::vector<char> found;
      {
        std::lock_guard lock(mutex);
        if (op == 'S') {
          values[k] = value;
        } else if (op == 'D') {
          values.erase(k);
        } else if (op == 'H') {
          rank = k;
        } else if (op == 'G') {
          const auto it = values.find(k);
          reply = it == values.end() ? 'n' : 'f';
          if (it != values.end()) found = it->second;
        }
      }
      if (!write_all(fd, &reply, 1) || (reply == 'f' && !write_blob(fd, found.data(), found.size()))) break;
    }
    std::lock_guard lock(mutex);
    if (!stopping && !values.count(kDeadKey)) values[kDeadKey] = std::vector<char>(rank.begin(), rank.end());
  }
};

TcpStore::TcpStore(const std::string& host, int port, int rank, std::chrono::milliseconds timeout) : rank_(rank) {
  if (rank == 0) {
    server_ = std::make_unique<Server>(port);
    return;
  }
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
      throw Error(
          fmt::format("env:// store: process {} cannot reach process 0 at {}:{} (MASTER_ADDR:MASTER_PORT) "
                      "within {} s: {}",
                      rank, host, port, std::chrono::duration_cast<std::chrono::seconds>(timeout).count(), last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  request('H', std::to_string(rank), {});
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

std::optional<std::vector<char>> TcpStore::request(char op, const std::string& key, const std::vector<char>& value) {
  std::lock_guard lock(socket_mutex_);
  char reply = 0;
  std::vector<char> found;
  const bool ok = write_all(socket_, &op, 1) && write_blob(socket_, key.data(), key.size()) &&
                  (op != 'S' || write_blob(socket_, value.data(), value.size())) && read_all(socket_, &reply, 1) &&
                  (reply != 'f' || read_blob(socket_, found));
  if (!ok) throw Error(fmt::format("env:// store: process {} lost its connection to process 0", rank_));
  if (reply == 'f') return found;
  return std::nullopt;
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  if (server_) {
    std::lock_guard lock(server_->mutex);
    server_->values[key] = value;
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
    server_->values.erase(key);
    return;
  }
  request('D', key, {});
}

}  // namespace dp::detail
