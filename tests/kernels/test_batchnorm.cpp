// test_batchnorm.cpp — BatchNorm2d against plain host loops (in double) and finite differences, on
// every backend; expected edge-case values were taken from torch 1.13 (CPU).
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

class BatchNormTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, BatchNormTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// ------------------------------------------------------------------------------------------------
// BatchNorm2d host reference, in double

std::size_t bn_size(const BatchNormShape& s) { return static_cast<std::size_t>(s.n) * s.c * s.h * s.w; }
std::size_t bn_count(const BatchNormShape& s) { return static_cast<std::size_t>(s.n) * s.h * s.w; }

// Flat NCHW indices of channel c's values.
std::vector<std::size_t> channel_indices(const BatchNormShape& s, int c) {
  std::vector<std::size_t> out;
  const std::size_t plane = static_cast<std::size_t>(s.h) * s.w;
  for (int n = 0; n < s.n; ++n)
    for (std::size_t k = 0; k < plane; ++k) out.push_back((static_cast<std::size_t>(n) * s.c + c) * plane + k);
  return out;
}

struct BnReference {
  std::vector<double> mean, var;  // batch mean and biased variance per channel
  std::vector<double> y;
};

BnReference bn_reference(const BatchNormShape& s, const std::vector<float>& x, const std::vector<float>& gamma,
                         const std::vector<float>& beta) {
  BnReference r{std::vector<double>(s.c), std::vector<double>(s.c), std::vector<double>(x.size())};
  const double m = static_cast<double>(bn_count(s));
  for (int c = 0; c < s.c; ++c) {
    const auto idx = channel_indices(s, c);
    for (auto i : idx) r.mean[c] += x[i];
    r.mean[c] /= m;
    for (auto i : idx) r.var[c] += (x[i] - r.mean[c]) * (x[i] - r.mean[c]);
    r.var[c] /= m;
    for (auto i : idx) r.y[i] = (x[i] - r.mean[c]) / std::sqrt(r.var[c] + s.eps) * gamma[c] + beta[c];
  }
  return r;
}

struct BnGradReference {
  std::vector<double> dx, dgamma, dbeta;
};

BnGradReference bn_grad_reference(const BatchNormShape& s, const std::vector<float>& x, const std::vector<float>& gamma,
                                  const std::vector<float>& dy) {
  const BnReference f = bn_reference(s, x, gamma, std::vector<float>(s.c, 0.0f));
  BnGradReference g{std::vector<double>(x.size()), std::vector<double>(s.c), std::vector<double>(s.c)};
  const double m = static_cast<double>(bn_count(s));
  for (int c = 0; c < s.c; ++c) {
    const auto idx = channel_indices(s, c);
    const double invstd = 1.0 / std::sqrt(f.var[c] + s.eps);
    for (auto i : idx) {
      g.dbeta[c] += dy[i];
      g.dgamma[c] += dy[i] * (x[i] - f.mean[c]) * invstd;
    }
    for (auto i : idx) {
      const double xhat = (x[i] - f.mean[c]) * invstd;
      g.dx[i] = gamma[c] * invstd / m * (m * dy[i] - g.dbeta[c] - xhat * g.dgamma[c]);
    }
  }
  return g;
}

// Every buffer one BatchNorm2d layer needs on the device, in PyTorch's initial state.
struct BnBuffers {
  BnBuffers(Device& device, const Stream& stream, const BatchNormShape& s, const std::vector<float>& gamma_h,
            const std::vector<float>& beta_h)
      : gamma(upload(device, stream, gamma_h)),
        beta(upload(device, stream, beta_h)),
        y(device.allocate(bn_size(s) * sizeof(float))),
        save_mean(device.allocate(s.c * sizeof(float))),
        save_invstd(device.allocate(s.c * sizeof(float))),
        running_mean(upload(device, stream, std::vector<float>(s.c, 0.0f))),
        running_var(upload(device, stream, std::vector<float>(s.c, 1.0f))),
        tracked(upload(device, stream, std::vector<std::int64_t>{0})),
        grad_sums(device.allocate(2 * s.c * sizeof(float))) {}
  void train(const Stream& stream, const BatchNormShape& s, const DeviceBuffer& x) {
    kernels::batchnorm_forward_train(stream, s, x.as<float>(), gamma.as<float>(), beta.as<float>(), y.as<float>(),
                                     save_mean.as<float>(), save_invstd.as<float>(), running_mean.as<float>(),
                                     running_var.as<float>(), tracked.as<std::int64_t>());
  }
  DeviceBuffer gamma, beta, y, save_mean, save_invstd, running_mean, running_var, tracked;
  DeviceBuffer grad_sums;  // backward scratch, 2*C
};

// Inputs with a per-channel offset and scale, so that the statistics are not those of a standard
// normal and the variance has a mean to cancel (offset 3 against spread ~1).
std::vector<float> bn_input(const BatchNormShape& s, unsigned seed) {
  std::vector<float> x = random_vector(bn_size(s), seed);
  for (int c = 0; c < s.c; ++c)
    for (auto i : channel_indices(s, c)) x[i] = 3.0f + 0.5f * static_cast<float>(c) + (1.0f + 0.25f * c) * x[i];
  return x;
}

// Shapes: a single sample, a 3-channel 5x5, a one-pixel plane (each channel's first two
// values lie in different samples), an odd one, and a large MNIST-like one (6272 values a channel).
const BatchNormShape kBnShapes[] = {{1, 3, 5, 5}, {4, 3, 1, 1}, {3, 5, 3, 7}, {8, 2, 28, 28}};

TEST_P(BatchNormTest, TrainingForwardBackwardRunningStatsAndEval) {
  unsigned seed = 100;
  for (const BatchNormShape& s : kBnShapes) {
    SCOPED_TRACE(::testing::Message() << "shape " << s.n << "x" << s.c << "x" << s.h << "x" << s.w);
    const auto gamma = random_vector(s.c, ++seed, 0.5f, 1.5f), beta = random_vector(s.c, ++seed);
    BnBuffers bn(*device_, stream_, s, gamma, beta);
    const auto x1 = bn_input(s, ++seed), x2 = bn_input(s, ++seed);
    DeviceBuffer x1_dev = up(x1), x2_dev = up(x2);
    bn.train(stream_, s, x1_dev);
    bn.train(stream_, s, x2_dev);

    // y and the saved statistics of the second call. fp32 sums of M <= 6272 values |x| <= 5,
    // split over 256 lanes, lose ~1e-6 relative; y = xhat*gamma + beta is O(1): 1e-5 + 1e-4 rel.
    const BnReference r1 = bn_reference(s, x1, gamma, beta), r2 = bn_reference(s, x2, gamma, beta);
    EXPECT_TRUE(all_close(down<float>(bn.y), to_float(r2.y), 1e-4, 1e-5));
    EXPECT_TRUE(all_close(down<float>(bn.save_mean), to_float(r2.mean), 1e-5, 1e-6));
    std::vector<double> invstd(s.c);
    for (int c = 0; c < s.c; ++c) invstd[c] = 1.0 / std::sqrt(r2.var[c] + s.eps);
    EXPECT_TRUE(all_close(down<float>(bn.save_invstd), to_float(invstd), 1e-4, 0.0));

    // Running statistics after two momentum steps from (0, 1); running_var takes the unbiased variance.
    const double m = static_cast<double>(bn_count(s)), mo = s.momentum;
    std::vector<double> rm(s.c), rv(s.c);
    for (int c = 0; c < s.c; ++c) {
      rm[c] = (1 - mo) * ((1 - mo) * 0.0 + mo * r1.mean[c]) + mo * r2.mean[c];
      rv[c] = (1 - mo) * ((1 - mo) * 1.0 + mo * r1.var[c] * m / (m - 1)) + mo * r2.var[c] * m / (m - 1);
    }
    EXPECT_TRUE(all_close(down<float>(bn.running_mean), to_float(rm), 1e-5, 1e-6));
    EXPECT_TRUE(all_close(down<float>(bn.running_var), to_float(rv), 1e-4, 1e-6));
    EXPECT_EQ(down<std::int64_t>(bn.tracked), std::vector<std::int64_t>{2});

    // Backward of the second call, accumulating into nonzero grads. dgamma/dbeta are sums of M
    // terms |dy*xhat| <~ 2: fp32 error ~ sqrt(M)*eps*2 per lane tree, far under 1e-4 + 1e-4 rel.
    const auto dy = random_vector(bn_size(s), ++seed);
    const std::vector<float> g0(s.c, 0.25f), b0(s.c, -0.5f);
    DeviceBuffer ddy = up(dy), dgamma = up(g0), dbeta = up(b0), dx = device_->allocate(bn_size(s) * sizeof(float));
    kernels::batchnorm_backward(stream_, s, x2_dev.as<float>(), bn.gamma.as<float>(), bn.save_mean.as<float>(),
                                bn.save_invstd.as<float>(), ddy.as<float>(), dx.as<float>(), dgamma.as<float>(),
                                dbeta.as<float>(), bn.grad_sums.as<float>());
    BnGradReference g = bn_grad_reference(s, x2, gamma, dy);
    for (int c = 0; c < s.c; ++c) {
      g.dgamma[c] += g0[c];
      g.dbeta[c] += b0[c];
    }
    EXPECT_TRUE(all_close(down<float>(dx), to_float(g.dx), 1e-4, 1e-5));
    EXPECT_TRUE(all_close(down<float>(dgamma), to_float(g.dgamma), 1e-4, 1e-4));
    EXPECT_TRUE(all_close(down<float>(dbeta), to_float(g.dbeta), 1e-4, 1e-4));

    // Eval: the running statistics just checked, applied to a fresh input.
    const auto x3 = bn_input(s, ++seed);
    DeviceBuffer x3_dev = up(x3), y3 = device_->allocate(bn_size(s) * sizeof(float));
    kernels::batchnorm_forward_eval(stream_, s, x3_dev.as<float>(), bn.gamma.as<float>(), bn.beta.as<float>(),
                                    bn.running_mean.as<float>(), bn.running_var.as<float>(), y3.as<float>());
    const auto rm_dev = down<float>(bn.running_mean), rv_dev = down<float>(bn.running_var);
    std::vector<double> want(x3.size());
    for (int c = 0; c < s.c; ++c)
      for (auto i : channel_indices(s, c))
        want[i] = (x3[i] - rm_dev[c]) / std::sqrt(static_cast<double>(rv_dev[c]) + s.eps) * gamma[c] + beta[c];
    // Two momentum steps leave the running stats near (0.6, 0.9), far from the batch's: |y| ~ 3..6.
    EXPECT_TRUE(all_close(down<float>(y3), to_float(want), 1e-5, 1e-5));
  }
}

// Central differences of L = sum(y * r) against the backward with dy = r, through the kernels'
// own fp32 forward. Step 3e-3: y is rounded to ~1e-7 relative, so over 24 terms L carries ~1e-6
// of noise, /(2h) ~ 2e-4; the O(h^2) truncation with invstd ~ 1 and M = 12 is of the same order.
// Tolerance 2e-3 + 1e-2 relative leaves a margin of ~5 over both, yet misses any wrong term
// (each is O(0.1..1)). dbeta is linear in L: its differences are exact up to the rounding noise.
// A NaN input poisons its channel, as in torch (1.13: BatchNorm2d on a batch with one NaN gives NaN
// for that channel's outputs and running statistics), and leaves the other channels alone.
TEST_P(BatchNormTest, ANaNInputPoisonsItsChannelOnly) {
  const BatchNormShape s{2, 2, 3, 3};
  std::vector<float> x = bn_input(s, 5);
  x[channel_indices(s, 0)[4]] = std::nanf("");
  DeviceBuffer dx_in = upload(*device_, stream_, x);
  BnBuffers bn(*device_, stream_, s, {1.0f, 1.0f}, {0.0f, 0.0f});
  bn.train(stream_, s, dx_in);
  const auto y = download<float>(stream_, bn.y);
  for (auto i : channel_indices(s, 0)) EXPECT_TRUE(std::isnan(y[i])) << i;
  for (auto i : channel_indices(s, 1)) EXPECT_TRUE(std::isfinite(y[i])) << i;
  const auto mean = download<float>(stream_, bn.running_mean), var = download<float>(stream_, bn.running_var);
  EXPECT_TRUE(std::isnan(mean[0]) && std::isnan(var[0]));
  EXPECT_TRUE(std::isfinite(mean[1]) && std::isfinite(var[1]));
}

TEST_P(BatchNormTest, GradientsMatchFiniteDifferences) {
  const BatchNormShape s{2, 3, 2, 3};
  const auto x = bn_input(s, 7), gamma = random_vector(s.c, 8, 0.5f, 1.5f), beta = random_vector(s.c, 9);
  const auto r = random_vector(bn_size(s), 10);
  BnBuffers bn(*device_, stream_, s, gamma, beta);
  auto loss = [&](const std::vector<float>& xv, const std::vector<float>& gv, const std::vector<float>& bv) {
    DeviceBuffer xv_dev = up(xv), dg = up(gv), db = up(bv);
    kernels::batchnorm_forward_train(stream_, s, xv_dev.as<float>(), dg.as<float>(), db.as<float>(), bn.y.as<float>(),
                                     bn.save_mean.as<float>(), bn.save_invstd.as<float>(), bn.running_mean.as<float>(),
                                     bn.running_var.as<float>(), bn.tracked.as<std::int64_t>());
    const auto y = down<float>(bn.y);
    double l = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) l += static_cast<double>(y[i]) * r[i];
    return l;
  };
  // Central difference along one coordinate of v; the step is the float actually stored.
  const float h = 3e-3f;
  auto central = [&](std::vector<float> v, std::size_t i, auto&& eval) {
    const float base = v[i];
    v[i] = base + h;
    const double up_loss = eval(v), up_at = v[i];
    v[i] = base - h;
    const double down_loss = eval(v), down_at = v[i];
    return (up_loss - down_loss) / (up_at - down_at);
  };

  // Analytic gradients: forward once more at x (sets the saved statistics), backward with dy = r.
  loss(x, gamma, beta);
  DeviceBuffer x_dev = up(x), dr = up(r), dgamma = up(std::vector<float>(s.c, 0.0f)),
               dbeta = up(std::vector<float>(s.c, 0.0f)), dx = device_->allocate(bn_size(s) * sizeof(float));
  kernels::batchnorm_backward(stream_, s, x_dev.as<float>(), bn.gamma.as<float>(), bn.save_mean.as<float>(),
                              bn.save_invstd.as<float>(), dr.as<float>(), dx.as<float>(), dgamma.as<float>(),
                              dbeta.as<float>(), bn.grad_sums.as<float>());
  const auto gx = down<float>(dx), gg = down<float>(dgamma), gb = down<float>(dbeta);

  std::vector<double> fx(x.size()), fg(s.c), fb(s.c);
  for (std::size_t i = 0; i < x.size(); ++i)
    fx[i] = central(x, i, [&](const std::vector<float>& v) { return loss(v, gamma, beta); });
  for (int c = 0; c < s.c; ++c) {
    fg[c] = central(gamma, c, [&](const std::vector<float>& v) { return loss(x, v, beta); });
    fb[c] = central(beta, c, [&](const std::vector<float>& v) { return loss(x, gamma, v); });
  }
  EXPECT_TRUE(all_close(gx, to_float(fx), 1e-2, 2e-3));
  EXPECT_TRUE(all_close(gg, to_float(fg), 1e-2, 2e-3));
  EXPECT_TRUE(all_close(gb, to_float(fb), 1e-2, 2e-3));
}

// PyTorch accumulates .grad: a second backward adds the same sums again (exactly: 0 + s + s = 2s),
// while dx is overwritten with the same values. Without dx, only the parameter grads move.
TEST_P(BatchNormTest, BackwardAccumulatesParameterGradients) {
  const BatchNormShape s{4, 3, 6, 5};
  const auto x = bn_input(s, 20), gamma = random_vector(s.c, 21, 0.5f, 1.5f), dy = random_vector(bn_size(s), 22);
  BnBuffers bn(*device_, stream_, s, gamma, std::vector<float>(s.c, 0.0f));
  DeviceBuffer x_dev = up(x), ddy = up(dy), dgamma = up(std::vector<float>(s.c, 0.0f)),
               dbeta = up(std::vector<float>(s.c, 0.0f)), dx = device_->allocate(bn_size(s) * sizeof(float));
  bn.train(stream_, s, x_dev);
  auto backward = [&](float* dx_or_null) {
    kernels::batchnorm_backward(stream_, s, x_dev.as<float>(), bn.gamma.as<float>(), bn.save_mean.as<float>(),
                                bn.save_invstd.as<float>(), ddy.as<float>(), dx_or_null, dgamma.as<float>(),
                                dbeta.as<float>(), bn.grad_sums.as<float>());
  };
  backward(dx.as<float>());
  const auto g1 = down<float>(dgamma), b1 = down<float>(dbeta), dx_first = down<float>(dx);
  backward(dx.as<float>());
  std::vector<float> g2 = g1, b2 = b1;
  for (auto& v : g2) v *= 2.0f;
  for (auto& v : b2) v *= 2.0f;
  EXPECT_EQ(down<float>(dgamma), g2);
  EXPECT_EQ(down<float>(dbeta), b2);
  EXPECT_EQ(down<float>(dx), dx_first);
  backward(nullptr);
  for (int c = 0; c < s.c; ++c) {
    g2[c] += g1[c];
    b2[c] += b1[c];
  }
  EXPECT_EQ(down<float>(dgamma), g2);
  EXPECT_EQ(down<float>(dbeta), b2);
}

// One value per channel cannot be trained on (torch.nn.BatchNorm2d raises the same); operands
// of another device are refused before anything runs.
// SyncBatchNorm's count over all replicas must hold this replica's values, at least two, and stay
// exact as a float; a replica alone may hold one value per channel.
TEST_P(BatchNormTest, SyncRejectsImpossibleGlobalCounts) {
  const BatchNormShape s{2, 1, 2, 2};  // 8 values per channel here
  BnBuffers bn(*device_, stream_, s, {1.0f}, {0.0f});
  DeviceBuffer x = up(bn_input(s, 3)), scratch = floats(2);
  // The phases as nn's BatchNorm2d runs them, the all-reduce between them only counted here.
  int calls = 0;
  auto forward = [&](kernels::index_t global) {
    float* mean = bn.save_mean.as<float>();
    kernels::sync_batchnorm_sums(stream_, s, x.as<float>(), mean, global);
    ++calls;
    kernels::sync_batchnorm_moments(stream_, s, x.as<float>(), mean, scratch.as<float>(), global);
    ++calls;
    kernels::sync_batchnorm_normalize(stream_, s, x.as<float>(), bn.gamma.as<float>(), bn.beta.as<float>(),
                                      bn.y.as<float>(), mean, bn.save_invstd.as<float>(), bn.running_mean.as<float>(),
                                      bn.running_var.as<float>(), bn.tracked.as<std::int64_t>(), scratch.as<float>(),
                                      global);
  };
  for (kernels::index_t bad : {kernels::index_t{7}, kernels::index_t{1}, (kernels::index_t{1} << 24) + 1})
    EXPECT_THROW(forward(bad), InvalidArgument) << bad;
  EXPECT_EQ(calls, 0) << "refused before any collective";
  EXPECT_THROW(
      kernels::sync_batchnorm_backward_sums(stream_, s, x.as<float>(), bn.gamma.as<float>(), bn.save_mean.as<float>(),
                                            bn.save_invstd.as<float>(), x.as<float>(), bn.y.as<float>(),
                                            bn.y.as<float>(), bn.grad_sums.as<float>(), 4),
      InvalidArgument);
  EXPECT_THROW(kernels::sync_batchnorm_backward_dx(stream_, s, x.as<float>(), bn.gamma.as<float>(),
                                                   bn.save_mean.as<float>(), bn.save_invstd.as<float>(), x.as<float>(),
                                                   bn.y.as<float>(), bn.grad_sums.as<float>(), 4),
               InvalidArgument);
  forward(16);  // one replica of two: the sums go to the (here: counting) all-reduce twice
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(down<std::int64_t>(bn.tracked), std::vector<std::int64_t>{1});
}

TEST_P(BatchNormTest, RejectsSingleValueChannelsAndForeignOperands) {
  const BatchNormShape one{1, 2, 1, 1};
  BnBuffers bn(*device_, stream_, one, {1.0f, 1.0f}, {0.0f, 0.0f});
  DeviceBuffer x = up(std::vector<float>{1.0f, 2.0f});
  EXPECT_THROW(bn.train(stream_, one, x), InvalidArgument);
  EXPECT_EQ(down<std::int64_t>(bn.tracked), std::vector<std::int64_t>{0});

  if (GetParam() != "sim") return;
  const BatchNormShape s{2, 2, 2, 2};
  BnBuffers local(*device_, stream_, s, {1.0f, 1.0f}, {0.0f, 0.0f});
  DeviceBuffer other = runtime_->device(0).allocate(bn_size(s) * sizeof(float));
  EXPECT_THROW(local.train(stream_, s, other), DeviceMismatch);
  DeviceBuffer mine = up(std::vector<float>(bn_size(s), 1.0f)), dx = device_->allocate(bn_size(s) * sizeof(float)),
               dgamma = up(std::vector<float>(s.c, 0.0f)), dbeta = up(std::vector<float>(s.c, 0.0f));
  EXPECT_THROW(
      kernels::batchnorm_backward(stream_, s, mine.as<float>(), local.gamma.as<float>(), local.save_mean.as<float>(),
                                  local.save_invstd.as<float>(), other.as<float>(), dx.as<float>(), dgamma.as<float>(),
                                  dbeta.as<float>(), local.grad_sums.as<float>()),
      DeviceMismatch);
  EXPECT_EQ(down<float>(dgamma), std::vector<float>(s.c, 0.0f));  // refused before it ran
  EXPECT_THROW(
      kernels::batchnorm_forward_eval(stream_, s, mine.as<float>(), local.gamma.as<float>(), local.beta.as<float>(),
                                      local.running_mean.as<float>(), local.running_var.as<float>(), other.as<float>()),
      DeviceMismatch);
}

// ------------------------------------------------------------------------------------------------
// MaxPool2d host reference: every window position, padding as -inf, PyTorch's `v > max || isnan(v)`.

}  // namespace
}  // namespace dp
