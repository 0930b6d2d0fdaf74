// microbench.cpp — GEMM throughput per device (alone and all devices at once), device-to-device
// copy bandwidth, and all-reduce over dp::Communicator reported the way nccl-tests does (time,
// algbw, busbw), on whatever backend is available. The shapes are the reference models' GEMMs.
#include <CLI/CLI.hpp>
#include <chrono>
#include <fmt/format.h>
#include <vector>

#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"

namespace {

struct Shape {
  const char* what;
  int m, n, k;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `reps` GEMMs on each listed device concurrently; returns the wall time.
double run_gemms(dp::Runtime& rt, const std::vector<int>& devices, const Shape& s, int reps) {
  struct PerDevice {
    dp::DeviceBuffer a, b, c;
    dp::Stream stream;
  };
  std::vector<PerDevice> per(devices.size());
  for (std::size_t i = 0; i < devices.size(); ++i) {
    dp::Device& d = rt.device(devices[i]);
    per[i].stream = d.create_stream();
    per[i].a = d.allocate(sizeof(float) * s.m * s.k);
    per[i].b = d.allocate(sizeof(float) * s.k * s.n);
    per[i].c = d.allocate(sizeof(float) * s.m * s.n);
    dp::kernels::fill(per[i].stream, per[i].a.as<float>(), s.m * s.k, 0.5f);
    dp::kernels::fill(per[i].stream, per[i].b.as<float>(), s.k * s.n, 0.25f);
    per[i].stream.synchronize();
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (auto& p : per)
      dp::kernels::gemm(p.stream, false, false, s.m, s.n, s.k, 1.0f, p.a.as<float>(), s.k, p.b.as<float>(), s.n, 0.0f,
                        p.c.as<float>(), s.n);
  for (auto& p : per) p.stream.synchronize();
  return seconds_since(t0);
}

// nccl-tests' all_reduce_perf, out of place replaced by in place: for each size, every rank
// enqueues `iters` all-reduces (sum, float) on its own stream from its own worker thread, then all
// streams are synchronised. time = wall / iters; algbw = bytes / time; busbw = algbw * 2(N-1)/N,
// the bytes each rank's busiest link carries in a ring, comparable with the link bandwidth.
void run_all_reduce(dp::Runtime& rt, int devices, std::size_t min_bytes, std::size_t max_bytes, int iters) {
  std::vector<int> ids(static_cast<std::size_t>(devices));
  for (int i = 0; i < devices; ++i) ids[static_cast<std::size_t>(i)] = i;
  dp::DeviceGroup group(rt, ids);
  auto comm = dp::Communicator::create(group);
  std::vector<dp::Stream> streams;
  std::vector<dp::DeviceBuffer> buffers;
  for (int r = 0; r < devices; ++r) {
    streams.push_back(group.device(r).create_stream());
    buffers.push_back(group.device(r).allocate(max_bytes));
    dp::kernels::fill(streams.back(), buffers.back().as<float>(), static_cast<dp::kernels::index_t>(max_bytes / 4),
                      1.0f);
  }
  auto all_reduce = [&](std::size_t count, int times) {
    group.run([&](int r) {
      for (int i = 0; i < times; ++i)
        comm->all_reduce(r, streams[static_cast<std::size_t>(r)], buffers[static_cast<std::size_t>(r)].as<float>(),
                         count, dp::ReduceOp::sum);
    });
    for (auto& s : streams) s.synchronize();
  };
  // Correctness once: every element of ones summed over N ranks is N on every rank.
  all_reduce(max_bytes / 4, 1);
  bool ok = true;
  for (int r = 0; r < devices; ++r) {
    float first = 0, last = 0;
    const float* data = buffers[static_cast<std::size_t>(r)].as<float>();
    streams[static_cast<std::size_t>(r)].copy(&first, data, sizeof(float));
    streams[static_cast<std::size_t>(r)].copy(&last, data + max_bytes / 4 - 1, sizeof(float));
    ok = ok && first == static_cast<float>(devices) && last == static_cast<float>(devices);
  }
  const double bus_factor = 2.0 * (devices - 1) / devices;
  fmt::print("\nall-reduce (sum, float32, in place) over {} devices, {} iterations per size; check: {}\n", devices,
             iters, ok ? "ok" : "WRONG");
  fmt::print("{:>12} {:>12} {:>12} {:>12} {:>12}\n", "size (B)", "count", "time (us)", "algbw GB/s", "busbw GB/s");
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / 4;
    all_reduce(count, 2);  // warm-up: staging buffers, peers meeting
    const auto t0 = std::chrono::steady_clock::now();
    all_reduce(count, iters);
    const double seconds = seconds_since(t0) / iters;
    const double algbw = static_cast<double>(bytes) / seconds / 1e9;
    fmt::print("{:>12} {:>12} {:>12.1f} {:>12.3f} {:>12.3f}\n", bytes, count, seconds * 1e6, algbw, algbw * bus_factor);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dp micro-benchmarks: GEMM GFLOP/s per device and device-to-device copy bandwidth"};
  std::string backend = "auto";
  int devices = 2, reps = 50;
  std::size_t copy_mib = 64;
  std::size_t ar_min_bytes = 4096, ar_max_mib = 64;
  int ar_iters = 10;
  app.add_option("--backend", backend, "auto, cuda or sim")->check(CLI::IsMember({"auto", "cuda", "sim"}));
  app.add_option("--devices", devices, "devices to use (sim: how many to simulate)")->check(CLI::Range(1, 64));
  app.add_option("--reps", reps, "GEMMs per measurement")->check(CLI::Range(1, 100000));
  app.add_option("--copy-mib", copy_mib, "bytes per copy, MiB")->check(CLI::Range(1, 4096));
  app.add_option("--allreduce-min-bytes", ar_min_bytes, "smallest all-reduce, bytes (sizes grow x4)")
      ->check(CLI::Range(std::size_t{4}, std::size_t{1} << 32));
  app.add_option("--allreduce-max-mib", ar_max_mib, "largest all-reduce, MiB")->check(CLI::Range(1, 4096));
  app.add_option("--allreduce-iters", ar_iters, "all-reduces per size")->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);

  try {
    dp::RuntimeOptions options;
    options.backend = backend;
    options.sim_devices = devices;
    auto rt = dp::Runtime::create(options);
    if (devices > rt->device_count())
      throw dp::InvalidArgument(fmt::format("--devices {}: only {} available", devices, rt->device_count()));
    std::vector<int> all(devices);
    for (int i = 0; i < devices; ++i) all[i] = i;
    fmt::print("backend {} with {} device(s)\n\n", dp::to_string(rt->backend()), devices);

    const Shape shapes[] = {{"MLP fc1 forward (64x784 . 784x256)", 64, 256, 784},
                            {"MLP fc2 forward (64x256 . 256x256)", 64, 256, 256},
                            {"ConvNet conv2 im2col (3136x400 . 400x32)", 3136, 32, 400},
                            {"square 512", 512, 512, 512}};
    fmt::print("{:<44} {:>14} {:>22}\n", "GEMM", "1 device GF/s", fmt::format("{} devices GF/s each", devices));
    for (const Shape& s : shapes) {
      const double flops = 2.0 * s.m * s.n * s.k * reps;
      run_gemms(*rt, {0}, s, 2);  // warm-up
      const double alone = run_gemms(*rt, {0}, s, reps);
      const double together = run_gemms(*rt, all, s, reps);
      fmt::print("{:<44} {:>14.2f} {:>22.2f}\n", s.what, flops / alone / 1e9, flops / together / 1e9);
    }

    if (devices >= 2) {
      const std::size_t bytes = copy_mib << 20;
      dp::DeviceBuffer src = rt->device(0).allocate(bytes), dst = rt->device(1).allocate(bytes);
      dp::Stream s = rt->device(1).create_stream();
      s.copy(dst.data(), src.data(), bytes);
      s.synchronize();
      const int copies = 10;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < copies; ++i) s.copy(dst.data(), src.data(), bytes);
      s.synchronize();
      const double dt = seconds_since(t0);
      fmt::print("\ncopy device 0 -> 1: {} x {} MiB in {:.1f} ms = {:.2f} GB/s (link counter: {} bytes)\n", copies,
                 copy_mib, dt * 1e3, copies * static_cast<double>(bytes) / dt / 1e9, rt->link_traffic(0, 1).bytes);
      run_all_reduce(*rt, devices, ar_min_bytes / 4 * 4, ar_max_mib << 20, ar_iters);
    }
  } catch (const dp::Error& e) {
    fmt::print(stderr, "dp_microbench: {}\n", e.what());
    return 1;
  }
  return 0;
}
