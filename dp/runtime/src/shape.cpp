// shape.cpp — element counts and shape printing (dp/shape.h), span kind names (dp/trace.h).
#include "dp/runtime/shape.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <limits>

#include "dp/runtime/error.h"
#include "dp/runtime/trace.h"

namespace dp {

std::size_t numel(std::span<const std::int64_t> shape) {
  bool empty = false;
  for (const std::int64_t d : shape) {
    if (d < 0) throw InvalidArgument(fmt::format("shape {} has a negative extent", format_shape(shape)));
    empty = empty || d == 0;
  }
  if (empty) return 0;  // whatever the other extents, in any order
  std::size_t n = 1;
  for (const std::int64_t d : shape) {
    const auto extent = static_cast<std::size_t>(d);
    if (n > std::numeric_limits<std::size_t>::max() / extent)
      throw InvalidArgument(fmt::format("shape {} has more elements than fit in 64 bits", format_shape(shape)));
    n *= extent;
  }
  return n;
}

std::string format_shape(std::span<const std::int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string format_dims(std::initializer_list<std::pair<std::string_view, std::int64_t>> dims) {
  std::string out = "(";
  for (const auto& [name, extent] : dims) {
    if (out.size() > 1) out += ", ";
    fmt::format_to(std::back_inserter(out), "{}={}", name, extent);
  }
  return out + ")";
}

std::string_view to_string(SpanKind kind) {
  switch (kind) {
    case SpanKind::kernel: return "kernel";
    case SpanKind::gemm: return "gemm";
    case SpanKind::copy: return "copy";
    case SpanKind::collective: return "collective";
    case SpanKind::host: return "host";
    case SpanKind::sync: return "sync";
  }
  return "unknown";
}

}  // namespace dp
