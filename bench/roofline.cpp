// roofline.cpp — see roofline.h.
#include "roofline.h"

#include <algorithm>
#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp_bench {

std::vector<std::string> gpu_names() {
  std::vector<std::string> names;
  for (const GpuPeaks& g : kGpuPeaks) names.emplace_back(g.name);
  return names;
}

const GpuPeaks& gpu_peaks(std::string_view name) {
  for (const GpuPeaks& g : kGpuPeaks)
    if (name == g.name) return g;
  throw dp::InvalidArgument(fmt::format("no peaks known for GPU '{}'", name));
}

Roofline roofline(const GpuPeaks& gpu, double bytes, double flops, const std::string& precision, dp::Autocast amp) {
  Roofline r;
  r.gpu = gpu.name;
  double peak = gpu.fp32_flops;
  r.peak = "fp32";
  if (amp == dp::Autocast::bf16) {
    peak = gpu.bf16_flops;
    r.peak = "bf16";
  } else if (precision == "tf32") {
    peak = gpu.tf32_flops;
    r.peak = "tf32";
  }
  r.memory_ms = bytes / gpu.hbm_bytes_per_s * 1e3;
  r.compute_ms = flops / peak * 1e3;
  r.estimate_ms = std::max(r.memory_ms, r.compute_ms);
  r.bound = r.memory_ms >= r.compute_ms ? "memory" : "compute";
  return r;
}

}  // namespace dp_bench
