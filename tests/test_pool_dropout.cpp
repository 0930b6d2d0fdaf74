// test_pool_dropout.cpp — AvgPool2d, the global average pool, Dropout and the label-smoothed
// cross-entropy against plain host loops (in double), finite differences and torch 1.13 goldens
// (tests/golden/make_loss_goldens.py), on every backend.
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

class AvgPoolTest : public test::BackendTest {};
class DropoutTest : public test::BackendTest {};
class LabelSmoothingTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, AvgPoolTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Backends, DropoutTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Backends, LabelSmoothingTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// Distance in units in the last place (0 = the same bits; +0 and -0 are 0 apart, as a value).
std::int64_t ulps(float a, float b) {
  if (a == b) return 0;
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  // Map the sign-magnitude bit patterns onto one monotonic integer line.
  const std::int64_t la = ia < 0 ? -static_cast<std::int64_t>(ia & 0x7fffffff) : ia;
  const std::int64_t lb = ib < 0 ? -static_cast<std::int64_t>(ib & 0x7fffffff) : ib;
  return std::llabs(la - lb);
}
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
// AvgPool2d and the global average pool

std::size_t pool_in(const AvgPoolShape& s) { return static_cast<std::size_t>(s.n) * s.c * s.h * s.w; }
std::size_t pool_out(const AvgPoolShape& s) { return static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out(); }

// The definition in double: every window divides by kernel^2 (count_include_pad=True), the padded
// positions count as zeros; dx gathers dy / kernel^2 from every window covering the input.
std::vector<double> avgpool_reference(const AvgPoolShape& s, const std::vector<float>& x) {
  std::vector<double> y(pool_out(s));
  const int ho = s.h_out(), wo = s.w_out();
  for (int p = 0; p < s.n * s.c; ++p)
    for (int oh = 0; oh < ho; ++oh)
      for (int ow = 0; ow < wo; ++ow) {
        double sum = 0.0;
        for (int kh = 0; kh < s.kernel; ++kh)
          for (int kw = 0; kw < s.kernel; ++kw) {
            const int ih = oh * s.stride - s.pad + kh, iw = ow * s.stride - s.pad + kw;
            if (ih >= 0 && ih < s.h && iw >= 0 && iw < s.w)
              sum += x[(static_cast<std::size_t>(p) * s.h + ih) * s.w + iw];
          }
        y[(static_cast<std::size_t>(p) * ho + oh) * wo + ow] = sum / (s.kernel * s.kernel);
      }
  return y;
}
std::vector<double> avgpool_grad_reference(const AvgPoolShape& s, const std::vector<float>& dy) {
  std::vector<double> dx(pool_in(s), 0.0);
  const int ho = s.h_out(), wo = s.w_out();
  for (int p = 0; p < s.n * s.c; ++p)
    for (int oh = 0; oh < ho; ++oh)
      for (int ow = 0; ow < wo; ++ow)
        for (int kh = 0; kh < s.kernel; ++kh)
          for (int kw = 0; kw < s.kernel; ++kw) {
            const int ih = oh * s.stride - s.pad + kh, iw = ow * s.stride - s.pad + kw;
            if (ih >= 0 && ih < s.h && iw >= 0 && iw < s.w)
              dx[(static_cast<std::size_t>(p) * s.h + ih) * s.w + iw] +=
                  dy[(static_cast<std::size_t>(p) * ho + oh) * wo + ow] / double(s.kernel * s.kernel);
          }
  return dx;
}

// Overlapping windows with padding (3/2/1 and 3/1/1), the plain 2/2/0, stride != kernel (5/3/2),
// a stride larger than the kernel (2/3/0: some inputs lie in no window, their gradient is 0), a
// window as large as the padded input, and a one-pixel plane.
const AvgPoolShape kPoolShapes[] = {{2, 3, 9, 8, 3, 2, 1},   {1, 2, 7, 6, 3, 1, 1}, {2, 2, 8, 6, 2, 2, 0},
                                    {1, 2, 11, 10, 5, 3, 2}, {1, 2, 8, 8, 2, 3, 0}, {2, 1, 3, 4, 5, 1, 2},
                                    {3, 2, 1, 1, 1, 1, 0}};

TEST_P(AvgPoolTest, ForwardBackwardMatchDoubleReference) {
  unsigned seed = 300;
  for (const AvgPoolShape& s : kPoolShapes) {
    SCOPED_TRACE(::testing::Message() << "shape " << s.n << "x" << s.c << "x" << s.h << "x" << s.w << " kernel "
                                      << s.kernel << " stride " << s.stride << " pad " << s.pad);
    const auto x = random_vector(pool_in(s), ++seed), dy = random_vector(pool_out(s), ++seed);
    DeviceBuffer x_dev = up(x), dy_dev = up(dy), y = floats(pool_out(s));
    DeviceBuffer dx = up(std::vector<float>(pool_in(s), 99.0f));  // overwritten, not accumulated
    kernels::avgpool_forward(stream_, s, x_dev.as<float>(), y.as<float>());
    kernels::avgpool_backward(stream_, s, dy_dev.as<float>(), dx.as<float>());
    // fp32 sums of at most 25 values (a 5x5 window forward; 25 windows over an input at kernel 5,
    // stride 1 backward): 24 roundings of partial sums below 25, then / 25 (forward) or of terms
    // dy / 25 (backward): at worst 24 * 2^-24 ~ 1.5e-6 absolute.
    EXPECT_TRUE(all_close(down<float>(y), to_float(avgpool_reference(s, x)), 0.0, 2e-6));
    EXPECT_TRUE(all_close(down<float>(dx), to_float(avgpool_grad_reference(s, dy)), 0.0, 2e-6));
  }
}

TEST_P(AvgPoolTest, GlobalForwardBackwardMatchReference) {
  unsigned seed = 400;
  for (int hw : {1, 49, 196, 1000}) {
    const int n = 3, c = 4;
    const std::size_t planes = static_cast<std::size_t>(n) * c;
    const auto x = random_vector(planes * hw, ++seed), dy = random_vector(planes, ++seed);
    DeviceBuffer x_dev = up(x), dy_dev = up(dy), y = floats(planes), dx = floats(planes * hw);
    kernels::global_avgpool_forward(stream_, n, c, hw, x_dev.as<float>(), y.as<float>());
    kernels::global_avgpool_backward(stream_, n, c, hw, dy_dev.as<float>(), dx.as<float>());
    std::vector<double> mean(planes, 0.0);
    for (std::size_t p = 0; p < planes; ++p) {
      for (int k = 0; k < hw; ++k) mean[p] += x[p * hw + k];
      mean[p] /= hw;
    }
    // A serial fp32 sum of hw values |v| <= 1 is off by at most (hw - 1) roundings of partial sums
    // below hw: after the division, (hw - 1) * 2^-24 absolute. Typical errors are far smaller.
    EXPECT_TRUE(all_close(down<float>(y), to_float(mean), 0.0, hw * std::ldexp(1.0, -24) + 1e-9)) << "hw=" << hw;
    // The backward is one fp32 division per element, torch's dy / hw: exactly.
    std::vector<float> want(planes * hw);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = dy[i / hw] / static_cast<float>(hw);
    EXPECT_TRUE(same_bits(down<float>(dx), want)) << "hw=" << hw;
  }
}

// Both pools are linear: central differences of L = sum(y * r) have no truncation error, only the
// rounding of L (~1e-7 relative over <= 200 terms |y r| <= 1, so ~1e-6 absolute) over 2h = 0.1.
TEST_P(AvgPoolTest, GradientsMatchFiniteDifferences) {
  const AvgPoolShape s{1, 2, 7, 6, 3, 2, 1};
  const int hw = s.h * s.w;
  const auto x = random_vector(pool_in(s), 31), r = random_vector(pool_out(s), 32), r_global = random_vector(2, 33);
  DeviceBuffer y = floats(pool_out(s)), y_global = floats(2);
  auto loss = [&](const std::vector<float>& xv, bool global) {
    DeviceBuffer xv_dev = up(xv);
    if (global) {
      kernels::global_avgpool_forward(stream_, s.n, s.c, hw, xv_dev.as<float>(), y_global.as<float>());
    } else {
      kernels::avgpool_forward(stream_, s, xv_dev.as<float>(), y.as<float>());
    }
    const auto yv = down<float>(global ? y_global : y);
    const auto& weights = global ? r_global : r;
    double l = 0.0;
    for (std::size_t o = 0; o < yv.size(); ++o) l += static_cast<double>(yv[o]) * weights[o];
    return l;
  };
  for (bool global : {false, true}) {
    std::vector<double> fd(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      std::vector<float> v = x;
      v[i] = x[i] + 0.05f;
      const double up_loss = loss(v, global), up_at = v[i];
      v[i] = x[i] - 0.05f;
      const double down_loss = loss(v, global), down_at = v[i];
      fd[i] = (up_loss - down_loss) / (up_at - down_at);
    }
    DeviceBuffer dr = up(global ? r_global : r), dx = floats(pool_in(s));
    if (global) {
      kernels::global_avgpool_backward(stream_, s.n, s.c, hw, dr.as<float>(), dx.as<float>());
    } else {
      kernels::avgpool_backward(stream_, s, dr.as<float>(), dx.as<float>());
    }
    EXPECT_TRUE(all_close(down<float>(dx), to_float(fd), 0.0, 1e-4)) << (global ? "global" : "avgpool");
  }
}

// torch.nn.AvgPool2d: the same bits forward and backward (same summation order, same division).
// AdaptiveAvgPool2d(1) is x.mean((-1, -2)) in torch: its backward is exact, its forward sums in
// ATen's vectorised cascade (8 lanes x 4 accumulators on this machine's AVX2), not serially, so
// it agrees to a few ulp of the sum's magnitude instead (see the bound below).
TEST_P(AvgPoolTest, MatchesPyTorchGoldens) {
  const auto golden = safetensors::read(test::golden_path("avgpool"));
  for (const auto& [name, json] : golden.metadata) {
    if (name == "torch") continue;
    SCOPED_TRACE(name);
    const auto h = nlohmann::json::parse(json);
    const auto& x_tensor = golden.at(name + ".x");
    const auto& shape = x_tensor.shape;
    ASSERT_EQ(shape.size(), 4u);
    const int n = static_cast<int>(shape[0]), c = static_cast<int>(shape[1]), hh = static_cast<int>(shape[2]),
              ww = static_cast<int>(shape[3]);
    const auto x = x_tensor.to_f32(), dy = golden.at(name + ".dy").to_f32();
    const auto want_y = golden.at(name + ".y").to_f32(), want_dx = golden.at(name + ".dx").to_f32();
    DeviceBuffer x_dev = up(x), dy_dev = up(dy), y = floats(want_y.size()), dx = floats(x.size());
    if (h.contains("global")) {
      kernels::global_avgpool_forward(stream_, n, c, hh * ww, x_dev.as<float>(), y.as<float>());
      kernels::global_avgpool_backward(stream_, n, c, hh * ww, dy_dev.as<float>(), dx.as<float>());
      // Either order of summing the hw values is within (hw - 1) * 2^-24 * sum|v| of the exact sum,
      // so the two means differ by at most 2 * 2^-24 * sum|v|. Observed on sim: under 1% of that.
      double bound = 0.0;
      for (std::size_t p = 0; p < want_y.size(); ++p) {
        double magnitude = 0.0;
        for (int k = 0; k < hh * ww; ++k) magnitude += std::fabs(x[p * hh * ww + k]);
        bound = std::max(bound, 2.0 * std::ldexp(magnitude, -24));
      }
      EXPECT_TRUE(all_close(down<float>(y), want_y, 0.0, bound));
    } else {
      const AvgPoolShape s{n, c, hh, ww, h.at("kernel").get<int>(), h.at("stride").get<int>(), h.at("pad").get<int>()};
      kernels::avgpool_forward(stream_, s, x_dev.as<float>(), y.as<float>());
      kernels::avgpool_backward(stream_, s, dy_dev.as<float>(), dx.as<float>());
      EXPECT_TRUE(same_bits(down<float>(y), want_y));
    }
    EXPECT_TRUE(same_bits(down<float>(dx), want_dx));
  }
}

TEST_P(AvgPoolTest, RejectsBadShapesAndForeignOperands) {
  DeviceBuffer x = up(std::vector<float>(16, 1.0f)), y = floats(16);
  for (const AvgPoolShape& bad : {AvgPoolShape{1, 1, 4, 4, 3, 1, 2},      // pad > kernel/2
                                  AvgPoolShape{1, 1, 4, 4, 0, 1, 0},      // empty kernel
                                  AvgPoolShape{1, 1, 4, 4, 2, 0, 0},      // zero stride
                                  AvgPoolShape{1, 1, 2, 4, 5, 1, 1},      // window larger than padded input
                                  AvgPoolShape{-1, 1, 4, 4, 2, 2, 0}}) {  // negative extent
    EXPECT_THROW(kernels::avgpool_forward(stream_, bad, x.as<float>(), y.as<float>()), InvalidArgument);
    EXPECT_THROW(kernels::avgpool_backward(stream_, bad, y.as<float>(), x.as<float>()), InvalidArgument);
  }
  EXPECT_THROW(kernels::global_avgpool_forward(stream_, 1, 1, 0, x.as<float>(), y.as<float>()), InvalidArgument);
  EXPECT_THROW(kernels::global_avgpool_backward(stream_, -1, 1, 4, x.as<float>(), y.as<float>()), InvalidArgument);
  if (GetParam() != "sim") return;
  const AvgPoolShape s{1, 1, 4, 4, 2, 2, 0};
  DeviceBuffer other = runtime_->device(0).allocate(16 * sizeof(float));
  EXPECT_THROW(kernels::avgpool_forward(stream_, s, other.as<float>(), y.as<float>()), DeviceMismatch);
  EXPECT_THROW(kernels::avgpool_backward(stream_, s, y.as<float>(), other.as<float>()), DeviceMismatch);
  EXPECT_THROW(kernels::global_avgpool_forward(stream_, 1, 2, 8, other.as<float>(), y.as<float>()), DeviceMismatch);
  EXPECT_THROW(kernels::global_avgpool_forward(stream_, 1, 2, 9, x.as<float>(), y.as<float>()), DeviceMismatch)
      << "18 floats read from a 16-float buffer";
  stream_.synchronize();  // nothing was queued: the stream is healthy
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

// ------------------------------------------------------------------------------------------------
// Cross-entropy with label smoothing

// The definition in double: log p = x - max - log(sum exp(x - max)); term_i = (1 - eps)(-log p_t)
// + (eps / C) sum_c (-log p_c); dlogits = (softmax - q) * scale with q = (1 - eps) onehot + eps / C.
struct SmoothedReference {
  std::vector<double> terms, dlogits;
  double loss = 0.0;
};
SmoothedReference smoothed_reference(const std::vector<float>& logits, const std::vector<std::int64_t>& t, int classes,
                                     double eps, double scale) {
  const int n = static_cast<int>(t.size());
  SmoothedReference r{std::vector<double>(n), std::vector<double>(logits.size()), 0.0};
  for (int i = 0; i < n; ++i) {
    const float* x = &logits[static_cast<std::size_t>(i) * classes];
    double m = x[0], s = 0.0, smooth = 0.0;
    for (int c = 0; c < classes; ++c) m = std::max<double>(m, x[c]);
    for (int c = 0; c < classes; ++c) s += std::exp(x[c] - m);
    for (int c = 0; c < classes; ++c) smooth -= x[c] - m - std::log(s);
    r.terms[i] = (1.0 - eps) * -(x[t[i]] - m - std::log(s)) + eps / classes * smooth;
    r.loss += r.terms[i] / n;
    for (int c = 0; c < classes; ++c) {
      const double q = (c == t[i] ? 1.0 - eps : 0.0) + eps / classes;
      r.dlogits[static_cast<std::size_t>(i) * classes + c] = (std::exp(x[c] - m) / s - q) * scale;
    }
  }
  return r;
}

struct LossBuffers {
  LossBuffers(Device& device, const Stream& stream, const std::vector<float>& logits_h,
              const std::vector<std::int64_t>& targets_h)
      : n(static_cast<int>(targets_h.size())),
        classes(static_cast<int>(logits_h.size() / targets_h.size())),
        logits(upload(device, stream, logits_h)),
        targets(upload(device, stream, targets_h)),
        per_sample(device.allocate(targets_h.size() * sizeof(float))),
        loss(device.allocate(sizeof(float))),
        dlogits(device.allocate(logits_h.size() * sizeof(float))) {}
  void forward(const Stream& stream, double eps) {
    kernels::cross_entropy_forward(stream, n, classes, logits.as<float>(), targets.as<std::int64_t>(),
                                   per_sample.as<float>(), loss.as<float>(), eps);
  }
  void backward(const Stream& stream, double eps, float dloss, int mean_over) {
    kernels::cross_entropy_backward(stream, n, classes, logits.as<float>(), targets.as<std::int64_t>(), dloss,
                                    mean_over, dlogits.as<float>(), eps);
  }
  int n, classes;
  DeviceBuffer logits, targets, per_sample, loss, dlogits;
};

TEST_P(LabelSmoothingTest, MatchesDoubleReference) {
  unsigned seed = 500;
  for (int classes : {10, 3})
    for (int n : {1, 7, 64})
      for (double eps : {0.1, 0.25, 1.0}) {
        SCOPED_TRACE(::testing::Message() << "classes=" << classes << " n=" << n << " eps=" << eps);
        const auto logits = random_vector(static_cast<std::size_t>(n) * classes, ++seed, -3.0f, 3.0f);
        const auto targets = test::random_targets(n, classes, ++seed);
        LossBuffers b(*device_, stream_, logits, targets);
        b.forward(stream_, eps);
        const auto ref = smoothed_reference(logits, targets, classes, eps, 1.0 / n);
        // Per-sample terms: C values -log p_c (each within a few ulp: expf/logf ~2 ulp, the sum of
        // C exps ~C ulp) summed in fp32: ~C * 2^-23 relative to the sum's magnitude (<= ~60).
        EXPECT_TRUE(all_close(down<float>(b.per_sample), to_float(ref.terms), 4e-6, 4e-6));
        const float loss = down<float>(b.loss)[0];
        EXPECT_NEAR(loss, ref.loss, 4e-6 * (1.0 + std::fabs(ref.loss)));
        for (auto [dloss, mean_over] : {std::pair{1.0f, n}, std::pair{0.5f, 4 * n}}) {
          b.backward(stream_, eps, dloss, mean_over);
          const auto want = smoothed_reference(logits, targets, classes, eps, double(dloss) / mean_over);
          // softmax within ~10 ulp relative, q rounded once, scaled by <= 1.
          EXPECT_TRUE(all_close(down<float>(b.dlogits), to_float(want.dlogits), 1e-5, 1e-6));
        }
      }
}

// label_smoothing = 0, passed or defaulted, is the plain loss: the same kernels, the same bits.
TEST_P(LabelSmoothingTest, ZeroSmoothingIsThePlainLoss) {
  const int n = 9, classes = 10;
  const auto logits = random_vector(n * classes, 70, -4.0f, 4.0f);
  const auto targets = test::random_targets(n, classes, 71);
  LossBuffers b(*device_, stream_, logits, targets);
  kernels::cross_entropy_forward(stream_, n, classes, b.logits.as<float>(), b.targets.as<std::int64_t>(),
                                 b.per_sample.as<float>(), b.loss.as<float>());
  kernels::cross_entropy_backward(stream_, n, classes, b.logits.as<float>(), b.targets.as<std::int64_t>(), 1.0f, n,
                                  b.dlogits.as<float>());
  const auto loss = down<float>(b.loss), terms = down<float>(b.per_sample), grad = down<float>(b.dlogits);
  b.forward(stream_, 0.0);
  b.backward(stream_, 0.0, 1.0f, n);
  EXPECT_TRUE(same_bits(down<float>(b.loss), loss));
  EXPECT_TRUE(same_bits(down<float>(b.per_sample), terms));
  EXPECT_TRUE(same_bits(down<float>(b.dlogits), grad));
  // A tiny smoothing takes the other path yet moves the loss by about eps * (smooth/C - nll) only.
  b.forward(stream_, 1e-6);
  EXPECT_NEAR(down<float>(b.loss)[0], loss[0], 1e-4);
}

// Central differences of the device loss, as for the plain loss (test_loss_optimizer): eps 1e-2,
// the smoothing adds terms of the same smoothness (sums of log-softmax), so the same 3e-4 bound.
TEST_P(LabelSmoothingTest, GradientMatchesFiniteDifferences) {
  const int n = 3, classes = 10;
  const double smoothing = 0.2;
  const auto logits = random_vector(n * classes, 80, -2.0f, 2.0f);
  const auto targets = test::random_targets(n, classes, 81);
  LossBuffers b(*device_, stream_, logits, targets);
  b.backward(stream_, smoothing, 1.0f, n);
  const auto grad = down<float>(b.dlogits);
  const auto device_loss = [&](const std::vector<float>& x) {
    stream_.copy(b.logits.data(), x.data(), x.size() * sizeof(float));
    b.forward(stream_, smoothing);
    return static_cast<double>(down<float>(b.loss)[0]);
  };
  const float h = 1e-2f;
  std::vector<float> fd(logits.size());
  for (std::size_t k = 0; k < logits.size(); ++k) {
    auto plus = logits, minus = logits;
    plus[k] += h;
    minus[k] -= h;
    fd[k] = static_cast<float>((device_loss(plus) - device_loss(minus)) / (static_cast<double>(plus[k]) - minus[k]));
  }
  EXPECT_TRUE(all_close(grad, fd, 0.0, 3e-4));
}

// torch.nn.functional.cross_entropy(label_smoothing=eps), CPU: the kernel follows its order of
// operations (two means, then (1 - eps) * nll + smooth * (eps / C)), but torch's log_softmax uses
// its vectorised exp (Sleef) and sums in a vectorised / cascaded order, libm's and CUDA's expf and
// logf differ from it by an ulp or two: the results agree to a few ulp, not bit for bit.
// Observed on sim: the loss within 1 ulp; per-sample terms within 2 ulp of max(1, |term|) (a term
// near 0 is log(sum) with sum ~ 1, so its error is absolute); dlogits within 4 ulp of 1/N.
TEST_P(LabelSmoothingTest, MatchesPyTorchGoldens) {
  const auto golden = safetensors::read(test::golden_path("label_smoothing"));
  int cases = 0;
  for (const auto& [name, json] : golden.metadata) {
    if (name == "torch") continue;
    SCOPED_TRACE(name);
    ++cases;
    const auto h = nlohmann::json::parse(json);
    const double eps = h.at("label_smoothing");
    const int n = h.at("n"), classes = h.at("classes");
    const auto logits = golden.at(name + ".logits").to_f32();
    const auto targets = golden.at(name + ".targets").to_i64();
    ASSERT_EQ(logits.size(), static_cast<std::size_t>(n) * classes);
    LossBuffers b(*device_, stream_, logits, targets);
    b.forward(stream_, eps);
    b.backward(stream_, eps, 1.0f, n);
    // Margins of 2 to 4 over what sim shows, for CUDA's expf/logf (within 2 ulp of exact, as are
    // glibc's): the loss 4 ulp; terms 8 ulp of max(1, |term|); the gradient 8 ulp of its scale 1/N
    // (entries near 0 carry absolute, not relative, error).
    const float want_loss = golden.at(name + ".loss").to_f32()[0];
    EXPECT_LE(ulps(down<float>(b.loss)[0], want_loss), 4) << down<float>(b.loss)[0] << " vs " << want_loss;
    EXPECT_TRUE(
        all_close(down<float>(b.per_sample), golden.at(name + ".per_sample").to_f32(), 8 * 0x1p-23, 8 * 0x1p-23));
    EXPECT_TRUE(all_close(down<float>(b.dlogits), golden.at(name + ".dlogits").to_f32(), 0.0, 8 * 0x1p-23 / n));
  }
  EXPECT_EQ(cases, 10);
}

TEST_P(LabelSmoothingTest, RejectsSmoothingOutsideZeroToOne) {
  LossBuffers b(*device_, stream_, std::vector<float>(20, 0.5f), std::vector<std::int64_t>{1, 2});
  for (double eps : {-0.1, 1.1, std::nan("")}) {
    EXPECT_THROW(b.forward(stream_, eps), InvalidArgument) << eps;
    EXPECT_THROW(b.backward(stream_, eps, 1.0f, 2), InvalidArgument) << eps;
  }
  stream_.synchronize();  // nothing was queued
}

// A bad target with smoothing: NaN for its sample and the loss, and the sim stream fails, as without.
TEST_P(LabelSmoothingTest, InvalidTargetGivesNaN) {
  Stream stream = device_->create_stream();  // a failed sim stream stays failed
  LossBuffers b(*device_, stream_, random_vector(30, 90), std::vector<std::int64_t>{2, 10, 0});
  stream_.synchronize();
  b.forward(stream, 0.1);
  if (GetParam() == "sim") {
    EXPECT_THROW(stream.synchronize(), InvalidArgument);
  } else {
    stream.synchronize();
  }
  const auto terms = down<float>(b.per_sample);
  EXPECT_TRUE(std::isfinite(terms[0]) && std::isnan(terms[1]) && std::isfinite(terms[2]));
  EXPECT_TRUE(std::isnan(down<float>(b.loss)[0]));
}

}  // namespace
}  // namespace dp
