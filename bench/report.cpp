// report.cpp — dp_bench's output: four tables (runs, per device, host work, DP phases), the JSON
// report and the Chrome/Perfetto trace, the files written atomically.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "dp/io/atomic_file.h"
#include "dp/runtime/trace.h"

namespace dp_bench {

using json = nlohmann::json;

// The report's fields that are members of the same name; the others are written below.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Options, devices_per_gpu, batch_size, steps, warmup, bucket_cap_mb, first_bucket_mb,
                                   seed, precision)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Setup, backend, devices, processes, device_names, busy_time_available,
                                   core_round_trip_ns)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Recovery, model, mode, steps, device, step, devices, rebuild_ms, redone_step_ms,
                                   disturbed_ms, undisturbed_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Run, model, mode, devices, device_ids, batch_per_device, global_batch, param_count,
                                   tokens_per_sample, tokens_per_s, buffers_bytes, activation_bytes_per_sample,
                                   optimizer_state_bytes, gradient_bytes, samples_per_s, wall_ms, step_ms,
                                   step_ms_median, step_ms_p90, step_ms_p10, step_spread, step_ms_mean, loss_first,
                                   loss_last, graphs, pipelined, check_agreements_per_step, check_us_per_step,
                                   trace_offset_ms)

namespace {

// ---------------------------------------------------------------------------------------------
// figures over a run's devices

// f(device) for each of the run's devices, as doubles (f: a PerDevice member or a function of it).
template <class F>
std::vector<double> column(const Run& run, F f) {
  std::vector<double> v;
  for (const auto& pd : run.per_device) v.push_back(static_cast<double>(std::invoke(f, pd)));
  return v;
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

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

// Every device's busy %, or nothing when a device has none (no spans recorded).
std::optional<std::vector<double>> busy_pcts(const Run& run) {
  std::vector<double> v;
  for (const auto& pd : run.per_device) {
    if (!pd.busy_pct) return std::nullopt;
    v.push_back(*pd.busy_pct);
  }
  return v;
}

std::optional<double> busy_imbalance(const Run& run) {
  const auto v = busy_pcts(run);
  return v ? std::optional<double>(imbalance(*v)) : std::nullopt;
}

std::optional<double> busy_mean(const Run& run) {
  const auto v = busy_pcts(run);
  if (!v) return std::nullopt;
  double sum = 0;
  for (double x : *v) sum += x;
  return sum / static_cast<double>(run.per_device.size());
}

// A counter over the run's devices: summed, or the busiest device's (CounterFigure::summed).
double counter_total(const Run& run, const CounterFigure& f) {
  double total = 0;
  for (const auto& pd : run.per_device) total = f.summed ? total + pd.*f.member : std::max(total, pd.*f.member);
  return total;
}

// ---------------------------------------------------------------------------------------------
// tables

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string fixed(double v, int decimals) { return fmt::format("{:.{}f}", v, decimals); }

std::string opt(const std::optional<double>& v, int decimals) { return v ? fixed(*v, decimals) : std::string("n/a"); }

struct Column {
  const char* title;
  int width;  // as printf's: negative for a left-aligned (text) column
};

// The header, then one line per row: cells padded to their column's width, one space apart.
void print_table(const std::vector<Column>& columns, const std::vector<std::vector<std::string>>& rows) {
  const auto line = [&](const auto& cell_text) {
    std::string text;
    for (std::size_t i = 0; i < columns.size(); ++i) {
      const int width = columns[i].width;
      if (i > 0) text += ' ';
      text += width < 0 ? fmt::format("{:<{}}", cell_text(i), -width) : fmt::format("{:>{}}", cell_text(i), width);
    }
    fmt::print("{}\n", text);
  };
  line([&](std::size_t i) { return std::string(columns[i].title); });
  for (const auto& row : rows) line([&](std::size_t i) { return row[i]; });
}

void print_recovery(const Recovery& r) {
  fmt::print(
      "\nlost device (DP_FAULT): {} {}, device {} lost in step {} of {}: the survivors [{}] trained again {:.1f} ms "
      "after the failure (their state to the host, an engine on them, the state back) and redid the step in "
      "{:.1f} ms; the run took {:.1f} ms against {:.1f} ms undisturbed ({:+.1f} ms)\n",
      r.model, r.mode, r.device, r.step, r.steps, fmt::join(r.devices, ","), r.rebuild_ms, r.redone_step_ms,
      r.disturbed_ms, r.undisturbed_ms, r.disturbed_ms - r.undisturbed_ms);
}

void print_run_table(const std::vector<Run>& runs, const Setup& setup) {
  const bool have_spans = setup.busy_time_available;
  std::vector<std::vector<std::string>> rows;
  for (const Run& r : runs) {
    const auto traffic =
        column(r, [](const PerDevice& p) { return p.bytes_sent + p.bytes_received + p.net_sent + p.net_received; });
    const auto peak = column(r, &PerDevice::peak_bytes);
    rows.push_back({r.model,
                    r.mode,
                    fmt::format("{}", r.devices),
                    fmt::format("{}", r.global_batch),
                    fixed(r.samples_per_s, 1),
                    fixed(r.step_ms_median, 2),
                    fixed(r.step_ms_p90, 2),
                    fixed(r.step_spread, 2),
                    opt(r.scaling_efficiency, 2),
                    opt(busy_mean(r), 1),
                    opt(busy_imbalance(r), 2),
                    human_bytes(max_of(column(r, &PerDevice::bytes_sent))),
                    human_bytes(max_of(column(r, &PerDevice::bytes_received))),
                    human_bytes(max_of(column(r, [](const PerDevice& p) { return p.net_sent + p.net_received; }))),
                    fixed(imbalance(traffic), 2),
                    human_bytes(max_of(peak)),
                    fixed(imbalance(peak), 2),
                    human_bytes(static_cast<double>(r.activation_bytes_per_sample)),
                    human_bytes(static_cast<double>(r.optimizer_state_bytes)),
                    human_bytes(static_cast<double>(r.gradient_bytes))});
  }
  fmt::print("\n");
  const std::vector<Column> columns = {{"model", -8},     {"mode", -6},       {"dev", 3},        {"batch", 6},
                                       {"samples/s", 11}, {"step ms", 9},     {"p90 ms", 9},     {"spread", 6},
                                       {"scaling", 7},    {"busy %", 7},      {"imb", 5},        {"sent/step", 11},
                                       {"recv/step", 11}, {"net/step", 11},   {"imb", 5},        {"peak mem", 11},
                                       {"imb", 5},        {"act/sample", 11}, {"opt state", 11}, {"grads", 11}};
  print_table(columns, rows);
  fmt::print(
      "  batch = global samples per step; spread = p90 / p10 of the measured steps' times;\n"
      "  scaling = samples/s / (devices x samples/s of single);\n"
      "  busy % = mean over devices of the time covered by kernel/gemm/copy/collective spans{};\n"
      "  sent/recv = the busiest device's device-to-device bytes per step (intra-node); net = its bytes to and\n"
      "  from other processes (inter-node, under mpirun); imb = max/mean over devices; act/sample = what a\n"
      "  forward keeps for the backward, per sample (bf16 under --amp bf16); opt state = the optimizer state\n"
      "  a device keeps (--zero: its slice); grads = the gradient memory a device keeps (the model's\n"
      "  gradients; --zero 1: and its slice of them; --zero 2: its slice and the backward's bucket slots\n"
      "  instead; --grad-reduce bf16: and their bf16 copy)\n",
      have_spans ? "" : " (n/a: on cuda, spans are recorded with --profile or --trace)");
  for (const Run& r : runs)
    if (r.tokens_per_sample > 1)
      fmt::print("  {} {}: {} tokens per sample, {:.0f} tokens/s\n", r.model, r.mode, r.tokens_per_sample,
                 r.tokens_per_s);
  if (setup.backend == "sim") {
    // Simulated devices run on host threads: more devices than cores share them.
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    fmt::print(
        "  sim: {} simulated device(s) share {} host core(s): scaling cannot pass {:.2f}, busy % counts time\n"
        "  a device waits for a core as busy\n",
        setup.devices, cores, std::min(1.0, static_cast<double>(cores) / std::max(1, setup.devices)));
    if (setup.core_round_trip_ns > 0)
      fmt::print(
          "  sim: a cache line's round trip between devices 0 and 1's cores took {:.0f} ns (one L3: ~50-100; a VM\n"
          "  whose cores sit on two dies pays several hundred in every collective, and its DDP runs are slower)\n",
          setup.core_round_trip_ns);
  }
}

void print_device_table(const std::vector<Run>& runs) {
  std::vector<std::vector<std::string>> rows;
  for (const Run& r : runs)
    for (const auto& pd : r.per_device)
      rows.push_back({r.model, r.mode, fmt::format("{}", pd.process), fmt::format("{}", pd.device), opt(pd.busy_pct, 1),
                      opt(pd.gemm_ms_per_step, 2), opt(pd.model_gflops, 1), human_bytes(pd.bytes_sent),
                      human_bytes(pd.bytes_received), human_bytes(pd.net_sent), human_bytes(pd.net_received),
                      human_bytes(static_cast<double>(pd.peak_bytes))});
  fmt::print("\nper device\n");
  const std::vector<Column> columns = {{"model", -8},     {"mode", -6},     {"process", 7},     {"device", 6},
                                       {"busy %", 7},     {"gemm ms", 8},   {"model GF/s", 10}, {"sent/step", 12},
                                       {"recv/step", 12}, {"net sent", 12}, {"net recv", 12},   {"peak mem", 11}};
  print_table(columns, rows);
  fmt::print(
      "  gemm ms = GEMM span time per step; model GF/s = the device's share of the model's GEMM and convolution\n"
      "  FLOPs per step / the measured step time\n");
}

void print_host_work_table(const std::vector<Run>& runs) {
  std::vector<std::vector<std::string>> rows;
  for (const Run& r : runs) {
    std::vector<std::string> row = {r.model, r.mode};
    for (const auto& f : kCounterFigures) row.push_back(fixed(counter_total(r, f), 1));
    row.push_back(r.graphs ? "yes" : "no");
    row.push_back(fixed(r.check_agreements_per_step, 1));
    row.push_back(fixed(r.check_us_per_step, 1));
    rows.push_back(row);
  }
  fmt::print(
      "\nhost work per step (summed over devices; submits: the busiest device; a replayed graph is one launch;\n"
      "checks: the collectives' signature agreements, summed over this process's ranks, and their host us per rank,\n"
      "waiting for the last rank included: a captured call is checked once, its replays never)\n");
  // One column per kCounterFigures entry, in its order.
  const std::vector<Column> columns = {{"model", -8},       {"mode", -6},    {"launches", 9}, {"host syncs", 11},
                                       {"allocations", 12}, {"pageable", 9}, {"submits", 8},  {"graphs", 7},
                                       {"checks", 7},       {"check us", 9}};
  print_table(columns, rows);
}

void print_traffic_table(const std::vector<Run>& runs) {
  std::vector<std::vector<std::string>> rows;
  std::string gpu;
  for (const Run& r : runs) {
    if (!r.bytes_per_step || !r.roofline) continue;
    gpu = r.roofline->gpu;
    const double per_sample = *r.bytes_per_step * std::max(1, r.devices) / r.global_batch;
    std::string top;
    for (std::size_t i = 0; i < r.top_kernels.size() && i < 3; ++i)
      top += fmt::format("{}{} {:.0f}%", i ? ", " : "", r.top_kernels[i].kernel,
                         100.0 * static_cast<double>(r.top_kernels[i].bytes) / *r.bytes_per_step);
    rows.push_back({r.model, r.mode, human_bytes(*r.bytes_per_step), human_bytes(per_sample),
                    fixed(r.roofline->estimate_ms, 3), r.roofline->bound + " (" + r.roofline->peak + ")",
                    fixed(r.step_ms_median, 2), top});
  }
  if (rows.empty()) return;
  fmt::print("\nmemory traffic of one step (the busiest device; each launch's operands once) and its roofline on {}\n",
             gpu);
  const std::vector<Column> columns = {{"model", -8},       {"mode", -6},   {"bytes/step", 11},  {"bytes/sample", 12},
                                       {"roofline ms", 11}, {"bound", -16}, {"measured ms", 11}, {"top kernels", -1}};
  print_table(columns, rows);
  fmt::print("  roofline ms = max(bytes / HBM bandwidth, GEMM FLOPs / peak): a lower bound on that GPU, not a time\n");
}

void print_phase_table(const std::vector<Run>& runs) {
  std::vector<std::vector<std::string>> rows;
  for (const Run& r : runs) {
    if (!r.phases) continue;
    std::vector<std::string> row = {r.model};
    for (const auto& f : kPhases) row.push_back(fixed((*r.phases).*f.member, 2));
    row.push_back(fixed(r.step_ms_mean, 2));
    rows.push_back(row);
  }
  if (rows.empty()) return;
  fmt::print("\nDP phases, ms per step (mean over measured steps; per-device phases: the slowest device)\n");
  // One column per kPhases entry, in its order, then the whole step.
  const std::vector<Column> columns = {{"model", -8}, {"broadcast", 9}, {"scatter", 8}, {"forward", 8}, {"gather", 8},
                                       {"loss", 8},   {"backward", 9},  {"reduce", 8},  {"update", 8},  {"step", 8}};
  print_table(columns, rows);
}

// ---------------------------------------------------------------------------------------------
// JSON

template <class T>
json optional_json(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

// Exact integers where the per-step value is one (it is: every step moves the same bytes).
json bytes_json(double v) {
  if (v >= 0 && v == std::floor(v) && v < 9.0e15) return json(static_cast<std::uint64_t>(v));
  return json(v);
}

json device_json(const PerDevice& pd) {
  json j = {{"device", pd.device},
            {"process", pd.process},
            {"host", pd.host},
            {"samples_per_step", pd.samples_per_step},
            {"peak_bytes", pd.peak_bytes}};
  for (const auto& f : kSpanFigures) j[f.key] = optional_json(pd.*f.member);
  for (const auto& f : kByteFigures) j[f.key] = bytes_json(pd.*f.member);
  for (const auto& f : kCounterFigures) j[f.key] = pd.*f.member;
  return j;
}

json run_json(const Run& r) {
  json j = r;
  j["steps"] = r.step_ms.size();
  j["scaling_efficiency"] = optional_json(r.scaling_efficiency);
  j["ddp_buckets"] = optional_json(r.buckets);
  j["unchecked_samples_per_s"] = optional_json(r.unchecked_samples_per_s);
  j["unchecked_replicas_samples_per_s"] = optional_json(r.unchecked_replicas_samples_per_s);
  j["unshadowed_samples_per_s"] = optional_json(r.unshadowed_samples_per_s);
  j["gemm_flops_per_sample"] = r.gemm_flops_per_sample;
  j["busy_pct_mean"] = optional_json(busy_mean(r));
  j["per_device"] = json::array();
  for (const auto& pd : r.per_device) j["per_device"].push_back(device_json(pd));
  j["phases_ms"] = json::object();
  if (r.phases)
    for (const auto& f : kPhases) j["phases_ms"][f.name] = (*r.phases).*f.member;
  // Summed over the devices (worker submissions: per device only). With graphs, a step is one
  // launch per graph: DP's one graph spans every device, DDP has one per rank.
  for (const auto& f : kCounterFigures)
    if (f.summed) j[f.key] = counter_total(r, f);
  j["bytes_per_step"] = optional_json(r.bytes_per_step);
  j["bytes_per_sample"] = r.bytes_per_step ? json(*r.bytes_per_step * std::max(1, r.devices) / r.global_batch) : json();
  j["top_kernels"] = json::array();
  for (const auto& k : r.top_kernels)
    j["top_kernels"].push_back({{"kernel", k.kernel}, {"bytes", k.bytes}, {"launches", k.launches}});
  j["roofline"] = r.roofline ? json{{"gpu", r.roofline->gpu},
                                    {"peak", r.roofline->peak},
                                    {"memory_ms", r.roofline->memory_ms},
                                    {"compute_ms", r.roofline->compute_ms},
                                    {"estimate_ms", r.roofline->estimate_ms},
                                    {"bound", r.roofline->bound}}
                             : json();
  j["imbalance"] = {{"busy_pct", optional_json(busy_imbalance(r))},
                    {"bytes_sent", imbalance(column(r, &PerDevice::bytes_sent))},
                    {"bytes_received", imbalance(column(r, &PerDevice::bytes_received))},
                    {"peak_bytes", imbalance(column(r, &PerDevice::peak_bytes))}};
  return j;
}

// One entry per process, from a run across all of them.
std::vector<std::string> hosts(const std::vector<Run>& runs) {
  std::vector<std::string> out;
  for (const Run& r : runs)
    for (const auto& pd : r.per_device)
      if (pd.process == static_cast<int>(out.size())) out.push_back(pd.host);
  return out;
}

json report_json(const Options& o, const Setup& setup, const std::vector<Run>& runs,
                 const std::optional<Recovery>& recovery) {
  json j = o;
  // The named values as their flags spell them.
  j["amp"] = std::string(dp::to_string(o.amp));
  j["optimizer"] = std::string(dp::tools::to_string(o.optimizer));
  j["broadcast_buffers"] = o.broadcast_buffers ? "on" : "off";
  // The settings of one mode (--sync-bn, --grad-reduce), as given: a switch as a bool.
  for (const auto& flag : dp::tools::shared_flags<Options>().flags)
    if (!flag.applies_to.empty())
      j[dp::tools::tag_of(flag.name)] =
          flag.value.metavar.empty() ? json(flag.value.text(o) == "true") : json(flag.value.text(o));
  j.update(setup);
  j["hosts"] = hosts(runs);
  j["graphs_requested"] = o.graphs;
  j["pipeline_requested"] = o.pipeline;
  j["runs"] = json::array();
  for (const Run& r : runs) j["runs"].push_back(run_json(r));
  if (recovery) j["recovery"] = *recovery;
  return j;
}

// ---------------------------------------------------------------------------------------------
// trace: Chrome / Perfetto Trace Event Format. Runs are laid end to end in time (each run's
// measured window, then a gap), pid = device, tid = the runtime-wide stream id — each run makes its
// own streams, so a stream's track holds one run; every event's args name the run and the step.
// Event record/wait spans (kind "sync") are left out: a stream waiting is idle, and the gap shows it.

using Tracks = std::map<int, std::set<int>>;  // device -> streams that did work

// The spans of every run, with each run's offset set; timestamps from the first span.
json span_events(std::vector<Run>& runs, Tracks& tracks) {
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
  std::stable_sort(spans.begin(), spans.end(),
                   [](const json& a, const json& b) { return a["ts"].get<double>() < b["ts"].get<double>(); });
  for (auto& e : spans) e["ts"] = std::max(0.0, e["ts"].get<double>() - first_ts);
  return spans;
}

json metadata_event(const char* name, int pid, int tid, json args) {
  return {{"ph", "M"}, {"name", name}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}};
}

// Names and orders the tracks: one process per device, one thread per stream.
json track_events(const Tracks& tracks) {
  json events = json::array();
  for (const auto& [device, streams] : tracks) {
    events.push_back(metadata_event("process_name", device, 0, {{"name", fmt::format("device {}", device)}}));
    events.push_back(metadata_event("process_sort_index", device, 0, {{"sort_index", device}}));
    for (int stream : streams) {
      events.push_back(metadata_event("thread_name", device, stream, {{"name", fmt::format("stream {}", stream)}}));
      events.push_back(metadata_event("thread_sort_index", device, stream, {{"sort_index", stream}}));
    }
  }
  return events;
}

json trace_json(std::vector<Run>& runs) {
  Tracks tracks;
  json spans = span_events(runs, tracks);
  json events = track_events(tracks);
  for (auto& e : spans) events.push_back(std::move(e));
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

}  // namespace

void report(const Options& o, const Setup& setup, std::vector<Run>& runs, const std::optional<Recovery>& recovery) {
  const json trace = trace_json(runs);
  print_run_table(runs, setup);
  if (recovery) print_recovery(*recovery);
  print_device_table(runs);
  print_host_work_table(runs);
  print_phase_table(runs);
  print_traffic_table(runs);
  if (!o.trace_path.empty()) {
    write_file(o.trace_path, trace);
    fmt::print("\ntrace: {} (open in https://ui.perfetto.dev or chrome://tracing; runs laid end to end:", o.trace_path);
    for (const Run& r : runs) fmt::print(" {} {} at {:.1f} ms;", r.model, r.mode, r.trace_offset_ms);
    fmt::print(")\n");
    if (setup.processes > 1) fmt::print("  (the trace holds process 0's devices)\n");
  }
  if (!o.json_path.empty()) {
    write_file(o.json_path, report_json(o, setup, runs, recovery));
    fmt::print("json: {}\n", o.json_path);
  }
}

}  // namespace dp_bench
