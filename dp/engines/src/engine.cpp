// engine.cpp — the Engine interface's shared pieces (evaluation, the loss handle, check_applies);
// make_engine, which knows the engines, is make_engine.cpp.
#include "dp/engines/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp {

std::string_view to_string(EngineKind kind) {
  switch (kind) {
    case EngineKind::single: return "single";
    case EngineKind::dp: return "dp";
    case EngineKind::ddp: return "ddp";
  }
  return "unknown";
}

EngineKind parse_engine_kind(std::string_view name) {
  for (EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp})
    if (name == to_string(kind)) return kind;
  throw InvalidArgument(fmt::format("unknown engine '{}' (expected single, dp or ddp)", name));
}

EvalTotals& EvalTotals::operator+=(const EvalTotals& other) {
  loss_sum += other.loss_sum;
  correct += other.correct;
  samples += other.samples;
  return *this;
}

EvalTotals Engine::evaluate(std::span<const Batch> batches, std::vector<std::int32_t>* predictions) {
  for (const Batch& batch : batches)
    if (batch.size > 0 && !batch.targets) throw InvalidArgument("evaluation batch without targets (null pointer)");
  const std::vector<float> logits = predict(batches);
  const auto classes = static_cast<std::size_t>(model().output_features());
  const auto targets_per_sample = static_cast<std::size_t>(model().targets_per_sample());
  std::vector<EvalTotals> per_batch(batches.size());
  std::size_t row = 0;
  for (std::size_t b = 0; b < batches.size(); ++b) {
    const Batch& batch = batches[b];
    EvalTotals& totals = per_batch[b];
    const std::size_t rows = static_cast<std::size_t>(batch.size) * targets_per_sample;
    for (std::size_t i = 0; i < rows; ++i, ++row) {
      const float* x = logits.data() + row * classes;
      const std::int64_t target = batch.targets[i];
      if (target < 0 || static_cast<std::size_t>(target) >= classes)
        throw InvalidArgument(fmt::format("evaluation target {} is outside [0, {})", target, classes));
      std::size_t best = 0;
      for (std::size_t c = 1; c < classes; ++c)
        if (x[c] > x[best]) best = c;  // strict: the first of equal maxima wins
      double sum = 0.0;
      for (std::size_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(x[c]) - x[best]);
      totals.loss_sum += std::log(sum) + x[best] - x[target];
      totals.correct += best == static_cast<std::size_t>(target) ? 1 : 0;
      if (predictions) predictions->push_back(static_cast<std::int32_t>(best));
      ++totals.samples;
    }
  }
  return reduce_totals(per_batch);
}

EvalTotals Engine::reduce_totals(std::span<const EvalTotals> per_batch) {
  EvalTotals total;
  for (const EvalTotals& totals : per_batch) total += totals;
  return total;
}

void StepLoss::State::resolve() {
  if (!wait) return;
  try {
    value = wait();
  } catch (...) {
    error = std::current_exception();
  }
  wait = nullptr;  // what it refers to (the engine's events and pinned loss) may go away now
  query = nullptr;
}

float StepLoss::get() const {
  if (!state_) throw InvalidArgument("StepLoss::get: this StepLoss belongs to no training step");
  state_->resolve();
  if (state_->error) {
    state_->reported = true;
    std::rethrow_exception(state_->error);
  }
  return *state_->value;
}

bool StepLoss::ready() const { return state_ && (!state_->query || state_->query()); }

void Engine::freeze(const std::vector<Optimizer::ParamRange>& frozen) {
  for (Optimizer* o : optimizers()) o->freeze(frozen);
}

void Engine::exclude_from_weight_decay(const std::vector<Optimizer::ParamRange>& ranges) {
  for (Optimizer* o : optimizers()) o->exclude_from_weight_decay(ranges);
}

void Engine::set_lr(double lr) {
  for (Optimizer* optimizer : optimizers()) optimizer->set_lr(lr);
}

ZeroStage zero_stage(const EngineOptions& options) {
  if (options.zero != 2) return {options.zero, {}};
  const char* why = options.grad_reduce == GradReduce::bf16 ? "a bf16 gradient reduction all-reduces whole buckets"
                    : options.accumulate > 1 ? "accumulation adds the micro-batches into the whole gradients"
                    : options.shards > 0     ? "fixed shards keep each shard's gradients apart and sum them in order"
                                             : nullptr;
  return why ? ZeroStage{1, why} : ZeroStage{2, {}};
}

const EngineOptions& check_applies(EngineKind kind, const EngineOptions& options) {
  const auto refuse = [&](const char* field, const char* applies_to) {
    throw InvalidArgument(fmt::format("{} applies to {}, not {}", field, applies_to, to_string(kind)));
  };
  if (kind != EngineKind::ddp) {
    // With shards every kind runs DDP's replicas, SyncBatchNorm's too (a replica per shard).
    if (options.sync_batchnorm && (options.shards == 0 || kind == EngineKind::single))
      refuse("sync_batchnorm", options.shards ? "ddp and dp (a device per shard)" : "ddp");
    if (options.grad_reduce != GradReduce::fp32) refuse("a bf16 gradient all-reduce", "ddp");
    if (options.processes && options.processes->size() > 1)
      throw InvalidArgument(fmt::format(
          "{} is single-process by definition, but this job has {} processes: use ddp across processes (or run "
          "without mpirun)",
          kind == EngineKind::dp ? "DataParallel" : "single-device training", options.processes->size()));
  }
  if (kind != EngineKind::dp && options.output_device) refuse("output_device", "dp");
  if (options.shadow_shards < 0)
    throw InvalidArgument(fmt::format("shadow_shards must be 0 (off) or a step count, not {}", options.shadow_shards));
  if (options.shadow_shards > 0 && options.shards == 0)
    throw InvalidArgument("shadow_shards recomputes one of the fixed shards: it needs shards > 0");
  if (options.zero < 0 || options.zero > 2)
    throw InvalidArgument(fmt::format("zero must be 0 (off), 1 or 2 (the ZeRO stage), not {}", options.zero));
  if (kind != EngineKind::ddp && options.zero) refuse("ZeRO (zero)", "ddp");
  if (options.accumulate < 1)
    throw InvalidArgument(
        fmt::format("accumulate must be at least 1 (micro-batches per step), not {}", options.accumulate));
  if (!(options.step.clip_grad_norm >= 0.0) || !std::isfinite(options.step.clip_grad_norm))
    throw InvalidArgument(
        fmt::format("clip_grad_norm must be positive and finite (0: off), not {}", options.step.clip_grad_norm));
  if (options.shards < 0)
    throw InvalidArgument(fmt::format("shards must be 0 (off) or positive, not {}", options.shards));
  if (options.shards > 0) {
    const auto refuse_with_shards = [&](const char* what, const char* why) {
      throw InvalidArgument(fmt::format("{} cannot be used with shards: {}", what, why));
    };
    if (options.grad_reduce != GradReduce::fp32)
      refuse_with_shards("a bf16 gradient all-reduce",
                         "it rounds after every addition, in the collective's order, which shards keep out of the "
                         "result");
    if (options.output_device) refuse_with_shards("output_device", "each shard's loss is taken on its own device");
  }
  return options;
}

}  // namespace dp
