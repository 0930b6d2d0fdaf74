// test_maxpool.cpp — MaxPool2d against plain host loops and finite differences, on every backend;
// ties, NaN and infinity as torch 1.13 (CPU) routes them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <gtest/gtest.h>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "dp/kernels/batchnorm.h"
#include "dp/kernels/maxpool.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::BatchNormShape;
using kernels::MaxPoolShape;
using test::all_close;
using test::download;
using test::random_vector;
using test::upload;

class MaxPoolTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, MaxPoolTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

std::size_t pool_in(const MaxPoolShape& s) { return static_cast<std::size_t>(s.n) * s.c * s.h * s.w; }
std::size_t pool_out(const MaxPoolShape& s) { return static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out(); }

struct PoolReference {
  std::vector<float> y;
  std::vector<std::int32_t> argmax;
};

PoolReference pool_reference(const MaxPoolShape& s, const std::vector<float>& x) {
  PoolReference r{std::vector<float>(pool_out(s)), std::vector<std::int32_t>(pool_out(s))};
  const int ho = s.h_out(), wo = s.w_out();
  std::size_t o = 0;
  for (int nc = 0; nc < s.n * s.c; ++nc)
    for (int oh = 0; oh < ho; ++oh)
      for (int ow = 0; ow < wo; ++ow, ++o) {
        float best = -std::numeric_limits<float>::infinity();
        int at = -1;
        for (int kh = 0; kh < s.kernel; ++kh)
          for (int kw = 0; kw < s.kernel; ++kw) {
            const int ih = oh * s.stride - s.pad + kh, iw = ow * s.stride - s.pad + kw;
            if (ih < 0 || ih >= s.h || iw < 0 || iw >= s.w) continue;  // padding: -inf, never chosen
            const float v = x[static_cast<std::size_t>(nc) * s.h * s.w + ih * s.w + iw];
            if (at < 0 || v > best || std::isnan(v)) {
              best = v;
              at = ih * s.w + iw;
            }
          }
        r.y[o] = best;
        r.argmax[o] = at;
      }
  return r;
}

// The scatter PyTorch's CPU backward does, output by output in row-major order: the same order in
// which the kernel's gather meets each input's contributions, so the sums agree bit for bit.
std::vector<float> pool_grad_reference(const MaxPoolShape& s, const std::vector<std::int32_t>& argmax,
                                       const std::vector<float>& dy) {
  std::vector<float> dx(pool_in(s), 0.0f);
  const std::size_t plane_out = static_cast<std::size_t>(s.h_out()) * s.w_out();
  for (std::size_t o = 0; o < dy.size(); ++o)
    dx[o / plane_out * s.h * s.w + static_cast<std::size_t>(argmax[o])] += dy[o];
  return dx;
}

// Shapes: MNIST 28x28 with 2x2/2; odd 7x5 (the last row and column are dropped); overlapping
// 3x3/2 pad 1 on even and odd sizes; stride 1 (every input in up to 9 windows); a whole-plane window.
const MaxPoolShape kPoolShapes[] = {{2, 3, 28, 28, 2, 2, 0}, {2, 2, 7, 5, 2, 2, 0}, {2, 3, 28, 28, 3, 2, 1},
                                    {1, 2, 7, 5, 3, 2, 1},   {1, 2, 6, 7, 3, 1, 1}, {2, 1, 4, 3, 3, 3, 0}};

TEST_P(MaxPoolTest, ForwardAndBackwardMatchHostLoops) {
  unsigned seed = 200;
  for (const MaxPoolShape& s : kPoolShapes) {
    SCOPED_TRACE(::testing::Message() << "shape " << s.n << "x" << s.c << "x" << s.h << "x" << s.w << " k" << s.kernel
                                      << " s" << s.stride << " p" << s.pad);
    // Values on a coarse grid: many exact ties, which must resolve as PyTorch resolves them.
    std::vector<float> x = random_vector(pool_in(s), ++seed);
    for (auto& v : x) v = std::round(v * 4.0f) / 4.0f;
    const auto dy = random_vector(pool_out(s), ++seed);
    DeviceBuffer x_dev = up(x), ddy = up(dy), y = device_->allocate(pool_out(s) * sizeof(float)),
                 argmax = device_->allocate(pool_out(s) * sizeof(std::int32_t)),
                 dx = up(std::vector<float>(pool_in(s), 99.0f));  // overwritten, not accumulated
    kernels::maxpool_forward(stream_, s, x_dev.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
    kernels::maxpool_backward(stream_, s, argmax.as<std::int32_t>(), ddy.as<float>(), dx.as<float>());
    const PoolReference r = pool_reference(s, x);
    EXPECT_EQ(down<float>(y), r.y);
    EXPECT_EQ(down<std::int32_t>(argmax), r.argmax);
    EXPECT_EQ(down<float>(dx), pool_grad_reference(s, r.argmax, dy));
  }
}

// Expected values from torch.nn.functional.max_pool2d(..., return_indices=True), torch 1.13 CPU.
TEST_P(MaxPoolTest, TiesNanAndInfinityFollowPyTorch) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  struct Case {
    MaxPoolShape shape;
    std::vector<float> x;
    std::vector<std::int32_t> argmax;
  };
  const Case cases[] = {
      {{1, 1, 2, 2, 2, 2, 0}, {1, 5, 5, 2}, {1}},                             // equal maxima: the first in scan order
      {{1, 1, 2, 2, 2, 2, 0}, {1, nan, 3, 2}, {1}},                           // NaN wins over larger values
      {{1, 1, 2, 2, 2, 2, 0}, {nan, 1, nan, 2}, {2}},                         // ... and a later NaN over an earlier one
      {{1, 1, 2, 3, 3, 2, 1}, {-inf, -inf, -inf, -inf, -inf, -inf}, {0, 1}},  // all -inf: first real element
      {{1, 1, 2, 3, 3, 2, 1}, {3, 3, 3, 3, 3, 3}, {0, 1}},                    // padding never beats a real value
  };
  for (const Case& k : cases) {
    DeviceBuffer x = up(k.x), y = device_->allocate(k.argmax.size() * sizeof(float)),
                 argmax = device_->allocate(k.argmax.size() * sizeof(std::int32_t));
    kernels::maxpool_forward(stream_, k.shape, x.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
    const auto got = down<std::int32_t>(argmax);
    EXPECT_EQ(got, k.argmax);
    const auto yv = down<float>(y);
    for (std::size_t o = 0; o < yv.size(); ++o) {
      const float want = k.x[static_cast<std::size_t>(k.argmax[o])];
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(yv[o])) << o;
      } else {
        EXPECT_EQ(yv[o], want) << o;
      }
    }
  }
}

// 3x3 stride 2 pad 1 over a 5x5 plane of zeros but one 10 at (1,1): that input is the maximum of
// four overlapping windows and gathers all four gradients; the other windows pick their first
// real element (ties). The expected dx is torch's x.grad for dy = 1..9.
TEST_P(MaxPoolTest, OverlappingWindowsSumTheirGradients) {
  const MaxPoolShape s{1, 1, 5, 5, 3, 2, 1};
  std::vector<float> x(25, 0.0f);
  x[1 * 5 + 1] = 10.0f;
  std::vector<float> dy(9);
  std::iota(dy.begin(), dy.end(), 1.0f);
  DeviceBuffer x_dev = up(x), ddy = up(dy), y = device_->allocate(9 * sizeof(float)),
               argmax = device_->allocate(9 * sizeof(std::int32_t)), dx = device_->allocate(25 * sizeof(float));
  kernels::maxpool_forward(stream_, s, x_dev.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
  kernels::maxpool_backward(stream_, s, argmax.as<std::int32_t>(), ddy.as<float>(), dx.as<float>());
  const std::vector<float> want = {0, 0,  0, 3, 0,  //
                                   0, 12, 0, 6, 0,  //
                                   0, 0,  0, 0, 0,  //
                                   7, 8,  0, 9, 0,  //
                                   0, 0,  0, 0, 0};
  EXPECT_EQ(down<float>(dx), want);
}

// Central differences of L = sum(y * r). Inputs are a shuffled grid 0.05 apart, so a step of 1e-3
// never changes which input a window picks: L is linear there, the difference quotient exact up
// to rounding of L (~1e-7 relative over ~100 terms, /2e-3 => ~1e-5). Tolerance 1e-4 absolute.
// Overlapping windows (3x3 stride 2 pad 1) make some inputs the maximum of several outputs.
TEST_P(MaxPoolTest, GradientMatchesFiniteDifferences) {
  const MaxPoolShape s{1, 2, 7, 6, 3, 2, 1};
  std::vector<float> x(pool_in(s));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.05f * static_cast<float>(i) - 1.0f;
  std::shuffle(x.begin(), x.end(), std::mt19937(30));
  const auto r = random_vector(pool_out(s), 31);
  DeviceBuffer y = device_->allocate(pool_out(s) * sizeof(float)),
               argmax = device_->allocate(pool_out(s) * sizeof(std::int32_t));
  auto loss = [&](const std::vector<float>& xv) {
    DeviceBuffer xv_dev = up(xv);
    kernels::maxpool_forward(stream_, s, xv_dev.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
    const auto yv = down<float>(y);
    double l = 0.0;
    for (std::size_t o = 0; o < yv.size(); ++o) l += static_cast<double>(yv[o]) * r[o];
    return l;
  };
  std::vector<double> fd(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::vector<float> v = x;
    v[i] = x[i] + 1e-3f;
    const double up_loss = loss(v), up_at = v[i];
    v[i] = x[i] - 1e-3f;
    const double down_loss = loss(v), down_at = v[i];
    fd[i] = (up_loss - down_loss) / (up_at - down_at);
  }
  loss(x);
  DeviceBuffer dr = up(r), dx = device_->allocate(pool_in(s) * sizeof(float));
  kernels::maxpool_backward(stream_, s, argmax.as<std::int32_t>(), dr.as<float>(), dx.as<float>());
  const auto got = down<float>(dx);
  EXPECT_TRUE(all_close(got, to_float(fd), 0.0, 1e-4));
  // Some input must have been picked by more than one window, or the check above proves less.
  const auto am = down<std::int32_t>(argmax);
  std::vector<int> picks(pool_in(s), 0);
  for (std::size_t o = 0; o < am.size(); ++o) ++picks[o / (s.h_out() * s.w_out()) * s.h * s.w + am[o]];
  EXPECT_GT(*std::max_element(picks.begin(), picks.end()), 1);
}

TEST_P(MaxPoolTest, RejectsBadShapesAndForeignOperands) {
  DeviceBuffer x = up(std::vector<float>(16, 1.0f)), y = device_->allocate(16 * sizeof(float)),
               argmax = device_->allocate(16 * sizeof(std::int32_t));
  for (const MaxPoolShape& bad : {MaxPoolShape{1, 1, 4, 4, 3, 1, 2},   // pad > kernel/2
                                  MaxPoolShape{1, 1, 4, 4, 0, 1, 0},   // empty kernel
                                  MaxPoolShape{1, 1, 4, 4, 2, 0, 0},   // zero stride
                                  MaxPoolShape{1, 1, 2, 4, 5, 1, 1}})  // window larger than padded input
    EXPECT_THROW(kernels::maxpool_forward(stream_, bad, x.as<float>(), y.as<float>(), argmax.as<std::int32_t>()),
                 InvalidArgument);
  if (GetParam() != "sim") return;
  const MaxPoolShape s{1, 1, 4, 4, 2, 2, 0};
  DeviceBuffer other = runtime_->device(0).allocate(16 * sizeof(float));
  EXPECT_THROW(kernels::maxpool_forward(stream_, s, other.as<float>(), y.as<float>(), argmax.as<std::int32_t>()),
               DeviceMismatch);
  EXPECT_THROW(kernels::maxpool_backward(stream_, s, argmax.as<std::int32_t>(), y.as<float>(), other.as<float>()),
               DeviceMismatch);
}

}  // namespace
}  // namespace dp
