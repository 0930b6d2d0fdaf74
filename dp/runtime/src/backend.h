// backend.h — the internal interface each device backend (sim, cuda) implements. Private to the
// runtime: public handles (Device, Stream, Event) forward to these, and kernels reach them only
// through dp/runtime/kernel_api.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dp/runtime/collectives.h"
#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "dp/runtime/trace.h"

namespace dp::detail {

class RuntimeImpl;

// Runtime::counters, by kind.
enum class Counter { launches, host_syncs, allocations, pageable_copies, worker_submits };
inline constexpr int kCounters = 5;

struct Span {
  std::string name;
  SpanKind kind;
  std::int64_t start_ns;  // steady clock
  std::int64_t end_ns;
};

// Note [last error]
// The CUDA runtime keeps one last-error slot per host thread. A call that returns an error also
// leaves it there, including errors dp tolerates (600 "not ready" from a query, 900-908 from a
// failed capture), and the launch check after the next kernel launch on that thread
// (cudaGetLastError) reports it as that launch's failure. So every error dp reads is read out:
// DP_CUDA_CHECK does it for what it throws, and the public query()s call clear_not_ready() after a
// "not ready". The sim keeps the same slot (sim_backend.cpp: a query that finds work pending sets
// 600, every launch reads it), so a query whose "not ready" is not read out fails on the sim too.
// docs/cuda-rules.md, rule 18.

class EventImpl {
 public:
  virtual ~EventImpl() = default;
  virtual int device() const = 0;
  // false: work before the latest record is pending, and the calling thread's last-error slot
  // holds "not ready" until clear_not_ready() (See Note [last error]).
  virtual bool query() = 0;
  virtual void clear_not_ready() noexcept = 0;
  virtual void synchronize() = 0;
  virtual double elapsed_ms_since(EventImpl& start) = 0;
};

// Captured stream work (Graph).
class GraphImpl {
 public:
  virtual ~GraphImpl() = default;
  virtual void replay() = 0;
  virtual std::size_t nodes() const = 0;
};

class StreamImpl {
 public:
  virtual ~StreamImpl() = default;
  virtual int device() const = 0;
  virtual Backend backend() const = 0;
  virtual void record(EventImpl& event) = 0;
  virtual void wait(EventImpl& event) = 0;
  // As EventImpl::query, with the same clear_not_ready() duty (See Note [last error]).
  virtual bool query() = 0;
  virtual void clear_not_ready() noexcept = 0;
  virtual void synchronize() = 0;
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void launch_host_func(std::function<void()> fn) = 0;

  // Throws DeviceMismatch unless [ptr, ptr+bytes) lies in memory of this stream's device.
  // `op` names the operation for the message. The sim checks every operand; cuda trusts the GPU.
  virtual void check_access(const void* ptr, std::size_t bytes, const char* op) = 0;

  // sim only: run a kernel body on the stream thread. cuda launches kernels natively instead.
  virtual void enqueue_kernel(const char* name, std::function<void()> body, SpanKind kind = SpanKind::kernel) = 0;
  // sim only: like enqueue_kernel, but `issue` runs on the host each time the work is issued --
  // now, or at every replay of a graph that captured it -- and returns that issue's body. For work
  // whose host-side bookkeeping belongs to each execution (a collective's sequence number and its
  // traffic, as NCCL kernels in a replayed graph count their own calls).
  virtual void enqueue_reissued(const char* name, std::function<std::function<void()>()> issue,
                                SpanKind kind = SpanKind::kernel) = 0;

  virtual void begin_capture() = 0;
  virtual std::shared_ptr<GraphImpl> end_capture() = 0;
  virtual bool capturing() = 0;
  // cuda only: the cudaStream_t (nullptr on sim).
  virtual void* native_handle() = 0;
  // cuda only: number of multiprocessors of the stream's device (launch grid sizing); sim: 1.
  virtual int multiprocessor_count() const = 0;
  // cuda: makes the stream's device current on the calling thread (a kernel launch into a stream
  // of another device fails) and returns the device that was current before, or -1 when it already
  // was the stream's; restore_current(that) puts it back. sim: nothing to do (-1).
  virtual int make_current() = 0;
  virtual void restore_current(int /*previous*/) noexcept {}
  // cuda only: kernel_api::with_library on this stream; sim: throws.
  virtual void with_library(kernel_api::Library library, const std::function<void(kernel_api::LibraryCall&)>& fn) = 0;
  // cuda only: kernel_api::kernel_scratch on this stream; sim: throws.
  virtual void* kernel_scratch(std::size_t bytes) = 0;
  virtual RuntimeImpl& runtime() const = 0;
  void count(Counter counter) const;  // on this stream's device

  // cuda, while profiling: brackets work enqueued natively (a kernel, a library call, a
  // collective) with timing events, turned into a span by take_spans(); `name` must outlive the
  // runtime (a string literal). The sim records its own spans, so these do nothing there.
  virtual void begin_span(const char* /*name*/, SpanKind /*kind*/) {}
  virtual void end_span() {}
};

// begin_span / end_span for one scope.
class StreamSpan {
 public:
  StreamSpan(StreamImpl& stream, const char* name, SpanKind kind) : stream_(stream) { stream_.begin_span(name, kind); }
  ~StreamSpan() {
    try {
      stream_.end_span();
    } catch (...) {  // never throws from a destructor: the span is lost at worst
    }
  }
  StreamSpan(const StreamSpan&) = delete;
  StreamSpan& operator=(const StreamSpan&) = delete;

 private:
  StreamImpl& stream_;
};

class DeviceImpl {
 public:
  virtual ~DeviceImpl() = default;
  virtual Backend backend() const = 0;
  virtual std::string name() const = 0;
  virtual std::string gpu_uuid() const = 0;  // Device::gpu_uuid
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void free(void* ptr, std::size_t bytes) noexcept = 0;
  virtual MemoryStats memory() const = 0;
  virtual void reset_peak_memory() = 0;
  virtual std::shared_ptr<StreamImpl> create_stream() = 0;
  virtual std::shared_ptr<EventImpl> create_event(EventTiming timing) = 0;
  virtual void synchronize() = 0;
  virtual std::future<void> submit(std::function<void()> task) = 0;

  DeviceBuffer wrap(int device, void* data, std::size_t bytes) { return DeviceBuffer(this, device, data, bytes); }
};

// Accounting shared by both backends: per-device current/peak/capacity bytes.
class MemoryCounter {
 public:
  explicit MemoryCounter(std::size_t capacity) : capacity_(capacity) {}
  // Reserves `bytes`; returns false (and reserves nothing) when capacity would be exceeded.
  bool reserve(std::size_t bytes);
  void release(std::size_t bytes) noexcept;
  MemoryStats stats() const;
  void reset_peak();
  std::size_t capacity() const { return capacity_; }
  void set_capacity(std::size_t capacity) { capacity_ = capacity; }

 private:
  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
  std::size_t allocations_ = 0;
  std::uint64_t allocations_made_ = 0;
};

// Throws InvalidArgument unless 1 <= devices_per_gpu <= 64 (RuntimeOptions::devices_per_gpu).
void check_devices_per_gpu(int devices_per_gpu);

class RuntimeImpl {
 public:
  // `devices_per_gpu` dp devices share each (physical or simulated) GPU: device d runs on GPU
  // d / devices_per_gpu.
  explicit RuntimeImpl(int device_count, int devices_per_gpu = 1);
  virtual ~RuntimeImpl() = default;
  virtual Backend backend() const = 0;
  virtual void* allocate_pinned(std::size_t bytes) = 0;
  virtual void free_pinned(void* ptr) noexcept = 0;
  virtual bool is_pinned(const void* ptr, std::size_t bytes) const = 0;  // Runtime::is_pinned

  int device_count() const { return static_cast<int>(devices_.size()); }
  int devices_per_gpu() const { return devices_per_gpu_; }
  int gpu_of(int device) const { return device / devices_per_gpu_; }
  Device& device(int index);
  PinnedBuffer wrap_pinned(void* data, std::size_t bytes) { return PinnedBuffer(this, data, bytes); }

  // Link accounting: src/dst are device indices, kHost or kNetwork.
  void count_copy(int src, int dst, std::size_t bytes);
  LinkTraffic link_traffic(int src, int dst) const;
  void reset_link_traffic();

  // Work counters per device (Runtime::counters).
  void count(int device, Counter counter) noexcept {
    counters_[static_cast<std::size_t>(device) * kCounters + static_cast<std::size_t>(counter)].fetch_add(
        1, std::memory_order_relaxed);
  }
  DeviceCounters counters(int device) const;
  void reset_counters();
  // Memory traffic per device and kernel (Runtime::memory_traffic); `kernel` a string literal.
  void count_traffic(int device, const char* kernel, std::uint64_t bytes);
  std::vector<KernelTraffic> memory_traffic(int device) const;
  void reset_memory_traffic();

  // Stream work spans, recorded while profiling is on (bench traces, overlap tests).
  void set_profiling(bool on) {
    if (on && !profiling()) begin_profiling();
    profiling_.store(on);
  }
  bool profiling() const { return profiling_.load(std::memory_order_relaxed); }
  void add_span(int device, int stream_id, Span span);
  struct StreamSpans {
    int device;
    int stream_id;
    std::vector<Span> spans;
  };
  std::vector<StreamSpans> take_spans();
  int next_stream_id() { return stream_ids_.fetch_add(1); }
  // Backend hooks: profiling is about to start (cuda: takes each device's time reference); the
  // spans are about to be taken (cuda: converts completed event pairs into spans with add_span).
  virtual void begin_profiling() {}
  virtual void collect_spans() {}

  // RuntimeOptions::precision, set once by Runtime::create before any stream exists.
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }

 protected:
  // Called by the backend's constructor once per device, in index order.
  void add_device(std::unique_ptr<DeviceImpl> impl);

 private:
  std::size_t slot(int index) const;  // kHost -> last slot
  int expected_devices_;
  int devices_per_gpu_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> link_bytes_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> link_copies_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> counters_;  // device x Counter
  struct Traffic {
    mutable std::mutex mutex;
    std::map<const char*, std::pair<std::uint64_t, std::uint64_t>> by_kernel;  // bytes, launches
  };
  std::unique_ptr<Traffic[]> traffic_;  // by device
  std::atomic<bool> profiling_{false};
  std::atomic<int> stream_ids_{0};
  Precision precision_ = Precision::strict;
  std::mutex spans_mutex_;
  std::vector<StreamSpans> spans_;
};

std::int64_t now_ns();

// The private side of the public handles, for the runtime's own code (backends, kernel_api).
struct Access {
  // Throws InvalidArgument for an empty handle, DeviceLost for a stream of a lost device.
  static StreamImpl& stream(const Stream& stream);
  static StreamImpl& unchecked_stream(const Stream& stream);  // a lost device's too
  static EventImpl& event(const Event& event);
  static DeviceImpl& device(const Device& device) { return *device.impl_; }
  static RuntimeImpl& runtime(const Runtime& runtime) { return *runtime.impl_; }
};

// Backend factories (cuda ones come from the cuda backend, or from its stub when not compiled).
std::unique_ptr<RuntimeImpl> make_sim_runtime(const RuntimeOptions& options);
std::unique_ptr<RuntimeImpl> make_cuda_runtime(const RuntimeOptions& options);
int cuda_device_count_impl();
bool cuda_compiled_impl();

// Communicators (`group` must outlive them): the ring over counted copies (sim), NCCL and the
// device ring (cuda builds; elsewhere an error naming the missing backend).
std::unique_ptr<Communicator> make_ring_communicator(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes);
std::unique_ptr<Communicator> make_nccl_communicator(const DeviceGroup& group, std::shared_ptr<ProcessGroup> processes);
// cuda: the ranks of a group whose devices share one GPU (devices_per_gpu > 1), one process.
std::unique_ptr<Communicator> make_device_ring_communicator(const DeviceGroup& group,
                                                            std::shared_ptr<ProcessGroup> processes);

}  // namespace dp::detail
