// test_cuda_rules.cpp — the CUDA rules the engine relies on (docs/cuda-rules.md), one test per rule,
// each body run on the simulator and on cuda (skipped without a GPU): both backends must refuse the
// same misuse with the same dp exception, and allow what CUDA allows. The sim is only worth what
// this file proves of it.
#include <atomic>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dp/kernels/ops.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using test::BackendTest;

// Each operation CUDA forbids while a stream captures (thread-local mode) throws CaptureError there
// and invalidates the capture: ending it then fails too (cudaErrorStreamCaptureInvalidated), after
// which the stream works normally and nothing captured has run.
class ForbiddenInCapture : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ForbiddenInCapture, ThrowsAndInvalidatesTheCapture) {
  const std::string backend = std::get<0>(GetParam()), op = std::get<1>(GetParam());
  DP_RUNTIME_OR_SKIP(runtime, backend, 2);
  Device& device = runtime->device(runtime->device_count() - 1);
  Stream stream = device.create_stream();
  Stream other = device.create_stream();
  Event outside = device.create_event(), inside = device.create_event();
  DeviceBuffer buffer = device.allocate(16);
  std::vector<float> pageable(4);
  kernels::fill(stream, buffer.as<float>(), 4, 0.0f);
  // On another stream: a wait on a record of the capturing stream itself might count as in-stream
  // order, which CUDA lets cross the capture's boundary.
  other.record(outside);
  stream.synchronize();
  other.synchronize();

  stream.begin_capture();
  kernels::fill(stream, buffer.as<float>(), 4, 1.0f);
  stream.record(inside);
  const auto forbidden = [&] {
    if (op == "stream_synchronize") stream.synchronize();                           // 900
    if (op == "stream_query") (void)stream.query();                                 // 900
    if (op == "device_synchronize") device.synchronize();                           // 900
    if (op == "event_synchronize") inside.synchronize();                            // 907
    if (op == "event_query") (void)inside.query();                                  // 907
    if (op == "pageable_copy_in") stream.copy(buffer.data(), pageable.data(), 16);  // 900
    if (op == "pageable_copy_out") stream.copy(pageable.data(), buffer.data(), 16);
    if (op == "allocation") (void)device.allocate(64);                  // 900, capturing thread
    if (op == "pinned_allocation") (void)runtime->allocate_pinned(64);  // 900, capturing thread
    if (op == "wait_on_outside_event") stream.wait(outside);            // 905
  };
  EXPECT_THROW(forbidden(), CaptureError) << op;
  // An invalidated capture takes no more work (901) until it is ended.
  EXPECT_THROW(kernels::fill(stream, buffer.as<float>(), 4, 2.0f), CaptureError) << op;
  try {
    stream.end_capture();
    FAIL() << op << ": an invalidated capture ended";
  } catch (const CaptureError& e) {
    EXPECT_NE(std::string(e.what()).find("invalidated"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(stream.capturing());
  stream.synchronize();
  EXPECT_EQ(test::download<float>(stream, buffer), std::vector<float>(4, 0.0f));
}

INSTANTIATE_TEST_SUITE_P(Backends, ForbiddenInCapture,
                         ::testing::Combine(::testing::Values("sim", "cuda"),
                                            ::testing::Values("stream_synchronize", "stream_query",
                                                              "device_synchronize", "event_synchronize", "event_query",
                                                              "pageable_copy_in", "pageable_copy_out", "allocation",
                                                              "pinned_allocation", "wait_on_outside_event")),
                         [](const auto& info) { return std::get<1>(info.param) + "_" + std::get<0>(info.param); });

class CudaRules : public BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, CudaRules, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(CudaRules, AllocatingOnAnotherThreadDuringACaptureIsAllowed) {
  // Thread-local capture mode restricts the capturing thread only: a data loader's pinned buffers
  // or another device's worker allocate while a step is captured.
  DeviceBuffer x = floats(4);
  stream_.begin_capture();
  kernels::fill(stream_, x.as<float>(), 4, 3.0f);
  std::thread other([&] {
    DeviceBuffer more = device_->allocate(256);
    PinnedBuffer pinned = runtime_->allocate_pinned(256);
    EXPECT_NE(more.data(), nullptr);
    EXPECT_NE(pinned.data(), nullptr);
  });
  other.join();
  const Graph graph = stream_.end_capture();
  graph.replay();
  EXPECT_EQ(down<float>(x), std::vector<float>(4, 3.0f));
}

TEST_P(CudaRules, OnlyTheThreadThatBeganACaptureEndsIt) {
  // cudaErrorStreamCaptureWrongThread: refused, and the capture goes on.
  DeviceBuffer x = up(std::vector<float>{1, 1});
  stream_.synchronize();
  stream_.begin_capture();
  kernels::scale(stream_, 2, 5.0f, x.as<float>());
  std::thread other([&] { EXPECT_THROW(stream_.end_capture(), InvalidArgument); });
  other.join();
  EXPECT_TRUE(stream_.capturing());
  const Graph graph = stream_.end_capture();
  EXPECT_FALSE(stream_.capturing());
  graph.replay();
  EXPECT_EQ(down<float>(x), (std::vector<float>{5, 5}));
}

TEST_P(CudaRules, EndingACaptureThatWasNotBegunIsRefused) {
  EXPECT_THROW(stream_.end_capture(), InvalidArgument);  // never began
  Stream side = device_->create_stream();
  Event fork = device_->create_event(), join = device_->create_event();
  stream_.begin_capture();
  EXPECT_THROW(stream_.begin_capture(), Error);  // nested on one stream
  stream_.record(fork);
  side.wait(fork);
  EXPECT_THROW(side.end_capture(), InvalidArgument);  // joined, not begun there (903)
  EXPECT_TRUE(stream_.capturing()) << "the refused end left the capture going";
  side.record(join);
  stream_.wait(join);
  EXPECT_NO_THROW(stream_.end_capture());
}

TEST_P(CudaRules, BeginningACaptureOnACapturingStreamIsRefusedAndItGoesOn) {
  // CUDA answers 401 (IllegalState); dp refuses it first, so the capture in progress survives.
  DeviceBuffer x = up(std::vector<float>{1, 1});
  stream_.synchronize();
  stream_.begin_capture();
  kernels::scale(stream_, 2, 3.0f, x.as<float>());
  EXPECT_THROW(stream_.begin_capture(), InvalidArgument);
  EXPECT_TRUE(stream_.capturing());
  const Graph graph = stream_.end_capture();
  graph.replay();
  EXPECT_EQ(down<float>(x), (std::vector<float>{3, 3}));
}

TEST_P(CudaRules, SynchronizingACapturingStreamFromAnotherThreadInvalidatesIt) {
  // Capture mode is thread-local for the calls CUDA deems unsafe, but a capturing stream itself may
  // not be synchronized or queried from any thread (900): the capture is invalidated.
  DeviceBuffer x = up(std::vector<float>{1});
  stream_.synchronize();
  stream_.begin_capture();
  kernels::scale(stream_, 1, 2.0f, x.as<float>());
  std::thread other([&] { EXPECT_THROW(stream_.synchronize(), CaptureError); });
  other.join();
  EXPECT_THROW(stream_.end_capture(), CaptureError);
  EXPECT_FALSE(stream_.capturing());
  EXPECT_EQ(down<float>(x), std::vector<float>{1});
}

TEST_P(CudaRules, AQueryThatFindsWorkPendingLeavesNoErrorForTheNextLaunch) {
  // A query's "not ready" (600) sits in the thread's last-error slot until read; the next launch's
  // check must not report it (docs/cuda-rules.md, rule 18). The stream is held by a host function
  // until both queries have answered.
  DeviceBuffer x = floats(4);
  Event pending = device_->create_event();
  Stream other = device_->create_stream();
  // Loaded before the host function holds the stream: a lazily loaded kernel's first launch may
  // synchronize the context, which would wait for the host function, which waits for this thread.
  kernels::fill(other, x.as<float>(), 4, 0.0f);
  other.synchronize();
  std::atomic<bool> release{false};
  stream_.launch_host_func([&release] {
    while (!release.load()) std::this_thread::yield();
  });
  stream_.record(pending);
  EXPECT_FALSE(pending.query());
  EXPECT_FALSE(stream_.query());
  EXPECT_NO_THROW(kernels::fill(other, x.as<float>(), 4, 7.0f));
  release = true;
  stream_.synchronize();
  EXPECT_TRUE(pending.query());
  EXPECT_EQ(test::download<float>(other, x), std::vector<float>(4, 7.0f));
}

TEST_P(CudaRules, ALibraryCallInAnInvalidatedCaptureIsACaptureError) {
  // cuBLAS (cuda) or OpenBLAS (sim) inside a capture an earlier call invalidated: a CaptureError,
  // which the engines answer with an eager step, not a plain Error that would end the run.
  const int n = 4;
  DeviceBuffer a = up(std::vector<float>(n * n, 1.0f)), c = floats(n * n);
  stream_.synchronize();
  stream_.begin_capture();
  EXPECT_THROW((void)stream_.query(), CaptureError);
  EXPECT_THROW(
      kernels::gemm(stream_, false, false, n, n, n, 1.0f, a.as<float>(), n, a.as<float>(), n, 0.0f, c.as<float>(), n),
      CaptureError);
  EXPECT_THROW(stream_.end_capture(), CaptureError);
  EXPECT_NO_THROW(
      kernels::gemm(stream_, false, false, n, n, n, 1.0f, a.as<float>(), n, a.as<float>(), n, 0.0f, c.as<float>(), n));
  EXPECT_EQ(down<float>(c), std::vector<float>(n * n, static_cast<float>(n)));
}

TEST_P(CudaRules, AWaitAcrossTwoCapturesIsRefused) {
  // cudaErrorStreamCaptureMerge: one capture's event cannot order another capture, and both
  // captures are invalidated.
  Stream other = device_->create_stream();
  Event in_first = device_->create_event();
  DeviceBuffer x = floats(1);
  stream_.begin_capture();
  kernels::fill(stream_, x.as<float>(), 1, 1.0f);
  stream_.record(in_first);
  other.begin_capture();
  EXPECT_THROW(other.wait(in_first), CaptureError);
  EXPECT_THROW(other.end_capture(), CaptureError);
  EXPECT_THROW(stream_.end_capture(), CaptureError);
  EXPECT_FALSE(stream_.capturing());
  EXPECT_FALSE(other.capturing());
}

TEST_P(CudaRules, ElapsedTimeNeedsTimingEvents) {
  // cudaEventDisableTiming events (the default: ordering only) carry no timestamps.
  Event plain_start = device_->create_event(), plain_end = device_->create_event();
  Event start = device_->create_event(EventTiming::on), end = device_->create_event(EventTiming::on);
  stream_.record(plain_start);
  stream_.record(start);
  stream_.record(plain_end);
  stream_.record(end);
  stream_.synchronize();
  EXPECT_GE(Event::elapsed_ms(start, end), 0.0);
  EXPECT_THROW(Event::elapsed_ms(plain_start, plain_end), InvalidArgument);
  EXPECT_THROW(Event::elapsed_ms(start, plain_end), InvalidArgument);
}

TEST_P(CudaRules, AnEventIsRecordedOnlyOnItsOwnDevice) {
  if (runtime_->device_count() < 2) GTEST_SKIP() << "one device: nothing to mismatch";
  Event foreign = runtime_->device(0).create_event();
  EXPECT_THROW(stream_.record(foreign), DeviceMismatch);
  // Waiting on another device's event is allowed (cudaStreamWaitEvent across devices).
  Stream zero = runtime_->device(0).create_stream();
  zero.record(foreign);
  stream_.wait(foreign);
  stream_.synchronize();
}

}  // namespace
}  // namespace dp
