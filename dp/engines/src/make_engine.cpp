// make_engine.cpp — make_engine: the engine of a kind, or the fixed-shards engine, frozen and
// grouped for weight decay as EngineOptions says. Apart from engine.cpp, so that the interface
// depends on none of the engines.
#include <fmt/format.h>

#include "dp/engines/data_parallel.h"
#include "dp/engines/ddp.h"
#include "dp/engines/engine.h"
#include "dp/engines/trainer.h"
#include "dp/runtime/error.h"
#include "fixed_shards.h"

namespace dp {

namespace {

// The flat-buffer ranges of the parameters named by `prefixes` (a name equal to a prefix or under
// it: "layer1" is layer1.* but not layer10.*).
std::vector<Optimizer::ParamRange> frozen_ranges(const Model& model, const std::vector<std::string>& prefixes) {
  std::vector<Optimizer::ParamRange> ranges;
  const auto params = model.parameters();
  for (const std::string& prefix : prefixes) {
    bool matched = false;
    for (const TensorRef& p : params) {
      if (!is_under(p.name, prefix)) continue;
      ranges.push_back({p.offset, p.numel()});
      matched = true;
    }
    if (!matched) {
      std::vector<std::string> names;
      for (const TensorRef& p : params) names.push_back(p.name);
      throw InvalidArgument(
          fmt::format("frozen '{}' names no parameter of the model ({})", prefix, fmt::join(names, ", ")));
    }
  }
  return ranges;
}

std::unique_ptr<Engine> make_unfrozen_engine(Runtime& runtime, Model& model, const OptimizerOptions& optimizer,
                                             const EngineOptions& options);

void check_single_device(const Model& model, const EngineOptions& options) {
  if (options.device_ids && (options.device_ids->size() != 1 || (*options.device_ids)[0] != model.device().index()))
    throw InvalidArgument(fmt::format("single-device training runs on the model's device {}, not on [{}]",
                                      model.device().index(), fmt::join(*options.device_ids, ", ")));
}

}  // namespace

std::unique_ptr<Engine> make_engine(Runtime& runtime, Model& model, const OptimizerOptions& optimizer,
                                    const EngineOptions& options) {
  const auto frozen = frozen_ranges(model, options.frozen);  // checked before anything is built
  // Before the engine replicates the model: replicas keep the setting.
  model.set_autocast(options.amp);
  auto engine = make_unfrozen_engine(runtime, model, optimizer, options);
  if (!frozen.empty()) engine->freeze(frozen);
  if (options.weight_decay_on == WeightDecayOn::matrices) {
    std::vector<Optimizer::ParamRange> vectors;  // nanoGPT's no-decay group: p.dim() < 2
    for (const TensorRef& p : model.parameters())
      if (p.shape.size() < 2) vectors.push_back({p.offset, p.numel()});
    engine->exclude_from_weight_decay(vectors);
  }
  return engine;
}

namespace {

std::unique_ptr<Engine> make_unfrozen_engine(Runtime& runtime, Model& model, const OptimizerOptions& optimizer,
                                             const EngineOptions& options) {
  // With fixed shards every kind computes the same step (Note [fixed shards]), in the fixed-shards
  // engine; the kind keeps its launch rules (single: the model's device; single and dp: one
  // process) and its name.
  if (options.shards > 0) {
    EngineOptions sharded = options;
    if (options.kind == EngineKind::single) {
      check_applies(options.kind, options);
      check_single_device(model, options);
      sharded.device_ids = std::vector<int>{model.device().index()};
    }
    return std::make_unique<engines::FixedShards>(runtime, model, optimizer, sharded, options.kind);
  }
  switch (options.kind) {
    case EngineKind::single:
      check_applies(options.kind, options);
      check_single_device(model, options);
      return std::make_unique<SingleDeviceTrainer>(model, optimizer, options.step, options.graphs, options.accumulate);
    case EngineKind::dp: return std::make_unique<DataParallel>(runtime, model, optimizer, options);
    case EngineKind::ddp: return std::make_unique<DistributedDataParallel>(runtime, model, optimizer, options);
  }
  throw InvalidArgument("unknown engine kind");
}

}  // namespace

}  // namespace dp
