// dp_train — trains the reference MLP or ConvNet on one device, with DataParallel or with
// DistributedDataParallel, on GPUs or simulated devices; saves and resumes checkpoints.
// It is also the embedding example: of dp it uses only the public headers, as a user's program would
// (and tools/: the command-line rules and the mpirun job protocol it shares with dp_bench).
#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <fmt/format.h>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <unistd.h>
#include <variant>

#include "dp/atomic_file.h"
#include "dp/checkpoint.h"
#include "dp/data.h"
#include "dp/device.h"
#include "dp/engine.h"
#include "dp/error.h"
#include "dp/lr_schedule.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/process_group.h"
#include "dp/safetensors.h"
#include "dp/training_state.h"
#include "dp_cli.h"
#include "dp_job.h"

namespace {

struct Options {
  std::string model = "mlp";
  std::string hidden = "256,256";
  double dropout = 0.0;
  bool sync_bn = false;
  double label_smoothing = 0.0;
  std::string mode = "single";
  std::string backend = "auto";
  std::string precision = "strict";
  std::string graphs = "on";
  std::string pipeline = "on";
  std::optional<int> devices;
  int devices_per_gpu = 1;
  std::string device_ids;
  std::optional<int> output_device;
  std::string data;
  std::optional<std::size_t> synthetic;
  int batch_size = 64;
  std::optional<int> epochs;
  std::optional<long> steps;
  std::string optimizer = "sgd";
  double lr = 0.01;  // in double, as Python's; each optimizer rounds it as torch's kernels do
  float momentum = 0.9f;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool nesterov = false, scale_lr = false, no_shuffle = false;
  long warmup_steps = 0;
  std::uint64_t seed = 0;
  std::string init, save, resume;
  long log_every = 10;
  std::string schedule = "none";
  long step_size = 1;
  double gamma = 0.1, eta_min = 0.0;
  std::optional<long> t_max;
  bool log_batches = false;
  std::optional<bool> eval;  // unset: evaluate when the data has a test split
  bool eval_only = false;
  std::string normalize;     // "MEAN,STD"
  std::string metrics_json;  // JSON lines, one per logged step and per epoch
  std::string predictions;   // --eval-only: each test sample's predicted class, one per line
  long fail_at_step = 0;     // testing only: this process fails at that step, as a crashing rank would
};

// A failure the user caused (bad flag value, bad file): message, exit code 2.
struct UsageError : dp::Error {
  using dp::Error::Error;
};

dp::tools::Job g_job("dp_train");  // under mpirun: one process of the job (tools/dp_job.h)

// Prints what failed (naming the process, host and global ranks under mpirun) and returns the exit
// code: 2 bad input or configuration, 3 non-finite values, 1 anything else.
int report(const std::exception_ptr& error) {
  const std::string where = g_job.where(error);
  const auto print = [&](const std::exception& e, const char* hint = "") {
    fmt::print(stderr, "dp_train: error{}: {}{}\n", where, e.what(), hint);
  };
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    print(e);
    return 2;
  } catch (const dp::OutOfMemory& e) {
    print(e, ": the configuration does not fit (a smaller --batch-size or model)");
    return 2;
  } catch (const dp::NonFiniteError& e) {
    print(e);
    return 3;
  } catch (const std::exception& e) {
    print(e);
    return 1;
  } catch (...) {
    fmt::print(stderr, "dp_train: error{}: unknown exception\n", where);
    return 1;
  }
}

// Standard output is process 0's (torch's "print on rank 0"); errors come from every process.
template <class... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
  if (g_job.primary()) fmt::print(format, std::forward<Args>(args)...);
}

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
// After the warm-up, `schedule` (--schedule, per optimizer step, counted from the warm-up's end)
// takes the target down; none keeps it. In double, as a Python training loop computes it.
double lr_at(const Options& o, int world, long step, const dp::LrSchedule& schedule) {
  const double target = o.scale_lr ? o.lr * world : o.lr;
  if (o.warmup_steps <= 0 || step >= o.warmup_steps) return schedule.lr(target, step - std::max(0L, o.warmup_steps));
  const double start = o.scale_lr ? o.lr : target / static_cast<double>(o.warmup_steps);
  return start + (target - start) * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
}

// The optimizer of --optimizer at learning rate `lr` (SGD: --momentum, --nesterov; AdamW: --beta1,
// --beta2, --eps; both: --weight-decay, which AdamW applies decoupled, as torch.optim.AdamW).
dp::OptimizerOptions optimizer_options(const Options& o, double lr) {
  if (o.optimizer == "adamw") return dp::AdamWOptions{lr, o.beta1, o.beta2, o.eps, o.weight_decay};
  return dp::SgdOptions{static_cast<float>(lr), o.momentum, static_cast<float>(o.weight_decay), o.nesterov};
}

// --schedule: none, step (StepLR: x --gamma every --step-size steps) or cosine (CosineAnnealingLR to
// --eta-min over --t-max steps, by default the steps after the warm-up up to the run's last step).
dp::LrSchedule make_schedule(const Options& o, long last_step) {
  try {
    if (o.schedule == "step") return dp::LrSchedule::step(o.step_size, o.gamma);
    if (o.schedule == "cosine")
      return dp::LrSchedule::cosine(o.t_max.value_or(std::max(1L, last_step - std::max(0L, o.warmup_steps))),
                                    o.eta_min);
    return dp::LrSchedule::constant();
  } catch (const dp::Error& e) {
    throw UsageError(fmt::format("--schedule {}: {}", o.schedule, e.what()));
  }
}

std::string ids_of(const std::vector<int>& v) { return fmt::format("{}", fmt::join(v, ",")); }

// "MEAN,STD" (e.g. Fashion-MNIST's 0.2860,0.3530) for torchvision's Normalize.
dp::Normalize parse_normalize(const std::string& text) {
  const std::size_t comma = text.find(',');
  try {
    if (comma != std::string::npos && text.find(',', comma + 1) == std::string::npos) {
      std::size_t used_mean = 0, used_std = 0;
      const std::string mean_text = text.substr(0, comma), std_text = text.substr(comma + 1);
      const float mean = std::stof(mean_text, &used_mean), std = std::stof(std_text, &used_std);
      if (used_mean == mean_text.size() && used_std == std_text.size() && std::isfinite(mean) && std::isfinite(std) &&
          std > 0.0f)
        return dp::Normalize{mean, std};
    }
  } catch (const std::exception&) {
  }
  throw UsageError(fmt::format("--normalize '{}': expected MEAN,STD with a finite mean and a std > 0", text));
}

// "1m 05s", "42.0 s": durations for people.
std::string duration_text(double seconds) {
  if (seconds < 60) return fmt::format("{:.1f} s", seconds);
  const auto whole = static_cast<long>(seconds + 0.5);
  if (whole < 3600) return fmt::format("{}m {:02}s", whole / 60, whole % 60);
  return fmt::format("{}h {:02}m", whole / 3600, (whole % 3600) / 60);
}

// --metrics-json: one JSON object per line, each written with a single write(2) to a file opened
// for appending, so a crash leaves every line logged before it whole (at most the last one cut by a
// full disk).
class MetricsLog {
 public:
  // Truncates `path`, or appends to it when resuming (the earlier run's lines stay).
  MetricsLog(const std::string& path, bool append) {
    if (path.empty()) return;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (append ? 0 : O_TRUNC), 0644);
    if (fd_ < 0) throw UsageError(fmt::format("--metrics-json {}: cannot open ({})", path, std::strerror(errno)));
    path_ = path;
  }
  ~MetricsLog() {
    if (fd_ >= 0) ::close(fd_);
  }
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record) {
    if (fd_ < 0) return;
    const std::string line = record.dump() + "\n";
    if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
      throw dp::Error(fmt::format("--metrics-json {}: write failed ({})", path_, std::strerror(errno)));
  }

 private:
  int fd_ = -1;
  std::string path_;
};

// Test-set loss and accuracy through the engine: every sample exactly once (eval_shard: global
// rank r of the engine's world_size() R takes samples r, r + R, ...; no padding), in batches of
// `batch_size` per rank; a rank whose shard ran out sends an empty batch. Across processes, each
// evaluates its ranks' shards and the engine sums the totals.
// With `predictions`, it is resized to the test set and gets each sample's predicted class.
dp::EvalTotals evaluate(dp::Engine& engine, dp::Runtime& runtime, const dp::Dataset& test, int batch_size,
                        dp::Normalize normalize, std::vector<std::int32_t>* predictions = nullptr) {
  const int shards = engine.world_size(), local = engine.batches_per_step();
  std::vector<std::vector<std::vector<std::int64_t>>> plans(static_cast<std::size_t>(local));
  // Global rank 0's shard is the longest: every process takes as many steps as it needs.
  const std::size_t batch = static_cast<std::size_t>(batch_size);
  const std::size_t steps = (dp::eval_shard(test.size(), shards, 0).size() + batch - 1) / batch;
  for (int l = 0; l < local; ++l) {
    const auto mine = dp::eval_shard(test.size(), shards, engine.first_rank() + l);
    auto& plan = plans[static_cast<std::size_t>(l)];
    for (std::size_t begin = 0; begin < mine.size(); begin += static_cast<std::size_t>(batch_size))
      plan.emplace_back(mine.begin() + static_cast<std::ptrdiff_t>(begin),
                        mine.begin() + static_cast<std::ptrdiff_t>(
                                           std::min(mine.size(), begin + static_cast<std::size_t>(batch_size))));
  }
  for (auto& plan : plans) plan.resize(steps);  // empty batches for the ranks whose shard is shorter
  const auto order = plans;                     // which sample each prediction belongs to
  std::vector<std::unique_ptr<dp::BatchLoader>> loaders;
  for (auto& plan : plans)
    loaders.push_back(std::make_unique<dp::BatchLoader>(runtime, test, std::move(plan), 2, normalize));
  if (predictions) predictions->assign(test.size(), -1);
  dp::EvalTotals totals;
  std::vector<std::int32_t> classes;
  for (std::size_t k = 0; k < steps; ++k) {
    std::vector<dp::Batch> batches;
    for (auto& loader : loaders) batches.push_back(loader->next());
    classes.clear();
    totals += engine.evaluate(batches, predictions ? &classes : nullptr);
    if (!predictions) continue;
    std::size_t at = 0;
    for (const auto& plan : order)
      for (const std::int64_t sample : plan[k]) (*predictions)[static_cast<std::size_t>(sample)] = classes[at++];
  }
  return totals;
}

// a * b, or UsageError naming `what` when it does not fit in 64 bits.
std::uint64_t times(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) throw UsageError(fmt::format("{} does not fit in 64 bits", what));
  return out;
}
std::uint64_t plus(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) throw UsageError(fmt::format("{} does not fit in 64 bits", what));
  return out;
}

std::string gib(std::uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1u << 30)); }

// Refuses (exit 2, with the figures) a run that cannot fit, before anything is allocated: what it
// needs at the least — the model's parameters, gradients and momentum and the input batch on each
// device, the synthetic data set and the pinned batches on the host — against the host's memory
// and a simulated device's capacity. (The activations come on top; a run that passes this and
// still does not fit fails with the device's out-of-memory error, also exit 2.)
void check_memory(const Options& o, const std::vector<int>& hidden, const std::vector<int>& ids, bool cuda,
                  int processes) {
  const std::uint64_t devices = ids.size(), batch = static_cast<std::uint64_t>(o.batch_size);
  const std::uint64_t shards = o.mode == "ddp" ? devices * static_cast<std::uint64_t>(processes) : 1;
  if (times(batch, shards, "the global batch") > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    throw UsageError(fmt::format("--batch-size {} x {} device(s): a global batch of {} samples is more than {}",
                                 o.batch_size, shards, batch * shards, std::numeric_limits<int>::max()));
  std::uint64_t params = o.model == "resnet8" ? 77754 : 29034;  // ResNet-8, the ConvNet
  if (o.model == "mlp") {
    params = 0;
    std::uint64_t in = 784;
    for (const std::uint64_t out : hidden) {
      params = plus(params, plus(times(in, out, "the MLP's size"), out, "the MLP's size"), "the MLP's size");
      in = out;
    }
    params = plus(params, plus(times(in, 10, "the MLP's size"), 10, "the MLP's size"), "the MLP's size");
  }
  const std::uint64_t rows = o.mode == "dp" ? (batch + devices - 1) / devices : batch;  // per device
  const std::uint64_t per_device = plus(times(times(params, 4, "the model"),
                                              o.optimizer == "adamw" ? 4
                                              : o.momentum > 0       ? 3
                                                                     : 2,
                                              "the model"),
                                        times(rows, (784 + 10) * 4, "the batch"), "the device memory");
  const std::uint64_t samples = o.data.empty() ? o.synthetic.value_or(2048) : 0;
  std::uint64_t host =
      plus(times(samples, 784 + 8, "the data set"),
           times(times(3 * shards, batch, "the staging"), 784 * 4 + 8, "the staging"), "the host memory");
  if (!cuda) host = plus(host, times(per_device, devices, "the devices' memory"), "the host memory");
  const std::uint64_t host_memory = dp::Runtime::host_memory_bytes();
  if (host_memory > 0 && host > host_memory)
    throw UsageError(
        fmt::format("this run needs at least {} of host memory ({} parameters, {} samples{}), the host "
                    "has {}",
                    gib(host), params, samples, cuda ? "" : ", the simulated devices' memory", gib(host_memory)));
  const std::uint64_t capacity = dp::RuntimeOptions{}.sim_capacity_bytes;
  if (!cuda && per_device > capacity)
    throw UsageError(fmt::format("this run needs at least {} per device ({} parameters), a simulated device holds {}",
                                 gib(per_device), params, gib(capacity)));
}

// What every process of an mpirun job must agree on (tools/dp_job.h): everything that decides the
// collectives a run makes or the numbers it trains — not which local devices (--device-ids), where
// process 0 writes, nor the testing hook.
std::vector<std::pair<std::string, std::string>> configuration(const Options& o, const std::vector<int>& ids, bool cuda,
                                                               const dp::Dataset& data,
                                                               const std::optional<dp::Dataset>& test) {
  const auto file = [](const std::string& path) {
    if (path.empty()) return std::string("none");
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    return fmt::format("{:016x}", dp::tools::fingerprint(bytes.str()));
  };
  const auto contents = [](const dp::Dataset& set) {
    const std::string_view pixels(reinterpret_cast<const char*>(set.pixels.data()), set.pixels.size());
    const std::string_view labels(reinterpret_cast<const char*>(set.labels.data()),
                                  set.labels.size() * sizeof(std::int64_t));
    return fmt::format("{} samples, {:016x}", set.size(),
                       dp::tools::fingerprint(pixels) ^ (dp::tools::fingerprint(labels) << 1));
  };
  return {
      {"--backend", cuda ? "cuda" : "sim"},
      {"devices per process", fmt::format("{}", ids.size())},
      {"--mode", o.mode},
      {"--model", fmt::format("{} {} dropout {}", o.model, o.model == "mlp" ? o.hidden : "", o.dropout)},
      {"--sync-bn", fmt::format("{}", o.sync_bn)},
      {"--batch-size", fmt::format("{}", o.batch_size)},
      {"--steps/--epochs", fmt::format("{} {}", o.steps.value_or(0), o.epochs.value_or(0))},
      {"optimizer", fmt::format("{} lr {} momentum {} wd {} nesterov {} betas {} {} eps {} scale-lr {}", o.optimizer,
                                o.lr, o.momentum, o.weight_decay, o.nesterov, o.beta1, o.beta2, o.eps, o.scale_lr)},
      {"schedule", fmt::format("{} warm-up {} step {} gamma {} t-max {} eta-min {}", o.schedule, o.warmup_steps,
                               o.step_size, o.gamma, o.t_max.value_or(0), o.eta_min)},
      {"--label-smoothing", fmt::format("{}", o.label_smoothing)},
      {"--seed, --no-shuffle", fmt::format("{} {}", o.seed, o.no_shuffle)},
      {"--normalize", o.normalize},
      {"evaluation", test ? "on, " + contents(*test) : "off"},
      {"training data", o.eval_only ? "none" : contents(data)},
      {"--init", file(o.init)},
      {"--resume", file(o.resume)}};
}

int run(Options o) {
  // ---- validate everything before any work, so bad input never leaves a file behind
  dp::ProcessGroup& processes = *g_job.processes();
  const bool primary = g_job.primary();
  if (processes.size() > 1 && o.mode != "ddp")
    throw UsageError(
        fmt::format("--mode {} is single-process, but mpirun started {} processes: use --mode ddp across processes",
                    o.mode, processes.size()));
  if (processes.size() > 1 && !o.predictions.empty())
    throw UsageError("--predictions writes one process's test-set order: run --eval-only without mpirun");
  std::vector<int> hidden;
  if (o.model == "mlp") {
    hidden = parse_int_list(o.hidden, "--hidden");
    for (int h : hidden)
      if (h < 1) throw UsageError(fmt::format("--hidden '{}': layer sizes must be >= 1", o.hidden));
  }
  if (o.dropout > 0.0 && o.model != "mlp") throw UsageError("--dropout applies to --model mlp");
  if (o.sync_bn && o.mode != "ddp") throw UsageError("--sync-bn applies to --mode ddp");
  if (o.batch_size < 1) throw UsageError(fmt::format("--batch-size {}: must be at least 1", o.batch_size));
  if (o.steps && *o.steps < 1) throw UsageError(fmt::format("--steps {}: must be at least 1", *o.steps));
  if (o.epochs && *o.epochs < 1) throw UsageError(fmt::format("--epochs {}: must be at least 1", *o.epochs));
  if (o.output_device && o.mode != "dp") throw UsageError("--output-device applies to --mode dp only");
  const dp::Normalize normalize = o.normalize.empty() ? dp::Normalize{} : parse_normalize(o.normalize);
  if (o.eval_only && o.init.empty() && o.resume.empty())
    throw UsageError("--eval-only evaluates a checkpoint: give it with --init (or --resume)");
  if (o.eval_only && (o.steps || o.epochs || !o.save.empty()))
    throw UsageError("--eval-only trains nothing: it takes no --steps, --epochs or --save");
  if (o.eval_only && o.eval == false) throw UsageError("--eval-only and --no-eval contradict each other");
  if (!o.predictions.empty() && !o.eval_only) throw UsageError("--predictions goes with --eval-only");
  if (!o.predictions.empty() && primary) {
    try {
      dp::check_writable(o.predictions);
    } catch (const dp::Error& e) {
      throw UsageError(fmt::format("--predictions {}", e.what()));
    }
  }
  // The optimizer's own checks (a NaN or infinite lr, nesterov without momentum, ...), now rather
  // than after the data is loaded; --scale-lr multiplies the lr by up to the device count.
  try {
    std::visit([](const auto& options) { dp::validate(options); },
               optimizer_options(o, o.lr * (o.scale_lr ? o.devices.value_or(1) * processes.size() : 1)));
  } catch (const dp::Error& e) {
    throw UsageError(e.what());
  }
  // Where the checkpoint goes is checked before step 1, not discovered after the last one
  // (by process 0, the one that writes it).
  if (!o.save.empty() && primary) {
    try {
      dp::check_writable(o.save);
    } catch (const dp::Error& e) {
      throw UsageError(fmt::format("--save {}", e.what()));
    }
  }
  // Opened now, so that a path it cannot write is refused before any work. A resumed run appends.
  MetricsLog metrics(primary ? o.metrics_json : std::string(), !o.resume.empty());

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
  // Several dp devices may share a GPU (--devices-per-gpu): every device of every GPU is one.
  const int available = want_cuda ? dp::Runtime::cuda_device_count() * o.devices_per_gpu : 64;
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
  if (!want_cuda && (highest + 1) % o.devices_per_gpu != 0)
    throw UsageError(fmt::format("--devices-per-gpu {} does not divide the {} simulated device(s) (devices 0..{})",
                                 o.devices_per_gpu, highest + 1, highest));
  if (o.output_device && std::find(ids.begin(), ids.end(), *o.output_device) == ids.end())
    throw UsageError(fmt::format("--output-device {} is not among the devices [{}]", *o.output_device, ids_of(ids)));

  // ---- sizes: what the run needs at the least, in 64 bits, before anything is allocated
  check_memory(o, hidden, ids, want_cuda, processes.size());
  g_job.set_devices(ids);

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
  // The training split (not needed to evaluate a checkpoint), and the test split when there is one.
  std::string data_dir;
  if (!o.data.empty()) data_dir = as_usage_error([&] { return dp::find_data_dir(o.data); });
  dp::Dataset data;
  if (!o.eval_only)
    data = as_usage_error([&] {
      return !data_dir.empty() ? dp::load_mnist(data_dir) : dp::make_synthetic(o.synthetic.value_or(2048), o.seed);
    });
  const bool test_split = !data_dir.empty() && dp::has_split(data_dir, dp::Split::test);
  const bool eval = o.eval_only || o.eval.value_or(test_split);
  if (eval && !test_split)
    throw UsageError(
        fmt::format("--eval{}: {} has no test split (t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, "
                    "plain or .gz)",
                    o.eval_only ? "-only" : "", data_dir.empty() ? "synthetic data" : data_dir));
  std::optional<dp::Dataset> test;
  if (eval) test = as_usage_error([&] { return dp::load_mnist(data_dir, dp::Split::test); });

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
      say("note: the checkpoint was trained in {} mode; continuing in {} mode (a different data order)\n",
          tags.at("mode"), o.mode);
    if (progress.seed != o.seed) say("note: resuming with the checkpoint's seed {} (not {})\n", progress.seed, o.seed);
    o.seed = progress.seed;
  }

  dp::RuntimeOptions runtime_options;
  runtime_options.backend = want_cuda ? "cuda" : "sim";
  runtime_options.sim_devices = highest + 1;
  runtime_options.devices_per_gpu = o.devices_per_gpu;
  runtime_options.precision = dp::parse_precision(o.precision);
  auto runtime = dp::Runtime::create(runtime_options);
  dp::Device& source = runtime->device(ids[0]);
  auto model = o.model == "convnet"   ? dp::models::make_convnet(source, o.seed)
               : o.model == "resnet8" ? dp::models::make_resnet8(source, o.seed)
                                      : dp::models::make_mlp(source, hidden, o.seed, o.dropout);
  as_usage_error([&] {
    if (!o.init.empty()) dp::load_state_dict(*model, source.create_stream(), dp::safetensors::read(o.init));
    if (resume) resume->load_model(*model);  // before the engine: DDP broadcasts rank 0's values
    return 0;
  });

  // ---- every process is ready (or all stop with the first failing one's exit code); from here on
  // the processes meet in collectives
  g_job.agree_or_stop();
  if (g_job.several()) g_job.agree_on_configuration(configuration(o, ids, want_cuda, data, test));  // hashes the data
  g_job.collectives_begin();

  // ---- the engine, picked once: everything below runs through dp::Engine
  const int world = static_cast<int>(ids.size()) * (o.mode == "ddp" ? processes.size() : 1);
  // The schedule needs the run's length, known below; the optimizer starts at the warm-up's first lr
  // and every step sets its own.
  const dp::OptimizerOptions optimizer = optimizer_options(o, lr_at(o, world, start_step, dp::LrSchedule::constant()));
  dp::EngineOptions engine_options;
  engine_options.kind = dp::parse_engine_kind(o.mode);
  engine_options.device_ids = ids;
  engine_options.sync_batchnorm = o.sync_bn;
  engine_options.step.label_smoothing = o.label_smoothing;
  engine_options.step.seed = o.seed;  // Dropout's masks (DDP rank r: seed + r)
  engine_options.output_device = o.output_device;
  engine_options.processes = g_job.processes();
  engine_options.graphs = o.graphs == "on";
  // Declared before the engine so that they outlive it: its streams read their pinned batches.
  std::vector<std::unique_ptr<dp::BatchLoader>> loaders;
  const auto engine = dp::make_engine(*runtime, *model, optimizer, engine_options);
  if (resume)
    as_usage_error([&] {
      resume->load_optimizers(*model, engine->optimizers());
      return 0;
    });
  if (o.eval_only) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::int32_t> predictions;
    const dp::EvalTotals totals =
        evaluate(*engine, *runtime, *test, o.batch_size, normalize, o.predictions.empty() ? nullptr : &predictions);
    g_job.collectives_end();
    if (!o.predictions.empty()) {
      std::string text;
      for (const std::int32_t c : predictions) text += fmt::format("{}\n", c);
      dp::write_atomically(o.predictions, text);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say("dp_train: {} on {} test samples: test loss {:.6f}, test accuracy {:.2f}% ({} correct) in {}\n",
        o.init.empty() ? o.resume : o.init, totals.samples, totals.mean_loss(), 100.0 * totals.accuracy(),
        totals.correct, duration_text(seconds));
    metrics.write({{"kind", "eval"},
                   {"checkpoint", o.init.empty() ? o.resume : o.init},
                   {"test_loss", totals.mean_loss()},
                   {"test_accuracy", totals.accuracy()},
                   {"test_correct", totals.correct},
                   {"test_samples", totals.samples}});
    g_job.agree_or_stop();
    return 0;
  }

  // single and dp read the whole data set in order (one replica); ddp ranks read their shards: this
  // process's ranks first_rank() .. first_rank() + batches_per_step() - 1 of world_size().
  const int shards = engine->world_size();
  const int global_batch = o.batch_size * shards;
  const std::size_t per_rank_samples = dp::DistributedSampler(data.size(), shards, 0, false, 0).num_samples();
  const long batches_per_epoch = static_cast<long>((per_rank_samples + static_cast<std::size_t>(o.batch_size) - 1) /
                                                   static_cast<std::size_t>(o.batch_size));
  const long total_steps = o.steps ? *o.steps : static_cast<long>(o.epochs.value_or(1)) * batches_per_epoch;
  if (long end = 0; __builtin_add_overflow(start_step, total_steps, &end))
    throw UsageError(fmt::format("{} step(s) from step {} of --resume {}: the run would end past step {}", total_steps,
                                 start_step, o.resume, std::numeric_limits<long>::max()));
  const dp::LrSchedule schedule = make_schedule(o, start_step + total_steps);
  say("dp_train: {} {} on {} device(s) [{}]{} ({} backend), {} samples, global batch {}{}, {} step(s) from step {}\n",
      o.model, o.mode, world, ids_of(ids),
      processes.size() > 1 ? fmt::format(" in each of {} processes", processes.size()) : "",
      dp::to_string(runtime->backend()), data.size(), global_batch,
      shards > 1 ? fmt::format(" ({} per device)", o.batch_size) : "", total_steps, start_step);

  // ---- the data order: per step, the sample indices of each rank's batch, made by the rank's
  // loader thread just before it fills the batch (constant memory, however many steps)
  for (int local = 0; local < engine->batches_per_step(); ++local) {
    const int rank = engine->first_rank() + local;
    struct Order {
      dp::DistributedSampler sampler;
      std::vector<std::int64_t> indices;  // this epoch's, rebuilt only when the epoch changes
    };
    auto order =
        std::make_shared<Order>(Order{dp::DistributedSampler(data.size(), shards, rank, !o.no_shuffle, o.seed), {}});
    const auto batch = static_cast<std::size_t>(o.batch_size);
    const bool log = o.log_batches;
    auto plan = [order, batch, log, rank, start_step, batches_per_epoch](std::size_t k) {
      const long s = start_step + static_cast<long>(k), epoch = s / batches_per_epoch, in_epoch = s % batches_per_epoch;
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
    loaders.push_back(std::make_unique<dp::BatchLoader>(*runtime, data, static_cast<std::size_t>(total_steps), batch,
                                                        plan, 2, normalize));
  }

  // ---- train: a line per --log-every steps, and after every epoch its train loss, the test loss
  // and accuracy (--eval), throughput, elapsed time and the ETA
  // (mpirun forwards output through a pseudo-terminal: lines, not a progress line)
  const bool terminal = ::isatty(STDOUT_FILENO) != 0 && !g_job.several();
  const auto t0 = std::chrono::steady_clock::now();
  auto last_log = t0, epoch_start = t0;
  long samples_since_log = 0;
  float loss = 0.0f;
  double epoch_loss_sum = 0.0;  // sum of step loss x step samples: the epoch's mean per sample
  long epoch_samples = 0;
  const auto since = [](std::chrono::steady_clock::time_point from) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
  };
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
  // Reads a submitted step's loss, then logs it and closes its epoch; non-zero: the exit code.
  const auto finish = [&](Submitted& step) -> int {
    const long s = step.s;
    const double lr = step.lr;
    const long samples = step.samples;
    loss = step.loss.get();
    const long epoch = s / batches_per_epoch;
    if (!std::isfinite(loss)) {  // the loss of every rank: every process stops here
      if (primary)
        fmt::print(stderr, "\ndp_train: error: loss is {} at step {} (epoch {}); stopping{}\n", loss, s + 1, epoch + 1,
                   o.save.empty() ? "" : fmt::format(", {} was not written", o.save));
      return 3;
    }
    samples_since_log += samples;
    epoch_loss_sum += static_cast<double>(loss) * static_cast<double>(samples);
    epoch_samples += samples;
    const bool last = s + 1 == start_step + total_steps;
    if ((s + 1) % o.log_every == 0 || last) {
      const auto now = std::chrono::steady_clock::now();
      const double rate = static_cast<double>(samples_since_log) /
                          std::max(1e-9, std::chrono::duration<double>(now - last_log).count());
      const std::string line = fmt::format("step {:>6} epoch {:>3} loss {:.6f} lr {:.5g} samples/s {:.1f}", s + 1,
                                           epoch + 1, loss, lr, rate);
      metrics.write({{"kind", "step"},
                     {"step", s + 1},
                     {"epoch", epoch + 1},
                     {"loss", loss},
                     {"lr", lr},
                     {"samples_per_s", rate},
                     {"elapsed_s", since(t0)}});
      if (terminal) {
        say("\r{}", line);
        if (last) say("\n");
        std::fflush(stdout);
      } else {
        say("{}\n", line);
      }
      last_log = now;
      samples_since_log = 0;
    }
    // The end of an epoch (or of a run that stops inside one): its summary.
    if ((s + 1) % batches_per_epoch == 0 || last) {
      const double train_seconds = since(epoch_start);
      std::optional<dp::EvalTotals> totals;
      if (eval) totals = evaluate(*engine, *runtime, *test, o.batch_size, normalize);
      const double done = static_cast<double>(s + 1 - start_step), elapsed = since(t0);
      const double eta = elapsed / done * static_cast<double>(start_step + total_steps - (s + 1));
      const double train_loss = epoch_loss_sum / static_cast<double>(std::max(epoch_samples, 1L));
      const double rate = static_cast<double>(epoch_samples) / std::max(1e-9, train_seconds);
      if (terminal) say("\r");
      say("epoch {:>3}{} | train loss {:.4f}{} | {:.1f} samples/s | elapsed {} | ETA {}\n", epoch + 1,
          (s + 1) % batches_per_epoch == 0 ? "" : " (partial)", train_loss,
          totals
              ? fmt::format(" | test loss {:.4f} | test acc {:.2f}%", totals->mean_loss(), 100.0 * totals->accuracy())
              : "",
          rate, duration_text(elapsed), duration_text(eta));
      std::fflush(stdout);
      nlohmann::json record = {{"kind", "epoch"},
                               {"epoch", epoch + 1},
                               {"step", s + 1},
                               {"complete", (s + 1) % batches_per_epoch == 0},
                               {"train_loss", train_loss},
                               {"samples_per_s", rate},
                               {"elapsed_s", elapsed},
                               {"eta_s", eta}};
      record["test_loss"] = totals ? nlohmann::json(totals->mean_loss()) : nlohmann::json(nullptr);
      record["test_accuracy"] = totals ? nlohmann::json(totals->accuracy()) : nlohmann::json(nullptr);
      if (totals) record["test_samples"] = totals->samples;
      metrics.write(record);
      epoch_loss_sum = 0.0;
      epoch_samples = 0;
      epoch_start = std::chrono::steady_clock::now();
      last_log = epoch_start;  // the evaluation is not training time
    }
    return 0;
  };
  std::optional<Submitted> pending;  // submitted, its loss not yet read
  for (long s = start_step; s < start_step + total_steps; ++s) {
    const double lr = lr_at(o, world, s, schedule);
    engine->set_lr(lr);
    std::vector<dp::Batch> batches;
    long samples = 0;
    for (auto& loader : loaders) {
      batches.push_back(loader->next());
      samples += batches.back().size;
    }
    samples *= shards / engine->batches_per_step();  // every rank's batch has this process's size
    if (s + 1 == o.fail_at_step) {
      if (pending)  // what the step before reports comes first, as without pipelining
        if (const int code = finish(*pending)) return code;
      throw dp::Error(fmt::format("failing at step {} as asked (--debug-fail-at-step)", s + 1));
    }
    std::optional<Submitted> submitted;
    try {
      submitted.emplace(Submitted{s, lr, samples, engine->submit_step(batches)});
    } catch (...) {  // the step before is reported first (its log line, or its divergence), as step by step
      if (pending)
        if (const int code = finish(*pending)) return code;
      throw;
    }
    Submitted& step = *submitted;
    if (pending) {
      const int code = finish(*pending);
      pending.reset();
      if (code) return code;
    }
    const bool ends_epoch = (s + 1) % batches_per_epoch == 0 || s + 1 == start_step + total_steps;
    if (o.pipeline == "on" && !ends_epoch) {
      pending = std::move(step);
    } else if (const int code = finish(step)) {
      return code;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  say("dp_train: {} step(s) in {:.2f} s, final loss {:.6f}\n", total_steps, seconds, loss);

  // ---- save: the source / rank-0 state, plus what resuming needs (process 0 writes it)
  engine->synchronize();
  g_job.collectives_end();
  if (!o.save.empty() && primary) {
    dp::TrainingProgress progress;
    progress.step = start_step + total_steps;
    progress.epoch = (start_step + total_steps) / batches_per_epoch;
    progress.seed = o.seed;
    progress.tags = {{"model", o.model},
                     {"hidden", o.model == "mlp" ? o.hidden : ""},
                     {"mode", o.mode},
                     {"dropout", fmt::format("{}", o.dropout)},
                     {"label_smoothing", fmt::format("{}", o.label_smoothing)}};
    dp::TrainingState::save(o.save, engine->model(), *engine->optimizers().front(), progress);
    say("dp_train: saved {}\n", o.save);
  }
  g_job.agree_or_stop();
  return 0;
}

}  // namespace

int train_main(int argc, char** argv) {
  // Integers in decimal only and within range (dp_cli::add_integer), and numbers >= 0 named
  // readably (CLI11's own bound is the 309-digit largest double).
  const CLI::Validator non_negative(
      [](const std::string& text) {
        try {
          std::size_t used = 0;
          const double value = std::stod(text, &used);
          if (used == text.size() && value >= 0.0 && std::isfinite(value)) return std::string();
        } catch (const std::exception&) {
        }
        return fmt::format("'{}' is not a finite number >= 0", text);
      },
      ">= 0");
  CLI::App app{"dp_train: train the reference MLP, ConvNet or ResNet-8 on one device, with DataParallel or with DDP"};
  Options o;
  app.add_option("--model", o.model, "mlp, convnet or resnet8")->check(CLI::IsMember({"mlp", "convnet", "resnet8"}));
  app.add_option("--dropout", o.dropout, "mlp: Dropout(P) after each hidden ReLU (default 0: none)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--sync-bn", o.sync_bn, "ddp: SyncBatchNorm, BatchNorm statistics over all ranks' batches");
  app.add_option("--label-smoothing", o.label_smoothing, "CrossEntropyLoss(label_smoothing=S), S in [0, 1]")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--hidden", o.hidden, "MLP hidden sizes, e.g. 256,256");
  app.add_option("--mode", o.mode, "single, dp or ddp")->check(CLI::IsMember({"single", "dp", "ddp"}));
  app.add_option("--backend", o.backend, "auto, cuda or sim")->check(CLI::IsMember({"auto", "cuda", "sim"}));
  app.add_option("--precision", o.precision,
                 "strict (default: cuDNN exact fp32 and deterministic, within rounding of the host path) or fast "
                 "(PyTorch's defaults: fastest cuDNN algorithm, TF32 convolutions, nondeterministic); the sim "
                 "computes the same for both")
      ->check(CLI::IsMember({"strict", "fast"}));
  app.add_option("--graphs", o.graphs,
                 "on (default): capture the training step once per batch size and replay it (CUDA graphs; emulated "
                 "on sim; the same results bit for bit), off: launch every kernel every step")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--pipeline", o.pipeline,
                 "on (default): submit each step before reading the previous step's loss, so the host prepares the "
                 "next batch while the devices compute (within an epoch; the same output), off: wait for each loss")
      ->check(CLI::IsMember({"on", "off"}));
  auto* devices = dp_cli::add_integer(app, "--devices", o.devices, "use devices 0..N-1")->check(CLI::Range(1, 1 << 20));
  app.add_option("--device-ids", o.device_ids, "devices in rank order, e.g. 2,0,1")->excludes(devices);
  dp_cli::add_integer(app, "--devices-per-gpu", o.devices_per_gpu,
                      "K dp devices on each GPU (device d on GPU d/K), so that multi-device runs fit one GPU; same "
                      "results bit for bit (default: 1)")
      ->check(CLI::Range(1, 64));
  dp_cli::add_integer(app, "--output-device", o.output_device,
                      "dp: the device that gathers outputs and computes the loss");
  auto* data = app.add_option("--data", o.data,
                              "directory with train-{images-idx3,labels-idx1}-ubyte (and t10k-* for --eval), plain "
                              "or .gz; or an installed data set's name: fashion-mnist, mnist");
  dp_cli::add_integer(app, "--synthetic", o.synthetic, "use N synthetic samples (the default: 2048)")
      ->excludes(data)
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 26));
  dp_cli::add_integer(app, "--batch-size", o.batch_size, "global batch (single, dp) or per device (ddp)");
  auto* epochs = dp_cli::add_integer(app, "--epochs", o.epochs, "full passes over the data (default 1)");
  dp_cli::add_integer(app, "--steps", o.steps, "optimizer steps (crosses epoch boundaries)")->excludes(epochs);
  app.add_option("--optimizer", o.optimizer, "sgd (torch.optim.SGD) or adamw (torch.optim.AdamW)")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--lr", o.lr, "learning rate (default: sgd 0.01, adamw 1e-3)")->check(non_negative);
  app.add_option("--momentum", o.momentum, "sgd: momentum")->check(non_negative);
  app.add_option("--weight-decay", o.weight_decay, "weight decay (default: sgd 0, adamw 1e-2, decoupled as torch's)")
      ->check(non_negative);
  app.add_flag("--nesterov", o.nesterov, "sgd: Nesterov momentum");
  app.add_option("--beta1", o.beta1, "adamw: first-moment decay (default 0.9)");
  app.add_option("--beta2", o.beta2, "adamw: second-moment decay (default 0.999)");
  app.add_option("--eps", o.eps, "adamw: denominator epsilon (default 1e-8)");
  app.add_flag("--scale-lr", o.scale_lr, "multiply lr by the number of devices");
  dp_cli::add_integer(app, "--warmup-steps", o.warmup_steps, "linear lr warm-up steps");
  app.add_option("--schedule", o.schedule,
                 "after the warm-up, per step: none, step (StepLR) or cosine (CosineAnnealingLR)")
      ->check(CLI::IsMember({"none", "step", "cosine"}));
  dp_cli::add_integer(app, "--step-size", o.step_size, "step: multiply the lr by --gamma every N steps");
  app.add_option("--gamma", o.gamma, "step: the factor (default 0.1)")->check(non_negative);
  dp_cli::add_integer(app, "--t-max", o.t_max, "cosine: steps to anneal over (default: the rest of the run)");
  app.add_option("--eta-min", o.eta_min, "cosine: the lr at the end (default 0)")->check(non_negative);
  dp_cli::add_integer(app, "--seed", o.seed, "seed of the initialisation, synthetic data and shuffling (0 to 2^64-1)");
  app.add_flag("--no-shuffle", o.no_shuffle, "visit the samples in order (PyTorch's order exactly)");
  app.add_option("--init", o.init, "load weights and buffers (safetensors) before training");
  app.add_option("--save", o.save, "write the final state (safetensors) here");
  app.add_option("--resume", o.resume, "continue from a checkpoint written by --save");
  dp_cli::add_integer(app, "--log-every", o.log_every, "log every K steps")->check(CLI::Range(1L, 1L << 40));
  app.add_flag("--log-batches", o.log_batches, "print the sample indices of every batch (per rank)");
  bool eval_on = false, eval_off = false;
  auto* eval = app.add_flag("--eval", eval_on,
                            "after every epoch, test loss and accuracy over the whole test set (default: on when "
                            "--data has t10k-* files)");
  app.add_flag("--no-eval", eval_off, "no evaluation")->excludes(eval);
  app.add_flag("--eval-only", o.eval_only, "evaluate the --init checkpoint on the test set, no training");
  app.add_option("--normalize", o.normalize, "MEAN,STD: inputs (pixel/255 - MEAN) / STD, e.g. 0.2860,0.3530");
  app.add_option("--predictions", o.predictions,
                 "with --eval-only: write each test sample's predicted class here, one per line, in test-set order");
  // Hidden (no group): the failure tests start one process of an mpirun job with it.
  dp_cli::add_integer(app, "--debug-fail-at-step", o.fail_at_step, "testing: fail on this process at step N")
      ->group("");
  app.add_option("--metrics-json", o.metrics_json, "write every logged step and epoch here, one JSON object per line");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, or the message naming the flag
    // Every bad command line is exit code 2, as bad files are; --help stops without error.
    return code == 0 ? g_job.agree(dp::kStopWithoutError).value_or(0) : g_job.failed(2);
  }
  if (eval_on || eval_off) o.eval = eval_on;
  // Each optimizer's own flags, and torch's defaults for those not given (torch.optim.AdamW: lr 1e-3,
  // weight_decay 1e-2).
  const bool adamw = o.optimizer == "adamw";
  const std::vector<std::string> other_optimizers_flags = adamw
                                                              ? std::vector<std::string>{"--momentum", "--nesterov"}
                                                              : std::vector<std::string>{"--beta1", "--beta2", "--eps"};
  for (const std::string& flag : other_optimizers_flags) {
    if (app.get_option(flag)->count() > 0) {
      fmt::print(stderr, "dp_train: error: {} does not apply to --optimizer {}\n", flag, o.optimizer);
      return g_job.failed(2);
    }
  }
  if (adamw && app.get_option("--lr")->count() == 0) o.lr = 1e-3;
  if (adamw && app.get_option("--weight-decay")->count() == 0) o.weight_decay = 1e-2;
  // A file flag given an empty value names no file: refused rather than read as "not given".
  for (const char* flag :
       {"--data", "--init", "--save", "--resume", "--metrics-json", "--normalize", "--predictions"}) {
    const auto* option = app.get_option(flag);
    if (option->count() > 0 && option->as<std::string>().empty()) {
      fmt::print(stderr, "dp_train: error: {}: empty value\n", flag);
      return g_job.failed(2);
    }
  }
  int code = 0;
  try {
    code = run(o);
  } catch (const dp::tools::PeerFailed& e) {
    code = e.code;  // agreed with the others; the failing process said why
  } catch (...) {
    code = g_job.failed(report(std::current_exception()));
  }
  return code;
}

int main(int argc, char** argv) {
  // The job first: under mpirun every way out, a bad command line included, goes through the
  // processes' agreement (an early exit would leave the others waiting for this one).
  try {
    g_job.start();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_train: error: {}\n", e.what());
    return 2;
  }
  const int code = train_main(argc, argv);
  g_job.end();  // MPI_Finalize, when under mpirun
  return code;
}
