// dp/runtime/bfloat16.h — bfloat16 values as their 16 bits, converted as the GPU converts them, written once
// for host and device so that the sim and the cuda backend give the same bits: float -> bf16
// rounds to nearest, ties to even (__float2bfloat16_rn, PTX cvt.rn.bf16.f32), with CUDA's one NaN
// 0x7fff for every NaN (torch's CPU conversion keeps 0x7fc0; a NaN gradient stops the run either
// way); bf16 -> float is exact. A sum of two bf16 values is their float sum rounded back: exact
// before the rounding wherever it matters, so it equals the correctly rounded sum (__hadd, NCCL's
// bf16 reduction).
#pragma once

#include <cstdint>
#include <cstring>

#include "dp/runtime/detail/kernel_api.h"

namespace dp {

DP_HD inline std::uint16_t bf16_from_float(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  u += 0x7fffu + ((u >> 16) & 1u);  // finite values near the largest round to infinity, as the GPU's
  return static_cast<std::uint16_t>(u >> 16);
}

DP_HD inline float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float x = 0.0f;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

DP_HD inline std::uint16_t bf16_add(std::uint16_t a, std::uint16_t b) {
  return bf16_from_float(bf16_to_float(a) + bf16_to_float(b));
}

}  // namespace dp
