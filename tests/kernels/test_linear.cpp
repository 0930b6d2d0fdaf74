// test_linear.cpp — nn.Linear forward and backward against double host loops and finite
// differences, on every backend: gradient accumulation (+=), optional dx and bias.
#include <cmath>
#include <gtest/gtest.h>
#include <limits>
#include <tuple>

#include "dp/kernels/linear.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using test::all_close;
using test::download;
using test::random_vector;
using test::upload;

class LinearTest : public test::BackendTest {
 protected:
  DeviceBuffer filled(std::size_t n, float value) { return upload(*device_, stream_, std::vector<float>(n, value)); }
};

INSTANTIATE_TEST_SUITE_P(Backends, LinearTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// The definitions in double: y = x W^T + b, dx = dy W, dW = dW0 + dy^T x, db = db0 + sum_rows dy.
struct LinearReference {
  std::vector<float> y, dx, dweight, dbias;
};
LinearReference linear_reference(int n, int in, int out, const std::vector<float>& x, const std::vector<float>& w,
                                 const std::vector<float>* b, const std::vector<float>& dy,
                                 const std::vector<float>& dweight0, const std::vector<float>& dbias0) {
  LinearReference r;
  r.y.resize(static_cast<std::size_t>(n) * out);
  r.dx.resize(static_cast<std::size_t>(n) * in);
  r.dweight.resize(dweight0.size());
  r.dbias.resize(dbias0.size());
  const auto at = [](int row, int cols, int col) { return static_cast<std::size_t>(row) * cols + col; };
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) {
      double acc = b ? (*b)[o] : 0.0;
      for (int k = 0; k < in; ++k) acc += static_cast<double>(x[at(i, in, k)]) * w[at(o, in, k)];
      r.y[at(i, out, o)] = static_cast<float>(acc);
    }
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < in; ++k) {
      double acc = 0.0;
      for (int o = 0; o < out; ++o) acc += static_cast<double>(dy[at(i, out, o)]) * w[at(o, in, k)];
      r.dx[at(i, in, k)] = static_cast<float>(acc);
    }
  for (int o = 0; o < out; ++o) {
    for (int k = 0; k < in; ++k) {
      double acc = dweight0[at(o, in, k)];
      for (int i = 0; i < n; ++i) acc += static_cast<double>(dy[at(i, out, o)]) * x[at(i, in, k)];
      r.dweight[at(o, in, k)] = static_cast<float>(acc);
    }
    if (!dbias0.empty()) {
      double acc = dbias0[o];
      for (int i = 0; i < n; ++i) acc += dy[at(i, out, o)];
      r.dbias[o] = static_cast<float>(acc);
    }
  }
  return r;
}

TEST_P(LinearTest, ForwardBackwardMatchDoubleReference) {
  unsigned seed = 300;
  for (auto [n, in, out] : {std::tuple{1, 13, 5}, std::tuple{7, 13, 5}, std::tuple{64, 784, 256}}) {
    const std::size_t xs = static_cast<std::size_t>(n) * in, ws = static_cast<std::size_t>(out) * in,
                      ys = static_cast<std::size_t>(n) * out;
    const auto x = random_vector(xs, ++seed), w = random_vector(ws, ++seed), b = random_vector(out, ++seed);
    const auto dy = random_vector(ys, ++seed);
    // dW and db start non-zero: the backward accumulates onto them.
    const auto dweight0 = random_vector(ws, ++seed), dbias0 = random_vector(out, ++seed);
    DeviceBuffer dx_in = upload(*device_, stream_, x), dw = upload(*device_, stream_, w),
                 db = upload(*device_, stream_, b), ddy = upload(*device_, stream_, dy);
    DeviceBuffer dweight = upload(*device_, stream_, dweight0), dbias = upload(*device_, stream_, dbias0);
    // Outputs start as NaN: they must be overwritten, never read (gemm beta = 0 does not read C).
    const float nan = std::numeric_limits<float>::quiet_NaN();
    DeviceBuffer y = filled(ys, nan), dx = filled(xs, nan);

    kernels::linear_forward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), db.as<float>(), y.as<float>());
    kernels::linear_backward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), ddy.as<float>(), dx.as<float>(),
                             dweight.as<float>(), dbias.as<float>());
    const auto ref = linear_reference(n, in, out, x, w, &b, dy, dweight0, dbias0);
    // Dot products of up to 784 terms in [-1, 1] accumulated in fp32 (blocked by BLAS): |y| reaches
    // ~30 (std sqrt(784/9) ~ 9) and its rounding error ~1e-5 (6e-6 observed with OpenBLAS), which
    // 1e-4 + 1e-5*|want| covers 10x over; a wrong index or transpose errs by O(1).
    const std::string where = "n=" + std::to_string(n) + " in=" + std::to_string(in) + " out=" + std::to_string(out);
    EXPECT_TRUE(all_close(download<float>(stream_, y), ref.y, 1e-5, 1e-4)) << where;
    EXPECT_TRUE(all_close(download<float>(stream_, dx), ref.dx, 1e-5, 1e-4)) << where;
    EXPECT_TRUE(all_close(download<float>(stream_, dweight), ref.dweight, 1e-5, 1e-4)) << where;
    EXPECT_TRUE(all_close(download<float>(stream_, dbias), ref.dbias, 1e-5, 1e-5)) << where;
  }
}

// Gradients from zero, then a second backward on the same dy: dW and db double (autograd
// accumulates into .grad across backward calls), dx is overwritten with the same value.
TEST_P(LinearTest, BackwardAccumulatesWeightAndBiasGradients) {
  const int n = 7, in = 13, out = 5;
  const auto x = random_vector(n * in, 1), w = random_vector(out * in, 2), dy = random_vector(n * out, 3);
  DeviceBuffer dx_in = upload(*device_, stream_, x), dw = upload(*device_, stream_, w),
               ddy = upload(*device_, stream_, dy);
  DeviceBuffer dx = filled(n * in, 0.0f), dweight = filled(out * in, 0.0f), dbias = filled(out, 0.0f);
  const auto backward = [&] {
    kernels::linear_backward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), ddy.as<float>(), dx.as<float>(),
                             dweight.as<float>(), dbias.as<float>());
  };
  backward();
  const auto dx1 = download<float>(stream_, dx), dw1 = download<float>(stream_, dweight),
             db1 = download<float>(stream_, dbias);
  backward();
  std::vector<float> dw2(dw1), db2(db1);
  for (auto& v : dw2) v *= 2.0f;
  for (auto& v : db2) v *= 2.0f;
  // g + g = 2g exactly when the second sum adds onto the stored first one; allow one rounding
  // in case a cuBLAS kernel splits k and folds the old C into a partial sum instead.
  EXPECT_TRUE(all_close(download<float>(stream_, dweight), dw2, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(download<float>(stream_, dbias), db2, 1e-6, 1e-7));
  EXPECT_EQ(download<float>(stream_, dx), dx1);
  EXPECT_TRUE(all_close(
      db1,
      linear_reference(n, in, out, x, w, nullptr, dy, std::vector<float>(out * in, 0.0f), std::vector<float>(out, 0.0f))
          .dbias,
      1e-6, 1e-6));
}

// No bias (y = x W^T, db not touched) and no dx (the first layer): dW is still right, and dx's
// memory is left alone.
TEST_P(LinearTest, NullBiasAndNullDx) {
  const int n = 7, in = 13, out = 5;
  const auto x = random_vector(n * in, 4), w = random_vector(out * in, 5), dy = random_vector(n * out, 6);
  DeviceBuffer dx_in = upload(*device_, stream_, x), dw = upload(*device_, stream_, w),
               ddy = upload(*device_, stream_, dy);
  DeviceBuffer y = filled(n * out, std::numeric_limits<float>::quiet_NaN()), dweight = filled(out * in, 0.0f);
  kernels::linear_forward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), nullptr, y.as<float>());
  kernels::linear_backward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), ddy.as<float>(), nullptr,
                           dweight.as<float>(), nullptr);
  const auto ref = linear_reference(n, in, out, x, w, nullptr, dy, std::vector<float>(out * in, 0.0f), {});
  EXPECT_TRUE(all_close(download<float>(stream_, y), ref.y, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(download<float>(stream_, dweight), ref.dweight, 1e-5, 1e-5));
}

// The backward is the gradient of the forward as implemented: central differences of
// L = sum(y * r) on the device, whose gradient wrt y is r (so dy = r).
TEST_P(LinearTest, GradientsMatchFiniteDifferences) {
  const int n = 2, in = 13, out = 5;
  auto x = random_vector(n * in, 7), w = random_vector(out * in, 8), b = random_vector(out, 9);
  const auto r = random_vector(n * out, 10);
  DeviceBuffer dx_in = upload(*device_, stream_, x), dw = upload(*device_, stream_, w),
               db = upload(*device_, stream_, b), ddy = upload(*device_, stream_, r);
  DeviceBuffer y = device_->allocate(n * out * sizeof(float)), dx = device_->allocate(n * in * sizeof(float));
  DeviceBuffer dweight = filled(out * in, 0.0f), dbias = filled(out, 0.0f);
  kernels::linear_backward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), ddy.as<float>(), dx.as<float>(),
                           dweight.as<float>(), dbias.as<float>());

  const auto loss = [&] {
    stream_.copy(dx_in.data(), x.data(), x.size() * sizeof(float));
    stream_.copy(dw.data(), w.data(), w.size() * sizeof(float));
    stream_.copy(db.data(), b.data(), b.size() * sizeof(float));
    kernels::linear_forward(stream_, n, in, out, dx_in.as<float>(), dw.as<float>(), db.as<float>(), y.as<float>());
    const auto yv = download<float>(stream_, y);
    double sum = 0.0;
    for (std::size_t k = 0; k < yv.size(); ++k) sum += static_cast<double>(yv[k]) * r[k];
    return sum;
  };
  // L is linear in each of x, W and b, so central differences have no truncation error and a
  // large step costs nothing: eps = 0.25. What remains is fp32 rounding of the y elements the
  // step changes (<= 5 of them, each ~1e-7 off), divided by 2*eps: ~1e-6. Gradients are O(1).
  const float eps = 0.25f;
  const auto finite_differences = [&](std::vector<float>& v) {
    std::vector<float> fd(v.size());
    for (std::size_t k = 0; k < v.size(); ++k) {
      const float saved = v[k];
      v[k] = saved + eps;
      const double step_plus = static_cast<double>(v[k]), plus = loss();
      v[k] = saved - eps;
      const double step_minus = static_cast<double>(v[k]), minus = loss();
      v[k] = saved;
      fd[k] = static_cast<float>((plus - minus) / (step_plus - step_minus));  // the step as rounded to fp32
    }
    return fd;
  };
  EXPECT_TRUE(all_close(download<float>(stream_, dx), finite_differences(x), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(download<float>(stream_, dweight), finite_differences(w), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(download<float>(stream_, dbias), finite_differences(b), 1e-5, 1e-5));
}

TEST_P(LinearTest, RejectsBadArguments) {
  DeviceBuffer a = filled(16, 0.0f);
  float* p = a.as<float>();
  EXPECT_THROW(kernels::linear_forward(stream_, -1, 2, 2, p, p, p, p), InvalidArgument);
  EXPECT_THROW(kernels::linear_backward(stream_, 2, 2, 2, p, p, p, p, nullptr, p), InvalidArgument);
  if (GetParam() == "sim") {  // y of 8x4 floats runs past the 16-float allocation
    EXPECT_THROW(kernels::linear_forward(stream_, 8, 4, 4, p, p, p, p), DeviceMismatch);
  }
  stream_.synchronize();
}

}  // namespace
}  // namespace dp
