// dp/runtime/call_site.h — the file and line of a call, taken where a defaulted argument is
// evaluated, as std::source_location does. std::source_location itself is not used: libstdc++'s
// needs __builtin_source_location, which clang 14 (the fuzzing build's compiler) lacks, while
// __builtin_FILE and __builtin_LINE exist in GCC, Clang and nvcc alike.
#pragma once

namespace dp {

struct CallSite {
  const char* file = "";
  unsigned line = 0;

  // A defaulted `CallSite where = CallSite::here()` parameter names its caller's line.
  static constexpr CallSite here(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) noexcept {
    return {file, line};
  }
};

}  // namespace dp
