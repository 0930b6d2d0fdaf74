// address_space.h — the up-front check that a run fits the process's address-space limit
// (ulimit -v), shared by dp_train and dp_bench.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fmt/format.h>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/resource.h>
#include <thread>

#include "exit_codes.h"

namespace dp::tools {

// Besides the run's own memory (`bytes`), the sim's GEMMs take address space: OpenBLAS maps a
// 128 MiB buffer per thread that calls it (each simulated device's stream) and per thread of its
// own pool, and when that mapping fails it retries forever, spinning at 100% CPU rather than
// failing. So a limit too small for them is refused before anything runs. `what` names what
// `bytes` counts.
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

inline void check_address_space(std::uint64_t bytes, std::uint64_t sim_devices, const std::string& what) {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  constexpr std::uint64_t kBlasBuffer = std::uint64_t{128} << 20, kProcess = std::uint64_t{64} << 20;
  const std::uint64_t blas_threads =
      sim_devices == 0 ? 0 : sim_devices + std::max(1u, std::thread::hardware_concurrency());
  // What the process maps already counts against the limit too: with the cuda backend built in,
  // the CUDA libraries alone take hundreds of MiB. (Far below overflow: bytes is checked.)
  const std::uint64_t needed = mapped_bytes() + bytes + blas_threads * kBlasBuffer + kProcess;
  if (needed <= limit.rlim_cur) return;
  const auto gib = [](std::uint64_t b) { return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1u << 30)); };
  throw UsageError(fmt::format("this run needs at least {} of address space ({}{}), the process may use {} (ulimit -v)",
                               gib(needed), what, sim_devices ? ", OpenBLAS's buffers" : "", gib(limit.rlim_cur)));
}

}  // namespace dp::tools
