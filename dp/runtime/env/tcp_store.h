// tcp_store.h — the key-value store of an env:// job, as c10d's TCPStore: process 0 serves it on
// MASTER_ADDR:MASTER_PORT, every process (0 included, in process) sets and reads keys. The job's
// host collectives and the rendezvous of its gloo pairs go through it. A process whose connection
// drops before it said goodbye is recorded under kDeadKey, so that the others stop waiting for it.
// Private to the runtime.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dp::detail {

class TcpStore {
 public:
  static constexpr const char* kDeadKey = "dp/dead";
  // rank 0 listens on `port` (every interface); the others connect to host:port, retrying until
  // `timeout` passes (Error naming the address then).
  TcpStore(const std::string& host, int port, int rank, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  std::optional<std::vector<char>> try_get(const std::string& key);
  void erase(const std::string& key);

 private:
  struct Server;
  // A request to the server (not on rank 0): op, key, value; the reply's value, if any.
  std::optional<std::vector<char>> request(char op, const std::string& key, const std::vector<char>& value);

  int rank_;
  std::unique_ptr<Server> server_;  // rank 0
  int socket_ = -1;                 // the others
  std::mutex socket_mutex_;
};

}  // namespace dp::detail
