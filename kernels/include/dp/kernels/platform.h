// platform.h — the index type and helpers of kernel arithmetic written once for host and device
// (DP_HD comes from the runtime's kernel API).
#pragma once

#include <cstdint>

#include "dp/runtime/kernel_api.h"

namespace dp::kernels {

using index_t = std::int64_t;

constexpr DP_HD index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }

// a*b rounded to fp32 on its own. nvcc contracts a*b + c into one FMA by default; __fmul_rn is
// never contracted. The host compiler does not contract: the build passes -ffp-contract=off for
// all host code (it also passes -mfma, so fmaf is one instruction rather than a libm call).
DP_HD inline float mul_unfused(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

using kernel_api::Operand;
using kernel_api::operand;

}  // namespace dp::kernels
