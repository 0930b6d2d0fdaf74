// dp_train — trains the reference MLP or ConvNet on one device, with DataParallel or with
// DistributedDataParallel, on GPUs or simulated devices; saves and resumes checkpoints.
// It is also the embedding example: it uses only dp's public headers, as a user's program would.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <set>

#include "dp/checkpoint.h"
#include "dp/data.h"
#include "dp/data_parallel.h"
#include "dp/ddp.h"
#include "dp/device.h"
#include "dp/error.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/safetensors.h"
#include "dp/trainer.h"

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

std::string shape_of(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

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
    if (!std::filesystem::is_directory(dir)) throw UsageError(fmt::format("--save {}: directory {} does not exist", o.save, dir.string()));
    if (std::filesystem::is_directory(p)) throw UsageError(fmt::format("--save {}: is a directory", o.save));
  }

  std::vector<int> ids;
  if (!o.device_ids.empty()) {
    ids = parse_int_list(o.device_ids, "--device-ids");
    std::set<int> seen;
    for (int id : ids) {
      if (id < 0) throw UsageError(fmt::format("--device-ids {}: device {} is negative", o.device_ids, id));
      if (!seen.insert(id).second) throw UsageError(fmt::format("--device-ids {}: device {} appears twice", o.device_ids, id));
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
  if (!want_cuda && highest >= 64) throw UsageError(fmt::format("device {}: the sim backend simulates at most 64 devices", highest));
  if (o.output_device && std::find(ids.begin(), ids.end(), *o.output_device) == ids.end())
    throw UsageError(fmt::format("--output-device {} is not among the devices [{}]", *o.output_device, shape_of(ids)));

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
  std::optional<dp::safetensors::File> resume;
  long start_step = 0;
  std::int64_t sgd_steps = 0;
  if (!o.resume.empty()) {
    resume = as_usage_error([&] { return dp::safetensors::read(o.resume); });
    const auto& meta = resume->metadata;
    if (!meta.count("dp.step")) throw UsageError(fmt::format("--resume {}: not a dp_train checkpoint (no training state)", o.resume));
    // Every number is range-checked: a checkpoint is input like any other.
    auto number = [&](const char* key, long long lo, long long hi) {
      const auto it = meta.find(key);
      if (it == meta.end()) throw UsageError(fmt::format("--resume {}: metadata '{}' is missing", o.resume, key));
      try {
        std::size_t used = 0;
        const long long value = std::stoll(it->second, &used);
        if (used == it->second.size() && value >= lo && value <= hi) return value;
      } catch (const std::exception&) {
      }
      throw UsageError(fmt::format("--resume {}: metadata '{}' = '{}' is not a number in [{}, {}]", o.resume, key,
                                   it->second, lo, hi));
    };
    start_step = static_cast<long>(number("dp.step", 0, 1LL << 40));
    sgd_steps = number("dp.sgd_steps", 0, 1LL << 40);
    const auto seed = static_cast<std::uint64_t>(number("dp.seed", 0, std::numeric_limits<long long>::max()));
    if (meta.count("dp.model") && meta.at("dp.model") != o.model)
      throw UsageError(fmt::format("--resume {}: the checkpoint is a {}, not a {}", o.resume, meta.at("dp.model"), o.model));
    if (meta.count("dp.mode") && meta.at("dp.mode") != o.mode)
      fmt::print("note: the checkpoint was trained in {} mode; continuing in {} mode (a different data order)\n",
                 meta.at("dp.mode"), o.mode);
    if (seed != o.seed) fmt::print("note: resuming with the checkpoint's seed {} (not {})\n", seed, o.seed);
    o.seed = seed;
  }

  dp::RuntimeOptions runtime_options;
  runtime_options.backend = want_cuda ? "cuda" : "sim";
  runtime_options.sim_devices = highest + 1;
  auto runtime = dp::Runtime::create(runtime_options);
  dp::Device& source = runtime->device(ids[0]);
  auto model = o.model == "convnet" ? dp::models::make_convnet(source, o.seed) : dp::models::make_mlp(source, hidden, o.seed);
  dp::Stream host_io = source.create_stream();
  as_usage_error([&] {
    if (!o.init.empty()) dp::load_state_dict(*model, host_io, dp::safetensors::read(o.init));
    if (resume) dp::load_state_dict(*model, host_io, *resume);
    return 0;
  });

  const int world = static_cast<int>(ids.size());
  dp::SgdOptions sgd{lr_at(o, world, start_step), o.momentum, o.weight_decay, o.nesterov};
  const bool ddp_mode = o.mode == "ddp", dp_mode = o.mode == "dp";
  const int global_batch = ddp_mode ? o.batch_size * world : o.batch_size;
  const std::size_t per_rank_samples =
      ddp_mode ? dp::DistributedSampler(data.size(), world, 0, false, 0).num_samples() : data.size();
  const long batches_per_epoch = static_cast<long>((per_rank_samples + static_cast<std::size_t>(o.batch_size) - 1) /
                                                   static_cast<std::size_t>(o.batch_size));
  const long total_steps = o.steps ? *o.steps : static_cast<long>(o.epochs.value_or(1)) * batches_per_epoch;
  fmt::print("dp_train: {} {} on {} device(s) [{}] ({} backend), {} samples, global batch {}{}, {} step(s) from step {}\n",
             o.model, o.mode, world, shape_of(ids), dp::to_string(runtime->backend()), data.size(), global_batch,
             ddp_mode ? fmt::format(" ({} per device)", o.batch_size) : "", total_steps, start_step);

  // ---- engines
  // Declared before the engines so that it outlives them: their streams read its pinned batches.
  std::vector<std::unique_ptr<dp::BatchLoader>> loaders;
  std::unique_ptr<dp::SingleDeviceTrainer> single;
  std::unique_ptr<dp::DataParallel> data_parallel;
  std::unique_ptr<dp::DistributedDataParallel> ddp;
  std::vector<dp::Sgd*> optimizers;
  if (dp_mode) {
    dp::DataParallelOptions options;
    options.device_ids = ids;
    options.output_device = o.output_device;
    data_parallel = std::make_unique<dp::DataParallel>(*runtime, *model, sgd, options);
    optimizers.push_back(&data_parallel->optimizer());
  } else if (ddp_mode) {
    dp::DdpOptions options;
    options.device_ids = ids;
    ddp = std::make_unique<dp::DistributedDataParallel>(*runtime, *model, sgd, options);
    for (int r = 0; r < world; ++r) optimizers.push_back(&ddp->optimizer(r));
  } else {
    single = std::make_unique<dp::SingleDeviceTrainer>(*model, sgd);
    optimizers.push_back(&single->optimizer());
  }
  if (resume) {
    // Every rank's optimizer has the same state (identical gradients every step).
    for (std::size_t rank = 0; rank < optimizers.size(); ++rank) {
      dp::Sgd* opt = optimizers[rank];
      opt->set_steps(sgd_steps);
      if (!opt->momentum_flat()) continue;
      for (const dp::TensorRef& p : model->parameters()) {
        const std::string key = "optimizer.momentum." + p.name;
        if (!resume->has(key))
          throw UsageError(fmt::format("--resume {}: no momentum buffer '{}' (saved without momentum?)", o.resume, key));
        const auto values = resume->at(key).to_f32();
        if (values.size() != p.numel())
          throw UsageError(fmt::format("--resume {}: momentum buffer '{}' has {} values, expected {}", o.resume, key,
                                       values.size(), p.numel()));
        // Each optimizer's momentum lives on its rank's device.
        dp::Stream s = runtime->device(ids[rank]).create_stream();
        s.copy(opt->momentum_flat() + p.offset, values.data(), values.size() * sizeof(float));
        s.synchronize();
      }
    }
  }

  // ---- the data order: per step, the sample indices of each rank's batch
  const int loaders_count = ddp_mode ? world : 1;
  for (int rank = 0; rank < loaders_count; ++rank) {
    // single and dp read the whole data set in order (one replica); ddp ranks read their shards.
    dp::DistributedSampler sampler(data.size(), loaders_count, rank, !o.no_shuffle, o.seed);
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
      plan.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin), order.begin() + static_cast<std::ptrdiff_t>(end));
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
    for (dp::Sgd* opt : optimizers) opt->set_lr(lr);
    long samples = 0;
    if (ddp_mode) {
      std::vector<dp::RankBatch> batches;
      for (auto& loader : loaders) {
        const dp::HostBatch b = loader->next();
        batches.push_back(dp::RankBatch{b.inputs, b.targets, b.size});
        samples += b.size;
      }
      loss = ddp->train_step(batches);
    } else {
      const dp::HostBatch b = loaders[0]->next();
      samples = b.size;
      loss = dp_mode ? data_parallel->train_step(b.inputs, b.targets, b.size) : single->step(b.inputs, b.targets, b.size);
    }
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
      const double rate = static_cast<double>(samples_since_log) / std::max(1e-9, std::chrono::duration<double>(now - last_log).count());
      const std::string line = fmt::format("step {:>6} epoch {:>3} loss {:.6f} lr {:.5g} samples/s {:.1f}", s + 1, epoch, loss, lr, rate);
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
  if (data_parallel) data_parallel->synchronize();
  if (ddp) ddp->synchronize();
  if (!o.save.empty()) {
    dp::safetensors::File file = dp::state_dict(*model, host_io);
    dp::Sgd& opt = *optimizers[0];
    if (opt.momentum_flat()) {
      for (const dp::TensorRef& p : model->parameters()) {
        std::vector<float> values(p.numel());
        host_io.copy(values.data(), opt.momentum_flat() + p.offset, values.size() * sizeof(float));
        file.add("optimizer.momentum." + p.name, dp::safetensors::make_f32(p.shape, values.data()));
      }
    }
    file.metadata["dp.format"] = "1";
    file.metadata["dp.step"] = std::to_string(start_step + total_steps);
    file.metadata["dp.sgd_steps"] = std::to_string(opt.steps());
    file.metadata["dp.epoch"] = std::to_string((start_step + total_steps) / batches_per_epoch);
    file.metadata["dp.seed"] = std::to_string(o.seed);
    file.metadata["dp.model"] = o.model;
    file.metadata["dp.hidden"] = o.model == "mlp" ? o.hidden : "";
    file.metadata["dp.mode"] = o.mode;
    dp::safetensors::write(o.save, file);
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
  app.add_option("--synthetic", o.synthetic, "use N synthetic samples (the default: 2048)")->excludes(data)->check(CLI::Range(std::size_t{1}, std::size_t{1} << 26));
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
