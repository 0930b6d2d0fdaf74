// dp/kernels/platform.h — the index type and helpers of kernel arithmetic written once for host and device
// (DP_HD comes from the runtime's kernel API).
#pragma once

#include <cstdint>

#include "dp/runtime/detail/kernel_api.h"

namespace dp::kernels {

using index_t = std::int64_t;

constexpr DP_HD index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }

// a*b rounded to fp32 on its own. Neither compiler contracts kernel arithmetic (host code builds
// with -ffp-contract=off, the kernels' device code with --fmad=false: kernels/CMakeLists.txt), so
// host and device round alike by construction; __fmul_rn keeps this product unfused even in a unit
// built without that flag. (The host also gets -mfma, so fmaf is one instruction, not a libm call.)
DP_HD inline float mul_unfused(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// Division by a divisor fixed at launch, as a multiply-high and a shift (Granlund-Montgomery
// round-up method, as CUTLASS's FastDivmod). Kernel index maps (convolution, channels)
// split element indices; hardware integer division is a long instruction sequence on GPUs and costs
// tens of cycles on CPUs, where it made im2col many times slower than the GEMM it feeds.
// Exact for 0 <= n < 2^31 and 1 <= d < 2^31: m = ceil(2^p / d) with p = 31 + ceil(log2 d)
// overshoots 2^p / d by less than 2^(p-31) / d, which n < 2^31 keeps below one quotient step.
struct FastDivmod {
  int divisor = 1;
  std::uint32_t multiplier = 0;  // unused when divisor == 1
  unsigned shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(int d) : divisor(d) {
    if (d == 1) return;
    unsigned log2 = 0;
    while ((std::uint64_t{1} << log2) < static_cast<std::uint64_t>(d)) ++log2;
    const unsigned p = 31 + log2;
    multiplier = static_cast<std::uint32_t>(((std::uint64_t{1} << p) + static_cast<std::uint64_t>(d) - 1) /
                                            static_cast<std::uint64_t>(d));
    shift = p - 32;
  }
  DP_HD int div(int n) const {
    if (divisor == 1) return n;
    return static_cast<int>(((static_cast<std::uint64_t>(n) * multiplier) >> 32) >> shift);
  }
  // quotient and remainder
  DP_HD int divmod(int n, int& remainder) const {
    const int q = div(n);
    remainder = n - q * divisor;
    return q;
  }
};

using kernel_api::Operand;
using kernel_api::operand;

}  // namespace dp::kernels
