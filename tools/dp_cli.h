// dp_cli.h — the file rules dp_train and dp_bench share (their flags are tables: flags.h).
#pragma once

#include <filesystem>
#include <string>

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

}  // namespace dp_cli
