// platform.h — lets kernel arithmetic be written once for host and device compilers.
#pragma once

#if defined(__CUDACC__)
#define DP_HD __host__ __device__
#else
#define DP_HD
#endif

#include <cstdint>

namespace dp::kernels {
using index_t = std::int64_t;

constexpr DP_HD index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
}  // namespace dp::kernels
