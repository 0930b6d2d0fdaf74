// test_graph.cpp — stream capture and graph replay (Stream::begin_capture .. end_capture,
// Graph::replay): nothing runs while capturing, a replay runs the captured work again with the
// values memory holds at that time, forks and joins across streams and devices, collectives inside
// a graph. What CUDA forbids during a capture, and how each backend refuses it, is in
// test_cuda_rules.cpp. Bodies run on sim and, where a GPU exists, on cuda.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using test::BackendTest;

class Graphs : public BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, Graphs, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(Graphs, CapturedWorkRunsOnlyWhenReplayed) {
  DeviceBuffer x = up(std::vector<float>{1, 2, 3, 4});
  DeviceBuffer y = up(std::vector<float>{0, 0, 0, 0});
  stream_.synchronize();
  stream_.begin_capture();
  EXPECT_TRUE(stream_.capturing());
  kernels::axpy(stream_, 4, 2.0f, x.as<float>(), y.as<float>());  // y += 2x
  kernels::scale(stream_, 4, 0.5f, y.as<float>());                // y *= 0.5
  const Graph graph = stream_.end_capture();
  EXPECT_FALSE(stream_.capturing());
  EXPECT_EQ(down<float>(y), (std::vector<float>{0, 0, 0, 0}));  // captured, not run
  if (GetParam() == "sim") {
    EXPECT_EQ(graph.nodes(), 2u);
  }
  graph.replay();
  EXPECT_EQ(down<float>(y), (std::vector<float>{1, 2, 3, 4}));
  graph.replay();
  graph.replay();
  EXPECT_EQ(down<float>(y), (std::vector<float>{1.75f, 3.5f, 5.25f, 7}));  // ((y+2x)/2 three times)
}

TEST_P(Graphs, AReplayReadsWhatMemoryHoldsThen) {
  // A value that changes between replays (a learning rate) lives in pinned memory a captured copy
  // reads, not in a launch argument.
  PinnedBuffer host = runtime_->allocate_pinned(sizeof(float));
  DeviceBuffer scalar = floats(1);
  DeviceBuffer acc = up(std::vector<float>{0});
  stream_.synchronize();
  stream_.begin_capture();
  stream_.copy(scalar.data(), host.data(), sizeof(float));
  kernels::axpy(stream_, 1, 1.0f, scalar.as<float>(), acc.as<float>());
  const Graph graph = stream_.end_capture();
  for (float v : {1.0f, 10.0f, 100.0f}) {
    *host.as<float>() = v;
    graph.replay();
    stream_.synchronize();  // the host writes `host` again only after the replay has read it
  }
  EXPECT_EQ(down<float>(acc), std::vector<float>{111});
}

TEST_P(Graphs, ForkAndJoinAcrossStreamsAndDevices) {
  Device& other = runtime_->device(0);
  Stream side = device_->create_stream();
  Stream remote = other.create_stream();
  Event fork = device_->create_event(), side_done = device_->create_event(), remote_done = other.create_event();
  DeviceBuffer a = up(std::vector<float>{1, 1});
  DeviceBuffer b = up(std::vector<float>{0, 0});
  DeviceBuffer far = other.allocate(2 * sizeof(float));
  stream_.synchronize();

  stream_.begin_capture();
  kernels::scale(stream_, 2, 3.0f, a.as<float>());  // a = 3a
  stream_.record(fork);
  side.wait(fork);                                             // side joins the capture
  kernels::axpy(side, 2, 1.0f, a.as<float>(), b.as<float>());  // b += a
  side.record(side_done);
  remote.wait(fork);  // a stream of another device joins too
  remote.copy(far.data(), a.data(), 2 * sizeof(float));
  kernels::scale(remote, 2, 2.0f, far.as<float>());
  remote.record(remote_done);
  stream_.wait(side_done);  // both join back
  stream_.wait(remote_done);
  stream_.copy(a.data(), far.data(), 2 * sizeof(float));  // a = 2 * (3a)
  const Graph graph = stream_.end_capture();
  EXPECT_FALSE(side.capturing());
  EXPECT_FALSE(remote.capturing());
  EXPECT_EQ(down<float>(a), (std::vector<float>{1, 1}));

  graph.replay();
  graph.replay();
  // Work issued after a replay waits for all of it, side streams included.
  EXPECT_EQ(down<float>(b), (std::vector<float>{3 + 18, 3 + 18}));
  EXPECT_EQ(down<float>(a), (std::vector<float>{36, 36}));
}

// While profiling, a replayed graph's work shows as busy time on its device (the sim records each
// replayed piece of work; cuda brackets the whole replay with timing events, as it cannot time the
// kernels inside an instantiated graph).
TEST_P(Graphs, AReplayIsTracedWhileProfiling) {
  DeviceBuffer x = up(std::vector<float>(1 << 16, 1.0f));
  stream_.synchronize();
  stream_.begin_capture();
  for (int i = 0; i < 4; ++i) kernels::scale(stream_, 1 << 16, 0.5f, x.as<float>());
  const Graph graph = stream_.end_capture();
  runtime_->set_profiling(true);
  (void)runtime_->take_trace();
  graph.replay();
  stream_.synchronize();
  const std::vector<TraceSpan> trace = runtime_->take_trace();
  runtime_->set_profiling(false);
  std::int64_t busy_ns = 0;
  for (const TraceSpan& span : trace)
    if (span.device == device_->index() && is_busy(span.kind)) busy_ns += span.end_ns - span.start_ns;
  EXPECT_GT(busy_ns, 0) << trace.size() << " span(s)";
}

TEST_P(Graphs, AStreamThatNeverJoinsBackFailsTheCapture) {
  Stream side = device_->create_stream();
  Event fork = device_->create_event();
  DeviceBuffer a = up(std::vector<float>{1});
  stream_.synchronize();
  stream_.begin_capture();
  stream_.record(fork);
  side.wait(fork);
  kernels::scale(side, 1, 2.0f, a.as<float>());
  EXPECT_THROW(side.end_capture(), InvalidArgument);  // only the stream that began it ends it
  EXPECT_THROW(stream_.end_capture(), CaptureError);
  EXPECT_FALSE(stream_.capturing());
  EXPECT_FALSE(side.capturing());
  EXPECT_EQ(down<float>(a), std::vector<float>{1});
}

TEST_P(Graphs, MisuseIsAClearError) {
  EXPECT_THROW(Graph().replay(), InvalidArgument);
  EXPECT_EQ(Graph().nodes(), 0u);
  EXPECT_THROW(stream_.end_capture(), Error);  // not capturing
  stream_.begin_capture();
  EXPECT_THROW(stream_.begin_capture(), InvalidArgument);  // refused before CUDA could end the capture
  EXPECT_TRUE(stream_.capturing());
  const Graph empty = stream_.end_capture();
  empty.replay();  // an empty graph does nothing
  stream_.synchronize();
}

TEST(GraphCollectives, ReplayedAllReduceIsANewCallEachTime) {
  // Each device captures its own step with an all-reduce inside (as DDP does with NCCL); replaying
  // the graphs runs the collective again, with its traffic counted again.
  constexpr int kRanks = 3;
  auto runtime = test::sim_runtime(kRanks);
  DeviceGroup group(*runtime, {0, 1, 2});
  auto comm = Communicator::create(group);
  std::vector<Stream> streams;
  std::vector<DeviceBuffer> data;
  for (int r = 0; r < kRanks; ++r) {
    streams.push_back(group.device(r).create_stream());
    data.push_back(test::upload(group.device(r), streams.back(), std::vector<float>{1, 2, 3}));
  }
  // A warm-up call sizes the ring's staging memory (no allocation may happen inside a capture).
  group.run([&](int r) {
    comm->all_reduce(r, streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)].as<float>(), 3,
                     ReduceOp::sum);
  });
  std::vector<Graph> graphs(kRanks);
  group.run([&](int r) {
    const Stream& s = streams[static_cast<std::size_t>(r)];
    s.synchronize();
    s.begin_capture();
    comm->all_reduce(r, s, data[static_cast<std::size_t>(r)].as<float>(), 3, ReduceOp::sum);
    kernels::scale(s, 3, 0.5f, data[static_cast<std::size_t>(r)].as<float>());
    graphs[static_cast<std::size_t>(r)] = s.end_capture();
  });
  runtime->reset_link_traffic();
  for (int replay = 0; replay < 2; ++replay) group.run([&](int r) { graphs[static_cast<std::size_t>(r)].replay(); });
  // warm-up: 3x; each replay: sum (x3) then halve -> x1.5.
  for (int r = 0; r < kRanks; ++r)
    EXPECT_EQ(test::download<float>(streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)]),
              (std::vector<float>{3 * 2.25f, 6 * 2.25f, 9 * 2.25f}));
  std::uint64_t received = 0;
  for (int r = 0; r < kRanks; ++r) received += runtime->bytes_received(r);
  EXPECT_GT(received, 0u);
}

TEST(GraphCounters, AReplayIsOneLaunch) {
  auto runtime = test::sim_runtime(1);
  Device& device = runtime->device(0);
  Stream stream = device.create_stream();
  DeviceBuffer x = device.allocate(4 * sizeof(float));
  stream.begin_capture();
  for (int i = 0; i < 5; ++i) kernels::fill(stream, x.as<float>(), 4, static_cast<float>(i));
  const Graph graph = stream.end_capture();
  runtime->reset_counters();
  graph.replay();
  stream.synchronize();
  const DeviceCounters counters = runtime->counters(0);
  EXPECT_EQ(counters.launches, 1u);
  EXPECT_EQ(counters.allocations, 0u);
  EXPECT_EQ(test::download<float>(stream, x), std::vector<float>(4, 4.0f));
}

}  // namespace
}  // namespace dp
