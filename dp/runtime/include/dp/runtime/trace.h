// dp/runtime/trace.h — what the streams did and when: spans recorded while profiling is on
// (Runtime::set_profiling), for traces (dp_bench --trace) and busy-time accounting.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace dp {

// What a piece of stream work is. `sync` is an event record or wait, `host` a host callback: the
// device neither computes nor moves data during them.
enum class SpanKind { kernel, gemm, copy, collective, host, sync };

// "kernel", "gemm", "copy", "collective", "host", "sync" (trace categories, JSON).
std::string_view to_string(SpanKind kind);

// Whether a span of this kind keeps the device busy (computing or moving data).
constexpr bool is_busy(SpanKind kind) { return kind != SpanKind::host && kind != SpanKind::sync; }

// One piece of stream work, recorded while profiling is on (sim: every task of every stream).
struct TraceSpan {
  int device = 0;
  int stream = 0;    // runtime-wide stream id
  std::string name;  // kernel or operation name, e.g. "gemm", "copy", "all_reduce"
  SpanKind kind = SpanKind::kernel;
  std::int64_t start_ns = 0;  // steady clock
  std::int64_t end_ns = 0;
};

}  // namespace dp
