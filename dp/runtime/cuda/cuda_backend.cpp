// cuda_backend.cpp — real GPUs (host-side code only, so the host compiler builds it). Thin by
// design: a worker thread per device that makes the device current once, non-blocking streams,
// events, cudaMemcpyAsync with link accounting, each stream's own cuBLAS and cuDNN handles, which
// kernels borrow through kernel_api::with_library, and — while profiling — timing events around
// the work each stream enqueues, turned into trace spans. Nothing here runs on machines without a
// GPU; tests that need it GTEST_SKIP there.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <fmt/format.h>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "device_scope.h"
#include "dp/runtime/detail/cuda_status.h"
#include "dp/runtime/scratch.h"
#include "executor.h"
#include "launch_group.h"

namespace dp::detail {
namespace {

// Makes `device` current on the calling thread if it is not (cheap: a thread-local read); returns
// the device that was current, or -1 when it already was `device`.
int make_device_current(int device) {
  int current = -1;
  DP_CUDA_CHECK(cudaGetDevice(&current));
  if (current == device) return -1;
  DP_CUDA_CHECK(cudaSetDevice(device));
  return current;
}

// What the driver knows of a pointer (any host or device address; unknown host memory is
// cudaMemoryTypeUnregistered, not an error).
cudaPointerAttributes attributes_of(const void* ptr) {
  cudaPointerAttributes attributes{};
  DP_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  return attributes;
}

// A query's answer: true when the work is done; false when it is pending, the "not ready" then left
// in the thread's last-error slot for clear_not_ready() (See Note [last error]); any other error
// throws.
bool done_or_pending(cudaError_t status, const char* call) {
  if (status == cudaErrorNotReady) return false;
  cuda::check(status, call, __FILE__, __LINE__);
  return true;
}

// Captures the calling thread has begun and not yet ended (thread-local capture mode): where it is
// not zero, an allocation goes to cudaMalloc, which refuses it as CUDA does during a capture.
thread_local int t_captures_begun = 0;
// The device-ring calls captured on this thread since its outermost capture began.
thread_local std::vector<CapturedRingCall> t_ring_calls;

// cuBLAS's recommended workspace per handle: 32 MiB on Hopper and later, 4 MiB before (cuBLAS
// docs, cublasSetWorkspace). Given at handle creation, so no GEMM allocates.
std::size_t cublas_workspace_bytes(int compute_major) {
  return compute_major >= 9 ? std::size_t{32} << 20 : std::size_t{4} << 20;
}

// The timing events of one stream while profiling: a pair per piece of work (kernel, library
// call, copy, collective), taken from a pool that only grows to the number of spans between two
// take_trace() calls, so steady-state profiling creates no events. Shared by the stream and the
// runtime (which converts them to spans, also after the stream is gone).
class SpanLog {
 public:
  SpanLog(int device, int gpu, int stream_id) : device_(device), gpu_(gpu), stream_id_(stream_id) {}
  ~SpanLog() {
    for (const Pending& p : pending_) {
      if (p.start) cudaEventDestroy(p.start);  // never throws from a destructor
      if (p.end) cudaEventDestroy(p.end);
    }
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  SpanLog(const SpanLog&) = delete;
  SpanLog& operator=(const SpanLog&) = delete;
  int device() const { return device_; }

  void begin(cudaStream_t stream, const char* name, SpanKind kind) {
    std::lock_guard lock(mutex_);
    if (!pending_.empty() && !pending_.back().end) {  // a launch that failed left its span open
      pool_.push_back(pending_.back().start);
      pending_.pop_back();
    }
    cudaEvent_t start = take_event();
    if (const cudaError_t status = cudaEventRecord(start, stream); status != cudaSuccess) {
      pool_.push_back(start);
      DP_CUDA_CHECK(status);
    }
    pending_.push_back(Pending{name, kind, start, nullptr});
    open_.store(true, std::memory_order_relaxed);
  }
  void end(cudaStream_t stream) {
    if (!open_.load(std::memory_order_relaxed)) return;  // not profiling: no lock taken
    std::lock_guard lock(mutex_);
    open_.store(false, std::memory_order_relaxed);
    if (pending_.empty() || pending_.back().end) return;
    cudaEvent_t end = take_event();
    if (const cudaError_t status = cudaEventRecord(end, stream); status != cudaSuccess) {
      pool_.push_back(end);
      DP_CUDA_CHECK(status);
    }
    pending_.back().end = end;
  }
  // Converts every closed span to steady-clock times: `reference` completed at `reference_ns`.
  // Waits for the spans' end events (take_trace runs after the work it traces).
  void collect(RuntimeImpl& runtime, cudaEvent_t reference, std::int64_t reference_ns) {
    std::lock_guard lock(mutex_);
    std::size_t kept = 0;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      if (!p.end) {  // still open: it is the last one
        pending_[kept++] = p;
        continue;
      }
      DP_CUDA_CHECK(cudaEventSynchronize(p.end));
      float start_ms = 0.0f, end_ms = 0.0f;
      DP_CUDA_CHECK(cudaEventElapsedTime(&start_ms, reference, p.start));
      DP_CUDA_CHECK(cudaEventElapsedTime(&end_ms, reference, p.end));
      runtime.add_span(device_, stream_id_,
                       Span{p.name, p.kind, reference_ns + static_cast<std::int64_t>(double{start_ms} * 1e6),
                            reference_ns + static_cast<std::int64_t>(double{end_ms} * 1e6)});
      pool_.push_back(p.start);
      pool_.push_back(p.end);
    }
    pending_.resize(kept);
  }

 private:
  struct Pending {
    const char* name;
    SpanKind kind;
    cudaEvent_t start;
    cudaEvent_t end;
  };
  cudaEvent_t take_event() {
    if (!pool_.empty()) {
      cudaEvent_t e = pool_.back();
      pool_.pop_back();
      return e;
    }
    const DeviceScope scope(gpu_);
    cudaEvent_t e = nullptr;
    DP_CUDA_CHECK(cudaEventCreate(&e));  // with timing, unlike synchronisation-only events
    return e;
  }

  int device_, gpu_, stream_id_;
  std::mutex mutex_;
  std::atomic<bool> open_{false};
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> pool_;
};

class CudaRuntime;

class CudaEvent final : public EventImpl {
 public:
  CudaEvent(RuntimeImpl& runtime, int device, EventTiming timing)
      : runtime_(runtime), device_(device), timing_(timing) {
    DeviceScope scope(runtime.gpu_of(device));
    DP_CUDA_CHECK(
        cudaEventCreateWithFlags(&event_, timing == EventTiming::on ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    if (event_) cudaEventDestroy(event_);  // never throws from a destructor
  }
  int device() const override { return device_; }
  bool query() override { return done_or_pending(cudaEventQuery(event_), "cudaEventQuery(event_)"); }
  void clear_not_ready() noexcept override { (void)cudaGetLastError(); }
  void synchronize() override {
    runtime_.count(device_, Counter::host_syncs);
    DP_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  double elapsed_ms_since(EventImpl& start) override {
    // cudaEventElapsedTime says cudaErrorInvalidResourceHandle; the simulator's words are clearer.
    if (timing_ == EventTiming::off || static_cast<CudaEvent&>(start).timing_ == EventTiming::off)
      throw InvalidArgument(
          "Event::elapsed_ms: both events must be created with EventTiming::on (cudaEventDisableTiming events have "
          "no timestamps)");
    float ms = 0.0f;
    DP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<CudaEvent&>(start).event_, event_));
    return ms;
  }
  cudaEvent_t handle() const { return event_; }
  // Whether the latest record was made inside a capture: a wait on it joins that capture.
  bool recorded_in_capture() const { return recorded_in_capture_.load(std::memory_order_relaxed); }
  void set_recorded_in_capture(bool in_capture) { recorded_in_capture_.store(in_capture, std::memory_order_relaxed); }

 private:
  RuntimeImpl& runtime_;
  int device_;
  EventTiming timing_;
  cudaEvent_t event_ = nullptr;
  std::atomic<bool> recorded_in_capture_{false};
};

class CudaDevice;

// An instantiated graph (cudaGraphExec_t) and the host functions its host nodes call.
class CudaGraph final : public GraphImpl {
 public:
  CudaGraph(RuntimeImpl& runtime, int device, cudaStream_t stream, cudaGraph_t graph,
            std::vector<std::unique_ptr<std::function<void()>>> host_funcs, std::shared_ptr<SpanLog> spans,
            std::vector<CapturedRingCall> ring_calls)
      : runtime_(runtime),
        device_(device),
        stream_(stream),
        graph_(graph),
        host_funcs_(std::move(host_funcs)),
        spans_(std::move(spans)),
        ring_calls_(std::move(ring_calls)) {
    DeviceScope scope(runtime_.gpu_of(device_));
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph_, 0);
    if (status != cudaSuccess) {
      cudaGraphDestroy(graph_);
      DP_CUDA_CHECK(status);
    }
  }
  ~CudaGraph() override {  // never throws
    DeviceScope scope(runtime_.gpu_of(device_));
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  // While profiling, the whole replay is one span on the launching stream: timing events cannot
  // stand between the kernels of an instantiated graph, and every stream the graph forked into
  // joined back to this one, so the span ends when the last of its work does.
  void replay() override {
    runtime_.count(device_, Counter::launches);  // one graph launch
    DeviceScope scope(runtime_.gpu_of(device_));
    const bool traced = runtime_.profiling();
    if (traced) spans_->begin(stream_, "graph", SpanKind::kernel);
    if (ring_calls_.empty()) {
      DP_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    } else {  // with the other ranks' replays (Note [implicit synchronization])
      const CapturedRingCall& ring = ring_calls_.front();
      DP_CUDA_CHECK(ring.replays->arrive(
          ring.rank, [this] { return cudaGraphLaunch(exec_, stream_); }, "graph replay"));
    }
    if (traced) spans_->end(stream_);
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
  std::shared_ptr<SpanLog> spans_;  // the launching stream's
  std::vector<CapturedRingCall> ring_calls_;
};

class CudaStream final : public StreamImpl {
 public:
  CudaStream(CudaRuntime& runtime, CudaDevice& device, int index);
  ~CudaStream() override;
  int device() const override { return index_; }
  Backend backend() const override { return Backend::cuda; }
  void record(EventImpl& event) override {
    if (event.device() != index_)
      throw DeviceMismatch(fmt::format("event of device {} recorded on a stream of device {}", event.device(), index_));
    auto& cuda_event = static_cast<CudaEvent&>(event);
    DP_CUDA_CHECK(cudaEventRecord(cuda_event.handle(), stream_));
    cuda_event.set_recorded_in_capture(capturing());
  }
  void wait(EventImpl& event) override;
  bool query() override { return done_or_pending(cudaStreamQuery(stream_), "cudaStreamQuery(stream_)"); }
  void clear_not_ready() noexcept override { (void)cudaGetLastError(); }
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
  void begin_capture() override;
  std::shared_ptr<GraphImpl> end_capture() override;
  bool capturing() override { return capture_status() != cudaStreamCaptureStatusNone; }
  cudaStreamCaptureStatus capture_status() {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    DP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status;
  }
  void* native_handle() override { return stream_; }
  cudaStream_t native() const { return stream_; }
  int multiprocessor_count() const override { return sm_count_; }
  int make_current() override { return detail::make_device_current(gpu_); }
  void restore_current(int previous) noexcept override {
    if (previous >= 0) cudaSetDevice(previous);  // never throws: the launch's own error is what counts
  }
  void with_library(kernel_api::Library library, const std::function<void(kernel_api::LibraryCall&)>& fn) override;
  void* kernel_scratch(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    std::lock_guard lock(scratch_mutex_);
    return scratch_.get<std::byte>(runtime().device(index_), bytes, &scratch_retired_);
  }
  RuntimeImpl& runtime() const override;
  // Waits for the stream's work, reporting nothing (a device's own streams before a pooled free),
  // but never synchronizes a capturing stream: that would invalidate its capture. Its work issued
  // before it began or joined the capture is waited for through the fence recorded then; what it
  // captured runs only when a graph is replayed. See Note [capture fence].
  void finish() noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess) {
      if (status == cudaStreamCaptureStatusNone)
        cudaStreamSynchronize(stream_);
      else
        cudaEventSynchronize(fence_);
    }
    (void)cudaGetLastError();  // reported nowhere: read out (See Note [last error])
  }
  void begin_span(const char* name, SpanKind kind) override;
  void end_span() override { spans_->end(stream_); }

 private:
  // This stream's handle of one library, created on its first call and bound to the stream once,
  // with its workspaces: cuBLAS's fixed one (cublasSetWorkspace) and the grow-only scratch that
  // kernel_api::LibraryCall::workspace lends (cuDNN's), outgrown buffers kept until the stream goes
  // (freeing them would wait for the whole device, maybe on another device's collective).
  struct Library {
    std::mutex mutex;
    void* handle = nullptr;
    DeviceBuffer cublas_workspace;
    Scratch workspace;
    std::vector<DeviceBuffer> retired;
  };
  void create_handle(kernel_api::Library library, Library& state);
  void call_in_capture(const std::function<void(kernel_api::LibraryCall&)>& fn, kernel_api::LibraryCall& call);

  CudaRuntime& runtime_;
  CudaDevice& device_;
  int index_;  // the dp device
  int gpu_;    // the GPU it runs on (devices_per_gpu dp devices share one)
  int sm_count_ = 1;
  std::vector<std::unique_ptr<std::function<void()>>> captured_host_funcs_;  // for the graph being captured
  // kernel_api::kernel_scratch: grow-only; outgrown buffers kept until the stream goes (freeing one
  // would wait for the whole device).
  std::mutex scratch_mutex_;
  Scratch scratch_;
  std::vector<DeviceBuffer> scratch_retired_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t fence_ = nullptr;  // recorded before the stream begins or joins a capture
  // The capture this stream began: ended only here and on this thread; CUDA's own refusals of the
  // other cases (903, 908) may end or invalidate the capture, so they are refused before reaching it.
  bool began_capture_ = false;
  std::thread::id capture_thread_;
  Library libraries_[2];  // by kernel_api::Library
  std::shared_ptr<SpanLog> spans_;
};

class CudaDevice final : public DeviceImpl {
 public:
  CudaDevice(CudaRuntime& runtime, int index, int gpu, bool shared)
      : runtime_(runtime),
        index_(index),
        gpu_(gpu),
        shared_(shared),
        memory_(0),
        worker_(fmt::format("cuda{}.worker", index), [gpu] { DP_CUDA_CHECK(cudaSetDevice(gpu)); }) {
    // Properties are read on the worker thread, which has the device current.
    submit([this, shared] {
      cudaDeviceProp prop{};
      DP_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu_));
      name_ = shared ? fmt::format("cuda:{} (GPU {}, {})", index_, gpu_, prop.name)
                     : fmt::format("cuda:{} ({})", index_, prop.name);
      sm_count_ = prop.multiProcessorCount;
      compute_major_ = prop.major;
      // nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, the same in every process.
      const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
      uuid_ = fmt::format(
          "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
          u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
      std::size_t free_bytes = 0, total_bytes = 0;
      DP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      memory_.set_capacity(total_bytes);
      // Stream-ordered allocations (cudaMallocAsync: libraries, NCCL's and cuDNN's internals) keep
      // what they free in the device's pool instead of returning it at every synchronisation: with
      // the default threshold (0) an alloc/kernel/free/sync cycle took 102 us on an H100, 13.5 us
      // with it raised (docs/perf). dp's own buffers use cudaMalloc and are reused, not re-made.
      int pools = 0;
      DP_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, gpu_));
      if (pools) {
        cudaMemPool_t pool = nullptr;
        DP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, gpu_));
        std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
        DP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
      }
      pooled_ = shared_ && pools;
      if (pooled_) DP_CUDA_CHECK(cudaStreamCreateWithFlags(&memory_stream_, cudaStreamNonBlocking));
    }).get();
  }
  ~CudaDevice() override {
    auto done = submit([this] {
      if (memory_stream_) cudaStreamDestroy(memory_stream_);  // never throws
    });
    done.wait();
  }
  Backend backend() const override { return Backend::cuda; }
  std::string name() const override { return name_; }
  std::string gpu_uuid() const override { return uuid_; }
  // Devices that share a GPU take their memory from the GPU's pool on their own memory stream, and
  // free it there once their own streams are done with it: cudaFree waits for the whole GPU, where
  // another device's ring kernel may be waiting for work this device's worker has yet to launch.
  // Elsewhere, and on a thread that is capturing (CUDA refuses the allocation there), cudaMalloc.
  void* allocate(std::size_t bytes) override {
    count(Counter::allocations);
    DeviceScope scope(gpu_);
    void* ptr = nullptr;
    const bool pooled = pooled_ && t_captures_begun == 0;
    cudaError_t status = cudaSuccess;
    {
      // Issued under the lock, waited for outside it (Note [implicit synchronization]).
      const std::lock_guard serial(implicit_sync_mutex());
      status = pooled ? cudaMallocAsync(&ptr, bytes, memory_stream_) : cudaMalloc(&ptr, bytes);
    }
    if (status == cudaSuccess && pooled) status = cudaStreamSynchronize(memory_stream_);  // usable on any stream
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the non-sticky error
      const auto stats = memory_.stats();
      throw OutOfMemory(index_, bytes, stats.in_use, stats.capacity);
    }
    DP_CUDA_CHECK(status);
    memory_.reserve(bytes);  // accounting only: the driver already granted it
    register_allocation(ptr, bytes, pooled);
    return ptr;
  }
  void free(void* ptr, std::size_t bytes) noexcept override {
    const bool pooled = unregister_allocation(ptr);
    try {
      DeviceScope scope(gpu_);
      if (pooled) {
        // As cudaFree waits, for this device's streams; no stream begins or joins a capture meanwhile.
        const std::lock_guard lock(capture_mutex_);
        for (auto& stream : live_streams()) stream->finish();
        const std::lock_guard serial(implicit_sync_mutex());
        cudaFreeAsync(ptr, memory_stream_);
      } else {
        cudaFree(ptr);  // waits for the GPU: never under the lock, whose holders may be what it waits for
      }
      (void)cudaGetLastError();  // reported nowhere: read out (See Note [last error])
    } catch (...) {              // never throws: cudaFree reports nothing either
    }
    memory_.release(bytes);
  }
  MemoryStats memory() const override { return memory_.stats(); }
  void reset_peak_memory() override { memory_.reset_peak(); }
  std::shared_ptr<StreamImpl> create_stream() override;
  std::shared_ptr<EventImpl> create_event(EventTiming timing) override;
  // This device's work: on a GPU of its own the whole GPU's; sharing one, its own streams' only
  // (the other devices' may wait for this one's worker, as the simulator's devices do).
  void synchronize() override {
    count(Counter::host_syncs);
    DeviceScope scope(gpu_);
    if (!shared_) {
      DP_CUDA_CHECK(cudaDeviceSynchronize());
      return;
    }
    for (auto& stream : live_streams()) DP_CUDA_CHECK(cudaStreamSynchronize(stream->native()));
    if (memory_stream_) DP_CUDA_CHECK(cudaStreamSynchronize(memory_stream_));
  }
  std::future<void> submit(std::function<void()> task) override {
    count(Counter::worker_submits);
    auto packaged = std::make_shared<std::packaged_task<void()>>(std::move(task));
    auto future = packaged->get_future();
    worker_.post([packaged] { (*packaged)(); });
    return future;
  }
  int sm_count() const { return sm_count_; }
  int gpu() const { return gpu_; }
  void count(Counter counter);
  // kernel_api::LibraryCall::temporary: stream-ordered memory counted as this device's.
  std::shared_ptr<void> temporary(std::size_t bytes, cudaStream_t stream);
  int compute_major() const { return compute_major_; }
  // Runs fn with its GPU's cache for `library` (cuDNN plans), held exclusively meanwhile. See
  // Note [shared plans].
  void with_cache(kernel_api::Library library, const std::function<void(std::shared_ptr<void>&)>& fn);
  // Held while a stream of this device begins or joins a capture, and while a pooled free waits for
  // the device's streams: so the free never synchronizes a stream that is capturing by then.
  std::mutex& capture_mutex() { return capture_mutex_; }

 private:
  void register_allocation(void* ptr, std::size_t bytes, bool pooled);
  bool unregister_allocation(void* ptr) noexcept;  // whether it came from the pool
  std::vector<std::shared_ptr<CudaStream>> live_streams();

  CudaRuntime& runtime_;
  int index_;    // the dp device
  int gpu_;      // the GPU it runs on
  bool shared_;  // with other dp devices (RuntimeOptions::devices_per_gpu > 1)
  bool pooled_ = false;
  cudaStream_t memory_stream_ = nullptr;  // pooled allocations and frees
  std::mutex streams_mutex_;
  std::vector<std::weak_ptr<CudaStream>> streams_;
  std::set<void*> pooled_allocations_;  // under streams_mutex_
  std::mutex capture_mutex_;
  std::string name_;
  std::string uuid_;
  int sm_count_ = 1;
  MemoryCounter memory_;
  int compute_major_ = 0;
  SerialExecutor worker_;
};

// Note [shared plans]
// What kernels cache for a library (cuDNN plans: descriptors and the algorithms chosen) is kept per
// physical GPU for the whole process: every dp device on that GPU, virtual or not, and every
// runtime alive at once share it. So a shape's plan is chosen once per GPU, and two devices or two
// runtimes on one GPU run the same algorithm and give the same bits (in Precision::strict the choice
// is a fixed order, never a timing: cudnn_conv.cpp). The plans go with the last runtime using them.
struct GpuCaches {
  struct Lent {
    std::mutex mutex;
    std::shared_ptr<void> cache;
  };
  Lent lent[2];  // by kernel_api::Library
};
std::shared_ptr<GpuCaches> caches_of_gpu(int gpu) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<GpuCaches>> caches;
  const std::lock_guard lock(mutex);
  std::weak_ptr<GpuCaches>& weak = caches[gpu];
  auto shared = weak.lock();
  if (!shared) {
    shared = std::make_shared<GpuCaches>();
    weak = shared;
  }
  return shared;
}

class CudaRuntime final : public RuntimeImpl {
 public:
  // `gpus` GPUs, each driven as `per_gpu` dp devices (dp device d runs on GPU d / per_gpu).
  CudaRuntime(int gpus, int per_gpu)
      : RuntimeImpl(gpus * per_gpu, per_gpu), references_(static_cast<std::size_t>(gpus * per_gpu)) {
    for (int g = 0; g < gpus; ++g) caches_.push_back(caches_of_gpu(g));
    for (int d = 0; d < gpus * per_gpu; ++d)
      add_device(std::make_unique<CudaDevice>(*this, d, d / per_gpu, per_gpu > 1));
    // Peer access where the topology allows it: peer copies then go over NVLink/PCIe directly.
    for (int i = 0; i < gpus; ++i)
      for (int j = 0; j < gpus; ++j) {
        if (i == j) continue;
        int can = 0;
        DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, i, j));
        if (!can) continue;
        const DeviceScope scope(i);  // the creating thread's current device is kept
        const cudaError_t status = cudaDeviceEnablePeerAccess(j, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled)
          cudaGetLastError();
        else
          DP_CUDA_CHECK(status);
      }
  }
  ~CudaRuntime() override {
    for (const Reference& r : references_)
      if (r.event) cudaEventDestroy(r.event);  // never throws from a destructor
  }
  Backend backend() const override { return Backend::cuda; }
  void* allocate_pinned(std::size_t bytes) override {
    void* ptr = nullptr;
    const std::lock_guard serial(implicit_sync_mutex());  // Note [implicit synchronization]
    DP_CUDA_CHECK(cudaMallocHost(&ptr, bytes));
    return ptr;
  }
  void free_pinned(void* ptr) noexcept override { cudaFreeHost(ptr); }  // may wait for the GPU: not under the lock
  // Page-locked at both ends (cudaMallocHost'd or registered): a copy from it is asynchronous.
  bool is_pinned(const void* ptr, std::size_t bytes) const override {
    const auto page_locked = [](const void* p) { return attributes_of(p).type == cudaMemoryTypeHost; };
    return page_locked(ptr) && (bytes <= 1 || page_locked(static_cast<const char*>(ptr) + bytes - 1));
  }

  std::shared_ptr<SpanLog> make_span_log(int device) {
    auto log = std::make_shared<SpanLog>(device, gpu_of(device), next_stream_id());
    std::lock_guard lock(logs_mutex_);
    logs_.push_back(log);
    return log;
  }
  // Each device's time reference: an event recorded on its idle legacy stream, waited for, and
  // the steady clock read right after (within the few microseconds of that wait). Spans are
  // placed relative to it by cudaEventElapsedTime, so they line up with host timestamps.
  void begin_profiling() override {
    for (int d = 0; d < device_count(); ++d) {
      Reference& r = references_[static_cast<std::size_t>(d)];
      const DeviceScope scope(gpu_of(d));
      if (!r.event) DP_CUDA_CHECK(cudaEventCreate(&r.event));
      DP_CUDA_CHECK(cudaEventRecord(r.event, nullptr));
      DP_CUDA_CHECK(cudaEventSynchronize(r.event));
      r.ns = now_ns();
    }
  }
  // Which dp device each allocation of the runtime belongs to: the driver knows the GPU only, and
  // dp devices sharing a GPU are told apart for link accounting and peer copies.
  void add_allocation(const void* ptr, std::size_t bytes, int device) {
    std::unique_lock lock(allocations_mutex_);
    allocations_[reinterpret_cast<std::uintptr_t>(ptr)] = {bytes, device};
  }
  void remove_allocation(const void* ptr) noexcept {
    std::unique_lock lock(allocations_mutex_);
    allocations_.erase(reinterpret_cast<std::uintptr_t>(ptr));
  }
  // Where a pointer lives: a dp device, or kHost for pinned and pageable host memory. Device memory
  // dp did not allocate counts as the first dp device of its GPU.
  int location_of(const void* ptr) const {
    {
      std::shared_lock lock(allocations_mutex_);
      const auto p = reinterpret_cast<std::uintptr_t>(ptr);
      auto it = allocations_.upper_bound(p);
      if (it != allocations_.begin() && p < (--it)->first + it->second.first) return it->second.second;
    }
    const cudaPointerAttributes attributes = attributes_of(ptr);
    if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged)
      return attributes.device * devices_per_gpu();
    return kHost;
  }

  GpuCaches& caches(int gpu) { return *caches_[static_cast<std::size_t>(gpu)]; }

  void collect_spans() override {
    std::lock_guard lock(logs_mutex_);
    for (const auto& log : logs_) {
      const Reference& r = references_[static_cast<std::size_t>(log->device())];
      if (r.event) log->collect(*this, r.event, r.ns);
    }
    // Logs of streams that are gone have nothing left once collected.
    std::erase_if(logs_, [](const std::shared_ptr<SpanLog>& log) { return log.use_count() == 1; });
  }

 private:
  struct Reference {
    cudaEvent_t event = nullptr;
    std::int64_t ns = 0;
  };
  std::vector<Reference> references_;               // by device
  std::vector<std::shared_ptr<GpuCaches>> caches_;  // by GPU
  mutable std::shared_mutex allocations_mutex_;
  std::map<std::uintptr_t, std::pair<std::size_t, int>> allocations_;  // base -> (bytes, dp device)
  std::mutex logs_mutex_;
  std::vector<std::shared_ptr<SpanLog>> logs_;
};

CudaStream::CudaStream(CudaRuntime& runtime, CudaDevice& device, int index)
    : runtime_(runtime),
      device_(device),
      index_(index),
      gpu_(device.gpu()),
      sm_count_(device.sm_count()),
      spans_(runtime.make_span_log(index)) {
  DeviceScope scope(gpu_);
  DP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming));
}

CudaStream::~CudaStream() {
  try {  // never throws from a destructor: a failure leaks a handle at worst
    const DeviceScope scope(gpu_);
    if (auto* cublas = static_cast<cublasHandle_t>(libraries_[0].handle)) cublasDestroy(cublas);
    if (auto* cudnn = static_cast<cudnnHandle_t>(libraries_[1].handle)) cudnnDestroy(cudnn);
    if (fence_) cudaEventDestroy(fence_);
    if (stream_) cudaStreamDestroy(stream_);
  } catch (...) {
  }
  // The workspaces (DeviceBuffers) are freed after, by their own destructors.
}

void CudaStream::create_handle(kernel_api::Library library, Library& state) {
  // The stream's device is current (with_library): handles belong to the current device.
  if (library == kernel_api::Library::cublas) {
    cublasHandle_t handle = nullptr;
    DP_CUDA_CHECK(cublasCreate(&handle));
    state.handle = handle;  // owned from here on: destroyed with the stream
    DP_CUDA_CHECK(cublasSetStream(handle, stream_));
    // Exact fp32 (no TF32) so GPU results match the host results within fp32 rounding; PyTorch's
    // matmuls default to the same (allow_tf32 = False), so Precision::fast keeps it too.
    // Precision::tf32 is allow_tf32 = True: TF32 tensor cores.
    DP_CUDA_CHECK(cublasSetMathMode(
        handle, runtime_.precision() == Precision::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH));
    const std::size_t bytes = cublas_workspace_bytes(device_.compute_major());
    state.cublas_workspace = runtime_.device(index_).allocate(bytes);
    DP_CUDA_CHECK(cublasSetWorkspace(handle, state.cublas_workspace.data(), bytes));
  } else {
    cudnnHandle_t handle = nullptr;
    // On first use: cuDNN 9 loads its sub-libraries (libcudnn_ops, libcudnn_cnn, libcudnn_engines_*)
    // now, from the dynamic loader's path; a machine that has libcudnn.so.9 without them fails here.
    if (const cudnnStatus_t status = cudnnCreate(&handle); status != CUDNN_STATUS_SUCCESS) {
      char detail[512] = {};
      cudnnGetLastErrorString(detail, sizeof(detail));
      throw Error(fmt::format(
          "cuDNN could not start on device {}: {} ({}). cuDNN 9 loads libcudnn_ops.so.9, libcudnn_cnn.so.9 and "
          "libcudnn_engines_*.so.9 at run time: put the directory holding them on LD_LIBRARY_PATH",
          index_, cudnnGetErrorString(status), detail));
    }
    state.handle = handle;
    DP_CUDA_CHECK(cudnnSetStream(handle, stream_));
  }
}

void CudaStream::begin_span(const char* name, SpanKind kind) {
  // Not inside a capture: an event recorded there is a dependency of the graph, never a time.
  if (runtime_.profiling() && !capturing()) spans_->begin(stream_, name, kind);
}

std::shared_ptr<StreamImpl> CudaDevice::create_stream() {
  auto stream = std::make_shared<CudaStream>(runtime_, *this, index_);
  std::lock_guard lock(streams_mutex_);
  std::erase_if(streams_, [](const std::weak_ptr<CudaStream>& s) { return s.expired(); });
  streams_.push_back(stream);
  return stream;
}

std::vector<std::shared_ptr<CudaStream>> CudaDevice::live_streams() {
  std::vector<std::shared_ptr<CudaStream>> out;
  std::lock_guard lock(streams_mutex_);
  for (auto& weak : streams_)
    if (auto s = weak.lock()) out.push_back(std::move(s));
  return out;
}

// Host memory the driver does not know (not cudaMallocHost'd nor registered): copies stage it.
bool pageable(const void* ptr) { return attributes_of(ptr).type == cudaMemoryTypeUnregistered; }

void CudaStream::copy(void* dst, const void* src, std::size_t bytes) {
  const int src_loc = runtime_.location_of(src), dst_loc = runtime_.location_of(dst);
  runtime_.count_copy(src_loc, dst_loc, bytes);
  const bool src_pageable = src_loc == kHost && pageable(src), dst_pageable = dst_loc == kHost && pageable(dst);
  DeviceScope scope(gpu_);
  if ((src_pageable || dst_pageable) && capturing()) {
    // Whether a driver refuses it (900) or captures a node that reads the host memory at each
    // replay, a graph must not hold it: refused here, the capture invalidated as CUDA's refusal
    // does (a query of a capturing stream invalidates it), the same on every driver and the sim.
    (void)cudaStreamQuery(stream_);
    (void)cudaGetLastError();  // Note [last error]
    throw CaptureError(
        fmt::format("copy of {} bytes with a pageable host side on device {} while the stream is being "
                    "captured (use pinned memory)",
                    bytes, index_));
  }
  if (src_pageable || dst_pageable) count(Counter::pageable_copies);
  // Into pageable memory cudaMemcpyAsync returns once the copy is done: the host waited.
  if (dst_pageable) count(Counter::host_syncs);
  const StreamSpan span(*this, "copy", SpanKind::copy);
  // Between two GPUs a peer copy; between dp devices that share a GPU a device-to-device copy.
  const int src_gpu = src_loc == kHost ? -1 : runtime_.gpu_of(src_loc);
  const int dst_gpu = dst_loc == kHost ? -1 : runtime_.gpu_of(dst_loc);
  if (src_gpu >= 0 && dst_gpu >= 0 && src_gpu != dst_gpu) {
    DP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_gpu, src, src_gpu, bytes, stream_));
  } else if (src_gpu >= 0 && src_gpu == dst_gpu) {
    const std::lock_guard serial(implicit_sync_mutex());  // Note [implicit synchronization]
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  } else {
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
}

RuntimeImpl& CudaStream::runtime() const { return runtime_; }

// Note [capture fence]
// A pooled free waits for its device's streams (as cudaFree waits for the device), but
// synchronizing a capturing stream invalidates the capture, from any thread. So each stream records
// its fence just before it begins or joins a capture, under its device's capture mutex, and a free
// (under the same mutex) waits for a capturing stream's fence instead: the work issued before the
// capture, the only work of that stream that can be running.
void CudaStream::begin_capture() {
  DeviceScope scope(gpu_);
  // As the simulator: a capture in progress on the stream (begun or joined) is the caller's mistake,
  // refused before CUDA's 401 could end or invalidate it.
  if (capturing())
    throw InvalidArgument(fmt::format("Stream::begin_capture: the stream of device {} is already capturing", index_));
  const std::lock_guard lock(device_.capture_mutex());
  DP_CUDA_CHECK(cudaEventRecord(fence_, stream_));
  DP_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  if (t_captures_begun++ == 0) t_ring_calls.clear();
  began_capture_ = true;
  capture_thread_ = std::this_thread::get_id();
}

void CudaStream::wait(EventImpl& event) {
  auto& cuda_event = static_cast<CudaEvent&>(event);
  if (cuda_event.recorded_in_capture() && !capturing()) {  // this wait joins the capture
    const DeviceScope scope(gpu_);
    const std::lock_guard lock(device_.capture_mutex());
    DP_CUDA_CHECK(cudaEventRecord(fence_, stream_));
    DP_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event.handle(), 0));
    return;
  }
  DP_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event.handle(), 0));
}

std::shared_ptr<GraphImpl> CudaStream::end_capture() {
  DeviceScope scope(gpu_);
  // As the simulator, and before CUDA sees the call: ending a capture that is not in progress
  // (CUDA: 401), that another stream began (903) or that another thread began (908) is the caller's
  // mistake, and the capture goes on, its host functions with it.
  if (!capturing())
    throw InvalidArgument(fmt::format("Stream::end_capture: the stream of device {} is not capturing", index_));
  if (!began_capture_)
    throw InvalidArgument(fmt::format(
        "Stream::end_capture: the stream of device {} joined a capture another stream began; that stream ends it",
        index_));
  if (capture_thread_ != std::this_thread::get_id())
    throw InvalidArgument(fmt::format(
        "Stream::end_capture: the capture on device {} was begun by another thread, which must end it", index_));
  cudaGraph_t graph = nullptr;
  const cudaError_t status = cudaStreamEndCapture(stream_, &graph);
  began_capture_ = false;
  if (t_captures_begun > 0) --t_captures_begun;  // ended, whatever it returned
  auto host_funcs = std::move(captured_host_funcs_);
  captured_host_funcs_.clear();
  std::vector<CapturedRingCall> ring_calls = std::move(t_ring_calls);
  t_ring_calls.clear();
  if (status != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    if (status == cudaErrorStreamCaptureInvalidated) {
      (void)cudaGetLastError();  // the eager fallback's first launch must not report it (Note [last error])
      throw CaptureError(
          fmt::format("stream capture was invalidated on device {}: {}", index_, cudaGetErrorString(status)));
    }
    DP_CUDA_CHECK(status);  // an unjoined fork (904) is a CaptureError there too
  }
  return std::make_shared<CudaGraph>(runtime(), index_, stream_, graph, std::move(host_funcs), spans_,
                                     std::move(ring_calls));
}

void CudaDevice::count(Counter counter) { runtime_.count(index_, counter); }
void CudaDevice::with_cache(kernel_api::Library library, const std::function<void(std::shared_ptr<void>&)>& fn) {
  GpuCaches::Lent& lent = runtime_.caches(gpu_).lent[static_cast<std::size_t>(library)];
  const std::lock_guard lock(lent.mutex);
  fn(lent.cache);
}
void CudaDevice::register_allocation(void* ptr, std::size_t bytes, bool pooled) {
  runtime_.add_allocation(ptr, bytes, index_);
  if (!pooled) return;
  std::lock_guard lock(streams_mutex_);
  pooled_allocations_.insert(ptr);
}
bool CudaDevice::unregister_allocation(void* ptr) noexcept {
  runtime_.remove_allocation(ptr);
  std::lock_guard lock(streams_mutex_);
  return pooled_allocations_.erase(ptr) != 0;
}

std::shared_ptr<void> CudaDevice::temporary(std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  count(Counter::allocations);
  DeviceScope scope(gpu_);
  void* ptr = nullptr;
  bool async = true;
  cudaError_t status = cudaSuccess;
  {
    const std::lock_guard serial(implicit_sync_mutex());  // Note [implicit synchronization]
    status = cudaMallocAsync(&ptr, bytes, stream);
    if (status == cudaErrorNotSupported) {  // no memory pools on this device
      cudaGetLastError();
      async = false;
      status = cudaMalloc(&ptr, bytes);
    }
  }
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    const auto stats = memory_.stats();
    throw OutOfMemory(index_, bytes, stats.in_use, stats.capacity);
  }
  DP_CUDA_CHECK(status);
  memory_.reserve(bytes);  // accounting only: the driver already granted it
  return std::shared_ptr<void>(ptr, [this, bytes, stream, async](void* p) {
    {
      DeviceScope restore(gpu_);
      if (async) {
        const std::lock_guard serial(implicit_sync_mutex());
        cudaFreeAsync(p, stream);  // behind the call's work on the stream; never throws
      } else {
        cudaFree(p);
      }
    }
    memory_.release(bytes);
  });
}
std::shared_ptr<EventImpl> CudaDevice::create_event(EventTiming timing) {
  return std::make_shared<CudaEvent>(runtime_, index_, timing);
}

// Makes the stream's device current for the call (as a kernel launch does) and lends the stream's own handle,
// held exclusively: calls on other streams of the device use their own handles and workspaces, so
// their kernels may overlap on the GPU without sharing scratch. The device's cache for the library
// is held meanwhile (plan look-ups are short; a plan's first build times algorithms, in warm-up).
void CudaStream::with_library(kernel_api::Library library, const std::function<void(kernel_api::LibraryCall&)>& fn) {
  const DeviceScope scope(gpu_);  // the caller's current device is restored after the call
  Library& state = libraries_[static_cast<std::size_t>(library)];
  std::lock_guard lock(state.mutex);
  if (!state.handle) {
    try {
      create_handle(library, state);
    } catch (const Error& e) {
      // A handle made in a capture allocates, which the capture refuses: as any library call there.
      if (!capturing()) throw;
      (void)cudaGetLastError();  // Note [last error]
      throw CaptureError(
          fmt::format("{} (creating a library handle on device {} inside a stream capture)", e.what(), index_));
    }
  }
  Device& device = runtime_.device(index_);
  device_.with_cache(library, [&](std::shared_ptr<void>& cache) {
    kernel_api::LibraryCall call{state.handle, cache,
                                 [&](std::size_t bytes) -> void* {
                                   return bytes == 0 ? nullptr
                                                     : state.workspace.get<std::byte>(device, bytes, &state.retired);
                                 },
                                 [this](std::size_t bytes) { return device_.temporary(bytes, stream_); }};
    const bool gemm = library == kernel_api::Library::cublas;
    const StreamSpan span(*this, gemm ? "gemm" : "cudnn", gemm ? SpanKind::gemm : SpanKind::kernel);
    call_in_capture(fn, call);
  });
}

// A library call inside a capture that cannot hold it, or inside one already invalidated, fails
// with the library's own status (cuBLAS's "execution failed", cuDNN's) or not at all, the capture's
// 901 left in the last-error slot. Either way it is a CaptureError, as on the sim, so the engine
// falls back to eager steps.
void CudaStream::call_in_capture(const std::function<void(kernel_api::LibraryCall&)>& fn,
                                 kernel_api::LibraryCall& call) {
  const auto invalidated = [this](const std::string& what) {
    (void)cudaGetLastError();  // Note [last error]
    return CaptureError(fmt::format("{} (a library call on device {} inside a stream capture)", what, index_));
  };
  try {
    fn(call);
  } catch (const CaptureError&) {
    throw;
  } catch (const Error& e) {
    if (capturing()) throw invalidated(e.what());
    throw;
  }
  if (capture_status() == cudaStreamCaptureStatusInvalidated) throw invalidated("stream capture was invalidated");
}

}  // namespace

void note_captured_ring_call(CapturedRingCall call) { t_ring_calls.push_back(std::move(call)); }

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

std::unique_ptr<RuntimeImpl> make_cuda_runtime(const RuntimeOptions& options) {
  check_devices_per_gpu(options.devices_per_gpu);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0)
    throw Error(fmt::format("cuda backend: no CUDA device is visible ({})",
                            status != cudaSuccess ? cudaGetErrorString(status) : "device count is 0"));
  return std::make_unique<CudaRuntime>(count, options.devices_per_gpu);
}

}  // namespace dp::detail
