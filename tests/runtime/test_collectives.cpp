// test_collectives.cpp — collectives with small whole numbers, so every sum is exact (nccl-tests
// style): every N, sizes not divisible by N and smaller than N; on sim also the ring's traffic.
// The same bodies run on cuda where there is a GPU (NCCL across GPUs, the device ring among
// devices that share one), else skip.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <future>
#include <gtest/gtest.h>
#include <map>
#include <string>
#include <thread>

#include "backend.h"  // the sim ring itself, under a process group of the test's
#include "channel.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/process_group.h"
#include "test_util.h"

namespace dp {
namespace {

struct Fixture {
  std::unique_ptr<Runtime> runtime;
  std::unique_ptr<DeviceGroup> group;
  std::unique_ptr<Communicator> comm;
  std::vector<Stream> streams;
  Fixture(const std::string& backend, int n) {
    runtime = test::runtime_or_skip(backend, n);
    std::vector<int> ids(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = n - 1 - i;  // ranks != device indices
    group = std::make_unique<DeviceGroup>(*runtime, ids);
    comm = Communicator::create(*group);
    for (int r = 0; r < n; ++r) streams.push_back(group->device(r).create_stream());
  }
};

float value(int rank, std::size_t i) { return static_cast<float>((rank + 1) * static_cast<int>(i % 7 + 1)); }

class Collectives : public ::testing::TestWithParam<std::string> {
 protected:
  // World sizes to try: up to 4 devices (cuda: several on one GPU where there are fewer GPUs, their
  // collectives on the device ring), none on cuda without a GPU.
  int max_world() const { return GetParam() == "sim" || Runtime::cuda_device_count() > 0 ? 4 : 0; }
  bool counts_traffic() const { return GetParam() == "sim"; }  // NCCL moves bytes outside dp's counters
};

INSTANTIATE_TEST_SUITE_P(Backends, Collectives, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

#define DP_SKIP_WITHOUT_DEVICES() \
  if (max_world() == 0) GTEST_SKIP() << "no CUDA device: NCCL collectives need GPUs"

TEST_P(Collectives, AllReduceIsExactForEveryWorldSizeAndLength) {
  DP_SKIP_WITHOUT_DEVICES();
  for (int n = 1; n <= max_world(); ++n) {
    for (std::size_t count :
         {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7}, std::size_t{1000}, std::size_t{1001}}) {
      SCOPED_TRACE(fmt::format("N={} count={}", n, count));
      Fixture f(GetParam(), n);
      std::vector<DeviceBuffer> data;
      for (int r = 0; r < n; ++r) {
        std::vector<float> host(count);
        for (std::size_t i = 0; i < count; ++i) host[i] = value(r, i);
        data.push_back(test::upload(f.group->device(r), f.streams[static_cast<std::size_t>(r)], host));
      }
      f.runtime->reset_link_traffic();
      f.group->run([&](int r) {
        f.comm->all_reduce(r, f.streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)].as<float>(),
                           count, ReduceOp::sum);
      });
      std::vector<float> want(count);
      for (std::size_t i = 0; i < count; ++i)
        want[i] = static_cast<float>(n * (n + 1) / 2 * static_cast<int>(i % 7 + 1));
      for (int r = 0; r < n; ++r)
        EXPECT_EQ(test::download<float>(f.streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)]),
                  want)
            << "rank " << r;
      if (!counts_traffic()) continue;
      // Ring traffic: each rank sends (N-1) chunks in reduce-scatter and (N-1) in all-gather,
      // i.e. 2(N-1)/N of the buffer when N divides it; every chunk of floor boundaries in general.
      std::uint64_t total = 0;
      for (int r = 0; r < n; ++r) total += f.runtime->bytes_sent(f.group->device_ids()[static_cast<std::size_t>(r)]);
      EXPECT_EQ(total, 2u * static_cast<std::uint64_t>(n - 1) * count * sizeof(float));
      if (count % static_cast<std::size_t>(n) == 0) {
        for (int r = 0; r < n; ++r) {
          const int device = f.group->device_ids()[static_cast<std::size_t>(r)];
          EXPECT_EQ(f.runtime->bytes_sent(device), 2u * (n - 1) * count / n * sizeof(float)) << "rank " << r;
          EXPECT_EQ(f.runtime->bytes_received(device), 2u * (n - 1) * count / n * sizeof(float)) << "rank " << r;
        }
      }
    }
  }
}

TEST_P(Collectives, AllReduceAverage) {
  DP_SKIP_WITHOUT_DEVICES();
  const int n = std::min(3, max_world());
  Fixture f(GetParam(), n);
  std::vector<DeviceBuffer> data;
  for (int r = 0; r < n; ++r)
    data.push_back(test::upload(f.group->device(r), f.streams[static_cast<std::size_t>(r)],
                                std::vector<float>(10, static_cast<float>(r + 1))));
  f.group->run([&](int r) {
    f.comm->all_reduce(r, f.streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)].as<float>(), 10,
                       ReduceOp::avg);
  });
  // The sim sums then scales by 1/N; NCCL may pre-multiply each input instead: 2 ulp, as in nccl-tests.
  const float want = static_cast<float>(n * (n + 1) / 2) * (1.0f / static_cast<float>(n));
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(test::all_close(
        test::download<float>(f.streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)]),
        std::vector<float>(10, want), 2.5e-7, 0.0));
}

TEST_P(Collectives, BroadcastReduceAllGather) {
  DP_SKIP_WITHOUT_DEVICES();
  for (int n = 1; n <= max_world(); ++n) {
    SCOPED_TRACE(fmt::format("N={}", n));
    Fixture f(GetParam(), n);
    const int root = n - 1;
    const std::size_t count = 5;
    std::vector<DeviceBuffer> a, b, send, recv;
    for (int r = 0; r < n; ++r) {
      std::vector<float> host(count);
      for (std::size_t i = 0; i < count; ++i) host[i] = value(r, i);
      const Stream& s = f.streams[static_cast<std::size_t>(r)];
      a.push_back(test::upload(f.group->device(r), s, host));
      b.push_back(test::upload(f.group->device(r), s, host));
      send.push_back(test::upload(f.group->device(r), s, host));
      recv.push_back(f.group->device(r).allocate(count * static_cast<std::size_t>(n) * sizeof(float)));
    }
    f.group->run([&](int r) {
      const Stream& s = f.streams[static_cast<std::size_t>(r)];
      f.comm->broadcast(r, s, a[static_cast<std::size_t>(r)].data(), count * sizeof(float), root);
      f.comm->reduce(r, s, b[static_cast<std::size_t>(r)].as<float>(), count, root);
      f.comm->all_gather(r, s, send[static_cast<std::size_t>(r)].as<float>(),
                         recv[static_cast<std::size_t>(r)].as<float>(), count);
    });
    for (int r = 0; r < n; ++r) {
      const Stream& s = f.streams[static_cast<std::size_t>(r)];
      std::vector<float> root_values(count), sums(count), own(count), gathered;
      for (std::size_t i = 0; i < count; ++i) {
        root_values[i] = value(root, i);
        sums[i] = static_cast<float>(n * (n + 1) / 2 * static_cast<int>(i % 7 + 1));
        own[i] = value(r, i);
      }
      for (int q = 0; q < n; ++q)
        for (std::size_t i = 0; i < count; ++i) gathered.push_back(value(q, i));
      EXPECT_EQ(test::download<float>(s, a[static_cast<std::size_t>(r)]), root_values) << "broadcast, rank " << r;
      EXPECT_EQ(test::download<float>(s, b[static_cast<std::size_t>(r)]), r == root ? sums : own)
          << "reduce, rank " << r;
      EXPECT_EQ(test::download<float>(s, recv[static_cast<std::size_t>(r)]), gathered) << "all_gather, rank " << r;
    }
  }
}

// reduce_scatter and all_gather_blocks are all_reduce's halves: each rank's owned block holds the
// sum after the first (on sim, on random floats, all_reduce's very bits; exact small sums on every
// backend), every block of every rank after the second, and the two move all_reduce's bytes.
TEST_P(Collectives, ReduceScatterThenAllGatherBlocksIsAllReduce) {
  DP_SKIP_WITHOUT_DEVICES();
  const auto bits = [](const std::vector<float>& v, BlockRange range) {
    return std::vector<std::uint32_t>(reinterpret_cast<const std::uint32_t*>(v.data() + range.begin),
                                      reinterpret_cast<const std::uint32_t*>(v.data() + range.end));
  };
  for (int n = 1; n <= max_world(); ++n) {
    for (const std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{1001}}) {
      SCOPED_TRACE(fmt::format("N={} count={}", n, count));
      Fixture f(GetParam(), n);
      const bool exact = GetParam() != "sim";  // small whole numbers: every order of additions agrees
      std::vector<std::vector<float>> inputs, reduced(static_cast<std::size_t>(n)), scattered(reduced),
          gathered(reduced);
      for (int r = 0; r < n; ++r) {
        auto input = test::random_vector(count, static_cast<unsigned>(7 * r + count), -3.0f, 3.0f);
        for (std::size_t i = 0; exact && i < count; ++i) input[i] = value(r, i);
        inputs.push_back(input);
      }
      std::vector<std::uint64_t> all_reduce_bytes(static_cast<std::size_t>(n)), halves_bytes(all_reduce_bytes);
      const auto sent = [&](int r) {
        return f.runtime->bytes_sent(f.group->device_ids()[static_cast<std::size_t>(r)]);
      };
      f.runtime->reset_link_traffic();
      f.group->run([&](int r) {
        const Stream& s = f.streams[static_cast<std::size_t>(r)];
        DeviceBuffer x = test::upload(f.group->device(r), s, inputs[static_cast<std::size_t>(r)]);
        f.comm->all_reduce(r, s, x.as<float>(), count, ReduceOp::sum);
        reduced[static_cast<std::size_t>(r)] = test::download<float>(s, x);
      });
      for (int r = 0; r < n; ++r) all_reduce_bytes[static_cast<std::size_t>(r)] = sent(r);
      f.runtime->reset_link_traffic();
      f.group->run([&](int r) {
        const Stream& s = f.streams[static_cast<std::size_t>(r)];
        DeviceBuffer x = test::upload(f.group->device(r), s, inputs[static_cast<std::size_t>(r)]);
        f.comm->reduce_scatter(r, s, x.as<float>(), count);
        scattered[static_cast<std::size_t>(r)] = test::download<float>(s, x);
        f.comm->all_gather_blocks(r, s, x.as<float>(), count);
        gathered[static_cast<std::size_t>(r)] = test::download<float>(s, x);
      });
      for (int r = 0; r < n; ++r) halves_bytes[static_cast<std::size_t>(r)] = sent(r);
      const BlockRange all{0, count};
      for (int r = 0; r < n; ++r) {
        const auto i = static_cast<std::size_t>(r);
        const BlockRange mine = ring_block(owned_block(r, n), count, n);
        EXPECT_EQ(bits(scattered[i], mine), bits(reduced[i], mine)) << "rank " << r << "'s block";
        EXPECT_EQ(bits(gathered[i], all), bits(reduced[i], all)) << "rank " << r;
        if (counts_traffic()) {
          EXPECT_EQ(halves_bytes[i], all_reduce_bytes[i]) << "rank " << r;
        }
      }
    }
  }
}

// Simulator semantics: operand checks and a rank waiting for absent peers until abort().
TEST(SimCollectives, WrongDeviceAndAbort) {
  Fixture f("sim", 2);
  DeviceBuffer on_rank1 = f.group->device(1).allocate(16);
  EXPECT_THROW(f.comm->all_reduce(0, f.streams[0], on_rank1.as<float>(), 4, ReduceOp::sum), DeviceMismatch);
  EXPECT_THROW(f.comm->all_reduce(0, f.streams[1], on_rank1.as<float>(), 4, ReduceOp::sum), DeviceMismatch)
      << "stream of another rank";
  // Rank 0 makes a call rank 1 never makes: the call waits for its peer's (as the cuda device ring's
  // and, within one process, NCCL's may) until the communicator is aborted from another thread.
  DeviceBuffer on_rank0 = f.group->device(0).allocate(16);
  std::thread rank0([&] {
    EXPECT_THROW(f.comm->all_reduce(0, f.streams[0], on_rank0.as<float>(), 4, ReduceOp::sum), CollectiveAborted);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  f.comm->abort();
  rank0.join();
  EXPECT_THROW(f.comm->all_reduce(1, f.streams[1], on_rank1.as<float>(), 4, ReduceOp::sum), Error);
}

}  // namespace
}  // namespace dp

namespace dp {
namespace {

// The device ring (cuda, devices sharing one GPU) runs the sim ring's algorithm: on random floats,
// where the order of additions shows in the last bits, both give the same bits for every call.
// One rank waits inside a collective for its peer while the peer's worker first launches a kernel
// no earlier call of this process launched. On cuda the waiting rank may be a device-ring kernel
// spinning on the GPU, and a lazily loaded kernel's first launch may need a context
// synchronization that waits for it: the ranks' parts are launched together, so it ends (Note
// [rings and lazy loading]). A hang here is ctest's timeout.
TEST_P(Collectives, AFirstLaunchWhileAPeerWaitsInACollectiveEnds) {
  if (max_world() < 2) GTEST_SKIP() << "no CUDA device";
  Fixture f(GetParam(), 2);
  std::atomic<bool> first_rank_waits{false};
  std::vector<std::vector<float>> out(2);
  f.group->run([&](int r) {
    const Stream& s = f.streams[static_cast<std::size_t>(r)];
    Device& device = f.group->device(r);
    DeviceBuffer x = test::upload(device, s, std::vector<float>(64, static_cast<float>(r + 1)));
    // Rank 0 waits in the call (on its GPU, or on the host: a collective's call may return only once
    // every rank has made it, as NCCL's within one process) before rank 1 launches its first kernel.
    if (r == 0) first_rank_waits = true;
    if (r == 1) {
      while (!first_rank_waits.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      kernels::add_bf16_rounded(s, 64, x.as<float>(), x.as<float>(), false);  // x, rounded to bf16: 2
    }
    f.comm->all_reduce(r, s, x.as<float>(), 64, ReduceOp::sum);
    out[static_cast<std::size_t>(r)] = test::download<float>(s, x);
  });
  for (const auto& v : out) EXPECT_EQ(v, std::vector<float>(64, 3.0f));
}

TEST(DeviceRing, EqualsTheSimRingBitForBit) {
  if (Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the device ring runs on a GPU";
  const auto bits = [](const std::vector<float>& v) {
    return std::vector<std::uint32_t>(reinterpret_cast<const std::uint32_t*>(v.data()),
                                      reinterpret_cast<const std::uint32_t*>(v.data()) + v.size());
  };
  for (int n = 2; n <= 4; ++n) {
    for (const std::size_t count : {std::size_t{1}, std::size_t{5}, std::size_t{1001}, std::size_t{4099}}) {
      SCOPED_TRACE(fmt::format("N={} count={}", n, count));
      // per backend: the results of all_reduce (sum, avg), reduce to rank 1 and all_gather, per rank
      std::map<std::string, std::vector<std::vector<float>>> results;
      for (const std::string backend : {"sim", "cuda"}) {
        Fixture f(backend, n);
        ASSERT_EQ(shares_a_gpu(*f.group), backend == "cuda" && Runtime::cuda_device_count() < n);
        std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
        f.group->run([&](int r) {
          const Stream& s = f.streams[static_cast<std::size_t>(r)];
          Device& device = f.group->device(r);
          const auto input = test::random_vector(count, static_cast<unsigned>(100 * r + count), -3.0f, 3.0f);
          DeviceBuffer sum = test::upload(device, s, input), avg = test::upload(device, s, input);
          DeviceBuffer reduced = test::upload(device, s, input), send = test::upload(device, s, input);
          DeviceBuffer gathered = device.allocate(count * static_cast<std::size_t>(n) * sizeof(float));
          f.comm->all_reduce(r, s, sum.as<float>(), count, ReduceOp::sum);
          f.comm->all_reduce(r, s, avg.as<float>(), count, ReduceOp::avg);
          f.comm->reduce(r, s, reduced.as<float>(), count, 1);
          f.comm->all_gather(r, s, send.as<float>(), gathered.as<float>(), count);
          auto& mine = out[static_cast<std::size_t>(r)];
          for (const DeviceBuffer* b : {&sum, &avg, &reduced, &gathered}) {
            const auto v = test::download<float>(s, *b);
            mine.insert(mine.end(), v.begin(), v.end());
          }
        });
        results[backend] = out;
      }
      for (int r = 0; r < n; ++r)
        EXPECT_EQ(bits(results["cuda"][static_cast<std::size_t>(r)]), bits(results["sim"][static_cast<std::size_t>(r)]))
            << "rank " << r;
    }
  }
}

// Each rank allocates device and pinned memory between its collectives while its peers' kernels
// may already wait in the call: CUDA keeps kernels issued on either side of an allocation from
// running together (Note [implicit synchronization]), so a ring kernel launched alone would wait
// for a peer that can only start after it. Every call ends, with exact sums.
TEST_P(Collectives, RanksThatAllocateBetweenCallsEnd) {
  if (max_world() == 0) GTEST_SKIP() << "no CUDA device";
  Fixture f(GetParam(), 2);
  for (int round = 0; round < 12; ++round) {
    std::vector<std::vector<float>> out(2);
    f.group->run([&](int r) {
      const Stream& s = f.streams[static_cast<std::size_t>(r)];
      Device& device = f.group->device(r);
      const std::size_t count = 1000 + 37 * static_cast<std::size_t>(round);
      std::vector<float> input(count);
      for (std::size_t i = 0; i < count; ++i) input[i] = value(r, i);
      DeviceBuffer data = test::upload(device, s, input);
      f.comm->all_reduce(r, s, data.as<float>(), count, ReduceOp::sum);
      // After this rank's part: allocations of growing sizes, device and pinned, then another call.
      DeviceBuffer more = device.allocate((static_cast<std::size_t>(round) + 1) << 20);
      PinnedBuffer pinned = f.runtime->allocate_pinned(4096 * (static_cast<std::size_t>(round) + 1));
      f.comm->all_reduce(r, s, data.as<float>(), count, ReduceOp::sum);
      out[static_cast<std::size_t>(r)] = test::download<float>(s, data);
    });
    for (int r = 0; r < 2; ++r)
      for (std::size_t i = 0; i < out[0].size(); i += 97)
        ASSERT_EQ(out[static_cast<std::size_t>(r)][i], 2.0f * (value(0, i) + value(1, i))) << "round " << round;
  }
}

// Collectives of one communicator issued on two streams of each rank run one at a time per rank,
// in the order the rank made them (as NCCL's), so neither corrupts the other's staging: both sums
// exact, many times over.
TEST(SimCollectives, CallsOnTwoStreamsOfOneRankDoNotInterfere) {
  auto rt = test::sim_runtime(3);
  DeviceGroup group(*rt, {0, 1, 2});
  auto comm = Communicator::create(group);
  const std::size_t count = 1001;
  for (int repeat = 0; repeat < 20; ++repeat) {
    std::vector<std::vector<float>> first(3), second(3);
    group.run([&](int r) {
      Device& device = group.device(r);
      Stream a = device.create_stream(), b = device.create_stream();
      auto x = test::upload(device, a, std::vector<float>(count, static_cast<float>(r + 1)));
      auto y = test::upload(device, b, std::vector<float>(count, static_cast<float>(10 * (r + 1))));
      a.synchronize();
      b.synchronize();
      comm->all_reduce(r, a, x.as<float>(), count, ReduceOp::sum);
      comm->all_reduce(r, b, y.as<float>(), count, ReduceOp::sum);
      first[static_cast<std::size_t>(r)] = test::download<float>(a, x);
      second[static_cast<std::size_t>(r)] = test::download<float>(b, y);
    });
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(first[static_cast<std::size_t>(r)], std::vector<float>(count, 6.0f)) << "rank " << r;
      EXPECT_EQ(second[static_cast<std::size_t>(r)], std::vector<float>(count, 60.0f)) << "rank " << r;
    }
  }
}

// Every rank agrees on a call's signature before the backend sees it (Note [collective
// agreement]): a rank whose call differs (another count, operation or purpose) makes every rank
// throw CollectiveMismatch naming both ranks, both signatures and the call's number, and no rank's
// buffer is touched (no backend call ran). The communicator is usable for nothing after that, as a
// desynchronized NCCL communicator is not; the flight record holds the failed calls.
TEST_P(Collectives, AMismatchedCallEndsOnEveryRankBeforeItRuns) {
  DP_SKIP_WITHOUT_DEVICES();
  if (max_world() < 3) GTEST_SKIP() << "needs 3 devices";
  Fixture f(GetParam(), 3);
  FlightRecorder::process().clear();
  std::vector<std::vector<float>> after(3);
  std::vector<std::string> errors(3);
  std::vector<DeviceBuffer> buffers(3);
  for (int r = 0; r < 3; ++r)
    buffers[static_cast<std::size_t>(r)] =
        test::upload(f.group->device(r), f.streams[static_cast<std::size_t>(r)], std::vector<float>(8, 1.0f + r));
  f.group->run([&](int r) {
    const Stream& s = f.streams[static_cast<std::size_t>(r)];
    float* x = buffers[static_cast<std::size_t>(r)].as<float>();
    {
      const CollectivePurpose purpose("first");
      f.comm->all_reduce(r, s, x, 8, ReduceOp::sum);  // agreed: runs
    }
    try {
      const CollectivePurpose purpose(r == 1 ? "bucket 1" : "bucket 0");
      f.comm->all_reduce(r, s, x, r == 2 ? 7 : 8, ReduceOp::sum);
    } catch (const CollectiveMismatch& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
    after[static_cast<std::size_t>(r)] = test::download<float>(s, buffers[static_cast<std::size_t>(r)]);
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    // The first call's sum (1 + 2 + 3), and nothing of the second.
    EXPECT_EQ(after[static_cast<std::size_t>(r)], std::vector<float>(8, 6.0f));
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], errors[0]);  // one verdict, on every rank
  }
  const std::string& e = errors[0];
  EXPECT_NE(e.find("call #1"), std::string::npos) << e;
  EXPECT_NE(e.find("global rank 0"), std::string::npos) << e;
  EXPECT_NE(e.find("global rank 1"), std::string::npos) << e;  // the first rank that differs
  EXPECT_NE(e.find("all_reduce f32 x 8 (bucket 0, at test_collectives.cpp:"), std::string::npos) << e;
  EXPECT_NE(e.find("all_reduce f32 x 8 (bucket 1, at test_collectives.cpp:"), std::string::npos) << e;
  int failed = 0, done = 0;
  for (const FlightEntry& entry : FlightRecorder::process().entries()) {
    failed += entry.state == CollectiveState::failed && entry.seq == 1;
    done += entry.state == CollectiveState::done && entry.seq == 0;
  }
  EXPECT_EQ(failed, 3);
  EXPECT_EQ(done, 3);
}

// A rank that ends a unit of work (Communicator::end_of) while its peers issue one more call is
// named at once, as a desync: never a wait for a call it will not make.
TEST_P(Collectives, ARankThatIssuesFewerCallsIsNamedAtOnce) {
  DP_SKIP_WITHOUT_DEVICES();
  Fixture f(GetParam(), 2);
  std::vector<std::string> errors(2);
  std::vector<DeviceBuffer> buffers(2);
  for (int r = 0; r < 2; ++r)
    buffers[static_cast<std::size_t>(r)] =
        test::upload(f.group->device(r), f.streams[static_cast<std::size_t>(r)], std::vector<float>(4, 1.0f));
  const auto start = std::chrono::steady_clock::now();
  f.group->run([&](int r) {
    try {
      if (r == 0) {
        const CollectivePurpose purpose("bucket 0");
        f.comm->all_reduce(r, f.streams[0], buffers[0].as<float>(), 4, ReduceOp::sum);
      }
      f.comm->end_of(r, "the step");
    } catch (const CollectiveMismatch& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("end none x 0 (the step"), std::string::npos) << errors[0];
}

}  // namespace
}  // namespace dp

namespace dp {
// The sim ring between processes, without processes: this is process 1 of 2, whose channel sends
// into the void and whose every receive fails, as when process 0 vanished (kill -9) in the middle
// of an all-reduce. Of the two local ranks, rank 0 receives from process 0 and fails; rank 1 only
// receives from rank 0 (local) and sends to process 0, which succeeds while the socket takes it,
// so it goes on to the ring's next step. It must fail too, at once, not wait there for good.
namespace {
class VanishedPeerChannel final : public detail::Channel {
 public:
  int max_tag() const override { return 1 << 20; }
  void exchange(std::span<const Message>, std::span<const Message> receives, const std::function<bool()>&,
                std::string_view what) override {
    if (!receives.empty()) throw CollectiveAborted(fmt::format("{}: process 0: connection closed by peer", what));
  }
};
class ProcessOneOfTwo final : public ProcessGroup {
 public:
  int rank() const override { return 1; }
  int size() const override { return 2; }
  const std::string& host() const override { return host_; }
  void all_gather_bytes(const void* send, std::size_t bytes, void* recv) override {
    for (int p = 0; p < 2; ++p)
      std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(p) * bytes, send, bytes);
  }
  void broadcast_bytes(void*, std::size_t, int) override {}
  [[noreturn]] void abort(int) override { std::abort(); }
  std::unique_ptr<detail::Channel> open_channel() override { return std::make_unique<VanishedPeerChannel>(); }

 private:
  std::string host_ = "here";
};
}  // namespace

TEST(SimCollectives, ARankThatFailsMidCallEndsItsLocalPeersToo) {
  const auto runtime = test::runtime_or_skip("sim", 2);
  DeviceGroup group(*runtime, {0, 1});
  const auto comm = detail::make_ring_communicator(group, std::make_shared<ProcessOneOfTwo>());
  std::vector<Stream> streams;
  std::vector<DeviceBuffer> data;
  for (int r = 0; r < 2; ++r) {
    streams.push_back(group.device(r).create_stream());
    data.push_back(group.device(r).allocate(64 * sizeof(float)));
  }
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.push_back(std::async(std::launch::async, [&, r]() -> std::string {
      try {
        comm->all_reduce(r, streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)].as<float>(), 64,
                         ReduceOp::sum);
        streams[static_cast<std::size_t>(r)].synchronize();
      } catch (const CollectiveAborted& e) {
        return e.what();
      }
      return "finished";
    }));
  for (int r = 0; r < 2; ++r) {
    const bool ended =
        ranks[static_cast<std::size_t>(r)].wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    EXPECT_TRUE(ended) << "rank " << r << " still waits in the ring";
    if (!ended) comm->abort();  // lets the test end after reporting
    const std::string said = ranks[static_cast<std::size_t>(r)].get();
    EXPECT_NE(said.find(r == 0 ? "connection closed by peer" : "aborted"), std::string::npos)
        << "rank " << r << ": " << said;
  }
}
}  // namespace dp
