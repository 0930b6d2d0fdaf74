// step_graphs.cpp — captures, replays and the eager fallback of the engines' training steps.
#include "step_graphs.h"

#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/error.h"

namespace dp::engines {

void upload_replayed_step(Model& model, Optimizer& optimizer, const Stream& stream) {
  model.upload_random_step(stream, static_cast<std::uint64_t>(optimizer.steps()));
  optimizer.replayed_step(stream);
}

void abandon_capture(const Stream& stream) noexcept {
  try {
    if (stream.capturing()) (void)stream.end_capture();
  } catch (...) {  // an invalidated or unjoined capture: the error that made us abandon it is reported
  }
}

Graph capture_on(const Stream& stream, const std::function<void()>& enqueue) {
  stream.begin_capture();
  try {
    enqueue();
  } catch (...) {
    abandon_capture(stream);
    throw;
  }
  return stream.end_capture();  // a capture that cannot end is ended by the failing call itself
}

namespace {
// Whether a failed step failed for a reason a graph cannot hold (CaptureError), maybe inside the
// WorkerError of the device where it happened.
bool capture_failed(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CaptureError&) {
    return true;
  } catch (const WorkerError& e) {
    return e.cause() && capture_failed(e.cause());
  } catch (...) {
    return false;
  }
}
}  // namespace

bool MemorySnapshot::operator==(const MemorySnapshot& other) const {
  if (staging_growths != other.staging_growths || stats.size() != other.stats.size()) return false;
  for (std::size_t i = 0; i < stats.size(); ++i)
    if (stats[i].in_use != other.stats[i].in_use || stats[i].allocations_made != other.stats[i].allocations_made)
      return false;
  return true;
}

MemorySnapshot snapshot(const std::vector<Device*>& devices, std::uint64_t staging_growths) {
  MemorySnapshot out;
  for (Device* device : devices) out.stats.push_back(device->memory());
  out.staging_growths = staging_growths;
  return out;
}

StepGraphs::Action StepGraphs::plan(const Key& key, int slot) const {
  if (!enabled_ || refused_.count(key)) return Action::eager;
  const auto it = graphs_.find(key);
  if (it != graphs_.end() && !it->second[static_cast<std::size_t>(slot)].empty()) return Action::replay;
  return warmed_.count(key) ? Action::capture : Action::eager;
}

bool StepGraphs::capture(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
                         const std::function<std::vector<Graph>()>& record) {
  std::vector<std::int64_t> steps;
  for (const Optimizer* optimizer : optimizers) steps.push_back(optimizer->steps());
  const auto restore_steps = [&] {
    for (std::size_t i = 0; i < optimizers.size(); ++i) optimizers[i]->set_steps(steps[i]);
  };
  try {
    graphs_[key][static_cast<std::size_t>(slot)] = record();
    restore_steps();
    return true;
  } catch (...) {
    restore_steps();
    if (!capture_failed(std::current_exception())) throw;
    refused_.insert(key);
    return false;
  }
}

void StepGraphs::drop_graphs() {
  graphs_.clear();
  warmed_.clear();
}

bool StepGraphs::run(const Key& key, int slot, const std::vector<Optimizer*>& optimizers,
                     const std::function<MemorySnapshot()>& memory, const StepWork& work) {
  if (!enabled_ || !work.capture) {  // a step with no capture form: eager (a later one sees what it grew)
    work.eager();
    return false;
  }
  MemorySnapshot now = memory();
  if (last_ && !(*last_ == now)) drop_graphs();
  Action action = plan(key, slot);
  if (action == Action::capture) {
    action = capture(key, slot, optimizers, work.capture) ? Action::replay : Action::eager;
    if (action == Action::eager) now = memory();  // where the eager step starts from
  }
  if (action == Action::replay) {
    work.replay(graphs_.at(key)[static_cast<std::size_t>(slot)]);
    ++replays_;
    last_ = memory();
    return true;
  }
  work.eager();
  last_ = memory();
  if (!(now == *last_)) drop_graphs();  // its own allocations sized its key's buffers
  warmed_.insert(key);
  return false;
}

}  // namespace dp::engines
