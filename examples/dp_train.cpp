// dp_train — trains the reference MLP or ConvNet on one device, with DataParallel or with
// DistributedDataParallel, on GPUs or simulated devices; saves and resumes checkpoints.
// It is also the embedding example: it uses only dp's public headers, as a user's program would.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <unistd.h>

#include "dp/checkpoint.h"
#include "dp/data.h"
#include "dp/device.h"
#include "dp/engine.h"
#include "dp/error.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/safetensors.h"
#include "dp/training_state.h"

namespace {

struct Options {
  std::string model = "mlp";
  std::string hidden = "256,256";
  std::string mode = "single";
  std::string backend = "auto";
  std::optional<int> devices;
  std::string device_ids;
  std::optional<int> output_device;
  std::string data;
  std::optional<std::size_t> synthetic;
  int batch_size = 64;
  std::optional<int> epochs;
  std::optional<long> steps;
  float lr = 0.01f, momentum = 0.9f, weight_decay = 0.0f;
  bool nesterov = false, scale_lr = false, no_shuffle = false;
  long warmup_steps = 0;
  std::uint64_t seed = 0;
  std::string init, save, resume;
  long log_every = 10;
  bool log_batches = false;
};

// A failure the user caused (bad flag value, bad file): message, exit code 2.
struct UsageError : dp::Error {
  using dp::Error::Error;
};

std::vector<int> parse_int_list(const std::string& text, const char* flag) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      std::size_t used = 0;
      const int value = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(value);
    } catch (const std::exception&) {
      throw UsageError(fmt::format("{} '{}': '{}' is not an integer", flag, text, item));
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// The learning rate of step s: linear scaling (--scale-lr, seed 003) and linear warm-up
// (Goyal et al. 2017) from the unscaled lr, or from target/W without scaling, to the target at s = W.
float lr_at(const Options& o, int world, long step) {
  const float target = o.scale_lr ? o.lr * static_cast<float>(world) : o.lr;
  if (o.warmup_steps <= 0 || step >= o.warmup_steps) return target;
  const float start = o.scale_lr ? o.lr : target / static_cast<float>(o.warmup_steps);
  return start + (target - start) * static_cast<float>(step) / static_cast<float>(o.warmup_steps);
}

std::string ids_of(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

int run(Options o) {
  // ---- validate everything before any work, so bad input never leaves a file behind
  std::vector<int> hidden;
  if (o.model == "mlp") {
    hidden = parse_int_list(o.hidden, "--hidden");
    for (int h : hidden)
      if (h < 1) throw UsageError(fmt::format("--hidden '{}': layer sizes must be >= 1", o.hidden));
  }
  if (o.batch_size < 1) throw UsageError(fmt::format("--batch-size {}: must be at least 1", o.batch_size));
  if (o.steps && *o.steps < 1) throw UsageError(fmt::format("--steps {}: must be at least 1", *o.steps));
  if (o.epochs && *o.epochs < 1) throw UsageError(fmt::format("--epochs {}: must be at least 1", *o.epochs));
  if (o.output_device && o.mode != "dp") throw UsageError("--output-device applies to --mode dp only");
  if (!o.save.empty()) {
    const std::filesystem::path p(o.save);
    const auto dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
    if (!std::filesystem::is_directory(dir))
      throw UsageError(fmt::format("--save {}: directory {} does not exist", o.save, dir.string()));
    if (std::filesystem::is_directory(p)) throw UsageError(fmt::format("--save {}: is a directory", o.save));
  }

  std::vector<int> ids;
  if (!o.device_ids.empty()) {
    ids = parse_int_list(o.device_ids, "--device-ids");
    std::set<int> seen;
    for (int id : ids) {
      if (id < 0) throw UsageError(fmt::format("--device-ids {}: device {} is negative", o.device_ids, id));
      if (!seen.insert(id).second)
        throw UsageError(fmt::format("--device-ids {}: device {} appears twice", o.device_ids, id));
    }
  }
  const bool want_cuda = o.backend == "cuda" || (o.backend == "auto" && dp::Runtime::cuda_device_count() > 0);
  const int available = want_cuda ? dp::Runtime::cuda_device_count() : 64;
  if (want_cuda && available == 0)
    throw UsageError(dp::Runtime::cuda_compiled() ? "--backend cuda: no CUDA device is visible"
                                                  : "--backend cuda: this build of dp has no cuda backend");
  int count = o.devices.value_or(o.mode == "single" ? 1 : (want_cuda ? available : 2));
  if (ids.empty()) {
    for (int i = 0; i < count; ++i) ids.push_back(i);
  }
  if (o.mode == "single" && ids.size() > 1) ids.erase(ids.begin() + 1, ids.end());
  const int highest = *std::max_element(ids.begin(), ids.end());
  if (want_cuda && highest >= available)
    throw UsageError(fmt::format("{} device(s) requested (up to device {}), but only {} CUDA device(s) are available",
                                 ids.size(), highest, available));
  if (!want_cuda && highest >= 64)
    throw UsageError(fmt::format("device {}: the sim backend simulates at most 64 devices", highest));
  if (o.output_device && std::find(ids.begin(), ids.end(), *o.output_device) == ids.end())
    throw UsageError(fmt::format("--output-device {} is not among the devices [{}]", *o.output_device, ids_of(ids)));

  // ---- data and checkpoints: a bad file is the user's input, so UsageError (exit 2)
  auto as_usage_error = [](auto&& load) {
    try {
      return load();
    } catch (const UsageError&) {
      throw;
    } catch (const dp::Error& e) {
      throw UsageError(e.what());
    }
  };
  dp::Dataset data = as_usage_error([&] {
    return !o.data.empty() ? dp::load_mnist(o.data) : dp::make_synthetic(o.synthetic.value_or(2048), o.seed);
  });

  // ---- checkpoint to resume (validated before the runtime spins up)
  std::optional<dp::TrainingState> resume;
  long start_step = 0;
  if (!o.resume.empty()) {
    resume = as_usage_error([&] { return dp::TrainingState::read(o.resume); });
    const dp::TrainingProgress& progress = resume->progress();
    start_step = static_cast<long>(progress.step);
    const auto& tags = progress.tags;
    if (tags.count("model") && tags.at("model") != o.model)
      throw UsageError(
          fmt::format("--resume {}: the checkpoint is a {}, not a {}", o.resume, tags.at("model"), o.model));
    if (tags.count("mode") && tags.at("mode") != o.mode)
      fmt::print("note: the checkpoint was trained in {} mode; continuing in {} mode (a different data order)\n",
                 tags.at("mode"), o.mode);
    if (progress.seed != o.seed)
      fmt::print("note: resuming with the checkpoint's seed {} (not {})\n", progress.seed, o.seed);
    o.seed = progress.seed;
  }

  dp::RuntimeOptions runtime_options;
  runtime_options.backend = want_cuda ? "cuda" : "sim";
  runtime_options.sim_devices = highest + 1;
  auto runtime = dp::Runtime::create(runtime_options);
  dp::Device& source = runtime->device(ids[0]);
  auto model =
      o.model == "convnet" ? dp::models::make_convnet(source, o.seed) : dp::models::make_mlp(source, hidden, o.seed);
  as_usage_error([&] {
    if (!o.init.empty()) dp::load_state_dict(*model, source.create_stream(), dp::safetensors::read(o.init));
    if (resume) resume->load_model(*model);  // before the engine: DDP broadcasts rank 0's values
    return 0;
  });

  // ---- the engine, picked once: everything below runs through dp::Engine
  const int world = static_cast<int>(ids.size());
  const dp::SgdOptions sgd{lr_at(o, world, start_step), o.momentum, o.weight_decay, o.nesterov};
  dp::EngineOptions engine_options;
  engine_options.kind = dp::parse_engine_kind(o.mode);
  engine_options.device_ids = ids;
  engine_options.output_device = o.output_device;
  // Declared before the engine so that they outlive it: its streams read their pinned batches.
  std::vector<std::unique_ptr<dp::BatchLoader>> loaders;
  const auto engine = dp::make_engine(*runtime, *model, sgd, engine_options);
  if (resume)
    as_usage_error([&] {
      resume->load_optimizers(*model, engine->optimizers());
      return 0;
    });
  // single and dp read the whole data set in order (one replica); ddp ranks read their shards.
  const int shards = engine->batches_per_step();
  const int global_batch = o.batch_size * shards;
  const std::size_t per_rank_samples = dp::DistributedSampler(data.size(), shards, 0, false, 0).num_samples();
  const long batches_per_epoch = static_cast<long>((per_rank_samples + static_cast<std::size_t>(o.batch_size) - 1) /
                                                   static_cast<std::size_t>(o.batch_size));
  const long total_steps = o.steps ? *o.steps : static_cast<long>(o.epochs.value_or(1)) * batches_per_epoch;
  fmt::print(
      "dp_train: {} {} on {} device(s) [{}] ({} backend), {} samples, global batch {}{}, {} step(s) from step {}\n",
      o.model, o.mode, world, ids_of(ids), dp::to_string(runtime->backend()), data.size(), global_batch,
      shards > 1 ? fmt::format(" ({} per device)", o.batch_size) : "", total_steps, start_step);

  // ---- the data order: per step, the sample indices of each rank's batch
  for (int rank = 0; rank < shards; ++rank) {
    dp::DistributedSampler sampler(data.size(), shards, rank, !o.no_shuffle, o.seed);
    std::vector<std::int64_t> order;  // this epoch's indices, rebuilt only when the epoch changes
    std::vector<std::vector<std::int64_t>> plan;
    for (long s = start_step; s < start_step + total_steps; ++s) {
      const long epoch = s / batches_per_epoch, k = s % batches_per_epoch;
      if (order.empty() || sampler.epoch() != epoch) {
        sampler.set_epoch(epoch);
        order = sampler.indices();
      }
      const std::size_t begin = static_cast<std::size_t>(k) * static_cast<std::size_t>(o.batch_size);
      const std::size_t end = std::min(order.size(), begin + static_cast<std::size_t>(o.batch_size));
      plan.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin),
                        order.begin() + static_cast<std::ptrdiff_t>(end));
      if (o.log_batches) fmt::print("batch step {} rank {}: {}\n", s, rank, fmt::join(plan.back(), " "));
    }
    loaders.push_back(std::make_unique<dp::BatchLoader>(*runtime, data, std::move(plan)));
  }

  // ---- train
  const bool terminal = ::isatty(STDOUT_FILENO) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_log = t0;
  long samples_since_log = 0;
  float loss = 0.0f;
  for (long s = start_step; s < start_step + total_steps; ++s) {
    const float lr = lr_at(o, world, s);
    engine->set_lr(lr);
    std::vector<dp::Batch> batches;
    long samples = 0;
    for (auto& loader : loaders) {
      batches.push_back(loader->next());
      samples += batches.back().size;
    }
    loss = engine->train_step(batches);
    const long epoch = s / batches_per_epoch;
    if (!std::isfinite(loss)) {
      fmt::print(stderr, "\ndp_train: error: loss is {} at step {} (epoch {}); stopping{}\n", loss, s, epoch,
                 o.save.empty() ? "" : fmt::format(", {} was not written", o.save));
      return 3;
    }
    samples_since_log += samples;
    const bool last = s + 1 == start_step + total_steps;
    if ((s + 1) % o.log_every == 0 || last) {
      const auto now = std::chrono::steady_clock::now();
      const double rate = static_cast<double>(samples_since_log) /
                          std::max(1e-9, std::chrono::duration<double>(now - last_log).count());
      const std::string line =
          fmt::format("step {:>6} epoch {:>3} loss {:.6f} lr {:.5g} samples/s {:.1f}", s + 1, epoch, loss, lr, rate);
      if (terminal) {
        fmt::print("\r{}", line);
        if (last) fmt::print("\n");
        std::fflush(stdout);
      } else {
        fmt::print("{}\n", line);
      }
      last_log = now;
      samples_since_log = 0;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("dp_train: {} step(s) in {:.2f} s, final loss {:.6f}\n", total_steps, seconds, loss);

  // ---- save: the source / rank-0 state, plus what resuming needs
  engine->synchronize();
  if (!o.save.empty()) {
    dp::TrainingProgress progress;
    progress.step = start_step + total_steps;
    progress.epoch = (start_step + total_steps) / batches_per_epoch;
    progress.seed = o.seed;
    progress.tags = {{"model", o.model}, {"hidden", o.model == "mlp" ? o.hidden : ""}, {"mode", o.mode}};
    dp::TrainingState::save(o.save, engine->model(), *engine->optimizers().front(), progress);
    fmt::print("dp_train: saved {}\n", o.save);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dp_train: train the reference MLP or ConvNet on one device, with DataParallel or with DDP"};
  Options o;
  app.add_option("--model", o.model, "mlp or convnet")->check(CLI::IsMember({"mlp", "convnet"}));
  app.add_option("--hidden", o.hidden, "MLP hidden sizes, e.g. 256,256");
  app.add_option("--mode", o.mode, "single, dp or ddp")->check(CLI::IsMember({"single", "dp", "ddp"}));
  app.add_option("--backend", o.backend, "auto, cuda or sim")->check(CLI::IsMember({"auto", "cuda", "sim"}));
  auto* devices = app.add_option("--devices", o.devices, "use devices 0..N-1")->check(CLI::Range(1, 1 << 20));
  app.add_option("--device-ids", o.device_ids, "devices in rank order, e.g. 2,0,1")->excludes(devices);
  app.add_option("--output-device", o.output_device, "dp: the device that gathers outputs and computes the loss");
  auto* data = app.add_option("--data", o.data, "directory with train-images-idx3-ubyte and train-labels-idx1-ubyte");
  app.add_option("--synthetic", o.synthetic, "use N synthetic samples (the default: 2048)")
      ->excludes(data)
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 26));
  app.add_option("--batch-size", o.batch_size, "global batch (single, dp) or per device (ddp)");
  auto* epochs = app.add_option("--epochs", o.epochs, "full passes over the data (default 1)");
  app.add_option("--steps", o.steps, "optimizer steps (crosses epoch boundaries)")->excludes(epochs);
  app.add_option("--lr", o.lr, "learning rate")->check(CLI::NonNegativeNumber);
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::NonNegativeNumber);
  app.add_option("--weight-decay", o.weight_decay, "SGD weight decay")->check(CLI::NonNegativeNumber);
  app.add_flag("--nesterov", o.nesterov, "Nesterov momentum");
  app.add_flag("--scale-lr", o.scale_lr, "multiply lr by the number of devices");
  app.add_option("--warmup-steps", o.warmup_steps, "linear lr warm-up steps")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", o.seed, "seed of the initialisation, synthetic data and shuffling");
  app.add_flag("--no-shuffle", o.no_shuffle, "visit the samples in order (PyTorch's order exactly)");
  app.add_option("--init", o.init, "load weights and buffers (safetensors) before training");
  app.add_option("--save", o.save, "write the final state (safetensors) here");
  app.add_option("--resume", o.resume, "continue from a checkpoint written by --save");
  app.add_option("--log-every", o.log_every, "log every K steps")->check(CLI::Range(1L, 1L << 40));
  app.add_flag("--log-batches", o.log_batches, "print the sample indices of every batch (per rank)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, or the message naming the flag
    return code == 0 ? 0 : 2;      // every bad command line is exit code 2, as bad files are
  }
  try {
    return run(o);
  } catch (const UsageError& e) {
    fmt::print(stderr, "dp_train: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_train: error: {}\n", e.what());
    return 1;
  }
}
