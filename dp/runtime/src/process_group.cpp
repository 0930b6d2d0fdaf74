// process_group.cpp — the one-process group, what every group shares (timeout, barrier,
// reduce_value), and the choice between one process and the MPI world.
#include "dp/runtime/process_group.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <string>
#include <unistd.h>

#include "channel.h"
#include "dp/runtime/error.h"
#include "process_backend.h"

namespace dp {
namespace {

std::chrono::milliseconds default_timeout() {
  if (const char* text = std::getenv("DP_TIMEOUT_S"); text && *text) {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    if (*end != '\0' || !(seconds > 0.0) || seconds > 1e9)
      throw InvalidArgument(fmt::format("DP_TIMEOUT_S='{}' is not a positive number of seconds", text));
    return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
  }
  return std::chrono::minutes(10);
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown host";
  return name;
}

// No peers: a channel would only ever talk to itself, which no communicator does.
class NoChannel final : public detail::Channel {
 public:
  int max_tag() const override { return 0; }
  void exchange(std::span<const Message> sends, std::span<const Message> receives, const std::function<bool()>&,
                std::string_view what) override {
    if (!sends.empty() || !receives.empty())
      throw Error(fmt::format("{}: a one-process group has no other process to exchange with", what));
  }
};

class SingleProcess final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& host() const override { return host_; }
  void all_gather_bytes(const void* send, std::size_t bytes, void* recv) override {
    if (bytes) std::memmove(recv, send, bytes);
  }
  void broadcast_bytes(void*, std::size_t, int root) override {
    if (root != 0) throw InvalidArgument(fmt::format("broadcast root {} in a group of one process", root));
  }
  [[noreturn]] void abort(int exit_code) override { std::_Exit(exit_code); }
  std::unique_ptr<detail::Channel> open_channel() override { return std::make_unique<NoChannel>(); }

 private:
  std::string host_ = host_name();
};

}  // namespace

ProcessGroup::ProcessGroup() : timeout_ms_(default_timeout().count()) {}

std::shared_ptr<ProcessGroup> ProcessGroup::single() { return std::make_shared<SingleProcess>(); }
std::shared_ptr<ProcessGroup> ProcessGroup::mpi() { return detail::mpi_process_group(); }
bool ProcessGroup::mpi_compiled() { return detail::mpi_compiled(); }

std::shared_ptr<ProcessGroup> ProcessGroup::from_environment() {
  // What the launchers set in each process they start (Open MPI, PMIx, MPICH/Hydra).
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"}) {
    if (std::getenv(variable)) {
      if (!mpi_compiled())
        throw Error(fmt::format("started by an MPI launcher ({} is set), but dp was built without MPI", variable));
      return mpi();
    }
  }
  // torch.distributed's env:// launch (torchrun, torch.distributed.launch, Kubernetes training
  // operators): RANK of WORLD_SIZE processes meeting at MASTER_ADDR:MASTER_PORT, through the
  // env:// process group (gloo). torchrun's elastic agent cannot be joined (its own store already
  // holds MASTER_PORT): refused, naming what to use. WORLD_SIZE=1 is this process alone.
  const char* const how =
      "start the processes with mpirun (mpirun -np N dp_train --mode ddp ...), or with RANK, "
      "WORLD_SIZE, MASTER_ADDR and MASTER_PORT set and no elastic agent (torchrun --no-python "
      "does not avoid it)";
  for (const char* variable : {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"})
    if (std::getenv(variable))
      throw InvalidArgument(
          fmt::format("started by torchrun's elastic agent ({} is set), which dp cannot join: {}", variable, how));
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank || world) {
    for (const char* variable : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      if (!std::getenv(variable))
        throw InvalidArgument(fmt::format("{} is set (torch.distributed's env:// launch) but {} is not",
                                          rank ? "RANK" : "WORLD_SIZE", variable));
    const auto number = [](const char* name, long low, long high) {
      const std::string value = std::getenv(name);
      long parsed = -1;
      const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
      if (value.empty() || error != std::errc() || end != value.data() + value.size() || parsed < low || parsed > high)
        throw InvalidArgument(fmt::format("{}='{}' is not an integer in [{}, {}]", name, value, low, high));
      return static_cast<int>(parsed);
    };
    const int size = number("WORLD_SIZE", 1, 1 << 20);
    const int me = number("RANK", 0, size - 1);
    const int port = number("MASTER_PORT", 1, 65535);
    if (size == 1) return single();
    if (!detail::env_compiled())
      throw InvalidArgument(
          fmt::format("started for torch.distributed's env:// rendezvous (RANK={}, WORLD_SIZE={}), but dp was built "
                      "without gloo, which it needs: {}",
                      me, size, how));
    return detail::env_process_group(me, size, std::getenv("MASTER_ADDR"), port);
  }
  return single();
}

void ProcessGroup::barrier() {
  const char nothing = 0;
  std::vector<char> all(static_cast<std::size_t>(size()));
  all_gather_bytes(&nothing, 1, all.data());
}

std::optional<ProcessFailure> first_failure(ProcessGroup& processes, int exit_code) {
  struct Status {
    int exit_code;
    char host[64];
  };
  Status mine;
  std::memset(&mine, 0, sizeof(mine));  // no uninitialised byte goes out
  mine.exit_code = exit_code;
  std::snprintf(mine.host, sizeof(mine.host), "%s", processes.host().c_str());
  const std::vector<Status> all = processes.all_gather(mine);
  for (std::size_t p = 0; p < all.size(); ++p)
    if (all[p].exit_code != 0) return ProcessFailure{static_cast<int>(p), all[p].exit_code, all[p].host};
  return std::nullopt;
}

double reduce_value(ProcessGroup& processes, std::span<const double> local, ReduceOp op) {
  const std::vector<std::size_t> counts = processes.all_gather(local.size());
  for (std::size_t p = 0; p < counts.size(); ++p)
    if (counts[p] != local.size())
      throw InvalidArgument(fmt::format("reduce_value: process {} has {} values, process {} has {}", p, counts[p],
                                        processes.rank(), local.size()));
  const std::vector<double> all = processes.all_gather(local);
  double sum = 0.0;
  for (const double value : all) sum += value;
  return op == ReduceOp::avg && !all.empty() ? sum / static_cast<double>(all.size()) : sum;
}

}  // namespace dp
