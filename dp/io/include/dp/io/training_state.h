// dp/io/training_state.h — everything a run needs to continue bit for bit as if it had not stopped:
// the model's parameters and buffers (its state dict, PyTorch names), the optimizer's kind, its
// per-parameter state buffers (SGD momentum; AdamW exp_avg, exp_avg_sq) and step count, and the run's progress (step,
// epoch, seed, free-form tags). One safetensors file, written atomically; every number read back is range-checked, as
// any input.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "dp/io/safetensors.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"

namespace dp {

struct TrainingProgress {
  std::int64_t step = 0;   // steps taken: the next step to run
  std::int64_t epoch = 0;  // the epoch that step belongs to
  std::uint64_t seed = 0;  // of the initialisation, data and shuffling
  // Free-form facts about the run a resume may want to check ("model", "mode", ...); stored as
  // metadata "dp.<key>". The state's own keys (format, step, optimizer, optimizer_steps, sgd_steps,
  // epoch, seed) are refused.
  std::map<std::string, std::string> tags;
};

class TrainingState {
 public:
  // Writes `model`'s parameters and buffers, `optimizer`'s kind, state buffers
  // ("optimizer.<state>.<parameter name>", e.g. optimizer.exp_avg.fc1.weight) and step count, and `progress` to `path`
  // (a temporary file renamed over it: an existing file is either replaced whole or untouched). Waits for all work on
  // the model's and the optimizer's devices first, so the state saved is the one the last step left.
  static void save(const std::string& path, const Model& model, const Optimizer& optimizer,
                   const TrainingProgress& progress);
  // The same state, read into memory without waiting for the devices' streams: for a caller that
  // knows the model's and the optimizer's work is done, on devices whose streams may have failed
  // (the survivors of a lost device). Reads through streams of its own.
  static TrainingState capture(const Model& model, const Optimizer& optimizer, const TrainingProgress& progress);
  // Writes the state to `path` as save() does (atomically; none of it if a value is not finite).
  void write(const std::string& path) const;

  // Reads `path` and its training metadata. Throws Error naming the file and the problem: not a
  // training checkpoint, a missing key, a number out of range.
  static TrainingState read(const std::string& path);

  const TrainingProgress& progress() const { return progress_; }
  std::int64_t optimizer_steps() const { return optimizer_steps_; }
  // "sgd" or "adamw" (files from before AdamW existed: "sgd").
  const std::string& optimizer_kind() const { return optimizer_kind_; }
  const safetensors::File& file() const { return file_; }

  // Loads the parameters and buffers into `model` (load_state_dict: every tensor checked first,
  // nothing written on error).
  void load_model(Model& model) const;
  // Loads the state buffers (named after `model`'s parameters) and the step count into every
  // optimizer, each on its own device. Throws Error naming the file and the problem — another
  // optimizer kind, a missing or misfit buffer —; the optimizers are untouched then.
  void load_optimizers(const Model& model, std::span<Optimizer* const> optimizers) const;

 private:
  std::string path_;
  safetensors::File file_;
  TrainingProgress progress_;
  std::int64_t optimizer_steps_ = 0;
  std::string optimizer_kind_ = "sgd";
};

}  // namespace dp
