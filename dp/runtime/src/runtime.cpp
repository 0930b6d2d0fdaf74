// runtime.cpp — public handles forwarding to the backend, backend selection, shared accounting.
#include <chrono>
#include <fmt/format.h>
#include <new>
#include <unistd.h>
#include <utility>

#include "backend.h"

namespace dp {

std::string_view to_string(Backend backend) { return backend == Backend::sim ? "sim" : "cuda"; }

OutOfMemory::OutOfMemory(int device, std::size_t requested, std::size_t in_use, std::size_t capacity)
    : Error(device < 0 ? fmt::format("out of pinned host memory: requested {} bytes", requested)
                       : fmt::format("out of memory on device {}: requested {} bytes with {} of {} bytes in use",
                                     device, requested, in_use, capacity)),
      device_(device),
      requested_(requested) {}

WorkerError::WorkerError(int device, const std::string& message, std::exception_ptr cause, int failed_devices)
    : Error(message), device_(device), cause_(std::move(cause)), failed_(failed_devices) {}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

int exit_code(const std::exception_ptr& error) noexcept {
  try {
    std::rethrow_exception(error);
  } catch (const WorkerError& e) {
    return e.cause() ? exit_code(e.cause()) : 1;
  } catch (const InvalidArgument&) {
    return 2;
  } catch (const DataError&) {
    return 2;
  } catch (const OutOfMemory&) {
    return 2;
  } catch (const std::bad_alloc&) {
    return 2;
  } catch (const NonFiniteError&) {
    return 3;
  } catch (const CollectiveMismatch&) {
    return 4;
  } catch (const PeerLost&) {
    return 5;
  } catch (const CollectiveTimeout&) {
    return 6;
  } catch (const DeviceLost&) {
    return 7;
  } catch (const ReplicaMismatch&) {
    return 8;
  } catch (...) {
    return 1;
  }
}

// ---- Event
// A "not ready" is an answer, not a failure: read out of the thread's last-error slot here, once for
// both backends (See Note [last error]).
bool Event::query() const {
  if (!impl_) return true;
  const bool done = impl_->query();
  if (!done) impl_->clear_not_ready();
  return done;
}
void Event::synchronize() const {
  if (impl_) impl_->synchronize();
}
double Event::elapsed_ms(const Event& start, const Event& end) {
  if (!start.impl_ || !end.impl_) throw InvalidArgument("Event::elapsed_ms: event not created");
  if (start.impl_->device() != end.impl_->device())
    throw InvalidArgument(
        fmt::format("Event::elapsed_ms: events of devices {} and {}", start.impl_->device(), end.impl_->device()));
  return end.impl_->elapsed_ms_since(*start.impl_);
}

// ---- Stream
using detail::Access;

// What a stream is, answered for a lost device's too (messages name it).
int Stream::device() const { return Access::unchecked_stream(*this).device(); }
Backend Stream::backend() const { return Access::unchecked_stream(*this).backend(); }
void Stream::record(const Event& event) const { Access::stream(*this).record(Access::event(event)); }
void Stream::wait(const Event& event) const { Access::stream(*this).wait(Access::event(event)); }
bool Stream::query() const {
  detail::StreamImpl& impl = Access::stream(*this);
  const bool done = impl.query();
  if (!done) impl.clear_not_ready();
  return done;
}
void Stream::synchronize() const { Access::stream(*this).synchronize(); }
void Stream::copy(void* dst, const void* src, std::size_t bytes) const {
  if (bytes == 0) return;
  if (!dst || !src) throw InvalidArgument("Stream::copy: null pointer");
  Access::stream(*this).copy(dst, src, bytes);
}
void Stream::launch_host_func(std::function<void()> fn) const { Access::stream(*this).launch_host_func(std::move(fn)); }
void Stream::begin_capture() const { Access::stream(*this).begin_capture(); }
Graph Stream::end_capture() const { return Graph(Access::stream(*this).end_capture()); }
bool Stream::capturing() const { return Access::stream(*this).capturing(); }

// ---- Graph
void Graph::replay() const {
  if (!impl_) throw InvalidArgument("Graph::replay: empty graph handle (nothing was captured)");
  impl_->replay();
}
std::size_t Graph::nodes() const { return impl_ ? impl_->nodes() : 0; }

// ---- Device
Device::Device(int index, std::unique_ptr<detail::DeviceImpl> impl, detail::RuntimeImpl& runtime)
    : index_(index), runtime_(runtime), impl_(std::move(impl)) {}
Device::~Device() = default;
Backend Device::backend() const { return impl_->backend(); }
std::string Device::name() const { return impl_->name(); }
std::string Device::gpu_uuid() const { return impl_->gpu_uuid(); }
int Device::gpu() const noexcept { return runtime_.gpu_of(index_); }
DeviceBuffer Device::allocate(std::size_t bytes) {
  throw_if_lost();
  if (bytes == 0) return {};
  return impl_->wrap(index_, impl_->allocate(bytes), bytes);
}
MemoryStats Device::memory() const { return impl_->memory(); }
void Device::reset_peak_memory() { impl_->reset_peak_memory(); }
Stream Device::create_stream() {
  throw_if_lost();
  return Stream(impl_->create_stream());
}
Event Device::create_event(EventTiming timing) {
  throw_if_lost();
  return Event(impl_->create_event(timing));
}
void Device::synchronize() {
  throw_if_lost();
  impl_->synchronize();
}
void Device::lose(const std::string& why) {
  std::lock_guard lock(lose_mutex_);
  if (lost()) return;
  lost_why_ = why;
  lost_.store(true, std::memory_order_release);
}
void Device::throw_lost() const { throw DeviceLost(index_, fmt::format("device {} is lost ({})", index_, lost_why_)); }
std::future<void> Device::submit(std::function<void()> task) { return impl_->submit(std::move(task)); }

// ---- buffers
DeviceBuffer::~DeviceBuffer() { reset(); }
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    device_ = std::exchange(other.device_, -1);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}
void DeviceBuffer::reset() noexcept {
  if (data_ && owner_) owner_->free(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  device_ = -1;
}

PinnedBuffer::~PinnedBuffer() { reset(); }
PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}
void PinnedBuffer::reset() noexcept {
  if (data_ && owner_) owner_->free_pinned(data_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

// ---- Runtime
Runtime::Runtime(std::unique_ptr<detail::RuntimeImpl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

int Runtime::cuda_device_count() { return detail::cuda_device_count_impl(); }
bool Runtime::cuda_compiled() { return detail::cuda_compiled_impl(); }
std::uint64_t Runtime::host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

std::unique_ptr<Runtime> Runtime::create(const RuntimeOptions& options) {
  const std::string& name = options.backend;
  std::unique_ptr<detail::RuntimeImpl> impl;
  if (name == "sim")
    impl = detail::make_sim_runtime(options);
  else if (name == "cuda")
    impl = detail::make_cuda_runtime(options);
  else if (name == "auto")
    impl = cuda_device_count() > 0 ? detail::make_cuda_runtime(options) : detail::make_sim_runtime(options);
  else
    throw InvalidArgument(fmt::format("unknown backend '{}' (expected auto, cuda or sim)", name));
  impl->set_precision(options.precision);
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

Backend Runtime::backend() const { return impl_->backend(); }
int Runtime::device_count() const { return impl_->device_count(); }
int Runtime::devices_per_gpu() const { return impl_->devices_per_gpu(); }
Device& Runtime::device(int index) { return impl_->device(index); }
PinnedBuffer Runtime::allocate_pinned(std::size_t bytes) {
  if (bytes == 0) return {};
  return impl_->wrap_pinned(impl_->allocate_pinned(bytes), bytes);
}
bool Runtime::is_pinned(const void* ptr, std::size_t bytes) const {
  return ptr != nullptr && impl_->is_pinned(ptr, bytes);
}
bool Device::is_pinned(const void* ptr, std::size_t bytes) const {
  return ptr != nullptr && runtime_.is_pinned(ptr, bytes);
}
PinnedBuffer Device::allocate_pinned(std::size_t bytes) {
  if (bytes == 0) return {};
  return runtime_.wrap_pinned(runtime_.allocate_pinned(bytes), bytes);
}
LinkTraffic Runtime::link_traffic(int src, int dst) const { return impl_->link_traffic(src, dst); }
std::uint64_t Runtime::bytes_sent(int device) const {
  std::uint64_t total = 0;
  for (int d = 0; d < device_count(); ++d)
    if (d != device) total += impl_->link_traffic(device, d).bytes;
  return total;
}
std::uint64_t Runtime::bytes_received(int device) const {
  std::uint64_t total = 0;
  for (int d = 0; d < device_count(); ++d)
    if (d != device) total += impl_->link_traffic(d, device).bytes;
  return total;
}
void Runtime::reset_link_traffic() { impl_->reset_link_traffic(); }
DeviceCounters Runtime::counters(int device) const { return impl_->counters(device); }
void Runtime::reset_counters() { impl_->reset_counters(); }
std::vector<KernelTraffic> Runtime::memory_traffic(int device) const { return impl_->memory_traffic(device); }
void Runtime::reset_memory_traffic() { impl_->reset_memory_traffic(); }
void Runtime::set_profiling(bool on) { impl_->set_profiling(on); }
std::vector<TraceSpan> Runtime::take_trace() {
  std::vector<TraceSpan> out;
  for (auto& stream : impl_->take_spans())
    for (auto& span : stream.spans)
      out.push_back(
          TraceSpan{stream.device, stream.stream_id, std::move(span.name), span.kind, span.start_ns, span.end_ns});
  return out;
}

namespace detail {

StreamImpl& Access::unchecked_stream(const Stream& stream) {
  if (!stream.impl_) throw InvalidArgument("use of an empty dp::Stream (create it with Device::create_stream)");
  return *stream.impl_;
}
StreamImpl& Access::stream(const Stream& stream) {
  if (!stream.impl_) throw InvalidArgument("use of an empty dp::Stream (create it with Device::create_stream)");
  // Every call on a stream passes here: a lost device refuses them all, as a CUDA context does
  // after an error that ends it.
  stream.impl_->runtime().device(stream.impl_->device()).throw_if_lost();
  return *stream.impl_;
}
EventImpl& Access::event(const Event& event) {
  if (!event.impl_) throw InvalidArgument("use of an empty dp::Event (create it with Device::create_event)");
  return *event.impl_;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool MemoryCounter::reserve(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  if (bytes > capacity_ - in_use_) return false;
  in_use_ += bytes;
  ++allocations_;
  ++allocations_made_;
  if (in_use_ > peak_) peak_ = in_use_;
  return true;
}
void MemoryCounter::release(std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  in_use_ -= bytes;
  --allocations_;
}
MemoryStats MemoryCounter::stats() const {
  std::lock_guard lock(mutex_);
  return MemoryStats{in_use_, peak_, capacity_, allocations_, allocations_made_};
}
void MemoryCounter::reset_peak() {
  std::lock_guard lock(mutex_);
  peak_ = in_use_;
}

void check_devices_per_gpu(int devices_per_gpu) {
  if (devices_per_gpu < 1 || devices_per_gpu > 64)
    throw InvalidArgument(fmt::format("devices_per_gpu must be in [1, 64], got {}", devices_per_gpu));
}

RuntimeImpl::RuntimeImpl(int device_count, int devices_per_gpu)
    : expected_devices_(device_count), devices_per_gpu_(devices_per_gpu) {
  const std::size_t slots = static_cast<std::size_t>(device_count + 2) * static_cast<std::size_t>(device_count + 2);
  link_bytes_ = std::make_unique<std::atomic<std::uint64_t>[]>(slots);
  link_copies_ = std::make_unique<std::atomic<std::uint64_t>[]>(slots);
  counters_ = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(device_count) * kCounters);
  traffic_ = std::make_unique<Traffic[]>(static_cast<std::size_t>(device_count));
  reset_link_traffic();
  reset_counters();
}

void RuntimeImpl::add_device(std::unique_ptr<DeviceImpl> impl) {
  const int index = device_count();
  devices_.push_back(std::unique_ptr<Device>(new Device(index, std::move(impl), *this)));
}

Device& RuntimeImpl::device(int index) {
  if (index < 0 || index >= device_count())
    throw InvalidArgument(fmt::format("device {} does not exist: the {} backend has {} device(s)", index,
                                      dp::to_string(backend()), device_count()));
  return *devices_[static_cast<std::size_t>(index)];
}

std::size_t RuntimeImpl::slot(int index) const {
  if (index == kHost) return static_cast<std::size_t>(expected_devices_);
  if (index == kNetwork) return static_cast<std::size_t>(expected_devices_) + 1;
  if (index < 0 || index >= expected_devices_)
    throw InvalidArgument(fmt::format("link endpoint {} is not a device of this runtime", index));
  return static_cast<std::size_t>(index);
}

void RuntimeImpl::count_copy(int src, int dst, std::size_t bytes) {
  const std::size_t i = slot(src) * static_cast<std::size_t>(expected_devices_ + 2) + slot(dst);
  link_bytes_[i].fetch_add(bytes, std::memory_order_relaxed);
  link_copies_[i].fetch_add(1, std::memory_order_relaxed);
}

LinkTraffic RuntimeImpl::link_traffic(int src, int dst) const {
  const std::size_t i = slot(src) * static_cast<std::size_t>(expected_devices_ + 2) + slot(dst);
  return LinkTraffic{link_bytes_[i].load(), link_copies_[i].load()};
}

DeviceCounters RuntimeImpl::counters(int device) const {
  if (device < 0 || device >= expected_devices_)
    throw InvalidArgument(
        fmt::format("counters of device {}: the runtime has {} device(s)", device, expected_devices_));
  const auto at = [&](Counter c) {
    return counters_[static_cast<std::size_t>(device) * kCounters + static_cast<std::size_t>(c)].load();
  };
  return DeviceCounters{at(Counter::launches), at(Counter::host_syncs), at(Counter::allocations),
                        at(Counter::pageable_copies), at(Counter::worker_submits)};
}

void RuntimeImpl::reset_counters() {
  for (std::size_t i = 0; i < static_cast<std::size_t>(expected_devices_) * kCounters; ++i) counters_[i].store(0);
}

void StreamImpl::count(Counter counter) const { runtime().count(device(), counter); }

void RuntimeImpl::count_traffic(int device, const char* kernel, std::uint64_t bytes) {
  Traffic& t = traffic_[static_cast<std::size_t>(device)];
  const std::lock_guard lock(t.mutex);
  auto& [total, launches] = t.by_kernel[kernel];
  total += bytes;
  ++launches;
}

std::vector<KernelTraffic> RuntimeImpl::memory_traffic(int device) const {
  if (device < 0 || device >= expected_devices_)
    throw InvalidArgument(
        fmt::format("memory traffic of device {}: the runtime has {} device(s)", device, expected_devices_));
  std::map<std::string, KernelTraffic> merged;  // one row per name, whichever literal carried it
  {
    const Traffic& t = traffic_[static_cast<std::size_t>(device)];
    const std::lock_guard lock(t.mutex);
    for (const auto& [kernel, counts] : t.by_kernel) {
      KernelTraffic& row = merged[kernel];
      row.kernel = kernel;
      row.bytes += counts.first;
      row.launches += counts.second;
    }
  }
  std::vector<KernelTraffic> rows;
  for (auto& [name, row] : merged) rows.push_back(std::move(row));
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  return rows;
}

void RuntimeImpl::reset_memory_traffic() {
  for (int d = 0; d < expected_devices_; ++d) {
    Traffic& t = traffic_[static_cast<std::size_t>(d)];
    const std::lock_guard lock(t.mutex);
    t.by_kernel.clear();
  }
}

void RuntimeImpl::reset_link_traffic() {
  const std::size_t slots =
      static_cast<std::size_t>(expected_devices_ + 2) * static_cast<std::size_t>(expected_devices_ + 2);
  for (std::size_t i = 0; i < slots; ++i) {
    link_bytes_[i].store(0);
    link_copies_[i].store(0);
  }
}

void RuntimeImpl::add_span(int device, int stream_id, Span span) {
  std::lock_guard lock(spans_mutex_);
  for (auto& s : spans_) {
    if (s.stream_id == stream_id) {
      s.spans.push_back(std::move(span));
      return;
    }
  }
  spans_.push_back(StreamSpans{device, stream_id, {std::move(span)}});
}

std::vector<RuntimeImpl::StreamSpans> RuntimeImpl::take_spans() {
  collect_spans();
  std::lock_guard lock(spans_mutex_);
  return std::exchange(spans_, {});
}

}  // namespace detail
}  // namespace dp
