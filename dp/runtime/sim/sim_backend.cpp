// sim_backend.cpp — N simulated devices on the host.
// Faithful where it matters for engine correctness: memory is owned per device and every
// operand is checked against the stream's device; a stream is an in-order queue run by its own
// thread, so two streams really overlap and a missing event wait is a real data race.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <pthread.h>
#include <sched.h>
#include <set>
#include <shared_mutex>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include "backend.h"
#include "executor.h"

namespace dp::detail {
namespace {

class SimRuntime;

// The calling thread's last-error slot, as the CUDA runtime keeps one (See Note [last error]): a
// query that finds work pending leaves cudaErrorNotReady (600) there, and every kernel launch
// reads the slot out afterwards and reports what it held, as the launch check after a CUDA launch
// does.
struct LastError {
  int code = 0;
  const char* name = nullptr;
};
thread_local LastError t_last_error;
void set_not_ready() noexcept { t_last_error = {600, "cudaErrorNotReady: device not ready"}; }
void check_last_error_after_launch(const char* kernel) {
  const LastError error = std::exchange(t_last_error, LastError{});
  if (error.code != 0)
    throw Error(
        fmt::format("sim: CUDA error {} ({}) in cudaGetLastError() after launching '{}': an earlier "
                    "call's error was left in the thread's last-error slot",
                    error.code, error.name, kernel));
}

// Which runtime and device (or pinned host memory: kHost) each simulated allocation belongs to.
// Process-wide because a pointer may be handed to the wrong runtime as well as the wrong device.
class AllocationRegistry {
 public:
  struct Owner {
    const SimRuntime* runtime = nullptr;
    int device = kHost;
  };
  static AllocationRegistry& instance() {
    static AllocationRegistry registry;
    return registry;
  }
  void add(const void* base, std::size_t bytes, Owner owner) {
    std::unique_lock lock(mutex_);
    blocks_[reinterpret_cast<std::uintptr_t>(base)] = Block{bytes, owner};
  }
  void remove(const void* base) {
    std::unique_lock lock(mutex_);
    blocks_.erase(reinterpret_cast<std::uintptr_t>(base));
  }
  // The owner of the block containing all of [ptr, ptr+bytes); nullopt-like {nullptr} for host memory.
  // `partial` is set when the range starts inside a block but runs past its end.
  Owner find(const void* ptr, std::size_t bytes, bool& partial) const {
    std::shared_lock lock(mutex_);
    partial = false;
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return {};
    --it;
    if (p >= it->first + it->second.bytes) return {};
    if (p + bytes > it->first + it->second.bytes) partial = true;
    return it->second.owner;
  }

 private:
  struct Block {
    std::size_t bytes;
    Owner owner;
  };
  mutable std::shared_mutex mutex_;
  std::map<std::uintptr_t, Block> blocks_;
};

constexpr std::size_t kAlignment = 256;  // cudaMalloc's alignment guarantee

void* aligned_host_alloc(std::size_t bytes) {
  return std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
}

struct SimCapture;

class SimEvent final : public EventImpl, public std::enable_shared_from_this<SimEvent> {
 public:
  SimEvent(RuntimeImpl& runtime, int device, EventTiming timing = EventTiming::off)
      : runtime_(runtime), device_(device), timing_(timing) {}
  int device() const override { return device_; }

  // The capture whose record is this event's latest (null: none). Such a record exists only in
  // the graph being built: the host cannot wait for it, and a stream that waits on it joins the
  // capture. Set and cleared by the capturing streams; the event's own state is untouched.
  void set_capture(std::shared_ptr<SimCapture> capture, int node) {
    std::lock_guard lock(mutex_);
    capture_ = std::move(capture);
    capture_node_ = node;
  }
  std::pair<std::shared_ptr<SimCapture>, int> capture() const {
    std::lock_guard lock(mutex_);
    return {capture_, capture_node_};
  }

  // Called by SimStream::record: returns the generation that completing this record reaches.
  std::uint64_t begin_record() {
    std::lock_guard lock(mutex_);
    return ++recorded_;
  }
  // Records may complete out of order when one event is recorded on several streams; a waiter
  // for record g must see g itself complete (as with cudaStreamWaitEvent), not a later one.
  // `failure`: what made the recording stream's earlier work fail, if it did. Waiting for or
  // querying that record then fails with it, as a CUDA event behind a faulted kernel reports the
  // sticky error, instead of announcing work done that never was.
  void complete(std::uint64_t generation, std::exception_ptr failure = nullptr) {
    {
      std::lock_guard lock(mutex_);
      if (failure) failed_[generation] = std::move(failure);
      done_.insert(generation);
      while (done_.count(completed_ + 1)) done_.erase(++completed_);
      time_ns_ = now_ns();
    }
    cv_.notify_all();
  }
  bool is_done(std::uint64_t generation) const { return generation <= completed_ || done_.count(generation) != 0; }
  std::uint64_t latest_record() const {
    std::lock_guard lock(mutex_);
    return recorded_;
  }
  void wait_until(std::uint64_t generation) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return is_done(generation); });
  }
  // A stream's wait for a record: as wait_until, then fails (poisoning the waiting stream) if the
  // work before the record failed, so work that depends on failed work is not announced done
  // either (a fault poisons the whole CUDA context, not one stream).
  void wait_on_stream(std::uint64_t generation) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return is_done(generation); });
    rethrow_failure(generation);
  }

  bool query() override {
    if (done()) return true;
    set_not_ready();
    return false;
  }
  void clear_not_ready() noexcept override { t_last_error = {}; }
  void synchronize() override {
    refuse_if_captured("synchronize");
    runtime_.count(device_, Counter::host_syncs);
    const std::uint64_t generation = latest_record();
    wait_until(generation);
    std::lock_guard lock(mutex_);
    rethrow_failure(generation);
  }
  double elapsed_ms_since(EventImpl& start) override {
    auto& begin = static_cast<SimEvent&>(start);
    if (timing_ == EventTiming::off || begin.timing_ == EventTiming::off)
      throw InvalidArgument(
          "Event::elapsed_ms: both events must be created with EventTiming::on (cudaEventDisableTiming events have "
          "no timestamps)");
    if (!done() || !begin.done() || recorded_at_least_once() == false || !begin.recorded_at_least_once())
      throw InvalidArgument("Event::elapsed_ms: both events must be recorded and completed");
    return static_cast<double>(time() - begin.time()) / 1e6;
  }

 private:
  bool done() {
    refuse_if_captured("query");
    std::lock_guard lock(mutex_);
    if (recorded_ == 0) return true;
    if (!is_done(recorded_)) return false;
    rethrow_failure(recorded_);
    return true;
  }
  bool recorded_at_least_once() const {
    std::lock_guard lock(mutex_);
    return recorded_ > 0;
  }
  std::int64_t time() const {
    std::lock_guard lock(mutex_);
    return time_ns_;
  }
  void refuse_if_captured(const char* op) const;
  void rethrow_failure(std::uint64_t generation) const {  // under mutex_
    if (const auto it = failed_.find(generation); it != failed_.end()) std::rethrow_exception(it->second);
  }

  RuntimeImpl& runtime_;
  int device_;
  EventTiming timing_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::shared_ptr<SimCapture> capture_;
  int capture_node_ = -1;
  std::uint64_t recorded_ = 0;
  std::uint64_t completed_ = 0;                         // every generation <= this one has completed
  std::set<std::uint64_t> done_;                        // completed generations above completed_
  std::map<std::uint64_t, std::exception_ptr> failed_;  // records that completed behind failed work
  std::int64_t time_ns_ = 0;
};

class SimDevice;
class SimStream;

// One capture in progress (Stream::begin_capture): the operations issued to its streams, in issue
// order across streams, with the dependencies CUDA would give the graph's nodes (the previous
// operation of the same stream, and the record an event wait refers to).
struct SimCapture {
  enum class Kind { work, record, wait };
  struct Node {
    SimStream* stream;
    Kind kind;
    const char* name;
    SpanKind span;
    std::function<std::function<void()>()> issue;  // work: the body of one execution
    std::shared_ptr<SimEvent> event;               // record, wait: the user's event (capture only)
    std::vector<int> deps;
    int record_node = -1;  // wait: the record node it waits for
  };
  explicit SimCapture(SimStream* origin_stream) : origin(origin_stream), origin_thread(std::this_thread::get_id()) {}

  // Appends a node issued to `stream` (which must have joined) after `extra` (a record it waits for).
  // An invalidated capture takes nothing more: every later use of its streams fails until it is
  // ended (cudaErrorStreamCaptureInvalidated).
  int add(SimStream* stream, Node node, int extra = -1) {
    std::lock_guard lock(mutex);
    if (!invalid.empty())
      throw CaptureError(
          fmt::format("stream capture was invalidated earlier ({}); end it on the stream that began it", invalid));
    auto it = last.find(stream);
    if (it != last.end() && it->second >= 0) node.deps.push_back(it->second);
    if (extra >= 0) node.deps.push_back(extra);
    if (extra >= 0 && node.kind == Kind::wait) node.record_node = extra;
    node.stream = stream;
    nodes.push_back(std::move(node));
    const int index = static_cast<int>(nodes.size()) - 1;
    last[stream] = index;
    return index;
  }
  void invalidate(const std::string& why) {
    std::lock_guard lock(mutex);
    if (invalid.empty()) invalid = why;
  }

  std::mutex mutex;
  SimStream* origin;
  std::thread::id origin_thread;                    // thread-local capture mode: only this thread may end it
  bool ended = false;                               // under mutex
  std::vector<std::shared_ptr<SimStream>> streams;  // joined, the origin first
  std::vector<std::shared_ptr<SimEvent>> events;    // recorded inside: unmarked when the capture ends
  std::map<SimStream*, int> last;                   // each stream's latest node
  std::vector<Node> nodes;
  std::string invalid;  // why the capture was invalidated (empty: it was not)
};

// The captures the calling thread began and has not ended. In cudaStreamCaptureModeThreadLocal
// (the mode both backends use) the calls CUDA deems unsafe (cudaMalloc, cudaMallocHost, ...) fail
// on that thread only, whichever device they name, and invalidate its captures; other threads,
// even those whose streams joined a capture, are not affected.
thread_local std::vector<std::weak_ptr<SimCapture>> t_captures;

void refuse_on_capturing_thread(const std::string& what) {
  std::vector<std::shared_ptr<SimCapture>> live;
  for (const auto& weak : t_captures)
    if (auto capture = weak.lock()) {
      std::lock_guard lock(capture->mutex);
      if (!capture->ended) live.push_back(std::move(capture));
    }
  if (live.empty()) return;
  const std::string why = fmt::format("{} on a thread that is capturing a stream into a graph", what);
  for (auto& capture : live) capture->invalidate(why);
  throw CaptureError(why);
}

void SimEvent::refuse_if_captured(const char* op) const {
  const auto capture = this->capture().first;
  if (!capture) return;
  const std::string why = fmt::format(
      "Event::{} on device {}: its latest record is inside a stream capture, which the host cannot wait for", op,
      device_);
  capture->invalidate(why);
  throw CaptureError(why);
}

// The host cores a simulated device's threads run on. Left to the OS scheduler, the threads of
// two devices that wake each other every step (a stream waking its peer's collective, the host
// waking both) are often placed on one core by wake-affine placement while the other idles, and
// stay there for many steps: the same run then measured 57k or 103k samples/s on two cores. Each
// device's threads (its streams and its worker) are kept on one core: device d on the d-th core
// the process may use, round robin. Only where there is a choice to make: two or more devices
// and two or more cores; the host's own threads stay where the scheduler puts them.
std::vector<int> placement_cores(const RuntimeOptions& options) {
  if (!options.sim_pin_threads || options.sim_devices < 2) return {};
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  std::vector<int> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cores.push_back(cpu);
  if (cores.size() < 2) return {};
  return cores;
}

// Runs first on each thread of a device placed on `core` (-1: not placed). A refusal (a cgroup
// that changed under the process) leaves the thread where it is: placement is a speed, not a rule.
void place_this_thread(int core) {
  if (core < 0) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(core, &one);
  (void)pthread_setaffinity_np(pthread_self(), sizeof one, &one);
}

class SimRuntime final : public RuntimeImpl {
 public:
  explicit SimRuntime(const RuntimeOptions& options);
  ~SimRuntime() override;
  Backend backend() const override { return Backend::sim; }
  // What each thread of device `device` runs first: its placement on the device's core, if any.
  SerialExecutor::Task place_on_start(int device) const {
    const int core = cores_.empty() ? -1 : cores_[static_cast<std::size_t>(device) % cores_.size()];
    return [core] { place_this_thread(core); };
  }
  void* allocate_pinned(std::size_t bytes) override {
    refuse_on_capturing_thread(fmt::format("pinned allocation of {} bytes", bytes));
    void* ptr = aligned_host_alloc(bytes);
    if (!ptr) throw OutOfMemory(kHost, bytes, 0, 0);
    AllocationRegistry::instance().add(ptr, bytes, {this, kHost});
    return ptr;
  }
  // cudaFreeHost waits for the device work that may still copy from or to the buffer.
  void free_pinned(void* ptr) noexcept override;
  bool is_pinned(const void* ptr, std::size_t bytes) const override {
    bool partial = false;
    const auto owner = AllocationRegistry::instance().find(ptr, bytes, partial);
    return owner.runtime == this && owner.device == kHost && !partial;
  }

 private:
  std::vector<int> cores_;  // placement_cores; empty: no placement
};

class SimStream final : public StreamImpl, public std::enable_shared_from_this<SimStream> {
 public:
  SimStream(SimRuntime& runtime, int index)
      : runtime_(runtime),
        device_(index),
        id_(runtime.next_stream_id()),
        executor_(fmt::format("sim{}.stream{}", index, id_), runtime.place_on_start(index)) {}

  int device() const override { return device_; }
  Backend backend() const override { return Backend::sim; }

  void record(EventImpl& event) override {
    auto sim_event = static_cast<SimEvent&>(event).shared_from_this();
    if (sim_event->device() != device_)
      throw DeviceMismatch(
          fmt::format("event of device {} recorded on a stream of device {}", sim_event->device(), device_));
    if (auto capture = current_capture()) {
      const int node =
          capture->add(this, {nullptr, SimCapture::Kind::record, "record", SpanKind::sync, {}, sim_event, {}});
      {
        std::lock_guard lock(capture->mutex);
        capture->events.push_back(sim_event);
      }
      sim_event->set_capture(capture, node);
      return;
    }
    rethrow_sticky_error();  // before taking a generation that a refused post could never complete
    sim_event->set_capture(nullptr, -1);
    post_record(*sim_event);
  }

  void wait(EventImpl& event) override {
    auto sim_event = static_cast<SimEvent&>(event).shared_from_this();
    const auto [event_capture, record_node] = sim_event->capture();
    auto capture = current_capture();
    if (event_capture) {
      if (capture && capture != event_capture) {
        // cudaErrorStreamCaptureMerge: both captures are invalidated.
        const std::string why =
            fmt::format("a stream of device {} waits on an event recorded in another capture", device_);
        event_capture->invalidate(why);
        fail(capture, why);
      }
      if (!capture) join(event_capture);  // a fork: this stream's work joins the graph from here on
      event_capture->add(this, {nullptr, SimCapture::Kind::wait, "wait", SpanKind::sync, {}, sim_event, {}},
                         record_node);
      return;
    }
    // Captures the latest record now, as cudaStreamWaitEvent does; later records do not matter.
    const std::uint64_t generation = sim_event->latest_record();
    if (generation == 0) return;  // never recorded: nothing to wait for, captured or not
    if (capture)
      fail(capture,
           fmt::format("a capturing stream of device {} waits on an event recorded outside the capture", device_));
    post_wait(sim_event, generation);
  }

  bool query() override {
    refuse_while_capturing("Stream::query");
    rethrow_sticky_error();
    if (executor_.completed() == executor_.submitted()) return true;
    set_not_ready();
    return false;
  }
  void clear_not_ready() noexcept override { t_last_error = {}; }
  void synchronize() override {
    refuse_while_capturing("Stream::synchronize");
    count(Counter::host_syncs);
    finish();
  }
  // synchronize() without counting: for a device's synchronize, which counts once for its streams.
  void finish() {
    refuse_while_capturing("Device::synchronize");
    executor_.wait_idle();
    rethrow_sticky_error();
  }

  void copy(void* dst, const void* src, std::size_t bytes) override;

  void launch_host_func(std::function<void()> fn) override {
    if (auto capture = current_capture()) {
      capture->add(this, {nullptr, SimCapture::Kind::work, "host_func", SpanKind::host, [fn] { return fn; }, {}, {}});
      return;
    }
    post("host_func", SpanKind::host, std::move(fn));
  }

  void check_access(const void* ptr, std::size_t bytes, const char* op) override {
    bool partial = false;
    const auto owner = AllocationRegistry::instance().find(ptr, bytes, partial);
    if (owner.runtime == nullptr)
      throw DeviceMismatch(fmt::format("{}: operand {} is not device memory (stream on device {})", op, ptr, device_));
    if (owner.runtime != &runtime_)
      throw DeviceMismatch(
          fmt::format("{}: operand {} belongs to another runtime (stream on device {})", op, ptr, device_));
    if (owner.device != device_)
      throw DeviceMismatch(fmt::format(
          "{}: operand {} lives on {} but the stream is on device {}", op, ptr,
          owner.device == kHost ? std::string("pinned host memory") : fmt::format("device {}", owner.device), device_));
    if (partial)
      throw DeviceMismatch(fmt::format("{}: operand {} (+{} bytes) runs past the end of its allocation on device {}",
                                       op, ptr, bytes, device_));
  }

  void enqueue_kernel(const char* name, std::function<void()> body, SpanKind kind) override {
    count(Counter::launches);
    if (auto capture = current_capture())
      capture->add(this, {nullptr, SimCapture::Kind::work, name, kind, [body] { return body; }, {}, {}});
    else
      post(name, kind, std::move(body));
    check_last_error_after_launch(name);
  }
  void enqueue_reissued(const char* name, std::function<std::function<void()>()> issue, SpanKind kind) override {
    count(Counter::launches);
    if (auto capture = current_capture())
      capture->add(this, {nullptr, SimCapture::Kind::work, name, kind, std::move(issue), {}, {}});
    else
      post(name, kind, issue());
    check_last_error_after_launch(name);
  }

  void begin_capture() override;
  std::shared_ptr<GraphImpl> end_capture() override;
  bool capturing() override { return current_capture() != nullptr; }

  void* native_handle() override { return nullptr; }
  int multiprocessor_count() const override { return 1; }
  int make_current() override { return -1; }
  void with_library(kernel_api::Library, const std::function<void(kernel_api::LibraryCall&)>&) override {
    throw Error(fmt::format("sim device {}: CUDA library handles exist on cuda devices only", device_));
  }
  void* kernel_scratch(std::size_t) override {
    throw Error(
        fmt::format("sim device {}: kernel scratch is for CUDA kernels; sim kernels keep their temporaries", device_));
  }
  RuntimeImpl& runtime() const override { return runtime_; }

  void drain() { executor_.wait_idle(); }

  // A replayed graph's nodes, issued to this stream as if issued anew. Records and waits use the
  // graph's own events: inside a graph they are dependencies only, and replaying one leaves the
  // events recorded during the capture as they are (as cudaEventRecord captured into a graph does).
  void replay_work(const SimCapture::Node& node) { post(node.name, node.span, node.issue()); }
  void replay_record(SimEvent& event) {
    rethrow_sticky_error();
    post_record(event);
  }
  void replay_wait(const std::shared_ptr<SimEvent>& event) {
    // The record it waits for was replayed earlier in this replay: it is the latest.
    if (const std::uint64_t generation = event->latest_record()) post_wait(event, generation);
  }

  std::shared_ptr<SimCapture> current_capture() {
    std::lock_guard lock(capture_mutex_);
    return capture_;
  }
  // Marks the capture invalid (CUDA invalidates a capture on a forbidden call) and throws.
  [[noreturn]] void fail(const std::shared_ptr<SimCapture>& capture, const std::string& why) {
    capture->invalidate(why);
    throw CaptureError(why);
  }
  void leave_capture();

 private:
  void join(std::shared_ptr<SimCapture> capture);
  void refuse_while_capturing(const char* op) {
    if (auto capture = current_capture())
      fail(capture, fmt::format("{} on device {} while the stream is being captured into a graph", op, device_));
  }
  void post_record(SimEvent& event) {
    auto shared = event.shared_from_this();
    // Refused before the generation is taken: a record that is taken but never posted would never
    // complete, and every later wait for the event would hang.
    rethrow_sticky_error();
    const std::uint64_t generation = shared->begin_record();
    // The task runs on the stream's thread, the only writer of the failure it reads; the
    // completion runs right after it.
    auto failure = std::make_shared<std::exception_ptr>();
    post_unchecked(
        "record", SpanKind::sync, [this, failure] { *failure = executor_.failure_seen_by_tasks(); },
        [shared, generation, failure] { shared->complete(generation, *failure); });
  }
  void post_wait(const std::shared_ptr<SimEvent>& event, std::uint64_t generation) {
    post("wait", SpanKind::sync, [event, generation] { event->wait_on_stream(generation); });
  }

  // Work behind a failed task does not run, as nothing runs in a CUDA context after a fault: a
  // copy or kernel enqueued before the host saw the failure must not touch memory that later work
  // (which may no longer wait for it: its events were never recorded) reuses. Its records still
  // complete, with the failure (post_record). Collectives still meet their peers, which would
  // otherwise hang until the communicator is aborted.
  template <class F>
  std::uint64_t post(const char* name, SpanKind kind, F&& fn, SerialExecutor::Task after = {}) {
    rethrow_sticky_error();
    if (kind == SpanKind::collective) return post_unchecked(name, kind, std::forward<F>(fn), std::move(after));
    return post_unchecked(
        name, kind,
        [this, fn = std::forward<F>(fn)]() mutable {
          if (!executor_.failure_seen_by_tasks()) fn();  // the stream's own thread: the failure's writer
        },
        std::move(after));
  }
  template <class F>
  std::uint64_t post_unchecked(const char* name, SpanKind kind, F&& fn, SerialExecutor::Task after = {}) {
    return executor_.post(
        [this, name, kind, fn = std::forward<F>(fn)]() mutable {
          if (!runtime_.profiling()) {
            fn();
            return;
          }
          const std::int64_t start = now_ns();
          fn();
          runtime_.add_span(device_, id_, Span{name, kind, start, now_ns()});
        },
        std::move(after));
  }

  // A task that threw poisons the stream, as a failed kernel poisons a CUDA context.
  void rethrow_sticky_error() {
    if (executor_.has_error()) {
      std::exception_ptr error = executor_.take_error();
      sticky_ = error;
    }
    if (sticky_) std::rethrow_exception(sticky_);
  }

  SimRuntime& runtime_;
  int device_;
  int id_;
  std::exception_ptr sticky_;
  std::mutex capture_mutex_;
  std::shared_ptr<SimCapture> capture_;  // the capture this stream's work goes to (null: it runs)
  SerialExecutor executor_;              // last: joins (draining queued work) before the members above die
};

// Replays post every node, in captured order, to the stream it was captured on: a record is
// replayed before any wait that refers to it, so each wait finds the record of its own replay.
class SimGraph final : public GraphImpl {
 public:
  SimGraph(RuntimeImpl& runtime, int device, std::vector<SimCapture::Node> nodes,
           std::vector<std::shared_ptr<SimStream>> streams)
      : runtime_(runtime), device_(device), nodes_(std::move(nodes)), streams_(std::move(streams)) {
    events_.resize(nodes_.size());
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      nodes_[i].event.reset();  // the user's event is not the graph's
      if (nodes_[i].kind == SimCapture::Kind::record)
        events_[i] = std::make_shared<SimEvent>(runtime_, nodes_[i].stream->device());
    }
  }
  void replay() override {
    for (auto& stream : streams_)
      if (stream->capturing())
        throw InvalidArgument(fmt::format("Graph::replay: a stream of device {} is capturing", stream->device()));
    runtime_.count(device_, Counter::launches);  // one graph launch
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      const SimCapture::Node& node = nodes_[i];
      switch (node.kind) {
        case SimCapture::Kind::work: node.stream->replay_work(node); break;
        case SimCapture::Kind::record: node.stream->replay_record(*events_[i]); break;
        case SimCapture::Kind::wait:
          node.stream->replay_wait(events_[static_cast<std::size_t>(node.record_node)]);
          break;
      }
    }
  }
  std::size_t nodes() const override { return nodes_.size(); }

 private:
  RuntimeImpl& runtime_;
  int device_;
  std::vector<SimCapture::Node> nodes_;
  std::vector<std::shared_ptr<SimEvent>> events_;    // per record node: the graph's own event
  std::vector<std::shared_ptr<SimStream>> streams_;  // keep the nodes' streams alive
};

class SimDevice final : public DeviceImpl {
 public:
  SimDevice(SimRuntime& runtime, int index, std::shared_ptr<MemoryCounter> gpu)
      : runtime_(runtime),
        index_(index),
        gpu_memory_(std::move(gpu)),
        memory_(gpu_memory_->capacity()),
        worker_(fmt::format("sim{}.worker", index), runtime.place_on_start(index)) {}

  Backend backend() const override { return Backend::sim; }
  std::string name() const override {
    return runtime_.devices_per_gpu() > 1 ? fmt::format("sim:{} (GPU {})", index_, runtime_.gpu_of(index_))
                                          : fmt::format("sim:{}", index_);
  }
  std::string gpu_uuid() const override {
    const int gpu = runtime_.gpu_of(index_);
    if (const char* prefix = std::getenv("DP_SIM_GPU_UUID"); prefix && *prefix)
      return fmt::format("{}-{}", prefix, gpu);
    char host[256] = {};
    if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    return fmt::format("sim-{}-{}-{}", host, getpid(), gpu);
  }

  void* allocate(std::size_t bytes) override {
    runtime_.count(index_, Counter::allocations);
    refuse_on_capturing_thread(fmt::format("allocation of {} bytes on device {}", bytes, index_));
    if (!gpu_memory_->reserve(bytes)) {  // what the GPU's devices hold together
      const auto stats = gpu_memory_->stats();
      throw OutOfMemory(index_, bytes, stats.in_use, stats.capacity);
    }
    memory_.reserve(bytes);  // never more than the GPU's sum
    void* ptr = aligned_host_alloc(bytes);
    if (!ptr) {
      memory_.release(bytes);
      gpu_memory_->release(bytes);
      const auto stats = memory_.stats();
      throw OutOfMemory(index_, bytes, stats.in_use, stats.capacity);
    }
    AllocationRegistry::instance().add(ptr, bytes, {&runtime_, index_});
    return ptr;
  }

  void free(void* ptr, std::size_t bytes) noexcept override {
    // cudaFree waits for the device to be idle; so does the simulator, so freeing memory a
    // queued kernel still uses is not a use-after-free.
    synchronize_noexcept();
    AllocationRegistry::instance().remove(ptr);
    std::free(ptr);
    memory_.release(bytes);
    gpu_memory_->release(bytes);
  }

  MemoryStats memory() const override { return memory_.stats(); }
  void reset_peak_memory() override { memory_.reset_peak(); }

  std::shared_ptr<StreamImpl> create_stream() override {
    auto stream = std::make_shared<SimStream>(runtime_, index_);
    std::lock_guard lock(streams_mutex_);
    std::erase_if(streams_, [](const std::weak_ptr<SimStream>& s) { return s.expired(); });
    streams_.push_back(stream);
    return stream;
  }
  std::shared_ptr<EventImpl> create_event(EventTiming timing) override {
    return std::make_shared<SimEvent>(runtime_, index_, timing);
  }

  // Waits for every stream even when one has failed, then reports the first failure.
  void synchronize() override {
    runtime_.count(index_, Counter::host_syncs);
    std::exception_ptr first;
    for (auto& stream : live_streams()) {
      try {
        stream->finish();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  std::future<void> submit(std::function<void()> task) override {
    runtime_.count(index_, Counter::worker_submits);
    auto packaged = std::make_shared<std::packaged_task<void()>>(std::move(task));
    auto future = packaged->get_future();
    worker_.post([packaged] { (*packaged)(); });
    return future;
  }

  void synchronize_noexcept() noexcept {
    try {
      for (auto& stream : live_streams()) stream->drain();
    } catch (...) {
    }
  }

 private:
  std::vector<std::shared_ptr<SimStream>> live_streams() {
    std::vector<std::shared_ptr<SimStream>> out;
    std::lock_guard lock(streams_mutex_);
    for (auto& weak : streams_)
      if (auto s = weak.lock()) out.push_back(std::move(s));
    return out;
  }
  SimRuntime& runtime_;
  int index_;
  std::shared_ptr<MemoryCounter> gpu_memory_;  // shared by the devices of one simulated GPU
  MemoryCounter memory_;                       // this device's own
  std::mutex streams_mutex_;
  std::vector<std::weak_ptr<SimStream>> streams_;
  SerialExecutor worker_;
};

void SimStream::begin_capture() {
  if (capturing())
    throw InvalidArgument(fmt::format("Stream::begin_capture: a stream of device {} already captures", device_));
  rethrow_sticky_error();
  auto capture = std::make_shared<SimCapture>(this);
  std::erase_if(t_captures, [](const std::weak_ptr<SimCapture>& c) { return c.expired(); });
  t_captures.push_back(capture);
  join(std::move(capture));
}

void SimStream::join(std::shared_ptr<SimCapture> capture) {
  {
    std::lock_guard lock(capture->mutex);
    capture->streams.push_back(shared_from_this());
  }
  {
    std::lock_guard lock(capture_mutex_);
    capture_ = std::move(capture);
  }
}

void SimStream::leave_capture() {
  std::lock_guard lock(capture_mutex_);
  capture_.reset();
}

std::shared_ptr<GraphImpl> SimStream::end_capture() {
  auto capture = current_capture();
  if (!capture)
    throw InvalidArgument(fmt::format("Stream::end_capture: the stream of device {} is not capturing", device_));
  if (capture->origin != this)
    throw InvalidArgument(fmt::format(
        "Stream::end_capture on a stream of device {} that joined the capture: end it on the stream that began it",
        device_));
  // cudaErrorStreamCaptureWrongThread: the capture goes on, and the thread that began it must end it.
  if (capture->origin_thread != std::this_thread::get_id())
    throw InvalidArgument(fmt::format(
        "Stream::end_capture on device {} from a thread other than the one that began the capture (thread-local "
        "capture mode): end it on that thread",
        device_));
  std::lock_guard lock(capture->mutex);  // every stream leaves it now: nothing else adds nodes
  capture->ended = true;
  for (auto& stream : capture->streams) stream->leave_capture();
  for (auto& event : capture->events)
    if (event->capture().first == capture) event->set_capture(nullptr, -1);
  if (!capture->invalid.empty()) throw CaptureError("stream capture was invalidated: " + capture->invalid);
  // As cudaStreamEndCapture: every stream forked into the capture must have joined back, i.e. its
  // last operation is one the origin's last operation depends on.
  std::vector<bool> reached(capture->nodes.size(), false);
  std::vector<int> todo;
  if (auto it = capture->last.find(this); it != capture->last.end()) todo.push_back(it->second);
  while (!todo.empty()) {
    const int node = todo.back();
    todo.pop_back();
    if (reached[static_cast<std::size_t>(node)]) continue;
    reached[static_cast<std::size_t>(node)] = true;
    for (const int dep : capture->nodes[static_cast<std::size_t>(node)].deps) todo.push_back(dep);
  }
  for (const auto& [stream, last] : capture->last)
    if (stream != this && !reached[static_cast<std::size_t>(last)])
      throw CaptureError(
          fmt::format("stream capture: a stream of device {} forked into the capture never joined "
                      "back (the capturing stream must wait on an event recorded after its work)",
                      stream->device()));
  return std::make_shared<SimGraph>(runtime_, device_, std::move(capture->nodes), std::move(capture->streams));
}

void SimStream::copy(void* dst, const void* src, std::size_t bytes) {
  bool src_partial = false, dst_partial = false;
  const auto src_owner = AllocationRegistry::instance().find(src, bytes, src_partial);
  const auto dst_owner = AllocationRegistry::instance().find(dst, bytes, dst_partial);
  for (const auto* owner : {&src_owner, &dst_owner})
    if (owner->runtime != nullptr && owner->runtime != &runtime_)
      throw DeviceMismatch("copy: an operand belongs to another runtime");
  if (src_partial || dst_partial)
    throw DeviceMismatch(fmt::format("copy of {} bytes runs past the end of its {} allocation", bytes,
                                     src_partial ? "source" : "destination"));
  const bool src_pageable = src_owner.runtime == nullptr, dst_pageable = dst_owner.runtime == nullptr;
  const int src_loc = src_pageable ? kHost : src_owner.device;
  const int dst_loc = dst_pageable ? kHost : dst_owner.device;
  // A copy touching device memory must be issued on a stream of one of its devices.
  if (src_loc != device_ && dst_loc != device_ && (src_loc != kHost || dst_loc != kHost))
    throw DeviceMismatch(fmt::format("copy from {} to {} issued on a stream of device {}",
                                     src_loc == kHost ? std::string("host") : fmt::format("device {}", src_loc),
                                     dst_loc == kHost ? std::string("host") : fmt::format("device {}", dst_loc),
                                     device_));
  if (auto capture = current_capture()) {
    if (src_pageable || dst_pageable)
      fail(capture, fmt::format("copy of {} bytes with a pageable host side on device {} while the stream is being "
                                "captured (use pinned memory)",
                                bytes, device_));
    // Counted each time the graph runs it, as the traffic is.
    auto issue = [&runtime = runtime_, dst, src, bytes, src_loc, dst_loc]() -> std::function<void()> {
      runtime.count_copy(src_loc, dst_loc, bytes);
      return [dst, src, bytes] { std::memcpy(dst, src, bytes); };
    };
    capture->add(this, {nullptr, SimCapture::Kind::work, "copy", SpanKind::copy, std::move(issue), {}, {}});
    return;
  }
  runtime_.count_copy(src_loc, dst_loc, bytes);
  if (src_pageable || dst_pageable) count(Counter::pageable_copies);
  if (src_pageable) {
    // cudaMemcpyAsync stages a pageable source before returning: the caller may reuse it at once.
    auto staged = std::make_shared<std::vector<unsigned char>>(static_cast<const unsigned char*>(src),
                                                               static_cast<const unsigned char*>(src) + bytes);
    post("copy", SpanKind::copy, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  } else {
    post("copy", SpanKind::copy, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }
  // ... and writes a pageable destination before returning.
  if (dst_pageable) synchronize();
}

void SimRuntime::free_pinned(void* ptr) noexcept {
  for (int i = 0; i < device_count(); ++i) static_cast<SimDevice&>(Access::device(device(i))).synchronize_noexcept();
  AllocationRegistry::instance().remove(ptr);
  std::free(ptr);
}

SimRuntime::SimRuntime(const RuntimeOptions& options)
    : RuntimeImpl(options.sim_devices, options.devices_per_gpu), cores_(placement_cores(options)) {
  // The devices of one simulated GPU share its memory: each counts its own, and allocates only
  // while their sum fits the GPU's capacity.
  std::shared_ptr<MemoryCounter> gpu;
  for (int i = 0; i < options.sim_devices; ++i) {
    if (i % options.devices_per_gpu == 0) gpu = std::make_shared<MemoryCounter>(options.sim_capacity_bytes);
    add_device(std::make_unique<SimDevice>(*this, i, gpu));
  }
}

SimRuntime::~SimRuntime() = default;

}  // namespace

std::unique_ptr<RuntimeImpl> make_sim_runtime(const RuntimeOptions& options) {
  if (options.sim_devices < 1 || options.sim_devices > 64)
    throw InvalidArgument(fmt::format("sim backend: device count must be in [1, 64], got {}", options.sim_devices));
  if (options.sim_capacity_bytes == 0) throw InvalidArgument("sim backend: device capacity must be > 0 bytes");
  check_devices_per_gpu(options.devices_per_gpu);
  if (options.sim_devices % options.devices_per_gpu != 0)
    throw InvalidArgument(
        fmt::format("sim backend: {} devices do not fill GPUs of {} devices each (devices_per_gpu "
                    "must divide the device count)",
                    options.sim_devices, options.devices_per_gpu));
  return std::make_unique<SimRuntime>(options);
}

}  // namespace dp::detail
