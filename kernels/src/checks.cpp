// checks.cpp — the launchers' shared checks (see checks.h).
#include "checks.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp::kernels::checks {

Text::Text(int number) : value(fmt::format("{}", number)) {}
Text::Text(long number) : value(fmt::format("{}", number)) {}
Text::Text(long long number) : value(fmt::format("{}", number)) {}
Text::Text(float number) : value(fmt::format("{}", number)) {}
Text::Text(double number) : value(fmt::format("{}", number)) {}

void fail(std::initializer_list<Text> message) {
  std::string text;
  for (const Text& piece : message) text += piece.value;
  throw InvalidArgument(text);
}

void present(const char* op, NamedPointers pointers) {
  for (const auto& [what, ptr] : pointers)
    if (ptr == nullptr) fail({op, ": ", what, " is null"});
}

std::string describe(const Pool2dShape& s) {
  return format_dims(
      {{"N", s.n}, {"C", s.c}, {"H", s.h}, {"W", s.w}, {"kernel", s.kernel}, {"stride", s.stride}, {"pad", s.pad}});
}

void pool2d(const char* op, const Pool2dShape& s) {
  const auto bad = [&](const char* why) { fail({op, ": ", why, " in shape ", describe(s)}); };
  if (s.n < 0 || s.c < 0 || s.h < 0 || s.w < 0) bad("negative extent");
  if (s.kernel < 1 || s.stride < 1) bad("kernel and stride must be positive");
  if (s.pad < 0 || s.pad > s.kernel / 2) bad("pad must be in [0, kernel/2]");
  if (s.h + 2 * s.pad < s.kernel || s.w + 2 * s.pad < s.kernel) bad("output size is too small");
}

void same_storage(const char* op, std::initializer_list<bool> bf16) {
  for (const bool b : bf16)
    if (b != *bf16.begin()) fail({op, ": operands of different storage (fp32 and bf16)"});
}

}  // namespace dp::kernels::checks
