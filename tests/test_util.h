// test_util.h — shared helpers: runtimes per backend (skipping without a GPU), host<->device vectors.
#pragma once

#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <map>
#include <memory>
#include <netinet/in.h>
#include <random>
#include <stdexcept>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "dp/runtime/bfloat16.h"
#include "dp/runtime/device.h"

namespace dp::test {

// A shell command's exit code (-1 when it did not exit normally) and its stdout and stderr together.
struct CommandResult {
  int code = -1;
  std::string output;
};
inline CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe)) result.output += buffer.data();
  const int status = pclose(pipe);
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// A TCP port of 127.0.0.1 that no one listens on now, chosen by the kernel (bind to port 0): tests
// run in parallel, and ports derived from process ids collide between them.
inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("free_tcp_port: no socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof address;
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0;
  ::close(fd);
  if (!bound) throw std::runtime_error("free_tcp_port: the kernel gave no port");
  return ntohs(address.sin_port);
}

// A cuda runtime of at least `devices` dp devices: one per GPU where there are that many GPUs, else
// `devices` on each GPU (RuntimeOptions::devices_per_gpu, their collectives on the device ring), so
// that every multi-device test also runs on a machine with one GPU.
inline std::unique_ptr<Runtime> cuda_runtime(int devices) {
  RuntimeOptions options;
  options.backend = "cuda";
  if (Runtime::cuda_device_count() < devices) options.devices_per_gpu = devices;
  return Runtime::create(options);
}

// A runtime of the named backend with at least `devices` devices, or nullptr when that backend
// cannot run here (the caller skips).
inline std::unique_ptr<Runtime> runtime_or_skip(const std::string& backend, int devices = 2) {
  if (backend == "cuda") return Runtime::cuda_device_count() == 0 ? nullptr : cuda_runtime(devices);
  RuntimeOptions options;
  options.backend = backend;
  options.sim_devices = devices;
  return Runtime::create(options);
}

#define DP_RUNTIME_OR_SKIP(var, backend, ...)                                                \
  auto var = ::dp::test::runtime_or_skip(backend, ##__VA_ARGS__);                            \
  if (!var)                                                                                  \
  GTEST_SKIP() << "no CUDA device: "                                                         \
               << (::dp::Runtime::cuda_compiled() ? "cudaGetDeviceCount found no usable GPU" \
                                                  : "dp was built without the cuda backend")

// tests/golden/<name>.safetensors: ctest sets DP_GOLDEN_DIR; a test binary run by hand finds the
// source tree's copy.
inline std::string golden_path(const std::string& name) {
  const char* dir = std::getenv("DP_GOLDEN_DIR");
  return std::string(dir ? dir : DP_SOURCE_GOLDEN_DIR) + "/" + name + ".safetensors";
}

inline std::unique_ptr<Runtime> sim_runtime(int devices, std::size_t capacity = std::size_t{1} << 30) {
  RuntimeOptions options;
  options.backend = "sim";
  options.sim_devices = devices;
  options.sim_capacity_bytes = capacity;
  return Runtime::create(options);
}

template <class T>
DeviceBuffer upload(Device& device, const Stream& stream, const std::vector<T>& host) {
  DeviceBuffer buffer = device.allocate(host.size() * sizeof(T));
  stream.copy(buffer.data(), host.data(), buffer.size());
  return buffer;
}

template <class T>
std::vector<T> download(const Stream& stream, const DeviceBuffer& buffer) {
  std::vector<T> host(buffer.size() / sizeof(T));
  stream.copy(host.data(), buffer.data(), buffer.size());  // pageable destination: returns when written
  return host;
}

// One test body per backend (Caffe's typed tests): instantiate with Values("sim", "cuda"); the
// cuda instances skip with the reason where no GPU is usable.
class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    runtime_ = runtime_or_skip(GetParam(), 2);
    if (!runtime_) GTEST_SKIP() << "no CUDA device: the cuda backend cannot run on this machine";
    // The last device, not 0 (device 1 of the two simulated ones): catches code that silently
    // assumes the first device, yet still runs on a one-GPU machine.
    device_ = &runtime_->device(runtime_->device_count() - 1);
    stream_ = device_->create_stream();
  }
  // Host <-> the test's device, on its stream.
  template <class T>
  DeviceBuffer up(const std::vector<T>& host) {
    return upload(*device_, stream_, host);
  }
  template <class T>
  std::vector<T> down(const DeviceBuffer& buffer) {
    return download<T>(stream_, buffer);
  }
  DeviceBuffer floats(std::size_t n) { return device_->allocate(n * sizeof(float)); }
  // Bytes and launches by kernel on the test's device since the last reset_memory_traffic, once
  // the stream's work is done (Runtime::memory_traffic).
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> traffic() {
    stream_.synchronize();
    std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> out;
    for (const KernelTraffic& k : runtime_->memory_traffic(device_->index())) out[k.kernel] = {k.bytes, k.launches};
    return out;
  }

  std::unique_ptr<Runtime> runtime_;
  Device* device_ = nullptr;
  Stream stream_;
};

// Values as bf16 bits (rounded to nearest even, as the GPU rounds), and bf16 bits as floats (exact).
inline std::vector<std::uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<std::uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = bf16_from_float(v[i]);
  return b;
}
inline std::vector<float> bf16_values(const std::vector<std::uint16_t>& b) {
  std::vector<float> v(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
  return v;
}

inline std::vector<float> random_vector(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// n class indices in [0, classes), uniformly drawn.
inline std::vector<std::int64_t> random_targets(int n, int classes, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::int64_t> dist(0, classes - 1);
  std::vector<std::int64_t> t(static_cast<std::size_t>(n));
  for (auto& v : t) v = dist(gen);
  return t;
}

// |got - want| <= atol + rtol*|want| everywhere; reports the first mismatching indices.
inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                                            double atol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  int shown = 0;
  std::size_t bad = 0;
  std::string detail;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(diff <= atol + rtol * std::fabs(static_cast<double>(want[i])))) {
      ++bad;
      if (shown++ < 5)
        detail += " [" + std::to_string(i) + "] got " + std::to_string(got[i]) + " want " + std::to_string(want[i]);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ:" << detail;
}

// A fresh directory for one test's files (named by the process and `name`: ctest runs tests of
// one binary in parallel processes), removed afterwards.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(std::filesystem::temp_directory_path() / fmt::format("dp_test_{}_{}", ::getpid(), name)) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& file) const { return path_ / file; }

 private:
  std::filesystem::path path_;
};

// A golden's tolerance for fp32 tensors PyTorch and dp sum in different orders: elementwise rtol
// 1e-4 plus 2e-5 of the golden tensor's largest |value| (each caller says why that is enough).
inline ::testing::AssertionResult matches_golden(const std::vector<float>& got, const std::vector<float>& want) {
  float scale = 0.0f;
  for (float v : want) scale = std::max(scale, std::fabs(v));
  return all_close(got, want, 1e-4, 2e-5 * scale + 1e-7);
}

// `count` floats of device memory, copied to the host (the stream's copy waits for its work).
inline std::vector<float> to_host(const Stream& stream, const float* device_ptr, std::size_t count) {
  std::vector<float> out(count);
  stream.copy(out.data(), device_ptr, count * sizeof(float));
  return out;
}

}  // namespace dp::test
