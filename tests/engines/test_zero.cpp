// test_zero.cpp — ZeRO stages 1 and 2 at the engine level, on 2-4 simulated devices: their
// parameters, whole optimizer state and losses are plain DDP's bit for bit (SGD with momentum and
// AdamW, several buckets, a frozen layer, decay groups; stage 2 also with clipping, accumulation,
// autocast and graphs), each rank keeps a 1/n slice of the state (stage 2: and of the gradients,
// beside a few buckets' slots), a checkpoint's whole state goes back into the slices, a step moves
// plain DDP's bytes, and a lost device's slice survives in its host copy.
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <gtest/gtest.h>
#include <optional>

#include "ddp_data.h"
#include "dp/engines/ddp.h"
#include "dp/engines/engine.h"
#include "dp/models/gpt.h"
#include "dp/models/mlp.h"
#include "dp/runtime/error.h"
#include "forwarding_model.h"
#include "test_util.h"

namespace dp {
namespace {

std::vector<float> download(const Device& device, const float* data, std::size_t count) {
  Stream s = const_cast<Device&>(device).create_stream();
  std::vector<float> out(count);
  s.copy(out.data(), data, count * sizeof(float));
  return out;
}

// The largest rank's slice, in bytes: what a device keeps of the gradients beside the whole under stage 1.
std::size_t largest_slice(Engine& engine) {
  std::size_t most = 0;
  for (Optimizer* o : engine.optimizers()) most = std::max(most, o->param_count() * sizeof(float));
  return most;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct ZeroRun {
  std::unique_ptr<Runtime> runtime;
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::vector<float> losses;
  std::uint64_t sent = 0;  // by every device, over the steps

  EngineOptions options;

  ZeroRun(int n, int zero, const OptimizerOptions& optimizer, const std::vector<std::string>& frozen,
          const std::function<void(EngineOptions&)>& more = {}) {
    runtime = test::sim_runtime(n);
    model = build(runtime->device(0));
    options.kind = EngineKind::ddp;
    options.zero = zero;
    options.first_bucket_mb = 1000.0 / (1 << 20);  // several buckets, each cut in n blocks
    options.bucket_cap_mb = 20000.0 / (1 << 20);
    options.frozen = frozen;
    options.weight_decay_on = WeightDecayOn::matrices;
    if (more) more(options);
    engine = make_engine(*runtime, *model, optimizer, options);
  }
  static std::unique_ptr<Model> build(Device& device) { return models::make_mlp(device, {48, 24}, 5); }
  void train(const test::Data& data, int steps, int per_rank) {
    const int n = engine->world_size();
    const int micro = options.accumulate;
    runtime->reset_link_traffic();
    for (int s = 0; s < steps; ++s) {
      // Rank r's micro-batches are batches [r * micro, (r + 1) * micro).
      std::vector<Batch> batches;
      for (const Batch& b : test::shards(data, s * n * per_rank * micro, n * micro, per_rank)) batches.push_back(b);
      losses.push_back(engine->train_step(batches));
    }
    engine->synchronize();
    for (const int d : engine->device_ids()) sent += runtime->bytes_sent(d);
  }
  std::vector<float> params() const {
    return download(engine->model().device(), engine->model().params_flat(), engine->model().param_count());
  }
  // The whole optimizer state, buffer after buffer, as a checkpoint holds it.
  std::vector<float> whole_state() {
    std::vector<float> out;
    Optimizer& whole = *engine->whole_optimizers()[0];
    for (const auto& buffer : whole.state()) {
      const auto v = download(runtime->device(engine->device_ids()[0]), buffer.data, whole.param_count());
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
};

// Devices and ZeRO stage.
class Zero : public ::testing::TestWithParam<std::tuple<int, int>> {};
INSTANTIATE_TEST_SUITE_P(DevicesAndStage, Zero, ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return fmt::format("{}Devices_Stage{}", std::get<0>(info.param), std::get<1>(info.param));
                         });

TEST_P(Zero, IsPlainDdpBitForBitWithASliceOfTheState) {
  const auto [n, stage] = GetParam();
  const int steps = 6, per_rank = 3;
  const test::Data data = test::make_data(steps * n * per_rank, 11);
  const std::vector<std::pair<std::string, OptimizerOptions>> optimizers = {
      {"sgd", SgdOptions{0.05f, 0.9f, 1e-3f, false}}, {"adamw", AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.1}}};
  for (const auto& [name, optimizer] : optimizers) {
    for (const std::vector<std::string>& frozen : {std::vector<std::string>{}, std::vector<std::string>{"fc2"}}) {
      SCOPED_TRACE(fmt::format("{} devices, {}, {} frozen", n, name, frozen.size()));
      ZeroRun plain(n, 0, optimizer, frozen), zero(n, stage, optimizer, frozen);
      plain.train(data, steps, per_rank);
      zero.train(data, steps, per_rank);
      EXPECT_TRUE(same_bits(plain.losses, zero.losses));
      EXPECT_TRUE(same_bits(plain.params(), zero.params())) << "parameters differ";
      EXPECT_TRUE(same_bits(plain.whole_state(), zero.whole_state())) << "optimizer state differs";
      // The buckets reduce-scattered, the parameters all-gathered: plain DDP's bytes.
      EXPECT_EQ(zero.sent, plain.sent);
      // Each rank's state covers its blocks of every bucket: 1/n of the trainable parameters.
      std::size_t slices = 0;
      for (Optimizer* o : zero.engine->optimizers()) {
        const std::size_t count = o->param_count();
        EXPECT_LE(count, plain.model->param_count() / static_cast<std::size_t>(n) + 8);
        slices += count;
      }
      std::size_t trainable = 0;
      for (const auto& range : plain.engine->optimizers()[0]->trainable()) trainable += range.count;
      EXPECT_EQ(slices, trainable) << "the slices cover the trainable parameters once";
      const std::size_t whole = plain.model->param_count() * sizeof(float);
      const std::size_t stage_one = whole + largest_slice(*zero.engine);
      EXPECT_EQ(plain.engine->gradient_bytes(), whole);
      if (stage == 1) {
        EXPECT_EQ(zero.engine->gradient_bytes(), stage_one);
      } else {
        // Its slice of the gradients and the slots, and no whole buffer. Here fc1's weight is most of
        // the model and a bucket of its own: a slot as large (ZeroTwo.KeepsASliceOfAGptsGradients
        // has a model of equal layers).
        EXPECT_LE(zero.engine->gradient_bytes(), stage_one);
        EXPECT_THROW((void)zero.model->grads_flat(), Error);
      }
    }
  }
}

// Stage 2 where the gradients must stay whole (accumulation adds micro-batches into the whole
// buffer) is stage 1, with its bits; with clipping (each slot all-reduced, its tensors' norms taken
// from it), under autocast and with graphs the slots give plain DDP's bits too, with several slots
// taken in turn (small buckets of a model of several layers), and the model has its whole gradients
// back once the engine is gone.
TEST(ZeroTwo, IsPlainDdpBitForBitWhereverItRuns) {
  const int n = 3, per_rank = 2, steps = 5;
  const OptimizerOptions adamw = AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.1};
  const std::vector<std::pair<std::string, std::function<void(EngineOptions&)>>> variants = {
      {"clipping", [](EngineOptions& o) { o.step.clip_grad_norm = 0.05; }},
      {"clipping with graphs",
       [](EngineOptions& o) {
         o.step.clip_grad_norm = 0.05;
         o.graphs = true;
       }},
      {"accumulation", [](EngineOptions& o) { o.accumulate = 2; }},
      {"autocast", [](EngineOptions& o) { o.amp = Autocast::bf16; }},
      {"graphs", [](EngineOptions& o) { o.graphs = true; }},
      {"tiny buckets", [](EngineOptions& o) { o.first_bucket_mb = o.bucket_cap_mb = 100.0 / (1 << 20); }}};
  for (const auto& [name, more] : variants) {
    SCOPED_TRACE(name);
    ZeroRun plain(n, 0, adamw, {"fc2"}, more), zero(n, 2, adamw, {"fc2"}, more);
    const test::Data data = test::make_data(steps * n * per_rank * plain.options.accumulate, 13);
    plain.train(data, steps, per_rank);
    zero.train(data, steps, per_rank);
    EXPECT_TRUE(same_bits(plain.losses, zero.losses));
    EXPECT_TRUE(same_bits(plain.params(), zero.params())) << "parameters differ";
    EXPECT_TRUE(same_bits(plain.whole_state(), zero.whole_state())) << "optimizer state differs";
    // Clipping all-reduces the buckets, then the parameters are all-gathered (as stage 1 does).
    if (name.find("clipping") != std::string::npos) {
      // The norm before clipping, from the slots: plain DDP's, and past the bound (it clipped).
      const std::optional<float> norm = zero.engine->last_grad_norm();
      ASSERT_TRUE(norm.has_value());
      EXPECT_EQ(*norm, *plain.engine->last_grad_norm());
      EXPECT_GT(*norm, 0.05f);
    }
    if (name.find("clipping") == std::string::npos) {
      EXPECT_EQ(zero.sent, plain.sent);
    }
    const bool whole = name == "accumulation";
    const std::size_t stage_one = plain.engine->gradient_bytes() + largest_slice(*zero.engine);
    if (whole) {
      EXPECT_EQ(zero.engine->gradient_bytes(), stage_one);
    } else {
      EXPECT_THROW((void)zero.model->grads_flat(), Error);
    }
    zero.engine.reset();
    if (whole) continue;
    const std::vector<TensorRef> gradients = zero.model->gradients();  // the flat buffer back, zeroed
    ASSERT_FALSE(gradients.empty());
    const auto first = download(zero.model->device(), static_cast<const float*>(gradients[0].data), 4);
    EXPECT_EQ(first, std::vector<float>(4, 0.0f));
  }
}

// A GPT of equal blocks on 4 devices, buckets of about a block: a device keeps its quarter of the
// gradients and a few buckets' slots (the tied embedding's, held through the whole backward, and two
// taken in turn), under half of the whole; the losses and parameters are plain DDP's.
TEST(ZeroTwo, KeepsASliceOfAGptsGradients) {
  const int n = 4, batch = 2, steps = 3;
  const models::GptConfig config{.vocab = 64, .context = 16, .layers = 6, .heads = 2, .width = 32};
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> targets;
  for (int i = 0; i < steps * n * batch * config.context; ++i) {
    tokens.push_back((i * 37 + 11) % config.vocab);
    targets.push_back((i * 37 + 48) % config.vocab);
  }
  const OptimizerOptions adamw = AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.1};
  std::vector<std::vector<float>> params, losses;
  std::vector<std::size_t> bytes;
  for (const int stage : {0, 2}) {
    auto runtime = test::sim_runtime(n);
    auto model = models::make_gpt(runtime->device(0), config, 3);
    EngineOptions options;
    options.kind = EngineKind::ddp;
    options.zero = stage;
    options.graphs = true;
    options.first_bucket_mb = options.bucket_cap_mb = 8000.0 / (1 << 20);  // a block: 12.6k floats
    auto engine = make_engine(*runtime, *model, adamw, options);
    losses.emplace_back();
    for (int s = 0; s < steps; ++s) {
      std::vector<Batch> batches;
      for (int r = 0; r < n; ++r) {
        const std::size_t at = static_cast<std::size_t>((s * n + r) * batch * config.context);
        batches.push_back(Batch{tokens.data() + at, targets.data() + at, batch});
      }
      losses.back().push_back(engine->train_step(batches));
    }
    engine->synchronize();
    params.push_back(download(model->device(), model->params_flat(), model->param_count()));
    bytes.push_back(engine->gradient_bytes());
  }
  EXPECT_TRUE(same_bits(losses[0], losses[1]));
  EXPECT_TRUE(same_bits(params[0], params[1])) << "parameters differ";
  EXPECT_LT(static_cast<double>(bytes[1]), 0.5 * static_cast<double>(bytes[0])) << bytes[1] << " of " << bytes[0];
}

// no_sync would accumulate into the whole buffer that stage 2 gave up: refused, naming the way out;
// a model that cannot place its gradients elsewhere is refused when the engine is made.
TEST(ZeroTwo, RefusesNoSyncAndModelsThatKeepTheirGradients) {
  const OptimizerOptions sgd = SgdOptions{};
  ZeroRun zero(2, 2, sgd, {});
  auto& ddp = dynamic_cast<DistributedDataParallel&>(*zero.engine);
  const test::Data data = test::make_data(8, 1);
  const auto batches = test::shards(data, 0, 2, 2);
  {
    auto scope = ddp.no_sync();
    try {
      (void)ddp.forward_backward(batches);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("no_sync accumulates gradients in the whole gradient buffer"),
                std::string::npos)
          << e.what();
    }
  }
  zero.engine.reset();

  class Keeps final : public test::ForwardingModel {
   public:
    using ForwardingModel::ForwardingModel;
    bool place_gradients(GradientSlots* slots) override { return slots == nullptr; }
    std::unique_ptr<Model> replicate(Device& device) const override {
      return std::make_unique<Keeps>(inner().replicate(device));
    }
  };
  auto runtime = test::sim_runtime(2);
  Keeps keeps(ZeroRun::build(runtime->device(0)));
  EngineOptions options;
  options.kind = EngineKind::ddp;
  options.zero = 2;
  try {
    make_engine(*runtime, keeps, sgd, options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write its gradients elsewhere"), std::string::npos) << e.what();
  }
}

// A checkpoint's whole state, loaded back, goes into the slices: training on from it is training
// on without the round trip.
TEST_P(Zero, WholeStateGoesBackIntoTheSlices) {
  const auto [n, stage] = GetParam();
  const int per_rank = 2;
  const test::Data data = test::make_data(8 * n * per_rank, 3);
  const OptimizerOptions adamw = AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.0};
  ZeroRun straight(n, stage, adamw, {}), resumed(n, stage, adamw, {});
  straight.train(data, 8, per_rank);
  resumed.train(data, 4, per_rank);
  // Scramble the slices, then load the whole state gathered before.
  const std::vector<float> state = resumed.whole_state();
  Optimizer& whole = *resumed.engine->whole_optimizers()[0];
  const auto optimizers = resumed.engine->optimizers();
  for (std::size_t r = 0; r < optimizers.size(); ++r) {
    Optimizer* o = optimizers[r];
    Stream s = resumed.runtime->device(resumed.engine->device_ids()[r]).create_stream();
    const std::vector<float> junk(o->param_count(), 7.0f);
    for (const auto& buffer : o->state()) s.copy(buffer.data, junk.data(), junk.size() * sizeof(float));
  }
  Stream s = resumed.runtime->device(resumed.engine->device_ids()[0]).create_stream();
  std::size_t at = 0;
  for (const auto& buffer : whole.state()) {
    s.copy(buffer.data, state.data() + at, whole.param_count() * sizeof(float));
    at += whole.param_count();
  }
  s.synchronize();
  resumed.engine->whole_optimizers_loaded();
  const test::Data rest{std::vector<float>(data.x.begin() + 4 * n * per_rank * 784, data.x.end()),
                        std::vector<std::int64_t>(data.y.begin() + 4 * n * per_rank, data.y.end())};
  resumed.train(rest, 4, per_rank);
  EXPECT_TRUE(same_bits(straight.params(), resumed.params()));

  // A checkpoint's whole state is transient: once training goes on, no device keeps more than it did.
  std::vector<std::size_t> before;
  for (const int d : straight.engine->device_ids()) before.push_back(straight.runtime->device(d).memory().in_use);
  (void)straight.whole_state();
  straight.train(rest, 1, per_rank);
  const auto ids = straight.engine->device_ids();
  for (std::size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(straight.runtime->device(ids[i]).memory().in_use, before[i]) << "device " << ids[i];
}

// A lost device takes its rank's slice of the state with it, but in one process each rank also
// keeps a host copy of its part after every step: survivor() puts the last step that every rank
// kept together on a surviving device, plain DDP's parameters and optimizer state there, bit for bit.
TEST_P(Zero, ASurvivorHoldsTheLostRanksPartFromItsHostCopy) {
  const auto [n, stage] = GetParam();
  const int per_rank = 2, steps = 3;
  const test::Data data = test::make_data((steps + 1) * n * per_rank, 5);
  const OptimizerOptions adamw = AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.1};
  for (const int lost : {0, n - 1}) {
    SCOPED_TRACE(fmt::format("{} devices, device {} lost", n, lost));
    ZeroRun plain(n, 0, adamw, {"fc2"}), zero(n, stage, adamw, {"fc2"});
    plain.train(data, steps, per_rank);
    zero.train(data, steps, per_rank);
    zero.runtime->device(lost).lose("the test's");
    EXPECT_THROW((void)zero.engine->train_step(test::shards(data, steps * n * per_rank, n, per_rank)), Error);
    const std::optional<Engine::Survivor> survivor = zero.engine->survivor();
    ASSERT_TRUE(survivor.has_value());
    EXPECT_EQ(survivor->steps, steps);
    EXPECT_NE(survivor->device, lost);
    const Device& device = survivor->model->device();
    EXPECT_TRUE(
        same_bits(download(device, survivor->model->params_flat(), survivor->model->param_count()), plain.params()))
        << "parameters differ";
    std::vector<float> state;
    for (const auto& buffer : survivor->optimizer->state()) {
      const auto v = download(device, buffer.data, survivor->optimizer->param_count());
      state.insert(state.end(), v.begin(), v.end());
    }
    EXPECT_TRUE(same_bits(state, plain.whole_state())) << "optimizer state differs";
    EXPECT_EQ(survivor->optimizer->steps(), steps);
  }
}

// go_on_without_lost takes that state to an engine on the survivors: plain DDP's parameters and
// whole optimizer state there too; a model of another shape is refused, and without host copies
// there is nothing to go on from.
TEST(ZeroOneGoesOn, OnTheSurvivorsFromTheHostCopies) {
  const int n = 3, per_rank = 2, steps = 2;
  const test::Data data = test::make_data((steps + 1) * n * per_rank, 7);
  const OptimizerOptions adamw = AdamWOptions{1e-2, 0.9, 0.999, 1e-8, 0.1};
  const auto lose = [&](ZeroRun& run, int device) {
    run.train(data, steps, per_rank);
    run.runtime->device(device).lose("the test's");
    EXPECT_THROW((void)run.engine->train_step(test::shards(data, steps * n * per_rank, n, per_rank)), Error);
  };
  ZeroRun plain(n, 0, adamw, {}), zero(n, 1, adamw, {});
  plain.train(data, steps, per_rank);
  lose(zero, 1);
  std::optional<Survivors> on =
      go_on_without_lost(*zero.runtime, std::move(zero.engine), ZeroRun::build, adamw, zero.options);
  ASSERT_TRUE(on.has_value());
  EXPECT_EQ(on->devices, (std::vector<int>{0, 2}));
  EXPECT_EQ(on->steps, steps);
  zero.engine = std::move(on->engine);
  zero.model = std::move(on->model);
  EXPECT_EQ(zero.engine->device_ids(), (std::vector<int>{0, 2}));
  EXPECT_TRUE(same_bits(zero.params(), plain.params())) << "parameters differ";
  EXPECT_TRUE(same_bits(zero.whole_state(), plain.whole_state())) << "optimizer state differs";
  EXPECT_EQ(zero.engine->optimizers().front()->steps(), steps);

  ZeroRun other(n, 1, adamw, {});
  lose(other, 0);
  try {
    (void)go_on_without_lost(
        *other.runtime, std::move(other.engine),
        [](Device& device) {
          return models::make_mlp(device, {48, 12}, 5);
        },
        adamw, other.options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the model built has"), std::string::npos) << e.what();
  }

  ZeroRun uncopied(n, 1, adamw, {});
  uncopied.options.zero_host_copies = false;
  uncopied.engine.reset();
  uncopied.engine = make_engine(*uncopied.runtime, *uncopied.model, adamw, uncopied.options);
  lose(uncopied, 2);
  EXPECT_FALSE(
      go_on_without_lost(*uncopied.runtime, std::move(uncopied.engine), ZeroRun::build, adamw, uncopied.options)
          .has_value());
}

TEST(ZeroOneRefuses, AModelThatLeavesARankNothingToUpdate) {
  auto runtime = test::sim_runtime(4);
  auto model = models::make_mlp(runtime->device(0), {}, 1);  // one bucket of 7850 floats: every rank has a block
  EngineOptions options;
  options.kind = EngineKind::ddp;
  options.zero = 1;
  options.frozen = {"fc1"};  // nothing left to train
  try {
    make_engine(*runtime, *model, SgdOptions{}, options);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("leave global rank 0 of 4 nothing to update"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dp
