// test_engine_graphs.cpp — training steps captured once and replayed (EngineOptions::graphs): every
// engine's losses, parameters and buffers equal its eager run bit for bit, through batch-size changes
// and a learning rate that changes every step, Dropout's masks included; a steady-state replay costs
// one launch, no allocation, no pageable copy and one host synchronisation; models a graph cannot
// hold run eagerly.
#include <atomic>
#include <cstring>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <memory>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"
#include "forwarding_model.h"
#include "test_util.h"

namespace dp {
namespace {

struct TrainRun {
  std::vector<float> losses;
  std::vector<float> params;
  std::vector<unsigned char> buffers;
  std::uint64_t replays = 0;
  std::int64_t optimizer_steps = 0;
};

enum class Net { mlp, convnet, mlp_dropout, mlp_syncing };

// An MLP that claims to be capturable but synchronises its stream in every forward: something a
// graph cannot hold (CaptureError), which the engines must survive by running that step eagerly.
class SyncingModel final : public test::ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  const float* forward(const Stream& stream, Inputs input, int batch, Mode mode) override {
    if (stream.capturing()) ++captured_forwards;
    stream.synchronize();
    return ForwardingModel::forward(stream, input, batch, mode);
  }
  bool capturable() const override { return true; }
  std::unique_ptr<Model> replicate(Device& device) const override {
    return std::make_unique<SyncingModel>(inner().replicate(device));
  }
  static inline std::atomic<int> captured_forwards{0};  // forwards issued into a capture
};

std::unique_ptr<Model> make_net(Net net, Device& device) {
  switch (net) {
    case Net::mlp: return models::make_mlp(device, {32, 16}, 3);
    case Net::convnet: return models::make_convnet(device, 3);
    case Net::mlp_dropout: return models::make_mlp(device, {32, 16}, 3, 0.25);
    case Net::mlp_syncing: return std::make_unique<SyncingModel>(models::make_mlp(device, {32, 16}, 3));
  }
  return nullptr;
}

// Trains `sizes.size()` steps of the given per-rank batch sizes, the lr changing at every step (a
// warm-up), and returns what the run produced.
TrainRun train(EngineKind kind, int devices, bool graphs, Net net, const OptimizerOptions& optimizer,
               const std::vector<int>& sizes, int predict_after = -1, int predict_batch = 0, bool cuda = false) {
  // cuda: several devices on one GPU where there are fewer GPUs (DDP's collectives on the device ring).
  auto runtime = cuda ? test::cuda_runtime(devices) : test::sim_runtime(devices);
  auto model = make_net(net, runtime->device(0));
  EngineOptions options;
  options.kind = kind;
  options.graphs = graphs;
  options.step.seed = 11;
  if (kind == EngineKind::single) options.device_ids = std::vector<int>{0};
  auto engine = make_engine(*runtime, *model, optimizer, options);
  const auto floats = static_cast<std::size_t>(numel(model->input_shape()));
  TrainRun run;
  for (std::size_t step = 0; step < sizes.size(); ++step) {
    engine->set_lr(base_lr(optimizer) * static_cast<double>(step + 1) / static_cast<double>(sizes.size()));
    std::vector<std::vector<float>> inputs;
    std::vector<std::vector<std::int64_t>> targets;
    std::vector<Batch> batches;
    for (int b = 0; b < engine->batches_per_step(); ++b) {
      const int n = sizes[step];
      inputs.push_back(
          test::random_vector(static_cast<std::size_t>(n) * floats, static_cast<unsigned>(100 * step + b)));
      targets.push_back(test::random_targets(n, model->output_features(), static_cast<unsigned>(7 * step + b)));
    }
    for (std::size_t b = 0; b < inputs.size(); ++b)
      batches.push_back(Batch{inputs[b].data(), targets[b].data(), sizes[step]});
    run.losses.push_back(engine->train_step(batches));
    if (static_cast<int>(step) == predict_after) {
      // An evaluation of a larger batch between two steps grows buffers the graphs refer to.
      const auto x = test::random_vector(static_cast<std::size_t>(predict_batch) * floats, 99);
      std::vector<Batch> eval(static_cast<std::size_t>(engine->batches_per_step()),
                              Batch{x.data(), nullptr, predict_batch});
      const auto logits = engine->predict(eval);
      run.losses.push_back(logits.empty() ? 0.0f : logits.back());
    }
  }
  engine->synchronize();
  Model& m = engine->model();
  const Stream stream = m.device().create_stream();
  run.params.resize(m.param_count());
  stream.copy(run.params.data(), m.params_flat(), run.params.size() * sizeof(float));
  run.buffers.resize(m.buffers_bytes());
  if (!run.buffers.empty()) stream.copy(run.buffers.data(), m.buffers_flat(), run.buffers.size());
  run.replays = engine->graph_replays();
  run.optimizer_steps = engine->optimizers()[0]->steps();
  return run;
}

void expect_identical(const TrainRun& eager, const TrainRun& graphs) {
  ASSERT_EQ(eager.losses.size(), graphs.losses.size());
  for (std::size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&eager.losses[i], &graphs.losses[i], sizeof(float)), 0)
        << "step " << i << ": eager " << eager.losses[i] << ", replayed " << graphs.losses[i];
  ASSERT_EQ(eager.params.size(), graphs.params.size());
  EXPECT_EQ(std::memcmp(eager.params.data(), graphs.params.data(), eager.params.size() * sizeof(float)), 0)
      << "parameters differ";
  EXPECT_EQ(eager.buffers, graphs.buffers) << "buffers (BatchNorm running statistics) differ";
  EXPECT_EQ(eager.optimizer_steps, graphs.optimizer_steps);
}

// Batch 8 warms up (eager), is captured at the next step and replayed; batch 6 warms up, is
// captured, replayed; batch 8 again replays the graph kept for it.
const std::vector<int> kSizes{8, 8, 8, 8, 6, 6, 6, 8, 8};
constexpr std::uint64_t kReplays = 7;

struct Case {
  const char* name;
  EngineKind kind;
  int devices;
  Net net;
  bool cuda = false;
};

class GraphsEqualEager : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (GetParam().cuda && Runtime::cuda_device_count() == 0)
      GTEST_SKIP() << "no CUDA device: the cuda instances replay CUDA graphs";
  }
};

TEST_P(GraphsEqualEager, SgdWithMomentumBitForBit) {
  const Case c = GetParam();
  const OptimizerOptions sgd = SgdOptions{0.05f, 0.9f, 1e-4f, false};
  const TrainRun eager = train(c.kind, c.devices, false, c.net, sgd, kSizes, -1, 0, c.cuda);
  const TrainRun graphs = train(c.kind, c.devices, true, c.net, sgd, kSizes, -1, 0, c.cuda);
  EXPECT_EQ(eager.replays, 0u);
  EXPECT_EQ(graphs.replays, kReplays);
  expect_identical(eager, graphs);
}

TEST_P(GraphsEqualEager, AdamWBitForBit) {
  const Case c = GetParam();
  const OptimizerOptions adamw = AdamWOptions{.lr = 3e-3};
  const TrainRun eager = train(c.kind, c.devices, false, c.net, adamw, kSizes, -1, 0, c.cuda);
  const TrainRun graphs = train(c.kind, c.devices, true, c.net, adamw, kSizes, -1, 0, c.cuda);
  EXPECT_EQ(graphs.replays, kReplays);
  expect_identical(eager, graphs);
}

INSTANTIATE_TEST_SUITE_P(Engines, GraphsEqualEager,
                         ::testing::Values(Case{"single_mlp", EngineKind::single, 1, Net::mlp},
                                           Case{"single_convnet", EngineKind::single, 1, Net::convnet},
                                           Case{"dp3_mlp", EngineKind::dp, 3, Net::mlp},
                                           Case{"dp3_convnet", EngineKind::dp, 3, Net::convnet},
                                           Case{"dp1_convnet", EngineKind::dp, 1, Net::convnet},
                                           Case{"ddp1_mlp", EngineKind::ddp, 1, Net::mlp},
                                           Case{"ddp1_convnet", EngineKind::ddp, 1, Net::convnet},
                                           Case{"ddp3_mlp", EngineKind::ddp, 3, Net::mlp},
                                           Case{"ddp3_convnet", EngineKind::ddp, 3, Net::convnet},
                                           Case{"single_dropout", EngineKind::single, 1, Net::mlp_dropout},
                                           Case{"dp3_dropout", EngineKind::dp, 3, Net::mlp_dropout},
                                           Case{"ddp3_dropout", EngineKind::ddp, 3, Net::mlp_dropout}),
                         [](const auto& info) { return std::string(info.param.name); });
// The same on GPUs: DP's one graph over every device and DDP's graph per rank, with its collectives
// inside (several devices on one GPU where there are fewer GPUs).
INSTANTIATE_TEST_SUITE_P(Cuda, GraphsEqualEager,
                         ::testing::Values(Case{"single_convnet", EngineKind::single, 1, Net::convnet, true},
                                           Case{"dp3_mlp", EngineKind::dp, 3, Net::mlp, true},
                                           Case{"dp3_convnet", EngineKind::dp, 3, Net::convnet, true},
                                           Case{"ddp1_convnet", EngineKind::ddp, 1, Net::convnet, true},
                                           Case{"ddp3_mlp", EngineKind::ddp, 3, Net::mlp, true},
                                           Case{"ddp3_convnet", EngineKind::ddp, 3, Net::convnet, true},
                                           Case{"single_dropout", EngineKind::single, 1, Net::mlp_dropout, true},
                                           Case{"dp3_dropout", EngineKind::dp, 3, Net::mlp_dropout, true},
                                           Case{"ddp3_dropout", EngineKind::ddp, 3, Net::mlp_dropout, true}),
                         [](const auto& info) { return std::string(info.param.name) + "_cuda"; });

TEST_P(GraphsEqualEager, AnEvaluationThatMovesMemoryBetweenStepsIsSeen) {
  const Case c = GetParam();
  const OptimizerOptions sgd = SgdOptions{0.05f, 0.9f};
  const std::vector<int> sizes{8, 8, 8, 8, 8, 8};
  const TrainRun eager = train(c.kind, c.devices, false, c.net, sgd, sizes, 3, 40, c.cuda);
  const TrainRun graphs = train(c.kind, c.devices, true, c.net, sgd, sizes, 3, 40, c.cuda);
  // Steps 1-3 replay; the evaluation grew buffers: step 4 runs eagerly, 5 is captured again.
  EXPECT_EQ(graphs.replays, 4u);
  expect_identical(eager, graphs);
}

// Dropout's masks depend on the step, which its kernels read from device memory: each replay draws
// its own step's masks (a replay that repeated the captured step's would differ from eager), and
// the step's value is uploaded before every replay, so a run that only replays still moves on.
TEST(EngineGraphs, ModelsThatDrawRandomNumbersReplayEachStepsMasks) {
  for (EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    const int devices = kind == EngineKind::single ? 1 : 2;
    const OptimizerOptions sgd = SgdOptions{0.05f};
    const TrainRun eager = train(kind, devices, false, Net::mlp_dropout, sgd, {8, 8, 8, 8, 8});
    const TrainRun graphs = train(kind, devices, true, Net::mlp_dropout, sgd, {8, 8, 8, 8, 8});
    EXPECT_EQ(graphs.replays, 4u);
    expect_identical(eager, graphs);
  }
}

TEST(EngineGraphs, ACaptureTheModelBreaksFallsBackToEagerSteps) {
  // The capture of step 2 throws CaptureError inside the model's forward: nothing captured runs,
  // the optimizer's step count is restored, and that step and every later one run eagerly.
  for (EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    const int devices = kind == EngineKind::single ? 1 : 2;
    const OptimizerOptions sgd = SgdOptions{0.05f, 0.9f};
    const TrainRun eager = train(kind, devices, false, Net::mlp_syncing, sgd, {8, 8, 8, 8});
    SyncingModel::captured_forwards = 0;
    const TrainRun graphs = train(kind, devices, true, Net::mlp_syncing, sgd, {8, 8, 8, 8});
    EXPECT_GE(SyncingModel::captured_forwards.load(), 1) << "step 2 tried a capture";
    EXPECT_EQ(graphs.replays, 0u);
    expect_identical(eager, graphs);
  }
}

// The same on a GPU: the failed capture's errors (900 from the synchronize, 901 from its end) must
// not reach the eager step's first launch (docs/cuda-rules.md, rule 18).
TEST(EngineGraphsCuda, ACaptureTheModelBreaksFallsBackToEagerSteps) {
  if (Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (EngineKind kind : {EngineKind::single, EngineKind::ddp}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    const int devices = kind == EngineKind::single ? 1 : 2;
    const OptimizerOptions sgd = SgdOptions{0.05f, 0.9f};
    const std::vector<int> sizes{8, 8, 8, 8};
    const TrainRun eager = train(kind, devices, false, Net::mlp_syncing, sgd, sizes, -1, 0, /*cuda=*/true);
    SyncingModel::captured_forwards = 0;
    const TrainRun graphs = train(kind, devices, true, Net::mlp_syncing, sgd, sizes, -1, 0, /*cuda=*/true);
    EXPECT_GE(SyncingModel::captured_forwards.load(), 1) << "step 2 tried a capture";
    EXPECT_EQ(graphs.replays, 0u);
    expect_identical(eager, graphs);
  }
}

TEST(EngineGraphs, ASteadyStateReplayIsOneLaunchAndOneHostSync) {
  // DDP on one device too: no bucket is all-reduced there, and the capture must not wait on the
  // idle communication stream (an event recorded outside the capture).
  const std::pair<EngineKind, int> cases[] = {
      {EngineKind::single, 1}, {EngineKind::dp, 2}, {EngineKind::ddp, 1}, {EngineKind::ddp, 2}};
  for (const auto& [kind, devices] : cases) {
    SCOPED_TRACE(fmt::format("{} on {} device(s)", to_string(kind), devices));
    auto runtime = test::sim_runtime(devices);
    auto model = make_net(Net::convnet, runtime->device(0));
    EngineOptions options;
    options.kind = kind;
    options.graphs = true;
    auto engine = make_engine(*runtime, *model, SgdOptions{0.01f, 0.9f}, options);
    const int n = 6;
    const std::size_t floats = 28 * 28;
    PinnedBuffer x = runtime->allocate_pinned(n * floats * sizeof(float));
    PinnedBuffer y = runtime->allocate_pinned(n * sizeof(std::int64_t));
    const auto xs = test::random_vector(n * floats, 5);
    const auto ys = test::random_targets(n, 10, 6);
    std::memcpy(x.data(), xs.data(), xs.size() * sizeof(float));
    std::memcpy(y.data(), ys.data(), ys.size() * sizeof(std::int64_t));
    std::vector<Batch> batches(static_cast<std::size_t>(engine->batches_per_step()),
                               Batch{x.as<float>(), y.as<std::int64_t>(), n});
    // Eager, then captured in each of the two pipeline slots (a graph per slot: each reads its
    // slot's input buffers).
    for (int warm = 0; warm < 3; ++warm) engine->train_step(batches);
    runtime->reset_counters();
    constexpr int kSteps = 3;
    for (int step = 0; step < kSteps; ++step) engine->train_step(batches);
    EXPECT_EQ(engine->graph_replays(), 2u + kSteps);
    std::uint64_t launches = 0, syncs = 0;
    for (int d = 0; d < devices; ++d) {
      const DeviceCounters c = runtime->counters(d);
      EXPECT_EQ(c.allocations, 0u) << "device " << d;
      EXPECT_EQ(c.pageable_copies, 0u) << "device " << d;
      launches += c.launches;
      syncs += c.host_syncs;
    }
    // One graph launch per device that launches one (DP: one graph for every device).
    EXPECT_EQ(launches, static_cast<std::uint64_t>(kSteps * (kind == EngineKind::ddp ? devices : 1)));
    EXPECT_LE(syncs, static_cast<std::uint64_t>(kSteps * (kind == EngineKind::ddp ? devices : 1)));
  }
}

}  // namespace
}  // namespace dp
