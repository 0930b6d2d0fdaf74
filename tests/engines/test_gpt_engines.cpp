// test_gpt_engines.cpp — a language model through every engine: nanoGPT's tiny GPT (vocab 32,
// context 16, width 32, 2 layers of 2 heads) takes one SGD step on 4 sequences of 16 tokens, a
// next-token target per position, single, DataParallel and DDP over 2 devices, fp32 and under bf16
// autocast, against torch's step (tests/golden/make_transformer_goldens.py). The loss is the mean
// over all 64 tokens in each engine (DDP: the mean of the ranks' equal-sized means). The engines'
// tests run on each backend (Backends/GptOnBackend.*/sim and /cuda), the model's own on the sim.
#include <cmath>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/models/gpt.h"
#include "dp/nn/sequential.h"
#include "forwarding_model.h"
#include "test_util.h"

namespace dp {
namespace {

models::GptConfig tiny_gpt(const safetensors::File& golden) {
  const auto at = [&](const char* key) { return std::stoi(golden.metadata.at(key)); };
  return {at("vocab"), at("context"), at("layers"), at("heads"), at("width")};
}

// The golden's sequences: token ids as the model's int32 inputs and their next-token targets, and
// the batches one engine's step takes of them (DDP: a share per rank).
struct GoldenTokens {
  explicit GoldenTokens(const safetensors::File& golden)
      : batch(std::stoi(golden.metadata.at("batch"))), targets(golden.at("data.targets").to_i64()) {
    const auto idx = golden.at("data.idx").to_i64();
    ids.assign(idx.begin(), idx.end());
  }
  std::vector<Batch> batches(const Engine& engine) const {
    const int pieces = engine.batches_per_step(), per_batch = batch / pieces;
    const std::size_t tokens = ids.size() / static_cast<std::size_t>(pieces);
    std::vector<Batch> out;
    for (int b = 0; b < pieces; ++b) out.emplace_back(ids.data() + b * tokens, targets.data() + b * tokens, per_batch);
    return out;
  }
  int batch;
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> targets;
};

struct EngineRun {
  EngineKind kind;
  int devices;
};

// The engines on each backend (cuda: two dp devices on one GPU where there is one, their
// collectives on the device ring), against torch's step; the sim's instances run everywhere.
class GptOnBackend : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Runtime> runtime(int devices) const { return test::runtime_or_skip(GetParam(), devices); }
  bool skip() const { return GetParam() == "cuda" && Runtime::cuda_device_count() == 0; }

  // The golden's GPT (its initial parameters; `config` says the dropout) on `devices` devices of this
  // backend, in an engine of `options` (single: on device 0).
  struct Run {
    std::unique_ptr<Runtime> runtime;
    std::unique_ptr<Model> model;
    Stream stream;  // device 0's
    std::unique_ptr<Engine> engine;
    std::vector<float> params() const {
      return test::to_host(stream, engine->model().params_flat(), engine->model().param_count());
    }
  };
  Run gpt_run(const safetensors::File& golden, const models::GptConfig& config, int devices, EngineOptions options,
              const OptimizerOptions& optimizer) const {
    Run run;
    run.runtime = runtime(devices);
    run.model = models::make_gpt(run.runtime->device(0), config, 1);
    run.stream = run.runtime->device(0).create_stream();
    load_state_dict(*run.model, run.stream, golden, "init.");
    if (options.kind == EngineKind::single) options.device_ids = std::vector<int>{0};
    run.engine = make_engine(*run.runtime, *run.model, optimizer, options);
    return run;
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, GptOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });
#define DP_SKIP_WITHOUT_GPU() \
  if (skip()) GTEST_SKIP() << "no CUDA device: the cuda instances train on a GPU"

TEST_P(GptOnBackend, OneStepInEveryEngineIsTorchs) {
  DP_SKIP_WITHOUT_GPU();
  for (const bool amp : {false, true}) {
    const std::string mode = amp ? "amp" : "fp32";
    const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
    const models::GptConfig config = tiny_gpt(golden);
    const SgdOptions sgd{std::stof(golden.metadata.at("lr")), 0.0f, 0.0f, false};
    const GoldenTokens data(golden);
    ASSERT_EQ(data.targets.size(), static_cast<std::size_t>(data.batch * config.context));
    std::vector<std::vector<float>> results;
    for (const EngineRun run :
         {EngineRun{EngineKind::single, 1}, EngineRun{EngineKind::dp, 2}, EngineRun{EngineKind::ddp, 2}}) {
      SCOPED_TRACE(fmt::format("{} on {} device(s), {}", to_string(run.kind), run.devices, mode));
      auto rt = runtime(run.devices);
      auto model = models::make_gpt(rt->device(0), config, 1);
      EXPECT_EQ(model->targets_per_sample(), config.context);
      EXPECT_EQ(model->output_features(), config.vocab);
      const Stream s = rt->device(0).create_stream();
      const auto keys = load_state_dict(*model, s, golden, "init.");  // strict: nanoGPT's names
      EXPECT_TRUE(keys.missing.empty());
      EXPECT_TRUE(keys.unexpected.empty());
      EngineOptions options;
      options.kind = run.kind;
      options.amp = amp ? Autocast::bf16 : Autocast::off;
      if (run.kind == EngineKind::single) options.device_ids = std::vector<int>{0};
      auto engine = make_engine(*rt, *model, sgd, options);
      const float loss = engine->train_step(data.batches(*engine));
      // Autocast: the residual stream fp32 as torch's type promotion keeps it (x + bf16 branch; in bf16
      // the loss was 4.2e-4 from torch's). Both heads round their logits to bf16, which magnifies the
      // attention's difference (torch's explicit one rounds its scores): in torch, hidden states moved
      // by 1e-4 (relative, at random) move this loss by up to 3.8e-4 through a bf16 head, 2.7e-5
      // through an fp32 one. dp's is 1.7e-4 from torch's (8e-5 while its head was fp32).
      EXPECT_NEAR(loss, golden.at(mode + ".loss").to_f32()[0], amp ? 5e-4 : 2e-6);
      engine->synchronize();
      std::vector<float> all;
      int checked = 0;
      for (const TensorRef& p : engine->model().parameters()) {
        const auto got = test::to_host(s, p.as<float>(), p.numel());
        const auto want = golden.at(mode + ".step." + p.name).to_f32();
        // fp32: torch's arithmetic to rounding (cuda: cuBLAS's strict fp32 GEMMs sum in their own
        // order, a few ulps). Autocast: both run c_attn and c_proj in bf16, but torch's explicit
        // attention rounds the scores and the probabilities to bf16 where dp's fused one keeps them in
        // fp32 (rounding only its output); the step moves a parameter by up to ~1e-2.
        EXPECT_TRUE(test::all_close(got, want, amp ? 2e-2 : 1e-4, amp ? 2e-4 : 2e-6)) << p.name;
        all.insert(all.end(), got.begin(), got.end());
        ++checked;
      }
      EXPECT_EQ(checked, 2 + 2 * 12 + 2);
      results.push_back(all);
    }
    // One device's step and two replicas' are the same arithmetic on the same rows, but for the order
    // of the gradients' sums; under autocast each replica also rounds its weight gradients to bf16
    // before they add up (as torch's replicas do), one rounding of the gradient more. The tied table's
    // gradient is the head's, so rounded, plus the embedding's: where the two nearly cancel, that
    // rounding is most of the sum (one element moves 1e-4 from single's).
    const double rtol = amp ? 1e-2 : 1e-5, atol = amp ? 2e-4 : 1e-7;
    EXPECT_TRUE(test::all_close(results[1], results[0], rtol, atol)) << "dp against single, " << mode;
    EXPECT_TRUE(test::all_close(results[2], results[0], rtol, atol)) << "ddp against single, " << mode;
  }
}

// The GPT with Model's default forward_for_loss: its logits reach the loss as forward()'s fp32 copy,
// and their gradient goes back through backward(), which rounds it.
class WidenedLogits final : public test::ForwardingModel {
 public:
  using ForwardingModel::ForwardingModel;
  std::unique_ptr<Model> replicate(Device& device) const override {
    return std::make_unique<WidenedLogits>(inner().replicate(device));
  }
};

// Under autocast the head's bf16 logits go to the loss as they are (DataParallel gathers and
// scatters them so): the loss widens each value and rounds its gradient once, so two steps give the
// bits of the widened copy's, in every engine (and with fixed shards).
TEST_P(GptOnBackend, Bf16LogitsTrainAsTheirWidenedCopy) {
  DP_SKIP_WITHOUT_GPU();
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  const models::GptConfig config = tiny_gpt(golden);
  const SgdOptions sgd{std::stof(golden.metadata.at("lr")), 0.9f, 0.0f, false};
  const GoldenTokens data(golden);
  for (const auto& [run, shards] : {std::pair{EngineRun{EngineKind::single, 1}, 0},
                                    {EngineRun{EngineKind::dp, 2}, 0},
                                    {EngineRun{EngineKind::ddp, 2}, 0},
                                    {EngineRun{EngineKind::ddp, 2}, 2}}) {
    SCOPED_TRACE(fmt::format("{} on {} device(s), {} shards", to_string(run.kind), run.devices, shards));
    std::vector<float> losses[2], params[2];
    for (const bool widened : {false, true}) {
      auto rt = runtime(run.devices);
      std::unique_ptr<Model> model = models::make_gpt(rt->device(0), config, 1);
      const Stream s = rt->device(0).create_stream();
      load_state_dict(*model, s, golden, "init.");
      if (widened) model = std::make_unique<WidenedLogits>(std::move(model));
      EngineOptions options;
      options.kind = run.kind;
      options.amp = Autocast::bf16;
      options.shards = shards;
      if (run.kind == EngineKind::single) options.device_ids = std::vector<int>{0};
      auto engine = make_engine(*rt, *model, sgd, options);
      for (int step = 0; step < 2; ++step) losses[widened].push_back(engine->train_step(data.batches(*engine)));
      engine->synchronize();
      params[widened] = test::to_host(s, engine->model().params_flat(), engine->model().param_count());
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_EQ(params[0], params[1]);
  }
}

// nanoGPT's optimizer: AdamW with weight decay on the matrices only (EngineOptions::weight_decay_on),
// in every engine and with ZeRO-1's slices, against torch's step with those two parameter groups.
// The golden's eps (1e-3, make_transformer_goldens.py) dominates the rounding noise of gradients
// whose true value is 0 (the key bias: softmax is shift-invariant), so the step is comparable
// across libraries too (docs/gpu.md).
TEST_P(GptOnBackend, AdamWDecaysTheMatricesOnlyAsNanoGptsGroups) {
  DP_SKIP_WITHOUT_GPU();
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  const models::GptConfig config = tiny_gpt(golden);
  const AdamWOptions adamw{1e-2, 0.9, 0.95, 1e-3, 0.1};  // eps: see make_transformer_goldens.py
  const GoldenTokens data(golden);
  const bool cuda = GetParam() == "cuda";
  for (const auto& [kind, devices, zero] : {std::tuple{EngineKind::single, 1, 0}, std::tuple{EngineKind::dp, 2, 0},
                                            std::tuple{EngineKind::ddp, 2, 0}, std::tuple{EngineKind::ddp, 2, 1}}) {
    SCOPED_TRACE(fmt::format("{} on {} device(s), zero {}", to_string(kind), devices, zero));
    EngineOptions options;
    options.kind = kind;
    options.zero = zero;
    options.weight_decay_on = WeightDecayOn::matrices;
    const Run run = gpt_run(golden, config, devices, options, adamw);
    run.engine->train_step(data.batches(*run.engine));
    run.engine->synchronize();
    for (const TensorRef& p : run.engine->model().parameters())
      EXPECT_TRUE(test::all_close(test::to_host(run.stream, p.as<float>(), p.numel()),
                                  golden.at("adamw.step." + p.name).to_f32(), cuda ? 1e-4 : 1e-5, cuda ? 1e-5 : 1e-6))
          << p.name;
  }
}

// With dropout the masks are keyed by the sample's place in the step's batch: DataParallel over two
// devices draws one device's masks on the whole batch and takes its step; the masks change the step.
TEST_P(GptOnBackend, DropoutDrawsOneDevicesMasksInDataParallel) {
  DP_SKIP_WITHOUT_GPU();
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  models::GptConfig config = tiny_gpt(golden);
  const GoldenTokens data(golden);
  std::vector<std::vector<float>> steps;
  for (const auto& [kind, devices, p] : {std::tuple{EngineKind::single, 1, 0.3}, std::tuple{EngineKind::dp, 2, 0.3},
                                         std::tuple{EngineKind::single, 1, 0.0}}) {
    config.dropout = p;
    EngineOptions options;
    options.kind = kind;
    const Run run = gpt_run(golden, config, devices, options, SgdOptions{0.5f, 0.0f, 0.0f, false});
    EXPECT_TRUE(run.model->capturable()) << "dropout reads its step from device memory";
    EXPECT_EQ(run.model->random_step_on_device() != nullptr, p > 0.0);
    run.engine->train_step(data.batches(*run.engine));
    run.engine->synchronize();
    steps.push_back(run.params());
  }
  EXPECT_TRUE(test::all_close(steps[1], steps[0], 1e-5, 1e-7)) << "dp's masks are single's";
  EXPECT_FALSE(test::all_close(steps[2], steps[0], 1e-3, 1e-5)) << "the masks changed the step";
}

// A GPT with dropout (embedding, attention's probabilities, residuals) captured into a graph: each
// replay reads its step's masks from device memory, so six steps replayed (after the eager one that
// sizes the buffers, the first of them the captured one) equal six eager steps bit for bit, in
// every engine.
TEST_P(GptOnBackend, DropoutStepsReplayedFromAGraphAreEagerStepsBitForBit) {
  DP_SKIP_WITHOUT_GPU();
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  models::GptConfig config = tiny_gpt(golden);
  config.dropout = 0.1;
  const GoldenTokens data(golden);
  for (const auto& [kind, devices] :
       {std::pair{EngineKind::single, 1}, std::pair{EngineKind::dp, 2}, std::pair{EngineKind::ddp, 2}}) {
    SCOPED_TRACE(fmt::format("{} on {} device(s)", to_string(kind), devices));
    std::vector<std::vector<float>> params, losses;
    for (const bool graphs : {false, true}) {
      EngineOptions options;
      options.kind = kind;
      options.graphs = graphs;
      const Run run = gpt_run(golden, config, devices, options, SgdOptions{0.1f, 0.9f, 0.0f, false});
      losses.emplace_back();
      for (int step = 0; step < 7; ++step) losses.back().push_back(run.engine->train_step(data.batches(*run.engine)));
      run.engine->synchronize();
      EXPECT_EQ(run.engine->graph_replays(), graphs ? 6u : 0u);
      params.push_back(run.params());
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_EQ(params[0], params[1]);
  }
}

// torch's state dict lists the tied table twice (transformer.wte.weight, lm_head.weight): a dp
// checkpoint writes both, so torch loads it with strict=True; a load takes either name, and refuses
// a file whose two copies differ.
TEST(GptEngines, TheTiedTableIsSavedUnderBothNamesAndLoadedFromEither) {
  auto rt = test::sim_runtime(1);
  const models::GptConfig config{32, 8, 1, 2, 16};
  auto model = models::make_gpt(rt->device(0), config, 5);
  const Stream s = rt->device(0).create_stream();
  const safetensors::File saved = state_dict(*model, s);
  ASSERT_TRUE(saved.has("lm_head.weight"));
  EXPECT_EQ(saved.at("lm_head.weight").data, saved.at("transformer.wte.weight").data);
  EXPECT_EQ(saved.order.back(), "lm_head.weight") << "last, as torch's state_dict() lists it";

  auto other = models::make_gpt(rt->device(0), config, 6);
  const auto keys = load_state_dict(*other, s, saved);  // strict: the alias is the model's
  EXPECT_TRUE(keys.unexpected.empty());
  EXPECT_EQ(state_dict(*other, s).at("transformer.wte.weight").data, saved.at("transformer.wte.weight").data);

  safetensors::File alias_only = saved;  // a file that names the table as the head only
  alias_only.tensors.erase("transformer.wte.weight");
  auto third = models::make_gpt(rt->device(0), config, 7);
  EXPECT_TRUE(load_state_dict(*third, s, alias_only).missing.empty());
  EXPECT_EQ(state_dict(*third, s).at("transformer.wte.weight").data, saved.at("transformer.wte.weight").data);

  safetensors::File differ = saved;
  differ.tensors.at("lm_head.weight").data[0] ^= std::byte{1};
  try {
    load_state_dict(*other, s, differ);
    FAIL() << "loaded two different tied tensors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'transformer.wte.weight' and 'lm_head.weight' differ"), std::string::npos)
        << e.what();
  }
}

// nanoGPT's dropout: attn_dropout on the probabilities. With p = 1 every probability is dropped in
// training: attention's output is c_proj's bias at every token and nothing reaches c_attn (its
// gradients are 0); in evaluation it is the plain attention.
TEST(GptEngines, AttentionDropoutDropsTheProbabilitiesInTrainingOnly) {
  auto rt = test::sim_runtime(1);
  Device& device = rt->device(0);
  const Stream s = device.create_stream();
  nn::Layers all, none;
  all.push_back(nn::make_causal_self_attention("attn", 8, 2, 1.0));
  none.push_back(nn::make_causal_self_attention("attn", 8, 2, 0.0));
  nn::SequentialModel dropping("a", device, std::move(all), {5, 1, 8}), plain("b", device, std::move(none), {5, 1, 8});
  dropping.initialize(3);
  plain.initialize(3);
  std::vector<float> x(2 * 5 * 8);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * static_cast<float>(i));
  DeviceBuffer in = test::upload(device, s, x);
  const auto bias = test::to_host(s, dropping.parameters()[3].as<float>(), 8);  // attn.c_proj.bias
  const auto y = test::to_host(s, dropping.forward(s, in.as<float>(), 2, Mode::train), x.size());
  for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], bias[i % 8]) << "element " << i;
  DeviceBuffer dy = test::upload(device, s, x);
  dropping.zero_grad(s);
  dropping.backward(s, dy.as<float>(), {});
  for (const TensorRef& g : dropping.gradients()) {
    if (!g.name.starts_with("attn.c_attn")) continue;
    for (const float v : test::to_host(s, g.as<float>(), g.numel())) ASSERT_EQ(v, 0.0f) << g.name;
  }
  EXPECT_EQ(test::to_host(s, dropping.forward(s, in.as<float>(), 2, Mode::eval), x.size()),
            test::to_host(s, plain.forward(s, in.as<float>(), 2, Mode::eval), x.size()));
}

// Evaluation scores every position: the mean loss over the tokens, and per-token top-1 accuracy.
TEST(GptEngines, EvaluationScoresEveryToken) {
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  const models::GptConfig config = tiny_gpt(golden);
  auto rt = test::sim_runtime(1);
  auto model = models::make_gpt(rt->device(0), config, 1);
  const Stream s = rt->device(0).create_stream();
  load_state_dict(*model, s, golden, "init.");
  auto engine = make_engine(*rt, *model, SgdOptions{0.1f, 0.0f, 0.0f, false}, {});
  const GoldenTokens data(golden);
  const EvalTotals totals = engine->evaluate(data.batches(*engine));
  EXPECT_EQ(totals.samples, data.batch * config.context);
  EXPECT_NEAR(totals.mean_loss(), golden.at("fp32.loss").to_f32()[0], 1e-5);
}

// Every engine asks the batch's dtype of the model before it waits for or enqueues anything: token
// ids sent as floats are refused naming both, and the parameters stay as they were.
TEST(GptEngines, FeaturesForTokenIdsAreRefusedBeforeAnyWork) {
  const auto golden = safetensors::read(test::golden_path("transformer_gpt_train"));
  const models::GptConfig config = tiny_gpt(golden);
  const GoldenTokens data(golden);
  const std::vector<float> as_floats(data.ids.begin(), data.ids.end());
  for (const EngineKind kind : {EngineKind::single, EngineKind::dp, EngineKind::ddp}) {
    auto rt = test::sim_runtime(2);
    auto model = models::make_gpt(rt->device(0), config, 1);
    EngineOptions options;
    options.kind = kind;
    if (kind == EngineKind::single) options.device_ids = std::vector<int>{0};
    auto engine = make_engine(*rt, *model, SgdOptions{0.1f, 0.0f, 0.0f, false}, options);
    const Stream s = rt->device(0).create_stream();
    const auto before = test::to_host(s, engine->model().params_flat(), engine->model().param_count());
    std::vector<Batch> batches = data.batches(*engine);
    const std::size_t tokens = data.ids.size() / batches.size();
    for (std::size_t b = 0; b < batches.size(); ++b) batches[b].inputs = as_floats.data() + b * tokens;
    try {
      engine->train_step(batches);
      FAIL() << to_string(kind) << " trained on floats";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("holds f32 features but the model reads i32 token ids"), std::string::npos)
          << to_string(kind) << ": " << e.what();
    }
    engine->synchronize();
    EXPECT_EQ(test::to_host(s, engine->model().params_flat(), engine->model().param_count()), before)
        << to_string(kind);
    EXPECT_EQ(engine->train_step(data.batches(*engine)) > 0.0f, true) << to_string(kind) << " trains on ids after";
  }
}

}  // namespace
}  // namespace dp
