// options.cpp — dp_bench's flags (CLI11, with dp_cli's integer rules), the checks CLI11 cannot
// make, and the runtime and device count they select.
#include "options.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sstream>

#include "address_space.h"
#include "dp/runtime/error.h"
#include "dp/runtime/precision.h"
#include "dp_cli.h"

namespace dp_bench {
namespace {

constexpr int kDefaultSimDevices = 4;
constexpr int kMaxSimDevices = 64;

// How a run is set up: backend, devices, precision, graphs, pipelining, profiling.
CLI::Option* add_runtime_flags(CLI::App& app, Options& o, int& devices) {
  auto* devices_opt = dp_cli::add_integer(app, "--devices", devices,
                                          "devices to use (default: every visible GPU, or 4 simulated devices)");
  app.add_option("--backend", o.backend, "auto (cuda when a GPU is visible, else sim), cuda or sim")
      ->capture_default_str();
  dp_cli::add_integer(app, "--devices-per-gpu", o.devices_per_gpu,
                      "K dp devices on each GPU (device d on GPU d/K; collectives among them on the device ring), so "
                      "that multi-device runs fit one GPU")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--precision", o.precision,
                 "strict (cuDNN: exact fp32, deterministic, fastest such algorithm), fast (PyTorch's defaults: "
                 "fastest cuDNN algorithm, TF32 convolutions, nondeterministic; the sim computes what strict does) or "
                 "tf32 (fast, and TF32 matmuls: allow_tf32 = True; the sim rounds GEMM operands to TF32)")
      ->capture_default_str();
  app.add_option("--graphs", o.graphs,
                 "on: capture each engine's training step once per batch size and replay it (CUDA graphs; emulated "
                 "on sim), off: launch every kernel every step (DP's phase times need off)")
      ->capture_default_str();
  app.add_option("--pipeline", o.pipeline,
                 "on: submit each measured step while the previous one runs (Engine::submit_step: the next batch is "
                 "copied in during this step), a step's time being the time between submissions; off: every step "
                 "waits for its loss and for every device (DP's phase times run so either way)")
      ->capture_default_str();
  app.add_flag("--profile", o.profile,
               "cuda: record device spans (timing events around every kernel) for busy % and GEMM rates; "
               "--trace implies it, the sim always records them");
  return devices_opt;
}

// What is trained and for how long, and where the figures go.
void add_workload_flags(CLI::App& app, Options& o) {
  app.add_option("--models", o.models,
                 "comma list of mlp, convnet, resnet8 (28x28 inputs), resnet18 (torchvision's, 3x32x32 inputs)")
      ->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "sgd (lr 0.01, momentum 0.9) or adamw (lr 1e-3, torch's defaults)")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--modes", o.modes, "comma list of single, dp, ddp")->capture_default_str();
  dp_cli::add_integer(app, "--batch-size", o.batch_per_device, "batch per device (dp's global batch = devices x this)")
      ->capture_default_str();
  dp_cli::add_integer(app, "--steps", o.steps, "measured steps per run")->capture_default_str();
  dp_cli::add_integer(app, "--warmup", o.warmup, "warm-up steps per run")->capture_default_str();
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DDP bucket cap, MiB")->capture_default_str();
  app.add_flag("--sync-bn", o.sync_bn, "ddp: SyncBatchNorm (BatchNorm statistics over all ranks' batches)");
  app.add_option("--broadcast-buffers", o.broadcast_buffers,
                 "ddp: on (torch's default) broadcasts the buffers (BatchNorm's running statistics) from rank 0 "
                 "before every forward; off skips it (DistributedDataParallel(broadcast_buffers=False))")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--amp", o.amp,
                 "off (default), or bf16: torch.autocast(dtype=torch.bfloat16) around the forward (bf16 "
                 "Linear/Conv2d and activations, fp32 loss and master weights)")
      ->check(CLI::IsMember({"off", "bf16"}))
      ->capture_default_str();
  app.add_option("--grad-reduce", o.grad_reduce,
                 "ddp: the gradient all-reduce in fp32 (default) or bf16 (torch's bf16_compress_hook: half the bytes)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--first-bucket-mb", o.first_bucket_mb,
                 "DDP first bucket cap, MiB (both models fit in torch's default 1 MiB: lower it to see "
                 "all-reduce overlap backward)")
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write every figure as JSON to this file");
  app.add_option("--trace", o.trace_path, "write a Chrome/Perfetto trace of the measured steps to this file");
  dp_cli::add_integer(app, "--seed", o.seed, "seed of the synthetic data and the models' initialisation")
      ->capture_default_str();
}

void check_on_off(const std::string& value, const char* flag) {
  if (value != "on" && value != "off")
    throw UsageError(fmt::format("{}: unknown value '{}' (expected on or off)", flag, value));
}

void check_positive(double value, const char* flag) {
  if (!(value > 0.0) || !std::isfinite(value))
    throw UsageError(fmt::format("{} must be a positive number, got {}", flag, value));
}

void check_at_least(int value, int least, const char* flag) {
  if (value < least) throw UsageError(fmt::format("{} must be at least {}, got {}", flag, least, value));
}

}  // namespace

std::optional<int> parse_command_line(int argc, char** argv, Options& o, const dp::tools::Job& job) {
  CLI::App app{"dp_bench: DP vs DDP throughput and per-device imbalance (single, dp, ddp for each model)"};
  int devices = 0;
  auto* devices_opt = add_runtime_flags(app, o, devices);
  add_workload_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help: 0, on stdout; a bad command line: its message on stderr and 2, as every bad input.
    return app.exit(e) == 0 ? job.agree(dp::kStopWithoutError).value_or(0) : job.failed(2);
  }
  if (devices_opt->count() > 0) o.devices = devices;
  // An output flag given an empty value names no file: refused rather than read as "not given".
  for (const char* flag : {"--json", "--trace"}) {
    const auto* option = app.get_option(flag);
    if (option->count() > 0 && option->as<std::string>().empty()) {
      fmt::print(stderr, "dp_bench: {}: empty value\n", flag);
      return job.failed(2);
    }
  }
  return std::nullopt;
}

void validate(const Options& o) {
  if (o.backend != "auto" && o.backend != "cuda" && o.backend != "sim")
    throw UsageError(fmt::format("--backend: unknown backend '{}' (expected auto, cuda or sim)", o.backend));
  try {
    dp::parse_precision(o.precision);
  } catch (const dp::InvalidArgument& e) {
    throw UsageError(fmt::format("--precision: {}", e.what()));
  }
  check_on_off(o.graphs, "--graphs");
  check_on_off(o.pipeline, "--pipeline");
  if (o.devices) check_at_least(*o.devices, 1, "--devices");
  check_at_least(o.batch_per_device, 1, "--batch-size");
  check_at_least(o.steps, 1, "--steps");
  check_at_least(o.warmup, 0, "--warmup");
  check_positive(o.bucket_cap_mb, "--bucket-cap-mb");
  check_positive(o.first_bucket_mb, "--first-bucket-mb");
}

std::vector<std::string> parse_list(const std::string& text, const std::vector<std::string>& known, const char* flag) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    if (std::find(known.begin(), known.end(), item) == known.end())
      throw UsageError(
          fmt::format("{}: unknown value '{}' (expected a comma list of {})", flag, item, fmt::join(known, ", ")));
    if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
  }
  if (out.empty())
    throw UsageError(fmt::format("{}: empty list (expected a comma list of {})", flag, fmt::join(known, ", ")));
  return out;
}

std::unique_ptr<dp::Runtime> make_runtime(const Options& o, int& devices) {
  std::string backend = o.backend;
  const int gpus = backend == "sim" ? 0 : dp::Runtime::cuda_device_count();
  if (backend == "auto") backend = gpus > 0 ? "cuda" : "sim";
  dp::RuntimeOptions options;
  options.backend = backend;
  options.precision = dp::parse_precision(o.precision);
  options.devices_per_gpu = o.devices_per_gpu;
  if (backend == "cuda") {
    if (gpus == 0)
      throw UsageError(dp::Runtime::cuda_compiled() ? "--backend cuda: no usable CUDA device is visible"
                                                    : "--backend cuda: dp was built without the cuda backend");
    devices = o.devices.value_or(gpus * o.devices_per_gpu);
    if (devices > gpus * o.devices_per_gpu)
      throw UsageError(fmt::format("--devices {}: only {} CUDA device(s) are visible ({} dp device(s) each)", devices,
                                   gpus, o.devices_per_gpu));
  } else {
    devices = o.devices.value_or(kDefaultSimDevices);
    if (devices > kMaxSimDevices)
      throw UsageError(
          fmt::format("--devices {}: the sim backend simulates at most {} devices", devices, kMaxSimDevices));
    options.sim_devices = devices;
    if (devices % o.devices_per_gpu != 0)
      throw UsageError(fmt::format("--devices-per-gpu {} does not divide --devices {}", o.devices_per_gpu, devices));
    // The models and batches a benchmark runs take well under 64 MiB a device.
    dp::tools::check_address_space(static_cast<std::uint64_t>(devices) << 26, static_cast<std::uint64_t>(devices),
                                   "the simulated devices' memory");
  }
  auto runtime = dp::Runtime::create(options);
  if (devices > runtime->device_count())
    throw UsageError(fmt::format("--devices {}: the {} backend has only {} device(s)", devices,
                                 dp::to_string(runtime->backend()), runtime->device_count()));
  return runtime;
}

bool records_spans(const dp::Runtime& rt, const Options& o) {
  return rt.backend() == dp::Backend::sim || o.profile || !o.trace_path.empty();
}

}  // namespace dp_bench
