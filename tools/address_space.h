// address_space.h — the up-front check that a run fits the process's address-space limit
// (ulimit -v), shared by dp_train and dp_bench.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fmt/format.h>
#include <fstream>
#include <malloc.h>
#include <pthread.h>
#include <sstream>
#include <string>
#include <sys/resource.h>
#include <thread>

#include "exit_codes.h"

namespace dp::tools {

// The process's address-space limit (ulimit -v), 0 when there is none.
inline std::uint64_t address_space_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 0;
  return limit.rlim_cur;
}

// Under an address-space limit, malloc keeps to its main arena: every further arena reserves 64 MiB
// of address space, up to 8 per core, far more than the memory the threads use (the limit's
// classic trouble, as with MALLOC_ARENA_MAX). Called before the threads start.
inline void keep_malloc_to_one_arena() {
  if (address_space_limit() != 0) mallopt(M_ARENA_MAX, 1);
}

// The threads a simulated device starts for its streams (compute, copies, communication), at most.
inline constexpr std::uint64_t kThreadsPerSimDevice = 6;

// The address space this process maps now (VmSize), 0 where /proc does not say.
inline std::uint64_t mapped_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmSize:", 0) == 0) {
      std::uint64_t kib = 0;
      std::istringstream(line.substr(7)) >> kib;
      return kib << 10;
    }
  return 0;
}

// The stack a new thread maps (ulimit -s, 8 MiB by default), with its guard page.
inline std::uint64_t thread_stack_bytes() {
  pthread_attr_t attr;
  std::size_t stack = std::size_t{8} << 20;
  if (pthread_getattr_default_np(&attr) == 0) {
    pthread_attr_getstacksize(&attr, &stack);
    pthread_attr_destroy(&attr);
  }
  return stack + 4096;
}

// Refuses (UsageError, exit 2) a run whose address space would pass the limit, before it starts:
// what the process maps now, the run's own memory (`bytes`; `what` names what it counts), a stack
// for each of the `threads` it will start, and the sim's GEMM buffers. OpenBLAS (Debian's
// openblas-pthread) maps BUFFER_SIZE (128 MiB) plus a page for each thread inside a GEMM at once:
// each simulated device's stream and each thread of its own pool. When that mapping fails it
// retries forever, spinning at 100% CPU and deaf to SIGTERM, so it must never fail.
inline void check_address_space(std::uint64_t bytes, std::uint64_t sim_devices, std::uint64_t threads,
                                const std::string& what) {
  const std::uint64_t limit = address_space_limit();
  if (limit == 0) return;
  constexpr std::uint64_t kBlasBuffer = (std::uint64_t{128} << 20) + 4096, kProcess = std::uint64_t{64} << 20;
  const std::uint64_t blas_threads =
      sim_devices == 0 ? 0 : sim_devices + std::max(1u, std::thread::hardware_concurrency());
  // What the process maps already counts against the limit too: with the cuda backend built in,
  // the CUDA libraries alone take hundreds of MiB. (Far below overflow: bytes is checked.)
  const std::uint64_t needed =
      mapped_bytes() + bytes + blas_threads * kBlasBuffer + threads * thread_stack_bytes() + kProcess;
  if (needed <= limit) return;
  const auto gib = [](std::uint64_t b) { return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1u << 30)); };
  throw UsageError(fmt::format(
      "this run needs at least {} of address space ({}, {} threads' stacks{}), the process may use {} (ulimit -v)",
      gib(needed), what, threads, sim_devices ? fmt::format(", OpenBLAS's {} GEMM buffers", blas_threads) : "",
      gib(limit)));
}

}  // namespace dp::tools
