// test_mpi — run by ctest under `mpirun -np 2`: every process drives 2 simulated devices, and
// every result is compared, bit for bit, with what one process computes over 4 simulated devices
// (the same ring, the same global ranks). Each process checks its own ranks; the exit code is the
// worst over the processes, and only process 0 prints gtest's report.
#include <cstring>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp_data.h"
#include "dp/engines/ddp.h"
#include "dp/io/checkpoint.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/process_group.h"
#include "sync_bn_golden.h"
#include "test_util.h"

namespace dp {
namespace {

std::shared_ptr<ProcessGroup> g_world;
constexpr int kLocal = 2;

ProcessGroup& world() { return *g_world; }
int first() { return world().rank() * kLocal; }
int global_ranks() { return world().size() * kLocal; }

TEST(ProcessGroup, RanksHostsAndHostCollectives) {
  ASSERT_GE(world().size(), 2) << "run under mpirun -np 2 (or more)";
  EXPECT_FALSE(world().host().empty());
  const std::vector<int> ranks = world().all_gather(world().rank());
  for (int p = 0; p < world().size(); ++p) EXPECT_EQ(ranks[static_cast<std::size_t>(p)], p);
  std::uint64_t value = world().rank() == 1 ? 0x0123456789abcdefULL : 0;
  world().broadcast_bytes(&value, sizeof(value), 1);
  EXPECT_EQ(value, 0x0123456789abcdefULL);
  // reduce_value: the mean over every global rank, the same bits everywhere.
  const std::vector<double> mine{0.1 * (first() + 1), 0.1 * (first() + 2)};
  double want = 0.0;
  for (int g = 0; g < global_ranks(); ++g) want += 0.1 * (g + 1);
  EXPECT_EQ(reduce_value(world(), mine, ReduceOp::sum), want);
  EXPECT_EQ(reduce_value(world(), mine, ReduceOp::avg), want / global_ranks());
  world().barrier();
}

// What the 2 x 2 ring computes is what one process's ring over 4 devices computes.
TEST(Ring, CollectivesAcrossProcessesEqualOneProcess) {
  const int n = global_ranks();
  auto rt = test::sim_runtime(kLocal);
  auto ref_rt = test::sim_runtime(n);
  DeviceGroup group(*rt, {0, 1});
  DeviceGroup ref_group(*ref_rt, DeviceGroup::all_devices(*ref_rt));
  auto comm = Communicator::create(group, g_world);
  auto ref = Communicator::create(ref_group);
  ASSERT_EQ(comm->size(), n);
  ASSERT_EQ(comm->local_size(), kLocal);
  ASSERT_EQ(comm->first_rank(), first());
  for (const std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{4099}}) {
    SCOPED_TRACE(fmt::format("{} floats", count));
    // Values whose sums round differently in another order: a different ring would show.
    const auto values = [&](int g, unsigned salt) { return test::random_vector(count, 100 * g + salt, -1e3f, 1e3f); };
    const auto run = [&](Communicator& c, DeviceGroup& devices, int offset) {
      std::vector<std::vector<float>> results(static_cast<std::size_t>(devices.size()));
      devices.run([&](int r) {
        Device& device = devices.device(r);
        Stream s = device.create_stream();
        const int g = offset + r;
        auto sum = test::upload(device, s, values(g, 1));
        auto avg = test::upload(device, s, values(g, 2));
        auto bcast = test::upload(device, s, values(g, 3));
        auto reduced = test::upload(device, s, values(g, 4));
        auto send = test::upload(device, s, values(g, 5));
        DeviceBuffer gathered = device.allocate(count * static_cast<std::size_t>(n) * sizeof(float));
        c.all_reduce(r, s, sum.as<float>(), count, ReduceOp::sum);
        c.all_reduce(r, s, avg.as<float>(), count, ReduceOp::avg);
        c.broadcast(r, s, bcast.data(), count * sizeof(float), n - 1);
        c.reduce(r, s, reduced.as<float>(), count, 1);
        c.all_gather(r, s, send.as<float>(), gathered.as<float>(), count);
        std::vector<float> out;
        for (const DeviceBuffer* b : {&sum, &avg, &bcast, &reduced, &gathered}) {
          const auto host = test::download<float>(s, *b);
          out.insert(out.end(), host.begin(), host.end());
        }
        results[static_cast<std::size_t>(r)] = out;
      });
      return results;
    };
    const auto got = run(*comm, group, first());
    const auto want = run(*ref, ref_group, 0);
    for (int r = 0; r < kLocal; ++r) {
      const auto& a = got[static_cast<std::size_t>(r)];
      const auto& b = want[static_cast<std::size_t>(first() + r)];
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "global rank " << first() + r;
    }
  }
  // The ring's step that crosses processes is network traffic; the others are device copies.
  EXPECT_GT(rt->link_traffic(kNetwork, 0).bytes, 0u);  // local rank 0 receives from the previous process
  EXPECT_GT(rt->link_traffic(1, kNetwork).bytes, 0u);  // local rank 1 sends to the next one
  EXPECT_GT(rt->link_traffic(0, 1).bytes, 0u);
}

using test::Data;
using test::make_data;

// This process's ranks' shards (global ranks first() .. first() + kLocal - 1) of a step's batch.
std::vector<Batch> local_shards(const Data& d, int first_row, int per_rank) {
  return test::shards(d, first_row, kLocal, per_rank, first());
}

// Two collectives of one communicator in flight on two streams of each rank, across processes:
// each rank's calls take turns, so the messages and staging of one never mix with the other's.
TEST(Ring, CallsOnTwoStreamsOfOneRankDoNotInterfere) {
  auto rt = test::sim_runtime(kLocal);
  DeviceGroup group(*rt, {0, 1});
  auto comm = Communicator::create(group, g_world);
  const int n = global_ranks();
  const std::size_t count = 1001;
  const float want_x = static_cast<float>(n * (n + 1) / 2), want_y = 10.0f * want_x;
  for (int repeat = 0; repeat < 20; ++repeat) {
    group.run([&](int r) {
      Device& device = group.device(r);
      Stream a = device.create_stream(), b = device.create_stream();
      const int g = first() + r;
      auto x = test::upload(device, a, std::vector<float>(count, static_cast<float>(g + 1)));
      auto y = test::upload(device, b, std::vector<float>(count, static_cast<float>(10 * (g + 1))));
      a.synchronize();
      b.synchronize();
      comm->all_reduce(r, a, x.as<float>(), count, ReduceOp::sum);
      comm->all_reduce(r, b, y.as<float>(), count, ReduceOp::sum);
      EXPECT_EQ(test::download<float>(a, x), std::vector<float>(count, want_x)) << "global rank " << g;
      EXPECT_EQ(test::download<float>(b, y), std::vector<float>(count, want_y)) << "global rank " << g;
    });
  }
}

struct DdpCase {
  std::string model;
  bool sync_bn;
};
class DdpAcrossProcesses : public ::testing::TestWithParam<DdpCase> {};

// DDP over 2 processes x 2 devices trains bit for bit as DDP over one process's 4 devices:
// the loss of every step, every parameter, buffer and optimizer state of every rank.
TEST_P(DdpAcrossProcesses, EqualsOneProcessWithAllTheDevices) {
  const auto& [name, sync_bn] = GetParam();
  const int n = global_ranks(), per_rank = 3, steps = 3;
  auto make = [&](Device& device) {
    return name == "convnet" ? models::make_convnet(device, 9) : models::make_mlp(device, {32, 16}, 9, 0.25);
  };
  auto rt = test::sim_runtime(kLocal);
  auto ref_rt = test::sim_runtime(n);
  auto model = make(rt->device(0));
  auto ref_model = make(ref_rt->device(0));
  const SgdOptions sgd{0.05f, 0.9f, 1e-4f, false};
  EngineOptions options;
  options.sync_batchnorm = sync_bn;
  options.step.seed = 5;           // the MLP's dropout: global rank g draws from seed + g
  options.first_bucket_mb = 0.01;  // several buckets
  options.bucket_cap_mb = 0.05;
  EngineOptions ref_options = options;
  options.processes = g_world;
  DistributedDataParallel ddp(*rt, *model, sgd, options);
  DistributedDataParallel ref(*ref_rt, *ref_model, sgd, ref_options);
  ASSERT_EQ(ddp.world_size(), n);
  ASSERT_EQ(ddp.first_rank(), first());
  const Data data = make_data(steps * n * per_rank, 4);
  for (int step = 0; step < steps; ++step) {
    const int row = step * n * per_rank;
    const float got = ddp.train_step(local_shards(data, row, per_rank));
    const float want = ref.train_step(test::shards(data, row, n, per_rank));
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << "step " << step << ": " << got << " vs " << want;
  }
  // Gradient accumulation: a no_sync forward/backward, then a synchronised one, then the step.
  {
    const int row = 0;
    {
      auto local = ddp.no_sync();
      auto ref_local = ref.no_sync();
      ddp.forward_backward(local_shards(data, row, per_rank));
      ref.forward_backward(test::shards(data, row, n, per_rank));
    }
    const int next = n * per_rank;
    const float got = ddp.forward_backward(local_shards(data, next, per_rank));
    const float want = ref.forward_backward(test::shards(data, next, n, per_rank));
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << "accumulated step: " << got << " vs " << want;
    ddp.optimizer_step();
    ref.optimizer_step();
  }
  // Evaluation totals are those of every process's batches.
  const EvalTotals got = ddp.evaluate(local_shards(data, 0, per_rank));
  const EvalTotals want = ref.evaluate(test::shards(data, 0, n, per_rank));
  EXPECT_EQ(got.samples, want.samples);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-9 * std::fabs(want.loss_sum));
  ddp.synchronize();
  ref.synchronize();
  for (int r = 0; r < kLocal; ++r) {
    Stream s = rt->device(r).create_stream();
    Stream rs = ref_rt->device(first() + r).create_stream();
    const safetensors::File a = state_dict(ddp.replica(r), s), b = state_dict(ref.replica(first() + r), rs);
    for (const auto& key : b.order)
      EXPECT_EQ(a.at(key).data, b.at(key).data) << key << " on global rank " << first() + r;
    const auto state = [](Optimizer& o, const Stream& stream) {
      std::vector<float> out;
      for (const auto& buffer : o.state()) {
        std::vector<float> host(o.param_count());
        stream.copy(host.data(), buffer.data, host.size() * sizeof(float));
        out.insert(out.end(), host.begin(), host.end());
      }
      return out;
    };
    EXPECT_EQ(state(ddp.optimizer(r), s), state(ref.optimizer(first() + r), rs));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DdpAcrossProcesses,
                         ::testing::Values(DdpCase{"mlp", false}, DdpCase{"convnet", false}, DdpCase{"convnet", true}),
                         [](const auto& info) {
                           return fmt::format("{}{}", info.param.model, info.param.sync_bn ? "_syncbn" : "");
                         });

// SyncBatchNorm across processes against PyTorch: 2 processes x 1 device, and 2 x 3 (6 ranks of one
// sample each: every BatchNorm statistic is made of all processes' samples).
TEST(SyncBatchNormAcrossProcesses, MatchesPyTorchOnTheWholeBatch) {
  for (const int local : {1, 3}) {
    SCOPED_TRACE(fmt::format("{} device(s) per process", local));
    auto rt = test::sim_runtime(local);
    test::expect_sync_bn_matches_torch(*rt, DeviceGroup::all_devices(*rt), g_world);
  }
}

// NCCL across processes: one GPU per process (process p drives GPU p), the unique id broadcast by
// MPI. Needs as many GPUs on this machine as processes; skips otherwise (no GPU here).
TEST(NcclAcrossProcesses, AllReduceAndBroadcastOverEveryProcess) {
  if (Runtime::cuda_device_count() < world().size())
    GTEST_SKIP() << "needs " << world().size() << " CUDA devices, found " << Runtime::cuda_device_count();
  auto rt = Runtime::create({.backend = "cuda"});
  DeviceGroup group(*rt, {world().rank()});
  auto comm = Communicator::create(group, g_world);
  ASSERT_EQ(comm->size(), world().size());
  Device& device = group.device(0);
  Stream s = device.create_stream();
  const std::size_t count = 1000;
  auto sum = test::upload(device, s, std::vector<float>(count, static_cast<float>(world().rank() + 1)));
  auto root = test::upload(device, s, std::vector<float>(count, static_cast<float>(world().rank() * 10)));
  group.run([&](int r) {
    comm->all_reduce(r, s, sum.as<float>(), count, ReduceOp::sum);
    comm->broadcast(r, s, root.data(), count * sizeof(float), world().size() - 1);
  });
  const float want = static_cast<float>(world().size() * (world().size() + 1) / 2);
  EXPECT_EQ(test::download<float>(s, sum), std::vector<float>(count, want));
  EXPECT_EQ(test::download<float>(s, root), std::vector<float>(count, static_cast<float>((world().size() - 1) * 10)));
}

TEST(DdpAcrossProcesses, EveryProcessMustDriveTheSameNumberOfDevices) {
  auto rt = test::sim_runtime(2);
  DeviceGroup group(*rt, world().rank() == 0 ? std::vector<int>{0} : std::vector<int>{0, 1});
  try {
    Communicator::create(group, g_world);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("same number of devices"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dp

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dp::g_world = dp::ProcessGroup::from_environment();
  if (dp::g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int result = RUN_ALL_TESTS();
  // A failure on any process fails the run, and every process says so.
  int worst = 0;
  for (const int r : dp::g_world->all_gather(result)) worst = std::max(worst, r);
  if (worst != 0 && result == 0)
    fmt::print("process {}: a test failed on another process (see process 0's report or run it alone)\n",
               dp::g_world->rank());
  dp::g_world.reset();  // MPI_Finalize
  return worst;
}
