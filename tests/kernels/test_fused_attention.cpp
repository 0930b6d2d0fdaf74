// test_fused_attention.cpp — the fused causal attention (online softmax over key tiles, no (T, T)
// matrix) against the unfused reference and PyTorch on each backend, with and without attn_dropout,
// at the mask's edges (T = 1, T not a multiple of the key tile, the largest head); its own exp and
// log against libm; what it moves; and cuda's bits against the sim's.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <gtest/gtest.h>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/kernels/attention.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;
using test::all_close;

// Units in the last place between two finite floats of one sign.
std::int64_t ulps(float a, float b) {
  std::int32_t ia = 0, ib = 0;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

// The fused attention's forward and backward on a new stream of `device`, qkv, dy and the results
// in storage T (float, or bf16 bits): y, each row's lse and dqkv.
template <class T>
struct Fused {
  std::vector<T> y;
  std::vector<float> lse;
  std::vector<T> dqkv;
};
template <class T>
Fused<T> fused_on(Device& device, const kernels::AttentionShape& s, const std::vector<T>& qkv, const std::vector<T>& dy,
                  const kernels::AttentionDropout& dropout) {
  const Stream stream = device.create_stream();
  const auto rows = static_cast<std::size_t>(kernels::attention_fused_rows(s));
  DeviceBuffer q = test::upload(device, stream, qkv), g = test::upload(device, stream, dy),
               y = device.allocate(dy.size() * sizeof(T)), lse = device.allocate(rows * 4),
               delta = device.allocate(rows * 4), dqkv = device.allocate(qkv.size() * sizeof(T));
  kernels::attention_fused_forward(stream, s, q.as<T>(), y.as<T>(), lse.as<float>(), dropout);
  kernels::attention_fused_backward(stream, s, q.as<T>(), y.as<T>(), lse.as<float>(), g.as<T>(), dqkv.as<T>(),
                                    delta.as<float>(), dropout);
  return {test::download<T>(stream, y), test::download<float>(stream, lse), test::download<T>(stream, dqkv)};
}

TEST(PortableMath, ExpIsWithinTwoUlpsOfTheTrueValue) {
  std::int64_t worst = 0;
  for (float x = -103.0f; x < 88.7f; x += 0.0137f) {
    const auto want = static_cast<float>(std::exp(static_cast<double>(x)));
    const float got = kernels::exp_portable(x);
    if (want < std::numeric_limits<float>::min()) {  // subnormal: within one subnormal step
      EXPECT_NEAR(got, want, std::numeric_limits<float>::denorm_min() * 2) << x;
      continue;
    }
    worst = std::max(worst, ulps(got, want));
  }
  EXPECT_LE(worst, 2);
  EXPECT_EQ(kernels::exp_portable(0.0f), 1.0f);
  EXPECT_EQ(kernels::exp_portable(-INFINITY), 0.0f);
  EXPECT_EQ(kernels::exp_portable(INFINITY), INFINITY);
  EXPECT_EQ(kernels::exp_portable(89.0f), INFINITY);
  EXPECT_EQ(kernels::exp_portable(-104.0f), 0.0f);
  EXPECT_TRUE(std::isnan(kernels::exp_portable(NAN)));
}

// max_portable is fmaxf: a NaN operand gives the other, two NaNs a NaN, infinities order.
TEST(PortableMath, MaxIsFmaxf) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float values[] = {-inf, -3.5f, -1e-38f, -0.0f, 0.0f, 1e-45f, 2.0f, 3e38f, inf, nan};
  for (const float a : values)
    for (const float b : values) {
      const float want = std::fmax(a, b), got = kernels::max_portable(a, b);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << a << " " << b;
      } else {
        EXPECT_EQ(got, want) << a << " " << b;  // +0 == -0: either sign, as fmaxf's
      }
    }
}

TEST(PortableMath, LogIsWithinTwoUlpsOfTheTrueValue) {
  std::int64_t worst = 0;
  for (float x = 1e-30f; x < 1e30f; x *= 1.0173f) {
    const auto want = static_cast<float>(std::log(static_cast<double>(x)));
    worst = std::max(worst, ulps(kernels::log_portable(x), want));
  }
  for (float x = 0.5f; x < 2.0f; x += 0.000731f)
    if (x != 1.0f) worst = std::max(worst, ulps(kernels::log_portable(x), static_cast<float>(std::log(double{x}))));
  EXPECT_LE(worst, 2);
  EXPECT_EQ(kernels::log_portable(1.0f), 0.0f);
  EXPECT_EQ(kernels::log_portable(0.0f), -INFINITY);
  EXPECT_EQ(kernels::log_portable(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(kernels::log_portable(-1.0f)));
  EXPECT_TRUE(std::isnan(kernels::log_portable(NAN)));
}

// erf and tanh (GELU's): within 2 ulps of the true value over every 257th float of [0, 10) (where
// glibc's erff is within 1 and its tanhf within 3), odd, and right at the edges.
TEST(PortableMath, ErfAndTanhAreWithinTwoUlpsOfTheTrueValue) {
  std::int64_t worst_erf = 0, worst_tanh = 0;
  for (std::uint32_t bits = 0; bits < 0x41200000u; bits += 257) {  // [0, 10)
    const auto x = std::bit_cast<float>(bits);
    worst_erf = std::max(worst_erf, ulps(kernels::erf_portable(x), static_cast<float>(std::erf(double{x}))));
    worst_tanh = std::max(worst_tanh, ulps(kernels::tanh_portable(x), static_cast<float>(std::tanh(double{x}))));
    ASSERT_EQ(kernels::erf_portable(-x), -kernels::erf_portable(x)) << x;
    ASSERT_EQ(kernels::tanh_portable(-x), -kernels::tanh_portable(x)) << x;
  }
  EXPECT_LE(worst_erf, 2);
  EXPECT_LE(worst_tanh, 2);
  for (const auto& f : {kernels::erf_portable, kernels::tanh_portable}) {
    EXPECT_EQ(f(0.0f), 0.0f);
    EXPECT_EQ(f(INFINITY), 1.0f);
    EXPECT_EQ(f(-INFINITY), -1.0f);
    EXPECT_EQ(f(1e30f), 1.0f);
    EXPECT_TRUE(std::isnan(f(NAN)));
  }
}

class FusedAttention : public test::BackendTest {
 protected:
  struct Result {
    std::vector<float> y, dqkv;
  };
  // Forward and backward of one form on qkv and dy; the fused form's lse also checked against the
  // unfused probabilities' normaliser by the caller through `lse`.
  Result run(bool fused, const kernels::AttentionShape& s, const std::vector<float>& qkv, const std::vector<float>& dy,
             double p = 0.0, std::vector<float>* lse = nullptr) {
    DeviceBuffer q = up(qkv), g = up(dy), y = floats(dy.size()), dqkv = floats(qkv.size());
    const auto matrices = static_cast<std::size_t>(s.probs()),
               rows = static_cast<std::size_t>(kernels::attention_fused_rows(s));
    DeviceBuffer probs = floats(fused ? rows : matrices), scratch = floats(fused ? rows : matrices),
                 dropped = floats(fused ? 1 : matrices);
    const kernels::AttentionDropout dropout{p, {7, 11, 3}, 40, fused ? nullptr : dropped.as<float>()};
    if (fused) {
      kernels::attention_fused_forward(stream_, s, q.as<float>(), y.as<float>(), probs.as<float>(), dropout);
      kernels::attention_fused_backward(stream_, s, q.as<float>(), y.as<float>(), probs.as<float>(), g.as<float>(),
                                        dqkv.as<float>(), scratch.as<float>(), dropout);
      if (lse) *lse = down<float>(probs);
    } else {
      kernels::attention_forward(stream_, s, q.as<float>(), probs.as<float>(), y.as<float>(), dropout);
      kernels::attention_backward(stream_, s, q.as<float>(), probs.as<float>(), g.as<float>(), dqkv.as<float>(),
                                  scratch.as<float>(), dropout);
    }
    return {down<float>(y), down<float>(dqkv)};
  }
  static std::vector<float> qkv_of(const kernels::AttentionShape& s, unsigned seed) {
    return test::random_vector(static_cast<std::size_t>(s.batch) * s.tokens * 3 * s.width(), seed, -2.0f, 2.0f);
  }
  static std::vector<float> dy_of(const kernels::AttentionShape& s, unsigned seed) {
    return test::random_vector(static_cast<std::size_t>(s.batch) * s.tokens * s.width(), seed);
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, FusedAttention, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// The shapes at the mask's edges: one token; T below, at and past the key tile (32) and not a
// multiple of it; the largest head the fused form takes; one head.
const kernels::AttentionShape kEdgeShapes[] = {
    {2, 1, 2, 8}, {2, 31, 3, 16}, {1, 32, 2, 32}, {2, 70, 2, 24}, {1, 45, 1, 128}, {3, 65, 4, 4},
};

TEST_P(FusedAttention, MatchesTheUnfusedReferenceWithinFp32Rounding) {
  unsigned seed = 100;
  for (const auto& s : kEdgeShapes) {
    const auto qkv = qkv_of(s, ++seed), dy = dy_of(s, ++seed);
    for (const double p : {0.0, 0.25}) {
      const Result want = run(false, s, qkv, dy, p), got = run(true, s, qkv, dy, p);
      const std::string where =
          "T=" + std::to_string(s.tokens) + " D=" + std::to_string(s.head_dim) + " p=" + std::to_string(p);
      EXPECT_TRUE(all_close(got.y, want.y, 2e-5, 2e-6)) << where;
      EXPECT_TRUE(all_close(got.dqkv, want.dqkv, 1e-4, 1e-5)) << where;
    }
  }
}

// Each query row's log-sum-exp is log sum_j exp(scale q_i . k_j) over j <= i, here in double.
TEST_P(FusedAttention, KeepsEachRowsLogSumExp) {
  const kernels::AttentionShape s{2, 40, 2, 8};
  const auto qkv = qkv_of(s, 5), dy = dy_of(s, 6);
  std::vector<float> lse;
  run(true, s, qkv, dy, 0.0, &lse);
  const int T = s.tokens, D = s.head_dim, H = s.heads;
  const auto C = static_cast<std::size_t>(s.width());
  ASSERT_EQ(lse.size(), static_cast<std::size_t>(s.batch * H * T));
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        double sum = 0.0;
        for (int j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int e = 0; e < D; ++e)
            dot += double{qkv[(static_cast<std::size_t>(b) * T + i) * 3 * C + h * D + e]} *
                   qkv[(static_cast<std::size_t>(b) * T + j) * 3 * C + C + h * D + e];
          sum += std::exp(dot / std::sqrt(static_cast<double>(D)));
        }
        EXPECT_NEAR(lse[(static_cast<std::size_t>(b) * H + h) * T + i], std::log(sum),
                    2e-6 * (1 + std::abs(std::log(sum))));
      }
}

TEST_P(FusedAttention, MatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  int cases = 0;
  for (const auto& [name, text] : golden.metadata) {
    if (name.rfind("attention.", 0) != 0) continue;
    ++cases;
    const auto meta = nlohmann::json::parse(text);
    const kernels::AttentionShape s{meta.at("batch"), meta.at("tokens"), meta.at("heads"), meta.at("head_dim")};
    const Result got = run(true, s, golden.at(name + ".qkv").to_f32(), golden.at(name + ".dy").to_f32());
    EXPECT_TRUE(all_close(got.y, golden.at(name + ".y").to_f32(), 1e-5, 1e-6)) << name;
    EXPECT_TRUE(all_close(got.dqkv, golden.at(name + ".dqkv").to_f32(), 1e-4, 1e-6)) << name;
  }
  EXPECT_EQ(cases, 3);
}

// Dropout p = 1 drops every probability: y and dv are zero (torch: att * 0), and so are dq and dk
// (nothing depends on the scores).
TEST_P(FusedAttention, DroppingEverythingGivesZeros) {
  const kernels::AttentionShape s{1, 9, 2, 4};
  const Result got = run(true, s, qkv_of(s, 8), dy_of(s, 9), 1.0);
  for (const float v : got.y) ASSERT_EQ(v, 0.0f);
  for (const float v : got.dqkv) ASSERT_EQ(v, 0.0f);
}

// What the fused kernels move: qkv and y once forward (and the rows' lse), the backward's two
// passes each their reads and their part of dqkv: 16 floats per (token, feature) and 5 per row,
// and no (T, T) matrix.
TEST_P(FusedAttention, MovesNoScoreMatrix) {
  const kernels::AttentionShape s{2, 48, 2, 16};
  const auto qkv = qkv_of(s, 3), dy = dy_of(s, 4);
  runtime_->reset_memory_traffic();
  run(true, s, qkv, dy, 0.25);
  const auto moved = traffic();
  const std::uint64_t n = static_cast<std::uint64_t>(s.batch) * s.tokens * s.width(),
                      r = static_cast<std::uint64_t>(kernels::attention_fused_rows(s));
  EXPECT_EQ(moved.at("attention_fused_forward").first, (4 * n + r) * 4);
  EXPECT_EQ(moved.at("attention_fused_backward_query").first, (6 * n + 2 * r) * 4);
  EXPECT_EQ(moved.at("attention_fused_backward_key").first, (6 * n + 2 * r) * 4);
  for (const auto& [kernel, counted] : moved) EXPECT_EQ(kernel.find("softmax"), std::string::npos) << kernel;
}

// Under autocast qkv, y, dy and dqkv are bf16: read widened, the arithmetic the fp32 kernel's on the
// widened values, each output rounded once. So the bf16 results are the fp32 kernel's on the same
// (widened) inputs, rounded: bit for bit, with attn_dropout too; the lse is the fp32 one exactly.
TEST_P(FusedAttention, Bf16StorageIsTheFp32ResultRounded) {
  const kernels::AttentionShape s{2, 37, 2, 16};
  const auto n = static_cast<std::size_t>(s.batch) * s.tokens * s.width();
  const auto rows = static_cast<std::size_t>(kernels::attention_fused_rows(s));
  std::vector<std::uint16_t> qkv16(3 * n), dy16(n);
  std::vector<float> qkv(3 * n), dy(n);
  const auto q0 = qkv_of(s, 70), g0 = dy_of(s, 71);
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = bf16_to_float(qkv16[i] = bf16_from_float(q0[i]));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = bf16_to_float(dy16[i] = bf16_from_float(g0[i]));
  for (const double p : {0.0, 0.25}) {
    const kernels::AttentionDropout dropout{p, {7, 11, 3}, 40, nullptr};
    DeviceBuffer q = up(qkv), g = up(dy), y = floats(n), lse = floats(rows), delta = floats(rows), dq = floats(3 * n);
    kernels::attention_fused_forward(stream_, s, q.as<float>(), y.as<float>(), lse.as<float>(), dropout);
    // The fp32 backward reads y as bf16 storage would hold it.
    std::vector<float> y32 = down<float>(y), y_rounded(n);
    for (std::size_t i = 0; i < n; ++i) y_rounded[i] = bf16_to_float(bf16_from_float(y32[i]));
    DeviceBuffer yr = up(y_rounded);
    kernels::attention_fused_backward(stream_, s, q.as<float>(), yr.as<float>(), lse.as<float>(), g.as<float>(),
                                      dq.as<float>(), delta.as<float>(), dropout);
    const Fused<std::uint16_t> got = fused_on(*device_, s, qkv16, dy16, dropout);
    const auto want_dq = down<float>(dq);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got.y[i], bf16_from_float(y32[i])) << "y " << i << " p=" << p;
    for (std::size_t i = 0; i < 3 * n; ++i)
      ASSERT_EQ(got.dqkv[i], bf16_from_float(want_dq[i])) << "dqkv " << i << " p=" << p;
    EXPECT_EQ(got.lse, down<float>(lse)) << p;
  }
  // One storage for all four: a bf16 qkv with an fp32 y is refused.
  DeviceBuffer q16 = up(qkv16), y = floats(n), lse = floats(rows);
  EXPECT_THROW(kernels::attention_fused_forward(stream_, s, q16.as<std::uint16_t>(), y.as<float>(), lse.as<float>()),
               InvalidArgument);
}

TEST_P(FusedAttention, RefusesAHeadPastItsRegisters) {
  const kernels::AttentionShape s{1, 2, 1, kernels::kAttentionMaxHeadDim + 1};
  DeviceBuffer q = floats(static_cast<std::size_t>(2 * 3 * s.width())),
               y = floats(static_cast<std::size_t>(2 * s.width())), lse = floats(2);
  try {
    kernels::attention_fused_forward(stream_, s, q.as<float>(), y.as<float>(), lse.as<float>());
    FAIL() << "a head of 129 features ran";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("up to 128"), std::string::npos) << e.what();
  }
}

// One body of arithmetic on both backends, its own exp and log: cuda's bits are the sim's.
TEST(FusedAttentionCudaMatchesSim, BitForBit) {
  auto sim = test::sim_runtime(1);
  auto cuda = test::runtime_or_skip("cuda", 1);
  if (!cuda) GTEST_SKIP() << "no CUDA device";
  Runtime* runtimes[2] = {sim.get(), cuda.get()};
  unsigned seed = 300;
  for (const auto& s : kEdgeShapes) {
    const auto n = static_cast<std::size_t>(s.batch) * s.tokens * s.width();
    const auto qkv = test::random_vector(3 * n, ++seed, -2.0f, 2.0f), dy = test::random_vector(n, ++seed);
    for (const double p : {0.0, 0.25}) {
      const kernels::AttentionDropout dropout{p, {7, 11, 3}, 40, nullptr};
      const Fused<float> sim_result = fused_on(runtimes[0]->device(0), s, qkv, dy, dropout),
                         cuda_result = fused_on(runtimes[1]->device(0), s, qkv, dy, dropout);
      const std::string where = "T=" + std::to_string(s.tokens) + " p=" + std::to_string(p);
      EXPECT_EQ(sim_result.y, cuda_result.y) << where;
      EXPECT_EQ(sim_result.lse, cuda_result.lse) << where;
      EXPECT_EQ(sim_result.dqkv, cuda_result.dqkv) << where;
    }
  }
  // bf16 storage (autocast), with attn_dropout.
  const kernels::AttentionShape s{2, 70, 2, 64};
  const auto n = static_cast<std::size_t>(s.batch) * s.tokens * s.width();
  std::vector<std::uint16_t> qkv(3 * n), dy(n);
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = bf16_from_float(2.0f * std::sin(0.37f * static_cast<float>(i)));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = bf16_from_float(std::cos(0.91f * static_cast<float>(i)));
  const kernels::AttentionDropout dropout{0.1, {5, 6, 7}, 8, nullptr};
  const Fused<std::uint16_t> sim_result = fused_on(runtimes[0]->device(0), s, qkv, dy, dropout),
                             cuda_result = fused_on(runtimes[1]->device(0), s, qkv, dy, dropout);
  EXPECT_EQ(sim_result.y, cuda_result.y) << "bf16 y";
  EXPECT_EQ(sim_result.lse, cuda_result.lse) << "bf16 lse";
  EXPECT_EQ(sim_result.dqkv, cuda_result.dqkv) << "bf16 dqkv";
}

}  // namespace
}  // namespace dp
