// test_data_parallel.cpp — the device group and DataParallel on 1-4 simulated devices: equality
// with single-device training (MLP), with the per-chunk semantics of torch.nn.DataParallel
// computed by a reference made of single-device pieces (ConvNet), exact traffic counters, errors.
#include <atomic>
#include <chrono>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <set>
#include <thread>

#include "dp/engines/data_parallel.h"
#include "dp/engines/trainer.h"
#include "dp/io/checkpoint.h"
#include "dp/kernels/ops.h"
#include "dp/kernels/optimizer.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/nn/loss.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

std::vector<float> host_floats(const Stream& s, const float* p, std::size_t n) {
  std::vector<float> out(n);
  s.copy(out.data(), p, n * sizeof(float));
  return out;
}

struct Batch {
  std::vector<float> x;
  std::vector<std::int64_t> y;
};
Batch make_batch(int batch, unsigned seed) {
  Batch b{test::random_vector(static_cast<std::size_t>(batch) * 784, seed, 0.0f, 1.0f), {}};
  for (int i = 0; i < batch; ++i) b.y.push_back((i * 3 + static_cast<int>(seed)) % 10);
  return b;
}

// ---------------------------------------------------------------------------------------------
// device group

TEST(DeviceGroup, RunsEachRankOnItsPersistentWorker) {
  auto rt = test::sim_runtime(3);
  DeviceGroup group(*rt, {2, 0, 1});
  std::vector<std::thread::id> first(3), second(3);
  group.run([&](int rank) { first[static_cast<std::size_t>(rank)] = std::this_thread::get_id(); });
  group.run([&](int rank) { second[static_cast<std::size_t>(rank)] = std::this_thread::get_id(); });
  EXPECT_EQ(first, second) << "no thread is spawned per step";
  EXPECT_EQ(std::set<std::thread::id>(first.begin(), first.end()).size(), 3u);
  EXPECT_EQ(group.device(0).index(), 2);
}

TEST(DeviceGroup, AFailureNamesTheDeviceAndLeavesTheGroupUsable) {
  auto rt = test::sim_runtime(3);
  DeviceGroup group(*rt, {0, 1, 2});
  std::atomic<int> finished{0};
  try {
    group.run([&](int rank) {
      if (rank == 1) throw OutOfMemory(1, 1024, 0, 512);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ++finished;
    });
    FAIL() << "error swallowed";
  } catch (const WorkerError& e) {
    EXPECT_EQ(e.device(), 1);
    EXPECT_NE(std::string(e.what()).find("device 1: out of memory on device 1"), std::string::npos) << e.what();
    EXPECT_THROW(std::rethrow_exception(e.cause()), OutOfMemory) << "the original error is kept";
  }
  EXPECT_EQ(finished.load(), 2) << "the other workers ran to completion";
  std::atomic<int> again{0};
  group.run([&](int) { ++again; });
  EXPECT_EQ(again.load(), 3) << "the group stays usable";
  // Two failures: reported once, for the lowest rank, with the count.
  try {
    group.run([](int rank) {
      if (rank > 0) throw Error(fmt::format("boom {}", rank));
    });
  } catch (const WorkerError& e) {
    EXPECT_EQ(e.device(), 1);
    EXPECT_EQ(e.failed_devices(), 2);
    EXPECT_NE(std::string(e.what()).find("and 1 more"), std::string::npos);
  }
}

TEST(DeviceGroup, RejectsBadDeviceLists) {
  auto rt = test::sim_runtime(2);
  EXPECT_THROW(DeviceGroup(*rt, {}), InvalidArgument);
  try {
    DeviceGroup(*rt, {1, 1});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("device 1 twice"), std::string::npos) << e.what();
  }
  try {
    DeviceGroup(*rt, {0, 2});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("device 2, but the sim backend has 2"), std::string::npos) << e.what();
  }
}

TEST(DataParallel, ChunkSizesFollowTorchChunk) {
  EXPECT_EQ(chunk_sizes(37, 3), (std::vector<int>{13, 13, 11}));
  EXPECT_EQ(chunk_sizes(2, 4), (std::vector<int>{1, 1}));
  EXPECT_EQ(chunk_sizes(10, 4), (std::vector<int>{3, 3, 3, 1}));
  EXPECT_EQ(chunk_sizes(9, 4), (std::vector<int>{3, 3, 3}));  // torch.chunk gives 3 chunks, not 4
  EXPECT_EQ(chunk_sizes(64, 1), (std::vector<int>{64}));
  EXPECT_THROW(chunk_sizes(0, 2), InvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// MLP: DP over N devices == one device on the global batch

// On sim and cuda with 1-4 devices (cuda: several on one GPU where there are fewer GPUs; skipped
// without one).
class DataParallelOnBackend : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Backends, DataParallelOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(DataParallelOnBackend, MlpEqualsSingleDeviceOnTheGlobalBatch) {
  const bool sim = GetParam() == "sim";
  if (!sim && Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: DataParallel on GPUs needs one";
  const int max_devices = 4;  // on cuda several per GPU where there are fewer GPUs
  auto rt = sim ? test::sim_runtime(max_devices) : test::cuda_runtime(max_devices);
  const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};
  for (int devices = 1; devices <= max_devices; ++devices) {
    SCOPED_TRACE(fmt::format("{} devices", devices));
    auto model = models::make_mlp(rt->device(0), {64, 32}, 5);
    auto reference = models::make_mlp(rt->device(0), {64, 32}, 5);
    EngineOptions options;
    options.device_ids = std::vector<int>(static_cast<std::size_t>(devices));
    for (int d = 0; d < devices; ++d) (*options.device_ids)[static_cast<std::size_t>(d)] = d;
    DataParallel dp(*rt, *model, sgd, options);
    SingleDeviceTrainer single(*reference, sgd);
    for (int step = 0; step < 4; ++step) {
      const Batch b = make_batch(30 + step, 100 + step);  // 30..33 rows: uneven chunks for 4 devices
      const float dp_loss = dp.train_step(b.x.data(), b.y.data(), static_cast<int>(b.y.size()));
      const float ref_loss = single.train_step(b.x.data(), b.y.data(), static_cast<int>(b.y.size()));
      // On sim the logits are per-row identical (OpenBLAS computes each row alike whatever the
      // batch) and the loss is a mean over the same rows; cuBLAS may pick other kernels per shape.
      EXPECT_NEAR(dp_loss, ref_loss, (sim ? 1e-6f : 1e-5f) * std::fabs(ref_loss));
    }
    dp.synchronize();
    Stream s = rt->device(0).create_stream();
    // Gradients differ only in summation order (per-chunk partial sums added on the source vs one
    // GEMM over the batch): ~1e-7 relative per step, compounded over 4 momentum steps at lr 0.05.
    EXPECT_TRUE(test::all_close(host_floats(s, model->params_flat(), model->param_count()),
                                host_floats(s, reference->params_flat(), reference->param_count()), 1e-5, 1e-6));
  }
}

// On one device, DataParallel is the module's own step (torch calls the module directly): the
// single-device trainer's results bit for bit — ConvNet with BatchNorm, the MLP with dropout —
// and its phase times still come (the empty phases as two adjacent events).
TEST(DataParallel, OnOneDeviceIsTheSingleDeviceStepBitForBit) {
  auto rt = test::sim_runtime(1);
  for (const std::string name : {"convnet", "mlp"}) {
    SCOPED_TRACE(name);
    const auto make = [&] {
      return name == "convnet" ? models::make_convnet(rt->device(0), 3) : models::make_mlp(rt->device(0), {32}, 3, 0.3);
    };
    auto model = make();
    auto reference = make();
    const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};
    EngineOptions options;
    options.time_phases = true;
    options.step.seed = 11;
    DataParallel dp(*rt, *model, sgd, options);
    SingleDeviceTrainer single(*reference, sgd, StepOptions{0.0, 11});
    for (int step = 0; step < 3; ++step) {
      const Batch b = make_batch(9 + step, 40 + step);
      const float got = dp.train_step(b.x.data(), b.y.data(), static_cast<int>(b.y.size()));
      const float want = single.train_step(b.x.data(), b.y.data(), static_cast<int>(b.y.size()));
      EXPECT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << got << " vs " << want;
      EXPECT_NO_THROW(dp.last_phases());
      EXPECT_EQ(dp.last_chunks(), std::vector<int>{static_cast<int>(b.y.size())});
    }
    dp.synchronize();
    Stream s = rt->device(0).create_stream();
    const auto a = host_floats(s, model->params_flat(), model->param_count());
    const auto r = host_floats(s, reference->params_flat(), reference->param_count());
    EXPECT_EQ(std::memcmp(a.data(), r.data(), a.size() * sizeof(float)), 0);
    if (model->buffers_bytes()) {
      std::vector<char> x(model->buffers_bytes()), y(model->buffers_bytes());
      s.copy(x.data(), model->buffers_flat(), x.size());
      s.copy(y.data(), reference->buffers_flat(), y.size());
      EXPECT_EQ(x, y) << "running statistics";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// ConvNet: DP == per-chunk semantics, computed with single-device pieces on one device

// torch.nn.DataParallel, spelled out: chunk replicas with a copy of the master's parameters and
// buffers, BN statistics per chunk, the loss over the gathered batch, gradients summed onto the
// master (master first, then replicas in order), only the master's running stats kept.
void reference_dp_step(Model& master, const std::vector<int>& chunks, const Batch& b, Optimizer& sgd, float* loss_out) {
  Device& device = master.device();
  Stream s = device.create_stream();
  const int batch = static_cast<int>(b.y.size());
  DeviceBuffer x = test::upload(device, s, b.x), y = test::upload(device, s, b.y);
  DeviceBuffer logits = device.allocate(static_cast<std::size_t>(batch) * 10 * sizeof(float));
  DeviceBuffer dlogits = device.allocate(static_cast<std::size_t>(batch) * 10 * sizeof(float));
  std::vector<std::unique_ptr<Model>> replicas;
  std::vector<Model*> models;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (c == 0) {
      models.push_back(&master);
      continue;
    }
    replicas.push_back(master.replicate(device));
    s.copy(replicas.back()->params_flat(), master.params_flat(), master.param_count() * sizeof(float));
    s.copy(replicas.back()->buffers_flat(), master.buffers_flat(), master.buffers_bytes());
    models.push_back(replicas.back().get());
  }
  int offset = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const float* out = models[c]->forward(s, x.as<float>() + offset * 784, chunks[c], Mode::train);
    s.copy(logits.as<float>() + offset * 10, out, static_cast<std::size_t>(chunks[c]) * 10 * sizeof(float));
    offset += chunks[c];
  }
  CrossEntropyLoss loss(device);
  const float* l = loss.forward(s, logits.as<float>(), y.as<std::int64_t>(), batch, 10);
  s.copy(loss_out, l, sizeof(float));
  loss.backward(s, logits.as<float>(), y.as<std::int64_t>(), batch, 10, dlogits.as<float>(), batch);
  offset = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    models[c]->zero_grad(s);
    models[c]->backward(s, dlogits.as<float>() + offset * 10);
    offset += chunks[c];
  }
  for (std::size_t c = 1; c < chunks.size(); ++c)
    kernels::axpy(s, static_cast<kernels::index_t>(master.param_count()), 1.0f, models[c]->grads_flat(),
                  master.grads_flat());
  sgd.step(s, master.params_flat(), master.grads_flat());
  s.synchronize();
}

struct DpCase {
  int devices;
  std::vector<int> device_ids;
  int output_device;
  std::vector<int> batches;
};

using ModelFactory = std::unique_ptr<Model> (*)(Device&, std::uint64_t);

// DP of `make` (a model with BatchNorm) against the per-chunk reference, bit for bit.
void expect_per_chunk_semantics(const DpCase& c, ModelFactory make, const std::string& bn_buffer) {
  const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};
  auto rt = test::sim_runtime(c.devices);
  auto ref_rt = test::sim_runtime(1);
  auto model = make(rt->device(c.device_ids[0]), 9);
  auto master = make(ref_rt->device(0), 9);
  EngineOptions options;
  options.device_ids = c.device_ids;
  options.output_device = c.output_device;
  DataParallel dp(*rt, *model, sgd, options);
  Sgd ref_sgd(ref_rt->device(0), master->param_count(), sgd);
  for (std::size_t step = 0; step < c.batches.size(); ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const Batch b = make_batch(c.batches[step], 40 + static_cast<unsigned>(step));
    const int batch = static_cast<int>(b.y.size());
    const float got = dp.train_step(b.x.data(), b.y.data(), batch);
    float want = 0.0f;
    reference_dp_step(*master, chunk_sizes(batch, static_cast<int>(c.device_ids.size())), b, ref_sgd, &want);
    // The same kernels on the same chunk shapes, the same summation order: bit-identical.
    EXPECT_EQ(got, want);
  }
  dp.synchronize();
  Stream s = model->device().create_stream(), rs = ref_rt->device(0).create_stream();
  const auto got = state_dict(*model, s), want = state_dict(*master, rs);
  for (const auto& name : want.order) {
    EXPECT_EQ(got.at(name).data, want.at(name).data) << name << " differs";
  }
  const auto tracked = got.at(bn_buffer).to_i64();
  EXPECT_EQ(tracked[0], static_cast<std::int64_t>(c.batches.size())) << "only the source replica's update persists";
}

class ConvNetDataParallel : public ::testing::TestWithParam<DpCase> {};

TEST_P(ConvNetDataParallel, MatchesPerChunkSemanticsExactly) {
  expect_per_chunk_semantics(
      GetParam(), [](Device& d, std::uint64_t seed) { return models::make_convnet(d, seed); },
      "layer1.1.num_batches_tracked");
}

// ResNet-8's residual blocks through DP: every BatchNorm (the blocks' and their downsample's) takes
// per-chunk statistics, as torch.nn.DataParallel's replicas do.
TEST(DataParallel, ResNet8MatchesPerChunkSemanticsExactly) {
  expect_per_chunk_semantics(
      DpCase{3, {0, 1, 2}, 1, {11, 7}}, [](Device& d, std::uint64_t seed) { return models::make_resnet8(d, seed); },
      "layer2.0.downsample.1.num_batches_tracked");
}

INSTANTIATE_TEST_SUITE_P(Configurations, ConvNetDataParallel,
                         ::testing::Values(DpCase{3, {0, 1, 2}, 0, {37, 37, 12}}, DpCase{4, {0, 1, 2, 3}, 0, {2, 5}},
                                           DpCase{3, {0, 1, 2}, 2, {37, 20}}, DpCase{3, {2, 0, 1}, 1, {37, 9}},
                                           DpCase{1, {0}, 0, {7, 7}}),
                         [](const auto& info) {
                           const DpCase& c = info.param;
                           return fmt::format("devices{}_ids{}_out{}", c.devices, fmt::join(c.device_ids, ""),
                                              c.output_device);
                         });

// ---------------------------------------------------------------------------------------------
// traffic

TEST(DataParallel, TrafficCountersEqualTheAnalyticValues) {
  auto rt = test::sim_runtime(3);
  auto model = models::make_convnet(rt->device(1), 2);
  EngineOptions options;
  options.device_ids = std::vector<int>{1, 2, 0};
  options.output_device = 2;
  DataParallel dp(*rt, *model, SgdOptions{0.01f, 0.9f, 0.0f, false}, options);
  const Batch b = make_batch(10, 7);  // chunks 4, 4, 2 on devices 1, 2, 0
  rt->reset_link_traffic();
  dp.train_step(b.x.data(), b.y.data(), 10);
  const std::uint64_t params = model->param_count() * 4, buffers = model->buffers_bytes();
  const std::uint64_t in_row = 784 * 4, out_row = 10 * 4;
  // broadcast: source 1 -> 2 and 1 -> 0; reduce: 2 -> 1 and 0 -> 1 (gradients)
  // gather onto output device 2: rows of device 1 and device 0; scatter of dlogits back: 2 -> 1, 2 -> 0
  EXPECT_EQ(rt->link_traffic(1, 2).bytes, params + buffers + 4 * out_row);
  EXPECT_EQ(rt->link_traffic(1, 0).bytes, params + buffers);
  EXPECT_EQ(rt->link_traffic(2, 1).bytes, params + 4 * out_row);
  EXPECT_EQ(rt->link_traffic(0, 1).bytes, params);
  EXPECT_EQ(rt->link_traffic(0, 2).bytes, 2 * out_row);
  EXPECT_EQ(rt->link_traffic(2, 0).bytes, 2 * out_row);
  // The source's chunk and the optimizer's per-step values (lr, first step: two floats).
  EXPECT_EQ(rt->link_traffic(kHost, 1).bytes, 4 * in_row + sizeof(kernels::SgdScalars));
  EXPECT_EQ(rt->link_traffic(kHost, 2).bytes, 4 * in_row + 10 * 8);  // its chunk and all targets
  EXPECT_EQ(rt->link_traffic(kHost, 0).bytes, 2 * in_row);
  EXPECT_EQ(rt->link_traffic(2, kHost).bytes, 4u) << "the loss";
  // The source sends and receives the most: DP's imbalance.
  EXPECT_GT(rt->bytes_received(1), rt->bytes_received(0));
  EXPECT_GT(rt->bytes_sent(1), rt->bytes_sent(0));
}

TEST(DataParallel, PhaseTimesAreRecordedWhenAskedFor) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_convnet(rt->device(0), 4);
  EngineOptions options;
  options.time_phases = true;
  DataParallel dp(*rt, *model, SgdOptions{0.01f}, options);
  const Batch b = make_batch(16, 3);
  const auto t0 = std::chrono::steady_clock::now();
  dp.train_step(b.x.data(), b.y.data(), 16);
  const auto phases = dp.last_phases();
  const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // Forward and backward of a ConvNet chunk do real work; no phase can exceed the whole step.
  EXPECT_GT(phases.forward, 0.0);
  EXPECT_GT(phases.backward, 0.0);
  for (double t : {phases.broadcast, phases.scatter, phases.forward, phases.gather, phases.loss, phases.backward,
                   phases.reduce, phases.update}) {
    EXPECT_GE(t, 0.0);
    EXPECT_LE(t, wall);
  }
  DataParallel untimed(*rt, *model, SgdOptions{0.01f});
  EXPECT_THROW(untimed.last_phases(), InvalidArgument);
}

TEST(DataParallel, EvalForwardEqualsTheModule) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_convnet(rt->device(0), 4);
  DataParallel dp(*rt, *model, SgdOptions{});
  const Batch b = make_batch(9, 3);
  const auto got = dp.predict(b.x.data(), 9);
  SingleDeviceTrainer single(*model, SgdOptions{});
  // Eval BN uses running stats, so chunking changes no value; only the conv GEMM's blocking over
  // 9 vs 5/4 images may round differently (a few ulps).
  EXPECT_TRUE(test::all_close(got, single.predict(b.x.data(), 9), 1e-5, 1e-6));
}

TEST(DataParallel, BadConfigurationIsAClearError) {
  auto rt = test::sim_runtime(3);
  auto model = models::make_mlp(rt->device(0), {8});
  auto expect_error = [&](EngineOptions options, const std::string& text) {
    try {
      DataParallel dp(*rt, *model, SgdOptions{}, options);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error({.device_ids = std::vector<int>{}}, "device_ids is empty");
  expect_error({.device_ids = std::vector<int>{0, 1, 0}}, "device 0 twice");
  expect_error({.device_ids = std::vector<int>{0, 1}, .output_device = 2},
               "output_device 2 is not one of device_ids [0, 1]");
  expect_error({.device_ids = std::vector<int>{1, 0}}, "module must have its parameters and buffers on device_ids[0]");
  expect_error({.sync_batchnorm = true}, "sync_batchnorm applies to ddp, not dp");
  DataParallel dp(*rt, *model, SgdOptions{});
  const Batch b = make_batch(1, 1);
  EXPECT_THROW(dp.train_step(b.x.data(), b.y.data(), 0), InvalidArgument) << "batch 0";
}

}  // namespace
}  // namespace dp
