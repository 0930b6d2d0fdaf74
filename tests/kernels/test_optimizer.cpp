// test_optimizer.cpp — the SGD and AdamW update kernels against torch.optim's formulas (exact fp32
// equality) and PyTorch's golden files, bit for bit, on every backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "dp/io/safetensors.h"
#include "dp/kernels/loss.h"
#include "dp/kernels/ops.h"
#include "dp/kernels/optimizer.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using test::all_close;
using test::download;
using test::random_vector;
using test::upload;

class OptimizerTest : public test::BackendTest {
 protected:
};

INSTANTIATE_TEST_SUITE_P(Backends, OptimizerTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// Distance in units in the last place between two floats of the same sign (0 = the same bits).
std::int64_t ulps(float a, float b) {
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

// torch.optim.AdamW, 4 steps on 1027 values, for two sets of hyper-parameters

// ------------------------------------------------------------------------------------------------
// SGD

// torch/optim/sgd.py (_single_tensor_sgd, dampening 0), one statement per tensor op, each rounded
// to fp32 as ATen rounds it: x.add(y, alpha=a) is one fused multiply-add x + a*y (ATen's
// ufunc::add is vec::fmadd; verified on this machine's torch for both the vector body and the
// scalar tail), x.mul_(m) a plain product.
// The update kernels as the optimizers call them: the options validated, then split into the
// update's constants and its per-step values.
void sgd_kernel(const Stream& stream, kernels::index_t n, const SgdOptions& o, bool first_step, float* params,
                const float* grads, float* buffer) {
  validate(o);
  kernels::sgd_step(stream, n, {o.momentum, o.weight_decay, o.nesterov}, kernels::sgd_scalars(o.lr, first_step), params,
                    grads, buffer);
}
void adamw_kernel(const Stream& stream, kernels::index_t n, const AdamWOptions& o, std::int64_t step, float* params,
                  const float* grads, float* exp_avg, float* exp_avg_sq) {
  validate(o);
  const kernels::AdamWConstants constants{o.beta1, o.beta2, o.eps};
  kernels::adamw_step(stream, n, constants, kernels::adamw_scalars(constants, o.lr, o.weight_decay, step), params,
                      grads, exp_avg, exp_avg_sq);
}

class TorchSgd {
 public:
  explicit TorchSgd(SgdOptions o) : o_(o) {}
  void step(std::vector<float>& params, std::vector<float> d_p) {
    if (buf_.empty() && o_.momentum != 0.0f) buf_.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (o_.weight_decay != 0.0f) d_p[i] = std::fma(params[i], o_.weight_decay, d_p[i]);  // d_p.add(p, alpha=wd)
      if (o_.momentum != 0.0f) {
        if (steps_ == 0) {
          buf_[i] = d_p[i];  // torch.clone(d_p)
        } else {
          const float scaled = buf_[i] * o_.momentum;  // buf.mul_(momentum)
          buf_[i] = scaled + d_p[i];                   // .add_(d_p, alpha=1)
        }
        d_p[i] = o_.nesterov ? std::fma(buf_[i], o_.momentum, d_p[i]) : buf_[i];  // d_p.add(buf, alpha=momentum)
      }
      params[i] = std::fma(d_p[i], -o_.lr, params[i]);  // p.add_(d_p, alpha=-lr)
    }
    ++steps_;
  }
  const std::vector<float>& buffer() const { return buf_; }

 private:
  SgdOptions o_;
  std::vector<float> buf_;
  int steps_ = 0;
};

// Several steps with fresh gradients each, every option combination: parameters and momentum
// buffer equal the reference exactly (all_close with zero tolerance), because the kernel performs
// the same fp32 operations.
TEST_P(OptimizerTest, SgdMatchesTorchFormulaExactly) {
  struct Case {
    const char* name;
    SgdOptions options;
  };
  const Case cases[] = {
      {"plain", {0.1f, 0.0f, 0.0f, false}},     {"weight_decay", {0.1f, 0.0f, 1e-2f, false}},
      {"momentum", {0.05f, 0.9f, 0.0f, false}}, {"momentum_weight_decay", {0.05f, 0.9f, 1e-3f, false}},
      {"nesterov", {0.05f, 0.9f, 0.0f, true}},  {"nesterov_weight_decay", {0.01f, 0.5f, 5e-4f, true}},
  };
  const std::size_t n = 4099;  // not a multiple of any block size
  unsigned seed = 200;
  for (const Case& c : cases) {
    auto params = random_vector(n, ++seed);
    DeviceBuffer dparams = upload(*device_, stream_, params);
    DeviceBuffer grads = device_->allocate(n * sizeof(float));
    DeviceBuffer buf = device_->allocate(n * sizeof(float));
    kernels::fill(stream_, buf.as<float>(), n, 123.0f);  // the first step must not read it
    TorchSgd ref(c.options);
    for (int step = 0; step < 4; ++step) {
      const auto g = random_vector(n, ++seed, -2.0f, 2.0f);
      stream_.copy(grads.data(), g.data(), n * sizeof(float));
      sgd_kernel(stream_, n, c.options, step == 0, dparams.as<float>(), grads.as<float>(),
                 c.options.momentum != 0.0f ? buf.as<float>() : nullptr);
      ref.step(params, g);
      EXPECT_TRUE(all_close(download<float>(stream_, dparams), params, 0.0, 0.0)) << c.name << " step " << step;
      if (c.options.momentum != 0.0f) {
        EXPECT_TRUE(all_close(download<float>(stream_, buf), ref.buffer(), 0.0, 0.0)) << c.name << " step " << step;
      }
    }
  }
}

// Whole numbers and powers of two, so every intermediate is exact and the expected values can be
// worked out by hand (lr 0.5, momentum 0.5, weight decay 0.25).
TEST_P(OptimizerTest, SgdHandComputedSteps) {
  const std::vector<float> p0{4.0f, -2.0f, 0.0f}, g0{2.0f, 4.0f, -6.0f}, g1{2.0f, 0.0f, 2.0f};
  DeviceBuffer grads = device_->allocate(3 * sizeof(float)), buf = device_->allocate(3 * sizeof(float));
  const auto run = [&](SgdOptions o) {
    DeviceBuffer p = upload(*device_, stream_, p0);
    std::vector<std::vector<float>> out;
    for (const auto* g : {&g0, &g1}) {
      stream_.copy(grads.data(), g->data(), 3 * sizeof(float));
      sgd_kernel(stream_, 3, o, g == &g0, p.as<float>(), grads.as<float>(), buf.as<float>());
      out.push_back(download<float>(stream_, p));
    }
    return out;
  };
  // plain: p -= 0.5 g.  [4,-2,0] - 0.5*[2,4,-6] = [3,-4,3];  - 0.5*[2,0,2] = [2,-4,2]
  auto r = run({0.5f, 0.0f, 0.0f, false});
  EXPECT_EQ(r[0], (std::vector<float>{3.0f, -4.0f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{2.0f, -4.0f, 2.0f}));
  // momentum: buf = g0 = [2,4,-6], p = [3,-4,3]; buf = 0.5*[2,4,-6] + [2,0,2] = [3,2,-1],
  // p = [3,-4,3] - 0.5*[3,2,-1] = [1.5,-5,3.5]
  r = run({0.5f, 0.5f, 0.0f, false});
  EXPECT_EQ(r[0], (std::vector<float>{3.0f, -4.0f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{1.5f, -5.0f, 3.5f}));
  EXPECT_EQ(download<float>(stream_, buf), (std::vector<float>{3.0f, 2.0f, -1.0f}));
  // nesterov: step 0: buf = [2,4,-6], d = g + 0.5 buf = [3,6,-9], p = [4,-2,0] - 0.5 d = [2.5,-5,4.5];
  // step 1: buf = [3,2,-1], d = [2,0,2] + 0.5*[3,2,-1] = [3.5,1,1.5], p = [0.75,-5.5,3.75]
  r = run({0.5f, 0.5f, 0.0f, true});
  EXPECT_EQ(r[0], (std::vector<float>{2.5f, -5.0f, 4.5f}));
  EXPECT_EQ(r[1], (std::vector<float>{0.75f, -5.5f, 3.75f}));
  // weight decay 0.25, no momentum: d = g + 0.25 p = [2+1, 4-0.5, -6+0] = [3,3.5,-6],
  // p = [4,-2,0] - 0.5 d = [2.5,-3.75,3]; d = [2+0.625, 0-0.9375, 2+0.75], p = [1.1875,-3.28125,1.625]
  r = run({0.5f, 0.0f, 0.25f, false});
  EXPECT_EQ(r[0], (std::vector<float>{2.5f, -3.75f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{1.1875f, -3.28125f, 1.625f}));
}

TEST_P(OptimizerTest, SgdRejectsInvalidOptions) {
  DeviceBuffer p = device_->allocate(16 * sizeof(float));
  float* x = p.as<float>();
  EXPECT_THROW(sgd_kernel(stream_, 16, {-0.1f, 0.0f, 0.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, -0.9f, 0.0f, false}, true, x, x, x), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.0f, -1.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.0f, 0.0f, true}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.9f, 0.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, -1, {}, true, x, x, nullptr), InvalidArgument);
  if (GetParam() == "sim") {  // 17 floats run past the 16-float allocation
    EXPECT_THROW(sgd_kernel(stream_, 17, {}, true, x, x, nullptr), DeviceMismatch);
  }
  stream_.synchronize();
}

// The golden files of tests/golden: PyTorch's own SGD (CPU, fp32) from `init` with the stored
// gradients must be reproduced bit for bit, momentum buffers after every step and final parameters,
// all parameters of the model in one flat buffer as the engine keeps them.
TEST_P(OptimizerTest, SgdMatchesPyTorchGoldensBitForBit) {
  for (const char* name : {"mlp_b7", "mlp_b7_nesterov", "convnet_b7"}) {
    const auto file = safetensors::read(test::golden_path(name));
    const auto& meta = file.metadata;
    const SgdOptions options{std::stof(meta.at("lr")), std::stof(meta.at("momentum")),
                             std::stof(meta.at("weight_decay")), meta.at("nesterov") == "1"};
    const int steps = std::stoi(meta.at("steps"));
    // Parameters are the tensors with a gradient, in file order; flattened one after another.
    std::vector<std::string> ordered;
    for (const auto& key : file.order)
      if (key.rfind("step0.grad.", 0) == 0) ordered.push_back(key.substr(11));
    ASSERT_FALSE(ordered.empty()) << name;
    const auto flat = [&](const std::string& prefix) {
      std::vector<float> out;
      for (const auto& param : ordered) {
        const auto v = file.at(prefix + param).to_f32();
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    const auto init = flat("init.");
    const std::size_t n = init.size();
    DeviceBuffer params = upload(*device_, stream_, init), grads = device_->allocate(n * sizeof(float));
    DeviceBuffer buf = device_->allocate(n * sizeof(float));
    for (int k = 0; k < steps; ++k) {
      const auto g = flat("step" + std::to_string(k) + ".grad.");
      stream_.copy(grads.data(), g.data(), n * sizeof(float));
      sgd_kernel(stream_, n, options, k == 0, params.as<float>(), grads.as<float>(), buf.as<float>());
      EXPECT_TRUE(all_close(download<float>(stream_, buf), flat("step" + std::to_string(k) + ".momentum."), 0.0, 0.0))
          << name << " step " << k;
    }
    EXPECT_TRUE(all_close(download<float>(stream_, params), flat("final."), 0.0, 0.0)) << name;
  }
}

// (tests/golden/make_adamw_goldens.py): parameters and both moments after every step.
TEST_P(OptimizerTest, AdamWMatchesPyTorchGoldens) {
  const auto golden = safetensors::read(test::golden_path("adamw"));
  for (const std::string name : {"defaults", "aggressive"}) {
    const auto h = nlohmann::json::parse(golden.metadata.at(name));
    const AdamWOptions options{h.at("lr"), h.at("beta1"), h.at("beta2"), h.at("eps"), h.at("weight_decay")};
    const auto init = golden.at(name + ".init").to_f32();
    const auto n = static_cast<kernels::index_t>(init.size());
    DeviceBuffer params = upload(*device_, stream_, init);
    DeviceBuffer m = upload(*device_, stream_, std::vector<float>(init.size(), 0.0f));
    DeviceBuffer v = upload(*device_, stream_, std::vector<float>(init.size(), 0.0f));
    for (int step = 0; step < 4; ++step) {
      const auto key = [&](const char* what) { return fmt::format("{}.{}.{}", name, what, step); };
      DeviceBuffer grads = upload(*device_, stream_, golden.at(key("grad")).to_f32());
      adamw_kernel(stream_, n, options, step + 1, params.as<float>(), grads.as<float>(), m.as<float>(), v.as<float>());
      for (const auto& [what, buffer] :
           {std::pair{"param", &params}, std::pair{"exp_avg", &m}, std::pair{"exp_avg_sq", &v}}) {
        const auto got = download<float>(stream_, *buffer), want = golden.at(key(what)).to_f32();
        std::int64_t worst = 0;
        for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, ulps(got[i], want[i]));
        EXPECT_EQ(worst, 0) << name << " " << what << " after step " << step + 1 << ": " << worst << " ulp";
      }
    }
  }
}

TEST_P(OptimizerTest, AdamWRejectsWhatTorchRejects) {
  DeviceBuffer buf = device_->allocate(16 * sizeof(float));
  float* x = buf.as<float>();
  EXPECT_THROW(adamw_kernel(stream_, 4, {.lr = -1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.beta1 = 1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.beta2 = -0.1}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.eps = std::nan("")}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.weight_decay = -1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {}, 0, x, x, x, x), InvalidArgument) << "steps count from 1";
}

// Weight decay excluded from some parameters (torch's parameter group of weight_decay 0): those are
// the bits of an optimizer without decay, the others of one with it, frozen ones untouched; the
// update runs in one launch per stretch of the same group.
TEST_P(OptimizerTest, ExcludedFromWeightDecayIsAGroupWithoutDecay) {
  constexpr std::size_t n = 10;
  std::vector<float> init(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    init[i] = 0.5f + 0.1f * static_cast<float>(i);
    grad[i] = 0.01f * static_cast<float>(i + 1) * (i % 2 ? -1.0f : 1.0f);
  }
  const auto run = [&](const OptimizerOptions& options, bool groups) {
    DeviceBuffer params = upload(*device_, stream_, init), grads = upload(*device_, stream_, grad);
    auto optimizer = make_optimizer(*device_, n, options);
    if (groups) {
      optimizer->freeze({{2, 2}});
      optimizer->exclude_from_weight_decay({{3, 4}, {9, 1}});
    }
    for (int step = 0; step < 2; ++step) optimizer->step(stream_, params.as<float>(), grads.as<float>());
    std::vector<std::pair<std::size_t, bool>> segments;
    for (const auto& [range, decay] : optimizer->segments()) segments.emplace_back(range.offset, decay);
    return std::pair{download<float>(stream_, params), segments};
  };
  for (const bool adamw : {false, true}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    const auto options = [&](double wd) -> OptimizerOptions {
      if (adamw) return AdamWOptions{1e-2, 0.9, 0.95, 1e-8, wd};
      return SgdOptions{0.1f, 0.9f, static_cast<float>(wd), false};
    };
    const auto [grouped, segments] = run(options(0.5), true);
    const auto decayed = run(options(0.5), false).first, plain = run(options(0.0), false).first;
    EXPECT_EQ(segments, (std::vector<std::pair<std::size_t, bool>>{{0, true}, {4, false}, {7, true}, {9, false}}));
    for (std::size_t i = 0; i < n; ++i) {
      const bool frozen = i == 2 || i == 3, excluded = (i >= 4 && i < 7) || i == 9;
      EXPECT_EQ(grouped[i], frozen ? init[i] : excluded ? plain[i] : decayed[i]) << "parameter " << i;
    }
    EXPECT_NE(decayed[5], plain[5]) << "the decay changes what it applies to";
  }
  auto optimizer = make_optimizer(*device_, n, SgdOptions{});
  EXPECT_THROW(optimizer->exclude_from_weight_decay({{8, 3}}), InvalidArgument) << "past the parameters";
}

}  // namespace
}  // namespace dp
