// exit_codes.h — one exit code per cause, for every dp tool (the README's table): dp::exit_code's
// (2 bad input or a configuration that does not fit, device or host memory; 3 non-finite values; 1
// anything else; a failure on one device of several judged by its cause), and 2 for the tools' own
// UsageError, with a hint for the causes a user can act on.
#pragma once

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fmt/format.h>
#include <new>
#include <string>
#include <sys/resource.h>

#include "dp/runtime/error.h"

namespace dp::tools {

// A failure the user caused (a bad flag value, a bad file): its message, exit code 2.
struct UsageError : dp::Error {
  using dp::Error::Error;
};

enum ExitCode : int { kExitOk = 0, kExitFailure = 1, kExitBadInput = 2, kExitDiverged = 3, kExitDeviceLost = 7 };

struct Verdict {
  int code = kExitFailure;
  const char* hint = "";  // appended to the error's message
};

// Whether a host allocation failed in this process (judge saw std::bad_alloc).
inline bool& host_memory_failed() {
  static bool failed = false;
  return failed;
}

// Whether `error` (on its own or as a device's WorkerError) is a collective aborted because of
// another failure: a consequence, never the failure to report.
inline bool is_consequence(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const WorkerError& w) {
    return w.cause() && is_consequence(w.cause());
  } catch (const CollectiveAborted&) {
    return true;
  } catch (...) {
    return false;
  }
}

// UsageError is the tools' own (2); every other cause takes dp::exit_code's code, with a hint.
inline Verdict judge(const std::exception_ptr& error) {
  const auto cause = [](const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const WorkerError& w) {
      return w.cause() ? w.cause() : e;
    } catch (...) {
      return e;
    }
  };
  try {
    std::rethrow_exception(cause(error));
  } catch (const UsageError&) {
    return {kExitBadInput};
  } catch (const OutOfMemory&) {
    return {kExitBadInput, ": the configuration does not fit (a smaller --batch-size or model)"};
  } catch (const std::bad_alloc&) {
    host_memory_failed() = true;
    return {kExitBadInput,
            ": out of host memory: the configuration does not fit (a smaller --batch-size, model or data set)"};
  } catch (...) {
    return {dp::exit_code(error)};
  }
}

// Prints "<tool>: error<where>: <what failed><hint>" on stderr and returns the exit code of the
// cause (`where`: which process, under mpirun).
inline int report_failure(const char* tool, const std::string& where, const std::exception_ptr& error) {
  const Verdict verdict = judge(error);
  try {
    std::rethrow_exception(error);
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: error{}: a host allocation failed{}\n", tool, where, verdict.hint);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error{}: {}{}\n", tool, where, e.what(), verdict.hint);
  } catch (...) {
    fmt::print(stderr, "{}: error{}: unknown exception\n", tool, where);
  }
  return verdict.code;
}

// A write past the file-size limit (ulimit -f) fails with EFBIG, which the writer reports (exit 2,
// the target as it was, no temporary file left), instead of SIGXFSZ killing the process half-way
// through a save.
inline void fail_writes_past_the_file_size_limit() { std::signal(SIGXFSZ, SIG_IGN); }

// The way out of main. Under a host memory shortage, OpenBLAS's threads (its pool starts when the
// library loads) may be retrying a buffer mapping forever, and the library's exit handler joins
// them: the process would spin at 100% CPU instead of exiting. So after a failed host allocation,
// or with an address-space limit (ulimit -v) in force, the process leaves without exit handlers,
// its streams flushed first. (Sanitizer builds cannot run under such a limit; their leak check,
// an exit handler, still runs everywhere else.)
inline int leave(int code) {
  rlimit limit{};
  const bool limited = getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
  if (host_memory_failed() || limited) {
    std::fflush(nullptr);
    std::_Exit(code);
  }
  return code;
}

}  // namespace dp::tools
