// measure.cpp — runs one (model, mode): builds the engine and its pinned batches, times warm-up and
// measured steps, and turns counters, traffic and device spans into per-device figures.
#include "measure.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <utility>

#include "dp/engines/ddp.h"
#include "dp/engines/engine.h"
#include "dp/io/training_state.h"
#include "dp/models/registry.h"
#include "dp/nn/model.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/shape.h"

namespace dp_bench {
namespace {

// dp_bench's optimizer (--optimizer): SGD with lr 0.01 and momentum 0.9, or AdamW's defaults.
dp::OptimizerOptions bench_optimizer(const Options& o) {
  if (o.optimizer == dp::tools::OptimizerKind::adamw) return dp::AdamWOptions{1e-3};
  return dp::SgdOptions{0.01f, 0.9f};
}

using Submit = std::function<dp::StepLoss()>;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double ms_between(std::int64_t start_ns, std::int64_t end_ns) { return static_cast<double>(end_ns - start_ns) / 1e6; }

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

void synchronize(dp::Runtime& rt, const std::vector<int>& devices) {
  for (int d : devices) rt.device(d).synchronize();
}

// The host work counters taken around each submission only: the synchronisation that times a step
// is the benchmark's work, not the engine's.
class HostWork {
 public:
  HostWork(dp::Runtime& rt, const std::vector<int>& devices) : rt_(rt), devices_(devices), total_(devices.size()) {}

  void begin() {
    before_.clear();
    for (int d : devices_) before_.push_back(rt_.counters(d));
  }
  void end() {
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      const dp::DeviceCounters now = rt_.counters(devices_[i]);
      for (const auto& f : kCounterFigures) total_[i].*f.counter += now.*f.counter - before_[i].*f.counter;
    }
  }
  const dp::DeviceCounters& of(std::size_t i) const { return total_[i]; }

 private:
  dp::Runtime& rt_;
  const std::vector<int>& devices_;
  std::vector<dp::DeviceCounters> before_, total_;
};

// The first warm-up step's memory traffic, on the device that moves the most: that step is eager
// (a graph, if any, is captured at a later step), so every launch of a step is counted once.
void take_traffic(dp::Runtime& rt, const Options& o, Run& run) {
  std::vector<dp::KernelTraffic> busiest;
  double most = -1.0;
  for (int d : run.device_ids) {
    std::vector<dp::KernelTraffic> kernels = rt.memory_traffic(d);
    double bytes = 0;
    for (const auto& k : kernels) bytes += static_cast<double>(k.bytes);
    if (bytes > most) {
      most = bytes;
      busiest = std::move(kernels);
    }
  }
  run.bytes_per_step = most;
  run.top_kernels = std::move(busiest);
  const double samples = static_cast<double>(run.global_batch) / std::max(1, run.devices);
  run.roofline = roofline(gpu_peaks(o.roofline), most, run.gemm_flops_per_sample * samples, o.precision, o.amp);
}

void warm_up(dp::Runtime& rt, const Options& o, Run& run, const Submit& submit, dp::ProcessGroup* processes) {
  for (int i = 0; i < o.warmup; ++i) {
    if (i == 0) rt.reset_memory_traffic();
    (void)submit().get();
    synchronize(rt, run.device_ids);
    if (i == 0) take_traffic(rt, o, run);
  }
  synchronize(rt, run.device_ids);
  if (processes) processes->barrier();  // every process starts its measured window together
}

// Clears what the measured window counts (traffic, host work, peak memory, earlier spans) and turns
// span recording on where it is wanted; returns whether it is.
bool open_window(dp::Runtime& rt, const Options& o, const Run& run) {
  rt.reset_link_traffic();
  rt.reset_counters();
  for (int d : run.device_ids) rt.device(d).reset_peak_memory();
  rt.take_trace();
  const bool have_spans = records_spans(rt, o);
  rt.set_profiling(have_spans);
  return have_spans;
}

// The measured steps; fills step_starts, step_ms and the window's end t1.
std::vector<dp::StepLoss> run_steps(dp::Runtime& rt, const Options& o, Run& run, const Submit& submit,
                                    const std::function<void()>& after_step, HostWork& work) {
  std::vector<dp::StepLoss> losses;
  for (int i = 0; i < o.steps; ++i) {
    const std::int64_t start = now_ns();
    run.step_starts.push_back(start);
    if (run.pipelined && i > 0) run.step_ms.push_back(ms_between(run.step_starts[run.step_starts.size() - 2], start));
    work.begin();
    losses.push_back(submit());
    if (!run.pipelined) (void)losses.back().get();  // the step's one host wait, counted as the engine's
    work.end();
    if (run.pipelined) continue;
    synchronize(rt, run.device_ids);  // a step ends when every device has finished it
    const std::int64_t end = now_ns();
    run.step_ms.push_back(ms_between(start, end));
    run.t1 = end;
    if (after_step) after_step();
  }
  if (run.pipelined) {
    synchronize(rt, run.device_ids);
    run.t1 = now_ns();
    run.step_ms.push_back(ms_between(run.step_starts.back(), run.t1));
  }
  return losses;
}

void summarise_steps(const Options& o, Run& run) {
  run.wall_ms = ms_between(run.t0, run.t1);
  run.samples_per_s = static_cast<double>(run.global_batch) * o.steps / (run.wall_ms / 1e3);
  run.tokens_per_s = run.samples_per_s * run.tokens_per_sample;
  run.step_ms_median = median(run.step_ms);
  run.step_ms_p90 = percentile(run.step_ms, 0.9);
  run.step_ms_p10 = percentile(run.step_ms, 0.1);
  run.step_spread = run.step_ms_p10 > 0 ? run.step_ms_p90 / run.step_ms_p10 : 0;
  double sum = 0;
  for (double t : run.step_ms) sum += t;
  run.step_ms_mean = sum / static_cast<double>(run.step_ms.size());
}

PerDevice device_figures(dp::Runtime& rt, const Options& o, const Run& run, int d, const dp::DeviceCounters& work,
                         dp::ProcessGroup* processes) {
  PerDevice pd;
  pd.device = d;
  pd.process = processes ? processes->rank() : 0;
  pd.host = processes ? processes->host() : std::string();
  pd.bytes_sent = static_cast<double>(rt.bytes_sent(d)) / o.steps;
  pd.bytes_received = static_cast<double>(rt.bytes_received(d)) / o.steps;
  pd.net_sent = static_cast<double>(rt.link_traffic(d, dp::kNetwork).bytes) / o.steps;
  pd.net_received = static_cast<double>(rt.link_traffic(dp::kNetwork, d).bytes) / o.steps;
  pd.peak_bytes = rt.device(d).memory().peak;
  for (const auto& f : kCounterFigures) pd.*f.member = static_cast<double>(work.*f.counter) / o.steps;
  pd.samples_per_step = run.batch_per_device;  // dp corrects it from its chunks
  return pd;
}

// Busy time and GEMM time need the stream spans: without them (cuda without --profile) they stay
// null ("n/a").
void add_span_figures(const Run& run, int steps, PerDevice& pd) {
  std::vector<std::pair<std::int64_t, std::int64_t>> busy, gemm;
  for (const auto& s : run.spans) {
    if (s.device != pd.device) continue;
    if (dp::is_busy(s.kind)) busy.emplace_back(s.start_ns, s.end_ns);
    if (s.kind == dp::SpanKind::gemm) gemm.emplace_back(s.start_ns, s.end_ns);
  }
  pd.busy_pct = 100.0 * static_cast<double>(union_ns(busy, run.t0, run.t1)) / static_cast<double>(run.t1 - run.t0);
  const double gemm_ns = static_cast<double>(union_ns(gemm, run.t0, run.t1));
  pd.gemm_ms_per_step = gemm_ns / 1e6 / steps;
  // Over the window's wall time: a pipelined step's interval between submissions is not its work.
  if (run.wall_ms > 0) pd.model_gflops = run.gemm_flops_per_sample * pd.samples_per_step * steps / (run.wall_ms * 1e6);
}

// Warm-up, then the measured steps with profiling on and the counters reset; fills the timing,
// traffic, memory and span fields of `run`. Pipelined (--pipeline on, and no `after_step`), each
// measured step is submitted as soon as the previous submission returned, as a training loop that
// does not read every loss runs: the host stages the next batch while the devices run this step,
// and a step's time is the time between two submissions (the last one's: until every device has
// finished). Otherwise each step waits for its loss and for every device, and `after_step` runs
// then (DP reads its phase times there).
void measure(dp::Runtime& rt, const Options& o, Run& run, const Submit& submit, const std::function<void()>& after_step,
             dp::ProcessGroup* processes) {
  warm_up(rt, o, run, submit, processes);
  const bool have_spans = open_window(rt, o, run);
  run.pipelined = o.pipeline && !after_step;
  run.t0 = now_ns();
  HostWork work(rt, run.device_ids);
  const dp::CollectiveCheckTotals checks_before = dp::collective_check_totals();
  const std::vector<dp::StepLoss> losses = run_steps(rt, o, run, submit, after_step, work);
  run.loss_first = losses.front().get();
  run.loss_last = losses.back().get();
  const dp::CollectiveCheckTotals checks_after = dp::collective_check_totals();
  const double steps = std::max(1, o.steps);
  run.check_agreements_per_step = static_cast<double>(checks_after.agreements - checks_before.agreements) / steps;
  run.check_us_per_step = static_cast<double>(checks_after.ns - checks_before.ns) * 1e-3 / steps /
                          static_cast<double>(std::max<std::size_t>(1, run.device_ids.size()));
  rt.set_profiling(false);
  run.spans = rt.take_trace();
  summarise_steps(o, run);
  for (std::size_t i = 0; i < run.device_ids.size(); ++i) {
    PerDevice pd = device_figures(rt, o, run, run.device_ids[i], work.of(i), processes);
    if (have_spans) add_span_figures(run, o.steps, pd);
    run.per_device.push_back(pd);
  }
}

// PerDevice as plain bytes for the gather; NaN for a span figure that is not available.
struct Wire {
  int device, process, samples;
  double spans[kSpanFigures.size()], bytes[kByteFigures.size()], counters[kCounterFigures.size()];
  std::uint64_t peak;
  char host[64];
};

Wire to_wire(const PerDevice& pd) {
  Wire w;
  std::memset(&w, 0, sizeof(w));  // no uninitialised padding goes out
  w.device = pd.device;
  w.process = pd.process;
  w.samples = pd.samples_per_step;
  const double none = std::numeric_limits<double>::quiet_NaN();
  for (std::size_t i = 0; i < kSpanFigures.size(); ++i) w.spans[i] = (pd.*kSpanFigures[i].member).value_or(none);
  for (std::size_t i = 0; i < kByteFigures.size(); ++i) w.bytes[i] = pd.*kByteFigures[i].member;
  for (std::size_t i = 0; i < kCounterFigures.size(); ++i) w.counters[i] = pd.*kCounterFigures[i].member;
  w.peak = pd.peak_bytes;
  std::snprintf(w.host, sizeof(w.host), "%s", pd.host.c_str());
  return w;
}

PerDevice from_wire(const Wire& w) {
  PerDevice pd;
  pd.device = w.device;
  pd.process = w.process;
  pd.host = w.host;
  pd.samples_per_step = w.samples;
  for (std::size_t i = 0; i < kSpanFigures.size(); ++i)
    if (!std::isnan(w.spans[i])) pd.*kSpanFigures[i].member = w.spans[i];
  for (std::size_t i = 0; i < kByteFigures.size(); ++i) pd.*kByteFigures[i].member = w.bytes[i];
  for (std::size_t i = 0; i < kCounterFigures.size(); ++i) pd.*kCounterFigures[i].member = w.counters[i];
  pd.peak_bytes = w.peak;
  return pd;
}

// Every process's per-device figures, in process order, on every process.
void gather_devices(Run& run, dp::ProcessGroup& processes) {
  std::vector<Wire> mine;
  for (const PerDevice& pd : run.per_device) mine.push_back(to_wire(pd));
  run.per_device.clear();
  for (const Wire& w : processes.all_gather(std::span<const Wire>(mine))) run.per_device.push_back(from_wire(w));
}

// --batch-size as torch means it: DataParallel's is the global batch, chunked over the devices
// (torch.chunk: ceil(B / N) rows for the first devices); DDP's is each rank's.
Run new_run(const Options& o, const std::string& model, dp::EngineKind kind, int used, int processes) {
  Run run;
  run.model = model;
  run.mode = dp::to_string(kind);
  for (int d = 0; d < used; ++d) run.device_ids.push_back(d);
  run.devices = used * processes;
  if (o.shards > 0) {  // --batch-size per shard, in every mode
    run.global_batch = o.batch_size * o.shards;
    run.batch_per_device = run.global_batch / run.devices;
    run.mode += fmt::format("/{}", o.shards);
  } else if (kind == dp::EngineKind::dp) {
    run.global_batch = o.batch_size;
    run.batch_per_device = (o.batch_size + run.devices - 1) / run.devices;
  } else {
    run.batch_per_device = o.batch_size;
    run.global_batch = o.batch_size * run.devices;
  }
  return run;
}

dp::EngineOptions engine_options(const Options& o, dp::EngineKind kind, const Run& run,
                                 std::shared_ptr<dp::ProcessGroup> processes) {
  dp::EngineOptions options;
  options.kind = kind;
  options.device_ids = run.device_ids;
  options.output_device = kind == dp::EngineKind::dp && o.shards == 0 ? std::optional<int>(0) : std::nullopt;
  dp::tools::set_engine_options(o, options, flag_groups());
  // Phase times come from events between the phases, which a replayed graph does not record.
  options.time_phases = kind == dp::EngineKind::dp && !options.graphs;
  options.processes = std::move(processes);
  return options;
}

// The global batch as the engine takes it: whole (single, DP) or one shard per rank (DDP: this
// process's ranks). In pinned host memory and lent to the engine (Batch::lease), as dp_train's
// loader hands them out: the engine copies them to the devices asynchronously, straight from where
// they are.
std::vector<dp::Batch> pinned_batches(dp::Runtime& rt, dp::Engine& engine, const Data& data, int global_batch) {
  const int pieces = engine.batches_per_step(), piece = global_batch / engine.world_size();
  const std::size_t rows = static_cast<std::size_t>(pieces) * static_cast<std::size_t>(piece);
  // The data holds the largest sample of the models measured: this model's samples are its first
  // elements, read as consecutive samples of its own size.
  const std::size_t elements = dp::numel(engine.model().input_shape());
  if (elements > data.sample_floats)
    throw dp::InvalidArgument(
        fmt::format("the synthetic data's samples have {} values, the model's {}", data.sample_floats, elements));
  struct Pinned {
    dp::PinnedBuffer inputs, labels;
  };
  const auto targets = static_cast<std::size_t>(engine.model().targets_per_sample());
  const dp::DType dtype = engine.model().input_dtype();
  auto pinned = std::make_shared<Pinned>();
  pinned->inputs = rt.allocate_pinned(rows * elements * dp::dtype_size(dtype));
  pinned->labels = rt.allocate_pinned(rows * targets * sizeof(std::int64_t));
  auto* labels = pinned->labels.as<std::int64_t>();
  if (dtype == dp::DType::f32) std::memcpy(pinned->inputs.data(), data.inputs.data(), pinned->inputs.size());
  if (targets == 1) std::memcpy(labels, data.labels.data(), pinned->labels.size());
  // A sequence model's token ids are the data's values in [0, 1) scaled to the vocabulary, and each
  // position's target is the next token, as in a text's windows.
  const auto vocab = static_cast<float>(engine.model().output_features());
  const auto token = [&](std::size_t i) {
    return static_cast<std::int32_t>(data.inputs[i % (rows * elements)] * vocab);
  };
  if (dtype == dp::DType::i32)
    for (std::size_t i = 0; i < rows * elements; ++i) pinned->inputs.as<std::int32_t>()[i] = token(i);
  if (targets > 1)
    for (std::size_t i = 0; i < rows * targets; ++i) labels[i] = token(i + 1);
  const dp::Inputs inputs{pinned->inputs.data(), dtype};
  std::vector<dp::Batch> batches;
  for (int i = 0; i < pieces; ++i) {
    const std::size_t row = static_cast<std::size_t>(i) * static_cast<std::size_t>(piece);
    // Never written again: the lease only keeps the memory alive while a copy may read it.
    batches.push_back(dp::Batch{inputs.advanced(row * elements), labels + row * targets, piece, pinned});
  }
  return batches;
}

// DataParallel's phase times, summed over the measured steps.
struct PhaseSum {
  dp::DataParallelPhases sum;
  int steps = 0;

  void add(const dp::DataParallelPhases& p) {
    for (const auto& f : kPhases) sum.*f.member += p.*f.member;
    ++steps;
  }
  std::optional<dp::DataParallelPhases> mean() const {
    if (steps == 0) return std::nullopt;
    dp::DataParallelPhases m;
    for (const auto& f : kPhases) m.*f.member = sum.*f.member / static_cast<double>(steps);
    return m;
  }
};

// torch.chunk rules: with a small global batch some devices get fewer rows (or none).
void apply_chunks(const std::vector<int>& chunks, Run& run) {
  for (std::size_t i = 0; i < run.per_device.size(); ++i) {
    auto& pd = run.per_device[i];
    pd.samples_per_step = i < chunks.size() ? chunks[i] : 0;
    if (pd.model_gflops && pd.samples_per_step != run.batch_per_device)
      pd.model_gflops = *pd.model_gflops * pd.samples_per_step / run.batch_per_device;
  }
}

}  // namespace

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

Run bench(dp::Runtime& rt, const Options& o, const std::string& model_name, const std::string& mode, const Data& data,
          int devices, const std::shared_ptr<dp::ProcessGroup>& processes) {
  const dp::EngineKind kind = dp::parse_engine_kind(mode);
  const bool across = kind == dp::EngineKind::ddp && processes->size() > 1;
  Run run = new_run(o, model_name, kind, kind == dp::EngineKind::single ? 1 : devices, across ? processes->size() : 1);
  auto model = model_spec(model_name).build(rt.device(0), model_args(o, model_name), o.seed);
  run.param_count = model->param_count();
  run.tokens_per_sample = model->targets_per_sample();
  run.gemm_flops_per_sample = model_spec(model_name).gemm_flops_per_sample(model_args(o, model_name));
  run.buffers_bytes = model->buffers_bytes();
  const dp::EngineOptions options = engine_options(o, kind, run, across ? processes : nullptr);
  const dp::OptimizerOptions optimizer = bench_optimizer(o);
  auto engine = dp::make_engine(rt, *model, optimizer, options);
  const std::vector<dp::Batch> batches = pinned_batches(rt, *engine, data, run.global_batch);

  // DataParallel also reports where its step time goes, and how it chunked the batch.
  auto* parallel = dynamic_cast<dp::DataParallel*>(engine.get());
  PhaseSum phases;
  std::function<void()> after_step;
  if (parallel && options.time_phases) after_step = [&] { phases.add(parallel->last_phases()); };
  measure(
      rt, o, run, [&] { return engine->submit_step(batches); }, after_step, across ? processes.get() : nullptr);
  run.graphs = engine->graph_replays() >= static_cast<std::uint64_t>(o.steps);
  engine->synchronize();
  run.activation_bytes_per_sample =
      engine->model().saved_activation_bytes() / static_cast<std::size_t>(run.batch_per_device);
  run.gradient_bytes = engine->gradient_bytes();
  for (const dp::Optimizer* optimizer : engine->optimizers())
    run.optimizer_state_bytes =
        std::max(run.optimizer_state_bytes, optimizer->state().size() * optimizer->param_count() * sizeof(float));
  if (across) gather_devices(run, *processes);
  if (const auto* ddp = dynamic_cast<const dp::DistributedDataParallel*>(engine.get()))
    run.buckets = ddp->buckets().size();
  if (!parallel) return run;
  run.phases = phases.mean();
  apply_chunks(parallel->last_chunks(), run);
  return run;
}

Recovery measure_recovery(const Options& o, const std::string& model_name, const std::string& mode, const Data& data,
                          int devices) {
  using clock = std::chrono::steady_clock;
  const auto ms = [](clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  Recovery out;
  out.model = model_name;
  out.mode = fmt::format("{}/{}", mode, o.shards);
  out.steps = o.warmup + o.steps;
  const dp::EngineKind kind = dp::parse_engine_kind(mode);
  const dp::OptimizerOptions optimizer = bench_optimizer(o);
  const auto one_run = [&](bool disturbed) {
    int count = devices;
    auto rt = make_runtime(o, count, true);  // one process: dp_bench refuses lose faults in several
    Run run = new_run(o, model_name, kind, devices, 1);
    auto model = model_spec(model_name).build(rt->device(0), model_args(o, model_name), o.seed);
    dp::EngineOptions options = engine_options(o, kind, run, nullptr);
    auto engine = dp::make_engine(*rt, *model, optimizer, options);
    std::vector<dp::Batch> batches = pinned_batches(*rt, *engine, data, run.global_batch);
    const auto start = clock::now();
    for (int k = 0; k < out.steps; ++k) {
      try {
        (void)engine->train_step(batches);
      } catch (const dp::Error&) {
        // Lost: the survivors take the state of the last step they hold whole and redo this one.
        const auto failed = clock::now();
        for (const int id : run.device_ids)
          if (rt->device(id).lost()) out.device = id;
        if (!disturbed || out.device < 0) throw;
        out.step = k + 1;
        batches.clear();
        std::optional<dp::Survivors> survivors = dp::go_on_without_lost(
            *rt, std::move(engine),
            [&](dp::Device& device) { return model_spec(model_name).build(device, model_args(o, model_name), o.seed); },
            optimizer, options);
        if (!survivors) throw;
        model = std::move(survivors->model);
        engine = std::move(survivors->engine);
        batches = pinned_batches(*rt, *engine, data, run.global_batch);
        out.devices = survivors->devices;
        const auto rebuilt = clock::now();
        (void)engine->train_step(batches);
        out.rebuild_ms = ms(rebuilt - failed);
        out.redone_step_ms = ms(clock::now() - rebuilt);
      }
    }
    engine->synchronize();
    return ms(clock::now() - start);
  };
  out.disturbed_ms = one_run(true);
  if (out.device < 0)
    throw UsageError(
        fmt::format("DP_FAULT's lose fault did not fire in {} steps of {} {} (its step is counted "
                    "from 1 over --warmup and --steps)",
                    out.steps, model_name, out.mode));
  out.undisturbed_ms = one_run(false);
  return out;
}

double core_round_trip_ns(dp::Runtime& rt) {
  if (rt.backend() != dp::Backend::sim || rt.device_count() < 2) return 0;
  // Batches of trips, the fastest batch kept: a batch that a preemption or a page fault slowed
  // says nothing about the cores.
  constexpr int kBatches = 20, kTrips = 1000;
  struct alignas(64) Line {
    std::atomic<int> value{0};
    std::atomic<bool> gave_up{false};
  };
  auto line = std::make_shared<Line>();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
  // Spins until the line holds `want`; false once the deadline passed (both devices on one core
  // spin in turns of the scheduler's slice, and the peer then stops as well).
  const auto await = [line, deadline](int want) {
    for (unsigned spins = 0;; ++spins) {
      if (line->value.load(std::memory_order_acquire) == want) return true;
      if (line->gave_up.load(std::memory_order_relaxed)) return false;
      if (spins % 1024 == 1023 && std::chrono::steady_clock::now() > deadline) {
        line->gave_up.store(true, std::memory_order_relaxed);
        return false;
      }
    }
  };
  auto fastest = std::make_shared<double>(0);
  auto ping = rt.device(0).submit([line, await, fastest] {
    int n = 0;
    for (int batch = 0; batch < kBatches; ++batch) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < kTrips; ++i, ++n) {
        line->value.store(2 * n + 1, std::memory_order_release);
        if (!await(2 * n + 2)) return;
      }
      const double ns =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kTrips;
      if (*fastest == 0 || ns < *fastest) *fastest = ns;
    }
  });
  auto pong = rt.device(1).submit([line, await] {
    for (int n = 0; n < kBatches * kTrips; ++n) {
      if (!await(2 * n + 1)) return;
      line->value.store(2 * n + 2, std::memory_order_release);
    }
  });
  ping.get();
  pong.get();
  return *fastest;
}

}  // namespace dp_bench
