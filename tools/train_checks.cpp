// train_checks.cpp — the checks a dp_train run makes of its options before it reads a file or starts a device
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
#include "dp/io/safetensors.h"
#include "dp/io/text.h"
#include "dp/io/training_state.h"
#include "dp/models/registry.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/device.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/process_group.h"
#include "dp/runtime/shape.h"
#include "dp_cli.h"
#include "run_settings.h"
#include "train_cli.h"
#include "train_parts.h"
#include "train_stages.h"

namespace dp_train {

// A non-finite evaluation loss is divergence, as a non-finite training loss is: the run stops with
// exit code 3 and saves nothing. Every process sees the same summed loss, so every process stops.
// `what` is `loss` (`where`: " at step 3"): exit code 3, naming what stays on disk: --save is not
// written; `kept` says what this run wrote before (its --save-best).
int diverged(const Options& o, double loss, const std::string& what, const std::string& where,
             const std::string& kept) {
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
  const bool tokens = !o.text.empty() || !o.tokens.empty();
  if (text_model && !tokens && !o.eval_only)
    throw UsageError(fmt::format(
        "--model {} trains on text: give --text FILE (its bytes are the tokens) or --tokens PATTERN (llm.c's shards)",
        o.model));
  if (text_model && !tokens)
    throw UsageError(fmt::format("--model {} evaluates on text: give --text FILE (its last 10 % is scored)", o.model));
  if (tokens && !text_model)
    throw UsageError(fmt::format("{} trains a language model (--model {}), not --model {}",
                                 o.text.empty() ? "--tokens" : "--text", models_taking(dp::models::ModelArg::gpt),
                                 o.model));
  if (!o.text.empty() && o.vocab < dp::kByteVocabulary)
    throw UsageError(fmt::format("--text: its tokens are bytes, ids up to 255; --vocab {} cannot hold them", o.vocab));
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
  // The one-device trainer has no device thread or collective for a fault to act on: refused, not ignored.
  if (o.mode == dp::EngineKind::single && o.shards == 0 && !dp::FaultPlan::from_environment().empty())
    throw UsageError(
        fmt::format("DP_FAULT {}: --mode single runs none of its faults (they act on the devices of "
                    "--mode dp and ddp, and of every mode with --shards)",
                    dp::FaultPlan::from_environment().faults().front().text()));
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

}  // namespace dp_train
