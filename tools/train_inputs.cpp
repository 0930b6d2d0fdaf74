// train_inputs.cpp — a dp_train run's inputs (the data sets, normalised) and the checkpoint it resumes
// (train_stages.h).
#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fmt/format.h>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <signal.h>
#include <span>
#include <unistd.h>
#include <utility>
#include <variant>
#include <vector>

#include "address_space.h"
#include "dp/engines/engine.h"
#include "dp/io/atomic_file.h"
#include "dp/io/checkpoint.h"
#include "dp/io/data.h"
#include "dp/io/image_folder.h"
#include "dp/io/llmc.h"
#include "dp/io/safetensors.h"
#include "dp/io/text.h"
#include "dp/io/training_state.h"
#include "dp/models/registry.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/device.h"
#include "dp/runtime/process_group.h"
#include "dp/runtime/shape.h"
#include "dp_cli.h"
#include "run_settings.h"
#include "train_cli.h"
#include "train_parts.h"
#include "train_stages.h"

namespace dp_train {

// --limit-train / --limit-test: the first `limit` samples of a split, as torch's Subset(range(N)).
std::shared_ptr<const dp::SampleSource> keep_first(std::shared_ptr<const dp::SampleSource> set,
                                                   const std::optional<std::size_t>& limit, const char* flag) {
  if (!limit || set->size() == 0) return set;
  if (*limit > set->size())
    say("note: {} {}: the set has only {} samples; using all of them\n", flag, *limit, set->size());
  return std::make_shared<dp::FirstSamples>(std::move(set), *limit);
}

// An image folder's split with torchvision's transforms: RandomResizedCrop + flip for training,
// Resize + CenterCrop for evaluation; a val folder must hold the training folder's classes.
std::shared_ptr<const dp::SampleSource> image_split(const Options& o, const Normalization& normalize,
                                                    const std::string& dir, bool train,
                                                    const std::vector<std::string>* classes) {
  dp::ImageFolderOptions options;
  options.transform = train ? dp::ImageTransform::train : dp::ImageTransform::eval;
  options.image_size = o.image_size;
  options.resize_size = o.resize.value_or(o.image_size * 256 / 224);
  const Normalization rgb = normalize.for_channels(3);
  std::copy(rgb.mean.begin(), rgb.mean.end(), options.normalization.mean.begin());
  std::copy(rgb.std.begin(), rgb.std.end(), options.normalization.std.begin());
  if (classes) options.expected_classes = *classes;
  return as_usage_error([&] { return std::make_shared<const dp::ImageFolder>(dir, options); });
}

// --data DIR with DIR/train and DIR/val, or --train-dir and --val-dir.
Inputs load_image_folders(Options& o, const Normalization& normalize) {
  std::string train = o.train_dir, val = o.val_dir;
  if (!o.data.empty()) {
    train = o.data + "/train";
    if (std::filesystem::is_directory(o.data + "/val")) val = o.data + "/val";
  }
  Inputs inputs;
  std::shared_ptr<const dp::SampleSource> train_set;
  if (!train.empty() && (!o.eval_only || val.empty())) train_set = image_split(o, normalize, train, true, nullptr);
  const auto* classes = train_set ? &dynamic_cast<const dp::ImageFolder&>(*train_set).classes() : nullptr;
  const bool eval = o.eval_only || o.eval.value_or(!val.empty());
  if (eval && val.empty())
    throw UsageError(fmt::format("--eval{}: {} has no val/ folder", o.eval_only ? "-only" : "", o.data));
  if (eval) inputs.test = image_split(o, normalize, val, false, classes);
  if (!o.eval_only) inputs.data = train_set;
  const int classes_found = (train_set ? train_set : inputs.test)->num_classes();
  if (!o.num_classes) o.num_classes = classes_found;
  if (*o.num_classes < classes_found)
    throw UsageError(fmt::format("--num-classes {}: the image folder has {} classes", *o.num_classes, classes_found));
  return inputs;
}

// The training split (not needed to evaluate a checkpoint), and the test split when there is one.
Inputs load_inputs(Options& o, const Normalization& normalize, int global_batch) {
  Inputs inputs;
  if (o.generate) return inputs;  // the prompt is the input
  if (!o.tokens.empty()) {
    // llm.c's shards: its batches are the global batch's (a step's samples are consecutive here).
    const auto shards = [&](const std::string& pattern) {
      return as_usage_error([&] {
        std::vector<std::shared_ptr<const dp::llmc::TokenShard>> out;
        for (const std::string& path : dp::llmc::glob_shards(pattern))
          out.push_back(std::make_shared<const dp::llmc::TokenShard>(path, o.vocab));
        return out;
      });
    };
    if (!o.eval_only)
      inputs.data = as_usage_error([&] {
        return std::make_shared<const dp::llmc::TokenSamples>(shards(o.tokens), o.context, global_batch, o.vocab,
                                                              !o.no_shuffle);
      });
    if (!o.val_tokens.empty())
      inputs.test = as_usage_error([&] {
        return std::make_shared<const dp::llmc::TokenSamples>(shards(o.val_tokens), o.context, global_batch, o.vocab,
                                                              false);
      });
  } else if (!o.text.empty()) {
    const auto corpus =
        as_usage_error([&] { return std::make_shared<const dp::TextCorpus>(dp::load_text(o.text, o.context)); });
    using Split = dp::TextWindows::Split;
    if (!o.eval_only) inputs.data = std::make_shared<const dp::TextWindows>(corpus, Split::train, o.context);
    if (o.eval_only || o.eval.value_or(true))
      inputs.test = std::make_shared<const dp::TextWindows>(corpus, Split::held_out, o.context);
  } else if (takes_image_folders(o)) {
    inputs = load_image_folders(o, normalize);
  } else {
    std::string data_dir;
    if (!o.data.empty()) data_dir = as_usage_error([&] { return dp::find_data_dir(o.data); });
    const Normalization grey = normalize.for_channels(1);
    const dp::Normalize one{grey.mean[0], grey.std[0]};
    if (!o.eval_only)
      inputs.data = as_usage_error([&] {
        return std::make_shared<const dp::DatasetSource>(
            !data_dir.empty() ? dp::load_mnist(data_dir) : dp::make_synthetic(o.synthetic.value_or(2048), o.seed), one);
      });
    const bool test_split = !data_dir.empty() && dp::has_split(data_dir, dp::Split::test);
    const bool eval = o.eval_only || o.eval.value_or(test_split);
    if (eval && !test_split)
      throw UsageError(
          fmt::format("--eval{}: {} has no test split (t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, "
                      "plain or .gz)",
                      o.eval_only ? "-only" : "", data_dir.empty() ? "synthetic data" : data_dir));
    if (eval)
      inputs.test = as_usage_error(
          [&] { return std::make_shared<const dp::DatasetSource>(dp::load_mnist(data_dir, dp::Split::test), one); });
  }
  if (inputs.data) inputs.data = keep_first(inputs.data, o.limit_train, "--limit-train");
  if (inputs.test) inputs.test = keep_first(inputs.test, o.limit_test, "--limit-test");
  return inputs;
}

// dp_train's checkpoints say in "dp.hidden" which MLP they hold: a file whose tensors contradict it
// (edited or assembled by hand) is refused, as --hidden contradicting the tensors is.
void check_hidden_tag(const std::string& path, const dp::safetensors::File& file) {
  const auto tag = file.metadata.find("dp.hidden");
  const auto model = file.metadata.find("dp.model");
  if (tag == file.metadata.end() || tag->second.empty()) return;
  if (model != file.metadata.end()) {
    const dp::models::ModelSpec* spec = dp::models::find_model(model->second);
    if (!spec || !spec->takes(dp::models::ModelArg::hidden)) return;
  }
  const std::string what = fmt::format("{}: metadata 'dp.hidden'", path);
  const std::vector<int> hidden = parse_int_list(tag->second, what.c_str());
  const auto find = [&](std::size_t layer) -> const dp::safetensors::Tensor* {
    const std::string name = fmt::format("fc{}.weight", layer);
    return file.has(name) ? &file.at(name) : file.has("module." + name) ? &file.at("module." + name) : nullptr;
  };
  for (std::size_t i = 0; i < hidden.size(); ++i) {
    const dp::safetensors::Tensor* weight = find(i + 1);
    if (!weight || weight->shape.empty() || weight->shape[0] != hidden[i])
      throw UsageError(
          fmt::format("{} = '{}' contradicts the tensors: fc{}.weight {} (expected {} rows)", what, tag->second, i + 1,
                      weight ? fmt::format("has shape {}", dp::format_shape(weight->shape)) : "is missing", hidden[i]));
  }
  if (!find(hidden.size() + 1) || find(hidden.size() + 2))
    throw UsageError(fmt::format("{} = '{}' contradicts the tensors: they hold {} than {} hidden layer(s)", what,
                                 tag->second, find(hidden.size() + 1) ? "more" : "fewer", hidden.size()));
}

// What a resumed run changes from the run that saved the checkpoint: said as a note where PyTorch
// users expect the new value to win (the device count: another data order and epochs; Dropout's
// rate), refused where the checkpoint's state would be silently dropped (its SGD momentum buffers
// with --momentum 0).
void check_resumed_settings(const Options& o, const dp::TrainingState& state, int world) {
  const auto& tags = state.progress().tags;
  if (tags.count("world") && tags.at("world") != fmt::format("{}", world))
    say("note: the checkpoint was trained on {} device(s); continuing on {} ({})\n", tags.at("world"), world,
        o.shards > 0 ? fmt::format("the same trajectory: its {} shards fix it", o.shards)
                     : "another data order; the epochs go on from the checkpoint's");
  if (tags.count("dropout") && tags.at("dropout") != fmt::format("{}", o.dropout))
    say("note: the checkpoint was trained with --dropout {}; continuing with {}\n", tags.at("dropout"), o.dropout);
  const bool saved_momentum =
      std::any_of(state.file().tensors.begin(), state.file().tensors.end(),
                  [](const auto& entry) { return entry.first.starts_with("optimizer.momentum."); });
  if (saved_momentum && o.optimizer == dp::tools::OptimizerKind::sgd && o.momentum == 0.0f)
    throw UsageError(
        fmt::format("--resume {}: the checkpoint holds SGD momentum buffers, which --momentum 0 would "
                    "drop: resume with the momentum it was trained with",
                    o.resume));
}

// A step count the checkpoint `path` records under "dp.<key>", if it does.
std::optional<long> step_tag(const std::string& path, const std::map<std::string, std::string>& tags,
                             const std::string& key) {
  const auto it = tags.find(key);
  if (it == tags.end()) return std::nullopt;
  long value = 0;
  const std::string& text = it->second;
  const auto [at, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || at != text.data() + text.size() || value < 0)
    throw UsageError(fmt::format("--resume {}: metadata 'dp.{}' = '{}' is not a step count", path, key, text));
  return value;
}

// Where the checkpoint's run stood and the end it planned; refused where the tags contradict the step.
void read_progress(const std::string& path, Resumed& resumed) {
  const dp::TrainingProgress& progress = resumed.state->progress();
  resumed.start_step = static_cast<long>(progress.step);
  resumed.epoch = static_cast<long>(progress.epoch);
  const auto& tags = progress.tags;
  resumed.epoch_start = step_tag(path, tags, "epoch_start");
  resumed.epoch_steps = step_tag(path, tags, "epoch_steps");
  resumed.end_step = step_tag(path, tags, "end_step");
  resumed.end_epoch = step_tag(path, tags, "end_epoch");
  if (resumed.epoch_start.has_value() != resumed.epoch_steps.has_value() ||
      (resumed.epoch_steps && (*resumed.epoch_steps < 1 || *resumed.epoch_start > resumed.start_step ||
                               resumed.start_step - *resumed.epoch_start >= *resumed.epoch_steps)))
    throw UsageError(fmt::format("--resume {}: metadata 'dp.epoch_start' and 'dp.epoch_steps' contradict step {}", path,
                                 resumed.start_step));
}

// The checkpoint to resume, validated before the data are loaded and the runtime spins up: the
// run takes its seed, which draws the synthetic data, the initialisation and the shuffling.
Resumed read_resume(Options& o, int world) {
  Resumed resumed;
  if (o.resume.empty()) return resumed;
  resumed.state = as_usage_error([&] { return dp::TrainingState::read(o.resume); });
  check_hidden_tag(o.resume, resumed.state->file());
  read_progress(o.resume, resumed);
  const dp::TrainingProgress& progress = resumed.state->progress();
  const auto& tags = progress.tags;
  if (tags.count("model") && tags.at("model") != o.model)
    throw UsageError(fmt::format("--resume {}: the checkpoint is a {}, not a {}", o.resume, tags.at("model"), o.model));
  if (tags.count("mode") && tags.at("mode") != dp::to_string(o.mode))
    say("note: the checkpoint was trained in {} mode; continuing in {} mode ({})\n", tags.at("mode"),
        dp::to_string(o.mode),
        o.shards > 0 ? fmt::format("the same trajectory: its {} shards fix it", o.shards) : "a different data order");
  if (o.given.count("--seed") && progress.seed != o.seed)
    say("note: the checkpoint was trained with --seed {}; continuing with its seed, not {}\n", progress.seed, o.seed);
  o.seed = progress.seed;
  check_resumed_settings(o, *resumed.state, world);
  return resumed;
}

}  // namespace dp_train
