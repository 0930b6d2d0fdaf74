// roofline.h — what a step should take on a named GPU, from the memory traffic it declares and the
// FLOPs of its GEMMs and convolutions: the larger of bytes / HBM bandwidth and FLOPs / peak. A lower
// bound (every byte moved once, every FLOP at peak), to set beside what a GPU measures; a GPU is not
// needed to compute it, so GPU speed can be reasoned about on the simulator.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dp/runtime/precision.h"

namespace dp_bench {

// Peaks from NVIDIA's data sheets (SXM parts, dense: no structured-sparsity doubling).
struct GpuPeaks {
  const char* name;
  double hbm_bytes_per_s;
  double fp32_flops, tf32_flops, bf16_flops;  // CUDA cores; tensor cores (TF32, BF16 with fp32 accumulation)
};
inline constexpr GpuPeaks kGpuPeaks[] = {
    {"h100", 3.35e12, 67e12, 494.7e12, 989.4e12},  // H100 SXM5 80 GB: HBM3
    {"h200", 4.8e12, 67e12, 494.7e12, 989.4e12},   // H200 SXM 141 GB: HBM3e, H100's compute
    {"a100", 2.039e12, 19.5e12, 156e12, 312e12},   // A100 SXM 80 GB: HBM2e
};
std::vector<std::string> gpu_names();
const GpuPeaks& gpu_peaks(std::string_view name);

struct Roofline {
  std::string gpu;
  double memory_ms = 0, compute_ms = 0, estimate_ms = 0;
  std::string bound;  // "memory" or "compute"
  std::string peak;   // which peak the FLOPs ran at: "fp32", "tf32" or "bf16"
};
// `precision` and `amp` as the run's flags say: strict and fast GEMMs run at the fp32 peak (no TF32),
// tf32 at the TF32 tensor-core peak, --amp bf16 at the BF16 one.
Roofline roofline(const GpuPeaks& gpu, double bytes, double flops, const std::string& precision, dp::Autocast amp);

}  // namespace dp_bench
