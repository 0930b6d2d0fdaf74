// measure.h — one benchmark run: a model trained in one mode (single, dp, ddp) through warm-up and
// measured steps, and the figures taken from them (timings, traffic, memory, host work, spans).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/engines/data_parallel.h"
#include "dp/runtime/device.h"
#include "dp/runtime/process_group.h"
#include "dp/runtime/trace.h"
#include "options.h"
#include "roofline.h"

namespace dp_bench {

// Synthetic data, generated once for the largest global batch: pixels in [0, 1), labels 0..9.
struct Data {
  std::vector<float> inputs;
  std::vector<std::int64_t> labels;
  std::size_t sample_floats = 0;
};

Data make_data(int samples, std::size_t sample_floats, std::uint64_t seed);

struct PerDevice {
  int device = 0;
  int process = 0;
  std::string host;
  std::optional<double> busy_pct;  // null on cuda (no spans recorded)
  std::optional<double> gemm_ms_per_step;
  // The device's share of the model's GEMM and convolution FLOPs over the measured window's wall
  // time: the whole step's rate, so it cannot pass the machine's peak.
  std::optional<double> model_gflops;
  double bytes_sent = 0, bytes_received = 0;  // device-to-device within the process (intra-node), per step
  double net_sent = 0, net_received = 0;      // to and from other processes (inter-node), per step
  std::uint64_t peak_bytes = 0;
  int samples_per_step = 0;
  // What the host asked of the device per measured step (Runtime::counters).
  double launches = 0, host_syncs = 0, allocations = 0, pageable_copies = 0, worker_submits = 0;
};

// The per-device figures by JSON key, so that the gather across processes and the report each
// name every figure once.
struct SpanFigure {  // needs the measured steps' spans: null where none were recorded
  const char* key;
  std::optional<double> PerDevice::*member;
};
inline constexpr std::array<SpanFigure, 3> kSpanFigures{{{"busy_pct", &PerDevice::busy_pct},
                                                         {"gemm_ms_per_step", &PerDevice::gemm_ms_per_step},
                                                         {"model_gflops", &PerDevice::model_gflops}}};

struct ByteFigure {  // per step; the report writes whole numbers as integers
  const char* key;
  double PerDevice::*member;
};
inline constexpr std::array<ByteFigure, 4> kByteFigures{{{"bytes_sent", &PerDevice::bytes_sent},
                                                         {"bytes_received", &PerDevice::bytes_received},
                                                         {"bytes_sent_inter_node", &PerDevice::net_sent},
                                                         {"bytes_received_inter_node", &PerDevice::net_received}}};

struct CounterFigure {  // per step, from Runtime::counters
  const char* key;
  std::uint64_t dp::DeviceCounters::*counter;
  double PerDevice::*member;
  bool summed;  // a run's figure is the sum over its devices; else the busiest device's
};
inline constexpr std::array<CounterFigure, 5> kCounterFigures{{
    {"launches_per_step", &dp::DeviceCounters::launches, &PerDevice::launches, true},
    {"host_syncs_per_step", &dp::DeviceCounters::host_syncs, &PerDevice::host_syncs, true},
    {"allocations_per_step", &dp::DeviceCounters::allocations, &PerDevice::allocations, true},
    {"pageable_copies_per_step", &dp::DeviceCounters::pageable_copies, &PerDevice::pageable_copies, true},
    {"worker_submits_per_step", &dp::DeviceCounters::worker_submits, &PerDevice::worker_submits, false},
}};

struct PhaseField {
  const char* name;
  double dp::DataParallelPhases::*member;
};
inline constexpr std::array<PhaseField, 8> kPhases{{{"broadcast", &dp::DataParallelPhases::broadcast},
                                                    {"scatter", &dp::DataParallelPhases::scatter},
                                                    {"forward", &dp::DataParallelPhases::forward},
                                                    {"gather", &dp::DataParallelPhases::gather},
                                                    {"loss", &dp::DataParallelPhases::loss},
                                                    {"backward", &dp::DataParallelPhases::backward},
                                                    {"reduce", &dp::DataParallelPhases::reduce},
                                                    {"update", &dp::DataParallelPhases::update}}};

// The members the JSON report shows are named as its keys (report.cpp writes them by name).
struct Run {
  std::string model, mode;
  std::vector<int> device_ids;  // this process's
  int devices = 0;              // every process's (ddp across processes), else device_ids.size()
  int batch_per_device = 0, global_batch = 0;
  std::size_t param_count = 0, buffers_bytes = 0;
  int tokens_per_sample = 1;  // a sequence model's positions (Model::targets_per_sample)
  // GEMM FLOPs per sample of one training step of the model as this run built it (the registry's).
  double gemm_flops_per_sample = 0;
  // What a train forward keeps for the backward, per sample (the model on device 0: DP's source,
  // DDP's rank 0): activations between layers and layers' saved state (Model::saved_activation_bytes).
  std::size_t activation_bytes_per_sample = 0;
  // Optimizer state per device (the largest of the engine's optimizers): under --zero a 1/ranks slice.
  std::size_t optimizer_state_bytes = 0;
  std::size_t gradient_bytes = 0;  // Engine::gradient_bytes: what one device keeps
  std::vector<double> step_ms;
  double wall_ms = 0, samples_per_s = 0, step_ms_median = 0, step_ms_p90 = 0, step_ms_mean = 0;
  // The spread of the measured steps: the 90th percentile over the 10th (1: every step alike), so a
  // run that two steps' noise would not move still shows how steady it was.
  double step_ms_p10 = 0, step_spread = 0;
  double tokens_per_s = 0;  // samples_per_s x tokens_per_sample
  std::optional<double> scaling_efficiency;
  std::optional<dp::DataParallelPhases> phases;   // dp only: averaged over the measured steps
  std::optional<std::size_t> buckets;             // ddp only: gradient buckets (all-reduces per step)
  std::optional<double> unchecked_samples_per_s;  // --check-cost: the same run with the check off
  // --check-cost with --check-replicas N <= --steps: the same run without the replicas' check.
  std::optional<double> unchecked_replicas_samples_per_s;
  // --check-cost with --shards and --shadow-shards K <= --steps: the same run without shadow shards.
  std::optional<double> unshadowed_samples_per_s;
  // The collectives' signature check over the measured steps, per step (dp::collective_check_totals,
  // this process): agreements summed over its ranks, and their host time per rank in microseconds.
  double check_agreements_per_step = 0, check_us_per_step = 0;
  bool graphs = false;     // every measured step was a replayed graph
  bool pipelined = false;  // measured steps submitted without waiting (--pipeline)
  std::vector<PerDevice> per_device;
  // The memory traffic of one eager step (the first warm-up step's, Runtime::memory_traffic) on the
  // device that moves the most, every kernel of it, the most bytes first; none without warm-up.
  std::optional<double> bytes_per_step;
  std::vector<dp::KernelTraffic> top_kernels;
  std::optional<Roofline> roofline;  // that step on Options::roofline's GPU
  float loss_first = 0, loss_last = 0;
  // For the trace: the measured window, its step boundaries and its spans.
  std::int64_t t0 = 0, t1 = 0;
  std::vector<std::int64_t> step_starts;
  std::vector<dp::TraceSpan> spans;
  double trace_offset_ms = 0;
};

// A run that loses a device (DP_FAULT=lose@...) under --shards and goes on without it, against the
// same run undisturbed: what the loss costs (dp_train's recovery, in one process: the survivors' state
// to the host, an engine on the survivors, the state back, the failed step again).
struct Recovery {
  std::string model, mode;
  int steps = 0;              // warm-up and measured steps, each run
  int device = -1;            // the device lost
  std::int64_t step = 0;      // the step that failed (1-based)
  std::vector<int> devices;   // the survivors
  double rebuild_ms = 0;      // from the failure to the engine on the survivors, with the state
  double redone_step_ms = 0;  // the failed step, again, on the survivors
  double disturbed_ms = 0;    // the whole run with the loss
  double undisturbed_ms = 0;  // the same steps on every device, none lost
};

// `mode` with --shards over devices 0..devices-1 in a runtime of its own (the lost device stays
// lost there), the run with DP_FAULT's lose fault first (the fault is then spent), then undisturbed.
Recovery measure_recovery(const Options& o, const std::string& model_name, const std::string& mode, const Data& data,
                          int devices);

// The round trip of one cache line between the host cores that sim devices 0 and 1 run on (their
// workers' cores), in ns: the fastest of 20 batches of 1,000 trips, 250 ms at most (a few ms on
// cores of their own); 0 on cuda or with one device. Every byte one simulated device hands another
// pays it, so it tells apart runs of one build that differ: a VM's two vCPUs on one die or on two
// (measured 54 ns or 330 ns).
double core_round_trip_ns(dp::Runtime& rt);

// One run: `mode` over devices 0..devices-1 (single: device 0 alone), the model on device 0 (DP's
// source and output device, DDP's rank 0), picked once as an Engine and driven through it.
// Under mpirun, ddp spans every process (`processes`), and every device's figures end up on all.
Run bench(dp::Runtime& rt, const Options& o, const std::string& model_name, const std::string& mode, const Data& data,
          int devices, const std::shared_ptr<dp::ProcessGroup>& processes);

}  // namespace dp_bench
