// precision.cpp — the names of the precision policies (dp/precision.h).
#include "dp/runtime/precision.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp {

std::string_view to_string(Precision precision) { return precision == Precision::fast ? "fast" : "strict"; }

Precision parse_precision(std::string_view text) {
  if (text == "strict") return Precision::strict;
  if (text == "fast") return Precision::fast;
  throw InvalidArgument(fmt::format("unknown precision '{}' (expected strict or fast)", text));
}

}  // namespace dp
