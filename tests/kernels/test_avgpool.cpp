// test_avgpool.cpp — AvgPool2d and the global average pool against a double reference, finite
// differences and PyTorch goldens, on every backend.
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

INSTANTIATE_TEST_SUITE_P(Backends, AvgPoolTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
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

}  // namespace
}  // namespace dp
