// train_recovery.cpp — what a run does when the training loop lost a device or another process
// (docs/training.md, "When a device fails"): the survivors' state of the last complete step, kept
// in memory to go on (--shards) or written to --save for a relaunch.
#include <exception>
#include <fmt/format.h>
#include <optional>
#include <string>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/io/training_state.h"
#include "dp/runtime/error.h"
#include "exit_codes.h"
#include "train_parts.h"
#include "train_stages.h"

namespace dp_train {
namespace {

// The device a failure lost and what it says (DeviceLost, as such or as a device's WorkerError's
// cause), if it lost one.
struct Lost {
  int device;
  std::string what;
};
std::optional<Lost> lost_device(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const dp::WorkerError& w) {
    std::optional<Lost> lost = w.cause() ? lost_device(w.cause()) : std::nullopt;
    if (lost && lost->device < 0) lost->device = w.device();  // a CUDA error on that device's worker
    return lost;
  } catch (const dp::DeviceLost& lost) {
    return Lost{lost.device(), lost.what()};
  } catch (...) {
    return std::nullopt;
  }
}

// Another process's loss (PeerLost, as such or as a device's cause): which process, -1 where the
// error does not say; none for another failure.
std::optional<int> peer_lost(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const dp::WorkerError& w) {
    return w.cause() ? peer_lost(w.cause()) : std::nullopt;
  } catch (const dp::PeerLost& lost) {
    return lost.process();
  } catch (...) {
    return std::nullopt;
  }
}

// Another process is gone: the lowest surviving process (process 0, or process 1 where process 0
// is the one lost) writes the last step its devices hold whole to --save (no collective: its peers
// may be gone), for a relaunch on fewer processes to resume; then the failure ends the run as
// before (exit 5 on every survivor).
void save_after_peer_lost(const Options& o, const Plan& plan, dp::Engine& engine, std::int64_t steps_at_start, int lost,
                          MetricsLog& metrics) {
  const int rank = g_job.processes()->rank();
  if (o.save.empty() || rank != (lost == 0 ? 1 : 0)) return;
  const std::optional<dp::Engine::Survivor> survivor = engine.survivor();
  if (!survivor) {
    fmt::print(
        "dp_train: a process of the job is lost; no device of this process holds the whole training "
        "state: nothing written\n");
    return;
  }
  const long step = plan.start_step + static_cast<long>(survivor->steps - steps_at_start);
  dp::TrainingState::capture(*survivor->model, *survivor->optimizer, checkpoint_progress(o, plan, step)).write(o.save);
  metrics.write({{"kind", "peer_lost"}, {"step", step}, {"saved", o.save}});
  // Said by the process that wrote it, process 0 or not.
  fmt::print(
      "dp_train: {} of the job is lost; wrote {} at step {}: relaunch on the remaining processes with "
      "--resume {}{}\n",
      lost >= 0 ? fmt::format("process {}", lost) : std::string("a process"), o.save, step, o.save,
      o.shards > 0 ? fmt::format(" (--shards {}: the same trajectory on any count)", o.shards) : "");
}

// What a run does once a device is lost (docs/training.md, "When a device fails"): with --shards,
// in one process, it goes on from the survivors' state in memory, each survivor taking its share
// of the shards (`resumed`, `devices` set: the caller trains again); else the state goes to --save
// and the run ends (exit 7).
std::optional<int> after_device_lost(const Options& o, const Plan& plan, dp::Engine& engine,
                                     std::int64_t steps_at_start, const Lost& loss, Devices& devices, Resumed& resumed,
                                     MetricsLog& metrics) {
  const int lost = loss.device;
  const std::string& why = loss.what;
  std::vector<int> survivors;
  for (const int id : devices.ids)
    if (id != lost) survivors.push_back(id);
  const std::optional<dp::Engine::Survivor> survivor = engine.survivor();
  if (!survivor) {
    const std::string_view kind = engine.name();
    say("dp_train: {}; no surviving device holds the whole training state ({}): nothing written\n", why,
        survivors.empty() ? std::string("it was this process's only device")
        : o.zero > 0 && g_job.several()
            ? std::string("ZeRO spreads the optimizer state over the processes, and host copies of it are kept in one "
                          "process only")
        : o.zero > 0 && !o.zero_host_copies
            ? std::string("ZeRO spread the optimizer state over the devices, and --zero-host-copies off kept no copy")
        : kind == "ddp" || kind == "fixed shards" ? std::string("rank 0 alone held the last step's running statistics")
        : kind == "dp" ? std::string("DataParallel's state lived on the source device, the one lost")
                       : fmt::format("{} keeps no replica of the state to go on from", kind));
    return dp::tools::kExitDeviceLost;
  }
  const long step = plan.start_step + static_cast<long>(survivor->steps - steps_at_start);
  dp::TrainingState state =
      dp::TrainingState::capture(*survivor->model, *survivor->optimizer, checkpoint_progress(o, plan, step));
  const int count = static_cast<int>(survivors.size());
  // Shadow shards need a second device to recompute a shard on.
  const bool go_on =
      o.shards > 0 && !g_job.several() && count > (o.shadow_shards > 0 ? 1 : 0) && !(o.sync_bn && o.shards != count);
  metrics.write({{"kind", "device_lost"},
                 {"device", lost},
                 {"step", step},
                 {"devices", survivors},
                 {"continues", go_on},
                 {"error", why}});
  if (go_on) {
    const int shards = o.shards * o.accumulate;
    say("dp_train: {}; {} shards go on from step {} on device(s) [{}], {}\n", why, o.shards, step, ids_of(survivors),
        shards % count == 0 ? fmt::format("{} shard(s) each", shards / count)
                            : fmt::format("{} or {} shards each", shards / count + 1, shards / count));
    resumed = Resumed{};
    resumed.state = std::move(state);
    read_progress("the survivors' state", resumed);
    devices.ids = survivors;
    return std::nullopt;
  }
  std::string saved = "nothing written (no --save)";
  if (g_job.several() && !g_job.primary()) {
    saved = "process 0 writes the state";
  } else if (!o.save.empty()) {
    state.write(o.save);
    saved = fmt::format("wrote {} at step {}", o.save, step);
  }
  say("dp_train: {}; {}: resume it on the remaining device(s) with --resume {} --device-ids {}{}\n", why, saved,
      o.save.empty() ? "CKPT" : o.save, ids_of(survivors),
      o.shards > 0 ? std::string() : " (with --shards the run would have gone on by itself, bit for bit)");
  return dp::tools::kExitDeviceLost;
}

}  // namespace

std::optional<int> after_training_failed(const Options& o, const Plan& plan, dp::Engine& engine,
                                         std::int64_t steps_at_start, const std::exception_ptr& error, Devices& devices,
                                         Resumed& resumed, MetricsLog& metrics) {
  if (const std::optional<int> process = peer_lost(error)) {
    try {
      save_after_peer_lost(o, plan, engine, steps_at_start, *process, metrics);
    } catch (const std::exception& e) {
      say("dp_train: the state after the lost process was not written: {}\n", e.what());
    }
    std::rethrow_exception(error);
  }
  const std::optional<Lost> lost = lost_device(error);
  if (!lost) std::rethrow_exception(error);
  return after_device_lost(o, plan, engine, steps_at_start, *lost, devices, resumed, metrics);
}

}  // namespace dp_train
