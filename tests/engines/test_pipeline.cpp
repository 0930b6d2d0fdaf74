// test_pipeline.cpp — training steps submitted without waiting (Engine::submit_step): the host
// prepares and submits the next step while the devices run this one, its batch copied in on a copy
// stream into the other of two input slots. Whatever order the losses are read in, and although the
// caller overwrites its batch memory as soon as a step is submitted, every engine's losses,
// parameters and buffers equal those of train_step one step after another, bit for bit, eager and
// replayed, through batch-size changes, learning-rate changes and an evaluation between steps.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <gtest/gtest.h>
#include <memory>
#include <string>
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

enum class Feed {
  step_by_step,  // train_step, one step after another
  submitted,     // every step submitted before any loss is read (read last, newest first), the batch
                 // memory overwritten right after each submission
  lent,          // as `submitted`, each batch in fresh pinned memory lent to the engine (Batch::lease),
                 // whose lender poisons and frees it the moment the engine lets go
};

// Pinned memory lent for one step's batch of one rank.
struct LentBatch {
  PinnedBuffer inputs, targets;
};

Outcome run(const Case& c, Feed feed) {
  const bool pipelined = feed != Feed::step_by_step;
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
  auto lent = std::make_shared<std::atomic<int>>(0);  // leases the engine has not let go of
  const auto lend = [&](const std::vector<float>& x, const std::vector<std::int64_t>& y) {
    auto memory = std::make_shared<LentBatch>();
    memory->inputs = runtime->allocate_pinned(x.size() * sizeof(float));
    memory->targets = runtime->allocate_pinned(y.size() * sizeof(std::int64_t));
    std::copy(x.begin(), x.end(), memory->inputs.as<float>());
    std::copy(y.begin(), y.end(), memory->targets.as<std::int64_t>());
    ++*lent;
    std::shared_ptr<const void> lease(memory->inputs.data(), [memory, lent](const void*) {
      std::fill_n(memory->inputs.as<float>(), memory->inputs.size() / sizeof(float), std::nanf(""));
      std::fill_n(memory->targets.as<std::int64_t>(), memory->targets.size() / sizeof(std::int64_t), -7);
      --*lent;
    });
    return Batch{memory->inputs.as<float>(), memory->targets.as<std::int64_t>(), static_cast<int>(y.size()),
                 std::move(lease)};
  };
  for (std::size_t step = 0; step < kSizes.size(); ++step) {
    const int n = kSizes[step];
    engine->set_lr(0.05 * static_cast<double>(step + 1) / static_cast<double>(kSizes.size()));
    std::vector<Batch> batches;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto x = test::random_vector(static_cast<std::size_t>(n) * floats, static_cast<unsigned>(10 * step + r));
      const auto y = test::random_targets(n, 3, static_cast<unsigned>(20 * step + r));
      std::copy(x.begin(), x.end(), inputs[r].begin());
      std::copy(y.begin(), y.end(), targets[r].begin());
      batches.push_back(feed == Feed::lent ? lend(x, y) : Batch{inputs[r].data(), targets[r].data(), n});
    }
    if (feed == Feed::lent) {
      pending.push_back(engine->submit_step(batches));
      batches.clear();
      // Read in place: the engine holds this step's leases until its copies have run.
      EXPECT_GE(lent->load(), static_cast<int>(ranks)) << "step " << step;
    } else if (pipelined) {
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
  EXPECT_EQ(lent->load(), 0) << "synchronize() lets go of every lent batch";
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

void expect_same(const Outcome& sequential, const Outcome& pipelined) {
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

TEST_P(Pipeline, SubmittedStepsEqualStepsOneAfterAnotherBitForBit) {
  expect_same(run(GetParam(), Feed::step_by_step), run(GetParam(), Feed::submitted));
}

// Batches lent in pinned memory are copied to the devices straight from it, asynchronously, and
// the engine lets go of each once its copy has run: the same bits as staged batches.
TEST_P(Pipeline, LentPinnedBatchesAreReadInPlaceWithTheSameResults) {
  expect_same(run(GetParam(), Feed::step_by_step), run(GetParam(), Feed::lent));
}

INSTANTIATE_TEST_SUITE_P(Engines, Pipeline,
                         ::testing::Values(Case{"single_mlp_eager", EngineKind::single, 1, false, false},
                                           Case{"single_convnet_graphs", EngineKind::single, 1, true, true},
                                           Case{"dp3_mlp_eager", EngineKind::dp, 3, false, false},
                                           Case{"dp3_convnet_graphs", EngineKind::dp, 3, true, true},
                                           Case{"ddp3_mlp_eager", EngineKind::ddp, 3, false, false},
                                           Case{"ddp3_convnet_graphs", EngineKind::ddp, 3, true, true}),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Lent memory that is not pinned is copied on the host before submit_step returns, as any batch
// is: the engine keeps no lease on it.
TEST(Pipeline, ALentBatchInPageableMemoryIsStagedAtOnce) {
  auto runtime = test::sim_runtime(1);
  auto model = models::make_mlp(runtime->device(0), {16}, 3);
  auto engine = make_engine(*runtime, *model, SgdOptions{0.1f}, EngineOptions{});
  auto x = test::random_vector(4 * 28 * 28, 1);
  const auto y = test::random_targets(4, 3, 2);
  PinnedBuffer pinned = runtime->allocate_pinned(x.size() * sizeof(float));
  EXPECT_TRUE(runtime->is_pinned(pinned.data(), pinned.size()));
  EXPECT_TRUE(runtime->is_pinned(pinned.as<float>() + 1, pinned.size() - sizeof(float)));
  EXPECT_FALSE(runtime->is_pinned(pinned.as<float>() + 1, pinned.size())) << "runs past its end";
  EXPECT_FALSE(runtime->is_pinned(x.data(), x.size() * sizeof(float)));
  EXPECT_FALSE(runtime->is_pinned(nullptr, 4));
  auto owner = std::make_shared<int>(0);
  const std::weak_ptr<int> watch = owner;
  std::vector<Batch> batches{Batch{x.data(), y.data(), 4, std::move(owner)}};
  const StepLoss loss = engine->submit_step(batches);
  batches.clear();
  EXPECT_TRUE(watch.expired()) << "a pageable batch's lease is not kept";
  std::fill(x.begin(), x.end(), std::nanf(""));
  EXPECT_TRUE(std::isfinite(loss.get()));
}

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

// A model whose forward number `fail_at` (counted over all its replicas) enqueues work that fails
// on the device, as a faulting kernel would: the stream is poisoned, like a sticky CUDA error.
class FailingModel final : public test::ForwardingModel {
 public:
  FailingModel(std::unique_ptr<Model> inner, std::shared_ptr<std::atomic<int>> forwards, int fail_at)
      : ForwardingModel(std::move(inner)), forwards_(std::move(forwards)), fail_at_(fail_at) {}
  const float* forward(const Stream& stream, Inputs input, int batch, Mode mode) override {
    const float* out = ForwardingModel::forward(stream, input, batch, mode);
    if (++*forwards_ == fail_at_) stream.launch_host_func([] { throw Error("injected device fault"); });
    return out;
  }
  std::unique_ptr<Model> replicate(Device& device) const override {
    return std::make_unique<FailingModel>(inner().replicate(device), forwards_, fail_at_);
  }

 private:
  std::shared_ptr<std::atomic<int>> forwards_;
  int fail_at_;
};

// What f threw (empty: nothing).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A step that fails on a device after it was submitted: its get() throws the failure (never a
// loss read from memory the step did not write), every time; the steps before it keep their
// losses; the engine then refuses to go on (its streams are poisoned, as a CUDA context is by a
// sticky error): later submissions, at the latest the one that waits for the failed step, and
// synchronize() throw; and the engine still goes away cleanly.
TEST(StepFailure, AFailedStepsLossThrowsAndTheEngineGoesNoFurther) {
  constexpr int kFailing = 2, kSteps = 5;
  for (const EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    auto runtime = test::sim_runtime(2);
    const int replicas = kind == EngineKind::single ? 1 : 2;  // forwards per step
    auto forwards = std::make_shared<std::atomic<int>>(0);
    // Forwards are counted over every replica: the first one of step kFailing fails.
    FailingModel model(models::make_mlp(runtime->device(0), {16}, 3), forwards, kFailing * replicas + 1);
    EngineOptions options;
    options.kind = kind;
    if (kind == EngineKind::single) options.device_ids = std::vector<int>{0};
    auto engine = make_engine(*runtime, model, SgdOptions{0.1f}, options);
    const auto x = test::random_vector(4 * 28 * 28, 3);
    const auto y = test::random_targets(4, 3, 4);
    const std::vector<Batch> batches(static_cast<std::size_t>(engine->batches_per_step()),
                                     Batch{x.data(), y.data(), 4});
    std::vector<StepLoss> losses;
    std::vector<std::string> submit_errors;
    for (int step = 0; step < kSteps; ++step) {
      StepLoss loss;
      submit_errors.push_back(error_of([&] { loss = engine->submit_step(batches); }));
      losses.push_back(loss);
    }
    for (int step = 0; step < kFailing; ++step) {
      ASSERT_EQ(submit_errors[static_cast<std::size_t>(step)], "") << "step " << step;
      float loss = std::nanf("");
      const std::string error = error_of([&] { loss = losses[static_cast<std::size_t>(step)].get(); });
      // The step just before may still be in flight when the failure aborts DDP's communicators (as
      // ncclCommAbort ends the collectives in flight): then it fails as a consequence, so named.
      if (step == kFailing - 1 && kind == EngineKind::ddp && error.find("abort") != std::string::npos) continue;
      EXPECT_EQ(error, "") << "step " << step;
      EXPECT_TRUE(std::isfinite(loss)) << "step " << step;
    }
    const std::string& failing_submit = submit_errors[kFailing];
    if (failing_submit.empty()) {  // submitted before the fault surfaced: its loss reports it
      const std::string error = error_of([&] { (void)losses[kFailing].get(); });
      EXPECT_NE(error.find("injected device fault"), std::string::npos) << error;
      EXPECT_EQ(error_of([&] { (void)losses[kFailing].get(); }), error) << "a loss reads the same every time";
    } else {
      EXPECT_NE(failing_submit.find("injected device fault"), std::string::npos) << failing_submit;
    }
    for (int step = kFailing + 2; step < kSteps; ++step)
      EXPECT_NE(submit_errors[static_cast<std::size_t>(step)], "") << "step " << step << " was accepted";
    EXPECT_NE(error_of([&] { engine->synchronize(); }), "");
    EXPECT_NE(error_of([&] { (void)engine->submit_step(batches); }), "");
    engine.reset();
  }
}

// The sim's events report failed work as CUDA's do after a fault: waiting for, or asking about, a
// record behind work that failed throws that failure, and so does work that waits for it; a record
// before the failure does not.
TEST(StepFailure, AnEventBehindFailedWorkReportsTheFailure) {
  auto rt = test::sim_runtime(1);
  Stream stream = rt->device(0).create_stream();
  Event before = rt->device(0).create_event(), after = rt->device(0).create_event();
  // The failing work waits for the gate, so the records are enqueued before it fails (once it has
  // failed, enqueueing on the stream throws, as a CUDA call after a fault returns the error).
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  stream.record(before);
  stream.launch_host_func([opened] {
    opened.wait();
    throw Error("boom in stream work");
  });
  // Work enqueued behind the failure, on its stream and on a stream that waits for it, never runs:
  // nothing runs in a CUDA context after a fault.
  PinnedBuffer source = rt->allocate_pinned(sizeof(float)), behind = rt->allocate_pinned(sizeof(float)),
               waiting = rt->allocate_pinned(sizeof(float));
  *source.as<float>() = 1.0f;
  *behind.as<float>() = *waiting.as<float>() = 0.0f;
  stream.copy(behind.data(), source.data(), sizeof(float));
  stream.record(after);
  Stream dependent = rt->device(0).create_stream();
  Event dependent_done = rt->device(0).create_event();
  dependent.wait(after);
  dependent.copy(waiting.data(), source.data(), sizeof(float));
  dependent.record(dependent_done);
  gate.set_value();
  EXPECT_NO_THROW(before.synchronize());
  EXPECT_TRUE(before.query());
  EXPECT_EQ(error_of([&] { after.synchronize(); }), "boom in stream work");
  EXPECT_EQ(error_of([&] { (void)after.query(); }), "boom in stream work");
  // Work that waits for it fails too: its stream is poisoned, as the whole context is on a GPU.
  EXPECT_EQ(error_of([&] { dependent_done.synchronize(); }), "boom in stream work");
  EXPECT_EQ(error_of([&] { dependent.synchronize(); }), "boom in stream work");
  EXPECT_EQ(*behind.as<float>(), 0.0f) << "a copy behind the failed work ran";
  EXPECT_EQ(*waiting.as<float>(), 0.0f) << "a copy behind a wait for the failed work ran";
}

}  // namespace
}  // namespace dp
