// fuzz_cli.cpp — dp_train's command line: the fuzzer's bytes are split at newlines into arguments
// (at most 24). Whatever they say, parsing and every check run() makes before it touches a file or a
// device end in Options or in a refusal (dp::Error, the tools' UsageError among them) — never a
// crash, an unexpected exception type (std::out_of_range from a number, say) or a hang.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dp/runtime/error.h"
#include "train_cli.h"
#include "train_run.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // CLI11 prints help and refusals; the fuzzer's own report goes to stderr, so only stdout is muted.
  if (!std::freopen("/dev/null", "w", stdout)) return 1;
  dp_train::g_job.start();  // one process, no mpirun
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"dp_train"};
  std::string current;
  for (std::size_t i = 0; i < size && args.size() < 25; ++i) {
    if (data[i] == '\n') {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(static_cast<char>(data[i]));
    }
  }
  if (args.size() < 25) args.push_back(current);
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  dp_train::Options o;
  try {
    if (dp_train::parse_command_line(static_cast<int>(argv.size()), argv.data(), o) == dp_train::Parsed::run)
      dp_train::check_options(o);
  } catch (const dp::Error&) {
  }
  return 0;
}
