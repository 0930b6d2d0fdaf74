// dp_job.h — how the tools (dp_train, dp_bench) run as one job of several processes under mpirun
// (one per node, each driving its local devices), header-only.
//
// A failure on one process must stop every process, with its exit code, and never leave the others
// waiting. Before the first collective of a run (the command line, every file read, every check)
// and after its last, the healthy processes' next host collective is an agreement: a failing (or
// --help) process joins it with its exit code, and every process stops with that code. The
// processes also agree that they run one configuration: a node with another checkpoint or data
// set, or other flags, would otherwise run other collectives than its peers and hang them, or
// silently train something else. In between, a peer may be inside a collective of the step: a
// failing process aborts the job (MPI_Abort), and mpirun ends every process within seconds.
// Decisions every process takes alike (a non-finite global loss) need neither.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/runtime/error.h"
#include "dp/runtime/process_group.h"

namespace dp::tools {

// Thrown where every process agreed to stop: the code to exit with (the failing process said why).
struct PeerFailed {
  int code;
};

// FNV-1a: a configuration field's fingerprint (equal texts, equal hashes; no security needed).
inline std::uint64_t fingerprint(std::string_view text) {
  std::uint64_t hash = 14695981039346656037ULL;
  for (const char c : text) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return hash;
}

class Job {
 private:
  // The agreements wait without the collectives' timeout (a year stands for "no limit").
  template <class F>
  auto with_unlimited_wait(F&& f) const {
    const auto saved = processes_->timeout();
    processes_->set_timeout(std::chrono::hours(24 * 365));
    try {
      auto result = f();
      processes_->set_timeout(saved);
      return result;
    } catch (...) {
      processes_->set_timeout(saved);
      throw;
    }
  }

 public:
  explicit Job(std::string tool) : tool_(std::move(tool)) {}

  // The processes of the job: the MPI world under mpirun, else this process (throws dp::Error).
  // First thing in main: every exit after it goes through the agreement.
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

  // Every process's exit code so far (0, a failure, or kStopWithoutError) -> the code every
  // process stops with (the first stopping process's; 0 for a stop without error), or nullopt when
  // all go on. Waits as long as the slowest process needs (a node still loading its data has not
  // failed; one that died is mpirun's to notice).
  std::optional<int> agree(int code) const {
    if (!several()) return code == 0 ? std::nullopt : std::optional<int>(std::max(code, 0));
    const auto failure = with_unlimited_wait([&] { return first_failure(*processes_, code); });
    if (!failure) return std::nullopt;
    if (primary() && failure->process != processes_->rank())
      fmt::print(stderr, "{}: process {} (host {}) {}; every process stops\n", tool_, failure->process, failure->host,
                 failure->exit_code == kStopWithoutError ? "stopped"
                                                         : fmt::format("failed with exit code {}", failure->exit_code));
    return std::max(failure->exit_code, 0);
  }
  // agree(0) at a point every healthy process reaches; PeerFailed when one stops.
  void agree_or_stop() const {
    if (const auto code = agree(0)) throw PeerFailed{*code};
  }

  // Every process must run the configuration process 0 runs: each (name, value) field is compared
  // by fingerprint; a difference stops every process with exit code 2, process 0 naming the fields
  // and the processes that differ.
  void agree_on_configuration(const std::vector<std::pair<std::string, std::string>>& fields) const {
    if (!several()) return;
    std::vector<std::uint64_t> mine;
    for (const auto& field : fields) mine.push_back(fingerprint(field.first + '=' + field.second));
    const auto all = with_unlimited_wait([&] { return processes_->all_gather(std::span<const std::uint64_t>(mine)); });
    std::vector<std::string> differences;
    for (std::size_t f = 0; f < fields.size(); ++f) {
      std::vector<int> others;
      for (int p = 1; p < processes_->size(); ++p)
        if (all[static_cast<std::size_t>(p) * fields.size() + f] != all[f]) others.push_back(p);
      if (!others.empty())
        differences.push_back(fmt::format("{} (process 0: '{}'; differs on process {})", fields[f].first,
                                          fields[f].second, fmt::join(others, ", ")));
    }
    if (differences.empty()) return;
    if (primary())
      fmt::print(stderr,
                 "{}: error: the processes of this job do not run one configuration: {}. Start every process "
                 "with the same flags, checkpoint and data\n",
                 tool_, fmt::join(differences, "; "));
    throw PeerFailed{2};
  }

  // After this process failed with `code` (its message printed): the job's exit code. Aborts the
  // whole job when the peers may be waiting in a collective this process will never join, or when
  // the agreement itself cannot be had. Never throws.
  int failed(int code) const noexcept {
    if (!several()) return code;
    if (agreement_next_) {
      try {
        return agree(code).value_or(code);
      } catch (const std::exception& e) {
        fmt::print(stderr, "{}: error{}: {}\n", tool_, where(), e.what());
      } catch (...) {
      }
    }
    processes_->abort(code);
    return code;  // not reached: abort ends the process
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
