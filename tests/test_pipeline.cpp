// test_pipeline.cpp — training steps submitted without waiting (Engine::submit_step): the host
// prepares and submits the next step while the devices run this one, its batch copied in on a copy
// stream into the other of two input slots. Whatever order the losses are read in, and although the
// caller overwrites its batch memory as soon as a step is submitted, every engine's losses,
// parameters and buffers equal those of train_step one step after another, bit for bit, eager and
// replayed, through batch-size changes, learning-rate changes and an evaluation between steps.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <gtest/gtest.h>
#include <memory>
#include <vector>

#include "dp/engine.h"
#include "dp/error.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/shape.h"
#include "test_util.h"

namespace dp {
namespace {

struct Outcome {
  std::vector<float> losses;
  std::vector<float> params;
  std::vector<unsigned char> buffers;
  std::int64_t optimizer_steps = 0;
};

struct Case {
  const char* name;
  EngineKind kind;
  int devices;
  bool convnet;
  bool graphs;
};

// Batch sizes per step: a change of size, and back (graphs warm up, capture per slot, replay).
const std::vector<int> kSizes{8, 8, 8, 8, 5, 5, 5, 8, 8};
constexpr int kPredictAfter = 3;  // an evaluation between two steps

std::unique_ptr<Model> make(const Case& c, Device& device) {
  return c.convnet ? models::make_convnet(device, 3) : models::make_mlp(device, {32, 16}, 3);
}

// `pipelined`: every step submitted before any loss is read (losses read last, newest first), and
// the batch memory overwritten right after each submission. Otherwise train_step, step by step.
Outcome run(const Case& c, bool pipelined) {
  auto runtime = test::sim_runtime(c.devices);
  auto model = make(c, runtime->device(0));
  EngineOptions options;
  options.kind = c.kind;
  options.graphs = c.graphs;
  options.step.seed = 5;
  if (c.kind == EngineKind::single) options.device_ids = std::vector<int>{0};
  auto engine = make_engine(*runtime, *model, SgdOptions{0.05f, 0.9f}, options);
  const auto floats = static_cast<std::size_t>(numel(model->input_shape()));
  const auto ranks = static_cast<std::size_t>(engine->batches_per_step());
  // One buffer per rank, reused by every step: the engine must have copied a batch before
  // submit_step returns.
  std::vector<std::vector<float>> inputs(ranks, std::vector<float>(8 * floats));
  std::vector<std::vector<std::int64_t>> targets(ranks, std::vector<std::int64_t>(8));
  std::vector<StepLoss> pending;
  Outcome out;
  for (std::size_t step = 0; step < kSizes.size(); ++step) {
    const int n = kSizes[step];
    engine->set_lr(0.05 * static_cast<double>(step + 1) / static_cast<double>(kSizes.size()));
    std::vector<Batch> batches;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto x = test::random_vector(static_cast<std::size_t>(n) * floats, static_cast<unsigned>(10 * step + r));
      const auto y = test::random_targets(n, 3, static_cast<unsigned>(20 * step + r));
      std::copy(x.begin(), x.end(), inputs[r].begin());
      std::copy(y.begin(), y.end(), targets[r].begin());
      batches.push_back(Batch{inputs[r].data(), targets[r].data(), n});
    }
    if (pipelined) {
      pending.push_back(engine->submit_step(batches));
      for (std::size_t r = 0; r < ranks; ++r) {  // the caller's memory is its own again
        std::fill(inputs[r].begin(), inputs[r].end(), std::nanf(""));
        std::fill(targets[r].begin(), targets[r].end(), std::int64_t{-7});
      }
    } else {
      out.losses.push_back(engine->train_step(batches));
    }
    if (static_cast<int>(step) == kPredictAfter) {
      const auto x = test::random_vector(6 * floats, 99);
      const std::vector<Batch> eval(ranks, Batch{x.data(), nullptr, 6});
      const auto logits = engine->predict(eval);
      out.buffers.assign(reinterpret_cast<const unsigned char*>(logits.data()),
                         reinterpret_cast<const unsigned char*>(logits.data() + logits.size()));
    }
  }
  if (pipelined) {
    out.losses.resize(pending.size());
    for (std::size_t i = pending.size(); i-- > 0;) out.losses[i] = pending[i].get();
  }
  engine->synchronize();
  for (const StepLoss& loss : pending) EXPECT_TRUE(loss.ready());
  Model& m = engine->model();
  const Stream stream = m.device().create_stream();
  out.params.resize(m.param_count());
  stream.copy(out.params.data(), m.params_flat(), out.params.size() * sizeof(float));
  std::vector<unsigned char> buffers(m.buffers_bytes());
  if (!buffers.empty()) stream.copy(buffers.data(), m.buffers_flat(), buffers.size());
  out.buffers.insert(out.buffers.end(), buffers.begin(), buffers.end());
  out.optimizer_steps = engine->optimizers()[0]->steps();
  return out;
}

class Pipeline : public ::testing::TestWithParam<Case> {};

TEST_P(Pipeline, SubmittedStepsEqualStepsOneAfterAnotherBitForBit) {
  const Case& c = GetParam();
  const Outcome sequential = run(c, false);
  const Outcome pipelined = run(c, true);
  ASSERT_EQ(sequential.losses.size(), pipelined.losses.size());
  for (std::size_t i = 0; i < sequential.losses.size(); ++i) {
    EXPECT_TRUE(std::isfinite(sequential.losses[i])) << "step " << i;
    EXPECT_EQ(std::memcmp(&sequential.losses[i], &pipelined.losses[i], sizeof(float)), 0)
        << "step " << i << ": " << sequential.losses[i] << " vs " << pipelined.losses[i];
  }
  EXPECT_EQ(std::memcmp(sequential.params.data(), pipelined.params.data(), sequential.params.size() * sizeof(float)), 0)
      << "parameters differ";
  EXPECT_EQ(sequential.buffers, pipelined.buffers) << "evaluation logits or BatchNorm buffers differ";
  EXPECT_EQ(sequential.optimizer_steps, static_cast<std::int64_t>(kSizes.size()));
  EXPECT_EQ(pipelined.optimizer_steps, sequential.optimizer_steps);
}

INSTANTIATE_TEST_SUITE_P(Engines, Pipeline,
                         ::testing::Values(Case{"single_mlp_eager", EngineKind::single, 1, false, false},
                                           Case{"single_convnet_graphs", EngineKind::single, 1, true, true},
                                           Case{"dp3_mlp_eager", EngineKind::dp, 3, false, false},
                                           Case{"dp3_convnet_graphs", EngineKind::dp, 3, true, true},
                                           Case{"ddp3_mlp_eager", EngineKind::ddp, 3, false, false},
                                           Case{"ddp3_convnet_graphs", EngineKind::ddp, 3, true, true}),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A zero_grad the caller issues before a replayed step is done with once the step ran, as after an
// eager one: the gradients read afterwards are the step's, graphs on or off.
TEST(Pipeline, AZeroGradBeforeAReplayedStepLeavesTheStepsGradients) {
  std::vector<std::vector<float>> grads;
  for (const bool graphs : {false, true}) {
    auto runtime = test::sim_runtime(1);
    auto model = models::make_mlp(runtime->device(0), {16}, 3);
    EngineOptions options;
    options.graphs = graphs;
    auto engine = make_engine(*runtime, *model, SgdOptions{0.1f}, options);
    const auto x = test::random_vector(4 * 28 * 28, 8);
    const auto y = test::random_targets(4, 3, 9);
    const std::vector<Batch> batches{Batch{x.data(), y.data(), 4}};
    for (int step = 0; step < 4; ++step) engine->train_step(batches);
    const Stream stream = model->device().create_stream();
    model->zero_grad(stream);
    engine->train_step(batches);
    EXPECT_EQ(engine->graph_replays(), graphs ? 4u : 0u);  // every step after the first
    engine->synchronize();
    std::vector<float> g(model->param_count());
    stream.copy(g.data(), model->grads_flat(), g.size() * sizeof(float));
    grads.push_back(g);
  }
  EXPECT_EQ(std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)), 0);
  EXPECT_NE(std::count(grads[1].begin(), grads[1].end(), 0.0f), static_cast<std::ptrdiff_t>(grads[1].size()));
}

TEST(StepLoss, WithoutAStepIsAClearError) {
  const StepLoss none;
  EXPECT_FALSE(none.ready());
  EXPECT_THROW((void)none.get(), InvalidArgument);
}

// A loss outlives its engine (the engine waits for its steps' losses when it goes), and a bad
// batch is refused before anything is submitted: the steps in flight are untouched.
TEST(StepLoss, OutlivesItsEngineAndBadBatchesLeaveTheStepsInFlight) {
  auto runtime = test::sim_runtime(2);
  auto model = models::make_mlp(runtime->device(0), {16}, 3);
  EngineOptions options;
  options.kind = EngineKind::ddp;
  options.graphs = true;
  auto engine = make_engine(*runtime, *model, SgdOptions{0.1f}, options);
  const auto x = test::random_vector(4 * 28 * 28, 3);
  const auto y = test::random_targets(4, 3, 4);
  const std::vector<Batch> batches(2, Batch{x.data(), y.data(), 4});
  StepLoss first = engine->submit_step(batches);
  StepLoss second = engine->submit_step(batches);
  const std::vector<Batch> empty(2, Batch{x.data(), y.data(), 0});
  EXPECT_THROW((void)engine->submit_step(empty), InvalidArgument);
  const std::vector<Batch> one(1, Batch{x.data(), y.data(), 4});
  EXPECT_THROW((void)engine->submit_step(one), InvalidArgument);
  StepLoss third = engine->submit_step(batches);  // waits for the first's loss: two in flight at most
  EXPECT_TRUE(first.ready());
  engine.reset();
  const float a = first.get(), b = second.get(), c = third.get();
  EXPECT_TRUE(std::isfinite(a) && std::isfinite(b) && std::isfinite(c));
  EXPECT_LT(c, a) << "three SGD steps on one batch lower its loss";
  EXPECT_EQ(first.get(), a) << "a loss reads the same every time";
}

}  // namespace
}  // namespace dp
