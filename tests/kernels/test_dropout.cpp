// test_dropout.cpp — Dropout's counter-based masks (Philox, as dropout.h documents them): a pure
// function of seed, layer, step and element, the same in chunks as whole, PyTorch's edge cases.
#include <Random123/philox.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <gtest/gtest.h>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/kernels/avgpool.h"
#include "dp/kernels/dropout.h"
#include "dp/kernels/loss.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::AvgPoolShape;
using kernels::DropoutKey;
using test::all_close;
using test::download;
using test::random_vector;
using test::upload;

class DropoutTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, DropoutTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// The same bits, NaN payloads aside (a NaN matches any NaN).
::testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

// ------------------------------------------------------------------------------------------------
// Dropout

// torch's kept value: noise.bernoulli_(1 - p).div_(1 - p), a float division by float(1 - p).
float torch_noise(double p) { return 1.0f / static_cast<float>(1.0 - p); }

// Element e's keep decision as dropout.h documents it, computed here with Random123 directly.
bool documented_keep(const DropoutKey& key, std::uint64_t e, double p) {
  const r123::Philox4x32::ctr_type counter = {
      {static_cast<std::uint32_t>(e / 4), static_cast<std::uint32_t>((e / 4) >> 32), key.layer_id, key.step}};
  const r123::Philox4x32::key_type k = {
      {static_cast<std::uint32_t>(key.seed), static_cast<std::uint32_t>(key.seed >> 32)}};
  const std::uint32_t word = r123::Philox4x32()(counter, k).v[e % 4];
  return std::ldexp(static_cast<double>(word >> 8), -24) >= p;
}

// Dropout of n ones: the noise of elements [offset, offset + n), 0 or the kept value.
class DropoutRun {
 public:
  DropoutRun(Device& device, const Stream& stream, std::size_t n)
      : stream_(stream),
        ones_(upload(device, stream, std::vector<float>(n, 1.0f))),
        noise_(device.allocate(n * sizeof(float))),
        n_(n) {}
  std::vector<float> noise(double p, const DropoutKey& key, kernels::index_t offset = 0) {
    kernels::dropout_forward(stream_, static_cast<kernels::index_t>(n_), p, key, offset, ones_.as<float>(),
                             noise_.as<float>());
    return download<float>(stream_, noise_);
  }

 private:
  Stream stream_;
  DeviceBuffer ones_, noise_;
  std::size_t n_;
};

std::size_t count_kept(const std::vector<float>& noise) {
  return static_cast<std::size_t>(std::count_if(noise.begin(), noise.end(), [](float v) { return v != 0.0f; }));
}

// Published Philox4x32-10 known answer (Random123 tests/kat_vectors): counter 0, key 0 gives
// 6627e8d5 e169c58d bc57ac4c 9b00dbd8, i.e. seed 0, layer 0, step 0, elements 0..3.
TEST_P(DropoutTest, DrawsPhiloxAsDocumented) {
  const auto words = kernels::dropout_words(DropoutKey{}, 0);
  EXPECT_EQ(words.v[0], 0x6627e8d5u);
  EXPECT_EQ(words.v[1], 0xe169c58du);
  EXPECT_EQ(words.v[2], 0xbc57ac4cu);
  EXPECT_EQ(words.v[3], 0x9b00dbd8u);
  // u = 0x6627e8 * 2^-24 = 0.399..., 0.880..., 0.735..., 0.605...: at p = 0.5 the first is dropped.
  DropoutRun four(*device_, stream_, 4);
  EXPECT_EQ(four.noise(0.5, DropoutKey{}), (std::vector<float>{0.0f, 2.0f, 2.0f, 2.0f}));

  // Every word of the counter and key in use: both seed halves, layer, step, and an element offset
  // past 2^34 (a block index with a non-zero high word) that is not a multiple of 4.
  const DropoutKey key{0x299f31d0a4093822ull, 0x13198a2eu, 0x03707344u};
  const kernels::index_t offset = (kernels::index_t{5} << 34) + 3;
  const std::size_t n = 1001;
  DropoutRun run(*device_, stream_, n);
  for (double p : {0.3, 0.021, 0.9}) {
    const auto got = run.noise(p, key, offset);
    std::vector<float> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = documented_keep(key, offset + i, p) ? torch_noise(p) : 0.0f;
    EXPECT_TRUE(same_bits(got, want)) << "p=" << p;
  }
}

TEST_P(DropoutTest, MaskIsAPureFunctionOfSeedLayerAndStep) {
  const std::size_t n = 4096;
  DropoutRun run(*device_, stream_, n);
  const double p = 0.3;
  const DropoutKey key{1234, 2, 7};
  const auto base = run.noise(p, key);
  EXPECT_EQ(run.noise(p, key), base) << "the same key draws the same mask";
  // Two independent masks agree on a fraction p^2 + (1-p)^2 = 0.58 of the elements; a key that
  // failed to reach the generator would agree on all of them. 0.5 is > 10 sigma from 0.58 here.
  const auto differs = [&](const std::vector<float>& other) {
    std::size_t same = 0;
    for (std::size_t i = 0; i < n; ++i) same += (base[i] != 0.0f) == (other[i] != 0.0f);
    return static_cast<double>(same) / n < 0.65;
  };
  EXPECT_TRUE(differs(run.noise(p, {1235, 2, 7}))) << "seed";
  EXPECT_TRUE(differs(run.noise(p, {1234ull + (1ull << 32), 2, 7}))) << "the seed's high word";
  EXPECT_TRUE(differs(run.noise(p, {1234, 3, 7}))) << "layer";
  EXPECT_TRUE(differs(run.noise(p, {1234, 2, 8}))) << "step";
  EXPECT_TRUE(differs(run.noise(p, key, 4096))) << "element offset";
}

// A data-parallel rank holding elements [offset, offset + n) draws what one device holding the
// whole tensor draws there: chunks at any offset (multiples of 4 or not) tile the whole exactly.
TEST_P(DropoutTest, ChunksAtTheirOffsetsEqualTheWhole) {
  const std::size_t half = 1001;  // odd: the second chunk starts mid-block
  const auto x = random_vector(2 * half, 50);
  const DropoutKey key{99, 1, 3};
  DeviceBuffer x_dev = up(x), whole = floats(2 * half), parts = floats(2 * half);
  kernels::dropout_forward(stream_, 2 * half, 0.4, key, 0, x_dev.as<float>(), whole.as<float>());
  kernels::dropout_forward(stream_, half, 0.4, key, 0, x_dev.as<float>(), parts.as<float>());
  kernels::dropout_forward(stream_, half, 0.4, key, half, x_dev.as<float>() + half, parts.as<float>() + half);
  EXPECT_TRUE(same_bits(down<float>(parts), down<float>(whole)));
  // Three uneven chunks (offsets 0, 5, 1502), the backward included.
  DeviceBuffer dx_whole = floats(2 * half), dx_parts = floats(2 * half);
  kernels::dropout_backward(stream_, 2 * half, 0.4, key, 0, x_dev.as<float>(), dx_whole.as<float>());
  for (auto [begin, end] : {std::pair<std::size_t, std::size_t>{0, 5}, {5, 1502}, {1502, 2 * half}})
    kernels::dropout_backward(stream_, static_cast<kernels::index_t>(end - begin), 0.4, key,
                              static_cast<kernels::index_t>(begin), x_dev.as<float>() + begin,
                              dx_parts.as<float>() + begin);
  EXPECT_TRUE(same_bits(down<float>(dx_parts), down<float>(dx_whole)));
}

// Kept count ~ Binomial(n, 1 - p): within 5 standard deviations (a false alarm once in ~3.5e6 runs,
// and the draws are deterministic anyway). Every kept value is torch's noise exactly.
TEST_P(DropoutTest, KeepFractionWithinStatisticalBounds) {
  const std::size_t n = std::size_t{1} << 20;
  DropoutRun run(*device_, stream_, n);
  for (double p : {0.3, 0.05, 0.9}) {
    const auto noise = run.noise(p, {2024, 0, 1});
    const double kept = static_cast<double>(count_kept(noise)) / n;
    EXPECT_LT(std::fabs(kept - (1.0 - p)), 5.0 * std::sqrt(p * (1.0 - p) / n)) << "p=" << p << " kept " << kept;
    for (float v : noise) ASSERT_TRUE(v == 0.0f || v == torch_noise(p)) << v;
  }
}

// y = x * noise and dx = dy * noise with the same mask, bit for bit, in place too.
TEST_P(DropoutTest, ForwardAndBackwardMultiplyByTheSameNoise) {
  const std::size_t n = 5003;
  const double p = 0.37;
  const DropoutKey key{7, 4, 11};
  const kernels::index_t offset = 12345;
  DropoutRun run(*device_, stream_, n);
  const auto noise = run.noise(p, key, offset);
  const auto x = random_vector(n, 60), dy = random_vector(n, 61);
  DeviceBuffer x_dev = up(x), dy_dev = up(dy), y = floats(n), dx = floats(n);
  kernels::dropout_forward(stream_, n, p, key, offset, x_dev.as<float>(), y.as<float>());
  kernels::dropout_backward(stream_, n, p, key, offset, dy_dev.as<float>(), dx.as<float>());
  std::vector<float> want_y(n), want_dx(n);
  for (std::size_t i = 0; i < n; ++i) {
    want_y[i] = x[i] * noise[i];
    want_dx[i] = dy[i] * noise[i];
  }
  EXPECT_TRUE(same_bits(down<float>(y), want_y));
  EXPECT_TRUE(same_bits(down<float>(dx), want_dx));
  kernels::dropout_forward(stream_, n, p, key, offset, x_dev.as<float>(), x_dev.as<float>());  // in place
  EXPECT_TRUE(same_bits(down<float>(x_dev), want_y));
}

// torch 1.13: F.dropout(x, 1.0) is x * 0 ([-1, nan, inf, 2] -> [-0, nan, nan, 0]), F.dropout(x, 0.0)
// returns x; a dropped element is x * 0 at any p. p = 0.021 is a probability where torch's
// 1.0f / float(1 - p) differs from float(1 / (1 - p)).
TEST_P(DropoutTest, EdgeProbabilitiesFollowPyTorch) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {-1.0f, nan, inf, 2.0f, -0.0f, 3.5f};
  DeviceBuffer x_dev = up(x), y = floats(x.size());
  kernels::dropout_forward(stream_, x.size(), 1.0, {5, 0, 0}, 0, x_dev.as<float>(), y.as<float>());
  EXPECT_TRUE(same_bits(down<float>(y), {-0.0f, nan, nan, 0.0f, -0.0f, 0.0f}));
  kernels::dropout_forward(stream_, x.size(), 0.0, {5, 0, 0}, 0, x_dev.as<float>(), y.as<float>());
  EXPECT_TRUE(same_bits(down<float>(y), x));
  kernels::dropout_backward(stream_, x.size(), 1.0, {5, 0, 0}, 0, x_dev.as<float>(), y.as<float>());
  EXPECT_TRUE(same_bits(down<float>(y), {-0.0f, nan, nan, 0.0f, -0.0f, 0.0f}));

  EXPECT_NE(torch_noise(0.021), static_cast<float>(1.0 / (1.0 - 0.021)));
  DropoutRun run(*device_, stream_, 256);
  const auto noise = run.noise(0.021, {5, 0, 0});
  ASSERT_GT(count_kept(noise), 0u);
  for (float v : noise) EXPECT_TRUE(v == 0.0f || v == torch_noise(0.021)) << v;
  // A dropped element of a negative, NaN or infinite input is x * 0, as torch's input * noise.
  const std::vector<float> specials(256, -inf);
  DeviceBuffer s_dev = up(specials), s_out = floats(256);
  kernels::dropout_forward(stream_, 256, 0.5, {5, 0, 0}, 0, s_dev.as<float>(), s_out.as<float>());
  const auto s_got = down<float>(s_out), half_noise = run.noise(0.5, {5, 0, 0});
  for (std::size_t i = 0; i < 256; ++i)
    EXPECT_TRUE(half_noise[i] == 0.0f ? std::isnan(s_got[i]) : s_got[i] == -inf) << i;
}

TEST_P(DropoutTest, RejectsBadProbabilityAndOffset) {
  DeviceBuffer x = floats(16);
  for (double p : {-0.1, 1.5, std::nan("")}) {
    EXPECT_THROW(kernels::dropout_forward(stream_, 16, p, {}, 0, x.as<float>(), x.as<float>()), InvalidArgument) << p;
    EXPECT_THROW(kernels::dropout_backward(stream_, 16, p, {}, 0, x.as<float>(), x.as<float>()), InvalidArgument) << p;
  }
  EXPECT_THROW(kernels::dropout_forward(stream_, 16, 0.5, {}, -4, x.as<float>(), x.as<float>()), InvalidArgument);
  EXPECT_THROW(kernels::dropout_forward(stream_, -1, 0.5, {}, 0, x.as<float>(), x.as<float>()), InvalidArgument);
  kernels::dropout_forward(stream_, 0, 0.5, {}, 0, x.as<float>(), x.as<float>());  // nothing to do
  if (GetParam() == "sim") {  // 17 floats run past the 16-float allocation
    EXPECT_THROW(kernels::dropout_forward(stream_, 17, 0.5, {}, 0, x.as<float>(), x.as<float>()), DeviceMismatch);
  }
  stream_.synchronize();
}

}  // namespace
}  // namespace dp
