// precision.cpp — the names of the precision policies (dp/precision.h).
#include "dp/runtime/precision.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp {

std::string_view to_string(Precision precision) {
  switch (precision) {
    case Precision::fast: return "fast";
    case Precision::tf32: return "tf32";
    case Precision::strict: break;
  }
  return "strict";
}

Precision parse_precision(std::string_view text) {
  if (text == "strict") return Precision::strict;
  if (text == "fast") return Precision::fast;
  if (text == "tf32") return Precision::tf32;
  throw InvalidArgument(fmt::format("unknown precision '{}' (expected strict, fast or tf32)", text));
}

std::string_view to_string(Autocast autocast) { return autocast == Autocast::bf16 ? "bf16" : "off"; }

Autocast parse_autocast(std::string_view text) {
  if (text == "off") return Autocast::off;
  if (text == "bf16") return Autocast::bf16;
  throw InvalidArgument(fmt::format("unknown autocast dtype '{}' (expected off or bf16)", text));
}

}  // namespace dp
