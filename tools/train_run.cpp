// train_run.cpp — dp_train's run as named steps, in the order a run takes them: validate, load,
// resume, build the runtime and engine, then evaluate a checkpoint or train, evaluate and save.
#include "train_run.h"

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

namespace dp_train {

dp::tools::Job g_job("dp_train");

namespace {

using Loaders = std::vector<std::unique_ptr<dp::BatchLoader>>;

// What validating the flags works out that later steps use.
struct Checked {
  std::vector<int> hidden;
  Normalization normalize;
};

struct Devices {
  std::vector<int> ids;  // this process's devices, in rank order
  bool cuda = false;
  int highest = 0;
};

struct Inputs {
  std::shared_ptr<const dp::SampleSource> data;  // the training split (none to evaluate a checkpoint)
  std::shared_ptr<const dp::SampleSource> test;  // when evaluating
};

// The checkpoint a run resumes, and where its run stood: the epoch of its next step, where that
// epoch began and how many steps its epochs had, and the end it planned (tags a checkpoint from
// another program may lack).
struct Resumed {
  std::optional<dp::TrainingState> state;
  long start_step = 0;
  long epoch = 0;
  std::optional<long> epoch_start, epoch_steps;
  std::optional<long> end_step, end_epoch;
};

// The model is destroyed before the runtime it lives on.
struct Built {
  std::unique_ptr<dp::Runtime> runtime;
  std::unique_ptr<dp::Model> model;
};

// A run's epochs: epoch `first` begins at step `first_step`, and every epoch has `steps` steps. A
// run resumed on another device count numbers its epochs on from the checkpoint's.
struct Epochs {
  long first = 0, first_step = 0, steps = 1;

  long of(long step) const { return first + (step - first_step) / steps; }
  long into(long step) const { return (step - first_step) % steps; }  // steps into its epoch
  long start(long step) const { return step - into(step); }
};

// The run's length, epochs and learning rates, known once the engine says how many ranks read the data.
struct Plan {
  int world, shards;  // devices training together; ranks reading the data set (1 for single and dp)
  long start_step, total_steps;
  Epochs epochs;
  long planned_end = 0;           // the end asked for: end_step(), unless the checkpoint is past it
  std::optional<long> end_epoch;  // the epoch the run ends with, when it was planned in epochs
  dp::LrSchedule schedule = dp::LrSchedule::constant();
  // Each data rank's batches per step: --accumulate's micro-batches (with shards the engine's shards
  // hold them: 1).
  long micro = 1;

  long end_step() const { return start_step + total_steps; }
};

// A non-finite evaluation loss is divergence, as a non-finite training loss is: the run stops with
// exit code 3 and saves nothing. Every process sees the same summed loss, so every process stops.
// `what` is `loss` (`where`: " at step 3"): exit code 3, naming what stays on disk: --save is not
// written; `kept` says what this run wrote before (its --save-best).
int diverged(const Options& o, double loss, const std::string& what, const std::string& where = "",
             const std::string& kept = "") {
  if (std::isfinite(loss)) return 0;
  if (g_job.primary())
    fmt::print(stderr, "\ndp_train: error: {} is {}{}; stopping{}{}\n", what, loss, where,
               o.save.empty() ? "" : fmt::format(", {} was not written", o.save), kept);
  return 3;
}

// A path process 0 will write, checked before any work rather than discovered after the last step.
void check_writable(const std::string& path, const char* flag) {
  if (path.empty() || !g_job.primary()) return;
  try {
    dp::check_writable(path);
  } catch (const dp::Error& e) {
    throw UsageError(fmt::format("{} {}", flag, e.what()));
  }
}

// --save-every's series beside --save: NAME.safetensors -> NAME.step<S>.safetensors (NAME.step<S>
// without that extension). The step S when `file` is one of them, else none.
std::optional<long> periodic_step(const std::string& save, const std::filesystem::path& file) {
  const std::filesystem::path path(save);
  const bool safetensors = path.extension() == ".safetensors";
  const std::string stem = (safetensors ? path.stem() : path.filename()).string() + ".step";
  const std::string tail = safetensors ? ".safetensors" : "";
  const std::string name = file.filename().string();
  if (name.size() <= stem.size() + tail.size() || !name.starts_with(stem) || !name.ends_with(tail)) return std::nullopt;
  std::error_code ec;
  const auto dir = [&](const std::filesystem::path& p) {
    return std::filesystem::weakly_canonical(p.parent_path().empty() ? "." : p.parent_path(), ec);
  };
  if (dir(path) != dir(file)) return std::nullopt;
  const std::string digits = name.substr(stem.size(), name.size() - stem.size() - tail.size());
  long step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

// Every output names a file of its own, and none overwrites an input (--resume and --save may name
// one checkpoint: a resumed run saves over the one it started from), nor one of --save's periodic
// series (which --save-every overwrites and --keep deletes).
void check_distinct_files(const Options& o) {
  if (!o.save.empty() && !o.save_best.empty() && periodic_step(o.save, o.save_best))
    throw UsageError(
        fmt::format("--save-best {} is a file of --save {}'s periodic series (--save-every writes "
                    "and --keep deletes those): name another file",
                    o.save_best, o.save));
  const std::pair<const char*, const std::string*> outputs[] = {{"--save", &o.save},
                                                                {"--metrics-json", &o.metrics_json},
                                                                {"--predictions", &o.predictions},
                                                                {"--save-best", &o.save_best}};
  const std::pair<const char*, const std::string*> inputs[] = {{"--init", &o.init}, {"--resume", &o.resume}};
  const auto same = dp_cli::same_file;
  for (std::size_t i = 0; i < std::size(outputs); ++i) {
    for (std::size_t j = i + 1; j < std::size(outputs); ++j)
      if (same(*outputs[i].second, *outputs[j].second))
        throw UsageError(
            fmt::format("{} and {} name the same file {}", outputs[i].first, outputs[j].first, *outputs[i].second));
    for (const auto& [flag, path] : inputs)
      if (same(*outputs[i].second, *path) &&
          !(outputs[i].first == std::string("--save") && flag == std::string("--resume")))
        throw UsageError(fmt::format("{} {} would overwrite the {} input", outputs[i].first, *outputs[i].second, flag));
  }
}

const dp::models::ModelSpec& model_of(const Options& o) { return dp::models::model_spec(o.model); }

std::vector<int> parse_hidden(const Options& o) {
  std::vector<int> hidden;
  if (!model_of(o).takes(dp::models::ModelArg::hidden)) return hidden;
  hidden = parse_int_list(o.hidden, "--hidden");
  for (int h : hidden)
    if (h < 1) throw UsageError(fmt::format("--hidden '{}': layer sizes must be >= 1", o.hidden));
  return hidden;
}

// The models whose inputs are S x S RGB images (--image-size): torchvision's, fed by image folders.
bool takes_image_folders(const Options& o) { return model_of(o).takes(dp::models::ModelArg::image_size); }
bool image_folders(const Options& o) { return !o.train_dir.empty() || !o.val_dir.empty(); }

// Which data feeds which model: text the language model (or, sampling, none), image folders the
// models that take an image size (RGB, any size), the IDX sets and the synthetic one the others.
void check_data_options(const Options& o) {
  const bool text_model = model_of(o).takes(dp::models::ModelArg::gpt);
  if (o.generate && !text_model)
    throw UsageError(fmt::format("--generate samples from a language model (--model {}), not --model {}",
                                 models_taking(dp::models::ModelArg::gpt), o.model));
  if (o.generate) return;  // no data: the prompt is its input
  if (text_model && o.text.empty() && !o.eval_only)
    throw UsageError(fmt::format("--model {} trains on text: give --text FILE (its bytes are the tokens)", o.model));
  if (text_model && o.text.empty())
    throw UsageError(fmt::format("--model {} evaluates on text: give --text FILE (its last 10 % is scored)", o.model));
  if (!o.text.empty() && !text_model)
    throw UsageError(fmt::format("--text trains a language model (--model {}), not --model {}",
                                 models_taking(dp::models::ModelArg::gpt), o.model));
  if (text_model) return;  // no images, no IDX files
  const bool images = image_folders(o) || (!o.data.empty() && std::filesystem::is_directory(o.data + "/train"));
  if (takes_image_folders(o) && !images)
    throw UsageError(
        fmt::format("--model {} trains on RGB images: give an image folder (--data DIR holding train/ "
                    "and val/, or --train-dir and --val-dir)",
                    o.model));
  if (images && !takes_image_folders(o)) {
    const auto shape = model_of(o).input_shape({});
    throw UsageError(fmt::format("--model {} takes {}x{} {} images (IDX files); an image folder trains --model {}",
                                 o.model, shape[1], shape[2], shape[0] == 1 ? "grey" : "RGB",
                                 models_taking(dp::models::ModelArg::image_size)));
  }
  if (!images && (o.given.count("--image-size") || o.given.count("--resize")))
    throw UsageError("--image-size and --resize apply to image folders");
  if (!o.train_dir.empty() && o.val_dir.empty() && o.eval == true)
    throw UsageError("--eval needs the image folder to evaluate on: give --val-dir");
  if (o.eval_only && !o.train_dir.empty() && o.val_dir.empty())
    throw UsageError("--eval-only evaluates on --val-dir: give it");
  if (!o.eval_only && o.train_dir.empty() && !o.val_dir.empty())
    throw UsageError(
        "--val-dir without --train-dir: training needs the folder to train on (--eval-only --init CKPT evaluates "
        "on --val-dir alone)");
  if (o.loader_only && o.eval_only) throw UsageError("--loader-only reads training batches: not with --eval-only");
  const int classes = model_of(o).num_classes({});
  if (!model_of(o).takes(dp::models::ModelArg::num_classes) && o.num_classes && *o.num_classes != classes)
    throw UsageError(fmt::format("--num-classes {}: --model {} has {} classes", *o.num_classes, o.model, classes));
}

// Everything is validated before any work, so bad input never leaves a file behind.
Checked validate_options(const Options& o) {
  const int processes = g_job.processes()->size();
  if (processes > 1 && o.mode != dp::EngineKind::ddp)
    throw UsageError(
        fmt::format("--mode {} is single-process, but mpirun started {} processes: use --mode ddp across processes",
                    dp::to_string(o.mode), processes));
  if (processes > 1 && !o.predictions.empty())
    throw UsageError("--predictions writes one process's test-set order: run --eval-only without mpirun");
  Checked checked{parse_hidden(o), {}};
  if (o.dropout > 0.0 && !model_of(o).takes(dp::models::ModelArg::dropout))
    throw UsageError(fmt::format("--dropout applies to --model {}", models_taking(dp::models::ModelArg::dropout)));
  if (const std::string why = dp::tools::misapplied_flag(o, dp::to_string(o.mode)); !why.empty()) throw UsageError(why);
  if (o.output_device && o.mode != dp::EngineKind::dp) throw UsageError("--output-device applies to --mode dp only");
  if (!o.normalize.empty()) checked.normalize = parse_normalize(o.normalize);
  check_data_options(o);
  if (const std::string why = misapplied_model_flag(o); !why.empty()) throw UsageError(why);
  if (o.shards > 0 && static_cast<long>(o.shards) * o.accumulate > dp::tools::kMaxShards)
    throw UsageError(
        fmt::format("--shards {} x --accumulate {}: {} shards per step (a loader thread each), more "
                    "than the {} dp allows",
                    o.shards, o.accumulate, static_cast<long>(o.shards) * o.accumulate, dp::tools::kMaxShards));
  if (o.eval_only && o.init.empty() && o.resume.empty())
    throw UsageError("--eval-only evaluates a checkpoint: give it with --init (or --resume)");
  if (o.eval_only && (o.steps || o.epochs || !o.save.empty()))
    throw UsageError("--eval-only trains nothing: it takes no --steps, --epochs or --save");
  if (o.eval_only && o.eval == false) throw UsageError("--eval-only and --no-eval contradict each other");
  if (!o.predictions.empty() && !o.eval_only) throw UsageError("--predictions goes with --eval-only");
  if (o.generate && o.init.empty()) throw UsageError("--generate samples from a checkpoint: give it with --init");
  if (o.generate && (o.eval_only || o.steps || o.epochs || !o.save.empty() || !o.text.empty()))
    throw UsageError(
        "--generate trains and evaluates nothing: it takes no --eval-only, --steps, --epochs, --save or --text");
  if (o.generate && o.mode != dp::EngineKind::single)
    throw UsageError(
        fmt::format("--generate samples one sequence on one device: leave out --mode {}", dp::to_string(o.mode)));
  check_writable(o.predictions, "--predictions");
  check_writable(o.save, "--save");
  check_writable(o.save_best, "--save-best");
  if (o.eval_only && (o.eval_every || !o.save_best.empty()))
    throw UsageError("--eval-only trains nothing: it takes no --eval-every or --save-best");
  check_writable(o.metrics_json, "--metrics-json");
  check_distinct_files(o);
  return checked;
}

std::vector<int> parse_device_ids(const Options& o) {
  std::vector<int> ids;
  if (o.device_ids.empty()) return ids;
  ids = parse_int_list(o.device_ids, "--device-ids");
  std::set<int> seen;
  for (int id : ids) {
    if (id < 0) throw UsageError(fmt::format("--device-ids {}: device {} is negative", o.device_ids, id));
    if (!seen.insert(id).second)
      throw UsageError(fmt::format("--device-ids {}: device {} appears twice", o.device_ids, id));
  }
  return ids;
}

Devices choose_devices(const Options& o) {
  Devices d{parse_device_ids(o), false, 0};
  using dp::tools::BackendChoice;
  d.cuda = o.backend == BackendChoice::cuda ||
           (o.backend == BackendChoice::automatic && dp::Runtime::cuda_device_count() > 0);
  // Several dp devices may share a GPU (--devices-per-gpu): every device of every GPU is one.
  const int available = d.cuda ? dp::Runtime::cuda_device_count() * o.devices_per_gpu : dp::tools::kMaxSimDevices;
  if (d.cuda && available == 0)
    throw UsageError(dp::Runtime::cuda_compiled() ? "--backend cuda: no CUDA device is visible"
                                                  : "--backend cuda: this build of dp has no cuda backend");
  // An env:// launch with a process per GPU (torchrun's way): LOCAL_RANK picks this process's device
  // unless --devices or --device-ids say otherwise.
  if (const char* local = std::getenv("LOCAL_RANK"); local && g_job.several() && d.ids.empty() && !o.devices) {
    int rank = -1;
    const std::string text = local;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), rank);
    if (text.empty() || error != std::errc() || end != text.data() + text.size() || rank < 0)
      throw UsageError(fmt::format("LOCAL_RANK='{}' is not a device index", text));
    d.ids.push_back(rank);
  }
  const int count =
      o.devices.value_or(o.mode == dp::EngineKind::single ? 1 : dp::tools::default_devices(d.cuda, available));
  if (d.ids.empty()) {
    for (int i = 0; i < count; ++i) d.ids.push_back(i);
  }
  if (o.mode == dp::EngineKind::single && d.ids.size() > 1) d.ids.erase(d.ids.begin() + 1, d.ids.end());
  d.highest = *std::max_element(d.ids.begin(), d.ids.end());
  if (d.cuda && d.highest >= available)
    throw UsageError(fmt::format("{} device(s) requested (up to device {}), but only {} CUDA device(s) are available",
                                 d.ids.size(), d.highest, available));
  if (!d.cuda && d.highest >= dp::tools::kMaxSimDevices)
    throw UsageError(
        fmt::format("device {}: the sim backend simulates at most {} devices", d.highest, dp::tools::kMaxSimDevices));
  if (!d.cuda && (d.highest + 1) % o.devices_per_gpu != 0)
    throw UsageError(fmt::format("--devices-per-gpu {} does not divide the {} simulated device(s) (devices 0..{})",
                                 o.devices_per_gpu, d.highest + 1, d.highest));
  if (o.output_device && std::find(d.ids.begin(), d.ids.end(), *o.output_device) == d.ids.end())
    throw UsageError(fmt::format("--output-device {} is not among the devices [{}]", *o.output_device, ids_of(d.ids)));
  return d;
}

// The optimizer's own checks (nesterov without momentum, ...) at the run's largest lr before the
// warm-up and schedule: --scale-lr multiplies it by the `world` devices, which may take a finite lr
// past the largest float (the optimizers compute in fp32).
void check_learning_rate(const Options& o, int world) {
  const double scaled = o.scale_lr ? o.lr * world : o.lr;
  if (!(std::fabs(scaled) <= std::numeric_limits<float>::max()))
    throw UsageError(
        fmt::format("--lr {:g} x {} device(s) (--scale-lr): the scaled learning rate {:g} overflows a "
                    "float (at most {:g})",
                    o.lr, world, scaled, std::numeric_limits<float>::max()));
  try {
    std::visit([](const auto& options) { dp::validate(options); }, optimizer_options(o, scaled));
  } catch (const dp::Error& e) {
    throw UsageError(e.what());
  }
}

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
Inputs load_inputs(Options& o, const Normalization& normalize) {
  Inputs inputs;
  if (o.generate) return inputs;  // the prompt is the input
  if (!o.text.empty()) {
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

// What --init loaded, as torch prints load_state_dict(strict=False)'s result: the keys left out
// either way (none under strict, which refuses them).
void report_init(const std::string& path, const dp::StateDictKeys& keys) {
  const auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (const auto& name : names) text += (text.empty() ? "'" : ", '") + name + "'";
    return "[" + text + "]";
  };
  if (keys.module_prefix)
    say("dp_train: --init {}: tensor names carry DataParallel's 'module.' prefix (dropped)\n", path);
  if (!keys.missing.empty() || !keys.unexpected.empty())
    say("dp_train: --init {}: missing_keys={} unexpected_keys={}\n", path, list(keys.missing), list(keys.unexpected));
}

Built build_model(const Options& o, const Checked& checked, const Devices& devices, const Resumed& resumed) {
  dp::RuntimeOptions runtime_options;
  runtime_options.backend = devices.cuda ? "cuda" : "sim";
  runtime_options.sim_devices = devices.highest + 1;
  runtime_options.devices_per_gpu = o.devices_per_gpu;
  runtime_options.precision = dp::parse_precision(o.precision);
  Built built;
  built.runtime = dp::Runtime::create(runtime_options);
  dp::Device& source = built.runtime->device(devices.ids[0]);
  built.model = model_of(o).build(source, model_args(o, checked.hidden), o.seed);
  dp::Model& model = *built.model;
  as_usage_error([&] {
    if (!o.init.empty()) {
      const dp::safetensors::File init = dp::safetensors::read(o.init);
      check_hidden_tag(o.init, init);
      const dp::StateDictKeys keys = dp::load_state_dict(model, source.create_stream(), init, "", !o.init_non_strict);
      report_init(o.init, keys);
    }
    if (resumed.state) resumed.state->load_model(model);  // before the engine: DDP broadcasts rank 0's values
    return 0;
  });
  return built;
}

// Every process is ready (or all stop with the first failing one's exit code); from here on the
// processes meet in collectives.
void join_collectives(const Options& o, const Devices& devices, const Inputs& inputs) {
  g_job.agree_or_stop();
  if (g_job.several())  // hashes the data
    g_job.agree_on_configuration(configuration(o, devices.ids, devices.cuda, inputs.data.get(), inputs.test.get()));
  g_job.collectives_begin();
}

// The engine, picked once: everything after it runs through dp::Engine.
std::unique_ptr<dp::Engine> build_engine(const Options& o, const Devices& devices, int world, Built& built,
                                         const Resumed& resumed) {
  // The schedule needs the run's length, known later; the optimizer starts at the warm-up's first lr
  // and every step sets its own.
  const dp::OptimizerOptions optimizer =
      optimizer_options(o, lr_at(o, world, resumed.start_step, dp::LrSchedule::constant()));
  dp::EngineOptions engine_options;
  engine_options.kind = o.mode;
  engine_options.device_ids = devices.ids;
  engine_options.processes = g_job.processes();
  dp::tools::set_engine_options(o, engine_options, train_flags());
  auto engine = dp::make_engine(*built.runtime, *built.model, optimizer, engine_options);
  if (resumed.state)
    as_usage_error([&] {
      resumed.state->load_optimizers(*built.model, engine->whole_optimizers());
      engine->whole_optimizers_loaded();
      return 0;
    });
  return engine;
}

// Text: the test loss (nats per byte predicted) in bits per byte, the unit byte-level models are
// compared in; nothing for other data.
std::optional<double> bits_per_byte(const Options& o, const dp::EvalTotals& totals) {
  if (o.text.empty()) return std::nullopt;
  return totals.mean_loss() / std::log(2.0);
}

std::string bits_per_byte_text(const Options& o, const dp::EvalTotals& totals) {
  const auto bpb = bits_per_byte(o, totals);
  return bpb ? fmt::format(" | test {:.4f} bits/byte", *bpb) : std::string();
}

// --generate: nanoGPT's sample.py on the --init checkpoint. The prompt's bytes (the last --context
// of them), then N bytes, each drawn from the softmax of the last position's logits over T (among
// the K likeliest), printed and fed back. A shorter sequence sits at the window's start with zeros
// after it: causal attention keeps them out of every position up to its last.
int generate_text(const Options& o, dp::Engine& engine) {
  const dp::Model& model = engine.model();
  const auto context = static_cast<std::size_t>(model.targets_per_sample());
  const auto vocab = static_cast<std::size_t>(model.output_features());
  std::vector<std::uint8_t> tokens(o.prompt.begin(), o.prompt.end());
  if (tokens.empty()) tokens.push_back('\n');
  std::mt19937_64 rng(o.seed);
  std::vector<float> window(context);
  for (long i = 0; i < o.generate; ++i) {
    const std::size_t n = std::min(tokens.size(), context);
    std::fill(window.begin(), window.end(), 0.0f);
    std::copy(tokens.end() - static_cast<std::ptrdiff_t>(n), tokens.end(), window.begin());
    const dp::Batch batch{window.data(), nullptr, 1};
    const std::vector<float> logits = engine.predict(std::span<const dp::Batch>(&batch, 1));
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
    const int next =
        sample_token(std::span<const float>(logits.data() + (n - 1) * vocab, vocab), o.temperature, o.top_k, u);
    tokens.push_back(static_cast<std::uint8_t>(next));
    if (g_job.primary()) std::fputc(next, stdout);
  }
  say("\n");
  std::fflush(stdout);
  return 0;
}

// --eval-only: the checkpoint's test loss and accuracy, and with --predictions each sample's class.
int evaluate_only(const Options& o, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
                  MetricsLog& metrics) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::int32_t> predictions;
  const dp::EvalTotals totals =
      evaluate(engine, runtime, inputs.test, o.batch_size, o.workers, o.predictions.empty() ? nullptr : &predictions);
  g_job.collectives_end();
  const std::string& checkpoint = o.init.empty() ? o.resume : o.init;
  if (const int code = diverged(o, totals.mean_loss(), fmt::format("the test loss of {}", checkpoint))) return code;
  if (!o.predictions.empty()) {
    std::string text;
    for (const std::int32_t c : predictions) text += fmt::format("{}\n", c);
    dp::write_atomically(o.predictions, text);
  }
  const double seconds = since(t0);
  say("dp_train: {} on {} test {}: test loss {:.6f}, test accuracy {:.2f}% ({} correct){} in {}\n", checkpoint,
      totals.samples, o.text.empty() ? "samples" : "tokens", totals.mean_loss(), 100.0 * totals.accuracy(),
      totals.correct, bits_per_byte_text(o, totals), duration_text(seconds));
  nlohmann::json record = {{"kind", "eval"},
                           {"checkpoint", checkpoint},
                           {"test_loss", totals.mean_loss()},
                           {"test_accuracy", totals.accuracy()},
                           {"test_correct", totals.correct},
                           {"test_samples", totals.samples}};
  if (const auto bpb = bits_per_byte(o, totals)) record["test_bits_per_byte"] = *bpb;
  metrics.write(record);
  g_job.agree_or_stop();
  return 0;
}

// Where a resumed run's epochs begin: on from the checkpoint's, whose epoch began at epoch_start.
// With epochs of another length (another device count, batch size or data set), an epoch the
// checkpoint stopped inside starts over at the resumed step, under the same number. A checkpoint
// that does not say (another program's) counts epochs from step 0.
void place_epochs(const Resumed& resumed, Plan& plan) {
  if (!resumed.state || !resumed.epoch_start) return;
  plan.epochs.first = resumed.epoch;
  plan.epochs.first_step = *resumed.epoch_start;
  if (*resumed.epoch_steps == plan.epochs.steps) return;
  if (resumed.start_step != *resumed.epoch_start)
    say("note: the checkpoint stopped {} step(s) into epoch {} of {} steps; this run's epochs have {}: epoch {} "
        "starts over\n",
        resumed.start_step - *resumed.epoch_start, resumed.epoch + 1, *resumed.epoch_steps, plan.epochs.steps,
        resumed.epoch + 1);
  plan.epochs.first_step = resumed.start_step;
}

// The step the run ends at, counted from the start of training (not from the checkpoint): --steps;
// the end of epoch --epochs; else the end the resumed checkpoint's run planned; else one epoch. So
// re-running a stopped command with --resume finishes the run it started, and re-running a
// finished one trains nothing.
long planned_end(const Options& o, const Resumed& resumed, Plan& plan) {
  if (o.steps) return *o.steps;
  std::optional<long> epochs = o.epochs ? std::optional<long>(*o.epochs) : resumed.end_epoch;
  if (!epochs && resumed.end_step) return *resumed.end_step;
  plan.end_epoch = epochs.value_or(1);
  long steps = 0, end = 0;
  if (__builtin_mul_overflow(*plan.end_epoch - plan.epochs.first, plan.epochs.steps, &steps) ||
      __builtin_add_overflow(plan.epochs.first_step, steps, &end))
    throw UsageError(fmt::format("--epochs {} of {} step(s): the run would end past step {}", *plan.end_epoch,
                                 plan.epochs.steps, std::numeric_limits<long>::max()));
  return end;
}

// single and dp read the whole data set in order (one replica); ddp ranks read their shards: this
// process's ranks first_rank() .. first_rank() + batches_per_step() - 1 of world_size().
Plan plan_run(const Options& o, const dp::Engine& engine, const dp::SampleSource& data, int world,
              const Resumed& resumed) {
  const int shards = engine.world_size();
  const std::size_t per_rank_samples = dp::DistributedSampler(data.size(), shards, 0, false, 0).num_samples();
  const long batches = static_cast<long>((per_rank_samples + static_cast<std::size_t>(o.batch_size) - 1) /
                                         static_cast<std::size_t>(o.batch_size));
  // --accumulate K: an epoch's optimizer steps take K of its batches each; the last batches of an
  // epoch, fewer than K, are left out, as torch's `if (i + 1) % K == 0: step()` leaves them.
  // With shards the engine's shards already count the K micro-batches (world_size() = K x V).
  const long micro = engine.batches_per_step() / engine.batches_per_forward();
  const long batches_per_epoch = batches / micro;
  if (batches_per_epoch == 0)
    throw UsageError(
        fmt::format("--accumulate {}: an epoch of {} batch(es) of {} per rank holds no step of {} "
                    "micro-batches",
                    o.accumulate, batches, o.batch_size, o.accumulate));
  Plan plan{world, shards,       resumed.start_step,        0, Epochs{0, 0, batches_per_epoch},
            0,     std::nullopt, dp::LrSchedule::constant()};
  plan.micro = micro;
  place_epochs(resumed, plan);
  plan.planned_end = planned_end(o, resumed, plan);
  plan.total_steps = std::max(0L, plan.planned_end - plan.start_step);
  if (plan.total_steps == 0) return plan;
  plan.schedule = make_schedule(o, plan.end_step());
  check_schedule(o, world, plan.end_step(), plan.schedule);
  return plan;
}

// How the global batch of an optimizer step is made: " (8 per device)", " (3 micro-batches of 16)".
std::string batch_text(const Options& o, const Plan& plan) {
  if (o.shards > 0)
    return o.accumulate > 1
               ? fmt::format(" ({} per shard, {} micro-batches of {} shards)", o.batch_size, o.accumulate, o.shards)
               : fmt::format(" ({} per shard, {} shards)", o.batch_size, o.shards);
  const std::string per_device = plan.shards > 1 ? fmt::format("{} per device", o.batch_size) : "";
  if (o.accumulate > 1)
    return fmt::format(" ({} micro-batches of {}{})", o.accumulate, o.batch_size * plan.shards,
                       per_device.empty() ? "" : ", " + per_device);
  return per_device.empty() ? "" : " (" + per_device + ")";
}

void say_plan(const Options& o, const Plan& plan, const dp::Runtime& runtime, const dp::SampleSource& data,
              const Devices& devices) {
  const int processes = g_job.processes()->size();
  say("dp_train: {} {} on {} device(s) [{}]{} ({} backend, precision {}{}{}), {} samples, global batch {}{}, {} "
      "step(s) "
      "from step {}\n",
      o.model, dp::to_string(o.mode), plan.world, ids_of(devices.ids),
      processes > 1 ? fmt::format(" in each of {} processes", processes) : "", dp::to_string(runtime.backend()),
      o.precision, o.amp == dp::Autocast::bf16 ? ", autocast bf16" : "",
      dp::tools::banner_settings(o, dp::to_string(o.mode)), data.size(),
      o.batch_size * plan.shards * (o.shards > 0 ? 1 : o.accumulate), batch_text(o, plan), plan.total_steps,
      plan.start_step);
}

// --resume of a run that has reached the end asked for: nothing is trained or written.
int nothing_to_train(const Options& o, const Plan& plan) {
  g_job.collectives_end();
  say("dp_train: --resume {}: the checkpoint is at step {}, {} (step {}): nothing to train, nothing written\n",
      o.resume, plan.start_step,
      plan.planned_end == plan.start_step ? "the end of its run" : "past the end this run asks for", plan.planned_end);
  g_job.agree_or_stop();
  return 0;
}

// The data order: per step, the sample indices of each rank's batch, made by the rank's loader
// thread just before it fills the batch (constant memory, however many steps).
Loaders make_loaders(const Options& o, const Plan& plan, const dp::Engine& engine, dp::Runtime& runtime,
                     std::shared_ptr<const dp::SampleSource> data) {
  Loaders loaders;
  // Micro-batches per step from each loader (with shards, the engine's shards hold them).
  const long micro = plan.micro;
  for (int local = 0; local < engine.batches_per_forward(); ++local) {
    const int rank = engine.first_rank() + local;
    struct Order {
      dp::DistributedSampler sampler;
      std::vector<std::int64_t> indices;  // this epoch's, rebuilt only when the epoch changes
    };
    auto order = std::make_shared<Order>(
        Order{dp::DistributedSampler(data->size(), plan.shards, rank, !o.no_shuffle, o.seed), {}});
    const auto batch = static_cast<std::size_t>(o.batch_size);
    const bool log = o.log_batches;
    const long start_step = plan.start_step;
    const Epochs epochs = plan.epochs;
    auto batch_plan = [order, batch, log, rank, start_step, epochs, micro](std::size_t k) {
      const long s = start_step + static_cast<long>(k) / micro, epoch = epochs.of(s),
                 in_epoch = epochs.into(s) * micro + static_cast<long>(k) % micro;
      if (order->indices.empty() || order->sampler.epoch() != epoch) {
        order->sampler.set_epoch(epoch);
        order->indices = order->sampler.indices();
      }
      const std::size_t begin = static_cast<std::size_t>(in_epoch) * batch;
      const std::size_t end = std::min(order->indices.size(), begin + batch);
      std::vector<std::int64_t> mine(order->indices.begin() + static_cast<std::ptrdiff_t>(begin),
                                     order->indices.begin() + static_cast<std::ptrdiff_t>(end));
      if (log) fmt::print("batch step {} rank {}: {}\n", s, rank, fmt::join(mine, " "));
      return mine;
    };
    // Augmentations draw from (seed, rank, epoch, sample): reproducible, different on every rank,
    // and a resumed run draws what the uninterrupted one would have.
    dp::LoaderOptions options;
    options.workers = o.workers;
    options.key = dp::SampleKey{o.seed, rank, 0};
    options.epoch_of = [start_step, epochs, micro](std::size_t k) {
      return epochs.of(start_step + static_cast<long>(k) / micro);
    };
    loaders.push_back(std::make_unique<dp::BatchLoader>(
        runtime, data, static_cast<std::size_t>(plan.total_steps * micro), batch, batch_plan, std::move(options)));
  }
  return loaders;
}

// --loader-only: the run's batches read as training would read them, nothing trained; the loader's
// rate (decoding and augmentation included) alone.
// Timed from `t0`, before the loaders were made: the batches they fill ahead count too.
int read_batches_only(const Options& o, const Plan& plan, Loaders& loaders, MetricsLog& metrics,
                      std::chrono::steady_clock::time_point t0) {
  long images = 0;
  for (long s = 0; s < plan.total_steps * plan.micro; ++s)
    for (auto& loader : loaders) images += loader->next().size;
  const double seconds = std::max(since(t0), 1e-9);
  say("dp_train: loader: {} images in {} step(s) in {:.2f} s: {:.1f} images/s ({} loader(s), --workers {})\n", images,
      plan.total_steps, seconds, static_cast<double>(images) / seconds, loaders.size(), o.workers);
  metrics.write({{"kind", "loader"},
                 {"images", images},
                 {"steps", plan.total_steps},
                 {"seconds", seconds},
                 {"images_per_s", static_cast<double>(images) / seconds},
                 {"workers", o.workers}});
  return 0;
}

// The training loop: a line per --log-every steps, and after every epoch its train loss, the test
// loss and accuracy (--eval), throughput, elapsed time and the ETA.
void write_checkpoint(const Options& o, dp::Engine& engine, const Plan& plan, const std::string& path, long step);

// SIGTERM and SIGINT while training: the run finishes the step in flight, saves and exits with
// 128 + the signal (143, 130), as a preempted job should. A second signal ends it at once (the
// handler is reset after the first).
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signal) { g_stop_signal.store(signal); }

class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, &term_);
    sigaction(SIGINT, &action, &interrupt_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &term_, nullptr);
    sigaction(SIGINT, &interrupt_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction term_ {
  }, interrupt_{};
};

// --save-every: NAME.safetensors -> NAME.step<S>.safetensors beside it (NAME.step<S> without that
// extension).
std::filesystem::path periodic_path(const std::string& save, long step) {
  const std::filesystem::path path(save);
  const bool safetensors = path.extension() == ".safetensors";
  const std::string stem = safetensors ? path.stem().string() : path.filename().string();
  return path.parent_path() / fmt::format("{}.step{}{}", stem, step, safetensors ? ".safetensors" : "");
}

// --keep K: every NAME.step<S> checkpoint beside --save but the K of the latest steps is removed.
void prune_periodic(const std::string& save, long keep) {
  if (keep <= 0) return;
  const std::filesystem::path path(save);
  std::vector<std::pair<long, std::filesystem::path>> found;
  std::error_code ec;
  const auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file(ec)) continue;
    if (const auto step = periodic_step(save, entry.path())) found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < found.size(); ++i)
    std::filesystem::remove(found[i].second, ec);
}

// Training time over a stretch of steps: from `start`, less the pauses inside it (evaluations,
// checkpoints), so that a rate over the stretch is its steps' alone.
struct TrainingTime {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double paused = 0.0;

  double seconds() const { return std::max(1e-9, since(start) - paused); }
};

class TrainLoop {
 public:
  TrainLoop(const Options& o, const Plan& plan, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
            MetricsLog& metrics, Loaders& loaders)
      : o_(o),
        plan_(plan),
        engine_(engine),
        runtime_(runtime),
        test_(inputs.test),
        metrics_(metrics),
        loaders_(loaders) {}

  // Non-zero: the exit code of a run that stopped (a non-finite loss).
  int run();
  // The steps taken when run() returned 0: the planned end, or the step a stop signal ended it at.
  long reached() const { return reached_; }
  // 0, or the signal (SIGTERM, SIGINT) that stopped the run.
  int stop_signal() const { return stop_signal_; }

 private:
  // Pipelined (--pipeline on), step s is submitted before step s-1's loss is read, so the host
  // prepares and submits the next batch while the devices compute. Only within an epoch: the step
  // that ends one (or the run) is finished at once, since evaluating and saving need its state
  // with no later step applied. Everything printed and written is the same either way.
  struct Submitted {
    long s;
    double lr;
    long samples;
    dp::StepLoss loss;
  };

  std::vector<dp::Batch> next_batches(long& samples);
  int finish(Submitted& step);
  int finish_pending(std::optional<Submitted>& pending);
  void log_step(long s, long epoch, double lr, bool last);
  // On a terminal, the line updated in place after step s: where the run is, its loss and rate, and
  // when its epoch and the run will end (`extra`: the log step's gradient norm).
  void draw_progress(long s, long epoch, double lr, const std::string& extra = "");
  int end_epoch(long s, long epoch);
  // --eval-every: an evaluation after step s (not at an epoch's end, which evaluates anyway).
  bool eval_due(long s) const {
    return o_.eval_every > 0 && (s + 1) % o_.eval_every == 0 && plan_.epochs.into(s + 1) != 0 && s + 1 != end_step();
  }
  int evaluate_at(long s, long epoch);
  // --save-best: after an evaluation at `steps`, its checkpoint when the accuracy beats the best so
  // far (the first evaluation's always); whether it wrote one.
  bool save_if_best(const dp::EvalTotals& totals, long steps);
  long end_step() const { return plan_.end_step(); }
  // Time since `from` that was not training: out of the rates' windows.
  void pause(std::chrono::steady_clock::time_point from) {
    const double seconds = since(from);
    since_log_.paused += seconds;
    this_epoch_.paused += seconds;
    paused_total_ += seconds;
  }
  // Seconds of training since the loop began (pauses left out): when each step's loss was read.
  double training_clock() const { return since(t0_) - paused_total_; }
  // The stop signal every process agrees on before step s (0: none): under several processes the
  // first signalled process's, so that all stop at the same step.
  int agreed_stop(long s) const;
  // --save-every / --save-every-epoch after `steps` steps: whether one is due, and writing it.
  bool periodic_due(long steps) const {
    return (o_.save_every > 0 && steps % o_.save_every == 0) || (o_.save_every_epoch && plan_.epochs.into(steps) == 0);
  }
  void save_periodic(long steps);

  const Options& o_;
  const Plan& plan_;
  dp::Engine& engine_;
  dp::Runtime& runtime_;
  std::shared_ptr<const dp::SampleSource> test_;
  MetricsLog& metrics_;
  Loaders& loaders_;
  // mpirun forwards output through a pseudo-terminal: lines, not a progress line.
  const bool terminal_ = ::isatty(STDOUT_FILENO) != 0 && !g_job.several();
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  TrainingTime since_log_, this_epoch_;
  std::chrono::steady_clock::time_point drawn_ = t0_;  // the progress line's last update
  long samples_since_log_ = 0, steps_since_log_ = 0;
  // The rate of a log line spans at least kRateSteps steps: losses are read as the pipeline gives
  // them back, two of them at times back to back, and a window of one such step would log a rate of
  // millions of samples/s. `recent_`: (training_clock(), samples) of the last kRateSteps + 1 steps.
  static constexpr std::size_t kRateSteps = 4;
  std::deque<std::pair<double, long>> recent_;
  double paused_total_ = 0.0;
  float loss_ = 0.0f;
  double epoch_loss_sum_ = 0.0;  // sum of step loss x step samples: the epoch's mean per sample
  long epoch_samples_ = 0;
  long reached_ = 0;
  int stop_signal_ = 0;
  std::optional<double> best_accuracy_;  // --save-best: of this run's evaluations
  long best_step_ = 0;                   // and the step of the checkpoint it wrote
  // A diverged run's note on the best checkpoint it wrote before (it stays: a good model), or "".
  std::string kept() const {
    return best_accuracy_ ? fmt::format("; --save-best {} holds step {}'s model (test accuracy {:.2f}%)", o_.save_best,
                                        best_step_, 100.0 * *best_accuracy_)
                          : "";
  }
};

int TrainLoop::agreed_stop(long s) const {
  if (o_.signal_at_step > 0 && s + 1 == o_.signal_at_step && g_job.primary()) std::raise(SIGTERM);
  const int local = g_stop_signal.load();
  if (!g_job.several()) return local;
  for (const int signal : g_job.processes()->all_gather(local))
    if (signal != 0) return signal;
  return 0;
}

void TrainLoop::save_periodic(long steps) {
  const auto began = std::chrono::steady_clock::now();
  const std::filesystem::path path = periodic_path(o_.save, steps);
  write_checkpoint(o_, engine_, plan_, path.string(), steps);
  if (g_job.primary()) prune_periodic(o_.save, o_.keep);
  pause(began);
}

int TrainLoop::run() {
  reached_ = end_step();
  std::optional<Submitted> pending;  // submitted, its loss not yet read
  for (long s = plan_.start_step; s < end_step(); ++s) {
    if (const int signal = agreed_stop(s)) {
      if (const int code = finish_pending(pending)) return code;
      reached_ = s;
      stop_signal_ = signal;
      say("\ndp_train: {}: stopping after step {} of {}\n", signal == SIGINT ? "SIGINT" : "SIGTERM", s, end_step());
      return 0;
    }
    const double lr = lr_at(o_, plan_.world, s, plan_.schedule);
    engine_.set_lr(lr);
    long samples = 0;
    const std::vector<dp::Batch> batches = next_batches(samples);
    if (s + 1 == o_.fail_at_step) {
      // What the step before reports comes first, as without pipelining.
      if (const int code = finish_pending(pending)) return code;
      throw dp::Error(fmt::format("failing at step {} as asked (--debug-fail-at-step)", s + 1));
    }
    std::optional<Submitted> submitted;
    try {
      submitted.emplace(Submitted{s, lr, samples, engine_.submit_step(batches)});
    } catch (...) {  // the step before is reported first (its log line, or its divergence), as step by step
      const std::exception_ptr failure = std::current_exception();
      try {
        if (const int code = finish_pending(pending)) return code;
      } catch (...) {
        // The step before failed too: by itself (its failure is the cause), or cut short when this
        // step's failure aborted the collectives it was still running (this one is).
        if (!dp::tools::is_consequence(std::current_exception())) throw;
      }
      std::rethrow_exception(failure);
    }
    if (const int code = finish_pending(pending)) return code;
    // A step after which something reads the state (an epoch's evaluation, a checkpoint, a stop
    // request, which every process checks before the next step) is finished before the next.
    const bool ends_epoch = plan_.epochs.into(s + 1) == 0 || s + 1 == end_step();
    const bool checkpoint = periodic_due(s + 1) && s + 1 < end_step();
    const bool evaluation = eval_due(s);
    if (o_.pipeline && !ends_epoch && !checkpoint && !evaluation) {
      pending = std::move(*submitted);
    } else if (const int code = finish(*submitted)) {
      return code;
    }
    if (evaluation)
      if (const int code = evaluate_at(s, plan_.epochs.of(s))) return code;
    if (checkpoint) save_periodic(s + 1);
  }
  say("dp_train: {} step(s) in {:.2f} s, final loss {:.6f}\n", plan_.total_steps, since(t0_), loss_);
  return 0;
}

std::vector<dp::Batch> TrainLoop::next_batches(long& samples) {
  std::vector<dp::Batch> batches;
  // Rank after rank, each rank's micro-batches together (Engine::batches_per_step).
  for (auto& loader : loaders_) {
    for (long m = 0; m < plan_.micro; ++m) {
      batches.push_back(loader->next());
      samples += batches.back().size;
    }
  }
  samples *= plan_.shards / engine_.batches_per_forward();  // every rank's batch has this process's size
  return batches;
}

int TrainLoop::finish_pending(std::optional<Submitted>& pending) {
  if (!pending) return 0;
  const int code = finish(*pending);
  pending.reset();
  return code;
}

// Reads a submitted step's loss, then logs it and closes its epoch.
int TrainLoop::finish(Submitted& step) {
  const long s = step.s;
  loss_ = step.loss.get();
  const long epoch = plan_.epochs.of(s);
  // The loss of every rank: every process stops here.
  if (const int code = diverged(o_, loss_, "loss", fmt::format(" at step {} (epoch {})", s + 1, epoch + 1), kept()))
    return code;
  samples_since_log_ += step.samples;
  ++steps_since_log_;
  recent_.emplace_back(training_clock(), step.samples);
  if (recent_.size() > kRateSteps + 1) recent_.pop_front();
  epoch_loss_sum_ += static_cast<double>(loss_) * static_cast<double>(step.samples);
  epoch_samples_ += step.samples;
  const bool last = s + 1 == end_step();
  if ((s + 1) % o_.log_every == 0 || last)
    log_step(s, epoch, step.lr, last);
  else if (terminal_ && since(drawn_) >= 0.2)
    draw_progress(s, epoch, step.lr);
  // The end of an epoch (or of a run that stops inside one): its summary.
  if (plan_.epochs.into(s + 1) == 0 || last) return end_epoch(s, epoch);
  return 0;
}

void TrainLoop::log_step(long s, long epoch, double lr, bool last) {
  double rate = static_cast<double>(samples_since_log_) / since_log_.seconds();
  if (steps_since_log_ < static_cast<long>(kRateSteps)) {
    // The last kRateSteps steps, or every step since the loop began while there are fewer.
    const bool full = recent_.size() == kRateSteps + 1;
    long samples = 0;
    for (std::size_t i = full ? 1 : 0; i < recent_.size(); ++i) samples += recent_[i].second;
    rate = static_cast<double>(samples) / std::max(1e-9, recent_.back().first - (full ? recent_.front().first : 0.0));
  }
  // --clip-grad-norm: the step's norm before clipping (a wait for the step's update: at log lines only).
  const std::optional<float> grad_norm = engine_.last_grad_norm();
  const std::string line =
      fmt::format("step {:>6} epoch {:>3} loss {:.6f} lr {:.5g}{} samples/s {:.1f}", s + 1, epoch + 1, loss_, lr,
                  grad_norm ? fmt::format(" grad-norm {:.4g}", *grad_norm) : "", rate);
  nlohmann::json record = {{"kind", "step"}, {"step", s + 1},         {"epoch", epoch + 1},     {"loss", loss_},
                           {"lr", lr},       {"samples_per_s", rate}, {"elapsed_s", since(t0_)}};
  if (grad_norm) record["grad_norm"] = *grad_norm;
  metrics_.write(record);
  if (terminal_) {
    draw_progress(s, epoch, lr, grad_norm ? fmt::format(" | grad-norm {:.4g}", *grad_norm) : "");
    if (last) say("\n");
    std::fflush(stdout);
  } else {
    say("{}\n", line);
  }
  since_log_ = TrainingTime{};
  samples_since_log_ = 0;
  steps_since_log_ = 0;
}

void TrainLoop::draw_progress(long s, long epoch, double lr, const std::string& extra) {
  const long into = plan_.epochs.into(s) + 1, epoch_steps = plan_.epochs.steps;
  const double epoch_seconds = this_epoch_.seconds(), elapsed = since(t0_);
  const long done = s + 1 - plan_.start_step;
  // Steps of this epoch taken by this run (a resumed run starts inside one).
  const long epoch_done = std::min(into, done);
  const double per_step = epoch_seconds / static_cast<double>(std::max(epoch_done, 1L));
  const double epoch_eta = per_step * static_cast<double>(std::min(epoch_steps - into, end_step() - (s + 1)));
  const double run_eta = elapsed / static_cast<double>(std::max(done, 1L)) * static_cast<double>(end_step() - (s + 1));
  // \x1b[K: the rest of the terminal line cleared, where a longer line stood before.
  say("\rstep {}/{} | epoch {} {}/{} | loss {:.6f} | lr {:.5g} | {:.1f} samples/s{} | ETA epoch {}, run {}\x1b[K",
      s + 1, end_step(), epoch + 1, into, epoch_steps, loss_, lr,
      static_cast<double>(epoch_samples_) / std::max(epoch_seconds, 1e-9), extra, duration_text(epoch_eta),
      duration_text(run_eta));
  std::fflush(stdout);
  drawn_ = std::chrono::steady_clock::now();
}

int TrainLoop::evaluate_at(long s, long epoch) {
  const auto began = std::chrono::steady_clock::now();
  const dp::EvalTotals totals = evaluate(engine_, runtime_, test_, o_.batch_size, o_.workers);
  if (const int code = diverged(o_, totals.mean_loss(), fmt::format("the test loss after step {}", s + 1), "", kept()))
    return code;
  if (terminal_) say("\r\x1b[K");  // the progress line cleared
  say("eval  step {:>6} epoch {:>3} | test loss {:.4f} | test acc {:.2f}%{}\n", s + 1, epoch + 1, totals.mean_loss(),
      100.0 * totals.accuracy(), bits_per_byte_text(o_, totals));
  std::fflush(stdout);
  nlohmann::json record = {{"kind", "eval"},
                           {"step", s + 1},
                           {"epoch", epoch + 1},
                           {"test_loss", totals.mean_loss()},
                           {"test_accuracy", totals.accuracy()},
                           {"test_samples", totals.samples}};
  if (const auto bpb = bits_per_byte(o_, totals)) record["test_bits_per_byte"] = *bpb;
  if (save_if_best(totals, s + 1)) record["saved_best"] = o_.save_best;
  metrics_.write(record);
  pause(began);
  return 0;
}

bool TrainLoop::save_if_best(const dp::EvalTotals& totals, long steps) {
  if (o_.save_best.empty() || (best_accuracy_ && totals.accuracy() <= *best_accuracy_)) return false;
  best_accuracy_ = totals.accuracy();
  best_step_ = steps;
  write_checkpoint(o_, engine_, plan_, o_.save_best, steps);
  say("dp_train: saved {} (test accuracy {:.2f}%, the best so far) at step {}\n", o_.save_best,
      100.0 * totals.accuracy(), steps);
  return true;
}

int TrainLoop::end_epoch(long s, long epoch) {
  const auto began = std::chrono::steady_clock::now();
  const double train_seconds = this_epoch_.seconds();
  std::optional<dp::EvalTotals> totals;
  if (test_) totals = evaluate(engine_, runtime_, test_, o_.batch_size, o_.workers);
  if (totals)
    if (const int code =
            diverged(o_, totals->mean_loss(), fmt::format("the test loss after step {}", s + 1), "", kept()))
      return code;
  const double done = static_cast<double>(s + 1 - plan_.start_step), elapsed = since(t0_);
  const double eta = elapsed / done * static_cast<double>(end_step() - (s + 1));
  const double train_loss = epoch_loss_sum_ / static_cast<double>(std::max(epoch_samples_, 1L));
  const double rate = static_cast<double>(epoch_samples_) / std::max(1e-9, train_seconds);
  const bool complete = plan_.epochs.into(s + 1) == 0;
  if (terminal_) say("\r\x1b[K");  // the progress line cleared
  say("epoch {:>3}{} | train loss {:.4f}{} | {:.1f} samples/s | elapsed {} | ETA {}\n", epoch + 1,
      complete ? "" : " (partial)", train_loss,
      totals ? fmt::format(" | test loss {:.4f} | test acc {:.2f}%{}", totals->mean_loss(), 100.0 * totals->accuracy(),
                           bits_per_byte_text(o_, *totals))
             : "",
      rate, duration_text(elapsed), duration_text(eta));
  std::fflush(stdout);
  nlohmann::json record = {
      {"kind", "epoch"},          {"epoch", epoch + 1},    {"step", s + 1},        {"complete", complete},
      {"train_loss", train_loss}, {"samples_per_s", rate}, {"elapsed_s", elapsed}, {"eta_s", eta},
      {"precision", o_.precision}};
  for (const auto& [tag, value] : dp::tools::per_epoch_settings(o_, dp::to_string(o_.mode))) record[tag] = value;
  record["test_loss"] = totals ? nlohmann::json(totals->mean_loss()) : nlohmann::json(nullptr);
  record["test_accuracy"] = totals ? nlohmann::json(totals->accuracy()) : nlohmann::json(nullptr);
  if (totals) record["test_samples"] = totals->samples;
  if (const auto bpb = totals ? bits_per_byte(o_, *totals) : std::nullopt) record["test_bits_per_byte"] = *bpb;
  if (totals && save_if_best(*totals, s + 1)) record["saved_best"] = o_.save_best;
  metrics_.write(record);
  epoch_loss_sum_ = 0.0;
  epoch_samples_ = 0;
  pause(began);  // the evaluation is not training time
  this_epoch_ = TrainingTime{};
  return 0;
}

// No later step checks the last step's update with its loss: the model the run ends with must give
// a finite loss, in evaluation (as a checkpoint is used), on the first global batch of the training
// data. The test set already checked it when there is one.
int check_final_model(const Options& o, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs) {
  if (inputs.test) return 0;
  const std::size_t count = static_cast<std::size_t>(o.batch_size) * static_cast<std::size_t>(engine.world_size());
  const dp::EvalTotals totals =
      evaluate(engine, runtime, std::make_shared<dp::FirstSamples>(inputs.data, count), o.batch_size, o.workers);
  return diverged(o, totals.mean_loss(), "the loss of the final model on the first batch");
}

// The training state after `step` steps into `path` (process 0 writes it; the others' replicas are
// equal). The schedule's T_max and the end it is planned to reach are the whole run's, so a run
// resumed from a checkpoint taken part-way continues the same curve to the same end; where the
// epoch of its next step began and the epochs' length let it number its epochs on.
void write_checkpoint(const Options& o, dp::Engine& engine, const Plan& plan, const std::string& path, long step) {
  engine.synchronize();
  // Every process: with ZeRO-1 the whole state is gathered from every rank.
  const std::vector<dp::Optimizer*> whole = engine.whole_optimizers();
  if (!g_job.primary()) return;
  dp::TrainingProgress progress;
  progress.step = step;
  progress.epoch = plan.epochs.of(step);
  progress.seed = o.seed;
  progress.tags = run_settings(o, resolved_t_max(o, plan.end_step()));
  progress.tags["mode"] = dp::to_string(o.mode);
  progress.tags["world"] = fmt::format("{}", plan.world);
  progress.tags["end_step"] = fmt::format("{}", plan.end_step());
  if (plan.end_epoch) progress.tags["end_epoch"] = fmt::format("{}", *plan.end_epoch);
  progress.tags["epoch_start"] = fmt::format("{}", plan.epochs.start(step));
  progress.tags["epoch_steps"] = fmt::format("{}", plan.epochs.steps);
  dp::TrainingState::save(path, engine.model(), *whole.front(), progress);
}

void save(const Options& o, dp::Engine& engine, const Plan& plan, long step) {
  engine.synchronize();
  if (!o.save.empty()) {
    // Every process: the whole optimizer state may be a collective (ZeRO-1); process 0 writes.
    write_checkpoint(o, engine, plan, o.save, step);
    say("dp_train: saved {}{}\n", o.save,
        step < plan.start_step + plan.total_steps ? fmt::format(" at step {}", step) : "");
  }
  g_job.collectives_end();
  g_job.agree_or_stop();
}

// With the data loaded, the model built and the loaders' threads started, the address space they
// take is known: the limit (ulimit -v) must still leave room for what the first steps map, the
// sim's GEMM buffers above all (tools/address_space.h).
void check_address_space_left(const Options& o, const Devices& devices, const Inputs& inputs) {
  const std::uint64_t count = devices.ids.size();
  const std::uint64_t eval_threads = inputs.test ? count * (1 + static_cast<std::uint64_t>(o.workers)) : 0;
  dp::tools::check_address_space(0, devices.cuda ? 0 : count, eval_threads, "the data and model loaded");
}

// Trains, checks the final model and saves it. SIGTERM and SIGINT are the run's until the save is
// done: one during the steps stops the run after the step in flight (exit 143, 130, saved); one
// after the last step leaves a complete run, which is checked and saved as if none had come (exit 0).
int train(const Options& o, const Plan& plan, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
          MetricsLog& metrics, Loaders& loaders) {
  const StopSignals signals;
  TrainLoop loop(o, plan, engine, runtime, inputs, metrics, loaders);
  if (const int code = loop.run()) return code;
  if (o.signal_at_step == plan.end_step() + 1 && !loop.stop_signal() && g_job.primary()) std::raise(SIGTERM);
  if (const int code = check_final_model(o, engine, runtime, inputs)) return code;
  save(o, engine, plan, loop.reached());
  if (loop.stop_signal()) return 128 + loop.stop_signal();
  if (const int late = g_stop_signal.load())
    say("dp_train: {} after the last step: the run is complete{}\n", late == SIGINT ? "SIGINT" : "SIGTERM",
        o.save.empty() ? "" : fmt::format(", {} saved", o.save));
  return 0;
}

}  // namespace

void check_options(const Options& o) {
  const Checked checked = validate_options(o);
  const Devices devices = choose_devices(o);
  const int world =
      static_cast<int>(devices.ids.size()) * (o.mode == dp::EngineKind::ddp ? g_job.processes()->size() : 1);
  check_learning_rate(o, world);
  check_memory(o, checked.hidden, devices.ids, devices.cuda, g_job.processes()->size());
}

// The settings the --resume (else --init) checkpoint describes, for the flags not given: read before
// any check, since they choose the model and the optimizer.
void adopt_checkpoint_settings(Options& o) {
  const bool resuming = !o.resume.empty();
  const std::string& path = resuming ? o.resume : o.init;
  if (path.empty()) return;
  check_distinct_files(o);  // an output naming the checkpoint is that mistake, not a bad checkpoint
  const dp::safetensors::File file = as_usage_error([&] { return dp::safetensors::read(path); });
  check_hidden_tag(path, file);  // a file contradicting itself is refused before its tags are taken
  std::map<std::string, std::string> tags;
  for (const auto& [key, value] : file.metadata)
    if (key.starts_with("dp.")) tags[key.substr(3)] = value;
  adopt_run_settings(o, path, tags, resuming);
}

int run(Options o) {
  adopt_checkpoint_settings(o);
  const Checked checked = validate_options(o);
  const Devices devices = choose_devices(o);
  const int world =
      static_cast<int>(devices.ids.size()) * (o.mode == dp::EngineKind::ddp ? g_job.processes()->size() : 1);
  check_learning_rate(o, world);
  // Its file is opened at the first record (validate_options checked the path); a resumed run appends.
  MetricsLog metrics(g_job.primary() ? o.metrics_json : std::string(), !o.resume.empty());
  // What the run needs at the least, in 64 bits, before anything is allocated.
  check_memory(o, checked.hidden, devices.ids, devices.cuda, g_job.processes()->size());
  g_job.set_devices(devices.ids);
  const Resumed resumed = read_resume(o, world);  // first: its seed draws the synthetic data
  const Inputs inputs = load_inputs(o, checked.normalize);
  if ((o.eval_every || !o.save_best.empty()) && !inputs.test)
    throw UsageError(fmt::format("{} evaluates on the test set, and this run has none (no test split, or --no-eval)",
                                 o.eval_every ? "--eval-every" : "--save-best"));
  Built built = build_model(o, checked, devices, resumed);
  join_collectives(o, devices, inputs);
  Loaders loaders;  // outlives the engine: its streams read their pinned batches
  const auto engine = build_engine(o, devices, world, built, resumed);
  if (o.eval_only) {
    return evaluate_only(o, *engine, *built.runtime, inputs, metrics);
  }
  if (o.generate) return generate_text(o, *engine);
  const Plan plan = plan_run(o, *engine, *inputs.data, world, resumed);
  if (plan.total_steps == 0) return nothing_to_train(o, plan);
  say_plan(o, plan, *built.runtime, *inputs.data, devices);
  const auto loaders_made = std::chrono::steady_clock::now();
  loaders = make_loaders(o, plan, *engine, *built.runtime, inputs.data);
  if (o.loader_only) return read_batches_only(o, plan, loaders, metrics, loaders_made);
  check_address_space_left(o, devices, inputs);
  return train(o, plan, *engine, *built.runtime, inputs, metrics, loaders);
}

}  // namespace dp_train
