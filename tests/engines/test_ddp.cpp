// test_ddp.cpp — DistributedDataParallel on 1-4 simulated devices: bucket assignment as torch does
// it, equality with single-device training on the concatenated batch, no_sync accumulation,
// overlap of the first bucket's all-reduce with backward, identical replicas, PyTorch gloo goldens.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include "ddp_data.h"
#include "dp/engines/ddp.h"
#include "dp/engines/engine.h"
#include "dp/engines/trainer.h"
#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/kernels/fingerprint.h"
#include "dp/kernels/ops.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/nn/loss.h"
#include "dp/runtime/error.h"
#include "dp/runtime/trace.h"
#include "forwarding_model.h"
#include "golden_model.h"
#include "sync_bn_golden.h"
#include "test_util.h"

namespace dp {
namespace {

std::vector<float> params_of(const Model& m) {
  Stream s = m.device().create_stream();
  std::vector<float> out(m.param_count());
  s.copy(out.data(), m.params_flat(), out.size() * sizeof(float));
  return out;
}

using test::Data;
using test::make_data;
using test::shards;

TEST(Ddp, BucketAssignmentMatchesTorch) {
  auto rt = test::sim_runtime(1);
  auto mlp = models::make_mlp(rt->device(0), {256, 256});
  // Values from torch 1.13: dist._compute_bucket_assignment_by_size(reversed params, limits,
  // tensor_indices=reversed(range(6))), i.e. the buckets DDP rebuilds after its first iteration.
  auto names = [](const std::vector<GradBucket>& buckets) {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : buckets) out.push_back(b.parameters);
    return out;
  };
  const auto params = mlp->parameters();
  EXPECT_EQ(names(assign_buckets(params, 1.0, 25.0)),
            (std::vector<std::vector<std::string>>{
                {"fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"}}));
  EXPECT_EQ(names(assign_buckets(params, 1024.0 / (1 << 20), 300000.0 / (1 << 20))),
            (std::vector<std::vector<std::string>>{{"fc3.bias", "fc3.weight"},
                                                   {"fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"}}));
  const auto three = assign_buckets(params, 1024.0 / (1 << 20), 4000.0 / (1 << 20));
  EXPECT_EQ(names(three), (std::vector<std::vector<std::string>>{
                              {"fc3.bias", "fc3.weight"}, {"fc2.bias", "fc2.weight"}, {"fc1.bias", "fc1.weight"}}));
  // Buckets are contiguous slices of the flat gradient buffer, last parameters first.
  EXPECT_EQ(three[0].offset, params[4].offset);
  EXPECT_EQ(three[0].count, 2560u + 10u);
  EXPECT_EQ(three[2].offset, 0u);
  EXPECT_EQ(three[2].count, 784u * 256 + 256);
  EXPECT_THROW(assign_buckets(params, 1.0, 0.0), InvalidArgument);
  // Frozen parameters are in no bucket; the buckets around them stay contiguous slices.
  const auto frozen = assign_buckets(params, 1.0, 25.0, {"fc2"});
  EXPECT_EQ(names(frozen),
            (std::vector<std::vector<std::string>>{{"fc3.bias", "fc3.weight"}, {"fc1.bias", "fc1.weight"}}));
  EXPECT_EQ(frozen[1].offset, 0u);
  EXPECT_EQ(frozen[1].count, 784u * 256 + 256);
  // An engine's frozen parameters reach DDP's reducer: their gradients are not all-reduced.
  auto two = test::sim_runtime(2);
  auto model = models::make_mlp(two->device(0), {256, 256});
  EngineOptions options;
  options.kind = EngineKind::ddp;
  options.frozen = {"fc2"};
  const auto engine = make_engine(*two, *model, SgdOptions{0.05f}, options);
  EXPECT_EQ(names(dynamic_cast<const DistributedDataParallel&>(*engine).buckets()), names(frozen));
}

// On sim and cuda with 1-4 devices (cuda: NCCL across GPUs, the device ring among devices sharing
// one; skipped without a GPU).
class DdpOnBackend : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Backends, DdpOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(DdpOnBackend, MlpEqualsSingleDeviceOnTheConcatenatedBatch) {
  const bool sim = GetParam() == "sim";
  if (!sim && Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: DDP on GPUs needs one";
  const int max_world = 4;  // on cuda several per GPU where there are fewer GPUs (the device ring)
  auto rt = sim ? test::sim_runtime(max_world) : test::cuda_runtime(max_world);
  const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};
  const Data data = make_data(4 * 5 * 8, 3);
  for (int world = 1; world <= max_world; ++world) {
    SCOPED_TRACE(fmt::format("world {}", world));
    auto model = models::make_mlp(rt->device(0), {64, 32}, 5);
    auto reference = models::make_mlp(rt->device(0), {64, 32}, 5);
    EngineOptions options;
    options.device_ids = std::vector<int>(static_cast<std::size_t>(world));
    for (int d = 0; d < world; ++d) (*options.device_ids)[static_cast<std::size_t>(d)] = d;
    options.bucket_cap_mb = 0.05;  // several buckets
    options.first_bucket_mb = 0.01;
    options.check_replicas = true;
    DistributedDataParallel ddp(*rt, *model, sgd, options);
    SingleDeviceTrainer single(*reference, sgd);
    const int per_rank = 5;
    for (int step = 0; step < 4; ++step) {
      const int first = step * world * per_rank;
      const float ddp_loss = ddp.train_step(shards(data, first, world, per_rank));
      const float ref_loss = single.train_step(data.x.data() + static_cast<std::size_t>(first) * 784,
                                               data.y.data() + first, world * per_rank);
      // The mean of per-rank means over equal shards is the global mean, up to fp32 rounding.
      EXPECT_NEAR(ddp_loss, ref_loss, (sim ? 2e-6f : 1e-5f) * std::fabs(ref_loss));
    }
    // Gradients differ in summation order only (per-rank GEMMs, pre-division by N, ring sum):
    // ~1e-7 relative per step, compounded over 4 momentum steps.
    ddp.synchronize();
    for (int r = 0; r < world; ++r)
      EXPECT_TRUE(test::all_close(params_of(ddp.replica(r)), params_of(*reference), 1e-5, 1e-6)) << "rank " << r;
  }
}

// SyncBatchNorm: with BatchNorm statistics over all ranks' batches, DDP over N ranks of b samples
// trains exactly as one device on the N*b samples (PyTorch's definition) — BatchNorm's running
// statistics included — up to summation order: the ConvNet and ResNet-8 (BatchNorm in every block
// and shortcut), 1 to 3 ranks, several steps.
struct SyncBnCase {
  std::string model;
  int world;
  bool cuda = false;  // several devices on one GPU where there are fewer GPUs
};
class SyncBatchNorm : public ::testing::TestWithParam<SyncBnCase> {};

TEST_P(SyncBatchNorm, DdpEqualsOneDeviceOnTheConcatenatedBatch) {
  const std::string name = GetParam().model;
  const auto world = GetParam().world;
  const bool cuda = GetParam().cuda;
  if (cuda && Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: SyncBatchNorm on GPUs needs one";
  auto make = [&](Device& device) {
    return name == "convnet" ? models::make_convnet(device, 6) : models::make_resnet8(device, 6);
  };
  auto rt = cuda ? test::cuda_runtime(world) : test::sim_runtime(world);
  auto ref_rt = cuda ? test::cuda_runtime(1) : test::sim_runtime(1);
  const SgdOptions sgd{0.05f, 0.9f, 1e-4f, false};
  auto model = make(rt->device(0));
  auto reference = make(ref_rt->device(0));
  EngineOptions options;
  options.sync_batchnorm = true;
  options.check_replicas = true;
  DistributedDataParallel ddp(*rt, *model, sgd, options);
  SingleDeviceTrainer single(*reference, sgd);
  const int per_rank = 4;
  const Data data = make_data(3 * world * per_rank, 21);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const int first = step * world * per_rank;
    const float got = ddp.train_step(shards(data, first, world, per_rank));
    const float want = single.train_step(data.x.data() + static_cast<std::size_t>(first) * 784, data.y.data() + first,
                                         world * per_rank);
    EXPECT_NEAR(got, want, 1e-5f * std::fabs(want));
  }
  ddp.synchronize();
  Stream rs = ref_rt->device(0).create_stream();
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    Stream s = rt->device(r).create_stream();
    const auto got = state_dict(ddp.replica(r), s), want = state_dict(*reference, rs);
    for (const auto& key : want.order) {
      if (want.at(key).dtype == "I64") {
        EXPECT_EQ(got.at(key).to_i64(), want.at(key).to_i64()) << key;
        continue;
      }
      const auto w = want.at(key).to_f32();
      float scale = 0.0f;
      for (float v : w) scale = std::max(scale, std::fabs(v));
      // Running statistics included: every rank holds the global ones, as torch's SyncBatchNorm.
      EXPECT_TRUE(test::all_close(got.at(key).to_f32(), w, 1e-4, 1e-5 * scale + 1e-6)) << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SyncBatchNorm,
                         ::testing::Values(SyncBnCase{"convnet", 1}, SyncBnCase{"convnet", 2}, SyncBnCase{"convnet", 3},
                                           SyncBnCase{"resnet8", 2}, SyncBnCase{"convnet", 2, true},
                                           SyncBnCase{"convnet", 3, true}, SyncBnCase{"resnet8", 2, true}),
                         [](const auto& info) {
                           return fmt::format("{}_w{}{}", info.param.model, info.param.world,
                                              info.param.cuda ? "_cuda" : "");
                         });

// Against PyTorch: DDP with SyncBatchNorm over 1, 2 and 3 ranks of the golden's batch of 6 trains
// as torch trains ResNet-8 on the whole batch.
TEST(SyncBatchNorm, MatchesPyTorchOnTheWholeBatch) {
  for (const int ranks : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks", ranks));
    auto rt = test::sim_runtime(ranks);
    test::expect_sync_bn_matches_torch(*rt, DeviceGroup::all_devices(*rt));
    test::expect_sync_bn_matches_torch(*rt, DeviceGroup::all_devices(*rt), nullptr, ranks);  // with shards
  }
}

// Without it, each rank normalises with its own batch: the same run differs from one device.
TEST(SyncBatchNormOff, PerRankStatisticsDifferFromOneDevice) {
  auto rt = test::sim_runtime(2);
  auto ref_rt = test::sim_runtime(1);
  auto model = models::make_convnet(rt->device(0), 6), reference = models::make_convnet(ref_rt->device(0), 6);
  DistributedDataParallel ddp(*rt, *model, SgdOptions{0.05f});
  SingleDeviceTrainer single(*reference, SgdOptions{0.05f});
  const Data data = make_data(8, 21);
  const float got = ddp.train_step(shards(data, 0, 2, 4));
  EXPECT_GT(std::fabs(got - single.train_step(data.x.data(), data.y.data(), 8)), 1e-4f);
}

// DDP on one rank is the single-device step: bit for bit, and without a collective or a 1/N scale
// in its trace (torch scales and all-reduces even then; there is nothing to gain from it).
TEST(Ddp, OneRankIsTheSingleDeviceStepWithoutCollectives) {
  auto rt = test::sim_runtime(1);
  auto ref_rt = test::sim_runtime(1);
  const SgdOptions sgd{0.05f, 0.9f, 1e-4f, false};
  auto model = models::make_convnet(rt->device(0), 3), reference = models::make_convnet(ref_rt->device(0), 3);
  DistributedDataParallel ddp(*rt, *model, sgd);
  SingleDeviceTrainer single(*reference, sgd);
  const Data data = make_data(18, 4);
  rt->set_profiling(true);
  for (int step = 0; step < 3; ++step) {
    const int first = step * 6;
    const float got = ddp.train_step(shards(data, first, 1, 6));
    EXPECT_EQ(got, single.train_step(data.x.data() + static_cast<std::size_t>(first) * 784, data.y.data() + first, 6));
  }
  ddp.synchronize();
  for (const TraceSpan& span : rt->take_trace()) {
    EXPECT_NE(span.kind, SpanKind::collective) << span.name;
    EXPECT_NE(span.name, "scale") << "the 1/N scale of the gradient buckets";
  }
  EXPECT_EQ(params_of(*model), params_of(*reference));
}

TEST(Ddp, NoSyncAccumulationEqualsOneStepOnTheConcatenatedBatch) {
  const SgdOptions sgd{0.05f, 0.9f, 0.0f, false};
  const int world = 2, per_rank = 4, micro = 3;
  const Data data = make_data(world * per_rank * micro, 8);
  auto rt = test::sim_runtime(world), single_rt = test::sim_runtime(1);
  auto model = models::make_mlp(rt->device(0), {32}, 2);
  auto reference = models::make_mlp(single_rt->device(0), {32}, 2);
  DistributedDataParallel ddp(*rt, *model, sgd);
  ddp.zero_grad();
  {
    auto guard = ddp.no_sync();
    for (int k = 0; k < micro - 1; ++k)
      ddp.forward_backward(shards(data, k * world * per_rank, world, per_rank), 1.0f / micro);
  }
  ddp.forward_backward(shards(data, (micro - 1) * world * per_rank, world, per_rank), 1.0f / micro);
  ddp.optimizer_step();
  // The same samples as one batch of 24: rank r's micro-batches are rows k*8 + r*4 .. +4.
  std::vector<float> x;
  std::vector<std::int64_t> y;
  for (int k = 0; k < micro; ++k)
    for (int r = 0; r < world; ++r)
      for (int i = 0; i < per_rank; ++i) {
        const int row = k * world * per_rank + r * per_rank + i;
        x.insert(x.end(), data.x.begin() + row * 784, data.x.begin() + (row + 1) * 784);
        y.push_back(data.y[static_cast<std::size_t>(row)]);
      }
  SingleDeviceTrainer single(*reference, sgd);
  single.train_step(x.data(), y.data(), world * per_rank * micro);
  ddp.synchronize();
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(test::all_close(params_of(ddp.replica(r)), params_of(*reference), 1e-5, 1e-6)) << "rank " << r;
  EXPECT_NO_THROW(ddp.check_replicas_identical());
}

// A user's own model (the engine sees only the Model interface) that wraps another and makes the
// rest of backward slow once the last layer's gradients are out, like a heavy first layer would:
// 50 ms on the compute stream dwarfs any thread-scheduling delay of the 2-core CI machines, so the
// overlap below is a property of the engine, not of the scheduler's mood.
class SlowRestOfBackward final : public test::ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  std::string name() const override { return "slow_" + ForwardingModel::name(); }
  void backward(const Stream& s, const float* dy, const GradientsReady& on_ready) override {
    bool first = true;
    ForwardingModel::backward(s, dy, [&](std::size_t offset, std::size_t count) {
      if (on_ready) on_ready(offset, count);
      if (std::exchange(first, false))
        s.launch_host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
    });
  }
  bool capturable() const override { return false; }  // its timing is what the tests look at: eager
  std::unique_ptr<Model> replicate(Device& device) const override {
    return std::make_unique<SlowRestOfBackward>(inner().replicate(device));
  }
};

// torch 1.13 broadcasts buffers before a forward only if the previous forward synchronised
// (require_forward_param_sync): counted on the 0 -> 1 link of two ranks.
TEST(Ddp, BufferBroadcastIsSkippedAfterANoSyncForward) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_convnet(rt->device(0), 1);
  DistributedDataParallel ddp(*rt, *model, SgdOptions{0.01f});
  const std::uint64_t buffers = model->buffers_bytes(), grads = model->param_count() * sizeof(float);
  const Data data = make_data(8, 3);
  rt->reset_link_traffic();
  ddp.zero_grad();
  {
    auto guard = ddp.no_sync();
    ddp.forward_backward(shards(data, 0, 2, 4));  // broadcast (the first forward syncs), no all-reduce
  }
  EXPECT_EQ(rt->link_traffic(0, 1).bytes, buffers);
  ddp.forward_backward(shards(data, 0, 2, 4));  // no broadcast after a no_sync forward; all-reduce
  // A two-rank ring all-reduce sends half the buffer in reduce-scatter and half in all-gather.
  EXPECT_EQ(rt->link_traffic(0, 1).bytes, buffers + grads);
  ddp.optimizer_step();
  ddp.train_step(shards(data, 0, 2, 4));  // synchronised again: broadcast + all-reduce
  EXPECT_EQ(rt->link_traffic(0, 1).bytes, 2 * buffers + 2 * grads);
}

TEST(Ddp, FirstBucketAllReduceOverlapsBackward) {
  auto rt = test::sim_runtime(2);
  SlowRestOfBackward model(models::make_mlp(rt->device(0), {256, 256}, 1));
  EngineOptions options;
  options.first_bucket_mb = 1024.0 / (1 << 20);
  options.bucket_cap_mb = 4000.0 / (1 << 20);  // buckets {fc3}, {fc2}, {fc1}
  DistributedDataParallel ddp(*rt, model, SgdOptions{0.01f}, options);
  ASSERT_EQ(ddp.buckets().size(), 3u);
  const Data data = make_data(128, 4);
  ddp.train_step(shards(data, 0, 2, 64));  // warm-up: allocations
  rt->take_trace();
  rt->set_profiling(true);
  ddp.train_step(shards(data, 0, 2, 64));
  rt->set_profiling(false);
  const auto trace = rt->take_trace();
  for (int device = 0; device < 2; ++device) {
    std::int64_t first_all_reduce = -1, last_gemm_end = -1;
    int all_reduces = 0;
    for (const auto& span : trace) {
      if (span.device != device) continue;
      if (span.name == "all_reduce") {
        ++all_reduces;
        if (first_all_reduce < 0 || span.start_ns < first_all_reduce) first_all_reduce = span.start_ns;
      }
      // The backward's last GEMM is fc1's weight gradient: it ends backward on the compute stream.
      if (span.kind == SpanKind::gemm) last_gemm_end = std::max(last_gemm_end, span.end_ns);
    }
    EXPECT_EQ(all_reduces, 3) << "one all-reduce per bucket on device " << device;
    ASSERT_GE(first_all_reduce, 0);
    EXPECT_LT(first_all_reduce, last_gemm_end)
        << "device " << device << ": the first bucket's all-reduce must start while backward is still running";
  }
}

TEST(Ddp, ReplicasStayIdenticalAndDivergenceIsCaught) {
  auto rt = test::sim_runtime(3);
  auto model = models::make_convnet(rt->device(0), 3);
  EngineOptions options;
  options.check_replicas = true;
  DistributedDataParallel ddp(*rt, *model, SgdOptions{0.05f, 0.9f, 1e-4f, true}, options);
  const Data data = make_data(3 * 4 * 2, 6);
  for (int step = 0; step < 2; ++step) EXPECT_NO_THROW(ddp.train_step(shards(data, step * 12, 3, 4)));
  // Corrupt one weight of rank 2: the debug check must name it.
  ddp.synchronize();
  Stream s = rt->device(2).create_stream();
  const float bad = 123.0f;
  s.copy(ddp.replica(2).params_flat() + 5, &bad, sizeof(float));
  s.synchronize();
  try {
    ddp.check_replicas_identical();
    FAIL() << "divergence not detected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layer1.0.weight'[5]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
}

// EngineOptions::check_replicas: one bit flipped on one device, in a parameter or in the optimizer
// state, is named at the next check (the device, the part, the tensor), ReplicaMismatch (exit 8);
// between checks it goes unseen.
TEST(Ddp, AFlippedBitIsNamedByTheReplicasFingerprints) {
  for (const bool state : {false, true}) {
    SCOPED_TRACE(state ? "optimizer state" : "parameters");
    auto rt = test::sim_runtime(3);
    auto model = models::make_convnet(rt->device(0), 3);
    EngineOptions options;
    options.check_replicas = 2;
    // lr 0 for the state: its flipped bit then stays out of the parameters (the update adds lr x it).
    DistributedDataParallel ddp(*rt, *model, SgdOptions{state ? 0.0f : 0.05f, 0.9f, 0.0f, false}, options);
    const Data data = make_data(3 * 4 * 4, 6);
    for (int step = 0; step < 2; ++step) EXPECT_NO_THROW(ddp.train_step(shards(data, step * 12, 3, 4)));
    ddp.synchronize();
    // The fc layer's weight, far from where layer1 starts.
    const TensorRef fc = ddp.replica(1).parameters().back();
    float* base = state ? ddp.optimizer(1).state()[0].data : ddp.replica(1).params_flat();
    // Bit 22, the mantissa's highest: a low bit may be rounded away by the next update, healing it.
    kernels::flip_bit(rt->device(1).create_stream(), reinterpret_cast<std::uint32_t*>(base + fc.offset), 22);
    ddp.synchronize();
    EXPECT_NO_THROW(ddp.train_step(shards(data, 24, 3, 4))) << "step 3: no check";
    try {
      ddp.train_step(shards(data, 36, 3, 4));
      FAIL() << "the flipped bit went unseen";
    } catch (const ReplicaMismatch& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fmt::format("after step 4 the replicas' {} differ: global rank 1 (device 1) holds other "
                                      "bits than the other 2 of 3 replicas, first in '{}'",
                                      state ? "optimizer momentum" : "parameters", fc.name)),
                std::string::npos)
          << what;
      EXPECT_EQ(exit_code(std::current_exception()), 8);
    }
  }
}

// A rank that fails mid-step (here: a label outside the classes) must not leave its peers waiting
// in a collective: the step throws an error naming the device. Small buckets: several
// collectives are in flight when it happens.
TEST(Ddp, AFailingRankDoesNotDeadlockItsPeers) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_mlp(rt->device(0), {256, 256}, 1);
  EngineOptions options;
  options.first_bucket_mb = 0.1;
  options.bucket_cap_mb = 0.1;
  DistributedDataParallel ddp(*rt, *model, SgdOptions{0.01f}, options);
  Data data = make_data(16, 2);
  data.y[12] = 10;  // rank 1's batch (rows 8..15)
  try {
    ddp.train_step(shards(data, 0, 2, 8));
    FAIL() << "the bad label was accepted";
  } catch (const WorkerError& e) {
    EXPECT_EQ(e.device(), 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("target 10"), std::string::npos) << e.what();
  }
}

// ResNet-8 (BatchNorm in every block and shortcut) through DDP with 2 ranks, emulated with two
// single-device replicas on one device: each rank normalizes with its own shard's statistics,
// rank 0's buffers reach rank 1 before every forward (broadcast_buffers), the gradient is the
// mean over ranks, every replica steps the same. Equal to summation order (the ring's).
TEST(Ddp, ResNet8EqualsItsPerRankEmulation) {
  auto rt = test::sim_runtime(2);
  auto ref_rt = test::sim_runtime(1);
  Device& ref = ref_rt->device(0);
  const SgdOptions sgd{0.05f, 0.9f, 1e-4f, false};
  auto model = models::make_resnet8(rt->device(0), 5);
  EngineOptions options;
  options.check_replicas = true;
  DistributedDataParallel ddp(*rt, *model, sgd, options);
  auto rank0 = models::make_resnet8(ref, 5), rank1 = models::make_resnet8(ref, 5);
  Sgd optimizer(ref, rank0->param_count(), sgd);
  CrossEntropyLoss loss(ref);
  Stream s = ref.create_stream();
  const int per_rank = 6;
  DeviceBuffer logits = ref.allocate(per_rank * 10 * sizeof(float)),
               dlogits = ref.allocate(per_rank * 10 * sizeof(float));
  DeviceBuffer x = ref.allocate(per_rank * 784 * sizeof(float)), y = ref.allocate(per_rank * sizeof(std::int64_t));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const Data d = make_data(2 * per_rank, 60 + static_cast<unsigned>(step));
    const float got = ddp.train_step(shards(d, 0, 2, per_rank));
    // Rank 1 starts from rank 0's parameters (identical anyway) and buffers.
    s.copy(rank1->params_flat(), rank0->params_flat(), rank0->param_count() * sizeof(float));
    s.copy(rank1->buffers_flat(), rank0->buffers_flat(), rank0->buffers_bytes());
    float losses[2];
    Model* ranks[2] = {rank0.get(), rank1.get()};
    for (int r = 0; r < 2; ++r) {
      s.copy(x.data(), d.x.data() + static_cast<std::size_t>(r * per_rank) * 784, x.size());
      s.copy(y.data(), d.y.data() + r * per_rank, y.size());
      const float* out = ranks[r]->forward(s, x.as<float>(), per_rank, Mode::train);
      s.copy(&losses[r], loss.forward(s, out, y.as<std::int64_t>(), per_rank, 10), sizeof(float));
      loss.backward(s, out, y.as<std::int64_t>(), per_rank, 10, dlogits.as<float>(), per_rank);
      ranks[r]->zero_grad(s);
      ranks[r]->backward(s, dlogits.as<float>());
    }
    // The mean over ranks: each gradient scaled by 1/world, then summed (as DDP does before its SUM).
    const auto n = static_cast<kernels::index_t>(rank0->param_count());
    kernels::scale(s, n, 0.5f, rank0->grads_flat());
    kernels::axpy(s, n, 0.5f, rank1->grads_flat(), rank0->grads_flat());
    optimizer.step(s, rank0->params_flat(), rank0->grads_flat());
    s.synchronize();
    const float want = (losses[0] + losses[1]) / 2.0f;
    EXPECT_NEAR(got, want, 1e-6f * std::fabs(want));
  }
  ddp.synchronize();
  Stream ds = rt->device(0).create_stream();
  const auto got = state_dict(ddp.replica(0), ds), want = state_dict(*rank0, s);
  for (const auto& name : want.order) {
    if (want.at(name).dtype == "I64") {
      EXPECT_EQ(got.at(name).to_i64(), want.at(name).to_i64()) << name;
      continue;
    }
    const auto w = want.at(name).to_f32();
    float scale = 0.0f;
    for (float v : w) scale = std::max(scale, std::fabs(v));
    EXPECT_TRUE(test::all_close(got.at(name).to_f32(), w, 1e-5, 1e-6 * scale + 1e-7)) << name;
  }
}

TEST(Ddp, BadConfigurationIsAClearError) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_mlp(rt->device(1), {8});
  EXPECT_THROW(DistributedDataParallel(*rt, *model, SgdOptions{}), InvalidArgument) << "module not on rank 0";
  EngineOptions options;
  options.device_ids = std::vector<int>{1, 1};
  EXPECT_THROW(DistributedDataParallel(*rt, *model, SgdOptions{}, options), InvalidArgument);
  options.device_ids = std::vector<int>{1, 0};
  DistributedDataParallel ddp(*rt, *model, SgdOptions{}, options);
  const Data data = make_data(4, 1);
  EXPECT_THROW(ddp.train_step(shards(data, 0, 1, 2)), InvalidArgument) << "one batch for two ranks";
  auto zero = shards(data, 0, 2, 2);
  zero[1].size = 0;
  EXPECT_THROW(ddp.train_step(zero), InvalidArgument) << "batch 0";
  auto null = shards(data, 0, 2, 2);
  null[0].inputs = nullptr;
  EXPECT_THROW(ddp.train_step(null), InvalidArgument) << "null inputs";
}

}  // namespace
}  // namespace dp

namespace dp {
namespace {

// The golden's micro-batches per step (1: it did not accumulate).
int golden_accumulate(const safetensors::File& golden) {
  const auto it = golden.metadata.find("accumulate");
  return it == golden.metadata.end() ? 1 : std::stoi(it->second);
}

// The golden's clip_grad_norm_ max_norm (0: it did not clip).
double golden_clip(const safetensors::File& golden) {
  const auto it = golden.metadata.find("clip_max_norm");
  return it == golden.metadata.end() ? 0.0 : std::stod(it->second);
}

// The golden's torch.optim.SGD (dampening 0, no Nesterov).
SgdOptions golden_sgd(const safetensors::File& golden) {
  return {std::stof(golden.metadata.at("lr")), std::stof(golden.metadata.at("momentum")),
          std::stof(golden.metadata.at("weight_decay")), false};
}

// The total norm torch's clip_grad_norm_ returned at step k (the same tolerance as the losses: the
// gradients it sums come from other summation orders), where the golden clipped.
void expect_golden_norm(const safetensors::File& golden, int k, std::optional<float> got) {
  if (golden_clip(golden) == 0.0) {
    EXPECT_FALSE(got.has_value());
    return;
  }
  ASSERT_TRUE(got.has_value());
  const float want = golden.at(fmt::format("step{}.grad_norm", k)).to_f32()[0];
  EXPECT_GT(want, golden_clip(golden)) << "step " << k << " does not clip";
  EXPECT_NEAR(*got, want, 1e-5f * want) << "step " << k;
}

// Step k's loss (the mean over the ranks; the same tolerance reasoning as the final state) and,
// where the golden clipped, its norm.
void expect_golden_step(const safetensors::File& golden, int k, float loss, std::optional<float> norm) {
  const float want = golden.at(fmt::format("step{}.loss_avg", k)).to_f32()[0];
  EXPECT_NEAR(loss, want, 1e-5f * std::fabs(want) + 1e-6f) << "step " << k;
  expect_golden_norm(golden, k, norm);
}

// A DDP golden's batches, step after step: one per rank, as its DistributedSampler gave them.
class GoldenBatches {
 public:
  GoldenBatches(const safetensors::File& golden, int world)
      : x_(golden.at("data.input").to_f32()),
        y_(golden.at("data.target").to_i64()),
        cursor_(static_cast<std::size_t>(world), 0),
        xs_(cursor_.size()),
        ys_(cursor_.size()) {
    for (int r = 0; r < world; ++r) {
      indices_.push_back(golden.at(fmt::format("rank{}.indices", r)).to_i64());
      sizes_.push_back(golden.at(fmt::format("rank{}.batch_sizes", r)).to_i64());
    }
    if (const auto it = golden.metadata.find("accumulate"); it != golden.metadata.end())
      micro_ = static_cast<std::size_t>(std::stoi(it->second));
  }
  // The next step's batches (valid until the next call): with the golden's accumulation of K
  // micro-batches, each rank's K batches together, rank after rank (Engine::batches_per_step).
  std::vector<Batch> next() {
    std::vector<Batch> batches;
    xs_.assign(cursor_.size() * micro_, {});
    ys_.assign(cursor_.size() * micro_, {});
    for (std::size_t r = 0; r < cursor_.size(); ++r) {
      for (std::size_t m = 0; m < micro_; ++m) {
        const auto n = static_cast<std::size_t>(sizes_[r][batch_ + m]);
        auto& xs = xs_[r * micro_ + m];
        auto& ys = ys_[r * micro_ + m];
        for (std::size_t i = 0; i < n; ++i) {
          const auto index = static_cast<std::size_t>(indices_[r][cursor_[r] + i]);
          xs.insert(xs.end(), x_.begin() + static_cast<std::ptrdiff_t>(index * 784),
                    x_.begin() + static_cast<std::ptrdiff_t>((index + 1) * 784));
          ys.push_back(y_[index]);
        }
        cursor_[r] += n;
        batches.push_back(Batch{xs.data(), ys.data(), static_cast<int>(n)});
      }
    }
    batch_ += micro_;
    return batches;
  }

 private:
  std::vector<float> x_;
  std::vector<std::int64_t> y_;
  std::vector<std::vector<std::int64_t>> indices_, sizes_;
  std::vector<std::size_t> cursor_;
  std::vector<std::vector<float>> xs_;
  std::vector<std::vector<std::int64_t>> ys_;
  std::size_t micro_ = 1, batch_ = 0;
};

// gloo's ring adds in another order than dp's ring, and PyTorch's CPU convolution and BN sum in
// other orders than im2col + split reductions: values agree to ~1e-6 of each tensor's scale.
void expect_matches_golden(const safetensors::File& golden, const safetensors::File& got, const std::string& prefix,
                           bool buffers_too) {
  for (const auto& tensor_name : got.order) {
    const auto& g = got.at(tensor_name);
    const std::string key = prefix + tensor_name;
    if (!golden.has(key)) continue;
    const bool is_buffer =
        tensor_name.find("running_") != std::string::npos || tensor_name.find("num_batches") != std::string::npos;
    if (is_buffer && !buffers_too) continue;
    if (g.dtype == "I64") {
      EXPECT_EQ(g.to_i64(), golden.at(key).to_i64()) << key;
      continue;
    }
    const auto want = golden.at(key).to_f32();
    float scale = 0.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    EXPECT_TRUE(test::all_close(g.to_f32(), want, 1e-4, 1e-5 * scale + 1e-6)) << key;
  }
}

// torch DistributedDataParallel over gloo (tests/golden/make_ddp_goldens.py): DistributedSampler
// shards with the padded tail, per-rank BN statistics, rank 0's buffers, an uneven last batch.
class DdpGolden : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(DdpGolden, MatchesPyTorchDistributedDataParallel) {
  const auto& [name, broadcast_buffers] = GetParam();
  const auto golden = safetensors::read(test::golden_path(name));
  const int world = std::stoi(golden.metadata.at("world_size"));
  const int steps = std::stoi(golden.metadata.at("steps"));
  auto rt = test::sim_runtime(world);
  auto model = test::golden_model(golden, rt->device(0));
  Stream s = rt->device(0).create_stream();
  load_state_dict(*model, s, golden, "init.");
  const SgdOptions sgd = golden_sgd(golden);
  EngineOptions options;
  options.broadcast_buffers = broadcast_buffers;
  options.check_replicas = true;
  options.step.clip_grad_norm = golden_clip(golden);
  options.accumulate = golden_accumulate(golden);
  DistributedDataParallel ddp(*rt, *model, sgd, options);

  GoldenBatches data(golden, world);
  for (int k = 0; k < steps; ++k) {
    SCOPED_TRACE(fmt::format("step {}", k));
    const std::vector<Batch> batches = data.next();
    const float loss = ddp.train_step(batches);
    expect_golden_step(golden, k, loss, ddp.last_grad_norm());
  }
  auto check = [&](const safetensors::File& got, const std::string& prefix, bool buffers_too) {
    expect_matches_golden(golden, got, prefix, buffers_too);
  };
  ddp.synchronize();
  check(state_dict(ddp.replica(0), s), "final.", true);
  for (int r = 1; r < world; ++r) {
    Stream rs = rt->device(r).create_stream();
    // Without buffer broadcast each rank keeps its own BN statistics, as in the golden run.
    check(state_dict(ddp.replica(r), rs), fmt::format("final_rank{}.", r), !broadcast_buffers);
  }
}

INSTANTIATE_TEST_SUITE_P(
    PyTorch, DdpGolden,
    ::testing::Values(
        std::tuple{std::string("ddp_convnet_w3"), true}, std::tuple{std::string("ddp_convnet_w3"), false},
        std::tuple{std::string("ddp_mlp_w2"), true}, std::tuple{std::string("ddp_resnet8_w2"), true},
        std::tuple{std::string("ddp_resnet8_w2"), false}, std::tuple{std::string("ddp_mlp_w2_clip"), true},
        std::tuple{std::string("ddp_convnet_w3_clip"), false}, std::tuple{std::string("ddp_mlp_w2_acc3"), true},
        std::tuple{std::string("ddp_convnet_w3_acc3"), false}, std::tuple{std::string("ddp_convnet_w3_acc3"), true}),
    [](const auto& info) { return std::get<0>(info.param) + (std::get<1>(info.param) ? "_broadcast" : "_local"); });

}  // namespace
}  // namespace dp

namespace dp {
namespace {

// Fixed shards (EngineOptions::shards = R) are DataParallel over R devices, which is what torch's
// DDP over R ranks without buffer broadcast computes (each rank's BatchNorm over its own batch,
// rank 0's running statistics, the mean of the ranks' gradients): every kind, on every device
// count (those that do not divide R with uneven_shards), matches the golden, and all of them give
// the same bits.
class ShardsGolden : public ::testing::TestWithParam<std::string> {};

// The golden's parameters and buffers as floats, by name (its step counters left out).
std::vector<std::pair<std::string, std::vector<float>>> float_tensors(const safetensors::File& state) {
  std::vector<std::pair<std::string, std::vector<float>>> values;
  for (const auto& name : state.order)
    if (state.at(name).dtype != "I64") values.emplace_back(name, state.at(name).to_f32());
  return values;
}

void expect_same_bits(const std::vector<std::pair<std::string, std::vector<float>>>& got,
                      const std::vector<std::pair<std::string, std::vector<float>>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t t = 0; t < got.size(); ++t)
    EXPECT_EQ(0, std::memcmp(got[t].second.data(), want[t].second.data(), got[t].second.size() * sizeof(float)))
        << got[t].first << " differs from the single-device run's bits";
}

TEST_P(ShardsGolden, EveryKindOnEveryDeviceCountIsTorchDdpOverTheShardsBitForBit) {
  const auto golden = safetensors::read(test::golden_path(GetParam()));
  const int shards = std::stoi(golden.metadata.at("world_size"));
  const int steps = std::stoi(golden.metadata.at("steps"));
  const SgdOptions sgd = golden_sgd(golden);
  std::vector<std::pair<EngineKind, int>> runs = {{EngineKind::single, 1}};
  for (const EngineKind kind : {EngineKind::dp, EngineKind::ddp})
    for (int devices = 1; devices <= shards; ++devices) runs.emplace_back(kind, devices);
  std::vector<std::pair<std::string, std::vector<float>>> first;
  for (const auto& [kind, devices] : runs) {
    SCOPED_TRACE(fmt::format("{} on {} device(s)", to_string(kind), devices));
    auto rt = test::sim_runtime(devices);
    auto model = test::golden_model(golden, rt->device(0));
    Stream s = rt->device(0).create_stream();
    load_state_dict(*model, s, golden, "init.");
    EngineOptions options;
    options.kind = kind;
    options.shards = shards;
    options.uneven_shards = shards % devices != 0;
    options.graphs = true;
    options.step.clip_grad_norm = golden_clip(golden);
    auto engine = make_engine(*rt, *model, sgd, options);
    EXPECT_EQ(engine->kind(), kind);
    EXPECT_EQ(engine->name(), "fixed shards") << "--shards builds the fixed-shards engine, for every kind";
    EXPECT_EQ(engine->world_size(), shards);
    ASSERT_EQ(engine->batches_per_step(), shards);
    GoldenBatches data(golden, shards);
    for (int k = 0; k < steps; ++k) {
      const float loss = engine->train_step(data.next());
      expect_golden_step(golden, k, loss, engine->last_grad_norm());
    }
    engine->synchronize();
    const auto got = state_dict(engine->model(), s);
    expect_matches_golden(golden, got, "final.", true);
    if (first.empty()) first = float_tensors(got);
    expect_same_bits(float_tensors(got), first);
  }
  // A device lost before step 1 (Device::lose: every call on it fails from then on): the step fails
  // with DeviceLost, a survivor holds the state of step 1 whole, and an engine on the survivors
  // (uneven where they do not divide the shards) goes on from it with the failed step's batches
  // to the same bits.
  for (const bool graphs : {true, false}) {
    SCOPED_TRACE(fmt::format("device 1 of {} lost, graphs {}", shards, graphs));
    auto rt = test::sim_runtime(shards);
    auto model = test::golden_model(golden, rt->device(0));
    load_state_dict(*model, rt->device(0).create_stream(), golden, "init.");
    EngineOptions options;
    options.kind = EngineKind::ddp;
    options.shards = shards;
    options.graphs = graphs;
    options.step.clip_grad_norm = golden_clip(golden);
    auto engine = make_engine(*rt, *model, sgd, options);
    GoldenBatches data(golden, shards);
    (void)engine->train_step(data.next());
    rt->device(1).lose("the test's");
    const auto batches = data.next();
    EXPECT_THROW((void)engine->train_step(batches), Error);
    const auto survivor = engine->survivor();
    ASSERT_TRUE(survivor.has_value());
    EXPECT_EQ(survivor->steps, 1);
    EXPECT_NE(survivor->device, 1);
    std::optional<Survivors> survivors = go_on_without_lost(
        *rt, std::move(engine), [&](Device& device) { return test::golden_model(golden, device); }, sgd, options);
    ASSERT_TRUE(survivors.has_value());
    std::vector<int> expected;
    for (int d = 0; d < shards; ++d)
      if (d != 1) expected.push_back(d);
    EXPECT_EQ(survivors->devices, expected);
    EXPECT_EQ(survivors->steps, 1);
    auto& on = survivors->engine;
    EXPECT_EQ(on->optimizers().front()->steps(), 1);
    for (int k = 1; k < steps; ++k) {
      const float loss = on->train_step(k == 1 ? batches : data.next());  // the failed step's batches first
      expect_golden_step(golden, k, loss, on->last_grad_norm());
    }
    on->synchronize();
    expect_same_bits(float_tensors(state_dict(on->model(), rt->device(0).create_stream())), first);
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, ShardsGolden,
                         ::testing::Values("ddp_convnet_w3", "ddp_mlp_w2", "ddp_resnet8_w2", "ddp_mlp_w2_clip",
                                           "ddp_convnet_w3_clip"),
                         [](const auto& info) { return info.param; });

// DataParallel over R devices, fed the ranks' batches one after another as its global batch (so
// chunk r is rank r's batch, with its own BatchNorm statistics), is torch's DDP over R ranks
// without buffer broadcast; and for a model without BatchNorm so is one device on that batch.
// With clip_grad_norm_, graphs on: the norms and the clipped run as torch's.
class DataParallelGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelGolden, DataParallelAndOneDeviceMatchPyTorch) {
  const auto golden = safetensors::read(test::golden_path(GetParam()));
  const int world = std::stoi(golden.metadata.at("world_size"));
  const int steps = std::stoi(golden.metadata.at("steps"));
  const SgdOptions sgd = golden_sgd(golden);
  const bool batchnorm = golden.metadata.at("model") != "mlp";
  for (const EngineKind kind : {EngineKind::dp, EngineKind::single}) {
    if (kind == EngineKind::single && batchnorm) continue;  // one device's statistics are the whole batch's
    SCOPED_TRACE(to_string(kind));
    auto rt = test::sim_runtime(world);
    auto model = test::golden_model(golden, rt->device(0));
    Stream s = rt->device(0).create_stream();
    load_state_dict(*model, s, golden, "init.");
    EngineOptions options;
    options.kind = kind;
    options.graphs = true;
    options.step.clip_grad_norm = golden_clip(golden);
    const int micro = golden_accumulate(golden);
    options.accumulate = micro;
    auto engine = make_engine(*rt, *model, sgd, options);
    GoldenBatches data(golden, world);
    std::vector<std::vector<float>> x(static_cast<std::size_t>(micro));
    std::vector<std::vector<std::int64_t>> y(static_cast<std::size_t>(micro));
    for (int k = 0; k < steps; ++k) {
      // Micro-batch m's global batch: the ranks' m-th batches, rank after rank.
      const std::vector<Batch> ranks = data.next();
      std::vector<Batch> globals;
      for (int m = 0; m < micro; ++m) {
        auto& xm = x[static_cast<std::size_t>(m)];
        auto& ym = y[static_cast<std::size_t>(m)];
        xm.clear();
        ym.clear();
        int size = 0;
        for (int r = 0; r < world; ++r) {
          const Batch& b = ranks[static_cast<std::size_t>(r * micro + m)];
          xm.insert(xm.end(), b.inputs.features(), b.inputs.features() + static_cast<std::ptrdiff_t>(b.size) * 784);
          ym.insert(ym.end(), b.targets, b.targets + b.size);
          size += b.size;
        }
        globals.push_back(Batch{xm.data(), ym.data(), size});
      }
      const float loss = engine->train_step(globals);
      expect_golden_step(golden, k, loss, engine->last_grad_norm());
    }
    engine->synchronize();
    expect_matches_golden(golden, state_dict(engine->model(), s), "final.", true);
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, DataParallelGolden,
                         ::testing::Values("ddp_convnet_w3", "ddp_mlp_w2", "ddp_mlp_w2_clip", "ddp_convnet_w3_clip",
                                           "ddp_mlp_w2_acc3", "ddp_convnet_w3_acc3"),
                         [](const auto& info) { return info.param; });

// What fixed shards cannot be combined with, or spread over, is refused naming it.
TEST(Shards, RefusalsNameTheProblem) {
  auto rt = test::sim_runtime(4);
  auto model = models::make_mlp(rt->device(0), {16});
  const SgdOptions sgd{0.1f, 0.0f, 0.0f, false};
  const auto refusal = [&](EngineOptions options) -> std::string {
    try {
      make_engine(*rt, *model, sgd, options);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "(accepted)";
  };
  EngineOptions options;
  options.kind = EngineKind::ddp;
  options.shards = 6;
  options.device_ids = std::vector<int>{0, 1, 2, 3};
  EXPECT_NE(refusal(options).find("6 shards cannot be spread evenly over 4 device(s)"), std::string::npos)
      << refusal(options);
  options.shards = 3;
  options.uneven_shards = true;  // uneven shares, but not none
  EXPECT_NE(refusal(options).find("3 shards leave some of 4 devices none"), std::string::npos) << refusal(options);
  options.uneven_shards = false;
  options.shards = 4;
  options.grad_reduce = GradReduce::bf16;
  EXPECT_NE(refusal(options).find("a bf16 gradient all-reduce cannot be used with shards"), std::string::npos);
  options.grad_reduce = GradReduce::fp32;
  options.sync_batchnorm = true;
  options.shards = 8;  // SyncBatchNorm needs a replica per shard
  EXPECT_NE(refusal(options).find("sync_batchnorm with 8 shards needs a device per shard, not 4"), std::string::npos)
      << refusal(options);
  options.kind = EngineKind::single;
  EXPECT_NE(refusal(options).find("sync_batchnorm applies to ddp and dp (a device per shard), not single"),
            std::string::npos)
      << refusal(options);
  options.kind = EngineKind::ddp;
  options.shards = 4;
  options.sync_batchnorm = false;
  options.kind = EngineKind::dp;
  options.output_device = 1;
  EXPECT_NE(refusal(options).find("output_device cannot be used with shards"), std::string::npos);
  options.output_device.reset();
  options.shards = -1;
  EXPECT_NE(refusal(options).find("shards must be 0 (off) or positive"), std::string::npos);
  options.shards = 4;
  auto engine = make_engine(*rt, *model, sgd, options);
  std::vector<float> x(4 * 784, 0.5f);
  std::vector<std::int64_t> y = {1, 2, 3, 4};
  std::vector<Batch> uneven;
  for (int i = 0; i < 4; ++i) uneven.push_back(Batch{x.data(), y.data(), i == 3 ? 1 : 2});
  EXPECT_THROW(engine->train_step(uneven), InvalidArgument) << "shards of a step must be the same size";
  uneven.pop_back();
  EXPECT_THROW(engine->train_step(uneven), InvalidArgument) << "a batch per shard";
}

}  // namespace
}  // namespace dp
