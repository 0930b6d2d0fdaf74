// dp_job.h — how the tools (dp_train, dp_bench) run as one job of several processes under mpirun
// (one per node, each driving its local devices), header-only.
//
// A failure on one process must stop every process, with its exit code, and never leave the others
// waiting. Before the first collective of a run (every file read, every check) and after its last,
// the healthy processes' next host collective is agree(): a failing process joins it with its exit
// code, and every process exits with that code. In between, its peers may be inside a collective
// of the step: a failing process aborts the job (MPI_Abort), and mpirun ends every process within
// seconds. Decisions every process takes alike (a non-finite global loss) need neither.
#pragma once

#include <exception>
#include <fmt/format.h>
#include <memory>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/process_group.h"

namespace dp::tools {

// Thrown where a peer's failure was agreed on: its exit code; the failing process said why.
struct PeerFailed {
  int code;
};

class Job {
 public:
  explicit Job(std::string tool) : tool_(std::move(tool)) {}

  // The processes of the job: the MPI world under mpirun, else this process (throws dp::Error).
  void start() { processes_ = ProcessGroup::from_environment(); }
  // MPI_Finalize (under mpirun), once nothing uses the group any more.
  void end() { processes_.reset(); }

  const std::shared_ptr<ProcessGroup>& processes() const { return processes_; }
  bool primary() const { return !processes_ || processes_->rank() == 0; }
  bool several() const { return processes_ && processes_->size() > 1; }

  // This process's devices, for "global ranks a-b" in messages (ddp: process p holds p*K .. p*K+K-1).
  void set_devices(std::vector<int> ids) { ids_ = std::move(ids); }

  // From here on the processes meet in collectives / they no longer do.
  void collectives_begin() { agreement_next_ = false; }
  void collectives_end() { agreement_next_ = true; }

  // Every process's exit code so far -> the first failing process's (process order), 0 if none.
  int agree(int code) const {
    if (!several()) return code;
    const auto failure = first_failure(*processes_, code);
    if (!failure) return 0;
    if (primary() && failure->process != processes_->rank())
      fmt::print(stderr, "{}: process {} (host {}) failed with exit code {}; every process stops\n", tool_,
                 failure->process, failure->host, failure->exit_code);
    return failure->exit_code;
  }
  // agree(0) at a point every healthy process reaches; PeerFailed when one did not.
  void agree_or_stop() const {
    if (const int code = agree(0); code != 0) throw PeerFailed{code};
  }

  // After this process failed with `code` (its message printed): the job's exit code. Aborts the
  // whole job when the peers may be waiting in a collective this process will never join.
  int failed(int code) const {
    if (!several()) return code;
    if (!agreement_next_) processes_->abort(code);
    return agree(code);
  }

  // " on process 1 of 2 (global ranks 2-3, host node7)", naming the rank of `device` when it is
  // one of this process's; empty in a one-process job.
  std::string where(int device = -1) const {
    if (!several()) return "";
    const int p = processes_->rank(), size = processes_->size();
    const int local = static_cast<int>(ids_.size()), first = p * local;
    if (ids_.empty()) return fmt::format(" on process {} of {} (host {})", p, size, processes_->host());
    for (int l = 0; l < local; ++l)
      if (ids_[static_cast<std::size_t>(l)] == device)
        return fmt::format(" on process {} of {} (global rank {}, device {}, host {})", p, size, first + l, device,
                           processes_->host());
    return fmt::format(" on process {} of {} (global ranks {}-{}, host {})", p, size, first, first + local - 1,
                       processes_->host());
  }
  // where() for a caught exception: a rank's worker failing names that rank.
  std::string where(const std::exception_ptr& error) const {
    int device = -1;
    try {
      std::rethrow_exception(error);
    } catch (const WorkerError& e) {
      device = e.device();
    } catch (...) {
    }
    return where(device);
  }

 private:
  std::string tool_;
  std::shared_ptr<ProcessGroup> processes_;
  std::vector<int> ids_;
  bool agreement_next_ = true;
};

}  // namespace dp::tools
