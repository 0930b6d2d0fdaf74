// dp_cli.h — the command-line rules dp_train and dp_bench share (see the README's exit codes).
// Integers are decimal only and within their type: CLI11 alone reads 0x10 as 16, -1 into an
// unsigned as 2^64-1, and caps a value past the type's range at its largest value.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

namespace dp_cli {

// Whether two paths name one file (after resolving symbolic links and relative paths; either may not
// exist yet): outputs must not overwrite each other or an input.
inline bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  // Absolute first: weakly_canonical leaves a relative path whose first part does not exist as it
  // is, so "x.json" and "./x.json" would differ until x.json exists.
  std::error_code ec;
  const auto resolve = [&](const std::string& p) {
    return std::filesystem::weakly_canonical(std::filesystem::absolute(p, ec), ec);
  };
  return resolve(a) == resolve(b);
}

// Accepts decimal digits only (no sign, 0x, spaces or exponent) for a value of at most `max`;
// the refusal names the bound readably.
inline CLI::Validator decimal(std::uint64_t max) {
  return CLI::Validator(
      [max](const std::string& text) {
        if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
          return fmt::format("'{}' is not a non-negative decimal integer", text);
        std::uint64_t value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error != std::errc() || end != text.data() + text.size() || value > max)
          return fmt::format("'{}' is out of range (at most {})", text, max);
        return std::string();
      },
      "DECIMAL");
}

template <class T>
struct integer_of {
  using type = T;
};
template <class T>
struct integer_of<std::optional<T>> {
  using type = T;
};

// An integer option (into an integer or an optional one): decimal, at most the type's largest
// value, or `max` when that is lower.
template <class T>
CLI::Option* add_integer(CLI::App& app, const std::string& name, T& value, const std::string& description,
                         std::uint64_t max = std::numeric_limits<typename integer_of<T>::type>::max()) {
  using Integer = typename integer_of<T>::type;
  static_assert(std::is_integral_v<Integer> && !std::is_same_v<Integer, bool>, "an integer option");
  const auto largest = static_cast<std::uint64_t>(std::numeric_limits<Integer>::max());
  return app.add_option(name, value, description)->check(decimal(max < largest ? max : largest));
}

}  // namespace dp_cli
