// options.cpp — dp_bench's own flags (the table beside the shared one, tools/flags.h), and the
// runtime and device count they select.
#include "options.h"

#include <fmt/format.h>

#include "address_space.h"
#include "dp/runtime/error.h"
#include "dp/runtime/precision.h"
#include "roofline.h"

namespace dp_bench {
namespace {

using dp::tools::FlagGroup;
using O = Options;
namespace flag = dp::tools;

// The registry's models, and gpt2.
constexpr const char* kGpt2 = "gpt2";
std::vector<std::string> bench_models() {
  std::vector<std::string> names = dp::models::model_names();
  names.emplace_back(kGpt2);
  return names;
}

FlagGroup<O> bench_flags() {
  return {"dp_bench",
          {
              {.name = "--models",
               .value = flag::list_of<O>(&O::models, bench_models(), "M1,M2,..."),
               .help = "the models to run (listed below; the ResNets: 10 classes, 3x32x32 inputs; gpt2: the gpt at "
                       "GPT-2 124M's shape, 12 x 12 x 768, context 1024, vocabulary 50304)"},
              {.name = "--modes",
               .value = flag::list_of<O>(&O::modes, kModes, "M1,M2,..."),
               .help = "the engines each model runs with: single, dp (DataParallel), ddp (DistributedDataParallel)"},
              {.name = "--warmup",
               .value = flag::integer<O>(&O::warmup, 0),
               .help = "warm-up steps per run, before the measured --steps"},
              {.name = "--broadcast-buffers",
               .value = flag::on_off<O>(&O::broadcast_buffers),
               .help = "ddp: broadcast the buffers (BatchNorm's running statistics) from rank 0 before each forward",
               .torch = "DistributedDataParallel(broadcast_buffers=...)",
               .engine = [](const O& o, dp::EngineOptions& e) { e.broadcast_buffers = o.broadcast_buffers; }},
              {.name = "--check-cost",
               .value = flag::on<O>(&O::check_cost),
               .help = "ddp: measure each ddp run again with the collectives' signature check off "
                       "(DP_CHECK_COLLECTIVES=0), and with --check-replicas 0 where --steps holds a replica check, "
                       "and print what each check costs"},
              {.name = "--profile",
               .value = flag::on<O>(&O::profile),
               .help = "cuda: record device spans (busy %, GEMM rates); --trace implies it, the sim always records"},
              {.name = "--roofline",
               .value = flag::choice<O>(&O::roofline, gpu_names()),
               .help = "the GPU whose HBM bandwidth and peak FLOP/s bound each step's estimate (h100, h200, a100)"},
              {.name = "--json",
               .value = flag::text<O>(&O::json_path, "FILE"),
               .help = "write every figure as JSON to this file"},
              {.name = "--trace",
               .value = flag::text<O>(&O::trace_path, "FILE"),
               .help = "write a Chrome/Perfetto trace of the measured steps to this file"},
          }};
}

}  // namespace

const std::vector<FlagGroup<Options>>& flag_groups() {
  static const std::vector<FlagGroup<Options>> groups = {
      dp::tools::shared_flags<O>(),
      {"the model's shape (dp_train's)", dp::tools::model_shape_flags<O>()},
      bench_flags()};
  return groups;
}

dp::models::ModelArgs model_args(const Options& o, const std::string& model) {
  dp::models::ModelArgs args = dp::tools::shape_model_args(o);
  args.num_classes = 10;
  args.image_size = 32;
  if (model == kGpt2) {
    const bool fused = args.gpt.fused_attention;
    args.gpt = {50304, 1024, 12, 12, 768};
    args.gpt.tanh_gelu = true;
    args.gpt.fused_attention = fused;
  }
  return args;
}

const dp::models::ModelSpec& model_spec(const std::string& model) {
  return dp::models::model_spec(model == kGpt2 ? "gpt" : model);
}

std::optional<int> parse_command_line(int argc, char** argv, Options& o, const dp::tools::Job& job) {
  dp::tools::CommandLine cli("dp_bench",
                             "dp_bench: DP vs DDP throughput and per-device imbalance (single, dp, ddp for each model)",
                             "dp_bench: ");
  static const Options defaults;
  cli.add(flag_groups(), o, defaults);
  cli.footer(dp::tools::models_help());
  switch (cli.parse(argc, argv)) {
    // --help: 0, on stdout; a bad command line: its message on stderr and 2, as every bad input.
    case dp::tools::CommandLine::Parsed::help: return job.agree(dp::kStopWithoutError).value_or(0);
    case dp::tools::CommandLine::Parsed::refused: return job.failed(2);
    case dp::tools::CommandLine::Parsed::run: return std::nullopt;
  }
  return std::nullopt;
}

std::unique_ptr<dp::Runtime> make_runtime(const Options& o, int& devices, bool one_process) {
  std::string backend(dp::tools::to_string(o.backend));
  const int gpus = backend == "sim" ? 0 : dp::Runtime::cuda_device_count();
  if (backend == "auto") backend = gpus > 0 ? "cuda" : "sim";
  dp::RuntimeOptions options;
  options.backend = backend;
  options.precision = dp::parse_precision(o.precision);
  options.devices_per_gpu = o.devices_per_gpu;
  // Every process of a job numbers its devices from 0: placed by that number, they would all
  // crowd the same first cores.
  options.sim_pin_threads = one_process;
  if (backend == "cuda") {
    if (gpus == 0)
      throw UsageError(dp::Runtime::cuda_compiled() ? "--backend cuda: no usable CUDA device is visible"
                                                    : "--backend cuda: dp was built without the cuda backend");
    devices = o.devices.value_or(dp::tools::default_devices(true, gpus * o.devices_per_gpu));
    if (devices > gpus * o.devices_per_gpu)
      throw UsageError(fmt::format("--devices {}: only {} CUDA device(s) are visible ({} dp device(s) each)", devices,
                                   gpus, o.devices_per_gpu));
  } else {
    devices = o.devices.value_or(dp::tools::default_devices(false, 0));
    if (devices > dp::tools::kMaxSimDevices)
      throw UsageError(fmt::format("--devices {}: the sim backend simulates at most {} devices", devices,
                                   dp::tools::kMaxSimDevices));
    options.sim_devices = devices;
    if (devices % o.devices_per_gpu != 0)
      throw UsageError(fmt::format("--devices-per-gpu {} does not divide --devices {}", o.devices_per_gpu, devices));
    // The models and batches a benchmark runs take well under 64 MiB a device.
    dp::tools::check_address_space(static_cast<std::uint64_t>(devices) << 26, static_cast<std::uint64_t>(devices),
                                   static_cast<std::uint64_t>(devices) * dp::tools::kThreadsPerSimDevice,
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
