// tcp_store.h — the key-value store of an env:// job, as c10d's TCPStore: process 0 serves it on
// MASTER_ADDR:MASTER_PORT, every process (0 included, in process) sets and reads keys. The job's
// host collectives and the rendezvous of its gloo pairs go through it. Private to the runtime.
//
// Note [store security]
// The store listens on MASTER_ADDR's address only (loopback when it is loopback), and a connection
// counts for nothing until it says hello (store_protocol.h) within kHelloSeconds: a port scanner,
// a health probe, a stranger's garbage or a flood of connections is dropped without touching the
// job, and every request is bounded (no allocation beyond store::kMaxValueBytes). A hello names its
// rank and world size: a second process with a rank already in the job, or one with another
// WORLD_SIZE, is refused, naming why (the latter is recorded under kRefusedKey, so the job ends at
// once instead of waiting for a process that will not come). With DP_JOB_TOKEN set, a hello must
// carry it: no one without it can read a key, stand in for a rank or forge an abort. Without a
// token, anyone who can reach the port and speaks this protocol can: set one wherever others share
// the network (a Kubernetes secret, a Slurm job's environment). Only a process that said hello and
// then drops its connection without a goodbye is recorded under kDeadKey, so that the others stop
// waiting for it. Clients give up on any reply that takes longer than the job's timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dp::detail {

struct Limit;  // a request's deadline (tcp_store.cpp)

class TcpStore {
 public:
  static constexpr const char* kDeadKey = "dp/dead";
  static constexpr const char* kRefusedKey = "dp/refused";
  static constexpr int kHelloSeconds = 5;
  // rank 0 listens on host:port (host: MASTER_ADDR, an address of its machine); the others connect
  // to it, retrying until `timeout` passes, and say hello (Error naming the address and the cause
  // otherwise). `token`: DP_JOB_TOKEN, empty for none.
  TcpStore(const std::string& host, int port, int rank, int world_size, const std::string& token,
           std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<char>& value);
  std::optional<std::vector<char>> try_get(const std::string& key);
  void erase(const std::string& key);
  // For a caller that must never hold up the job's own requests for long (the processes' beats):
  // sets `key` and reads `keys` (into `values`), waiting at most `limit` for its turn and `limit`
  // for all the answers; false when its turn or an answer did not come (a late answer is read and
  // dropped by the next request).
  bool try_brief(const std::string& key, const std::vector<char>& value, const std::vector<std::string>& keys,
                 std::vector<std::optional<std::vector<char>>>& values, std::chrono::milliseconds limit);
  // From here on, a request waits at most `timeout` for its answer (an aborting process tells
  // process 0 within moments, or not at all).
  void limit_wait(std::chrono::milliseconds timeout);

 private:
  struct Server;
  void connect_to(const std::string& host, int port, std::chrono::milliseconds timeout);
  void say_hello(const std::string& host, int port, int world_size, const std::string& token);
  // A request to the server (not on rank 0): op, key, value; the reply's value, if any.
  std::optional<std::vector<char>> request(char op, const std::string& key, const std::vector<char>& value);
  struct Answer {
    bool sent = false, ok = false, timed_out = false;
    char reply = 0;
    std::vector<char> found;
  };
  Answer ask(char op, const std::string& key, const std::vector<char>& value, const Limit& deadline);

  int rank_;
  std::chrono::milliseconds wait_limit() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  std::atomic<long long> timeout_ms_;  // a request's wait for its answer (limit_wait may lower it)
  std::unique_ptr<Server> server_;     // rank 0
  int socket_ = -1;                    // the others
  std::timed_mutex socket_mutex_;      // timed: a brief request waits for it only so long
  int owed_ = 0;                       // answers of brief requests not read yet (under socket_mutex_)
};

}  // namespace dp::detail
