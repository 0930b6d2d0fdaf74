// test_bench.cpp — dp_bench driven as a user drives it (the real binary, DP_BENCH_BIN) on simulated
// devices, with a small configuration. Asserts only machine-independent figures exactly: the
// device-to-device bytes per step of DP and DDP against their analytic values, the balance of DDP
// and the imbalance of DP's source, the shape of the JSON and of the Chrome/Perfetto trace, and
// clear errors on bad flags. Times and rates are only checked to be positive: no timed assertions.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <sched.h>
#include <set>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include "dp/engines/ddp.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/runtime/device.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using dp::test::TempDir;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Result {
  int exit_code = -1;
  std::string out, err;
};

// Runs dp_bench with `args` (already shell-quoted where needed), capturing stdout and stderr; `env`
// (VAR=value ...) in its environment.
Result run_bench(const TempDir& dir, const std::string& args, const std::string& env = "") {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string command =
      fmt::format("{} '{}' {} >'{}' 2>'{}'", env, DP_BENCH_BIN, args, out.string(), err.string());
  const int status = std::system(command.c_str());
  Result r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

// dp_bench once per value of `option`: `args` followed by "--<option> <value> --json
// <dir>/<value>.json", each run exiting 0; its output and parsed report by value. Call through
// ASSERT_NO_FATAL_FAILURE: a failed run stops the test.
struct RunsPerValue {
  std::map<std::string, Result> results;
  std::map<std::string, json> reports;
};
void run_bench_per_value(const TempDir& dir, const std::string& args, const std::string& option,
                         const std::vector<std::string>& values, RunsPerValue& runs) {
  for (const std::string& value : values) {
    const auto json_path = dir / (value + ".json");
    const Result r = run_bench(dir, fmt::format("{} --{} {} --json '{}'", args, option, value, json_path.string()));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    runs.results[value] = r;
    runs.reports[value] = json::parse(read_file(json_path));
  }
}

const json& find_run(const json& report, const std::string& model, const std::string& mode) {
  for (const auto& run : report.at("runs"))
    if (run.at("model") == model && run.at("mode") == mode) return run;
  ADD_FAILURE() << "no run " << model << " " << mode;
  static const json empty = json::object();
  return empty;
}

std::uint64_t u64(const json& j) { return j.get<std::uint64_t>(); }

// The models' sizes from the public API, checked against the architecture written out by hand.
struct ModelSizes {
  std::uint64_t param_bytes = 0, buffers_bytes = 0;
  std::vector<dp::GradBucket> buckets;  // DDP's buckets with the default caps
};
ModelSizes sizes_of(const std::string& model) {
  auto rt = dp::Runtime::create({.backend = "sim", .sim_devices = 1});
  auto m = model == "mlp" ? dp::models::make_mlp(rt->device(0), {256, 256}) : dp::models::make_convnet(rt->device(0));
  ModelSizes s;
  s.param_bytes = m->param_count() * sizeof(float);
  s.buffers_bytes = m->buffers_bytes();
  s.buckets = dp::assign_buckets(m->parameters(), 1.0, 25.0);
  return s;
}

TEST(Bench, ModelSizesMatchTheArchitectures) {
  const auto mlp = sizes_of("mlp"), convnet = sizes_of("convnet");
  EXPECT_EQ(mlp.param_bytes, 4u * (784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10));
  EXPECT_EQ(mlp.buffers_bytes, 0u);
  // conv1 + bn1 (weight, bias) + conv2 + bn2 + fc
  EXPECT_EQ(convnet.param_bytes, 4u * (16 * 25 + 16 + 16 + 16 + 32 * 16 * 25 + 32 + 32 + 32 + 1568 * 10 + 10));
  // per BatchNorm2d(C): running_mean and running_var (C floats each) and num_batches_tracked (int64)
  EXPECT_EQ(convnet.buffers_bytes, (2u * 16 * 4 + 8) + (2u * 32 * 4 + 8));
}

// Bytes each rank receives (and sends) per ring all-reduce of the buckets: the ring moves every
// chunk but the rank's own in reduce-scatter and every chunk but its right neighbour's in
// all-gather, i.e. exactly 2(N-1)/N of the bucket when N divides it (always, for N = 2).
std::uint64_t ring_bytes(const std::vector<dp::GradBucket>& buckets, std::uint64_t n) {
  std::uint64_t total = 0;
  for (const auto& b : buckets) {
    EXPECT_TRUE(n == 2 || b.count % n == 0) << "bucket of " << b.count << " floats is not divisible by " << n;
    total += 2 * (n - 1) * b.count / n * sizeof(float);
  }
  return total;
}

TEST(Bench, TwoSimDevicesAllModelsAndModes) {
  TempDir dir("two");
  const auto json_path = dir / "bench.json", trace_path = dir / "trace.json";
  const int batch = 8, steps = 2;
  // Eager (--graphs off): DP's phase times need it; GraphsReplayTheSteadyState covers the default.
  const Result r = run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp,convnet --modes single,dp,ddp "
                                              "--batch-size {} --steps {} --warmup 1 --graphs off --json '{}' "
                                              "--trace '{}'",
                                              batch, steps, json_path.string(), trace_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The human table names every run.
  for (const char* word : {"samples/s", "mlp", "convnet", "single", "ddp", "DP phases", "busy %"})
    EXPECT_NE(r.out.find(word), std::string::npos) << word << "\n" << r.out;

  const json report = json::parse(read_file(json_path));
  EXPECT_EQ(report.at("backend"), "sim");
  EXPECT_EQ(report.at("precision"), "strict") << "the default";
  EXPECT_EQ(report.at("devices"), 2);
  // The round trip of a cache line between the two devices' cores, measured before the runs: from
  // tens of ns (one L3) to a few us (a loaded or sanitised build), never nothing with two cores.
  if (std::thread::hardware_concurrency() >= 2) {
    const double round_trip = report.at("core_round_trip_ns").get<double>();
    EXPECT_GT(round_trip, 0.0);
    EXPECT_LT(round_trip, 1e6);
    EXPECT_NE(
        r.out.find(fmt::format("a cache line's round trip between devices 0 and 1's cores took {:.0f} ns", round_trip)),
        std::string::npos)
        << r.out;
  }
  ASSERT_EQ(report.at("runs").size(), 6u);

  for (const auto& run : report.at("runs")) {
    SCOPED_TRACE(fmt::format("{} {}", run.at("model").get<std::string>(), run.at("mode").get<std::string>()));
    const bool single = run.at("mode") == "single", dp = run.at("mode") == "dp";
    const int devices = single ? 1 : 2;
    EXPECT_EQ(run.at("devices"), devices);
    // As torch's: DataParallel's --batch-size is the global batch, chunked; DDP's each rank's.
    EXPECT_EQ(run.at("batch_per_device"), dp ? batch / devices : batch);
    EXPECT_EQ(run.at("global_batch"), dp ? batch : batch * devices);
    EXPECT_EQ(run.at("steps"), steps);
    EXPECT_GT(run.at("samples_per_s").get<double>(), 0.0);
    EXPECT_GT(run.at("step_ms_median").get<double>(), 0.0);
    EXPECT_GE(run.at("step_ms_p90").get<double>(), run.at("step_ms_median").get<double>());
    EXPECT_LE(run.at("step_ms_p10").get<double>(), run.at("step_ms_median").get<double>());
    EXPECT_DOUBLE_EQ(run.at("step_spread").get<double>(),
                     run.at("step_ms_p90").get<double>() / run.at("step_ms_p10").get<double>());
    EXPECT_GT(run.at("scaling_efficiency").get<double>(), 0.0);
    if (single) {
      EXPECT_EQ(run.at("scaling_efficiency").get<double>(), 1.0);
    }
    ASSERT_EQ(run.at("per_device").size(), static_cast<std::size_t>(devices));
    for (int d = 0; d < devices; ++d) {
      const json& pd = run.at("per_device").at(static_cast<std::size_t>(d));
      EXPECT_EQ(pd.at("device"), d);
      const double busy = pd.at("busy_pct").get<double>();  // recorded on sim
      EXPECT_GT(busy, 0.0);
      EXPECT_LE(busy, 100.0);
      EXPECT_GT(u64(pd.at("peak_bytes")), 0u);
      EXPECT_GT(pd.at("model_gflops").get<double>(), 0.0);
      // The whole step's rate: below any CPU's peak (2 cores of this kind: ~150 GF/s).
      EXPECT_LT(pd.at("model_gflops").get<double>(), 1000.0);
    }
    for (const char* key : {"busy_pct", "bytes_sent", "bytes_received", "peak_bytes"})
      EXPECT_GE(run.at("imbalance").at(key).get<double>(), 1.0) << key;
    // The host's work per steady-state step (Runtime::counters, the engine's steps only): no
    // allocation once warm; no pageable copy (inputs from pinned memory, the loss read back into
    // pinned memory); at most one host sync (ddp too: one stream waits for every rank's loss) --
    // pipelined, a submission waits for the loss of the step two before it, and the first two
    // measured steps find theirs already read; one submission per device for dp and ddp, none for
    // single (the caller's thread). dp records its phase times here (graphs off): not pipelined, one
    // host sync per step for its loss.
    const bool dp_phases = run.at("mode") == "dp";
    EXPECT_EQ(run.at("pipelined"), !dp_phases);
    EXPECT_EQ(run.at("allocations_per_step").get<double>(), 0.0);
    EXPECT_LE(run.at("host_syncs_per_step").get<double>(), 1.0);
    if (dp_phases) {
      EXPECT_EQ(run.at("host_syncs_per_step").get<double>(), 1.0);
    }
    EXPECT_EQ(run.at("pageable_copies_per_step").get<double>(), 0.0);
    EXPECT_GT(run.at("launches_per_step").get<double>(), 10.0);
    EXPECT_EQ(run.at("graphs"), false);
    for (const json& pd : run.at("per_device"))
      EXPECT_EQ(pd.at("worker_submits_per_step").get<double>(), single ? 0.0 : 1.0);
    if (single) {
      EXPECT_EQ(u64(run.at("per_device")[0].at("bytes_sent")), 0u);
      EXPECT_EQ(u64(run.at("per_device")[0].at("bytes_received")), 0u);
    }
    const json& phases = run.at("phases_ms");
    if (run.at("mode") == "dp") {
      for (const char* key : {"broadcast", "scatter", "forward", "gather", "loss", "backward", "reduce", "update"})
        EXPECT_GE(phases.at(key).get<double>(), 0.0) << key;
      EXPECT_GT(phases.at("forward").get<double>(), 0.0);
      EXPECT_GT(phases.at("backward").get<double>(), 0.0);
    } else {
      EXPECT_TRUE(phases.empty());
    }
  }

  for (const std::string model : {"mlp", "convnet"}) {
    SCOPED_TRACE(model);
    const ModelSizes size = sizes_of(model);
    const std::uint64_t params = size.param_bytes, buffers = size.buffers_bytes;
    const std::uint64_t out_rows = batch / 2 * 10 * sizeof(float);  // device 1's chunk of logits

    // DP, source = output device = 0. Per step the source sends parameters and buffers (broadcast)
    // and the output-gradient rows (scatter) to device 1, and receives its gradients (reduce) and
    // its output rows (gather). Inputs are host -> device traffic, not counted here.
    const json& dp_run = find_run(report, model, "dp");
    EXPECT_EQ(u64(dp_run.at("param_count")) * 4, params);
    EXPECT_EQ(u64(dp_run.at("buffers_bytes")), buffers);
    const json& src = dp_run.at("per_device")[0];
    const json& other = dp_run.at("per_device")[1];
    EXPECT_EQ(u64(src.at("bytes_sent")), params + buffers + out_rows);
    EXPECT_EQ(u64(src.at("bytes_received")), params + out_rows);
    EXPECT_EQ(u64(other.at("bytes_sent")), params + out_rows);
    EXPECT_EQ(u64(other.at("bytes_received")), params + buffers + out_rows);
    // The source holds the master copy, the optimizer state and the gathered outputs.
    EXPECT_GT(u64(src.at("peak_bytes")), u64(other.at("peak_bytes")));
    EXPECT_GT(dp_run.at("imbalance").at("peak_bytes").get<double>(), 1.0);

    // DDP, 2 ranks: each sends and receives 2(N-1)/N = 1 x the gradient bytes per step for the
    // all-reduce, plus the buffer broadcast rank 0 -> rank 1 before each forward.
    const json& ddp_run = find_run(report, model, "ddp");
    const std::uint64_t ring = ring_bytes(size.buckets, 2);
    EXPECT_EQ(ring, params);
    const json& r0 = ddp_run.at("per_device")[0];
    const json& r1 = ddp_run.at("per_device")[1];
    EXPECT_EQ(u64(r0.at("bytes_sent")), ring + buffers);
    EXPECT_EQ(u64(r0.at("bytes_received")), ring);
    EXPECT_EQ(u64(r1.at("bytes_sent")), ring);
    EXPECT_EQ(u64(r1.at("bytes_received")), ring + buffers);
    // Balanced: every rank holds the same replica, optimizer and buckets.
    EXPECT_EQ(u64(r0.at("peak_bytes")), u64(r1.at("peak_bytes")));
    EXPECT_EQ(ddp_run.at("imbalance").at("peak_bytes").get<double>(), 1.0);
    if (buffers == 0) {
      EXPECT_EQ(ddp_run.at("imbalance").at("bytes_sent").get<double>(), 1.0);
    }
  }

  // ---- the trace: Trace Event Format, one track per device stream that did work
  const json trace = json::parse(read_file(trace_path));
  ASSERT_TRUE(trace.is_object());
  ASSERT_TRUE(trace.at("traceEvents").is_array());
  std::map<int, std::string> process_names;
  std::map<std::pair<int, int>, std::string> thread_names;
  std::map<std::pair<int, int>, int> events_per_track;
  std::map<int, int> pid_of_tid;
  // Per run: its tracks, and its time window (runs are laid end to end and must not overlap).
  std::map<std::string, std::set<std::pair<int, int>>> run_tracks;
  std::map<std::string, std::pair<double, double>> run_window;
  const std::set<std::string> kinds = {"kernel", "gemm", "copy", "collective", "host"};
  for (const auto& e : trace.at("traceEvents")) {
    const std::string ph = e.at("ph");
    const int pid = e.at("pid"), tid = e.at("tid");
    if (ph == "M") {
      if (e.at("name") == "process_name") {
        EXPECT_TRUE(process_names.emplace(pid, e.at("args").at("name")).second) << "process " << pid << " named twice";
      } else if (e.at("name") == "thread_name") {
        EXPECT_TRUE(thread_names.emplace(std::pair{pid, tid}, e.at("args").at("name")).second)
            << "thread " << pid << "/" << tid << " named twice";
      }
      continue;
    }
    ASSERT_EQ(ph, "X") << e.dump();
    EXPECT_TRUE(e.at("name").is_string());
    EXPECT_TRUE(kinds.count(e.at("cat").get<std::string>())) << e.dump();
    const double ts = e.at("ts"), dur = e.at("dur");
    EXPECT_GE(ts, 0.0);
    EXPECT_GE(dur, 0.0);
    ++events_per_track[{pid, tid}];
    const auto [it, inserted] = pid_of_tid.emplace(tid, pid);
    EXPECT_EQ(it->second, pid) << "stream " << tid << " appears on two devices";
    const std::string run = e.at("args").at("run");
    run_tracks[run].insert({pid, tid});
    auto [w, first] = run_window.emplace(run, std::pair{ts, ts + dur});
    if (!first) w->second = {std::min(w->second.first, ts), std::max(w->second.second, ts + dur)};
  }
  EXPECT_EQ(process_names, (std::map<int, std::string>{{0, "device 0"}, {1, "device 1"}}));
  ASSERT_EQ(thread_names.size(), events_per_track.size()) << "exactly one named track per stream that did work";
  for (const auto& [track, count] : events_per_track) {
    ASSERT_TRUE(thread_names.count(track)) << "events on an unnamed track " << track.first << "/" << track.second;
    EXPECT_EQ(thread_names.at(track), fmt::format("stream {}", track.second));
    EXPECT_GT(count, 0);
  }
  // Which devices each run's work landed on, and that no stream is shared between runs.
  ASSERT_EQ(run_tracks.size(), 6u);
  std::set<std::pair<int, int>> seen;
  for (const auto& [run, tracks] : run_tracks) {
    std::set<int> pids;
    for (const auto& t : tracks) {
      pids.insert(t.first);
      EXPECT_TRUE(seen.insert(t).second) << run << ": stream " << t.second << " also used by another run";
    }
    const bool single = run.find("single") != std::string::npos;
    const std::set<int> expected = single ? std::set<int>{0} : std::set<int>{0, 1};
    EXPECT_EQ(pids, expected) << run;
    if (run.find("ddp") != std::string::npos) {
      EXPECT_EQ(tracks.size(), 6u) << run << ": a compute, a communication and an input-copy stream per device";
    }
  }
  // Runs do not overlap in the trace: in the order they ran, each starts after the previous ended.
  const std::vector<std::string> order = {"mlp single",     "mlp dp",     "mlp ddp",
                                          "convnet single", "convnet dp", "convnet ddp"};
  for (std::size_t i = 1; i < order.size(); ++i)
    EXPECT_LT(run_window.at(order[i - 1]).second, run_window.at(order[i]).first) << order[i - 1] << " / " << order[i];
  EXPECT_EQ(run_window.at(order[0]).first, 0.0) << "timestamps are relative to the first span";
}

TEST(Bench, ThreeSimDevicesShowDpSourceImbalanceAndBalancedDdp) {
  TempDir dir("three");
  const auto json_path = dir / "bench.json";
  const int batch = 12;  // DP's global batch: 4 rows per device
  const Result r = run_bench(dir, fmt::format("--backend sim --devices 3 --models mlp --modes dp,ddp --batch-size {} "
                                              "--steps 1 --warmup 1 --json '{}'",
                                              batch, json_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json report = json::parse(read_file(json_path));
  ASSERT_EQ(report.at("runs").size(), 2u);
  const ModelSizes size = sizes_of("mlp");
  const std::uint64_t params = size.param_bytes, out_rows = batch / 3 * 10 * sizeof(float);

  // DP: the source broadcasts to and reduces from each of the 2 other devices.
  const json& dp_run = find_run(report, "mlp", "dp");
  EXPECT_TRUE(dp_run.at("scaling_efficiency").is_null()) << "no single run to compare with";
  const json& per = dp_run.at("per_device");
  EXPECT_EQ(u64(per[0].at("bytes_sent")), 2 * (params + out_rows));
  EXPECT_EQ(u64(per[0].at("bytes_received")), 2 * (params + out_rows));
  for (int d = 1; d < 3; ++d) {
    EXPECT_EQ(u64(per[d].at("bytes_sent")), params + out_rows);
    EXPECT_EQ(u64(per[d].at("bytes_received")), params + out_rows);
  }
  EXPECT_NEAR(dp_run.at("imbalance").at("bytes_sent").get<double>(), 1.5, 1e-12);  // 2x / (4x / 3)
  EXPECT_NEAR(dp_run.at("imbalance").at("bytes_received").get<double>(), 1.5, 1e-12);

  // DDP: every rank sends and receives 2(N-1)/N of the gradient bytes — 4/3 x with 3 ranks.
  const json& ddp_run = find_run(report, "mlp", "ddp");
  const std::uint64_t ring = ring_bytes(size.buckets, 3);
  EXPECT_EQ(3 * ring, 4 * params);
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(u64(ddp_run.at("per_device")[d].at("bytes_sent")), ring);
    EXPECT_EQ(u64(ddp_run.at("per_device")[d].at("bytes_received")), ring);
  }
  EXPECT_EQ(ddp_run.at("imbalance").at("bytes_sent").get<double>(), 1.0);
  EXPECT_EQ(ddp_run.at("imbalance").at("bytes_received").get<double>(), 1.0);
}

// --precision strict|fast: both accepted and reported; the sim has one arithmetic, so both train
// to the same losses, bit for bit.
TEST(Bench, PrecisionIsReportedAndFastIsStrictOnTheSim) {
  TempDir dir("precision");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 2 --models convnet --modes single,ddp --batch-size 4 --steps 2 --warmup 1",
      "precision", {"strict", "fast"}, runs));
  auto& reports = runs.reports;
  for (const std::string precision : {"strict", "fast"}) {
    EXPECT_NE(runs.results[precision].out.find("precision " + precision), std::string::npos)
        << runs.results[precision].out;
    EXPECT_EQ(reports[precision].at("precision"), precision);
  }
  for (const std::string mode : {"single", "ddp"}) {
    SCOPED_TRACE(mode);
    const json& strict = find_run(reports["strict"], "convnet", mode);
    const json& fast = find_run(reports["fast"], "convnet", mode);
    EXPECT_EQ(fast.at("loss_first"), strict.at("loss_first"));
    EXPECT_EQ(fast.at("loss_last"), strict.at("loss_last"));
  }
}

// torchvision's ResNet-18 at CIFAR's 3x32x32 (its samples larger than the other models', from the
// same synthetic data): torchvision's parameter count for 10 classes, the GEMM work of its 20
// convolutions and fc, and every mode runs.
TEST(Bench, ResNet18RunsBesideTheSmallModels) {
  TempDir dir("resnet18");
  const auto json_path = dir / "r.json";
  // dp's global batch of 4 leaves each device 2 samples: BatchNorm's 1x1 planes of layer4 need more than one.
  const Result r = run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp,resnet18 --modes single,dp,ddp "
                                              "--batch-size 4 --steps 1 --warmup 1 --json '{}'",
                                              json_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json report = json::parse(read_file(json_path));
  for (const std::string mode : {"single", "dp", "ddp"}) {
    const json& run = find_run(report, "resnet18", mode);
    EXPECT_EQ(run.at("param_count"), 11181642) << "torchvision.models.resnet18(num_classes=10)";
    // Forward MACs at 32x32: stem 2,408,448, layer1 9,437,184, layers 2-4 8,388,608 each, fc 5,120;
    // forward, weight and input gradients but the stem's input gradient, 2 FLOPs per MAC.
    EXPECT_EQ(run.at("gemm_flops_per_sample").get<double>(), 2.0 * (3.0 * 37016576 - 2408448));
    EXPECT_TRUE(std::isfinite(run.at("loss_last").get<double>()));
  }
}

// --grad-reduce bf16 (torch's bf16_compress_hook): the gradient buckets cross the links as bf16, so
// a DDP step moves half the gradient bytes of fp32 (the ring's traffic: buffers are broadcast in
// fp32 either way), it is reported, and training goes on at bf16's precision.
TEST(Bench, Bf16GradientReductionHalvesTheBytes) {
  TempDir dir("grad_reduce");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 2 --models mlp,convnet --modes ddp --batch-size 4 --steps 2 --warmup 1",
      "grad-reduce", {"fp32", "bf16"}, runs));
  auto& reports = runs.reports;
  for (const std::string reduce : {"fp32", "bf16"}) EXPECT_EQ(reports[reduce].at("grad_reduce"), reduce);
  // The MLP has no buffers: its step's bytes are the gradients' alone, halved exactly.
  const json& fp32 = find_run(reports["fp32"], "mlp", "ddp");
  const json& bf16 = find_run(reports["bf16"], "mlp", "ddp");
  for (std::size_t d = 0; d < 2; ++d) {
    const auto sent32 = fp32.at("per_device")[d].at("bytes_sent").get<std::uint64_t>();
    EXPECT_EQ(bf16.at("per_device")[d].at("bytes_sent").get<std::uint64_t>() * 2, sent32) << "device " << d;
    EXPECT_GT(sent32, 4u * 200000u) << "the MLP's ~235k gradients cross once each way";
  }
  const json& conv32 = find_run(reports["fp32"], "convnet", "ddp");
  const json& conv16 = find_run(reports["bf16"], "convnet", "ddp");
  EXPECT_NEAR(conv16.at("loss_last").get<double>(), conv32.at("loss_last").get<double>(),
              0.01 * conv32.at("loss_last").get<double>());
}

// --clip-grad-norm: clip_grad_norm_ runs on the device inside the step, so a step waits on the host
// at most once, as without it (the pipeline's wait), with graphs replaying (one launch) or eagerly
// (its kernels added).
TEST(Bench, ClippingAddsNoHostSync) {
  TempDir dir("clip");
  for (const std::string graphs : {"on", "off"}) {
    SCOPED_TRACE("graphs " + graphs);
    RunsPerValue runs;
    ASSERT_NO_FATAL_FAILURE(run_bench_per_value(dir,
                                                "--backend sim --devices 2 --models mlp,convnet --modes single,dp,ddp "
                                                "--batch-size 4 --steps 3 --warmup 2 --graphs " +
                                                    graphs,
                                                "clip-grad-norm", {"0", "0.5"}, runs));
    for (const std::string model : {"mlp", "convnet"})
      for (const std::string mode : {"single", "dp", "ddp"}) {
        const json& plain = find_run(runs.reports["0"], model, mode);
        const json& clipped = find_run(runs.reports["0.5"], model, mode);
        // A pipelined step waits on the host at most once (for a loss two steps back; whether it must
        // wait depends on timing): clipping adds no wait of its own.
        EXPECT_LE(clipped.at("host_syncs_per_step").get<double>(), 1.0) << model << " " << mode;
        EXPECT_LE(plain.at("host_syncs_per_step").get<double>(), 1.0) << model << " " << mode;
        if (graphs == "off") {
          EXPECT_GT(clipped.at("launches_per_step").get<double>(), plain.at("launches_per_step").get<double>())
              << model << " " << mode << ": the clipping kernels run";
        }
      }
  }
}

// --zero 1: each device keeps and updates its blocks of every gradient bucket only, so its
// optimizer state is a 1/ranks slice (AdamW: 2 floats per parameter in all, each block's size
// rounded down or up by one); the buckets are reduce-scattered and the parameters all-gathered, so
// each device sends and receives what plain DDP's all-reduce moves, byte for byte; and the run
// trains as plain DDP does (the same losses).
TEST(Bench, ZeroOneSendsDdpsBytesAndKeepsASliceOfTheState) {
  TempDir dir("zero");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 4 --models mlp --modes ddp --optimizer adamw --batch-size 4 --steps 2 --warmup 1",
      "zero", {"0", "1"}, runs));
  const json& plain = find_run(runs.reports["0"], "mlp", "ddp");
  const json& zero = find_run(runs.reports["1"], "mlp", "ddp");
  const auto params = u64(plain.at("param_count"));
  EXPECT_EQ(u64(plain.at("optimizer_state_bytes")), 2 * 4 * params);
  const std::uint64_t buckets = u64(plain.at("ddp_buckets"));  // a float of rounding each
  EXPECT_GE(u64(zero.at("optimizer_state_bytes")), 2 * 4 * (params / 4 - buckets));
  EXPECT_LE(u64(zero.at("optimizer_state_bytes")), 2 * 4 * (params / 4 + buckets));
  // The gradients: the model's flat buffer, and under ZeRO-1 the slice packed for its update too.
  EXPECT_EQ(u64(plain.at("gradient_bytes")), 4 * params);
  EXPECT_GE(u64(zero.at("gradient_bytes")), 4 * (params + params / 4 - buckets));
  EXPECT_LE(u64(zero.at("gradient_bytes")), 4 * (params + params / 4 + buckets));
  for (std::size_t d = 0; d < 4; ++d) {
    EXPECT_EQ(u64(zero.at("per_device")[d].at("bytes_sent")), u64(plain.at("per_device")[d].at("bytes_sent")))
        << "device " << d;
    EXPECT_EQ(u64(zero.at("per_device")[d].at("bytes_received")), u64(plain.at("per_device")[d].at("bytes_received")))
        << "device " << d;
  }
  EXPECT_EQ(zero.at("loss_last"), plain.at("loss_last"));
}

// --zero 2 on a GPT of equal blocks, buckets of about a block: the backward writes its gradients into
// a few bucket slots and each device keeps its blocks of them, so a device's gradient memory falls
// under half of the model's (its quarter, the tied embedding's slot and two taken in turn) and its
// peak memory with it; the bytes sent and the losses stay plain DDP's.
TEST(Bench, ZeroTwoKeepsASliceOfTheGradients) {
  TempDir dir("zero2");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(dir,
                                              "--backend sim --devices 4 --models gpt --layers 6 --width 64 --heads 2 "
                                              "--context 16 --modes ddp --optimizer adamw --batch-size 2 --steps 2 "
                                              "--warmup 1 --bucket-cap-mb 0.05 --first-bucket-mb 0.05",
                                              "zero", {"0", "2"}, runs));
  const json& plain = find_run(runs.reports["0"], "gpt", "ddp");
  const json& zero = find_run(runs.reports["2"], "gpt", "ddp");
  const auto params = u64(plain.at("param_count"));
  EXPECT_EQ(u64(plain.at("gradient_bytes")), 4 * params);
  EXPECT_GE(u64(zero.at("gradient_bytes")), 4 * (params / 4));
  EXPECT_LT(u64(zero.at("gradient_bytes")), 4 * params / 2);
  for (std::size_t d = 0; d < 4; ++d) {
    const json &z = zero.at("per_device")[d], &p = plain.at("per_device")[d];
    EXPECT_EQ(u64(z.at("bytes_sent")), u64(p.at("bytes_sent"))) << "device " << d;
    EXPECT_LT(u64(z.at("peak_bytes")), u64(p.at("peak_bytes"))) << "device " << d;
  }
  EXPECT_EQ(zero.at("loss_last"), plain.at("loss_last"));
}

// --check-cost: each ddp run is measured with the collectives' signature check off too, in
// alternation, and the cost is printed and in the JSON beside the checked figure.
// DP_FAULT=lose@... with --shards: the first model and mode lose the device and go on without it,
// timed against the same run undisturbed (the rebuild, the redone step, both runs' time), before
// the measured runs, which the spent fault leaves whole.
TEST(Bench, ALostDeviceIsMeasuredAgainstTheUndisturbedRun) {
  TempDir dir("recovery");
  const fs::path json_path = dir / "report.json";
  const std::string args = "--backend sim --devices 3 --models mlp --modes ddp --batch-size 2 --steps 3 --warmup 1";
  const Result r =
      run_bench(dir, fmt::format("{} --shards 6 --json '{}'", args, json_path.string()), "DP_FAULT=lose@d1:3");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("lost device (DP_FAULT): mlp ddp/6, device 1 lost in step 3 of 4: the survivors [0,2]"),
            std::string::npos)
      << r.out;
  const json report = json::parse(read_file(json_path));
  const json& recovery = report.at("recovery");
  EXPECT_EQ(recovery.at("device"), 1);
  EXPECT_EQ(recovery.at("step"), 3);
  EXPECT_EQ(recovery.at("steps"), 4);
  EXPECT_EQ(recovery.at("devices"), json::parse("[0,2]"));
  for (const char* figure : {"rebuild_ms", "redone_step_ms", "disturbed_ms", "undisturbed_ms"})
    EXPECT_GT(recovery.at(figure).get<double>(), 0.0) << figure;
  EXPECT_EQ(find_run(report, "mlp", "ddp/6").at("devices"), 3);  // the fault is spent
  // Without --shards a lost device ends the run; a fault past the run's steps never fires.
  const Result plain = run_bench(dir, args, "DP_FAULT=lose@d1:3");
  EXPECT_EQ(plain.exit_code, 2) << plain.out << plain.err;
  EXPECT_NE(plain.err.find("needs --shards V and one process"), std::string::npos) << plain.err;
  const Result late = run_bench(dir, args + " --shards 6", "DP_FAULT=lose@d1:99");
  EXPECT_EQ(late.exit_code, 2) << late.out << late.err;
  EXPECT_NE(late.err.find("did not fire in 4 steps"), std::string::npos) << late.err;
}

TEST(Bench, TheCheckCostIsMeasuredBesideTheCheckedRun) {
  TempDir dir("check_cost");
  const fs::path json_path = dir / "report.json";
  const Result r = run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp --modes ddp --batch-size 4 "
                                              "--steps 2 --warmup 1 --check-cost --json '{}'",
                                              json_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("mlp      the collectives' check costs "), std::string::npos) << r.out;
  const json report = json::parse(read_file(json_path));
  const json& ddp = find_run(report, "mlp", "ddp");
  EXPECT_GT(ddp.at("unchecked_samples_per_s").get<double>(), 0.0);
  EXPECT_GT(ddp.at("samples_per_s").get<double>(), 0.0);
  EXPECT_TRUE(ddp.at("unchecked_replicas_samples_per_s").is_null()) << "no replica check within 2 steps";
  // With a replica check inside the measured steps, its cost is measured the same way.
  const Result every = run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp --modes ddp --batch-size 4 "
                                                  "--steps 2 --warmup 1 --check-cost --check-replicas 1 --json '{}'",
                                                  json_path.string()));
  ASSERT_EQ(every.exit_code, 0) << every.out << every.err;
  EXPECT_NE(every.out.find("mlp      the replicas' check every 1 step(s) costs "), std::string::npos) << every.out;
  EXPECT_GT(
      find_run(json::parse(read_file(json_path)), "mlp", "ddp").at("unchecked_replicas_samples_per_s").get<double>(),
      0.0);
  // Shadow shards (with --shards) too.
  const Result shadow = run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp --modes ddp --batch-size 4 "
                                                   "--steps 2 --warmup 1 --check-cost --shards 2 --shadow-shards 1 "
                                                   "--json '{}'",
                                                   json_path.string()));
  ASSERT_EQ(shadow.exit_code, 0) << shadow.out << shadow.err;
  EXPECT_NE(shadow.out.find("mlp      shadow shards every 1 step(s) costs "), std::string::npos) << shadow.out;
  EXPECT_GT(find_run(json::parse(read_file(json_path)), "mlp", "ddp/2").at("unshadowed_samples_per_s").get<double>(),
            0.0);
  // The check's own figures: eager steps agree on every call (each rank: each bucket, and the step's
  // end, where a rank that skipped a call is caught), and a run with the check off makes none.
  const std::string eager =
      "--backend sim --devices 2 --models mlp --modes ddp --batch-size 4 --steps 2 --warmup 1 "
      "--graphs off --check-replicas 0 --json '" +
      json_path.string() + "'";
  ASSERT_EQ(run_bench(dir, eager).exit_code, 0);
  const json checked_report = json::parse(read_file(json_path));
  const json& checked = find_run(checked_report, "mlp", "ddp");
  EXPECT_EQ(checked.at("check_agreements_per_step").get<double>(),
            2.0 * (checked.at("ddp_buckets").get<double>() + 1.0));
  EXPECT_GT(checked.at("check_us_per_step").get<double>(), 0.0);
  ASSERT_EQ(run_bench(dir, eager, "DP_CHECK_COLLECTIVES=0").exit_code, 0);
  const json unchecked_report = json::parse(read_file(json_path));
  const json& unchecked = find_run(unchecked_report, "mlp", "ddp");
  EXPECT_EQ(unchecked.at("check_agreements_per_step").get<double>(), 0.0);
  EXPECT_EQ(unchecked.at("check_us_per_step").get<double>(), 0.0);
}

// --shards V: every mode runs V shards of --batch-size (a global batch of V x --batch-size, named
// "mode/V"); ddp is also measured without shards in the same run, and a line gives the ratio. With
// V = P the sharded ddp step all-gathers V gradients: each device receives (V - 1) gradient copies.
TEST(Bench, ShardsAreMeasuredAgainstPlainDdp) {
  TempDir dir("shards");
  const auto json_path = dir / "report.json";
  const Result r =
      run_bench(dir, fmt::format("--backend sim --devices 2 --models mlp --modes single,ddp --batch-size 4 "
                                 "--steps 2 --warmup 1 --shards 2 --json '{}'",
                                 json_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("mlp      ddp/2 costs "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("x plain ddp's time per sample (global batches 8 and 8)"), std::string::npos) << r.out;
  const json report = json::parse(read_file(json_path));
  const json& single = find_run(report, "mlp", "single/2");
  const json& plain = find_run(report, "mlp", "ddp");
  const json& sharded = find_run(report, "mlp", "ddp/2");
  EXPECT_EQ(single.at("global_batch"), 8);
  EXPECT_EQ(plain.at("global_batch"), 8);
  EXPECT_EQ(sharded.at("global_batch"), 8);
  // Equal data, and the same step: the same losses.
  EXPECT_EQ(sharded.at("loss_last"), single.at("loss_last"));
  const auto params = u64(plain.at("param_count"));
  for (std::size_t d = 0; d < 2; ++d)
    EXPECT_GE(u64(sharded.at("per_device")[d].at("bytes_received")), 4 * params) << "device " << d;
}

// --broadcast-buffers off (DistributedDataParallel(broadcast_buffers=False)): a DDP step of the
// ConvNet no longer sends its BatchNorm buffers from rank 0, so rank 0 sends exactly their bytes
// less per step (the other ranks receive them, and send nothing more, in a broadcast's chain of 2),
// the MLP (no buffers) sends the same, and the report says which.
TEST(Bench, BroadcastBuffersOffSendsNoBuffers) {
  TempDir dir("broadcast_buffers");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 2 --models mlp,convnet --modes ddp --batch-size 4 --steps 2 --warmup 1",
      "broadcast-buffers", {"on", "off"}, runs));
  auto& reports = runs.reports;
  for (const std::string broadcast : {"on", "off"}) EXPECT_EQ(reports[broadcast].at("broadcast_buffers"), broadcast);
  const auto received = [&](const std::string& broadcast, const char* model) {
    return find_run(reports[broadcast], model, "ddp").at("per_device")[1].at("bytes_received").get<double>();
  };
  EXPECT_EQ(received("on", "mlp"), received("off", "mlp"));
  const double buffers = find_run(reports["on"], "convnet", "ddp").at("buffers_bytes").get<double>();
  EXPECT_GT(buffers, 0.0);
  EXPECT_EQ(received("on", "convnet") - received("off", "convnet"), buffers);
}

// --amp bf16: the run says so, and what a forward keeps for the backward per sample is half of fp32's
// (bf16 activations) but for the ConvNet's max-pool indices, int32 in both.
TEST(Bench, AutocastHalvesTheSavedActivations) {
  TempDir dir("amp");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 2 --models convnet,resnet8 --modes single,dp --batch-size 4 --steps 2 --warmup 1",
      "amp", {"off", "bf16"}, runs));
  auto& reports = runs.reports;
  for (const std::string amp : {"off", "bf16"}) {
    EXPECT_NE(runs.results[amp].out.find("autocast " + amp), std::string::npos) << runs.results[amp].out;
    EXPECT_EQ(reports[amp].at("amp"), amp);
  }
  for (const char* model : {"convnet", "resnet8"})
    for (const char* mode : {"single", "dp"}) {
      const auto fp32 = find_run(reports["off"], model, mode).at("activation_bytes_per_sample").get<double>();
      const auto bf16 = find_run(reports["bf16"], model, mode).at("activation_bytes_per_sample").get<double>();
      EXPECT_GT(fp32, 0.0) << model << " " << mode;
      // The activations halve; the ConvNet's max-pool indices stay int32 (4704 per sample), as do
      // BatchNorm's statistics (a few floats per channel: 1% of fp32's at a batch of 4).
      const double indices = std::string(model) == "convnet" ? 4704 * 4.0 : 0.0;
      EXPECT_LE(bf16, 0.5 * (fp32 + indices) + 0.01 * fp32) << model << " " << mode;
    }
}

// --graphs on (the default): after the warm-up, every engine's step is a replayed graph — one launch
// per graph (DP: one graph over every device, launched by the caller; DDP: one per rank, each on its
// worker), one host sync, no allocation, no pageable copy — and the losses are the eager ones.
TEST(Bench, GraphsReplayTheSteadyState) {
  TempDir dir("graphs");
  RunsPerValue runs;
  ASSERT_NO_FATAL_FAILURE(run_bench_per_value(
      dir, "--backend sim --devices 2 --models convnet --modes single,dp,ddp --batch-size 4 --steps 3 --warmup 3",
      "graphs", {"on", "off"}, runs));
  auto& reports = runs.reports;
  for (const std::string graphs : {"on", "off"})
    EXPECT_NE(runs.results[graphs].out.find("graphs " + graphs), std::string::npos) << runs.results[graphs].out;
  for (const std::string mode : {"single", "dp", "ddp"}) {
    SCOPED_TRACE(mode);
    const json& on = find_run(reports["on"], "convnet", mode);
    const json& off = find_run(reports["off"], "convnet", mode);
    EXPECT_EQ(on.at("graphs"), true);
    EXPECT_EQ(off.at("graphs"), false);
    EXPECT_EQ(on.at("loss_first"), off.at("loss_first"));
    EXPECT_EQ(on.at("loss_last"), off.at("loss_last"));
    EXPECT_EQ(on.at("allocations_per_step").get<double>(), 0.0);
    EXPECT_EQ(on.at("pageable_copies_per_step").get<double>(), 0.0);
    EXPECT_LE(on.at("host_syncs_per_step").get<double>(), 1.0);  // pipelined: the loss two steps back
    EXPECT_EQ(on.at("pipelined"), true);
    EXPECT_EQ(on.at("launches_per_step").get<double>(), mode == "ddp" ? 2.0 : 1.0);
    EXPECT_GT(off.at("launches_per_step").get<double>(), 20.0) << "eager: every kernel is a launch";
    for (const json& pd : on.at("per_device"))
      EXPECT_EQ(pd.at("worker_submits_per_step").get<double>(), mode == "ddp" ? 1.0 : 0.0);
  }
}

// Fused kernels (the loss's forward and backward in one launch, BatchNorm with its ReLU, a residual
// block's sum and ReLU, max-pool's backward without a zero fill, BatchNorm's batch count inside its
// variance pass), zero_grad without a fill (the backward writes the gradients) and a convolution's
// backward reusing the input its forward lowered (one im2col per convolution and step): fewer
// launches per eager step than before them (convnet 54, mlp 25, resnet8 167 at batch 16; 43, 22,
// 144 with the fusions alone; 40, 21, 134 with the sim's convolutions on the shared path), pinned at
// what they are now: the sim's convolutions in oneDNN, one launch per forward and per backward.
TEST(Bench, FusedKernelsCutLaunchesPerEagerStep) {
  TempDir dir("fused");
  const auto json_path = dir / "fused.json";
  const Result r = run_bench(dir, fmt::format("--backend sim --devices 2 --models convnet,mlp,resnet8 --modes single "
                                              "--batch-size 16 --steps 2 --warmup 1 --graphs off --json '{}'",
                                              json_path.string()));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json report = json::parse(read_file(json_path));
  const std::map<std::string, std::pair<double, double>> before_after = {
      {"convnet", {54.0, 32.0}}, {"mlp", {25.0, 21.0}}, {"resnet8", {167.0, 91.0}}};
  for (const auto& [model, counts] : before_after) {
    SCOPED_TRACE(model);
    const double launches = find_run(report, model, "single").at("launches_per_step").get<double>();
    EXPECT_LT(launches, counts.first);
    EXPECT_EQ(launches, counts.second);
  }
}

// The GPT's shape comes from dp_train's flags (one table): --context --layers --heads --width
// --vocab (its table padded to 128 rows as llm.c's) --gelu; the run reports that model's size, its
// tokens per sample and a GEMM FLOP count that grows with it.
TEST(Bench, TheGptTakesDpTrainsShapeFlags) {
  TempDir dir("gpt_shape");
  const fs::path json_path = dir / "report.json";
  const auto run_gpt = [&](const std::string& shape) {
    const Result r = run_bench(dir, fmt::format("--backend sim --devices 1 --models gpt --modes single --batch-size 2 "
                                                "--steps 1 --warmup 0 {} --json '{}'",
                                                shape, json_path.string()));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(r.out.find("round trip"), std::string::npos) << "one device: nothing to measure";
    const json report = json::parse(read_file(json_path));
    EXPECT_EQ(report.at("core_round_trip_ns").get<double>(), 0.0);
    return find_run(report, "gpt", "single");
  };
  const json small = run_gpt("--context 8 --layers 1 --heads 2 --width 16 --vocab 50 --gelu tanh");
  // wte 128 x 16 (50 padded), wpe 8 x 16, one block (12 C^2 + 13 C), ln_f (2 C).
  EXPECT_EQ(small.at("param_count").get<std::int64_t>(), 128 * 16 + 8 * 16 + (12 * 16 * 16 + 13 * 16) + 2 * 16);
  EXPECT_EQ(small.at("tokens_per_sample").get<int>(), 8);
  const json wider = run_gpt("--context 8 --layers 2 --heads 2 --width 16 --vocab 50");
  EXPECT_GT(wider.at("gemm_flops_per_sample").get<double>(), small.at("gemm_flops_per_sample").get<double>());
}

// Two devices that share one core cannot bounce a cache line between cores: the measurement
// gives up at its deadline and reports nothing (0, no line), and the runs go on.
TEST(Bench, DevicesOnOneCoreReportNoRoundTrip) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  int core = 0;
  while (!CPU_ISSET(core, &allowed)) ++core;
  TempDir dir("one_core");
  const fs::path json_path = dir / "report.json";
  const Result r = run_bench(dir,
                             fmt::format("--backend sim --devices 2 --models mlp --modes ddp --batch-size 2 "
                                         "--steps 1 --warmup 0 --json '{}'",
                                         json_path.string()),
                             fmt::format("taskset -c {}", core));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("round trip"), std::string::npos) << r.out;
  const json report = json::parse(read_file(json_path));
  EXPECT_EQ(report.at("core_round_trip_ns").get<double>(), 0.0);
  EXPECT_GT(find_run(report, "mlp", "ddp").at("samples_per_s").get<double>(), 0.0);
}

TEST(Bench, BadFlagsAreClearErrors) {
  TempDir dir("bad");
  struct Case {
    std::string args, message;
  };
  std::vector<Case> cases = {
      {"--backend sim --devices 0", "--devices: '0' is out of range (at least 1)"},
      {"--backend sim --devices 65", "--devices 65"},
      {"--backend sim --devices abc", "--devices"},
      {"--backend sim --models mlp,resnet", "unknown value 'resnet'"},
      {"--backend sim --models ,", "--models: empty list"},
      {"--backend sim --modes single,fsdp", "unknown value 'fsdp'"},
      {"--backend sim --batch-size 0", "--batch-size: '0' is out of range (at least 1)"},
      {"--backend sim --steps 0", "--steps: '0' is out of range (at least 1)"},
      {"--backend sim --warmup -1", "--warmup: '-1' is not a non-negative decimal integer"},
      // Integers are decimal and within their type: never read as hex, wrapped or capped.
      {"--backend sim --devices 0x10", "--devices: '0x10' is not a non-negative decimal integer"},
      {"--backend sim --seed -1", "--seed: '-1' is not a non-negative decimal integer"},
      {"--backend sim --seed 18446744073709551616",
       "--seed: '18446744073709551616' is out of range (at most 18446744073709551615)"},
      {"--backend sim --steps 2147483648", "--steps: '2147483648' is out of range (at most 2147483647)"},
      {"--backend sim --warmup 99999999999999999999", "--warmup: '99999999999999999999' is out of range"},
      {"--backend sim --batch-size 2147483648", "--batch-size: '2147483648' is out of range (at most 2147483647)"},
      {"--backend sim --devices 4294967297", "--devices: '4294967297' is out of range (at most 1048576)"},
      {"--backend sim --bucket-cap-mb 0", "--bucket-cap-mb: '0' is not a finite number > 0"},
      {"--backend tpu", "--backend: unknown value 'tpu' (expected auto, cuda or sim)"},
      {"--backend sim --precision fp16", "--precision: unknown value 'fp16' (expected strict, fast or tf32)"},
      {"--backend sim --grad-reduce fp16", "--grad-reduce"},
      {"--backend sim --broadcast-buffers maybe", "--broadcast-buffers"},
      {"--backend sim --graphs maybe", "--graphs: unknown value 'maybe' (expected on or off)"},
      {"--backend sim --dropout 1.5", "--dropout: '1.5' is not a finite number in [0, 1]"},
      {"--backend sim --shards 5000", "--shards: '5000' is out of range (at most 1024)"},
      {"--backend sim --zero 1 --modes single,dp", "--zero applies to --mode ddp, which --modes single,dp leaves out"},
      {"--backend sim --sync-bn --modes single", "--sync-bn applies to --mode ddp, which --modes single leaves out"},
      {"--backend sim --no-such-flag", "unknown flag --no-such-flag"},
      {"--backend sim -b 8", "unknown flag -b (did you mean --batch-size?)"},
      {"--backend sim --models nosuch", "--models: unknown value 'nosuch' (expected a comma list of mlp, convnet"},
      {"--backend sim --json /nonexistent-dir/x.json", "cannot write"},
      {"--backend sim --trace /proc/x.json", "cannot write /proc/x.json"},  // root passes access() there
      {"--backend sim --json same.json --trace ./same.json", "--json and --trace name the same file same.json"},
      {"--backend sim --json ''", "--json: empty value"},
      {"--backend sim --devices 2 --batch-size 1073741824", "a global batch of 2147483648 samples"},
      {"--backend sim --batch-size 100000000", "the synthetic inputs alone need"},
      {"--backend sim --batch-size 2147483647", "a global batch of 4294967294 samples is more than 2147483647"},
      {"--backend sim --devices 1 --batch-size 2147483647", "the synthetic inputs alone need 6288.0 GiB"},
  };
  if (dp::Runtime::cuda_device_count() == 0) cases.push_back({"--backend cuda", "--backend cuda"});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = run_bench(dir, c.args);
    EXPECT_EQ(r.exit_code, 2) << "every bad command line exits with 2";
    EXPECT_NE(r.err.find(c.message), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(r.out.find("samples/s"), std::string::npos) << "nothing was benchmarked";
  }
  // A run that fails leaves no report behind (written atomically, at the end).
  const std::string report = (dir / "report.json").string();
  const Result failed = run_bench(dir, "--backend sim --devices 100 --json " + report);
  EXPECT_EQ(failed.exit_code, 2);
  EXPECT_FALSE(std::filesystem::exists(report)) << "no empty or partial --json file";
  const Result help = run_bench(dir, "--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--bucket-cap-mb"), std::string::npos);
  // One line per flag, the shared ones as dp_train shows them, without CLI11's type names.
  for (const char* noise : {"UINT", "INT:", "DECIMAL", "TEXT", "FLOAT", "Excludes:"})
    EXPECT_EQ(help.out.find(noise), std::string::npos) << noise << " in:\n" << help.out;
  for (const char* shown :
       {"run (dp_train and dp_bench alike):", "the global batch in single and dp, per device in ddp",
        "every visible GPU, else 2 simulated", "--seed N", "(default 1;", "resnet34 "})
    EXPECT_NE(help.out.find(shown), std::string::npos) << shown << " in:\n" << help.out;
}

// A run that fails — refused up front, or after its outputs were checked — leaves no --json or
// --trace file, not even an empty or partial one, and no temporary file; files that were there
// keep their content.
TEST(Bench, FailedRunsLeaveNoReportNorTrace) {
  TempDir dir("failed");
  const fs::path out = dir / "out";
  fs::create_directories(out);
  const std::string json_path = (out / "x.json").string(), trace_path = (out / "y.trace.json").string();
  const std::string outputs = " --json " + json_path + " --trace " + trace_path;
  for (const std::string args : {"--backend sim --devices 100", "--backend sim --batch-size 2147483647",
                                 "--backend sim --broadcast-buffers maybe"}) {
    SCOPED_TRACE(args);
    Result r = run_bench(dir, args + outputs);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_FALSE(fs::exists(json_path));
    EXPECT_FALSE(fs::exists(trace_path));
    EXPECT_TRUE(fs::is_empty(out)) << "a temporary file was left in " << out;
    { std::ofstream(json_path) << "previous report"; }
    { std::ofstream(trace_path) << "previous trace"; }
    r = run_bench(dir, args + outputs);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(read_file(json_path), "previous report");
    EXPECT_EQ(read_file(trace_path), "previous trace");
    std::size_t files = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(out)) ++files;
    EXPECT_EQ(files, 2u) << "a temporary file was left in " << out;
    fs::remove(json_path);
    fs::remove(trace_path);
  }
}

}  // namespace
