// dp_bench.cpp — the project's main job: DP vs DDP throughput and per-device load imbalance, each
// model run as single, dp and ddp on synthetic data (the README says what every figure means).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "address_space.h"
#include "dp/io/atomic_file.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/flight_record.h"
#include "dp_cli.h"
#include "dp_job.h"
#include "measure.h"
#include "options.h"
#include "report.h"

namespace dp_bench {
namespace {

// Fails on an unwritable output before minutes are spent on the runs (process 0 writes them).
void check_outputs(const Options& o, const dp::tools::Job& job) {
  if (dp_cli::same_file(o.json_path, o.trace_path))
    throw UsageError(fmt::format("--json and --trace name the same file {}", o.json_path));
  for (const auto* path : {&o.json_path, &o.trace_path}) {
    if (path->empty() || !job.primary()) continue;
    try {
      dp::check_writable(*path);
    } catch (const dp::Error& e) {
      throw UsageError(fmt::format("cannot write {}", e.what()));
    }
  }
}

std::unique_ptr<dp::Runtime> open_runtime(const Options& o, dp::tools::Job& job, Setup& setup) {
  auto rt = make_runtime(o, setup.devices, !job.several());
  setup.backend = dp::to_string(rt->backend());
  setup.processes = job.processes()->size();
  setup.busy_time_available = records_spans(*rt, o);
  setup.core_round_trip_ns = core_round_trip_ns(*rt);
  std::vector<int> ids;
  for (int d = 0; d < setup.devices; ++d) {
    setup.device_names.push_back(rt->device(d).name());
    ids.push_back(d);
  }
  job.set_devices(ids);
  return rt;
}

void print_banner(const Options& o, const Setup& setup, const dp::tools::Job& job) {
  fmt::print(
      "dp_bench: backend {} (precision {}, autocast {}, graphs {}, pipeline {}), {} device(s) [{}]{}, batch {} "
      "(single, dp: global; ddp: per device), {} warm-up + {} measured steps, DDP buckets {} MiB (first {} MiB)\n",
      setup.backend, o.precision, dp::to_string(o.amp), o.graphs ? "on" : "off", o.pipeline ? "on" : "off",
      setup.devices, fmt::join(setup.device_names, ", "),
      job.several() ? fmt::format(" in each of {} processes (single and dp: process 0 alone)", setup.processes) : "",
      o.batch_size, o.warmup, o.steps, o.bucket_cap_mb, o.first_bucket_mb);
  std::fflush(stdout);
}

// The synthetic inputs of DDP's global batch (the largest any mode takes), generated once: refused
// (exit 2, with the figure) before anything is allocated when they cannot exist.
Data synthetic_data(const Options& o, int devices, const std::vector<std::string>& models) {
  std::size_t floats = 0;
  for (const std::string& model : models)
    floats = std::max(floats, model_spec(model).input_elements(model_args(o, model)));
  const int pieces = std::max(devices, o.shards);  // --shards: a batch per shard
  const std::uint64_t global = static_cast<std::uint64_t>(o.batch_size) * static_cast<std::uint64_t>(pieces);
  if (global > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    throw UsageError(fmt::format("--batch-size {} x {} {}: a global batch of {} samples is more than {}", o.batch_size,
                                 pieces, o.shards > devices ? "shards" : "devices", global,
                                 std::numeric_limits<int>::max()));
  const std::uint64_t data_bytes = global * (floats * sizeof(float) + sizeof(std::int64_t));
  if (const std::uint64_t host = dp::Runtime::host_memory_bytes(); host > 0 && data_bytes > host)
    throw UsageError(fmt::format("--batch-size {}: the synthetic inputs alone need {:.1f} GiB, the host has {:.1f} GiB",
                                 o.batch_size, static_cast<double>(data_bytes) / (1u << 30),
                                 static_cast<double>(host) / (1u << 30)));
  return make_data(o.batch_size * pieces, floats, o.seed);
}

// Every process is ready (or all stop with the first failing one's exit code), with one
// configuration (each one's devices and flags: their runs meet in collectives).
void agree_to_start(const dp::tools::Job& job, const Options& o, const Setup& setup,
                    const std::vector<std::string>& models, const std::vector<std::string>& modes) {
  job.agree_or_stop();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"backend", setup.backend},
      {"devices per process", fmt::format("{}", setup.devices)},
      {"--models", fmt::format("{}", fmt::join(models, ","))},
      {"--modes", fmt::format("{}", fmt::join(modes, ","))},
      {"--warmup", fmt::format("{}", o.warmup)},
      {"buckets", fmt::format("{} {}", o.bucket_cap_mb, o.first_bucket_mb)},
      {"--broadcast-buffers", o.broadcast_buffers ? "on" : "off"}};
  for (auto& field : dp::tools::shared_configuration(o)) fields.push_back(std::move(field));
  job.agree_on_configuration(fields);
}

// --check-cost: `run` (ddp, just measured) against the same run without each check it holds, in
// alternation, compared by their medians; the unchecked figures go into `run`.
void measure_check_costs(dp::Runtime& rt, const Options& o, const std::string& model, const std::string& mode,
                         const Data& data, int devices, const dp::tools::Job& job, Run& run) {
  // The same run with the collectives' signature check off and on again, in alternation (three
  // of each, the first checked one above; every process alike), compared by their medians: one
  // pair alone is within a small host's run-to-run noise.
  const bool was = dp::collectives_checked();
  std::vector<double> checked{run.samples_per_s}, unchecked;
  for (int k = 0; k < 3; ++k) {
    dp::set_collectives_checked(false);
    unchecked.push_back(bench(rt, o, model, mode, data, devices, job.processes()).samples_per_s);
    dp::set_collectives_checked(was);
    if (k < 2) checked.push_back(bench(rt, o, model, mode, data, devices, job.processes()).samples_per_s);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double on = median(checked), off = median(unchecked);
  run.unchecked_samples_per_s = off;
  fmt::print(
      "  {:<8} the collectives' check costs {:+.1f}% of ddp's time per sample (medians of 3: {:.1f} "
      "samples/s checked, {:.1f} unchecked)\n",
      model, 100.0 * (off / std::max(on, 1e-9) - 1.0), on, off);
  // A check that runs every N steps the same way, against the run `without` it, where a measured
  // window holds one: the replicas' fingerprints (--check-replicas N), shadow shards (--shadow-shards K).
  const auto cost = [&](const Options& without, const std::string& what) {
    std::vector<double> with_check, without_check;
    for (int k = 0; k < 3; ++k) {
      without_check.push_back(bench(rt, without, model, mode, data, devices, job.processes()).samples_per_s);
      with_check.push_back(bench(rt, o, model, mode, data, devices, job.processes()).samples_per_s);
    }
    const double a = median(with_check), b = median(without_check);
    fmt::print(
        "  {:<8} {} costs {:+.1f}% of ddp's time per sample (medians of 3: {:.1f} samples/s checked, {:.1f} "
        "unchecked)\n",
        model, what, 100.0 * (b / std::max(a, 1e-9) - 1.0), a, b);
    return b;
  };
  if (o.check_replicas > 0 && o.steps >= o.check_replicas) {
    Options without = o;
    without.check_replicas = 0;
    run.unchecked_replicas_samples_per_s =
        cost(without, fmt::format("the replicas' check every {} step(s)", o.check_replicas));
  }
  if (o.shadow_shards > 0 && o.shards > 0 && o.steps >= o.shadow_shards) {
    Options without = o;
    without.shadow_shards = 0;
    run.unshadowed_samples_per_s = cost(without, fmt::format("shadow shards every {} step(s)", o.shadow_shards));
  }
}

// Under mpirun (one process per node, --devices K each), ddp runs over every process's devices and
// every device's figures end up on process 0, the traffic split into intra-node (between the
// devices of one process) and inter-node (between processes) bytes. single and dp are
// single-process by definition: process 0 runs them while the others wait (without the
// collectives' timeout: those runs may take long) until all start ddp.
std::vector<Run> run_all(dp::Runtime& rt, const Options& o, const std::vector<std::string>& models,
                         const std::vector<std::string>& modes, const Data& data, int devices,
                         const dp::tools::Job& job) {
  std::vector<Run> runs;
  for (const auto& model : models) {
    for (const auto& mode : modes) {
      if (mode != "ddp" && !job.primary()) continue;
      if (mode == "ddp") job.agree_or_stop();
      // --shards: ddp is measured without them too, in the same run, for the cost of fixed shards.
      Options plain = o;
      plain.shards = 0;
      plain.shadow_shards = 0;  // checks fixed shards: plain ddp has none
      const bool against_plain = o.shards > 0 && mode == "ddp";
      if (against_plain) runs.push_back(bench(rt, plain, model, mode, data, devices, job.processes()));
      runs.push_back(bench(rt, o, model, mode, data, devices, job.processes()));
      for (std::size_t k = runs.size() - (against_plain ? 2 : 1); k < runs.size(); ++k) {
        const Run& r = runs[k];
        fmt::print("  {:<8} {:<6} {:>10.1f} samples/s  (median step {:.2f} ms)\n", r.model, r.mode, r.samples_per_s,
                   r.step_ms_median);
      }
      if (o.check_cost && mode == "ddp") measure_check_costs(rt, o, model, mode, data, devices, job, runs.back());
      if (against_plain) {
        const Run &base = runs[runs.size() - 2], &sharded = runs.back();
        fmt::print("  {:<8} {} costs {:.2f}x plain ddp's time per sample (global batches {} and {})\n", model,
                   sharded.mode, base.samples_per_s / std::max(sharded.samples_per_s, 1e-9), sharded.global_batch,
                   base.global_batch);
      }
      std::fflush(stdout);
    }
  }
  return runs;
}

void set_scaling_efficiency(std::vector<Run>& runs) {
  for (Run& r : runs) {
    for (const Run& s : runs)
      if (s.model == r.model && s.mode == "single" && s.samples_per_s > 0)
        r.scaling_efficiency = r.samples_per_s / (static_cast<double>(r.devices) * s.samples_per_s);
  }
}

int run_bench(const Options& o, dp::tools::Job& job) {
  const auto models = dp::tools::split_list(o.models);
  const auto modes = dp::tools::split_list(o.modes);
  if (const std::string why = dp::tools::misapplied_flag(o, modes); !why.empty()) throw UsageError(why);
  check_outputs(o, job);
  Setup setup;
  const auto rt = open_runtime(o, job, setup);
  print_banner(o, setup, job);
  const Data data = synthetic_data(o, setup.devices, models);
  agree_to_start(job, o, setup, models, modes);
  job.collectives_begin();
  // A lost device planned: the first model and mode lose it and go on, against the same run
  // undisturbed, before the other runs (the fault is spent then).
  std::optional<Recovery> recovery;
  if (dp::FaultPlan::from_environment().has(dp::FaultKind::lose)) {
    if (o.shards == 0 || job.several())
      throw UsageError(
          "DP_FAULT=lose@...: dp_bench measures how a run goes on without the device, which needs --shards V and one "
          "process (without them a lost device ends the run)");
    recovery = measure_recovery(o, models.front(), modes.front(), data, setup.devices);
  }
  std::vector<Run> runs = run_all(*rt, o, models, modes, data, setup.devices, job);
  set_scaling_efficiency(runs);
  job.processes()->barrier();  // process 0's single and dp runs are over
  job.collectives_end();
  if (job.primary()) report(o, setup, runs, recovery);
  return job.agree(0).value_or(0);
}

int bench_main(int argc, char** argv, dp::tools::Job& job) {
  Options o;
  if (const auto code = parse_command_line(argc, argv, o, job)) return *code;
  // Standard output is process 0's: the others' tables would be partial copies of it.
  if (!job.primary() && !std::freopen("/dev/null", "w", stdout)) return 1;
  try {
    return run_bench(o, job);
  } catch (const dp::tools::PeerFailed& e) {
    return e.code;
  } catch (const UsageError& e) {
    fmt::print(stderr, "dp_bench{}: {}\n", job.where(std::current_exception()), e.what());
    return job.failed(dp::tools::kExitBadInput);
  } catch (...) {
    // The same code per cause as dp_train: a device or host out of memory is 2, not 1.
    const std::exception_ptr error = std::current_exception();
    return job.failed(dp::tools::report_failure("dp_bench", job.where(error), error));
  }
}

}  // namespace
}  // namespace dp_bench

int main(int argc, char** argv) {
  // The job first: under mpirun every way out, a bad command line included, goes through the
  // processes' agreement (an early exit would leave the others waiting for this one).
  dp::tools::keep_malloc_to_one_arena();
  dp::tools::fail_writes_past_the_file_size_limit();
  dp::tools::Job job("dp_bench");
  try {
    job.start();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_bench: {}\n", e.what());
    return 2;
  }
  const int code = dp_bench::bench_main(argc, argv, job);
  job.end();
  return dp::tools::leave(code);
}
