// test_elementwise.cpp — every Foundation kernel against a plain host loop, on every backend:
// the sim runs the same __host__ __device__ functors; the cuda instances compare the GPU with the
// host result and skip with a reason where there is no GPU.
#include <cmath>
#include <gtest/gtest.h>
#include <tuple>

#include "dp/kernels/ops.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using test::all_close;
using test::download;
using test::random_vector;
using test::upload;

class KernelTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, KernelTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(KernelTest, Fill) {
  DeviceBuffer x = device_->allocate(1001 * sizeof(float));
  kernels::fill(stream_, x.as<float>(), 1001, 2.5f);
  EXPECT_EQ(download<float>(stream_, x), std::vector<float>(1001, 2.5f));
}

TEST_P(KernelTest, AxpyScaleAdd) {
  const std::size_t n = 4099;  // not a multiple of any block size
  const auto x = random_vector(n, 1), y = random_vector(n, 2);
  DeviceBuffer dx = upload(*device_, stream_, x), dy = upload(*device_, stream_, y);
  DeviceBuffer out = device_->allocate(n * sizeof(float));
  kernels::axpy(stream_, n, 0.75f, dx.as<float>(), dy.as<float>());
  std::vector<float> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = 0.75f * x[i] + y[i];
  // Exact: one fused or unfused multiply-add per element, same on both sides up to fma contraction.
  EXPECT_TRUE(all_close(download<float>(stream_, dy), want, 1e-6, 1e-7));
  kernels::scale(stream_, n, -3.0f, dx.as<float>());
  for (std::size_t i = 0; i < n; ++i) want[i] = -3.0f * x[i];
  EXPECT_EQ(download<float>(stream_, dx), want);
  kernels::add(stream_, n, dx.as<float>(), dx.as<float>(), out.as<float>());
  for (std::size_t i = 0; i < n; ++i) want[i] = -3.0f * x[i] + -3.0f * x[i];
  EXPECT_EQ(download<float>(stream_, out), want);
}

TEST_P(KernelTest, ReluForwardBackward) {
  std::vector<float> x = random_vector(777, 3);
  x[0] = 0.0f;  // PyTorch: relu'(0) = 0
  const auto dy = random_vector(777, 4);
  DeviceBuffer dx_in = upload(*device_, stream_, x), ddy = upload(*device_, stream_, dy);
  DeviceBuffer y = device_->allocate(777 * sizeof(float)), dx = device_->allocate(777 * sizeof(float));
  kernels::relu_forward(stream_, 777, dx_in.as<float>(), y.as<float>());
  kernels::relu_backward(stream_, 777, y.as<float>(), ddy.as<float>(), dx.as<float>());
  std::vector<float> want_y(777), want_dx(777);
  for (int i = 0; i < 777; ++i) {
    want_y[i] = x[i] > 0 ? x[i] : 0.0f;
    want_dx[i] = x[i] > 0 ? dy[i] : 0.0f;
  }
  EXPECT_EQ(download<float>(stream_, y), want_y);
  EXPECT_EQ(download<float>(stream_, dx), want_dx);
}

// torch.relu keeps NaN (so divergence reaches the loss) and its backward passes the gradient at
// NaN: torch 1.13 gives relu([nan, -1, 0, 2]) = [nan, 0, 0, 2] and grad [1, 0, 0, 1]; -0 -> +0.
TEST_P(KernelTest, ReluPropagatesNaNAsPyTorch) {
  const std::vector<float> x = {std::nanf(""), -1.0f, 0.0f, 2.0f, -0.0f}, dy(5, 1.0f);
  DeviceBuffer dx_in = upload(*device_, stream_, x), ddy = upload(*device_, stream_, dy);
  DeviceBuffer y = device_->allocate(5 * sizeof(float)), dx = device_->allocate(5 * sizeof(float));
  kernels::relu_forward(stream_, 5, dx_in.as<float>(), y.as<float>());
  kernels::relu_backward(stream_, 5, y.as<float>(), ddy.as<float>(), dx.as<float>());
  const auto got_y = download<float>(stream_, y), got_dx = download<float>(stream_, dx);
  EXPECT_TRUE(std::isnan(got_y[0]));
  EXPECT_EQ(got_y[1], 0.0f);
  EXPECT_EQ(got_y[2], 0.0f);
  EXPECT_EQ(got_y[3], 2.0f);
  EXPECT_FALSE(std::signbit(got_y[4])) << "relu(-0) is +0";
  EXPECT_EQ(got_dx, (std::vector<float>{1.0f, 0.0f, 0.0f, 1.0f, 0.0f}));
}

// Rows long enough that one serial thread per output would be the slow path the split avoids.
TEST_P(KernelTest, RowAndColumnSums) {
  for (auto [rows, cols] : {std::pair{3, 70001}, std::pair{64, 10}, std::pair{1, 1}, std::pair{5, 0}}) {
    const auto x = random_vector(static_cast<std::size_t>(rows) * cols, 5);
    DeviceBuffer dx = upload(*device_, stream_, x);
    std::vector<float> row_init(rows, 1.5f), col_init(cols, -0.5f);
    DeviceBuffer rs = upload(*device_, stream_, row_init);
    DeviceBuffer cs = cols ? upload(*device_, stream_, col_init) : DeviceBuffer{};
    kernels::row_sum(stream_, rows, cols, dx.as<float>(), rs.as<float>(), 1.0f);  // accumulate
    if (cols) kernels::column_sum(stream_, rows, cols, dx.as<float>(), cs.as<float>());
    std::vector<double> want_rows(rows, 1.5), want_cols(cols, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        want_rows[r] += x[static_cast<std::size_t>(r) * cols + c];
        want_cols[c] += x[static_cast<std::size_t>(r) * cols + c];
      }
    // fp32 sums of n terms in |x| <= 1 differ from the double sum by <= ~ n*eps*mean|x| in
    // the worst case; split accumulation keeps it near sqrt(n)*eps. 1e-4 absolute covers n=7e4.
    EXPECT_TRUE(
        all_close(download<float>(stream_, rs), std::vector<float>(want_rows.begin(), want_rows.end()), 1e-5, 1e-4))
        << rows << "x" << cols;
    if (cols) {
      EXPECT_TRUE(
          all_close(download<float>(stream_, cs), std::vector<float>(want_cols.begin(), want_cols.end()), 1e-5, 1e-5))
          << rows << "x" << cols;
    }
  }
}

// Row-major reference: C = alpha*op(A)*op(B) + beta*C, accumulated in double.
std::vector<float> naive_gemm(bool ta, bool tb, int m, int n, int k, float alpha, const std::vector<float>& a, int lda,
                              const std::vector<float>& b, int ldb, float beta, std::vector<float> c, int ldc) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int p = 0; p < k; ++p) {
        const float av = ta ? a[static_cast<std::size_t>(p) * lda + i] : a[static_cast<std::size_t>(i) * lda + p];
        const float bv = tb ? b[static_cast<std::size_t>(j) * ldb + p] : b[static_cast<std::size_t>(p) * ldb + j];
        acc += static_cast<double>(av) * bv;
      }
      float& cv = c[static_cast<std::size_t>(i) * ldc + j];
      cv = static_cast<float>(alpha * acc + beta * static_cast<double>(cv));
    }
  return c;
}

TEST_P(KernelTest, GemmAllTransposesOddSizesAndStrides) {
  unsigned seed = 10;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [m, n, k] : {std::tuple{1, 1, 1}, std::tuple{7, 13, 5}, std::tuple{33, 17, 65}, std::tuple{64, 10, 784},
                             std::tuple{3, 5, 0}})
        for (int pad : {0, 3}) {
          const int a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
          const int lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
          const auto a = random_vector(static_cast<std::size_t>(std::max(a_rows, 1)) * std::max(lda, 1), ++seed);
          const auto b = random_vector(static_cast<std::size_t>(std::max(b_rows, 1)) * std::max(ldb, 1), ++seed);
          const auto c = random_vector(static_cast<std::size_t>(m) * ldc, ++seed);
          const float alpha = 1.25f, beta = pad ? 0.5f : 0.0f;
          DeviceBuffer da = upload(*device_, stream_, a), db = upload(*device_, stream_, b),
                       dc = upload(*device_, stream_, c);
          kernels::gemm(stream_, ta, tb, m, n, k, alpha, da.as<float>(), std::max(lda, 1), db.as<float>(),
                        std::max(ldb, 1), beta, dc.as<float>(), ldc);
          const auto want = naive_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
          // fp32 dot products of k terms in [-1,1]: error <= k*eps*|alpha| ~ 784*6e-8*1.25 < 1e-4.
          EXPECT_TRUE(all_close(download<float>(stream_, dc), want, 1e-5, 1e-4))
              << "ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n << " k=" << k << " pad=" << pad;
        }
}

TEST_P(KernelTest, GemmRejectsBadLeadingDimensionsAndForeignOperands) {
  DeviceBuffer a = device_->allocate(16 * sizeof(float));
  EXPECT_THROW(
      kernels::gemm(stream_, false, false, 4, 4, 4, 1.0f, a.as<float>(), 3, a.as<float>(), 4, 0.0f, a.as<float>(), 4),
      InvalidArgument);
  if (GetParam() == "sim") {
    DeviceBuffer other = runtime_->device(0).allocate(16 * sizeof(float));
    EXPECT_THROW(kernels::gemm(stream_, false, false, 4, 4, 4, 1.0f, a.as<float>(), 4, other.as<float>(), 4, 0.0f,
                               a.as<float>(), 4),
                 DeviceMismatch);
  }
}

}  // namespace
}  // namespace dp
