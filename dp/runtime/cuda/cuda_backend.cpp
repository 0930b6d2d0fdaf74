// cuda_backend.cpp — real GPUs (host-side code only, so the host compiler builds it). Thin by
// design: a worker thread per device that makes the device current once, non-blocking streams,
// events, cudaMemcpyAsync with link accounting, and the device's cuBLAS and cuDNN handles, which
// kernels borrow through kernel_api::with_library. Nothing here runs on machines without a GPU;
// tests that need it GTEST_SKIP there.
#include <fmt/format.h>
#include <memory>
#include <mutex>
#include <vector>

#include "backend.h"
#include "dp/runtime/cuda_status.h"
#include "executor.h"

namespace dp::detail {
namespace {

// Makes `device` current on the calling thread if it is not (cheap: a thread-local read).
void make_device_current(int device) {
  int current = -1;
  DP_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) DP_CUDA_CHECK(cudaSetDevice(device));
}

// `device` current for a scope, the caller's device restored after: for calls that may come from
// any thread (allocation, events, streams, copies), which must leave the caller's current device
// as they found it. (Kernel launches make the stream's device current on purpose: make_current.)
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    DP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device)
      DP_CUDA_CHECK(cudaSetDevice(device));
    else
      previous_ = -1;  // nothing to restore
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);  // never throws from a destructor
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

class CudaRuntime;

class CudaEvent final : public EventImpl {
 public:
  CudaEvent(RuntimeImpl& runtime, int device) : runtime_(runtime), device_(device) {
    DeviceScope scope(device);
    DP_CUDA_CHECK(cudaEventCreate(&event_));
  }
  ~CudaEvent() override {
    if (event_) cudaEventDestroy(event_);  // never throws from a destructor
  }
  int device() const override { return device_; }
  bool query() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    DP_CUDA_CHECK(status);
    return true;
  }
  void synchronize() override {
    runtime_.count(device_, Counter::host_syncs);
    DP_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  double elapsed_ms_since(EventImpl& start) override {
    float ms = 0.0f;
    DP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<CudaEvent&>(start).event_, event_));
    return ms;
  }
  cudaEvent_t handle() const { return event_; }

 private:
  RuntimeImpl& runtime_;
  int device_;
  cudaEvent_t event_ = nullptr;
};

class CudaDevice;

// An instantiated graph (cudaGraphExec_t) and the host functions its host nodes call.
class CudaGraph final : public GraphImpl {
 public:
  CudaGraph(RuntimeImpl& runtime, int device, cudaStream_t stream, cudaGraph_t graph,
            std::vector<std::unique_ptr<std::function<void()>>> host_funcs)
      : runtime_(runtime), device_(device), stream_(stream), graph_(graph), host_funcs_(std::move(host_funcs)) {
    DeviceScope scope(device_);
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph_, 0);
    if (status != cudaSuccess) {
      cudaGraphDestroy(graph_);
      DP_CUDA_CHECK(status);
    }
  }
  ~CudaGraph() override {  // never throws
    DeviceScope scope(device_);
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void replay() override {
    runtime_.count(device_, Counter::launches);  // one graph launch
    DeviceScope scope(device_);
    DP_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
  }
  std::size_t nodes() const override {
    std::size_t count = 0;
    DP_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &count));
    return count;
  }

 private:
  RuntimeImpl& runtime_;
  int device_;
  cudaStream_t stream_;  // the capturing stream: the graph launches into it (the stream outlives
                         // its uses: engines keep both)
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<std::unique_ptr<std::function<void()>>> host_funcs_;
};

class CudaStream final : public StreamImpl {
 public:
  CudaStream(CudaRuntime& runtime, CudaDevice& device, int index);
  ~CudaStream() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  int device() const override { return index_; }
  Backend backend() const override { return Backend::cuda; }
  void record(EventImpl& event) override {
    if (event.device() != index_)
      throw DeviceMismatch(fmt::format("event of device {} recorded on a stream of device {}", event.device(), index_));
    DP_CUDA_CHECK(cudaEventRecord(static_cast<CudaEvent&>(event).handle(), stream_));
  }
  void wait(EventImpl& event) override {
    DP_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).handle(), 0));
  }
  bool query() override {
    const cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) return false;
    DP_CUDA_CHECK(status);
    return true;
  }
  void synchronize() override {
    count(Counter::host_syncs);
    DP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy(void* dst, const void* src, std::size_t bytes) override;
  void launch_host_func(std::function<void()> fn) override {
    if (capturing()) {
      // A captured host node runs at every replay with the same argument: the graph owns it.
      captured_host_funcs_.push_back(std::make_unique<std::function<void()>>(std::move(fn)));
      DP_CUDA_CHECK(cudaLaunchHostFunc(
          stream_, [](void* data) { (*static_cast<std::function<void()>*>(data))(); },
          captured_host_funcs_.back().get()));
      return;
    }
    auto* heap = new std::function<void()>(std::move(fn));
    const cudaError_t status = cudaLaunchHostFunc(
        stream_,
        [](void* data) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(data));
          (*f)();
        },
        heap);
    if (status != cudaSuccess) delete heap;
    DP_CUDA_CHECK(status);
  }
  void check_access(const void*, std::size_t, const char*) override {}  // the GPU faults on its own
  void enqueue_kernel(const char* name, std::function<void()>, SpanKind) override {
    throw Error(fmt::format("kernel '{}' has no CUDA build; it was compiled without nvcc", name));
  }
  void enqueue_reissued(const char* name, std::function<std::function<void()>()>, SpanKind) override {
    throw Error(fmt::format("'{}' is simulator work; cuda streams run native kernels", name));
  }
  // Thread-local mode: the calls CUDA forbids during a capture fail on the capturing thread; other
  // threads (a data loader's allocations) are not affected.
  void begin_capture() override {
    DeviceScope scope(index_);
    DP_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  }
  std::shared_ptr<GraphImpl> end_capture() override;
  bool capturing() override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    DP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status != cudaStreamCaptureStatusNone;
  }
  void* native_handle() override { return stream_; }
  int multiprocessor_count() const override { return sm_count_; }
  void make_current() override { detail::make_device_current(index_); }
  void with_library(kernel_api::Library library, const std::function<void(kernel_api::LibraryCall&)>& fn) override;
  RuntimeImpl& runtime() const override;

 private:
  CudaRuntime& runtime_;
  CudaDevice& device_;
  int index_;
  int sm_count_ = 1;
  std::vector<std::unique_ptr<std::function<void()>>> captured_host_funcs_;  // for the graph being captured
  cudaStream_t stream_ = nullptr;
};

class CudaDevice final : public DeviceImpl {
 public:
  CudaDevice(CudaRuntime& runtime, int index)
      : runtime_(runtime),
        index_(index),
        memory_(0),
        worker_(fmt::format("cuda{}.worker", index), [index] { DP_CUDA_CHECK(cudaSetDevice(index)); }) {
    // Handle and properties are created on the worker thread, which owns them.
    submit([this] {
      cudaDeviceProp prop{};
      DP_CUDA_CHECK(cudaGetDeviceProperties(&prop, index_));
      name_ = fmt::format("cuda:{} ({})", index_, prop.name);
      sm_count_ = prop.multiProcessorCount;
      std::size_t free_bytes = 0, total_bytes = 0;
      DP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      memory_.set_capacity(total_bytes);
      DP_CUDA_CHECK(cublasCreate(&cublas_));
      // Exact fp32 (no TF32) so GPU results match the host results within fp32 rounding.
      DP_CUDA_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
    }).get();
  }
  ~CudaDevice() override {
    // On the worker that created them; what kernels cached for a library (cuDNN plans) goes first.
    auto done = submit([this] {
      for (Lent& lent : lent_) lent.cache.reset();
      if (cudnn_) cudnnDestroy(cudnn_);
      if (cublas_) cublasDestroy(cublas_);
    });
    done.wait();
  }
  Backend backend() const override { return Backend::cuda; }
  std::string name() const override { return name_; }
  void* allocate(std::size_t bytes) override {
    count(Counter::allocations);
    DeviceScope scope(index_);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the non-sticky error
      const auto stats = memory_.stats();
      throw OutOfMemory(index_, bytes, stats.in_use, stats.capacity);
    }
    DP_CUDA_CHECK(status);
    memory_.reserve(bytes);  // accounting only: the driver already granted it
    return ptr;
  }
  void free(void* ptr, std::size_t bytes) noexcept override {
    try {
      DeviceScope scope(index_);
      cudaFree(ptr);
    } catch (...) {  // never throws: cudaFree reports nothing either
    }
    memory_.release(bytes);
  }
  MemoryStats memory() const override { return memory_.stats(); }
  void reset_peak_memory() override { memory_.reset_peak(); }
  std::shared_ptr<StreamImpl> create_stream() override;
  std::shared_ptr<EventImpl> create_event() override;
  void synchronize() override {
    count(Counter::host_syncs);
    DeviceScope scope(index_);
    DP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::future<void> submit(std::function<void()> task) override {
    count(Counter::worker_submits);
    auto packaged = std::make_shared<std::packaged_task<void()>>(std::move(task));
    auto future = packaged->get_future();
    worker_.post([packaged] { (*packaged)(); });
    return future;
  }
  int sm_count() const { return sm_count_; }
  void count(Counter counter);
  // Library handles are not safe for concurrent use; the streams of one device take turns.
  void with_library(kernel_api::Library library, cudaStream_t stream,
                    const std::function<void(kernel_api::LibraryCall&)>& fn) {
    make_device_current(index_);
    Lent& lent = lent_[static_cast<std::size_t>(library)];
    std::lock_guard lock(lent.mutex);
    void* handle = nullptr;
    if (library == kernel_api::Library::cublas) {
      DP_CUDA_CHECK(cublasSetStream(cublas_, stream));
      handle = cublas_;
    } else {
      if (!cudnn_) DP_CUDA_CHECK(cudnnCreate(&cudnn_));  // on first use: it loads cuDNN's kernels
      DP_CUDA_CHECK(cudnnSetStream(cudnn_, stream));
      handle = cudnn_;
    }
    kernel_api::LibraryCall call{handle, lent.cache};
    fn(call);
  }

 private:
  CudaRuntime& runtime_;
  int index_;
  std::string name_;
  int sm_count_ = 1;
  MemoryCounter memory_;
  struct Lent {
    std::mutex mutex;
    std::shared_ptr<void> cache;
  };
  Lent lent_[2];  // by kernel_api::Library
  cublasHandle_t cublas_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  SerialExecutor worker_;
};

class CudaRuntime final : public RuntimeImpl {
 public:
  explicit CudaRuntime(int count) : RuntimeImpl(count) {
    for (int i = 0; i < count; ++i) add_device(std::make_unique<CudaDevice>(*this, i));
    // Peer access where the topology allows it: peer copies then go over NVLink/PCIe directly.
    for (int i = 0; i < count; ++i)
      for (int j = 0; j < count; ++j) {
        if (i == j) continue;
        int can = 0;
        DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, i, j));
        if (!can) continue;
        DP_CUDA_CHECK(cudaSetDevice(i));
        const cudaError_t status = cudaDeviceEnablePeerAccess(j, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled)
          cudaGetLastError();
        else
          DP_CUDA_CHECK(status);
      }
  }
  Backend backend() const override { return Backend::cuda; }
  void* allocate_pinned(std::size_t bytes) override {
    void* ptr = nullptr;
    DP_CUDA_CHECK(cudaMallocHost(&ptr, bytes));
    return ptr;
  }
  void free_pinned(void* ptr) noexcept override { cudaFreeHost(ptr); }
};

CudaStream::CudaStream(CudaRuntime& runtime, CudaDevice& device, int index)
    : runtime_(runtime), device_(device), index_(index), sm_count_(device.sm_count()) {
  DeviceScope scope(index);
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

std::shared_ptr<StreamImpl> CudaDevice::create_stream() {
  return std::make_shared<CudaStream>(runtime_, *this, index_);
}

// Host memory the driver does not know (not cudaMallocHost'd nor registered): copies stage it.
bool pageable(const void* ptr) {
  cudaPointerAttributes attributes{};
  DP_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  return attributes.type == cudaMemoryTypeUnregistered;
}

// Where a pointer lives: a device index, or kHost for pinned and pageable host memory.
int location_of(const void* ptr) {
  cudaPointerAttributes attributes{};
  DP_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged ? attributes.device
                                                                                             : kHost;
}

void CudaStream::copy(void* dst, const void* src, std::size_t bytes) {
  const int src_loc = location_of(src), dst_loc = location_of(dst);
  runtime_.count_copy(src_loc, dst_loc, bytes);
  const bool src_pageable = src_loc == kHost && pageable(src), dst_pageable = dst_loc == kHost && pageable(dst);
  if (src_pageable || dst_pageable) count(Counter::pageable_copies);
  // Into pageable memory cudaMemcpyAsync returns once the copy is done: the host waited.
  if (dst_pageable) count(Counter::host_syncs);
  DeviceScope scope(index_);
  if (src_loc != kHost && dst_loc != kHost && src_loc != dst_loc)
    DP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_loc, src, src_loc, bytes, stream_));
  else
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
}

RuntimeImpl& CudaStream::runtime() const { return runtime_; }
std::shared_ptr<GraphImpl> CudaStream::end_capture() {
  DeviceScope scope(index_);
  cudaGraph_t graph = nullptr;
  const cudaError_t status = cudaStreamEndCapture(stream_, &graph);
  auto host_funcs = std::move(captured_host_funcs_);
  captured_host_funcs_.clear();
  if (status != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    throw CaptureError(fmt::format("stream capture on device {} failed: {} ({})", index_, cudaGetErrorName(status),
                                   cudaGetErrorString(status)));
  }
  return std::make_shared<CudaGraph>(runtime(), index_, stream_, graph, std::move(host_funcs));
}

void CudaDevice::count(Counter counter) { runtime_.count(index_, counter); }
std::shared_ptr<EventImpl> CudaDevice::create_event() { return std::make_shared<CudaEvent>(runtime_, index_); }

void CudaStream::with_library(kernel_api::Library library, const std::function<void(kernel_api::LibraryCall&)>& fn) {
  device_.with_library(library, stream_, fn);
}

}  // namespace

int cuda_device_count_impl() {
  int count = 0;
  // Any error (no driver, driver too old for this toolkit) means "no GPU".
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool cuda_compiled_impl() { return true; }

std::unique_ptr<RuntimeImpl> make_cuda_runtime(const RuntimeOptions&) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0)
    throw Error(fmt::format("cuda backend: no CUDA device is visible ({})",
                            status != cudaSuccess ? cudaGetErrorString(status) : "device count is 0"));
  return std::make_unique<CudaRuntime>(count);
}

}  // namespace dp::detail
