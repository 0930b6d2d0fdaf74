// survivors.cpp — go_on_without_lost: an engine over the survivors of a lost device, from the state
// of the last step they hold whole, by way of the host (the survivor's memory and the new model's
// may be the same device's, which need not hold both).
#include <cstddef>
#include <fmt/format.h>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/runtime/error.h"

namespace dp {

std::optional<Survivors> go_on_without_lost(Runtime& runtime, std::unique_ptr<Engine> failed,
                                            const std::function<std::unique_ptr<Model>(Device&)>& build,
                                            const OptimizerOptions& optimizer, EngineOptions options) {
  const std::optional<Engine::Survivor> survivor = failed->survivor();
  Survivors out;
  for (const int id : failed->device_ids())
    if (!runtime.device(id).lost()) out.devices.push_back(id);
  if (!survivor || out.devices.empty()) return std::nullopt;
  const Model& from = *survivor->model;
  const std::size_t params = from.param_count();
  std::vector<float> weights(params);
  std::vector<std::byte> buffers(from.buffers_bytes());
  std::vector<std::vector<float>> state;
  {
    const Stream stream = from.device().create_stream();
    stream.copy(weights.data(), from.params_flat(), params * sizeof(float));
    if (!buffers.empty()) stream.copy(buffers.data(), from.buffers_flat(), buffers.size());
    for (const Optimizer::StateBuffer& buffer : survivor->optimizer->state()) {
      auto& values = state.emplace_back(params);
      stream.copy(values.data(), buffer.data, params * sizeof(float));
    }
    stream.synchronize();
  }
  out.steps = survivor->optimizer->steps();
  failed.reset();  // its replicas and buffers, before the new engine's
  out.model = build(runtime.device(out.devices.front()));
  if (out.model->param_count() != params || out.model->buffers_bytes() != buffers.size())
    throw InvalidArgument(
        fmt::format("go_on_without_lost: the model built has {} parameters and {} buffer bytes, the "
                    "failed engine's {} and {}",
                    out.model->param_count(), out.model->buffers_bytes(), params, buffers.size()));
  {
    const Stream stream = out.model->device().create_stream();
    stream.copy(out.model->params_flat(), weights.data(), params * sizeof(float));
    if (!buffers.empty()) stream.copy(out.model->buffers_flat(), buffers.data(), buffers.size());
    stream.synchronize();
  }
  options.device_ids = out.devices;
  options.uneven_shards = true;
  out.engine = make_engine(runtime, *out.model, optimizer, options);
  for (Optimizer* whole : out.engine->whole_optimizers()) {
    const std::vector<Optimizer::StateBuffer> mine = whole->state();
    if (mine.size() != state.size() || whole->param_count() != params)
      throw InvalidArgument("go_on_without_lost: the new engine's optimizer keeps other state than the survivor's");
    const Stream stream = whole->device().create_stream();
    for (std::size_t k = 0; k < mine.size(); ++k) stream.copy(mine[k].data, state[k].data(), params * sizeof(float));
    stream.synchronize();
    whole->set_steps(out.steps);
  }
  out.engine->whole_optimizers_loaded();
  return out;
}

}  // namespace dp
