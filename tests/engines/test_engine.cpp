// test_engine.cpp — the Engine interface (make_engine, steps, predict, set_lr, refusals), resuming
// through TrainingState bit for bit, and the small runtime helpers (shapes, Scratch, span kinds).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include "dp/engines/ddp.h"
#include "dp/engines/engine.h"
#include "dp/engines/trainer.h"
#include "dp/io/safetensors.h"
#include "dp/io/training_state.h"
#include "dp/models/mlp.h"
#include "dp/runtime/error.h"
#include "dp/runtime/scratch.h"
#include "dp/runtime/shape.h"
#include "dp/runtime/trace.h"
#include "test_util.h"

namespace dp {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kPixels = 28 * 28;  // one MNIST-shaped sample, (1, 28, 28)
constexpr int kClasses = 10;

// Read on a fresh stream of the model's device: callers synchronize the engine first, as the
// Engine contract asks before parameters are read from another stream.
std::vector<float> params_of(const Model& m) {
  Stream s = m.device().create_stream();
  std::vector<float> out(m.param_count());
  s.copy(out.data(), m.params_flat(), out.size() * sizeof(float));
  return out;
}

// An optimizer's state buffer `name` ("momentum", "exp_avg", ...) on the host.
std::vector<float> state_of(const Optimizer& optimizer, const std::string& name) {
  for (const Optimizer::StateBuffer& buffer : optimizer.state()) {
    if (buffer.name != name) continue;
    Stream s = optimizer.device().create_stream();
    std::vector<float> out(optimizer.param_count());
    s.copy(out.data(), buffer.data, out.size() * sizeof(float));
    return out;
  }
  ADD_FAILURE() << optimizer.kind() << " has no state buffer " << name;
  return {};
}

std::vector<float> momentum_of(const Optimizer& optimizer) { return state_of(optimizer, "momentum"); }

// Host samples with pixels in [0, 1) and targets cycling through the classes; a seed per step
// keeps every step's batch different (a repeated batch would hide a stale staging buffer).
struct Data {
  std::vector<float> x;
  std::vector<std::int64_t> y;
  Batch batch() const { return Batch{x.data(), y.data(), static_cast<int>(y.size())}; }
  // Rows [first, first + size) as a batch (a DDP rank's shard of a global batch).
  Batch rows(int first, int size) const {
    return Batch{x.data() + static_cast<std::size_t>(first) * kPixels, y.data() + first, size};
  }
};
Data make_data(int samples, unsigned seed) {
  Data d{test::random_vector(static_cast<std::size_t>(samples) * kPixels, seed, 0.0f, 1.0f), {}};
  for (int i = 0; i < samples; ++i) d.y.push_back((i * 7 + static_cast<int>(seed)) % kClasses);
  return d;
}

EngineOptions options_for(EngineKind kind) {
  EngineOptions options;
  options.kind = kind;
  return options;
}

// A directory of its own under gtest's temp dir, per process and test, removed afterwards: ctest
// runs the tests of this binary in parallel processes.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string test = fmt::format("{}_{}", info->test_suite_name(), info->name());
    path_ = fs::path(::testing::TempDir()) / fmt::format("dp_test_engine_{}_{}", ::getpid(), test);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// `what` (an error message) contains every one of `parts`; a failure shows the whole message.
using Parts = std::initializer_list<std::string>;
::testing::AssertionResult mentions(const std::string& what, Parts parts) {
  for (const std::string& part : parts)
    if (what.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << what << "' does not mention '" << part << "'";
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------
// make_engine and the interface

TEST(Engine, MakeEngineReportsKindDevicesAndBatchesPerStep) {
  auto rt = test::sim_runtime(2);
  const SgdOptions sgd{0.05f};
  auto single_model = models::make_mlp(rt->device(1), {16}, 1);
  auto dp_model = models::make_mlp(rt->device(1), {16}, 1);
  auto ddp_model = models::make_mlp(rt->device(0), {16}, 1);

  // single runs where the model is (device 1 here, to catch a hard-coded device 0).
  auto single = make_engine(*rt, *single_model, sgd, options_for(EngineKind::single));
  EXPECT_EQ(single->kind(), EngineKind::single);
  EXPECT_EQ(single->name(), "single");
  EXPECT_EQ(single->device_ids(), std::vector<int>{1});
  EXPECT_EQ(single->batches_per_step(), 1);
  EXPECT_EQ(&single->model(), single_model.get());
  EXPECT_EQ(single->optimizers().size(), 1u);

  // Explicit device_ids keep their order: the source (rank 0) is device 1, where the model lives.
  EngineOptions dp_options = options_for(EngineKind::dp);
  dp_options.device_ids = std::vector<int>{1, 0};
  auto dp = make_engine(*rt, *dp_model, sgd, dp_options);
  EXPECT_EQ(dp->kind(), EngineKind::dp);
  EXPECT_EQ(dp->name(), "dp");
  EXPECT_EQ(dp->device_ids(), (std::vector<int>{1, 0}));
  EXPECT_EQ(dp->batches_per_step(), 1);  // the global batch, scattered by the engine
  EXPECT_EQ(&dp->model(), dp_model.get());
  EXPECT_EQ(dp->optimizers().size(), 1u);

  // Unset device_ids: every device of the runtime; one batch and one optimizer per rank.
  auto ddp = make_engine(*rt, *ddp_model, sgd, options_for(EngineKind::ddp));
  EXPECT_EQ(ddp->kind(), EngineKind::ddp);
  EXPECT_EQ(ddp->name(), "ddp");
  EXPECT_EQ(ddp->device_ids(), (std::vector<int>{0, 1}));
  EXPECT_EQ(ddp->batches_per_step(), 2);
  EXPECT_EQ(&ddp->model(), ddp_model.get());  // rank 0's replica is the module itself
  ASSERT_EQ(ddp->optimizers().size(), 2u);
  EXPECT_EQ(ddp->optimizers()[0]->device().index(), 0);
  EXPECT_EQ(ddp->optimizers()[1]->device().index(), 1);

  for (EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp})
    EXPECT_EQ(parse_engine_kind(to_string(kind)), kind);
}

// The threads of this process (on the sim a stream is a thread).
std::size_t threads_now() {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task")) ++count;
  return count;
}

// An engine's streams do not grow with the batches a step takes on a device: 64 fixed shards (or
// 64 micro-batches) on one device share one copy stream there.
TEST(Engine, BatchesOfAStepShareTheirDevicesCopyStream) {
  auto rt = test::sim_runtime(1);
  std::vector<float> x(64 * 784, 0.5f);
  std::vector<std::int64_t> y(64, 3);
  for (const bool shards : {true, false}) {
    SCOPED_TRACE(shards ? "64 shards" : "64 micro-batches");
    auto model = models::make_mlp(rt->device(0), {16}, 1);
    EngineOptions options;
    options.kind = EngineKind::single;
    if (shards)
      options.shards = 64;
    else
      options.accumulate = 64;
    const std::size_t before = threads_now();
    auto engine = make_engine(*rt, *model, SgdOptions{0.05f}, options);
    std::vector<Batch> batches;
    for (int b = 0; b < 64; ++b) batches.push_back(Batch{x.data() + b * 784, y.data() + b, 1});
    engine->train_step(batches);
    engine->synchronize();
    EXPECT_LT(threads_now(), before + 8) << "threads grew with the batches of a step";
  }
}

TEST(Engine, SingleThroughTheInterfaceIsTheConcreteTrainerBitForBit) {
  auto rt = test::sim_runtime(1);
  const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};
  auto model = models::make_mlp(rt->device(0), {16}, 3);
  auto reference = models::make_mlp(rt->device(0), {16}, 3);
  auto engine = make_engine(*rt, *model, sgd, options_for(EngineKind::single));
  SingleDeviceTrainer trainer(*reference, sgd);
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(6, 10 + static_cast<unsigned>(step));
    const Batch batch = d.batch();
    // The same kernels on the same device in the same order: no rounding may differ.
    const float got = engine->train_step({&batch, 1});
    EXPECT_EQ(got, trainer.train_step(d.x.data(), d.y.data(), 6)) << "step " << step;
  }
  engine->synchronize();
  trainer.synchronize();
  EXPECT_EQ(params_of(*model), params_of(*reference));
  EXPECT_EQ(engine->optimizers()[0]->steps(), 3);
}

// DP and DDP through the interface, with `optimizer`, against single-device training on the
// global batch.
void expect_dp_and_ddp_equal_single(const OptimizerOptions& sgd) {
  auto rt = test::sim_runtime(2);
  auto dp_model = models::make_mlp(rt->device(0), {16}, 4);
  auto ddp_model = models::make_mlp(rt->device(0), {16}, 4);
  auto reference = models::make_mlp(rt->device(0), {16}, 4);
  auto dp = make_engine(*rt, *dp_model, sgd, options_for(EngineKind::dp));
  auto ddp = make_engine(*rt, *ddp_model, sgd, options_for(EngineKind::ddp));
  auto single = make_engine(*rt, *reference, sgd, options_for(EngineKind::single));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const Data d = make_data(8, 20 + static_cast<unsigned>(step));
    const Batch global = d.batch();
    const std::array<Batch, 2> shards{d.rows(0, 4), d.rows(4, 4)};  // rank r: rows [4r, 4r + 4)
    const float dp_loss = dp->train_step({&global, 1});
    const float ddp_loss = ddp->train_step(shards);
    const float ref_loss = single->train_step({&global, 1});
    // Tolerances of test_data_parallel.cpp and test_ddp.cpp on sim: DP's logits are per-row
    // identical, its loss a mean over the same rows; DDP's is a mean of per-rank means.
    EXPECT_NEAR(dp_loss, ref_loss, 1e-6f * std::fabs(ref_loss));
    EXPECT_NEAR(ddp_loss, ref_loss, 2e-6f * std::fabs(ref_loss));
  }
  dp->synchronize();
  ddp->synchronize();
  single->synchronize();
  // Gradients differ in summation order only (per-chunk or per-rank partial sums).
  EXPECT_TRUE(test::all_close(params_of(*dp_model), params_of(*reference), 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(params_of(*ddp_model), params_of(*reference), 1e-5, 1e-6));
  for (Engine* engine : {dp.get(), ddp.get()})
    for (const Optimizer* optimizer : engine->optimizers()) {
      EXPECT_EQ(optimizer->kind(), optimizer_kind(sgd));
      EXPECT_EQ(optimizer->steps(), 3);
    }
}

TEST(Engine, DataParallelAndDdpThroughTheInterfaceEqualSingleOnTheGlobalBatch) {
  expect_dp_and_ddp_equal_single(SgdOptions{0.05f, 0.9f, 1e-3f, false});
}

// The engines take any optimizer: AdamW (per-rank state on DDP) as well as SGD.
TEST(Engine, AdamWThroughEveryEngineEqualsSingle) {
  expect_dp_and_ddp_equal_single(AdamWOptions{1e-3, 0.9, 0.999, 1e-8, 1e-2});
}

// ---------------------------------------------------------------------------------------------
// Dropout through the engines: masks from (seed, step, layer, sample), DDP rank r from seed + r

EngineOptions dropout_options(EngineKind kind, std::uint64_t seed) {
  EngineOptions options = options_for(kind);
  options.step.seed = seed;
  return options;
}

// DP scatters the batch, but each chunk draws at its samples' place in it: the masks, and so the
// training, of one device on the whole batch (to the summation-order tolerance of the test above).
TEST(Engine, DataParallelDrawsSingleDevicesDropoutMasks) {
  auto rt = test::sim_runtime(2);
  const SgdOptions sgd{0.05f, 0.9f};
  auto dp_model = models::make_mlp(rt->device(0), {32, 16}, 4, 0.4);
  auto reference = models::make_mlp(rt->device(0), {32, 16}, 4, 0.4);
  auto other_seed = models::make_mlp(rt->device(0), {32, 16}, 4, 0.4);
  auto dp = make_engine(*rt, *dp_model, sgd, dropout_options(EngineKind::dp, 11));
  auto single = make_engine(*rt, *reference, sgd, dropout_options(EngineKind::single, 11));
  auto other = make_engine(*rt, *other_seed, sgd, dropout_options(EngineKind::single, 12));
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(9, 30 + static_cast<unsigned>(step));  // chunks of 5 and 4
    const Batch global = d.batch();
    const float want = single->train_step({&global, 1});
    EXPECT_NEAR(dp->train_step({&global, 1}), want, 1e-6f * std::fabs(want)) << "step " << step;
    EXPECT_GT(std::fabs(other->train_step({&global, 1}) - want), 1e-4f) << "another seed, other masks";
  }
  dp->synchronize();
  single->synchronize();
  EXPECT_TRUE(test::all_close(params_of(*dp_model), params_of(*reference), 1e-5, 1e-6));
}

// DDP rank r draws from seed + r: with the same shard on both ranks, the DDP loss is the mean of
// single-device losses at seeds s and s + 1, not the loss at s.
TEST(Engine, DdpRankDrawsFromSeedPlusRank) {
  auto rt = test::sim_runtime(2);
  const SgdOptions sgd{0.0f};  // lr 0: every step sees the same parameters
  auto ddp_model = models::make_mlp(rt->device(0), {32}, 6, 0.5);
  auto at_s = models::make_mlp(rt->device(0), {32}, 6, 0.5);
  auto at_s1 = models::make_mlp(rt->device(0), {32}, 6, 0.5);
  auto ddp = make_engine(*rt, *ddp_model, sgd, dropout_options(EngineKind::ddp, 40));
  auto single_s = make_engine(*rt, *at_s, sgd, dropout_options(EngineKind::single, 40));
  auto single_s1 = make_engine(*rt, *at_s1, sgd, dropout_options(EngineKind::single, 41));
  const Data d = make_data(6, 77);
  const std::array<Batch, 2> same{d.batch(), d.batch()};
  const Batch batch = d.batch();
  for (int step = 0; step < 2; ++step) {
    const float s = single_s->train_step({&batch, 1}), s1 = single_s1->train_step({&batch, 1});
    EXPECT_GT(std::fabs(s - s1), 1e-4f) << "seeds s and s + 1 draw different masks";
    EXPECT_NEAR(ddp->train_step(same), (s + s1) / 2.0f, 1e-6f * std::fabs(s)) << "step " << step;
  }
}

// Eval mode is the identity: the logits of a model with Dropout equal those without it, every time.
TEST(Engine, DropoutIsTheIdentityInEvaluation) {
  auto rt = test::sim_runtime(1);
  auto with = models::make_mlp(rt->device(0), {32}, 8, 0.5);
  auto without = models::make_mlp(rt->device(0), {32}, 8);  // same parameters: Dropout has none
  auto a = make_engine(*rt, *with, SgdOptions{}, options_for(EngineKind::single));
  auto b = make_engine(*rt, *without, SgdOptions{}, options_for(EngineKind::single));
  const Data d = make_data(5, 3);
  const Batch batch = d.batch();
  const std::vector<float> logits = a->predict({&batch, 1});
  EXPECT_EQ(logits, b->predict({&batch, 1}));
  EXPECT_EQ(logits, a->predict({&batch, 1}));
}

// ---------------------------------------------------------------------------------------------
// predict

TEST(Engine, SingleAndDataParallelPredictTheSameLogits) {
  auto rt = test::sim_runtime(2);
  auto single_model = models::make_mlp(rt->device(0), {16}, 5);
  auto dp_model = models::make_mlp(rt->device(0), {16}, 5);
  auto single = make_engine(*rt, *single_model, SgdOptions{}, options_for(EngineKind::single));
  auto dp = make_engine(*rt, *dp_model, SgdOptions{}, options_for(EngineKind::dp));
  // 9 samples: DP chunks them 5 + 4; no targets, as a forward needs none.
  const Data d = make_data(9, 30);
  const Batch batch{d.x.data(), nullptr, 9};
  const std::vector<float> got = dp->predict({&batch, 1});
  const std::vector<float> want = single->predict({&batch, 1});
  ASSERT_EQ(want.size(), 9u * kClasses);
  // test_data_parallel.cpp's EvalForwardEqualsTheModule tolerance (chunked vs whole-batch GEMM).
  EXPECT_TRUE(test::all_close(got, want, 1e-5, 1e-6));
}

TEST(Engine, DdpPredictConcatenatesTheRanksLogitsInRankOrder) {
  auto rt = test::sim_runtime(2);
  const SgdOptions sgd{0.05f, 0.9f};
  auto model = models::make_mlp(rt->device(0), {16}, 6);
  auto ddp = make_engine(*rt, *model, sgd, options_for(EngineKind::ddp));
  const Data train = make_data(8, 40);
  const std::array<Batch, 2> shards{train.rows(0, 4), train.rows(4, 4)};
  ddp->train_step(shards);  // replicas must still agree after an update
  ddp->synchronize();

  // The same samples on both ranks: both halves come from identical replicas and kernels.
  const Data d = make_data(5, 41);
  const Batch same{d.x.data(), nullptr, 5};
  const std::array<Batch, 2> twice{same, same};
  const std::vector<float> both = ddp->predict(twice);
  ASSERT_EQ(both.size(), 2u * 5 * kClasses);
  const std::vector<float> first(both.begin(), both.begin() + 5 * kClasses);
  const std::vector<float> second(both.begin() + 5 * kClasses, both.end());
  EXPECT_EQ(first, second);

  // Different sizes per rank (3 and 5 samples): rank 0's rows first, at the right offsets, each
  // equal to rank 0's model predicting that batch on its own.
  const std::array<Batch, 2> uneven{Batch{d.x.data(), nullptr, 3}, same};
  const std::vector<float> got = ddp->predict(uneven);
  ASSERT_EQ(got.size(), 8u * kClasses);
  ddp->synchronize();
  SingleDeviceTrainer reference(ddp->model(), sgd);
  const std::vector<float> want0 = reference.predict(d.x.data(), 3);
  const std::vector<float> want1 = reference.predict(d.x.data(), 5);
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 3 * kClasses), want0);
  EXPECT_EQ(std::vector<float>(got.begin() + 3 * kClasses, got.end()), want1);
}

// ---------------------------------------------------------------------------------------------
// set_lr

TEST(Engine, SetLrReachesEveryOptimizerAndTheNextStep) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_mlp(rt->device(0), {16}, 7);
  auto ddp = make_engine(*rt, *model, SgdOptions{0.1f, 0.9f}, options_for(EngineKind::ddp));
  ddp->set_lr(0.025f);
  ASSERT_EQ(ddp->optimizers().size(), 2u);
  for (const Optimizer* optimizer : ddp->optimizers()) {
    EXPECT_EQ(optimizer->lr(), double{0.025f});  // SGD keeps it as the fp32 kernel takes it
    EXPECT_EQ(dynamic_cast<const Sgd&>(*optimizer).options().momentum, 0.9f);  // only the learning rate changes
  }

  // The step uses it: at lr 0, p - 0 * g == p exactly, on every rank.
  ddp->set_lr(0.0f);
  const std::vector<float> before = params_of(*model);
  const Data d = make_data(8, 50);
  const std::array<Batch, 2> shards{d.rows(0, 4), d.rows(4, 4)};
  ddp->train_step(shards);
  ddp->synchronize();
  EXPECT_EQ(params_of(*model), before);
  EXPECT_EQ(params_of(dynamic_cast<ReplicaEngine&>(*ddp).replica(1)), before);

  // What the constructor refuses, set_lr refuses too, at once and on no rank.
  EXPECT_THROW(ddp->set_lr(-1.0f), InvalidArgument);
  EXPECT_THROW(ddp->set_lr(std::nanf("")), InvalidArgument);
  for (const Optimizer* optimizer : ddp->optimizers()) EXPECT_EQ(optimizer->lr(), 0.0);
}

// ---------------------------------------------------------------------------------------------
// refusals

TEST(Engine, MakeEngineAndTrainStepRefuseWhatDoesNotApply) {
  auto rt = test::sim_runtime(2);
  auto model = models::make_mlp(rt->device(0), {16}, 8);
  const SgdOptions sgd{0.05f};

  // Only DP has an output device (it gathers the outputs there).
  for (EngineKind kind : {EngineKind::single, EngineKind::ddp}) {
    EngineOptions options = options_for(kind);
    options.output_device = 0;
    try {
      make_engine(*rt, *model, sgd, options);
      ADD_FAILURE() << "output_device accepted for " << to_string(kind);
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(mentions(e.what(), {"output_device", std::string(to_string(kind))}));
    }
  }

  // Only DDP has SyncBatchNorm (it synchronises ranks).
  for (EngineKind kind : {EngineKind::single, EngineKind::dp}) {
    EngineOptions options = options_for(kind);
    options.sync_batchnorm = true;
    try {
      make_engine(*rt, *model, sgd, options);
      ADD_FAILURE() << "sync_batchnorm accepted for " << to_string(kind);
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(mentions(e.what(), {"sync_batchnorm applies to ddp", std::string(to_string(kind))}));
    }
  }

  // single runs on the model's device (0) and nowhere else.
  for (const std::vector<int>& ids : {std::vector<int>{1}, std::vector<int>{0, 1}}) {
    EngineOptions options = options_for(EngineKind::single);
    options.device_ids = ids;
    EXPECT_THROW(make_engine(*rt, *model, sgd, options), InvalidArgument) << ids.size();
  }

  try {
    parse_engine_kind("fsdp");
    ADD_FAILURE() << "fsdp parsed";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(mentions(e.what(), {"'fsdp'"}));
  }

  // A step with the wrong number of batches is refused before any device work, so the engine
  // (and DDP's communicator, which a failing rank would abort) stays usable.
  const Data d = make_data(8, 60);
  const std::array<Batch, 2> two{d.rows(0, 4), d.rows(4, 4)};
  auto ddp = make_engine(*rt, *model, sgd, options_for(EngineKind::ddp));
  EXPECT_THROW(ddp->train_step({two.data(), 1}), InvalidArgument);
  EXPECT_THROW(ddp->predict({two.data(), 1}), InvalidArgument);
  EXPECT_TRUE(std::isfinite(ddp->train_step(two)));

  auto other = models::make_mlp(rt->device(0), {16}, 8);
  auto single = make_engine(*rt, *other, sgd, options_for(EngineKind::single));
  EXPECT_THROW(single->train_step(two), InvalidArgument);
  EXPECT_THROW(single->predict(two), InvalidArgument);
  EXPECT_THROW(single->train_step({}), InvalidArgument);
  EXPECT_TRUE(std::isfinite(single->train_step({two.data(), 1})));
}

// ---------------------------------------------------------------------------------------------
// TrainingState

// Trains a fresh single engine (MLP, seed 9) for `steps` steps and saves its state to `path`.
void train_and_save(Runtime& rt, const SgdOptions& sgd, int steps, const std::string& path) {
  auto model = models::make_mlp(rt.device(0), {16}, 9);
  auto engine = make_engine(rt, *model, sgd, options_for(EngineKind::single));
  for (int step = 0; step < steps; ++step) {
    const Data d = make_data(6, 70 + static_cast<unsigned>(step));
    const Batch batch = d.batch();
    engine->train_step({&batch, 1});
  }
  engine->synchronize();
  TrainingProgress progress;
  progress.step = steps;
  TrainingState::save(path, engine->model(), *engine->optimizers()[0], progress);
}

// The message TrainingState::read throws for `file` written to `path`; empty if it is accepted.
std::string read_error(const safetensors::File& file, const std::string& path) {
  safetensors::write(path, file);
  try {
    TrainingState::read(path);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

TEST(TrainingState, ResumeIsBitExact) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  const std::string path = dir.file("run.safetensors");
  const SgdOptions sgd{0.05f, 0.9f, 1e-3f, false};

  auto model = models::make_mlp(rt->device(0), {16}, 11);
  auto engine = make_engine(*rt, *model, sgd, options_for(EngineKind::single));
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(6, 80 + static_cast<unsigned>(step));
    const Batch batch = d.batch();
    engine->train_step({&batch, 1});
  }
  engine->synchronize();
  TrainingProgress progress;
  progress.step = 2;
  progress.epoch = 1;
  progress.seed = 1234567890123ULL;  // beyond 32 bits
  progress.tags = {{"model", "mlp"}, {"mode", "single"}};
  TrainingState::save(path, engine->model(), *engine->optimizers()[0], progress);

  const TrainingState state = TrainingState::read(path);
  EXPECT_EQ(state.progress().step, 2);
  EXPECT_EQ(state.progress().epoch, 1);
  EXPECT_EQ(state.progress().seed, 1234567890123ULL);
  EXPECT_EQ(state.progress().tags, progress.tags);
  EXPECT_EQ(state.optimizer_steps(), 2);

  // Another initialisation, so a load that wrote nothing would show.
  auto resumed_model = models::make_mlp(rt->device(0), {16}, 12);
  state.load_model(*resumed_model);
  auto resumed = make_engine(*rt, *resumed_model, sgd, options_for(EngineKind::single));
  state.load_optimizers(*resumed_model, resumed->optimizers());
  EXPECT_EQ(resumed->optimizers()[0]->steps(), 2);
  EXPECT_EQ(params_of(*resumed_model), params_of(*model));
  EXPECT_EQ(momentum_of(*resumed->optimizers()[0]), momentum_of(*engine->optimizers()[0]));

  // The third step needs the momentum buffer and the step count (a first step would overwrite
  // the buffer with g): equal losses and parameters only if both came back exactly.
  const Data d = make_data(6, 82);
  const Batch batch = d.batch();
  EXPECT_EQ(resumed->train_step({&batch, 1}), engine->train_step({&batch, 1}));
  resumed->synchronize();
  engine->synchronize();
  EXPECT_EQ(params_of(*resumed_model), params_of(*model));
  EXPECT_EQ(resumed->optimizers()[0]->steps(), 3);
}

// AdamW's exp_avg, exp_avg_sq and step survive a save and load: the resumed run's next step
// (whose bias correction depends on the step count) equals the uninterrupted one bit for bit, on
// every DDP rank. Its state refuses to load into SGD, and SGD's into AdamW.
TEST(TrainingState, AdamWResumeIsBitExactOnEveryRank) {
  auto rt = test::sim_runtime(2);
  const TempDir dir;
  const std::string path = dir.file("adamw.safetensors");
  const AdamWOptions adamw{2e-3, 0.8, 0.99, 1e-6, 0.05};
  auto model = models::make_mlp(rt->device(0), {16}, 21);
  auto engine = make_engine(*rt, *model, adamw, options_for(EngineKind::ddp));
  const auto step = [](Engine& e, unsigned seed) {
    const Data d = make_data(8, seed);
    const std::array<Batch, 2> shards{d.rows(0, 4), d.rows(4, 4)};
    return e.train_step(shards);
  };
  for (unsigned s = 0; s < 2; ++s) step(*engine, 90 + s);
  engine->synchronize();
  TrainingProgress progress;
  progress.step = 2;
  TrainingState::save(path, engine->model(), *engine->optimizers()[0], progress);
  const TrainingState state = TrainingState::read(path);
  EXPECT_EQ(state.optimizer_kind(), "adamw");
  EXPECT_EQ(state.optimizer_steps(), 2);
  EXPECT_TRUE(state.file().has("optimizer.exp_avg.fc1.weight"));
  EXPECT_TRUE(state.file().has("optimizer.exp_avg_sq.fc2.bias"));

  auto resumed_model = models::make_mlp(rt->device(0), {16}, 22);
  state.load_model(*resumed_model);
  auto resumed = make_engine(*rt, *resumed_model, adamw, options_for(EngineKind::ddp));
  state.load_optimizers(*resumed_model, resumed->optimizers());
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(resumed->optimizers()[r]->steps(), 2);
    EXPECT_EQ(state_of(*resumed->optimizers()[r], "exp_avg"), state_of(*engine->optimizers()[r], "exp_avg"));
    EXPECT_EQ(state_of(*resumed->optimizers()[r], "exp_avg_sq"), state_of(*engine->optimizers()[r], "exp_avg_sq"));
  }
  EXPECT_EQ(step(*resumed, 92), step(*engine, 92));
  resumed->synchronize();
  engine->synchronize();
  EXPECT_EQ(params_of(*resumed_model), params_of(*model));
  EXPECT_EQ(params_of(dynamic_cast<ReplicaEngine&>(*resumed).replica(1)), params_of(*model));

  // Another optimizer's state: refused, nothing written.
  auto sgd_model = models::make_mlp(rt->device(0), {16}, 23);
  auto sgd = make_engine(*rt, *sgd_model, SgdOptions{0.1f, 0.9f}, options_for(EngineKind::single));
  try {
    state.load_optimizers(*sgd_model, sgd->optimizers());
    ADD_FAILURE() << "an AdamW state loaded into SGD";
  } catch (const Error& e) {
    EXPECT_TRUE(mentions(e.what(), {path, "optimizer 'adamw'", "this run's optimizer is 'sgd'"}));
  }
  EXPECT_EQ(sgd->optimizers()[0]->steps(), 0);
  const std::string sgd_path = dir.file("sgd.safetensors");
  train_and_save(*rt, SgdOptions{0.1f, 0.9f}, 1, sgd_path);
  EXPECT_THROW(TrainingState::read(sgd_path).load_optimizers(*resumed_model, resumed->optimizers()), Error);
  EXPECT_EQ(resumed->optimizers()[0]->steps(), 3);
}

// One state loads into an engine's optimizers only when they agree with each other (kind, state,
// size); a mixed list is a caller's error, refused before anything is written.
TEST(TrainingState, LoadOptimizersRefusesOptimizersThatDiffer) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  const std::string path = dir.file("run.safetensors");
  train_and_save(*rt, SgdOptions{0.05f, 0.9f}, 1, path);
  const TrainingState state = TrainingState::read(path);
  auto model = models::make_mlp(rt->device(0), {16}, 9);
  Sgd with_momentum(rt->device(0), model->param_count(), SgdOptions{0.05f, 0.9f});
  Sgd without(rt->device(0), model->param_count(), SgdOptions{0.05f});
  const std::array<Optimizer*, 2> mixed{&with_momentum, &without};
  try {
    state.load_optimizers(*model, mixed);
    ADD_FAILURE() << "optimizers with and without momentum loaded one state";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(mentions(e.what(), {"optimizers differ"}));
  }
  EXPECT_EQ(with_momentum.steps(), 0);
  EXPECT_EQ(without.steps(), 0);
}

// Files of format 1 (SGD only: "dp.sgd_steps", no "dp.optimizer") still resume.
TEST(TrainingState, FormatOneFilesStillLoad) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  const std::string path = dir.file("v1.safetensors");
  train_and_save(*rt, SgdOptions{0.05f, 0.9f}, 2, path);
  safetensors::File file = safetensors::read(path);
  file.metadata["dp.format"] = "1";
  file.metadata["dp.sgd_steps"] = file.metadata.at("dp.optimizer_steps");
  file.metadata.erase("dp.optimizer_steps");
  file.metadata.erase("dp.optimizer");
  safetensors::write(path, file);
  const TrainingState state = TrainingState::read(path);
  EXPECT_EQ(state.optimizer_kind(), "sgd");
  EXPECT_EQ(state.optimizer_steps(), 2);
  auto model = models::make_mlp(rt->device(0), {16}, 9);
  auto engine = make_engine(*rt, *model, SgdOptions{0.05f, 0.9f}, options_for(EngineKind::single));
  state.load_optimizers(*model, engine->optimizers());
  EXPECT_EQ(engine->optimizers()[0]->steps(), 2);
  std::vector<float> want(model->param_count());
  for (const TensorRef& p : model->parameters()) {
    const std::vector<float> values = file.at("optimizer.momentum." + p.name).to_f32();
    std::copy(values.begin(), values.end(), want.begin() + static_cast<std::ptrdiff_t>(p.offset));
  }
  EXPECT_EQ(momentum_of(*engine->optimizers()[0]), want);
}

TEST(TrainingState, LoadOptimizersSetsEveryDdpRank) {
  auto rt = test::sim_runtime(2);
  const TempDir dir;
  const std::string path = dir.file("run.safetensors");
  const SgdOptions sgd{0.05f, 0.9f};
  train_and_save(*rt, sgd, 2, path);
  const TrainingState state = TrainingState::read(path);

  // As dp_train does: the model first (DDP broadcasts rank 0's values), then the optimizers.
  auto model = models::make_mlp(rt->device(0), {16}, 13);
  state.load_model(*model);
  auto ddp = make_engine(*rt, *model, sgd, options_for(EngineKind::ddp));
  state.load_optimizers(ddp->model(), ddp->optimizers());

  // Each rank's momentum, on its own device, is the file's buffers laid out as the parameters.
  std::vector<float> want(model->param_count());
  for (const TensorRef& p : model->parameters()) {
    const std::vector<float> values = state.file().at("optimizer.momentum." + p.name).to_f32();
    std::copy(values.begin(), values.end(), want.begin() + static_cast<std::ptrdiff_t>(p.offset));
  }
  ASSERT_EQ(ddp->optimizers().size(), 2u);
  for (const Optimizer* optimizer : ddp->optimizers()) {
    SCOPED_TRACE(fmt::format("device {}", optimizer->device().index()));
    EXPECT_EQ(optimizer->steps(), 2);
    EXPECT_EQ(momentum_of(*optimizer), want);
  }
}

TEST(TrainingState, EverySeedRoundTripsAndTagsCannotOverwriteTheState) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  auto model = models::make_mlp(rt->device(0), {16}, 9);
  auto engine = make_engine(*rt, *model, SgdOptions{0.05f, 0.9f}, options_for(EngineKind::single));
  TrainingProgress progress;
  progress.seed = std::numeric_limits<std::uint64_t>::max();  // dp_train --seed takes any uint64
  const std::string path = dir.file("seed.safetensors");
  TrainingState::save(path, engine->model(), *engine->optimizers()[0], progress);
  const TrainingState state = TrainingState::read(path);
  EXPECT_EQ(state.progress().seed, std::numeric_limits<std::uint64_t>::max());
  // Saved before any step: the momentum is zeros (the first step sets it), never stale memory.
  for (float v : state.file().at("optimizer.momentum.fc1.weight").to_f32()) ASSERT_EQ(v, 0.0f);
  for (const char* key : {"step", "optimizer", "optimizer_steps", "sgd_steps", "epoch", "seed", "format"}) {
    TrainingProgress clash;
    clash.tags[key] = "7";
    EXPECT_THROW(TrainingState::save(dir.file("clash.safetensors"), engine->model(), *engine->optimizers()[0], clash),
                 InvalidArgument)
        << key;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("clash.safetensors"))) << "nothing written for a refused save";
}

// A diverged model is never saved: NonFiniteError names the tensor, and the file there stays.
TEST(TrainingState, ANonFiniteStateIsNotSaved) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  auto model = models::make_mlp(rt->device(0), {16}, 9);
  auto engine = make_engine(*rt, *model, SgdOptions{0.05f, 0.9f}, options_for(EngineKind::single));
  const std::string path = dir.file("kept.safetensors");
  TrainingState::save(path, engine->model(), *engine->optimizers()[0], {});
  const auto before = safetensors::read(path);
  const float inf = std::numeric_limits<float>::infinity();
  const Stream stream = rt->device(0).create_stream();
  stream.copy(model->params_flat() + 5, &inf, sizeof(float));
  stream.synchronize();
  try {
    TrainingState::save(path, engine->model(), *engine->optimizers()[0], {});
    ADD_FAILURE() << "a non-finite state was saved";
  } catch (const NonFiniteError& e) {
    EXPECT_TRUE(mentions(e.what(), {path, "'fc1.weight'", "non-finite"})) << e.what();
  }
  EXPECT_EQ(safetensors::read(path).at("fc1.weight").data, before.at("fc1.weight").data) << "the old file stays";
}

TEST(TrainingState, RefusesWhatIsNotAUsableTrainingState) {
  auto rt = test::sim_runtime(1);
  const TempDir dir;
  const std::string good = dir.file("good.safetensors");
  train_and_save(*rt, SgdOptions{0.05f, 0.9f}, 2, good);
  const safetensors::File original = safetensors::read(good);

  // Each case edits a copy of the good file; read() must fail naming the file and the problem.
  // A plain state dict (what dp::state_dict gives) has no training metadata at all.
  safetensors::File plain = original;
  plain.metadata.clear();
  const std::string plain_path = dir.file("plain.safetensors");
  EXPECT_TRUE(mentions(read_error(plain, plain_path), {plain_path, "not a training checkpoint"}));

  safetensors::File negative = original;
  negative.metadata["dp.step"] = "-1";
  const std::string step_error = read_error(negative, dir.file("negative.safetensors"));
  EXPECT_TRUE(mentions(step_error, {"negative.safetensors", "'dp.step' = '-1' is not a number"}));

  // Trailing characters are not a number either (stoll alone would read "3x" as 3).
  safetensors::File trailing = original;
  trailing.metadata["dp.epoch"] = "3x";
  const std::string trailing_error = read_error(trailing, dir.file("trailing.safetensors"));
  EXPECT_TRUE(mentions(trailing_error, {"'dp.epoch' = '3x'", "is not a number"}));

  // A newer format than this dp knows is refused, not half-read.
  safetensors::File newer = original;
  newer.metadata["dp.format"] = "3";
  EXPECT_TRUE(mentions(read_error(newer, dir.file("newer.safetensors")), {"format 3 is newer"}));
  safetensors::File no_kind = original;
  no_kind.metadata.erase("dp.optimizer");
  EXPECT_TRUE(mentions(read_error(no_kind, dir.file("nokind.safetensors")), {"'dp.optimizer' is missing"}));

  safetensors::File no_optimizer_steps = original;
  no_optimizer_steps.metadata.erase("dp.optimizer_steps");
  const std::string missing_error = read_error(no_optimizer_steps, dir.file("missing.safetensors"));
  EXPECT_TRUE(mentions(missing_error, {"'dp.optimizer_steps'", "is missing"}));

  // Saved without momentum, loaded into optimizers with momentum: refused before anything is
  // written, so the optimizer keeps its step count and buffer.
  const std::string plain_sgd = dir.file("no_momentum.safetensors");
  train_and_save(*rt, SgdOptions{0.05f}, 2, plain_sgd);
  const TrainingState no_momentum = TrainingState::read(plain_sgd);
  auto model = models::make_mlp(rt->device(0), {16}, 14);
  auto engine = make_engine(*rt, *model, SgdOptions{0.05f, 0.9f}, options_for(EngineKind::single));
  const Data d = make_data(6, 90);
  const Batch batch = d.batch();
  engine->train_step({&batch, 1});
  engine->synchronize();
  const std::vector<float> momentum = momentum_of(*engine->optimizers()[0]);
  try {
    no_momentum.load_optimizers(*model, engine->optimizers());
    ADD_FAILURE() << "a momentum optimizer loaded a state without momentum";
  } catch (const Error& e) {
    EXPECT_TRUE(mentions(e.what(), {plain_sgd, "no momentum buffer", "'optimizer.momentum.fc1."}));
  }
  EXPECT_EQ(engine->optimizers()[0]->steps(), 1);
  EXPECT_EQ(momentum_of(*engine->optimizers()[0]), momentum);

  // A buffer of the wrong size is refused the same way (a file from another architecture).
  safetensors::File misfit = original;
  const std::array<float, 3> three{1.0f, 2.0f, 3.0f};
  misfit.tensors["optimizer.momentum.fc1.bias"] = safetensors::make_f32({3}, three.data());
  const std::string misfit_path = dir.file("misfit.safetensors");
  safetensors::write(misfit_path, misfit);
  try {
    TrainingState::read(misfit_path).load_optimizers(*model, engine->optimizers());
    ADD_FAILURE() << "a misfit momentum buffer was loaded";
  } catch (const Error& e) {
    EXPECT_TRUE(mentions(e.what(), {misfit_path, "momentum.fc1.bias' has 3", "expected 16 F32"}));
  }
  EXPECT_EQ(engine->optimizers()[0]->steps(), 1);
  EXPECT_EQ(momentum_of(*engine->optimizers()[0]), momentum);
}

// ---------------------------------------------------------------------------------------------
// shapes, Scratch, span kinds

TEST(Shape, NumelAndFormatting) {
  EXPECT_EQ(numel({}), 1u);  // a scalar
  const std::vector<std::int64_t> shape{2, 3, 4};
  EXPECT_EQ(numel(shape), 24u);
  const std::vector<std::int64_t> empty_extent{2, 0, 4};
  EXPECT_EQ(numel(empty_extent), 0u);
  // A forged shape must not wrap around into a small allocation.
  const std::vector<std::int64_t> negative{2, -3};
  EXPECT_THROW(numel(negative), InvalidArgument);
  const std::vector<std::int64_t> huge{std::int64_t{1} << 40, std::int64_t{1} << 40};
  try {
    numel(huge);
    ADD_FAILURE() << "2^80 elements counted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(mentions(e.what(), {format_shape(huge)}));
  }

  // An empty extent makes zero elements wherever it stands, before any overflow could count.
  const std::vector<std::int64_t> huge_but_empty{std::int64_t{1} << 40, std::int64_t{1} << 40, 0};
  EXPECT_EQ(numel(huge_but_empty), 0u);

  const std::vector<std::int64_t> two_by_three{2, 3};
  EXPECT_EQ(format_shape(two_by_three), "[2, 3]");
  EXPECT_EQ(format_shape({}), "[]");
  EXPECT_EQ(format_dims({{"N", 2}, {"C", 3}}), "(N=2, C=3)");
  EXPECT_EQ(format_dims({}), "()");
}

TEST(Scratch, GrowsOnlyAndCopiesStartEmpty) {
  auto rt = test::sim_runtime(2);
  Device& device = rt->device(0);
  Scratch scratch;
  EXPECT_EQ(scratch.size(), 0u);
  float* first = scratch.get<float>(device, 10);
  EXPECT_EQ(scratch.size(), 10 * sizeof(float));
  EXPECT_EQ(scratch.get<float>(device, 4), first);  // smaller: reused
  EXPECT_EQ(scratch.get<float>(device, 10), first);
  float* grown = scratch.get<float>(device, 11);  // larger: a new buffer (the old one was alive)
  EXPECT_NE(grown, first);
  EXPECT_EQ(scratch.size(), 11 * sizeof(float));

  // Copies (a replicated layer) own nothing of the original's; an assignment keeps its own.
  const Scratch copy(scratch);
  EXPECT_EQ(copy.size(), 0u);
  EXPECT_EQ(copy.data(), nullptr);
  Scratch assigned;
  float* own = assigned.get<float>(device, 2);
  assigned = scratch;
  EXPECT_EQ(assigned.data(), own);
  EXPECT_EQ(scratch.data(), grown);

  // With `retired`, the outgrown buffer is kept there (work queued on it may still wait for
  // another device) rather than freed; the first allocation retires nothing.
  std::vector<DeviceBuffer> retired;
  Scratch kept;
  float* small = kept.get<float>(device, 1, &retired);
  EXPECT_TRUE(retired.empty());
  float* large = kept.get<float>(device, 100, &retired);
  ASSERT_EQ(retired.size(), 1u);
  EXPECT_EQ(retired[0].data(), small);
  EXPECT_NE(large, small);
  // Another device needs its own buffer, whatever the size.
  kept.get<float>(rt->device(1), 1, &retired);
  ASSERT_EQ(retired.size(), 2u);
  EXPECT_EQ(retired[1].data(), large);
  EXPECT_EQ(retired[1].device(), 0);
}

TEST(Trace, SpanKindNamesAndBusyness) {
  EXPECT_EQ(to_string(SpanKind::gemm), "gemm");
  EXPECT_EQ(to_string(SpanKind::collective), "collective");
  // Event records and waits and host callbacks neither compute nor move data.
  static_assert(!is_busy(SpanKind::sync) && !is_busy(SpanKind::host));
  EXPECT_FALSE(is_busy(SpanKind::sync));
  EXPECT_FALSE(is_busy(SpanKind::host));
  for (SpanKind kind : {SpanKind::kernel, SpanKind::gemm, SpanKind::copy, SpanKind::collective})
    EXPECT_TRUE(is_busy(kind)) << to_string(kind);
}

}  // namespace
}  // namespace dp
