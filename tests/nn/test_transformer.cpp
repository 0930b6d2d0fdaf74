// test_transformer.cpp — a transformer's layers composed as nanoGPT composes them: one Block
// (x + attn(ln_1(x)), then x + mlp(ln_2(x)), exact GELU) built from dp's layers under nanoGPT's
// parameter names, loaded from torch's state dict, its output and every parameter gradient against
// torch's (tests/golden/make_transformer_goldens.py), on each backend.
#include <algorithm>
#include <cmath>
#include <gtest/gtest.h>
#include <memory>
#include <string>
#include <vector>

#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/kernels/loss.h"
#include "dp/models/gpt.h"
#include "dp/nn/layers.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using nn::Layers;

// Block h.0 of width 8 and 2 heads.
Layers block() {
  Layers layers;
  layers.push_back(models::gpt_block("h.0", 8, 2));
  return layers;
}

// Loads the golden's init.* strictly: every tensor is the model's under nanoGPT's names, and all of them.
void load_all(Model& model, const Stream& stream, const safetensors::File& golden) {
  const auto keys = load_state_dict(model, stream, golden, "init.");
  EXPECT_TRUE(keys.missing.empty());
  EXPECT_TRUE(keys.unexpected.empty());
}

// Every parameter gradient against the golden's grad.<name> (rtol 1e-4); returns how many.
int expect_gradients(const Model& model, const Stream& stream, const safetensors::File& golden, double atol) {
  int checked = 0;
  for (const TensorRef& g : model.gradients()) {
    const auto want = golden.at("grad." + g.name).to_f32();
    EXPECT_TRUE(test::all_close(test::to_host(stream, g.as<float>(), g.numel()), want, 1e-4, atol)) << g.name;
    ++checked;
  }
  return checked;
}

class Transformer : public test::BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, Transformer, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(Transformer, ANanoGptBlockMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_block"));
  nn::SequentialModel concrete("block", *device_, block(), {5, 1, 8});
  Model& model = concrete;
  load_all(model, stream_, golden);
  DeviceBuffer x = up(golden.at("data.x").to_f32()), dy = up(golden.at("data.dy").to_f32());
  const float* y = model.forward(stream_, x.as<float>(), 2, Mode::train);
  EXPECT_TRUE(test::all_close(test::to_host(stream_, y, 80), golden.at("data.y").to_f32(), 1e-5, 1e-5));
  model.zero_grad(stream_);
  model.backward(stream_, dy.as<float>());
  EXPECT_EQ(expect_gradients(model, stream_, golden, 1e-5), 12);  // ln_1 (2), attn (4), ln_2 (2), mlp (4)
}

// nanoGPT's GPT (vocab 32, context 8, width 16, 2 blocks of 2 heads) on 3 sequences of 6 tokens:
// logits, the loss over every token (the cross-entropy kernel over 18 rows) and every gradient,
// the tied table's with both of its parts, against torch's.
Layers gpt_body() { return models::gpt_body({32, 8, 2, 2, 16}); }

TEST_P(Transformer, ATinyGptMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_gpt"));
  Layers layers;
  layers.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  nn::SequentialModel concrete("gpt", *device_, std::move(layers), {6});
  Model& model = concrete;
  load_all(model, stream_, golden);
  const auto idx = golden.at("data.idx").to_i64();
  const std::vector<std::int32_t> ids(idx.begin(), idx.end());
  DeviceBuffer input = up(ids), targets = up(golden.at("data.targets").to_i64());
  const float* logits = model.forward(stream_, input.as<std::int32_t>(), 3, Mode::train);
  EXPECT_TRUE(test::all_close(test::to_host(stream_, logits, 18 * 32), golden.at("data.logits").to_f32(), 1e-5, 1e-5));

  // The loss per token: the cross-entropy over the 18 (sample, position) rows, and its gradient.
  DeviceBuffer per_token = floats(18), loss = floats(1), dlogits = floats(18 * 32);
  kernels::cross_entropy_forward_backward(stream_, 18, 32, logits, targets.as<std::int64_t>(), per_token.as<float>(),
                                          loss.as<float>(), 1.0f, 18, dlogits.as<float>());
  EXPECT_NEAR(down<float>(loss)[0], golden.at("data.loss").to_f32()[0], 1e-5);
  EXPECT_TRUE(test::all_close(down<float>(dlogits), golden.at("data.dlogits").to_f32(), 1e-4, 1e-7));

  model.zero_grad(stream_);
  model.backward(stream_, dlogits.as<float>());
  EXPECT_EQ(expect_gradients(model, stream_, golden, 2e-6), 2 + 2 * 12 + 2);  // wte, wpe, two blocks, ln_f
}

// What DataParallel and DDP rely on: a replica on another device computes the same bits, a second
// backward accumulates, and the tied table (offset 0) is reported ready once, last, after both of
// its parts are in.
TEST_P(Transformer, AGptReplicatesAccumulatesAndReportsTheTiedTableLast) {
  const auto golden = safetensors::read(test::golden_path("transformer_gpt"));
  Layers layers;
  layers.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  nn::SequentialModel concrete("gpt", *device_, std::move(layers), {6});
  Model& model = concrete;
  load_state_dict(model, stream_, golden, "init.");
  Device& other = runtime_->device(0);
  const std::unique_ptr<Model> replica = model.replicate(other);
  const Stream other_stream = other.create_stream();
  other_stream.copy(replica->params_flat(), model.params_flat(), model.param_count() * sizeof(float));
  other_stream.synchronize();
  const auto idx = golden.at("data.idx").to_i64();
  const std::vector<std::int32_t> ids(idx.begin(), idx.end());
  const auto dlogits = golden.at("data.dlogits").to_f32();
  std::vector<std::vector<float>> grads;
  std::vector<std::size_t> reported;
  for (Model* m : {&model, replica.get()}) {
    Device& d = m == &model ? *device_ : other;
    const Stream s = d.create_stream();
    DeviceBuffer in = test::upload(d, s, ids), dl = test::upload(d, s, dlogits);
    m->zero_grad(s);
    for (int pass = 0; pass < 2; ++pass) {
      m->forward(s, in.as<std::int32_t>(), 3, Mode::train);
      m->backward(s, dl.as<float>(), [&](std::size_t offset, std::size_t) {
        if (m == &model && pass == 0) reported.push_back(offset);
      });
    }
    grads.push_back(test::to_host(s, m->grads_flat(), m->param_count()));
  }
  EXPECT_EQ(grads[0], grads[1]) << "the replica's gradients";
  ASSERT_FALSE(reported.empty());
  EXPECT_EQ(reported.back(), 0u) << "wte (offset 0) is reported last";
  EXPECT_EQ(std::count(reported.begin(), reported.end(), 0u), 1) << "and once";
  // Two backwards of the same batch: twice torch's gradient.
  const auto want = golden.at("grad.transformer.wte.weight").to_f32();
  std::vector<float> twice(want.size());
  for (std::size_t i = 0; i < want.size(); ++i) twice[i] = 2.0f * want[i];
  const std::vector<float> wte(grads[0].begin(), grads[0].begin() + static_cast<std::ptrdiff_t>(want.size()));
  EXPECT_TRUE(test::all_close(wte, twice, 1e-4, 4e-6));
}

// llm.c's padded table (GPTConfig's 50257 tokens in 50304 rows): rows past the vocabulary get no
// logit, so the logits and every gradient are the unpadded model's, bit for bit, and the padding's
// gradient is 0 (written, and still 0 after a second, accumulating backward).
TEST_P(Transformer, APaddedTableGivesTheUnpaddedLogitsAndGradients) {
  const auto golden = safetensors::read(test::golden_path("transformer_gpt"));
  Layers plain_layers, padded_layers;
  plain_layers.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  padded_layers.push_back(nn::make_language_model(40, 8, 16, gpt_body(), 32));
  nn::SequentialModel plain("gpt", *device_, std::move(plain_layers), {6});
  nn::SequentialModel padded("gpt", *device_, std::move(padded_layers), {6});
  ASSERT_EQ(padded.param_count(), plain.param_count() + 8 * 16);
  load_state_dict(plain, stream_, golden, "init.");
  // wte leads both: the padded one's first 32 rows are plain's, then 8 rows of 0.5, then the rest.
  std::vector<float> values = test::to_host(stream_, plain.params_flat(), plain.param_count());
  values.insert(values.begin() + 32 * 16, 8 * 16, 0.5f);
  stream_.copy(padded.params_flat(), values.data(), values.size() * sizeof(float));
  const auto idx = golden.at("data.idx").to_i64();
  const std::vector<std::int32_t> ids(idx.begin(), idx.end());
  const auto dlogits = golden.at("data.dlogits").to_f32();
  DeviceBuffer in = test::upload(*device_, stream_, ids), dl = test::upload(*device_, stream_, dlogits);
  // Under autocast too: the head then multiplies the table's first rows in bf16.
  for (const Autocast amp : {Autocast::off, Autocast::bf16}) {
    SCOPED_TRACE(to_string(amp));
    std::vector<std::vector<float>> logits, grads;
    for (Model* m : std::initializer_list<Model*>{&plain, &padded}) {
      ASSERT_EQ(m->output_features(), 32);
      m->set_autocast(amp);
      m->zero_grad(stream_);
      for (int pass = 0; pass < 2; ++pass) {
        const float* y = m->forward(stream_, in.as<std::int32_t>(), 3, Mode::train);
        if (pass == 0) logits.push_back(test::to_host(stream_, y, dlogits.size()));
        m->backward(stream_, dl.as<float>(), {});
      }
      grads.push_back(test::to_host(stream_, m->grads_flat(), m->param_count()));
    }
    EXPECT_EQ(logits[0], logits[1]);
    std::vector<float> expected = grads[0];
    expected.insert(expected.begin() + 32 * 16, 8 * 16, 0.0f);
    EXPECT_EQ(grads[1], expected);
  }
  EXPECT_THROW(nn::make_language_model(8, 8, 16, gpt_body(), 9), InvalidArgument);
}

// Under autocast the tied head's logits are bf16 (torch's lm_head under autocast): forward_for_loss
// hands them as they are, forward() their widened copy; in fp32 both are the fp32 logits. A bf16
// gradient is refused by a model whose output is fp32.
TEST_P(Transformer, UnderAutocastTheHeadsLogitsReachTheLossAsBf16) {
  Layers layers;
  layers.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  nn::SequentialModel gpt("gpt", *device_, std::move(layers), {6});
  gpt.initialize(1);
  DeviceBuffer ids = up(std::vector<std::int32_t>{1, 2, 3, 4, 5, 31});
  const std::size_t n = 6 * 32;
  const Model::Output fp32 = gpt.forward_for_loss(stream_, ids.as<std::int32_t>(), 1);
  EXPECT_FALSE(fp32.bf16);
  DeviceBuffer grad = up(std::vector<float>(n, 0.01f));
  EXPECT_THROW(gpt.backward_from_loss(stream_, grad.data(), true), InvalidArgument);
  gpt.set_autocast(Autocast::bf16);
  const Model::Output bf16 = gpt.forward_for_loss(stream_, ids.as<std::int32_t>(), 1);
  ASSERT_TRUE(bf16.bf16);
  std::vector<std::uint16_t> bits(n);
  stream_.copy(bits.data(), bf16.data, n * sizeof(std::uint16_t));
  stream_.synchronize();
  const float* widened = gpt.forward(stream_, ids.as<std::int32_t>(), 1, Mode::train);
  EXPECT_EQ(test::to_host(stream_, widened, n), test::bf16_values(bits));
}

// Token ids are int32 from the batch to the embedding: a language model refuses f32 features, a
// model of features refuses ids, and no layer after the first may read ids.
TEST_P(Transformer, TokenIdsAreIntegersAndFeaturesAreNot) {
  Layers layers;
  layers.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  nn::SequentialModel gpt("gpt", *device_, std::move(layers), {6});
  gpt.initialize(1);
  EXPECT_EQ(gpt.input_dtype(), DType::i32);
  const std::vector<std::int32_t> ids{1, 2, 3, 4, 5, 31};
  const std::vector<float> features(ids.begin(), ids.end());
  DeviceBuffer as_ids = up(ids), as_features = up(features);
  try {
    gpt.forward(stream_, as_features.as<float>(), 1, Mode::eval);
    FAIL() << "a language model took f32 features";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("gpt reads i32 token ids, got f32 features"), std::string::npos) << e.what();
  }
  const auto logits = test::to_host(stream_, gpt.forward(stream_, as_ids.as<std::int32_t>(), 1, Mode::eval), 6 * 32);
  EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));

  Layers block_layers = block();
  nn::SequentialModel features_model("block", *device_, std::move(block_layers), {6, 1, 8});
  EXPECT_EQ(features_model.input_dtype(), DType::f32);
  EXPECT_THROW(features_model.forward(stream_, as_ids.as<std::int32_t>(), 1, Mode::eval), InvalidArgument);

  Layers late;
  late.push_back(nn::make_linear("proj", 1, 1));
  late.push_back(nn::make_language_model(32, 8, 16, gpt_body()));
  try {
    nn::SequentialModel("late", *device_, std::move(late), {6});
    FAIL() << "an embedding after a Linear";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("reads token ids: it can only be a list's first layer"), std::string::npos)
        << e.what();
  }
}

TEST_P(Transformer, ShapesThatDoNotFitAreRefusedNamingTheLayer) {
  Layers wrong;
  wrong.push_back(nn::make_layernorm("ln_f", 16));
  EXPECT_THROW(nn::SequentialModel("m", *device_, std::move(wrong), {5, 1, 8}), InvalidArgument);
  try {
    nn::make_causal_self_attention("attn", 10, 3);
    FAIL() << "10 features split into 3 heads";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("attn: 10 features do not split into 3 heads"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dp
