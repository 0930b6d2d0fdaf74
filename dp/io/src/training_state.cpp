// training_state.cpp — a run's resumable state as one safetensors file (dp/training_state.h).
#include "dp/io/training_state.h"

#include <fmt/format.h>
#include <limits>
#include <vector>

#include "dp/io/checkpoint.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp {
namespace {

constexpr int kFormat = 2;                  // 2: optimizer kind and named state buffers; 1: SGD momentum only
constexpr long long kMaxCount = 1LL << 40;  // steps and epochs: far beyond any run, far below overflow

// Metadata `key` of `file` as an integer in [lo, hi]; Error naming `path` and the key otherwise.
long long number(const std::string& path, const safetensors::File& file, const std::string& key, long long lo,
                 long long hi) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) throw Error(fmt::format("{}: metadata '{}' is missing", path, key));
  try {
    std::size_t used = 0;
    const long long value = std::stoll(it->second, &used);
    if (used == it->second.size() && value >= lo && value <= hi) return value;
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{}: metadata '{}' = '{}' is not a number in [{}, {}]", path, key, it->second, lo, hi));
}

// Metadata "dp.seed": any uint64_t, as TrainingProgress::seed (and dp_train --seed) allow.
std::uint64_t seed(const std::string& path, const safetensors::File& file) {
  const auto it = file.metadata.find("dp.seed");
  if (it == file.metadata.end()) throw Error(fmt::format("{}: metadata 'dp.seed' is missing", path));
  try {
    std::size_t used = 0;
    const unsigned long long value = std::stoull(it->second, &used);
    if (used == it->second.size() && !it->second.empty() && it->second[0] != '-') return value;
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("{}: metadata 'dp.seed' = '{}' is not a number in [0, 2^64)", path, it->second));
}

// The keys of the training state itself, which a tag must not overwrite.
bool reserved(const std::string& key) {
  return key == "format" || key == "step" || key == "optimizer" || key == "optimizer_steps" || key == "sgd_steps" ||
         key == "epoch" || key == "seed";
}

// "optimizer.<state>.<parameter>": format 1 wrote SGD's momentum as "optimizer.momentum.<name>",
// which this keeps, so those files still resume.
std::string state_key(const std::string& state, const std::string& parameter) {
  return fmt::format("optimizer.{}.{}", state, parameter);
}

}  // namespace

void TrainingState::save(const std::string& path, const Model& model, const Optimizer& optimizer,
                         const TrainingProgress& progress) {
  for (const auto& [key, value] : progress.tags)
    if (reserved(key)) throw InvalidArgument(fmt::format("training state tag '{}' would overwrite dp.{}", key, key));
  // The state as the devices last left it: every stream of both devices finishes first.
  model.device().synchronize();
  optimizer.device().synchronize();
  capture(model, optimizer, progress).write(path);
}

TrainingState TrainingState::capture(const Model& model, const Optimizer& optimizer, const TrainingProgress& progress) {
  for (const auto& [key, value] : progress.tags)
    if (reserved(key)) throw InvalidArgument(fmt::format("training state tag '{}' would overwrite dp.{}", key, key));
  TrainingState state;
  state.path_ = "the training state in memory";
  const Stream model_stream = model.device().create_stream();
  safetensors::File& file = state.file_;
  file = state_dict(model, model_stream);
  const Stream stream = optimizer.device().create_stream();
  for (const Optimizer::StateBuffer& buffer : optimizer.state()) {
    for (const TensorRef& p : model.parameters()) {
      std::vector<float> values(p.numel());
      stream.copy(values.data(), buffer.data + p.offset, values.size() * sizeof(float));
      file.add(state_key(buffer.name, p.name), safetensors::make_f32(p.shape, values.data()));
    }
  }
  file.metadata["dp.format"] = std::to_string(kFormat);
  file.metadata["dp.step"] = std::to_string(progress.step);
  file.metadata["dp.optimizer"] = std::string(optimizer.kind());
  file.metadata["dp.optimizer_steps"] = std::to_string(optimizer.steps());
  file.metadata["dp.epoch"] = std::to_string(progress.epoch);
  file.metadata["dp.seed"] = std::to_string(progress.seed);
  for (const auto& [key, value] : progress.tags) file.metadata[fmt::format("dp.{}", key)] = value;
  state.progress_ = progress;
  state.optimizer_steps_ = static_cast<std::int64_t>(optimizer.steps());
  state.optimizer_kind_ = std::string(optimizer.kind());
  return state;
}

void TrainingState::write(const std::string& path) const {
  // A diverged model is not a checkpoint: the file already there is worth more than NaNs.
  for (const auto& [name, tensor] : file_.tensors)
    if (const std::size_t at = tensor.first_non_finite(); at != safetensors::Tensor::npos)
      throw NonFiniteError(fmt::format("{}: not written: '{}' holds a non-finite value ({}) at element {}", path, name,
                                       tensor.to_f32()[at], at));
  safetensors::write(path, file_);
}

TrainingState TrainingState::read(const std::string& path) {
  TrainingState state;
  state.path_ = path;
  state.file_ = safetensors::read(path);
  const safetensors::File& file = state.file_;
  if (!file.metadata.count("dp.step"))
    throw Error(fmt::format("{}: not a training checkpoint (no training state)", path));
  state.progress_.step = number(path, file, "dp.step", 0, kMaxCount);
  // Format 1 (SGD only) counted "dp.sgd_steps".
  const bool legacy = !file.metadata.count("dp.optimizer_steps") && file.metadata.count("dp.sgd_steps");
  state.optimizer_steps_ = number(path, file, legacy ? "dp.sgd_steps" : "dp.optimizer_steps", 0, kMaxCount);
  const long long format = file.metadata.count("dp.format") ? number(path, file, "dp.format", 1, kMaxCount) : 1;
  if (format > kFormat)
    throw Error(fmt::format("{}: training state format {} is newer than this dp reads ({})", path, format, kFormat));
  if (format >= 2 && !file.metadata.count("dp.optimizer"))
    throw Error(fmt::format("{}: metadata 'dp.optimizer' is missing", path));
  if (const auto it = file.metadata.find("dp.optimizer"); it != file.metadata.end()) {
    if (it->second != "sgd" && it->second != "adamw")
      throw Error(fmt::format("{}: metadata 'dp.optimizer' = '{}' is not an optimizer dp knows (sgd, adamw)", path,
                              it->second));
    state.optimizer_kind_ = it->second;
  }
  state.progress_.seed = seed(path, file);
  if (file.metadata.count("dp.epoch")) state.progress_.epoch = number(path, file, "dp.epoch", 0, kMaxCount);
  for (const auto& [key, value] : file.metadata)
    if (key.rfind("dp.", 0) == 0 && !reserved(key.substr(3))) state.progress_.tags[key.substr(3)] = value;
  return state;
}

void TrainingState::load_model(Model& model) const {
  const Stream stream = model.device().create_stream();
  load_state_dict(model, stream, file_);
}

void TrainingState::load_optimizers(const Model& model, std::span<Optimizer* const> optimizers) const {
  if (optimizers.empty()) return;
  const Optimizer& first = *optimizers.front();
  if (first.kind() != optimizer_kind_)
    throw Error(fmt::format("{}: the state is of optimizer '{}'; this run's optimizer is '{}'", path_, optimizer_kind_,
                            first.kind()));
  const auto names = [](const Optimizer& o) {
    std::vector<std::string> out;
    for (const Optimizer::StateBuffer& b : o.state()) out.push_back(b.name);
    return out;
  };
  for (const Optimizer* o : optimizers)
    if (o->kind() != first.kind() || names(*o) != names(first) || o->param_count() != first.param_count())
      throw InvalidArgument("load_optimizers: the optimizers differ in kind, state or size");
  // Validate everything first, so a bad file leaves every optimizer untouched. Every optimizer of
  // an engine has the same kind and options, so the first one's buffers name them all.
  const std::vector<TensorRef> parameters = model.parameters();
  std::vector<std::vector<float>> values;  // per state buffer, per parameter
  for (const Optimizer::StateBuffer& buffer : first.state()) {
    for (const TensorRef& p : parameters) {
      const std::string key = state_key(buffer.name, p.name);
      if (!file_.has(key))
        throw Error(
            fmt::format("{}: no {} buffer '{}' (saved with other optimizer options?)", path_, buffer.name, key));
      const safetensors::Tensor& t = file_.at(key);
      if (t.dtype != "F32" || t.numel() != p.numel())
        throw Error(fmt::format("{}: {} buffer '{}' has {} {} values, expected {} F32", path_, buffer.name, key,
                                t.numel(), t.dtype, p.numel()));
      // The same count in another shape (a transposed matrix) would pair each value with the wrong weight.
      if (t.shape != p.shape)
        throw Error(fmt::format("{}: {} buffer '{}' has shape {}, its parameter '{}' has shape {}", path_, buffer.name,
                                key, format_shape(t.shape), p.name, format_shape(p.shape)));
      if (const std::size_t at = t.first_non_finite(); at != safetensors::Tensor::npos)
        throw Error(
            fmt::format("{}: {} buffer '{}' holds a non-finite value at element {}", path_, buffer.name, key, at));
      values.push_back(t.to_f32());
    }
  }
  for (Optimizer* optimizer : optimizers) {
    optimizer->set_steps(optimizer_steps_);
    // Each optimizer's state lives on its own rank's device.
    const Stream stream = optimizer->device().create_stream();
    auto host = values.begin();
    for (const Optimizer::StateBuffer& buffer : optimizer->state())
      for (const TensorRef& p : parameters) {
        stream.copy(buffer.data + p.offset, host->data(), host->size() * sizeof(float));
        ++host;
      }
    stream.synchronize();
  }
}

}  // namespace dp
