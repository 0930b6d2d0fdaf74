// test_device.cpp — the device runtime: memory accounting and isolation, stream concurrency and
// event ordering on the simulator, copies and their link counters, workers, errors.
#include <atomic>
#include <chrono>
#include <cstring>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <thread>
#include <vector>

#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/device.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"
#include "dp/runtime/precision.h"
#include "test_util.h"

namespace dp {
namespace {

using namespace std::chrono_literals;

TEST(Runtime, CreatesRequestedSimDevices) {
  auto rt = test::sim_runtime(3);
  EXPECT_EQ(rt->backend(), Backend::sim);
  ASSERT_EQ(rt->device_count(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rt->device(i).index(), i);
    EXPECT_EQ(rt->device(i).name(), "sim:" + std::to_string(i));
  }
}

TEST(Precision, NamesRoundTripAndUnknownOnesAreRefused) {
  for (const dp::Precision p : {dp::Precision::strict, dp::Precision::fast, dp::Precision::tf32})
    EXPECT_EQ(dp::parse_precision(dp::to_string(p)), p);
  EXPECT_EQ(dp::to_string(dp::Precision::strict), "strict");
  EXPECT_EQ(dp::to_string(dp::Precision::fast), "fast");
  EXPECT_EQ(dp::to_string(dp::Precision::tf32), "tf32");
  EXPECT_EQ(dp::RuntimeOptions{}.precision, dp::Precision::strict) << "strict is the default";
  try {
    dp::parse_precision("fp16");
    ADD_FAILURE() << "an unknown precision must be refused";
  } catch (const dp::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown precision 'fp16' (expected strict, fast or tf32)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(dp::parse_precision("Strict"), dp::InvalidArgument);
}

// The runtime carries RuntimeOptions::precision to the kernels (kernel_api::precision); the sim
// computes the same either way.
TEST(Precision, RuntimeOptionsReachTheKernels) {
  for (const dp::Precision p : {dp::Precision::strict, dp::Precision::fast}) {
    dp::RuntimeOptions options;
    options.backend = "sim";
    options.sim_devices = 1;
    options.precision = p;
    auto rt = dp::Runtime::create(options);
    EXPECT_EQ(dp::kernel_api::precision(rt->device(0).create_stream()), p);
  }
}

TEST(Runtime, RejectsBadConfiguration) {
  RuntimeOptions options;
  options.backend = "tpu";
  try {
    Runtime::create(options);
    FAIL() << "unknown backend accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown backend 'tpu'"), std::string::npos) << e.what();
  }
  options.backend = "sim";
  options.sim_devices = 0;
  EXPECT_THROW(Runtime::create(options), InvalidArgument);
  auto rt = test::sim_runtime(2);
  try {
    rt->device(2);
    FAIL() << "device 2 of 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("device 2 does not exist"), std::string::npos) << e.what();
  }
}

TEST(Runtime, CudaWithoutGpuIsAClearError) {
  if (Runtime::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  RuntimeOptions options;
  options.backend = "cuda";
  try {
    Runtime::create(options);
    FAIL() << "cuda runtime created without a GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda backend"), std::string::npos) << e.what();
  }
  options.backend = "auto";
  EXPECT_EQ(Runtime::create(options)->backend(), Backend::sim);
}

// Several dp devices on one simulated GPU (RuntimeOptions::devices_per_gpu): device d runs on GPU
// d / K; each counts its own memory, and together they fit the GPU's capacity.
TEST(Runtime, DevicesPerGpuShareTheGpusMemory) {
  RuntimeOptions options;
  options.backend = "sim";
  options.sim_devices = 4;
  options.devices_per_gpu = 2;
  options.sim_capacity_bytes = 1000;
  auto rt = Runtime::create(options);
  ASSERT_EQ(rt->device_count(), 4);
  EXPECT_EQ(rt->devices_per_gpu(), 2);
  for (int d = 0; d < 4; ++d) EXPECT_EQ(rt->device(d).gpu(), d / 2);
  EXPECT_EQ(rt->device(3).name(), "sim:3 (GPU 1)");
  DeviceBuffer a = rt->device(0).allocate(600);
  EXPECT_THROW((void)rt->device(1).allocate(600), OutOfMemory) << "devices 0 and 1 share GPU 0";
  DeviceBuffer b = rt->device(2).allocate(600);  // GPU 1 is another GPU
  DeviceBuffer c = rt->device(1).allocate(400);
  EXPECT_EQ(rt->device(0).memory().in_use, 600u);
  EXPECT_EQ(rt->device(1).memory().in_use, 400u);
  EXPECT_EQ(rt->device(1).memory().capacity, 1000u);
  a.reset();
  DeviceBuffer d = rt->device(1).allocate(500);  // the GPU's memory came back
  EXPECT_EQ(rt->device(1).memory().in_use, 900u);

  DeviceGroup pair(*rt, {0, 1}), apart(*rt, {0, 2}), mixed(*rt, {3, 0, 2});
  EXPECT_TRUE(shares_a_gpu(pair));
  EXPECT_FALSE(shares_a_gpu(apart));
  EXPECT_TRUE(shares_a_gpu(mixed));
  EXPECT_FALSE(shares_a_gpu(DeviceGroup(*test::sim_runtime(3), {0, 1, 2})));

  for (const auto& [devices, per_gpu] : {std::pair{4, 0}, {4, -1}, {4, 3}, {4, 65}}) {
    options.sim_devices = devices;
    options.devices_per_gpu = per_gpu;
    EXPECT_THROW(Runtime::create(options), InvalidArgument) << devices << " devices, " << per_gpu << " per GPU";
  }
}

TEST(Memory, CountsCurrentAndPeakPerDevice) {
  auto rt = test::sim_runtime(2);
  Device& d0 = rt->device(0);
  {
    DeviceBuffer a = d0.allocate(1000);
    DeviceBuffer b = d0.allocate(24);
    EXPECT_EQ(a.device(), 0);
    EXPECT_EQ(d0.memory().in_use, 1024u);
    EXPECT_EQ(d0.memory().allocations, 2u);
    a.reset();
    EXPECT_EQ(d0.memory().in_use, 24u);
    EXPECT_EQ(d0.memory().peak, 1024u);
    DeviceBuffer moved = std::move(b);
    EXPECT_EQ(d0.memory().in_use, 24u);
  }
  EXPECT_EQ(d0.memory().in_use, 0u);
  EXPECT_EQ(d0.memory().peak, 1024u);
  d0.reset_peak_memory();
  EXPECT_EQ(d0.memory().peak, 0u);
  EXPECT_EQ(rt->device(1).memory().peak, 0u) << "device 1 must not see device 0's allocations";
}

TEST(Memory, OutOfMemoryIsTypedAndNamesDeviceAndRequest) {
  auto rt = test::sim_runtime(2, 4096);
  DeviceBuffer a = rt->device(1).allocate(4000);
  try {
    rt->device(1).allocate(200);
    FAIL() << "allocation over capacity succeeded";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.device(), 1);
    EXPECT_EQ(e.requested(), 200u);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("device 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("requested 200 bytes"), std::string::npos) << msg;
  }
  // Device 0 has its own capacity.
  EXPECT_NO_THROW(rt->device(0).allocate(4000));
  EXPECT_EQ(rt->device(1).memory().in_use, 4000u);
}

TEST(Memory, KernelOnAnotherDevicesMemoryThrows) {
  auto rt = test::sim_runtime(2);
  DeviceBuffer on1 = rt->device(1).allocate(64 * sizeof(float));
  Stream s0 = rt->device(0).create_stream();
  try {
    kernels::fill(s0, on1.as<float>(), 64, 1.0f);
    FAIL() << "cross-device kernel launched";
  } catch (const DeviceMismatch& e) {
    EXPECT_NE(std::string(e.what()).find("lives on device 1 but the stream is on device 0"), std::string::npos)
        << e.what();
  }
  std::vector<float> host(64);
  EXPECT_THROW(kernels::fill(s0, host.data(), 64, 1.0f), DeviceMismatch) << "host pointer used as device memory";
  DeviceBuffer on0 = rt->device(0).allocate(64 * sizeof(float));
  EXPECT_THROW(kernels::fill(s0, on0.as<float>(), 65, 1.0f), DeviceMismatch) << "range past the allocation";
  auto other = test::sim_runtime(2);
  DeviceBuffer foreign = other->device(0).allocate(64 * sizeof(float));
  EXPECT_THROW(kernels::fill(s0, foreign.as<float>(), 64, 1.0f), DeviceMismatch) << "another runtime's memory";
}

// If the streams ran one after the other, the first task would wait for the second forever
// (here: until its timeout) and the flag would stay false.
TEST(Streams, TwoStreamsOfOneDeviceRunConcurrently) {
  auto rt = test::sim_runtime(1);
  Stream a = rt->device(0).create_stream();
  Stream b = rt->device(0).create_stream();
  std::atomic<bool> b_ran{false};
  std::atomic<bool> a_saw_b{false};
  a.launch_host_func([&] {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!b_ran.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    a_saw_b = b_ran.load();
  });
  b.launch_host_func([&] { b_ran = true; });
  a.synchronize();
  b.synchronize();
  EXPECT_TRUE(a_saw_b.load()) << "stream a blocked stream b: streams are not concurrent";
}

// The producer is slow; without the event wait the consumer reads before the write.
TEST(Streams, EventWaitOrdersStreamsAcrossDevices) {
  auto rt = test::sim_runtime(2);
  Stream producer = rt->device(0).create_stream();
  Stream consumer = rt->device(1).create_stream();
  Event written = rt->device(0).create_event();
  int value = 0;  // plain int: TSan reports the race if the ordering is missing
  int observed = -1;
  producer.launch_host_func([&] {
    std::this_thread::sleep_for(50ms);
    value = 42;
  });
  producer.record(written);
  consumer.wait(written);
  consumer.launch_host_func([&] { observed = value; });
  consumer.synchronize();
  EXPECT_EQ(observed, 42);
  EXPECT_TRUE(written.query());
}

TEST(Streams, WaitCapturesTheLatestRecordOnly) {
  auto rt = test::sim_runtime(1);
  Stream a = rt->device(0).create_stream();
  Stream b = rt->device(0).create_stream();
  Event e = rt->device(0).create_event();
  std::atomic<bool> release{false};
  a.record(e);
  a.synchronize();
  b.wait(e);  // captures the completed record: must not wait for work recorded later
  a.launch_host_func([&] {
    while (!release.load()) std::this_thread::sleep_for(1ms);
  });
  a.record(e);
  std::atomic<bool> b_done{false};
  b.launch_host_func([&] { b_done = true; });
  b.synchronize();
  EXPECT_TRUE(b_done.load());
  EXPECT_FALSE(e.query());
  release = true;
  e.synchronize();
  EXPECT_TRUE(e.query());
}

// cudaStreamWaitEvent waits for the record it captured, even when a later record of the same
// event (on a faster stream) completes first.
TEST(Streams, AWaitIsNotReleasedByALaterRecordOnAnotherStream) {
  auto rt = test::sim_runtime(1);
  Stream slow = rt->device(0).create_stream(), fast = rt->device(0).create_stream(),
         waiter = rt->device(0).create_stream();
  Event e = rt->device(0).create_event();
  int value = 0;
  int observed = -1;
  slow.launch_host_func([&] {
    std::this_thread::sleep_for(50ms);
    value = 7;
  });
  slow.record(e);
  waiter.wait(e);  // captures the slow record
  fast.record(e);  // completes at once
  waiter.launch_host_func([&] { observed = value; });
  waiter.synchronize();
  EXPECT_EQ(observed, 7);
  slow.synchronize();
}

TEST(Streams, RecordOnAPoisonedStreamLeavesTheEventUsable) {
  auto rt = test::sim_runtime(1);
  Stream bad = rt->device(0).create_stream(), other = rt->device(0).create_stream();
  Event e = rt->device(0).create_event();
  bad.launch_host_func([] { throw Error("kernel failed"); });
  EXPECT_THROW(bad.synchronize(), Error);
  EXPECT_THROW(bad.record(e), Error);
  EXPECT_TRUE(e.query()) << "a refused record must not leave the event pending forever";
  other.wait(e);
  EXPECT_NO_THROW(other.synchronize());
}

TEST(Streams, EventTimingAndQuery) {
  auto rt = test::sim_runtime(1);
  Stream s = rt->device(0).create_stream();
  Event start = rt->device(0).create_event(EventTiming::on), stop = rt->device(0).create_event(EventTiming::on);
  EXPECT_TRUE(stop.query()) << "a never-recorded event counts as complete";
  s.record(start);
  s.launch_host_func([] { std::this_thread::sleep_for(30ms); });
  s.record(stop);
  stop.synchronize();
  EXPECT_TRUE(s.query());
  EXPECT_GE(Event::elapsed_ms(start, stop), 29.0);
}

TEST(Streams, FailedWorkPoisonsTheStreamLikeAStickyError) {
  auto rt = test::sim_runtime(1);
  Stream s = rt->device(0).create_stream();
  s.launch_host_func([] { throw Error("boom in stream work"); });
  try {
    s.synchronize();
    FAIL() << "error swallowed";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "boom in stream work");
  }
  EXPECT_THROW(s.launch_host_func([] {}), Error) << "a poisoned stream accepts no more work";
}

TEST(Copies, AllDirectionsAndLinkCounters) {
  auto rt = test::sim_runtime(3);
  const std::size_t n = 1000, bytes = n * sizeof(float);
  std::vector<float> host = test::random_vector(n, 1);
  Stream s0 = rt->device(0).create_stream(), s2 = rt->device(2).create_stream();
  DeviceBuffer a = rt->device(0).allocate(bytes), a2 = rt->device(0).allocate(bytes), c = rt->device(2).allocate(bytes);
  s0.copy(a.data(), host.data(), bytes);  // H2D
  s0.copy(a2.data(), a.data(), bytes);    // D2D, same device
  Event done = rt->device(0).create_event();
  s0.record(done);
  s2.wait(done);
  s2.copy(c.data(), a2.data(), bytes);  // peer 0 -> 2, issued by the receiver
  s2.copy(c.data(), a2.data(), bytes);
  std::vector<float> back(n);
  s2.copy(back.data(), c.data(), bytes);  // D2H
  EXPECT_EQ(back, host);
  EXPECT_EQ(rt->link_traffic(kHost, 0).bytes, bytes);
  EXPECT_EQ(rt->link_traffic(0, 0).bytes, bytes);
  EXPECT_EQ(rt->link_traffic(0, 2).bytes, 2 * bytes);
  EXPECT_EQ(rt->link_traffic(0, 2).copies, 2u);
  EXPECT_EQ(rt->link_traffic(2, kHost).bytes, bytes);
  EXPECT_EQ(rt->link_traffic(2, 0).bytes, 0u);
  EXPECT_EQ(rt->bytes_sent(0), 2 * bytes);
  EXPECT_EQ(rt->bytes_received(2), 2 * bytes);
  EXPECT_EQ(rt->bytes_received(1), 0u);
  rt->reset_link_traffic();
  EXPECT_EQ(rt->link_traffic(0, 2).bytes, 0u);
}

// As cudaMemcpyAsync: a pageable source is staged before the call returns (the caller may reuse it
// at once, even while the stream is still busy); a pinned destination is written asynchronously.
class CopiesOnBackend : public test::BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, CopiesOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(CopiesOnBackend, PageableSourceIsStagedPinnedIsAsync) {
  DeviceBuffer d = device_->allocate(sizeof(int));
  std::atomic<bool> release{false};
  stream_.launch_host_func([&] {
    while (!release.load()) std::this_thread::sleep_for(1ms);
  });
  // Released from another thread as well, so that a copy that did wait for the stream cannot hang.
  std::thread releaser([&] {
    std::this_thread::sleep_for(300ms);
    release = true;
  });
  int pageable = 7;
  stream_.copy(d.data(), &pageable, sizeof(int));  // staged now, although the stream is still busy
  pageable = 8;
  release = true;
  PinnedBuffer pinned = runtime_->allocate_pinned(sizeof(int));
  stream_.copy(pinned.data(), d.data(), sizeof(int));  // pinned destination: asynchronous
  stream_.synchronize();
  releaser.join();
  EXPECT_EQ(*pinned.as<int>(), 7);
}

TEST(Copies, CopyMustBeIssuedOnAnEndpointsStream) {
  auto rt = test::sim_runtime(3);
  DeviceBuffer a = rt->device(0).allocate(64), b = rt->device(1).allocate(64);
  Stream s2 = rt->device(2).create_stream();
  EXPECT_THROW(s2.copy(b.data(), a.data(), 64), DeviceMismatch);
  EXPECT_THROW(s2.copy(b.data(), a.data(), 65), DeviceMismatch) << "runs past both allocations";
  EXPECT_EQ(rt->link_traffic(0, 1).bytes, 0u) << "a refused copy is not counted";
}

TEST(Device, SubmitRunsOnOnePersistentWorker) {
  auto rt = test::sim_runtime(2);
  std::thread::id first, second;
  rt->device(1).submit([&] { first = std::this_thread::get_id(); }).get();
  rt->device(1).submit([&] { second = std::this_thread::get_id(); }).get();
  EXPECT_EQ(first, second);
  EXPECT_NE(first, std::this_thread::get_id());
  auto failed = rt->device(1).submit([] { throw InvalidArgument("bad task"); });
  EXPECT_THROW(failed.get(), InvalidArgument);
  EXPECT_NO_THROW(rt->device(1).submit([] {}).get()) << "the worker survives a failed task";
}

// The CPUs a thread may run on, in order.
std::vector<int> cpus_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(pthread_getaffinity_np(pthread_self(), sizeof set, &set), 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  return cpus;
}

// Where a device's two streams and its worker run, and the first stream thread's name.
struct DeviceThreads {
  std::vector<int> first_stream, second_stream, worker;
  std::string name;
};
DeviceThreads threads_of(Device& device) {
  DeviceThreads out;
  Stream a = device.create_stream(), b = device.create_stream();
  a.launch_host_func([&] {
    out.first_stream = cpus_of_this_thread();
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof name);
    out.name = name;
  });
  b.launch_host_func([&] { out.second_stream = cpus_of_this_thread(); });
  a.synchronize();
  b.synchronize();
  device.submit([&] { out.worker = cpus_of_this_thread(); }).get();
  return out;
}

// Each simulated device's threads keep to one core, device d on the d-th core the process may use
// (round robin), so that the OS does not stack two devices on one core while another idles; with
// one device, or the option off, the threads may run anywhere the process may.
TEST(Device, EachSimDevicesThreadsKeepToOneCoreWhenThereIsAChoice) {
  const std::vector<int> allowed = cpus_of_this_thread();
  if (allowed.size() < 2) GTEST_SKIP() << "needs two or more cores to place devices on";
  auto rt = test::sim_runtime(3);
  for (int d = 0; d < 3; ++d) {
    const DeviceThreads t = threads_of(rt->device(d));
    const std::vector<int> core = {allowed[static_cast<std::size_t>(d) % allowed.size()]};
    EXPECT_EQ(t.first_stream, core) << "device " << d;
    EXPECT_EQ(t.second_stream, core) << "device " << d;
    EXPECT_EQ(t.worker, core) << "device " << d;
    EXPECT_EQ(t.name.rfind("sim" + std::to_string(d) + ".stream", 0), 0u) << t.name;
  }
  EXPECT_EQ(cpus_of_this_thread(), allowed) << "the host's own thread is not placed";

  const DeviceThreads alone = threads_of(test::sim_runtime(1)->device(0));
  EXPECT_EQ(alone.first_stream, allowed);
  EXPECT_EQ(alone.worker, allowed);

  RuntimeOptions off;
  off.backend = "sim";
  off.sim_devices = 2;
  off.sim_pin_threads = false;
  auto free = Runtime::create(off);
  for (int d = 0; d < 2; ++d) {
    const DeviceThreads t = threads_of(free->device(d));
    EXPECT_EQ(t.first_stream, allowed);
    EXPECT_EQ(t.worker, allowed);
  }
}

TEST(Device, FreeWaitsForQueuedWork) {
  auto rt = test::sim_runtime(1);
  Stream s = rt->device(0).create_stream();
  std::atomic<bool> ran{false};
  {
    DeviceBuffer buffer = rt->device(0).allocate(1 << 20);
    s.launch_host_func([&] { std::this_thread::sleep_for(20ms); });
    kernels::fill(s, buffer.as<float>(), (1 << 20) / 4, 3.0f);
    s.launch_host_func([&] { ran = true; });
  }  // the buffer dies while the fill is queued: freeing must wait
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(rt->device(0).memory().in_use, 0u);
}

// Runtime::counters: each kind of host work counted on the device it concerns (dp_bench reports
// them per step: the costs a steady-state step must not have).
TEST(Counters, CountLaunchesSyncsAllocationsPageableCopiesAndSubmits) {
  auto rt = test::sim_runtime(2);
  Device& d1 = rt->device(1);
  Stream s = d1.create_stream();
  DeviceBuffer buffer = d1.allocate(64 * sizeof(float));
  PinnedBuffer pinned = rt->allocate_pinned(64 * sizeof(float));
  std::vector<float> pageable(64, 1.0f);
  rt->reset_counters();
  kernels::fill(s, buffer.as<float>(), 64, 2.0f);              // 1 launch
  s.copy(buffer.data(), pinned.data(), 64 * sizeof(float));    // pinned: neither
  s.copy(buffer.data(), pageable.data(), 64 * sizeof(float));  // pageable source
  s.copy(pageable.data(), buffer.data(), 64 * sizeof(float));  // pageable destination: waits
  DeviceBuffer more = d1.allocate(16);                         // 1 allocation
  d1.submit([] {}).get();                                      // 1 worker task
  Event done = d1.create_event();
  s.record(done);
  done.synchronize();  // host syncs: event, stream, device
  s.synchronize();
  d1.synchronize();
  const DeviceCounters c = rt->counters(1);
  EXPECT_EQ(c.launches, 1u);
  EXPECT_EQ(c.pageable_copies, 2u);
  EXPECT_EQ(c.host_syncs, 4u);  // the copy into pageable memory, the event, the stream, the device
  EXPECT_EQ(c.allocations, 1u);
  EXPECT_EQ(c.worker_submits, 1u);
  const DeviceCounters other = rt->counters(0);
  EXPECT_EQ(other.launches + other.host_syncs + other.allocations + other.pageable_copies + other.worker_submits, 0u);
  rt->reset_counters();
  EXPECT_EQ(rt->counters(1).launches, 0u);
  EXPECT_THROW(rt->counters(2), InvalidArgument);
}

}  // namespace
}  // namespace dp
