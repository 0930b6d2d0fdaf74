// dp_bench.cpp — the project's main job: DP vs DDP throughput and per-device load imbalance.
//
// For each model (MLP 784-256-256-10, ConvNet) it runs `single` (one device, the per-device batch),
// `dp` (DataParallel over N devices, global batch N x per-device batch) and `ddp`
// (DistributedDataParallel, N ranks x per-device batch): warm-up steps, then measured steps on
// synthetic inputs and labels generated once. It reports samples/s, step time (median, p90),
// scaling efficiency against `single`, and per device: busy time (union of the device's kernel /
// gemm / copy / collective spans over the measured window), device-to-device bytes sent and
// received per step, peak memory; the max/mean imbalance of each; DP's phase times; and, from the
// GEMM spans and the models' analytic GEMM FLOPs, the GEMM rate each device reached.
//
// Under mpirun (one process per node, --devices K each), ddp runs over every process's devices and
// process 0 gathers every device's figures, with the traffic split into intra-node (between the
// devices of one process) and inter-node (between processes) bytes; single and dp are
// single-process by definition and run on process 0 alone. Process 0 prints and writes the files.
//
// Busy time and GEMM rates come from Runtime::take_trace(): the sim records spans always; the cuda
// backend brackets each kernel, library call, copy and collective with timing events, which costs
// two event records per piece of work, so there it is opt-in (--profile, implied by --trace) and
// without it busy time and GEMM rates are null / "n/a" (everything else — throughput, step times,
// traffic counters, peak memory, DP phases via events — works there as written).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dp/atomic_file.h"
#include "dp/data_parallel.h"
#include "dp/ddp.h"
#include "dp/device.h"
#include "dp/engine.h"
#include "dp/error.h"
#include "dp/model.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/precision.h"
#include "dp/process_group.h"
#include "dp/trace.h"
#include "dp_cli.h"
#include "dp_job.h"

namespace {

using json = nlohmann::json;

constexpr int kDefaultSimDevices = 4;
constexpr int kMaxSimDevices = 64;
const std::vector<std::string> kModels = {"mlp", "convnet", "resnet8"};
const std::vector<std::string> kModes = {"single", "dp", "ddp"};

// A bad command line: printed as "dp_bench: <message>" with exit code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Options {
  std::string backend = "auto";
  std::string precision = "strict";
  std::string graphs = "on";
  std::string pipeline = "on";
  bool profile = false;
  std::optional<int> devices;
  int devices_per_gpu = 1;
  std::string models = "mlp,convnet";
  std::string optimizer = "sgd";
  bool sync_bn = false;
  std::string modes = "single,dp,ddp";
  int batch = 64;
  int steps = 20;
  int warmup = 5;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::string json_path;
  std::string trace_path;
  std::uint64_t seed = 1;
};

// "a,b,,c" -> {"a","b","c"}, each checked against `known`, duplicates dropped (first one kept).
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

void validate(const Options& o) {
  if (o.backend != "auto" && o.backend != "cuda" && o.backend != "sim")
    throw UsageError(fmt::format("--backend: unknown backend '{}' (expected auto, cuda or sim)", o.backend));
  try {
    dp::parse_precision(o.precision);
  } catch (const dp::InvalidArgument& e) {
    throw UsageError(fmt::format("--precision: {}", e.what()));
  }
  if (o.graphs != "on" && o.graphs != "off")
    throw UsageError(fmt::format("--graphs: unknown value '{}' (expected on or off)", o.graphs));
  if (o.pipeline != "on" && o.pipeline != "off")
    throw UsageError(fmt::format("--pipeline: unknown value '{}' (expected on or off)", o.pipeline));
  if (o.devices && *o.devices < 1) throw UsageError(fmt::format("--devices must be at least 1, got {}", *o.devices));
  if (o.batch < 1) throw UsageError(fmt::format("--batch-size must be at least 1, got {}", o.batch));
  if (o.steps < 1) throw UsageError(fmt::format("--steps must be at least 1, got {}", o.steps));
  if (o.warmup < 0) throw UsageError(fmt::format("--warmup must be at least 0, got {}", o.warmup));
  if (!(o.bucket_cap_mb > 0.0) || !std::isfinite(o.bucket_cap_mb))
    throw UsageError(fmt::format("--bucket-cap-mb must be a positive number, got {}", o.bucket_cap_mb));
  if (!(o.first_bucket_mb > 0.0) || !std::isfinite(o.first_bucket_mb))
    throw UsageError(fmt::format("--first-bucket-mb must be a positive number, got {}", o.first_bucket_mb));
}

// The runtime the options ask for, checking the device count against what the backend has.
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
  }
  auto runtime = dp::Runtime::create(options);
  if (devices > runtime->device_count())
    throw UsageError(fmt::format("--devices {}: the {} backend has only {} device(s)", devices,
                                 dp::to_string(runtime->backend()), runtime->device_count()));
  return runtime;
}

std::unique_ptr<dp::Model> make_model(const std::string& name, dp::Device& device, std::uint64_t seed) {
  if (name == "mlp") return dp::models::make_mlp(device, {256, 256}, seed);
  if (name == "resnet8") return dp::models::make_resnet8(device, seed);
  return dp::models::make_convnet(device, seed);
}

// GEMM FLOPs per sample of one training step (forward, weight gradients, input gradients of every
// layer but the first: the engine skips the first layer's dx, as PyTorch does). The forward GEMM
// of each layer has `macs` multiply-accumulates per sample; its two backward GEMMs have as many.
double gemm_flops_per_sample(const std::string& model) {
  std::vector<double> macs;
  if (model == "mlp")
    macs = {784.0 * 256, 256.0 * 256, 256.0 * 10};
  else if (model == "resnet8")  // stem; layer1 2x; layer2 conv1, conv2, downsample; layer3 likewise; fc
    macs = {16.0 * 9 * 28 * 28,      16.0 * 16 * 9 * 28 * 28,
            16.0 * 16 * 9 * 28 * 28, 32.0 * 16 * 9 * 14 * 14,
            32.0 * 32 * 9 * 14 * 14, 32.0 * 16 * 14 * 14,
            64.0 * 32 * 9 * 7 * 7,   64.0 * 64 * 9 * 7 * 7,
            64.0 * 32 * 7 * 7,       64.0 * 10};
  else
    macs = {16.0 * 25 * 28 * 28, 32.0 * 16 * 25 * 14 * 14, 7.0 * 7 * 32 * 10};  // im2col GEMMs, fc
  double sum = 0;
  for (double m : macs) sum += m;
  return 2.0 * (3.0 * sum - macs.front());
}

// Synthetic data, generated once for the largest global batch: pixels in [0, 1), labels 0..9.
struct Data {
  std::vector<float> inputs;
  std::vector<std::int64_t> labels;
  std::size_t sample_floats = 0;
};

Data make_data(int samples, std::size_t sample_floats, std::uint64_t seed) {
  Data d;
  d.sample_floats = sample_floats;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::uniform_int_distribution<int> label(0, 9);
  d.inputs.resize(static_cast<std::size_t>(samples) * sample_floats);
  for (float& x : d.inputs) x = pixel(rng);
  d.labels.resize(static_cast<std::size_t>(samples));
  for (auto& y : d.labels) y = label(rng);
  return d;
}

struct PerDevice {
  int device = 0;
  int process = 0;
  std::string host;
  std::optional<double> busy_pct;  // null on cuda (no spans recorded)
  std::optional<double> gemm_ms_per_step;
  std::optional<double> gemm_gflops;
  double bytes_sent = 0, bytes_received = 0;  // device-to-device within the process (intra-node), per step
  double net_sent = 0, net_received = 0;      // to and from other processes (inter-node), per step
  std::uint64_t peak_bytes = 0;
  int samples_per_step = 0;
  // What the host asked of the device per measured step (Runtime::counters).
  double launches = 0, host_syncs = 0, allocations = 0, pageable_copies = 0, worker_submits = 0;
};

struct Run {
  std::string model, mode;
  std::vector<int> device_ids;  // this process's
  int devices = 0;              // every process's (ddp across processes), else device_ids.size()
  int batch_per_device = 0, global_batch = 0;
  std::size_t param_count = 0, buffers_bytes = 0;
  std::vector<double> step_ms;
  double wall_ms = 0, samples_per_s = 0, median = 0, p90 = 0, mean = 0;
  std::optional<double> scaling_efficiency;
  std::optional<dp::DataParallelPhases> phases;  // dp only: averaged over the measured steps
  std::optional<std::size_t> buckets;            // ddp only: gradient buckets (all-reduces per step)
  bool graphs = false;                           // every measured step was a replayed graph
  bool pipelined = false;                        // measured steps submitted without waiting (--pipeline)
  std::vector<PerDevice> per_device;
  float loss_first = 0, loss_last = 0;
  // For the trace: the measured window, its step boundaries and its spans.
  std::int64_t t0 = 0, t1 = 0;
  std::vector<std::int64_t> step_starts;
  std::vector<dp::TraceSpan> spans;
  double trace_offset_ms = 0;
};

double percentile(std::vector<double> v, double q) {  // nearest rank
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, rank == 0 ? 0 : rank - 1)];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// max / mean; 1 when every value is 0 (nothing to be imbalanced about).
double imbalance(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  double sum = 0, max = v.front();
  for (double x : v) {
    sum += x;
    max = std::max(max, x);
  }
  const double mean = sum / static_cast<double>(v.size());
  return mean > 0 ? max / mean : 1.0;
}

// Length of the union of [start, end) intervals clipped to [lo, hi).
std::int64_t union_ns(std::vector<std::pair<std::int64_t, std::int64_t>> spans, std::int64_t lo, std::int64_t hi) {
  for (auto& [s, e] : spans) {
    s = std::clamp(s, lo, hi);
    e = std::clamp(e, lo, hi);
  }
  std::sort(spans.begin(), spans.end());
  std::int64_t total = 0, cur_s = 0, cur_e = 0;
  bool open = false;
  for (const auto& [s, e] : spans) {
    if (e <= s) continue;
    if (open && s <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) total += cur_e - cur_s;
    cur_s = s;
    cur_e = e;
    open = true;
  }
  if (open) total += cur_e - cur_s;
  return total;
}

// Whether the measured steps record spans (busy time, GEMM rates, the trace): always on sim; on cuda
// only when asked (--profile or --trace), since each kernel then records two timing events.
bool records_spans(const dp::Runtime& rt, const Options& o) {
  return rt.backend() == dp::Backend::sim || o.profile || !o.trace_path.empty();
}

void synchronize(dp::Runtime& rt, const std::vector<int>& devices) {
  for (int d : devices) rt.device(d).synchronize();
}

// Warm-up, then the measured steps with profiling on and the counters reset; fills the timing,
// traffic, memory and span fields of `run`. `submit` submits one training step (Engine::submit_step).
// Pipelined (--pipeline on, and no `after_step`), each measured step is submitted as soon as the
// previous submission returned, as a training loop that does not read every loss runs: the host
// stages the next batch while the devices run this step, and a step's time is the time between two
// submissions (the last one's: until every device has finished). Otherwise each step waits for its
// loss and for every device, and `after_step` runs then (DP reads its phase times there).
void measure(dp::Runtime& rt, const Options& o, Run& run, const std::function<dp::StepLoss()>& submit,
             const std::function<void()>& after_step = {}, dp::ProcessGroup* processes = nullptr) {
  const std::vector<int>& used = run.device_ids;
  for (int i = 0; i < o.warmup; ++i) {
    (void)submit().get();
    synchronize(rt, used);
  }
  synchronize(rt, used);
  if (processes) processes->barrier();  // every process starts its measured window together
  rt.reset_link_traffic();
  rt.reset_counters();
  for (int d : used) rt.device(d).reset_peak_memory();
  rt.take_trace();
  const bool have_spans = records_spans(rt, o);
  rt.set_profiling(have_spans);
  run.pipelined = o.pipeline == "on" && !after_step;
  run.t0 = now_ns();
  // The host work counters cover the engine's steps only, not the synchronisation that times them.
  std::vector<dp::DeviceCounters> engine_work(used.size());
  const auto add_since = [&](const std::vector<dp::DeviceCounters>& before) {
    for (std::size_t i = 0; i < used.size(); ++i) {
      const dp::DeviceCounters now = rt.counters(used[i]);
      auto& w = engine_work[i];
      w.launches += now.launches - before[i].launches;
      w.host_syncs += now.host_syncs - before[i].host_syncs;
      w.allocations += now.allocations - before[i].allocations;
      w.pageable_copies += now.pageable_copies - before[i].pageable_copies;
      w.worker_submits += now.worker_submits - before[i].worker_submits;
    }
  };
  std::vector<dp::StepLoss> losses;
  for (int i = 0; i < o.steps; ++i) {
    const std::int64_t start = now_ns();
    run.step_starts.push_back(start);
    if (run.pipelined && i > 0)
      run.step_ms.push_back(static_cast<double>(start - run.step_starts[static_cast<std::size_t>(i) - 1]) / 1e6);
    std::vector<dp::DeviceCounters> before;
    for (int d : used) before.push_back(rt.counters(d));
    losses.push_back(submit());
    if (!run.pipelined) (void)losses.back().get();  // the step's one host wait, counted as the engine's
    add_since(before);
    if (run.pipelined) continue;
    synchronize(rt, used);  // a step ends when every device has finished it
    const std::int64_t end = now_ns();
    run.step_ms.push_back(static_cast<double>(end - start) / 1e6);
    run.t1 = end;
    if (after_step) after_step();
  }
  if (run.pipelined) {
    synchronize(rt, used);
    run.t1 = now_ns();
    run.step_ms.push_back(static_cast<double>(run.t1 - run.step_starts.back()) / 1e6);
  }
  run.loss_first = losses.front().get();
  run.loss_last = losses.back().get();
  rt.set_profiling(false);
  run.spans = rt.take_trace();

  run.wall_ms = static_cast<double>(run.t1 - run.t0) / 1e6;
  run.samples_per_s = static_cast<double>(run.global_batch) * o.steps / (run.wall_ms / 1e3);
  run.median = median(run.step_ms);
  run.p90 = percentile(run.step_ms, 0.9);
  double sum = 0;
  for (double t : run.step_ms) sum += t;
  run.mean = sum / static_cast<double>(run.step_ms.size());

  // Busy time and GEMM time need the stream spans: without them (cuda without --profile) they
  // stay null ("n/a").
  const double flops_per_sample = gemm_flops_per_sample(run.model);
  for (std::size_t i = 0; i < used.size(); ++i) {
    const int d = used[i];
    PerDevice pd;
    pd.device = d;
    pd.process = processes ? processes->rank() : 0;
    pd.host = processes ? processes->host() : std::string();
    pd.bytes_sent = static_cast<double>(rt.bytes_sent(d)) / o.steps;
    pd.bytes_received = static_cast<double>(rt.bytes_received(d)) / o.steps;
    pd.net_sent = static_cast<double>(rt.link_traffic(d, dp::kNetwork).bytes) / o.steps;
    pd.net_received = static_cast<double>(rt.link_traffic(dp::kNetwork, d).bytes) / o.steps;
    pd.peak_bytes = rt.device(d).memory().peak;
    const dp::DeviceCounters& counters = engine_work[i];
    pd.launches = static_cast<double>(counters.launches) / o.steps;
    pd.host_syncs = static_cast<double>(counters.host_syncs) / o.steps;
    pd.allocations = static_cast<double>(counters.allocations) / o.steps;
    pd.pageable_copies = static_cast<double>(counters.pageable_copies) / o.steps;
    pd.worker_submits = static_cast<double>(counters.worker_submits) / o.steps;
    pd.samples_per_step = run.batch_per_device;  // dp corrects it from its chunks
    if (have_spans) {
      std::vector<std::pair<std::int64_t, std::int64_t>> busy, gemm;
      for (const auto& s : run.spans) {
        if (s.device != d) continue;
        if (dp::is_busy(s.kind)) busy.emplace_back(s.start_ns, s.end_ns);
        if (s.kind == dp::SpanKind::gemm) gemm.emplace_back(s.start_ns, s.end_ns);
      }
      pd.busy_pct = 100.0 * static_cast<double>(union_ns(busy, run.t0, run.t1)) / static_cast<double>(run.t1 - run.t0);
      const double gemm_ns = static_cast<double>(union_ns(gemm, run.t0, run.t1));
      pd.gemm_ms_per_step = gemm_ns / 1e6 / o.steps;
      if (gemm_ns > 0) pd.gemm_gflops = flops_per_sample * pd.samples_per_step * o.steps / gemm_ns;
    }
    run.per_device.push_back(pd);
  }
}

// Every process's per-device figures, in process order, on every process.
void gather_devices(Run& run, dp::ProcessGroup& processes) {
  struct Wire {  // PerDevice as plain bytes; NaN for a figure that is not available
    int device, process, samples;
    double busy, gemm_ms, gemm_gflops, sent, received, net_sent, net_received;
    double launches, host_syncs, allocations, pageable_copies, worker_submits;
    std::uint64_t peak;
    char host[64];
  };
  const double none = std::numeric_limits<double>::quiet_NaN();
  std::vector<Wire> mine;
  for (const PerDevice& pd : run.per_device) {
    Wire w;
    std::memset(&w, 0, sizeof(w));  // no uninitialised padding goes out
    w.device = pd.device;
    w.process = pd.process;
    w.samples = pd.samples_per_step;
    w.busy = pd.busy_pct.value_or(none);
    w.gemm_ms = pd.gemm_ms_per_step.value_or(none);
    w.gemm_gflops = pd.gemm_gflops.value_or(none);
    w.sent = pd.bytes_sent;
    w.received = pd.bytes_received;
    w.net_sent = pd.net_sent;
    w.net_received = pd.net_received;
    w.launches = pd.launches;
    w.host_syncs = pd.host_syncs;
    w.allocations = pd.allocations;
    w.pageable_copies = pd.pageable_copies;
    w.worker_submits = pd.worker_submits;
    w.peak = pd.peak_bytes;
    std::snprintf(w.host, sizeof(w.host), "%s", pd.host.c_str());
    mine.push_back(w);
  }
  const auto value = [](double v) { return std::isnan(v) ? std::nullopt : std::optional<double>(v); };
  run.per_device.clear();
  for (const Wire& w : processes.all_gather(std::span<const Wire>(mine))) {
    PerDevice pd;
    pd.device = w.device;
    pd.process = w.process;
    pd.host = w.host;
    pd.samples_per_step = w.samples;
    pd.busy_pct = value(w.busy);
    pd.gemm_ms_per_step = value(w.gemm_ms);
    pd.gemm_gflops = value(w.gemm_gflops);
    pd.bytes_sent = w.sent;
    pd.bytes_received = w.received;
    pd.net_sent = w.net_sent;
    pd.net_received = w.net_received;
    pd.launches = w.launches;
    pd.host_syncs = w.host_syncs;
    pd.allocations = w.allocations;
    pd.pageable_copies = w.pageable_copies;
    pd.worker_submits = w.worker_submits;
    pd.peak_bytes = w.peak;
    run.per_device.push_back(pd);
  }
}

// One run: `mode` over devices 0..devices-1 (single: device 0 alone), the model on device 0 (DP's
// source and output device, DDP's rank 0), picked once as an Engine and driven through it.
// Under mpirun, ddp spans every process (`processes`), and every device's figures end up on all.
Run bench(dp::Runtime& rt, const Options& o, const std::string& model_name, const std::string& mode, const Data& data,
          int devices, const std::shared_ptr<dp::ProcessGroup>& processes) {
  const dp::EngineKind kind = dp::parse_engine_kind(mode);
  const int used = kind == dp::EngineKind::single ? 1 : devices;
  const bool across = kind == dp::EngineKind::ddp && processes->size() > 1;
  Run run;
  run.model = model_name;
  run.mode = mode;
  for (int d = 0; d < used; ++d) run.device_ids.push_back(d);
  run.devices = used * (across ? processes->size() : 1);
  run.batch_per_device = o.batch;
  run.global_batch = o.batch * run.devices;
  auto model = make_model(model_name, rt.device(0), o.seed);
  run.param_count = model->param_count();
  run.buffers_bytes = model->buffers_bytes();

  dp::EngineOptions options;
  options.kind = kind;
  options.device_ids = run.device_ids;
  options.output_device = kind == dp::EngineKind::dp ? std::optional<int>(0) : std::nullopt;
  options.graphs = o.graphs == "on";
  // Phase times come from events between the phases, which a replayed graph does not record.
  options.time_phases = kind == dp::EngineKind::dp && !options.graphs;
  options.bucket_cap_mb = o.bucket_cap_mb;
  options.sync_batchnorm = o.sync_bn && kind == dp::EngineKind::ddp;
  options.first_bucket_mb = o.first_bucket_mb;
  if (across) options.processes = processes;
  const dp::OptimizerOptions optimizer = o.optimizer == "adamw" ? dp::OptimizerOptions{dp::AdamWOptions{1e-3}}
                                                                : dp::OptimizerOptions{dp::SgdOptions{0.01f, 0.9f}};
  auto engine = dp::make_engine(rt, *model, optimizer, options);

  // The global batch as the engine takes it: whole (single, DP) or one shard per rank (DDP: this
  // process's ranks).
  // In pinned host memory and lent to the engine (Batch::lease), as dp_train's loader hands them
  // out: the engine copies them to the devices asynchronously, straight from where they are.
  const int pieces = engine->batches_per_step(), piece = run.global_batch / engine->world_size();
  const std::size_t rows = static_cast<std::size_t>(pieces) * static_cast<std::size_t>(piece);
  struct Pinned {
    dp::PinnedBuffer inputs, labels;
  };
  auto pinned = std::make_shared<Pinned>();
  pinned->inputs = rt.allocate_pinned(rows * data.sample_floats * sizeof(float));
  pinned->labels = rt.allocate_pinned(rows * sizeof(std::int64_t));
  std::memcpy(pinned->inputs.data(), data.inputs.data(), pinned->inputs.size());
  std::memcpy(pinned->labels.data(), data.labels.data(), pinned->labels.size());
  std::vector<dp::Batch> batches;
  for (int i = 0; i < pieces; ++i) {
    const std::size_t row = static_cast<std::size_t>(i) * static_cast<std::size_t>(piece);
    // Never written again: the lease only keeps the memory alive while a copy may read it.
    batches.push_back(dp::Batch{pinned->inputs.as<float>() + row * data.sample_floats,
                                pinned->labels.as<std::int64_t>() + row, piece, pinned});
  }

  // DataParallel also reports where its step time goes, and how it chunked the batch.
  auto* parallel = dynamic_cast<dp::DataParallel*>(engine.get());
  dp::DataParallelPhases sum;
  int timed = 0;
  std::function<void()> after_step;
  if (parallel && options.time_phases)
    after_step = [&] {
      const auto p = parallel->last_phases();
      sum.broadcast += p.broadcast, sum.scatter += p.scatter, sum.forward += p.forward, sum.gather += p.gather;
      sum.loss += p.loss, sum.backward += p.backward, sum.reduce += p.reduce, sum.update += p.update;
      ++timed;
    };
  measure(
      rt, o, run, [&] { return engine->submit_step(batches); }, after_step, across ? processes.get() : nullptr);
  run.graphs = engine->graph_replays() >= static_cast<std::uint64_t>(o.steps);
  if (across) gather_devices(run, *processes);
  if (kind == dp::EngineKind::ddp) run.buckets = static_cast<dp::DistributedDataParallel&>(*engine).buckets().size();
  if (!parallel) return run;
  const double n = timed;
  if (timed > 0)
    run.phases = dp::DataParallelPhases{sum.broadcast / n, sum.scatter / n,  sum.forward / n, sum.gather / n,
                                        sum.loss / n,      sum.backward / n, sum.reduce / n,  sum.update / n};
  // torch.chunk rules: with a small global batch some devices get fewer rows (or none).
  const auto& chunks = parallel->last_chunks();
  for (std::size_t i = 0; i < run.per_device.size(); ++i) {
    auto& pd = run.per_device[i];
    pd.samples_per_step = i < chunks.size() ? chunks[i] : 0;
    if (pd.gemm_gflops && pd.samples_per_step != run.batch_per_device)
      pd.gemm_gflops = *pd.gemm_gflops * pd.samples_per_step / run.batch_per_device;
  }
  return run;
}

// ---------------------------------------------------------------------------------------------
// output

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

template <class F>
std::vector<double> column(const Run& run, F f) {
  std::vector<double> v;
  for (const auto& pd : run.per_device) v.push_back(f(pd));
  return v;
}

std::optional<double> busy_imbalance(const Run& run) {
  std::vector<double> v;
  for (const auto& pd : run.per_device) {
    if (!pd.busy_pct) return std::nullopt;
    v.push_back(*pd.busy_pct);
  }
  return imbalance(v);
}

std::optional<double> busy_mean(const Run& run) {
  double sum = 0;
  for (const auto& pd : run.per_device) {
    if (!pd.busy_pct) return std::nullopt;
    sum += *pd.busy_pct;
  }
  return sum / static_cast<double>(run.per_device.size());
}

std::string opt(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : std::string("n/a");
}

void print_tables(const std::vector<Run>& runs, bool have_spans) {
  fmt::print("\n{:<8} {:<6} {:>3} {:>6} {:>11} {:>9} {:>9} {:>7} {:>7} {:>5} {:>11} {:>11} {:>11} {:>5} {:>11} {:>5}\n",
             "model", "mode", "dev", "batch", "samples/s", "step ms", "p90 ms", "scaling", "busy %", "imb", "sent/step",
             "recv/step", "net/step", "imb", "peak mem", "imb");
  for (const Run& r : runs) {
    const auto sent = column(r, [](const PerDevice& p) { return p.bytes_sent; });
    const auto recv = column(r, [](const PerDevice& p) { return p.bytes_received; });
    const auto peak = column(r, [](const PerDevice& p) { return static_cast<double>(p.peak_bytes); });
    const auto net = column(r, [](const PerDevice& p) { return p.net_sent + p.net_received; });
    fmt::print(
        "{:<8} {:<6} {:>3} {:>6} {:>11.1f} {:>9.2f} {:>9.2f} {:>7} {:>7} {:>5} {:>11} {:>11} {:>11} {:>5.2f} {:>11} "
        "{:>5.2f}\n",
        r.model, r.mode, r.devices, r.global_batch, r.samples_per_s, r.median, r.p90,
        opt(r.scaling_efficiency, "{:.2f}"), opt(busy_mean(r), "{:.1f}"), opt(busy_imbalance(r), "{:.2f}"),
        human_bytes(*std::max_element(sent.begin(), sent.end())),
        human_bytes(*std::max_element(recv.begin(), recv.end())),
        human_bytes(*std::max_element(net.begin(), net.end())),
        imbalance(column(
            r, [](const PerDevice& p) { return p.bytes_sent + p.bytes_received + p.net_sent + p.net_received; })),
        human_bytes(*std::max_element(peak.begin(), peak.end())), imbalance(peak));
  }
  fmt::print(
      "  batch = global samples per step; scaling = samples/s / (devices x samples/s of single);\n"
      "  busy % = mean over devices of the time covered by kernel/gemm/copy/collective spans{};\n"
      "  sent/recv = the busiest device's device-to-device bytes per step (intra-node); net = its bytes to and\n"
      "  from other processes (inter-node, under mpirun); imb = max/mean over devices\n",
      have_spans ? "" : " (n/a: on cuda, spans are recorded with --profile or --trace)");

  fmt::print("\nper device\n{:<8} {:<6} {:>7} {:>6} {:>7} {:>8} {:>9} {:>12} {:>12} {:>12} {:>12} {:>11}\n", "model",
             "mode", "process", "device", "busy %", "gemm ms", "gemm GF/s", "sent/step", "recv/step", "net sent",
             "net recv", "peak mem");
  for (const Run& r : runs)
    for (const auto& pd : r.per_device)
      fmt::print("{:<8} {:<6} {:>7} {:>6} {:>7} {:>8} {:>9} {:>12} {:>12} {:>12} {:>12} {:>11}\n", r.model, r.mode,
                 pd.process, pd.device, opt(pd.busy_pct, "{:.1f}"), opt(pd.gemm_ms_per_step, "{:.2f}"),
                 opt(pd.gemm_gflops, "{:.1f}"), human_bytes(pd.bytes_sent), human_bytes(pd.bytes_received),
                 human_bytes(pd.net_sent), human_bytes(pd.net_received),
                 human_bytes(static_cast<double>(pd.peak_bytes)));
  fmt::print("  gemm ms = GEMM span time per step; gemm GF/s = the model's analytic GEMM FLOPs / that time\n");

  fmt::print(
      "\nhost work per step (summed over devices; submits: the busiest device; a replayed graph is one launch)\n"
      "{:<8} {:<6} {:>9} {:>11} {:>12} {:>9} {:>8} {:>7}\n",
      "model", "mode", "launches", "host syncs", "allocations", "pageable", "submits", "graphs");
  for (const Run& r : runs) {
    double launches = 0, syncs = 0, allocations = 0, pageable = 0, submits = 0;
    for (const auto& pd : r.per_device) {
      launches += pd.launches;
      syncs += pd.host_syncs;
      allocations += pd.allocations;
      pageable += pd.pageable_copies;
      submits = std::max(submits, pd.worker_submits);
    }
    fmt::print("{:<8} {:<6} {:>9.1f} {:>11.1f} {:>12.1f} {:>9.1f} {:>8.1f} {:>7}\n", r.model, r.mode, launches, syncs,
               allocations, pageable, submits, r.graphs ? "yes" : "no");
  }

  bool any_dp = false;
  for (const Run& r : runs) any_dp = any_dp || r.phases.has_value();
  if (!any_dp) return;
  fmt::print(
      "\nDP phases, ms per step (mean over measured steps; per-device phases: the slowest device)\n"
      "{:<8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8}\n",
      "model", "broadcast", "scatter", "forward", "gather", "loss", "backward", "reduce", "update", "step");
  for (const Run& r : runs) {
    if (!r.phases) continue;
    const auto& p = *r.phases;
    fmt::print("{:<8} {:>9.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>8.2f}\n", r.model,
               p.broadcast, p.scatter, p.forward, p.gather, p.loss, p.backward, p.reduce, p.update, r.mean);
  }
}

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

// Exact integers where the per-step value is one (it is: every step moves the same bytes).
json bytes_json(double v) {
  if (v >= 0 && v == std::floor(v) && v < 9.0e15) return json(static_cast<std::uint64_t>(v));
  return json(v);
}

json run_json(const Run& r) {
  json j;
  j["model"] = r.model;
  j["mode"] = r.mode;
  j["devices"] = r.devices;
  j["device_ids"] = r.device_ids;
  j["batch_per_device"] = r.batch_per_device;
  j["global_batch"] = r.global_batch;
  j["param_count"] = r.param_count;
  j["buffers_bytes"] = r.buffers_bytes;
  j["steps"] = r.step_ms.size();
  j["samples_per_s"] = r.samples_per_s;
  j["wall_ms"] = r.wall_ms;
  j["step_ms"] = r.step_ms;
  j["step_ms_median"] = r.median;
  j["step_ms_p90"] = r.p90;
  j["step_ms_mean"] = r.mean;
  j["scaling_efficiency"] = optional_json(r.scaling_efficiency);
  j["loss_first"] = r.loss_first;
  j["loss_last"] = r.loss_last;
  j["gemm_flops_per_sample"] = gemm_flops_per_sample(r.model);
  json phases = json::object();
  if (r.phases) {
    const auto& p = *r.phases;
    phases = {{"broadcast", p.broadcast}, {"scatter", p.scatter},   {"forward", p.forward}, {"gather", p.gather},
              {"loss", p.loss},           {"backward", p.backward}, {"reduce", p.reduce},   {"update", p.update}};
  }
  j["phases_ms"] = phases;
  j["ddp_buckets"] = r.buckets ? json(*r.buckets) : json(nullptr);
  json per = json::array();
  for (const auto& pd : r.per_device)
    per.push_back({{"device", pd.device},
                   {"process", pd.process},
                   {"host", pd.host},
                   {"bytes_sent_inter_node", bytes_json(pd.net_sent)},
                   {"bytes_received_inter_node", bytes_json(pd.net_received)},
                   {"busy_pct", optional_json(pd.busy_pct)},
                   {"gemm_ms_per_step", optional_json(pd.gemm_ms_per_step)},
                   {"gemm_gflops", optional_json(pd.gemm_gflops)},
                   {"samples_per_step", pd.samples_per_step},
                   {"bytes_sent", bytes_json(pd.bytes_sent)},
                   {"bytes_received", bytes_json(pd.bytes_received)},
                   {"peak_bytes", pd.peak_bytes},
                   {"launches_per_step", pd.launches},
                   {"host_syncs_per_step", pd.host_syncs},
                   {"allocations_per_step", pd.allocations},
                   {"pageable_copies_per_step", pd.pageable_copies},
                   {"worker_submits_per_step", pd.worker_submits}});
  j["per_device"] = per;
  // Summed over the devices (worker submissions: per device, above). With graphs, a step is one
  // launch per graph: DP's one graph spans every device, DDP has one per rank.
  const auto total = [&](auto field) {
    double sum = 0;
    for (const auto& pd : r.per_device) sum += pd.*field;
    return sum;
  };
  j["launches_per_step"] = total(&PerDevice::launches);
  j["host_syncs_per_step"] = total(&PerDevice::host_syncs);
  j["allocations_per_step"] = total(&PerDevice::allocations);
  j["pageable_copies_per_step"] = total(&PerDevice::pageable_copies);
  j["graphs"] = r.graphs;
  j["pipelined"] = r.pipelined;
  j["busy_pct_mean"] = optional_json(busy_mean(r));
  j["imbalance"] = {
      {"busy_pct", optional_json(busy_imbalance(r))},
      {"bytes_sent", imbalance(column(r, [](const PerDevice& p) { return p.bytes_sent; }))},
      {"bytes_received", imbalance(column(r, [](const PerDevice& p) { return p.bytes_received; }))},
      {"peak_bytes", imbalance(column(r, [](const PerDevice& p) { return static_cast<double>(p.peak_bytes); }))}};
  j["trace_offset_ms"] = r.trace_offset_ms;
  return j;
}

// Chrome / Perfetto Trace Event Format. Runs are laid end to end in time (each run's measured
// window, then a gap), pid = device, tid = the runtime-wide stream id — each run makes its own
// streams, so a stream's track holds one run; every event's args name the run and the step.
// Event record/wait spans (kind "sync") are left out: a stream waiting is idle, and the gap shows it.
json trace_json(std::vector<Run>& runs) {
  json events = json::array();
  std::map<int, std::set<int>> tracks;  // device -> streams that did work
  std::int64_t cursor = 0;
  double first_ts = -1;
  json spans = json::array();
  for (Run& run : runs) {
    run.trace_offset_ms = static_cast<double>(cursor) / 1e6;
    const std::string label = fmt::format("{} {}", run.model, run.mode);
    for (const auto& s : run.spans) {
      if (s.kind == dp::SpanKind::sync) continue;
      const std::int64_t start = std::clamp(s.start_ns, run.t0, run.t1), end = std::clamp(s.end_ns, start, run.t1);
      const auto step =
          std::upper_bound(run.step_starts.begin(), run.step_starts.end(), s.start_ns) - run.step_starts.begin() - 1;
      const double ts = static_cast<double>(cursor + (start - run.t0)) / 1e3;
      if (first_ts < 0 || ts < first_ts) first_ts = ts;
      spans.push_back({{"ph", "X"},
                       {"name", s.name},
                       {"cat", dp::to_string(s.kind)},
                       {"pid", s.device},
                       {"tid", s.stream},
                       {"ts", ts},
                       {"dur", static_cast<double>(end - start) / 1e3},
                       {"args", {{"run", label}, {"step", std::max<std::ptrdiff_t>(step, 0)}}}});
      tracks[s.device].insert(s.stream);
    }
    const std::int64_t window = run.t1 - run.t0;
    cursor += window + std::max<std::int64_t>(1'000'000, window / 10);
  }
  if (first_ts < 0) first_ts = 0;
  for (auto& [device, streams] : tracks) {
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", device},
                      {"tid", 0},
                      {"args", {{"name", fmt::format("device {}", device)}}}});
    events.push_back(
        {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", device}, {"tid", 0}, {"args", {{"sort_index", device}}}});
    for (int stream : streams) {
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", device},
                        {"tid", stream},
                        {"args", {{"name", fmt::format("stream {}", stream)}}}});
      events.push_back({{"ph", "M"},
                        {"name", "thread_sort_index"},
                        {"pid", device},
                        {"tid", stream},
                        {"args", {{"sort_index", stream}}}});
    }
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const json& a, const json& b) { return a["ts"].get<double>() < b["ts"].get<double>(); });
  for (auto& e : spans) {
    e["ts"] = std::max(0.0, e["ts"].get<double>() - first_ts);
    events.push_back(std::move(e));
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

// The report indented; the trace (thousands of events) one event per line. Written atomically: a
// failed run or a full disk leaves the previous file (or none), never an empty or torn one.
void write_file(const std::string& path, const json& j) {
  std::string text;
  if (j.contains("traceEvents")) {
    text = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    const auto& events = j.at("traceEvents");
    for (std::size_t i = 0; i < events.size(); ++i) text += events[i].dump() + (i + 1 < events.size() ? ",\n" : "\n");
    text += "]}\n";
  } else {
    text = j.dump(1) + '\n';
  }
  dp::write_atomically(path, text);
}

int run_bench(const Options& o, dp::tools::Job& job) {
  const auto& processes = job.processes();
  validate(o);
  const auto models = parse_list(o.models, kModels, "--models");
  const auto modes = parse_list(o.modes, kModes, "--modes");
  // Fail on an unwritable output before spending minutes on the runs (process 0 writes them).
  for (const auto* path : {&o.json_path, &o.trace_path}) {
    if (path->empty() || !job.primary()) continue;
    try {
      dp::check_writable(*path);
    } catch (const dp::Error& e) {
      throw UsageError(fmt::format("cannot write {}", e.what()));
    }
  }

  int devices = 0;
  auto rt = make_runtime(o, devices);
  const std::string backend(dp::to_string(rt->backend()));
  std::vector<std::string> names;
  for (int d = 0; d < devices; ++d) names.push_back(rt->device(d).name());
  job.set_devices([&] {
    std::vector<int> ids;
    for (int d = 0; d < devices; ++d) ids.push_back(d);
    return ids;
  }());
  fmt::print(
      "dp_bench: backend {} (precision {}, graphs {}, pipeline {}), {} device(s) [{}]{}, batch {} per device, {} "
      "warm-up + {} measured steps, DDP buckets {} MiB (first {} MiB)\n",
      backend, o.precision, o.graphs, o.pipeline, devices, fmt::join(names, ", "),
      job.several() ? fmt::format(" in each of {} processes (single and dp: process 0 alone)", processes->size()) : "",
      o.batch, o.warmup, o.steps, o.bucket_cap_mb, o.first_bucket_mb);
  std::fflush(stdout);

  // The synthetic inputs of the largest global batch, generated once: refused (exit 2, with the
  // figure) before anything is allocated when they cannot exist.
  const std::uint64_t global = static_cast<std::uint64_t>(o.batch) * static_cast<std::uint64_t>(devices);
  if (global > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    throw UsageError(fmt::format("--batch-size {} x {} devices: a global batch of {} samples is more than {}", o.batch,
                                 devices, global, std::numeric_limits<int>::max()));
  const std::uint64_t data_bytes = global * (784 * sizeof(float) + sizeof(std::int64_t));
  if (const std::uint64_t host = dp::Runtime::host_memory_bytes(); host > 0 && data_bytes > host)
    throw UsageError(fmt::format("--batch-size {}: the synthetic inputs alone need {:.1f} GiB, the host has {:.1f} GiB",
                                 o.batch, static_cast<double>(data_bytes) / (1u << 30),
                                 static_cast<double>(host) / (1u << 30)));
  const Data data = make_data(o.batch * devices, 784, o.seed);
  // Every process is ready (or all stop with the first failing one's exit code), with one
  // configuration (each one's devices and flags: their runs meet in collectives).
  job.agree_or_stop();
  job.agree_on_configuration({{"--backend", backend},
                              {"--precision", o.precision},
                              {"--graphs", o.graphs},
                              {"--pipeline", o.pipeline},
                              {"--devices", fmt::format("{}", devices)},
                              {"--models", fmt::format("{}", fmt::join(models, ","))},
                              {"--modes", fmt::format("{}", fmt::join(modes, ","))},
                              {"--batch-size", fmt::format("{}", o.batch)},
                              {"--steps, --warmup", fmt::format("{} {}", o.steps, o.warmup)},
                              {"buckets", fmt::format("{} {}", o.bucket_cap_mb, o.first_bucket_mb)},
                              {"--optimizer, --sync-bn", fmt::format("{} {}", o.optimizer, o.sync_bn)},
                              {"--seed", fmt::format("{}", o.seed)}});
  job.collectives_begin();
  std::vector<Run> runs;
  for (const auto& model : models) {
    for (const auto& mode : modes) {
      // single and dp are single-process by definition: process 0 runs them, the others wait
      // (without the collectives' timeout: those runs may take long) until all start ddp.
      if (mode != "ddp" && !job.primary()) continue;
      if (mode == "ddp") job.agree_or_stop();
      runs.push_back(bench(*rt, o, model, mode, data, devices, processes));
      const Run& r = runs.back();
      fmt::print("  {:<8} {:<6} {:>10.1f} samples/s  (median step {:.2f} ms)\n", r.model, r.mode, r.samples_per_s,
                 r.median);
      std::fflush(stdout);
    }
  }
  for (Run& r : runs) {
    for (const Run& s : runs)
      if (s.model == r.model && s.mode == "single" && s.samples_per_s > 0)
        r.scaling_efficiency = r.samples_per_s / (static_cast<double>(r.devices) * s.samples_per_s);
  }
  processes->barrier();  // process 0's single and dp runs are over
  job.collectives_end();
  if (!job.primary()) return job.agree(0).value_or(0);
  // Lay out the trace first: it assigns each run's offset, which the JSON reports.
  const json trace = trace_json(runs);
  print_tables(runs, records_spans(*rt, o));

  if (!o.trace_path.empty()) {
    write_file(o.trace_path, trace);
    fmt::print("\ntrace: {} (open in https://ui.perfetto.dev or chrome://tracing; runs laid end to end:", o.trace_path);
    for (const Run& r : runs) fmt::print(" {} {} at {:.1f} ms;", r.model, r.mode, r.trace_offset_ms);
    fmt::print(")\n");
    if (job.several()) fmt::print("  (the trace holds process 0's devices)\n");
  }
  if (!o.json_path.empty()) {
    json j;
    j["backend"] = backend;
    j["devices"] = devices;  // per process
    j["devices_per_gpu"] = o.devices_per_gpu;
    j["processes"] = processes->size();
    j["hosts"] = [&] {  // per process, from a run across all of them
      std::vector<std::string> hosts;
      for (const Run& r : runs)
        for (const auto& pd : r.per_device)
          if (pd.process == static_cast<int>(hosts.size())) hosts.push_back(pd.host);
      return hosts;
    }();
    j["device_names"] = names;
    j["batch_per_device"] = o.batch;
    j["optimizer"] = o.optimizer;
    j["steps"] = o.steps;
    j["warmup"] = o.warmup;
    j["bucket_cap_mb"] = o.bucket_cap_mb;
    j["sync_bn"] = o.sync_bn;
    j["first_bucket_mb"] = o.first_bucket_mb;
    j["seed"] = o.seed;
    j["precision"] = o.precision;
    j["graphs_requested"] = o.graphs == "on";
    j["pipeline_requested"] = o.pipeline == "on";
    j["busy_time_available"] = records_spans(*rt, o);
    json rj = json::array();
    for (const Run& r : runs) rj.push_back(run_json(r));
    j["runs"] = rj;
    write_file(o.json_path, j);
    fmt::print("json: {}\n", o.json_path);
  }
  return job.agree(0).value_or(0);
}

}  // namespace

int bench_main(int argc, char** argv, dp::tools::Job& job) {
  CLI::App app{"dp_bench: DP vs DDP throughput and per-device imbalance (single, dp, ddp for each model)"};
  Options o;
  int devices = 0;
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
                 "strict (cuDNN: exact fp32, deterministic, fastest such algorithm) or fast (PyTorch's defaults: "
                 "fastest cuDNN algorithm, TF32 convolutions, nondeterministic); the sim computes the same for both")
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
  app.add_option("--models", o.models, "comma list of mlp, convnet, resnet8")->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "sgd (lr 0.01, momentum 0.9) or adamw (lr 1e-3, torch's defaults)")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--modes", o.modes, "comma list of single, dp, ddp")->capture_default_str();
  dp_cli::add_integer(app, "--batch-size", o.batch, "batch per device (dp's global batch = devices x this)")
      ->capture_default_str();
  dp_cli::add_integer(app, "--steps", o.steps, "measured steps per run")->capture_default_str();
  dp_cli::add_integer(app, "--warmup", o.warmup, "warm-up steps per run")->capture_default_str();
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DDP bucket cap, MiB")->capture_default_str();
  app.add_flag("--sync-bn", o.sync_bn, "ddp: SyncBatchNorm (BatchNorm statistics over all ranks' batches)");
  app.add_option("--first-bucket-mb", o.first_bucket_mb,
                 "DDP first bucket cap, MiB (both models fit in torch's default 1 MiB: lower it to see "
                 "all-reduce overlap backward)")
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write every figure as JSON to this file");
  app.add_option("--trace", o.trace_path, "write a Chrome/Perfetto trace of the measured steps to this file");
  dp_cli::add_integer(app, "--seed", o.seed, "seed of the synthetic data and the models' initialisation")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help: 0, on stdout; a bad command line: its message on stderr and 2, as every bad input.
    return app.exit(e) == 0 ? job.agree(dp::kStopWithoutError).value_or(0) : job.failed(2);
  }
  if (devices_opt->count() > 0) o.devices = devices;
  // Standard output is process 0's: the others' tables would be partial copies of it.
  if (!job.primary() && !std::freopen("/dev/null", "w", stdout)) return 1;
  int code = 0;
  try {
    code = run_bench(o, job);
  } catch (const dp::tools::PeerFailed& e) {
    code = e.code;
  } catch (const UsageError& e) {
    fmt::print(stderr, "dp_bench{}: {}\n", job.where(std::current_exception()), e.what());
    code = job.failed(2);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_bench: error{}: {}\n", job.where(std::current_exception()), e.what());
    code = job.failed(1);
  }
  return code;
}

int main(int argc, char** argv) {
  // The job first: under mpirun every way out, a bad command line included, goes through the
  // processes' agreement (an early exit would leave the others waiting for this one).
  dp::tools::Job job("dp_bench");
  try {
    job.start();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_bench: {}\n", e.what());
    return 2;
  }
  const int code = bench_main(argc, argv, job);
  job.end();
  return code;
}
