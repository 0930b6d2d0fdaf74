// dp/runtime/process_group.h — the processes of one training job, as torch.distributed's default group:
// one process per node, each driving the same number of local devices (one worker thread per
// device). Without a launcher the group is this process alone; under `mpirun` it is the MPI world,
// and MPI bootstraps what the communicators need (NCCL's unique id, the sim ring's transport);
// started as torchrun starts processes (env://), a key-value store on process 0 and gloo do.
//
// Global ranks, as torchrun numbers them with --nproc_per_node=K: process p's local device l is
// global rank p * K + l; the world is size() * K ranks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace dp {

enum class ReduceOp { sum, avg };

namespace detail {
class Channel;
}

class ProcessGroup {
 public:
  // This process alone: rank 0 of 1. Everything works as without MPI.
  static std::shared_ptr<ProcessGroup> single();
  // The MPI world (MPI initialised with MPI_THREAD_MULTIPLE on first use and finalised when the
  // last handle dies; MPI cannot be initialised twice in one process, so every call returns the
  // same group). Throws Error when dp was built without MPI.
  static std::shared_ptr<ProcessGroup> mpi();
  // mpi() when this process was started by mpirun (Open MPI, MPICH, PMIx environments); the env://
  // group when RANK, WORLD_SIZE (> 1), MASTER_ADDR and MASTER_PORT are set, as torchrun sets them
  // (process 0 serves a key-value store there; channels are gloo pairs); else single(). Throws
  // Error when started by mpirun but built without MPI, InvalidArgument for an env:// launch that
  // cannot be joined (torchrun's elastic agent, a missing variable, dp built without gloo).
  static std::shared_ptr<ProcessGroup> from_environment();
  // Whether this build of dp contains the MPI process group.
  static bool mpi_compiled();

  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // This process's host name (messages name the failing rank and host).
  virtual const std::string& host() const = 0;

  // Host-side collectives: every process calls them in the same order from one thread each;
  // they block until all have arrived (or the timeout passes: Error naming the operation).
  // recv = the processes' `bytes` bytes of send, in process order (size() * bytes).
  virtual void all_gather_bytes(const void* send, std::size_t bytes, void* recv) = 0;
  // data = root's data on every process.
  virtual void broadcast_bytes(void* data, std::size_t bytes, int root) = 0;
  void barrier();

  template <class T>
  std::vector<T> all_gather(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::vector<T> out(static_cast<std::size_t>(size()));
    all_gather_bytes(&value, sizeof(T), out.data());
    return out;
  }
  // Every process's values (the same count on each), concatenated in process order.
  template <class T>
  std::vector<T> all_gather(std::span<const T> values) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::vector<T> out(values.size() * static_cast<std::size_t>(size()));
    all_gather_bytes(values.data(), values.size_bytes(), out.data());
    return out;
  }

  // Ends every process of the job now with `exit_code` (MPI_Abort: peers blocked in collectives
  // are killed by the launcher instead of waiting for this one). single(): std::_Exit(exit_code).
  [[noreturn]] virtual void abort(int exit_code) = 0;

  // How long a collective waits for another process before it fails (default 10 minutes, or
  // DP_TIMEOUT_S from the environment). A process that died without MPI_Abort is noticed by mpirun.
  // After a host collective timed out the group refuses every later one (MPI cannot take it back).
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ms_.store(timeout.count()); }

  // Liveness apart from the collectives (progress.h's watch): once started, the group posts this
  // process's beat about once a second (a counter and the line `status` gives) and reads the
  // others', on a thread of its own, so that a process that is stopped (SIGSTOP, swapped out) or
  // alive without progress is named while the collectives still wait for it. The env:// group
  // beats through its store, the MPI world on a communicator of its own; one process has no peers.
  struct PeerBeat {
    int process = 0;
    double silent_s = 0.0;  // since its counter last moved (or, process 0 serving the store, since it last answered)
    std::string status;     // what it last said of itself
  };
  virtual void start_beats(std::function<std::string()> /*status*/) {}
  // Every other process's last beat (empty before start_beats, or without beats).
  virtual std::vector<PeerBeat> peer_beats() const { return {}; }

  // For the runtime's communicators: a point-to-point channel between the processes, separate
  // from every other channel's messages. Collective: every process opens its channels in the same
  // order (as communicators are created).
  virtual std::unique_ptr<detail::Channel> open_channel() = 0;

 protected:
  ProcessGroup();

 private:
  std::atomic<std::int64_t> timeout_ms_;  // read by the threads that wait for messages
};

// Failure agreement at a point every process reaches (before the first collective of a job, after
// its last): each passes its exit code so far (0: fine; kStopWithoutError: this process stops
// without a failure, e.g. it printed --help); every process learns the first process (in process
// order) that stops, so all stop alike instead of waiting for it.
inline constexpr int kStopWithoutError = -1;
struct ProcessFailure {
  int process = 0;
  int exit_code = 0;
  std::string host;
};
std::optional<ProcessFailure> first_failure(ProcessGroup& processes, int exit_code);

// torch's reduce_value for logging: the sum (or mean) over every global rank of a value each rank
// holds; `local` holds this process's ranks' values in local rank order, the same count on every
// process. Summed in double in global rank order, so every process (and a one-process run with
// the same ranks) gets the same bits.
double reduce_value(ProcessGroup& processes, std::span<const double> local, ReduceOp op = ReduceOp::avg);

}  // namespace dp
