// test_transformer.cpp — a transformer's layers composed as nanoGPT composes them: one Block
// (x + attn(ln_1(x)), then x + mlp(ln_2(x)), exact GELU) built from dp's layers under nanoGPT's
// parameter names, loaded from torch's state dict, its output and every parameter gradient against
// torch's (tests/golden/make_transformer_goldens.py), on each backend.
#include <gtest/gtest.h>
#include <string>
#include <vector>

#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/nn/layers.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using nn::Layers;

// nanoGPT's Block h.0 of width 8 and 2 heads: two unnamed residual branches (identity shortcuts, no
// ReLU) in a Sequential named h.0.
Layers block() {
  Layers attn, mlp, branches, layers;
  attn.push_back(nn::make_layernorm("ln_1", 8));
  attn.push_back(nn::make_causal_self_attention("attn", 8, 2));
  mlp.push_back(nn::make_layernorm("ln_2", 8));
  mlp.push_back(nn::make_linear("mlp.c_fc", 8, 32));
  mlp.push_back(nn::make_gelu("mlp.gelu"));
  mlp.push_back(nn::make_linear("mlp.c_proj", 32, 8));
  branches.push_back(nn::make_residual("", std::move(attn), {}, false));
  branches.push_back(nn::make_residual("", std::move(mlp), {}, false));
  layers.push_back(nn::make_sequential("h.0", std::move(branches)));
  return layers;
}

class Transformer : public test::BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, Transformer, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(Transformer, ANanoGptBlockMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_block"));
  nn::SequentialModel concrete("block", *device_, block(), {5, 1, 8});
  Model& model = concrete;
  const auto keys = load_state_dict(model, stream_, golden, "init.");  // strict: nanoGPT's names, all of them
  EXPECT_TRUE(keys.missing.empty());
  EXPECT_TRUE(keys.unexpected.empty());
  DeviceBuffer x = up(golden.at("data.x").to_f32()), dy = up(golden.at("data.dy").to_f32());
  const float* y = model.forward(stream_, x.as<float>(), 2, Mode::train);
  EXPECT_TRUE(test::all_close(test::to_host(stream_, y, 80), golden.at("data.y").to_f32(), 1e-5, 1e-5));
  model.zero_grad(stream_);
  model.backward(stream_, dy.as<float>());
  int checked = 0;
  for (const TensorRef& g : model.gradients()) {
    const auto want = golden.at("grad." + g.name).to_f32();
    EXPECT_TRUE(test::all_close(test::to_host(stream_, g.as<float>(), g.numel()), want, 1e-4, 1e-5)) << g.name;
    ++checked;
  }
  EXPECT_EQ(checked, 12);  // ln_1 (2), attn (4), ln_2 (2), mlp (4)
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
