// dp/runtime/device.h — devices, streams, events and copies behind one interface, two backends.
// `cuda` drives real GPUs; `sim` runs N isolated simulated devices on host threads, faithfully
// enough that a missing event wait is a real data race and a cross-device pointer a real error.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "dp/runtime/memory.h"
#include "dp/runtime/precision.h"
#include "dp/runtime/trace.h"

namespace dp {

enum class Backend { sim, cuda };

// "sim", "cuda"; parse also accepts "auto" (cuda when a GPU is visible, else sim).
std::string_view to_string(Backend backend);

namespace detail {
class RuntimeImpl;
class DeviceImpl;
class StreamImpl;
class EventImpl;
class GraphImpl;
struct Access;  // the runtime's own way in (backends, kernel_api); not part of the API
}  // namespace detail

class Device;
class Stream;
class Graph;

// Whether an event keeps timestamps (Event::elapsed_ms). Ordering-only events (the default) are
// cheaper to record and wait on: CUDA's cudaEventDisableTiming, which both backends honour.
enum class EventTiming { off, on };

// Marks the point in a stream's work at which it was recorded. Another stream (of any device)
// can wait on it; the host can query or block on it. Copyable handle; copies share the event.
class Event {
 public:
  Event() = default;
  bool valid() const noexcept { return impl_ != nullptr; }
  // True once all work captured by the latest record() has completed (true if never recorded).
  bool query() const;
  // Blocks the calling host thread until query() is true.
  void synchronize() const;
  // Milliseconds between two completed events of the same device, both created with
  // EventTiming::on (else InvalidArgument, as cudaEventElapsedTime refuses them).
  static double elapsed_ms(const Event& start, const Event& end);

 private:
  friend class Device;
  friend struct detail::Access;
  explicit Event(std::shared_ptr<detail::EventImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::EventImpl> impl_;
};

// An in-order queue of device work. Work enqueued on one stream runs in order; two streams run
// concurrently unless ordered with events. Copyable handle; copies share the stream.
class Stream {
 public:
  Stream() = default;
  bool valid() const noexcept { return impl_ != nullptr; }
  int device() const;
  Backend backend() const;

  void record(const Event& event) const;
  // Later work on this stream starts only after the work captured by `event` completed.
  void wait(const Event& event) const;
  bool query() const;        // all enqueued work done
  void synchronize() const;  // block the host until all enqueued work is done

  // Asynchronous copy of `bytes` between any two of: this stream's device, another device,
  // pinned host memory, pageable host memory. As with cudaMemcpyAsync, a pageable source is
  // consumed before the call returns and a pageable destination is written before it returns.
  // Device-to-device traffic is counted per (src, dst) link in the runtime.
  void copy(void* dst, const void* src, std::size_t bytes) const;
  // Runs `fn` on the host in stream order (cudaLaunchHostFunc). `fn` must not use dp streams.
  void launch_host_func(std::function<void()> fn) const;

  // Stream capture (cudaStreamBeginCapture, thread-local mode): from begin_capture() on, work
  // issued to this stream is recorded, not run. Another stream joins the capture by waiting on an
  // event recorded inside it (a fork) and must be waited on by this one again before
  // end_capture() (a join), which returns the recorded work as a Graph. While a stream captures,
  // what CUDA forbids throws CaptureError and invalidates the capture: synchronising or querying
  // it or its device, querying or synchronising an event recorded in it, a pageable copy, a device
  // allocation on its device, waiting on an event recorded outside the capture.
  void begin_capture() const;
  Graph end_capture() const;  // on the stream that began the capture
  bool capturing() const;

 private:
  friend class Device;
  friend struct detail::Access;
  explicit Stream(std::shared_ptr<detail::StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::StreamImpl> impl_;
};

// Work captured from streams (Stream::begin_capture .. end_capture), replayed as a whole: the same
// kernels, copies and collectives with the same arguments and addresses, in the captured order,
// on the captured streams. Values that change between replays must therefore live in memory the
// graph reads (device memory, or pinned memory a captured copy reads), never in launch arguments.
// Copyable handle; copies share the graph.
class Graph {
 public:
  Graph() = default;
  bool valid() const noexcept { return impl_ != nullptr; }
  // Enqueues the whole graph once (cudaGraphLaunch into the capture's first stream): it starts
  // after the work issued to that stream before, and work issued to it afterwards waits for all of
  // it. One launch in the device's counters. Throws InvalidArgument on an empty handle.
  void replay() const;
  // Operations captured (kernels, copies, collectives, event records and waits).
  std::size_t nodes() const;

 private:
  friend class Stream;
  explicit Graph(std::shared_ptr<detail::GraphImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::GraphImpl> impl_;
};

struct MemoryStats {
  std::size_t in_use = 0;              // bytes currently allocated
  std::size_t peak = 0;                // high-water mark of in_use since creation or reset_peak()
  std::size_t capacity = 0;            // bytes the device can hold
  std::size_t allocations = 0;         // live allocations
  std::uint64_t allocations_made = 0;  // allocations made since creation (never decreases): memory
                                       // that addresses were taken of may have moved when it changes
};

class Device {
 public:
  int index() const noexcept { return index_; }
  // The GPU this device runs on (RuntimeOptions::devices_per_gpu dp devices share one; sim: the
  // simulated GPU), index() / devices_per_gpu.
  int gpu() const noexcept;
  Backend backend() const;
  std::string name() const;
  // What names the GPU across processes: cuda, its UUID as nvidia-smi prints it (GPU-…); sim, a
  // simulated GPU of this process alone ("sim-<host>-<pid>-<gpu>"), or, with DP_SIM_GPU_UUID=PREFIX
  // set, "PREFIX-<gpu>": processes given the same prefix stand for processes sharing the GPUs of one
  // machine (what the check that two processes do not drive one GPU is tested with).
  std::string gpu_uuid() const;

  // Device memory, owned by the returned buffer. Throws OutOfMemory naming the device.
  DeviceBuffer allocate(std::size_t bytes);
  // Pinned host memory of this device's runtime (Runtime::allocate_pinned), for code that holds a
  // device but not its runtime (an engine's loss read-back).
  PinnedBuffer allocate_pinned(std::size_t bytes);
  // Runtime::is_pinned, for the same code.
  bool is_pinned(const void* ptr, std::size_t bytes) const;
  MemoryStats memory() const;
  void reset_peak_memory();

  Stream create_stream();
  Event create_event(EventTiming timing = EventTiming::off);
  // Blocks until all streams of this device are idle.
  void synchronize();

  // Runs `task` on this device's persistent worker thread (on cuda it has made this device
  // current once, at start). Exceptions come back through the future.
  std::future<void> submit(std::function<void()> task);

  // The device is lost on purpose (fault injection: DP_FAULT lose@dN), as a GPU is after an error
  // that ends its context: from now on every call on it (its streams' work and waits, allocations,
  // new streams and events) throws DeviceLost with `why`. Work already queued may still run, as on a
  // GPU; the other devices are untouched. Only the first call's reason is kept.
  void lose(const std::string& why);
  bool lost() const noexcept { return lost_.load(std::memory_order_acquire); }
  // Throws DeviceLost when lost().
  void throw_if_lost() const {
    if (lost()) throw_lost();
  }

 private:
  [[noreturn]] void throw_lost() const;
  friend class detail::RuntimeImpl;
  friend struct detail::Access;
  Device(int index, std::unique_ptr<detail::DeviceImpl> impl, detail::RuntimeImpl& runtime);
  int index_;
  detail::RuntimeImpl& runtime_;
  std::unique_ptr<detail::DeviceImpl> impl_;
  std::atomic<bool> lost_{false};
  std::string lost_why_;  // written once, before lost_ is set
  std::mutex lose_mutex_;

 public:
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
};

struct RuntimeOptions {
  // "auto" picks cuda when a GPU is visible, else sim.
  std::string backend = "auto";
  // sim only: number of simulated devices and each one's memory capacity.
  int sim_devices = 2;
  std::size_t sim_capacity_bytes = std::size_t{16} << 30;
  // sim only: keep each simulated device's threads on one host core (device d on the d-th core the
  // process may use, round robin) when there are two or more of both; false leaves them to the OS
  // scheduler, which often stacks two busy devices on one core while another idles. Placement
  // changes no result, only the speed and how steady it is. Turn it off where several processes
  // share the host's cores and number their devices alike (dp_train and dp_bench do, in a job of
  // several processes): they would all crowd the same first cores.
  bool sim_pin_threads = true;
  // How exact the GPU libraries must be (dp/precision.h); the sim computes the same for both.
  Precision precision = Precision::strict;
  // Several dp devices on one GPU ("virtual devices"), so that every multi-device path runs on a
  // machine with one GPU: dp device d runs on GPU d / devices_per_gpu, with its own worker thread,
  // streams, library handles and memory accounting (the GPU's memory is their shared capacity).
  // Copies between devices of one GPU are device-to-device copies; collectives among them use a
  // ring of copies and reduction kernels with the sim ring's summation order (NCCL refuses two
  // ranks on one GPU). cuda: the runtime has (GPUs x devices_per_gpu) devices; sim: sim_devices
  // must be a multiple of it, and sim_capacity_bytes is each simulated GPU's memory. In [1, 64].
  int devices_per_gpu = 1;
};

// Byte and copy counts of one directed link; `kHost` stands for host memory, `kNetwork` for the
// devices of other processes (other nodes: traffic between processes).
inline constexpr int kHost = -1;
inline constexpr int kNetwork = -2;
struct LinkTraffic {
  std::uint64_t bytes = 0;
  std::uint64_t copies = 0;
};

// What the host asked of one device, counted the same way on both backends (dp_bench reports them
// per step): the costs a steady-state step should not have (allocations, pageable copies, host
// synchronisations) and the ones it should have few of (launches, worker submissions).
struct DeviceCounters {
  std::uint64_t launches = 0;         // kernels, library calls (GEMM, convolution) and collectives enqueued
  std::uint64_t host_syncs = 0;       // the host waiting for the device: stream/event/device synchronize,
                                      // and copies into pageable memory (they return once written)
  std::uint64_t allocations = 0;      // device memory allocations
  std::uint64_t pageable_copies = 0;  // copies with a pageable host side
  std::uint64_t worker_submits = 0;   // tasks handed to the device's worker thread (Device::submit)
};

// The memory traffic of one kernel (by name) on a device: the bytes its launches' operands span,
// each operand counted once (what a launch must at least read or write; a library call's, as
// cuBLAS's GEMM or a convolution, by the same rule), and the launches. Counted the same way on both
// backends, when the work is enqueued: an eager step's kernels, a graph's when it is captured (a
// replay adds nothing). Collectives are link traffic (Runtime::link_traffic), not counted here.
struct KernelTraffic {
  std::string kernel;
  std::uint64_t bytes = 0;
  std::uint64_t launches = 0;
};

// Owns the devices of one backend. Create one per process (cuda) or as many as you like (sim).
class Runtime {
 public:
  static std::unique_ptr<Runtime> create(const RuntimeOptions& options = {});
  // Number of usable GPUs; 0 when the driver is missing or refuses (any error means "no GPU").
  static int cuda_device_count();
  // Whether this build of dp contains the cuda backend.
  static bool cuda_compiled();
  // Physical memory of the host, in bytes (simulated devices live in it too).
  static std::uint64_t host_memory_bytes();

  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Backend backend() const;
  int device_count() const;
  int devices_per_gpu() const;  // RuntimeOptions::devices_per_gpu
  Device& device(int index);    // throws InvalidArgument naming the index and the count

  // Pinned (page-locked) host memory: copies to and from it are truly asynchronous.
  PinnedBuffer allocate_pinned(std::size_t bytes);
  // Whether all of [ptr, ptr + bytes) is pinned host memory this runtime's devices copy from
  // asynchronously (allocate_pinned's; on cuda any page-locked memory). False for null.
  bool is_pinned(const void* ptr, std::size_t bytes) const;

  // Traffic enqueued so far on the directed link src -> dst (device index, kHost or kNetwork).
  LinkTraffic link_traffic(int src, int dst) const;
  std::uint64_t bytes_sent(int device) const;      // to other devices
  std::uint64_t bytes_received(int device) const;  // from other devices
  void reset_link_traffic();
  // Work counters of a device since the runtime was made or reset_counters() last ran.
  DeviceCounters counters(int device) const;
  void reset_counters();
  // Memory traffic of a device since the runtime was made or reset_memory_traffic() last ran, by
  // kernel, the most bytes first (KernelTraffic).
  std::vector<KernelTraffic> memory_traffic(int device) const;
  void reset_memory_traffic();

  // Records a span for every piece of stream work from now on (sim backend), for traces and
  // busy-time accounting; take_trace() returns and clears what was recorded.
  void set_profiling(bool on);
  std::vector<TraceSpan> take_trace();

 private:
  friend struct detail::Access;
  explicit Runtime(std::unique_ptr<detail::RuntimeImpl> impl);
  std::unique_ptr<detail::RuntimeImpl> impl_;
};

}  // namespace dp
