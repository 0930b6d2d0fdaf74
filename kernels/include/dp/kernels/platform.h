// platform.h — the index type and helpers of kernel arithmetic written once for host and device
// (DP_HD comes from the runtime's kernel API).
#pragma once

#include <cstdint>

#include "dp/runtime/kernel_api.h"

namespace dp::kernels {

using index_t = std::int64_t;

constexpr DP_HD index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }

using kernel_api::Operand;
using kernel_api::operand;

}  // namespace dp::kernels
