// test_transformer_kernels.cpp — a transformer's kernels (LayerNorm, GELU) on each backend against
// PyTorch (tests/golden/make_transformer_goldens.py), their bf16 storage against the fp32 kernels
// on the widened values, and cuda's results against the sim's.
#include <cmath>
#include <cstdint>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/kernels/gelu.h"
#include "dp/kernels/layernorm.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/device.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;
using test::all_close;

class TransformerKernels : public test::BackendTest {
 protected:
  struct LayerNormResult {
    std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
  };
  LayerNormResult layernorm(index_t rows, index_t cols, const std::vector<float>& x, const std::vector<float>& gamma,
                            const std::vector<float>& beta, const std::vector<float>& dy) {
    DeviceBuffer xd = up(x), g = up(gamma), b = up(beta), dyd = up(dy);
    DeviceBuffer y = floats(x.size()), mean = floats(rows), rstd = floats(rows), dx = floats(x.size());
    DeviceBuffer dg = floats(cols), db = floats(cols), sums = floats(2 * rows);
    kernels::layernorm_forward(stream_, rows, cols, xd.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(),
                               mean.as<float>(), rstd.as<float>());
    kernels::layernorm_backward(stream_, rows, cols, xd.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                dyd.as<float>(), dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                false);
    return {down<float>(y), down<float>(mean), down<float>(rstd), down<float>(dx), down<float>(dg), down<float>(db)};
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, TransformerKernels, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(TransformerKernels, LayerNormMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  int cases = 0;
  for (const auto& [name, text] : golden.metadata) {
    if (name.rfind("layernorm.", 0) != 0) continue;
    ++cases;
    const auto meta = nlohmann::json::parse(text);
    const index_t rows = meta.at("rows"), cols = meta.at("cols");
    const auto r = layernorm(rows, cols, golden.at(name + ".x").to_f32(), golden.at(name + ".gamma").to_f32(),
                             golden.at(name + ".beta").to_f32(), golden.at(name + ".dy").to_f32());
    // fp32 statistics over at most 300 values: a few ulps of the outputs' scale.
    EXPECT_TRUE(all_close(r.y, golden.at(name + ".y").to_f32(), 1e-5, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dx, golden.at(name + ".dx").to_f32(), 1e-4, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dgamma, golden.at(name + ".dgamma").to_f32(), 1e-5, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dbeta, golden.at(name + ".dbeta").to_f32(), 1e-5, 1e-5)) << name;
  }
  EXPECT_EQ(cases, 4);
  // One value a row: x - mean is exactly 0, so y is beta and the input gradient 0 (torch's CPU kernel,
  // folding the mean into a bias, leaves its rounding noise times 1/sqrt(eps) there instead).
  const auto r = layernorm(3, 1, {2.5f, -7.0f, 1e3f}, {1.5f}, {0.25f}, {1.0f, -2.0f, 3.0f});
  EXPECT_EQ(r.y, (std::vector<float>{0.25f, 0.25f, 0.25f}));
  EXPECT_EQ(r.dx, (std::vector<float>{0.0f, 0.0f, 0.0f}));
  EXPECT_EQ(r.dgamma, (std::vector<float>{0.0f}));
  EXPECT_EQ(r.dbeta, (std::vector<float>{2.0f}));
}

TEST_P(TransformerKernels, GeluMatchesPyTorchInBothForms) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  for (const auto& [form_name, form] : {std::pair{std::string("none"), kernels::GeluForm::exact},
                                        std::pair{std::string("tanh"), kernels::GeluForm::tanh}}) {
    const std::string p = "gelu." + form_name;
    const auto x = golden.at(p + ".x").to_f32(), dy = golden.at(p + ".dy").to_f32();
    const auto n = static_cast<index_t>(x.size());
    DeviceBuffer xd = up(x), dyd = up(dy), y = floats(x.size()), dx = floats(x.size());
    kernels::gelu_forward(stream_, n, form, xd.as<float>(), y.as<float>());
    kernels::gelu_backward(stream_, n, form, xd.as<float>(), dyd.as<float>(), dx.as<float>());
    // torch's CPU kernel is vectorised (its own tanh/erf/exp); a few ulps apart.
    EXPECT_TRUE(all_close(down<float>(y), golden.at(p + ".y").to_f32(), 4e-6, 1e-6)) << p;
    EXPECT_TRUE(all_close(down<float>(dx), golden.at(p + ".dx").to_f32(), 4e-6, 1e-6)) << p;
  }
}

// bf16 storage: the fp32 kernels' values on the widened inputs, rounded once (the statistics, the
// sums and the parameter gradients identical).
TEST_P(TransformerKernels, Bf16StorageIsTheFp32ResultRounded) {
  const index_t rows = 12, cols = 40;
  const auto size = static_cast<std::size_t>(rows * cols);
  std::vector<std::uint16_t> x16(size), dy16(size);
  std::vector<float> x(size), dy(size);
  const auto xr = test::random_vector(size, 1, -3.0f, 3.0f), dyr = test::random_vector(size, 2);
  for (std::size_t i = 0; i < size; ++i) {
    x16[i] = bf16_from_float(xr[i]);
    dy16[i] = bf16_from_float(dyr[i]);
    x[i] = bf16_to_float(x16[i]);
    dy[i] = bf16_to_float(dy16[i]);
  }
  const auto gamma = test::random_vector(static_cast<std::size_t>(cols), 3, 0.5f, 1.5f),
             beta = test::random_vector(static_cast<std::size_t>(cols), 4);
  const LayerNormResult want = layernorm(rows, cols, x, gamma, beta, dy);
  DeviceBuffer xd = up(x16), g = up(gamma), b = up(beta), dyd = up(dy16);
  DeviceBuffer y = device_->allocate(size * 2), dx = device_->allocate(size * 2), mean = floats(rows),
               rstd = floats(rows), dg = floats(cols), db = floats(cols), sums = floats(2 * rows);
  kernels::layernorm_forward(stream_, rows, cols, xd.as<std::uint16_t>(), g.as<float>(), b.as<float>(),
                             y.as<std::uint16_t>(), mean.as<float>(), rstd.as<float>());
  kernels::layernorm_backward(stream_, rows, cols, xd.as<std::uint16_t>(), g.as<float>(), mean.as<float>(),
                              rstd.as<float>(), dyd.as<std::uint16_t>(), dx.as<std::uint16_t>(), dg.as<float>(),
                              db.as<float>(), sums.as<float>(), false);
  const auto rounded = [](const std::vector<float>& v) {
    std::vector<std::uint16_t> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = bf16_from_float(v[i]);
    return r;
  };
  EXPECT_EQ(down<std::uint16_t>(y), rounded(want.y));
  EXPECT_EQ(down<std::uint16_t>(dx), rounded(want.dx));
  EXPECT_EQ(down<float>(mean), want.mean);
  EXPECT_EQ(down<float>(rstd), want.rstd);
  EXPECT_EQ(down<float>(dg), want.dgamma);
  EXPECT_EQ(down<float>(db), want.dbeta);

  DeviceBuffer gy = device_->allocate(size * 2), gdx = device_->allocate(size * 2);
  DeviceBuffer x32 = up(x), dy32 = up(dy), gy32 = floats(size), gdx32 = floats(size);
  for (const auto form : {kernels::GeluForm::exact, kernels::GeluForm::tanh}) {
    kernels::gelu_forward(stream_, rows * cols, form, xd.as<std::uint16_t>(), gy.as<std::uint16_t>());
    kernels::gelu_backward(stream_, rows * cols, form, xd.as<std::uint16_t>(), dyd.as<std::uint16_t>(),
                           gdx.as<std::uint16_t>());
    kernels::gelu_forward(stream_, rows * cols, form, x32.as<float>(), gy32.as<float>());
    kernels::gelu_backward(stream_, rows * cols, form, x32.as<float>(), dy32.as<float>(), gdx32.as<float>());
    EXPECT_EQ(down<std::uint16_t>(gy), rounded(down<float>(gy32)));
    EXPECT_EQ(down<std::uint16_t>(gdx), rounded(down<float>(gdx32)));
  }
}

// The reductions follow the plan: cuda's LayerNorm statistics, sums and gradients are the sim's bits.
TEST(TransformerKernelsCudaMatchesSim, LayerNorm) {
  auto sim = test::sim_runtime(1);
  auto cuda = test::runtime_or_skip("cuda", 1);
  if (!cuda) GTEST_SKIP() << "no CUDA device";
  const index_t rows = 33, cols = 700;
  const auto size = static_cast<std::size_t>(rows * cols);
  const auto x = test::random_vector(size, 5, -4.0f, 4.0f), dy = test::random_vector(size, 6);
  const auto gamma = test::random_vector(static_cast<std::size_t>(cols), 7),
             beta = test::random_vector(static_cast<std::size_t>(cols), 8);
  std::vector<std::vector<float>> results[2];
  Runtime* runtimes[2] = {sim.get(), cuda.get()};
  for (int k = 0; k < 2; ++k) {
    Device& device = runtimes[k]->device(0);
    const Stream stream = device.create_stream();
    DeviceBuffer xd = test::upload(device, stream, x), g = test::upload(device, stream, gamma),
                 b = test::upload(device, stream, beta), dyd = test::upload(device, stream, dy);
    DeviceBuffer y = device.allocate(size * 4), mean = device.allocate(rows * 4), rstd = device.allocate(rows * 4),
                 dx = device.allocate(size * 4), dg = device.allocate(cols * 4), db = device.allocate(cols * 4),
                 sums = device.allocate(2 * rows * 4);
    kernels::layernorm_forward(stream, rows, cols, xd.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(),
                               mean.as<float>(), rstd.as<float>());
    kernels::layernorm_backward(stream, rows, cols, xd.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                dyd.as<float>(), dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                false);
    for (const DeviceBuffer* buffer : {&y, &mean, &rstd, &dx, &dg, &db})
      results[k].push_back(test::download<float>(stream, *buffer));
  }
  for (std::size_t i = 0; i < results[0].size(); ++i) EXPECT_EQ(results[0][i], results[1][i]) << "tensor " << i;
}

}  // namespace
}  // namespace dp
