// dp/nn/optim.h — optimizers over a model's flat parameter buffer, one launch per step for all
// parameters, with torch.optim's exact semantics: Sgd (torch.optim.SGD, dampening 0) and AdamW
// (torch.optim.AdamW, amsgrad off). The engines hold them through the Optimizer interface, so a
// program picks one by its options (make_optimizer) and never branches on which it has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dp/runtime/device.h"
#include "dp/runtime/staged_values.h"

namespace dp {

// torch.optim.SGD's hyper-parameters (dampening 0).
struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};
// torch.optim.AdamW's hyper-parameters (amsgrad off), with torch's defaults.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// Throws InvalidArgument for what torch.optim.SGD rejects: a negative (or NaN) lr, momentum or
// weight_decay, nesterov without momentum; and a learning rate that is not finite.
void validate(const SgdOptions& options);
// Throws InvalidArgument for what torch.optim.AdamW rejects: lr < 0, eps < 0, betas outside
// [0, 1), weight_decay < 0 (and NaN or infinite values).
void validate(const AdamWOptions& options);

// Which optimizer, and how it is set: an engine builds one per device that steps.
using OptimizerOptions = std::variant<SgdOptions, AdamWOptions>;

class Optimizer {
 public:
  // One per-parameter state buffer: `param_count()` floats of device memory laid out as the
  // parameters are, named after torch's per-parameter state ("momentum" — torch's
  // momentum_buffer —, "exp_avg", "exp_avg_sq"). Checkpoints store them per parameter name.
  struct StateBuffer {
    std::string name;
    float* data;
  };

  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // "sgd" or "adamw": what a checkpoint records, so a resume cannot load one's state into the other.
  virtual std::string_view kind() const = 0;
  // Enqueues one update of params from grads on `stream` (the device's) and counts the step. The
  // values that change between steps (lr, bias corrections) reach the update through device
  // memory, so the enqueued work may be captured into a graph and replayed for later steps.
  virtual void step(const Stream& stream, float* params, const float* grads) = 0;
  // step() for a step whose update is a replay of a step() captured on `stream`: enqueues on
  // `stream` the copy of this step's values into the device memory the captured update reads (a
  // captured step() copies nothing, so that replays in flight never see a later step's values), and
  // counts the step. Call it just before the replay is launched on `stream`.
  virtual void replayed_step(const Stream& stream) = 0;
  virtual double lr() const = 0;
  // Validated as the options are (InvalidArgument for a negative, NaN or infinite lr).
  virtual void set_lr(double lr) = 0;
  // The state buffers; empty when there are none (SGD without momentum).
  virtual std::vector<StateBuffer> state() const = 0;

  // Parameters kept fixed (torch's requires_grad_(False) on them): [offset, offset + count) of the
  // flat buffer, which step() neither updates nor keeps state for (their state stays zero), as
  // torch.optim skips a parameter without a gradient. Each trainable stretch between them is one
  // launch of the update. Throws InvalidArgument for a range past the parameters.
  struct ParamRange {
    std::size_t offset = 0, count = 0;
  };
  void freeze(std::vector<ParamRange> frozen);
  // Parameters without weight decay, as torch's second parameter group {"weight_decay": 0.0}
  // (nanoGPT's biases and LayerNorm weights): [offset, offset + count) of the flat buffer, updated
  // with the optimizer's other hyper-parameters and no decay. Throws InvalidArgument for a range
  // past the parameters.
  void exclude_from_weight_decay(std::vector<ParamRange> ranges);
  Device& device() const { return device_; }
  std::size_t param_count() const { return param_count_; }
  // The stretches of the flat buffer step() updates: all of it unless some are frozen.
  const std::vector<ParamRange>& trainable() const { return trainable_; }
  // trainable() cut where weight decay starts or stops applying: one launch of the update each.
  struct Segment {
    ParamRange range;
    bool decay = true;
  };
  const std::vector<Segment>& segments() const { return segments_; }
  // Steps taken: torch's state['step'] (AdamW's bias correction uses it; SGD only asks whether it is 0).
  std::int64_t steps() const { return steps_; }
  // Restoring a checkpoint: the state buffers are written by the caller, then the step count set.
  void set_steps(std::int64_t steps) { steps_ = steps; }

 protected:
  Optimizer(Device& device, std::size_t param_count);
  // A zero-filled state buffer on the device: a state saved before any step holds zeros, not
  // whatever the allocation held (which may well read as NaN).
  DeviceBuffer zeroed_buffer() const;
  // This step's scalar values (at most kMaxScalarBytes) copied into device memory on `stream`
  // (StagedValues::upload); returns that device copy. While `stream` captures, only returns it:
  // replayed_step() copies before each replay.
  const void* upload_scalars(const Stream& stream, const void* values, std::size_t bytes) {
    return scalars_.upload(stream, values, bytes);
  }

  std::int64_t steps_ = 0;

 private:
  static constexpr std::size_t kMaxScalarBytes = 64;
  Device& device_;
  std::size_t param_count_;
  void cut_segments();
  std::vector<ParamRange> trainable_, no_decay_;
  std::vector<Segment> segments_;
  StagedValues scalars_;  // what the update reads
};

// g = grad + weight_decay*p; buf = first step ? g : momentum*buf + g; g = nesterov ? g + momentum*buf : buf;
// p -= lr*g.
class Sgd final : public Optimizer {
 public:
  // Validates the options, and allocates the momentum buffer on `device` when momentum > 0.
  Sgd(Device& device, std::size_t param_count, const SgdOptions& options);

  std::string_view kind() const override { return "sgd"; }
  void step(const Stream& stream, float* params, const float* grads) override;
  void replayed_step(const Stream& stream) override;
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;
  std::vector<StateBuffer> state() const override;

  const SgdOptions& options() const { return options_; }
  float* momentum_flat() const { return momentum_.as<float>(); }  // null without momentum

 private:
  SgdOptions options_;
  DeviceBuffer momentum_;
};

// Decoupled weight decay p *= 1 - lr*wd, then Adam with bias correction (dp/kernels/optimizer.h has
// the update with torch's roundings).
class AdamW final : public Optimizer {
 public:
  AdamW(Device& device, std::size_t param_count, const AdamWOptions& options);

  std::string_view kind() const override { return "adamw"; }
  void step(const Stream& stream, float* params, const float* grads) override;
  void replayed_step(const Stream& stream) override;
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;
  std::vector<StateBuffer> state() const override;

  const AdamWOptions& options() const { return options_; }

 private:
  AdamWOptions options_;
  DeviceBuffer exp_avg_, exp_avg_sq_;
};

// The stretches of [0, param_count) that `frozen` leaves (Optimizer::freeze's, and a ZeRO-1 engine's
// over the whole buffer). Throws InvalidArgument for a range past the parameters.
std::vector<Optimizer::ParamRange> trainable_ranges(std::size_t param_count, std::vector<Optimizer::ParamRange> frozen);

// The optimizer `options` names, on `device`, for `param_count` parameters (validated).
std::unique_ptr<Optimizer> make_optimizer(Device& device, std::size_t param_count, const OptimizerOptions& options);
// "sgd" or "adamw", as Optimizer::kind() of what make_optimizer builds.
std::string_view optimizer_kind(const OptimizerOptions& options);
// The learning rate `options` starts from.
double base_lr(const OptimizerOptions& options);

}  // namespace dp
