// test_cross_entropy.cpp — CrossEntropyLoss against its definition in double, finite differences,
// bad targets, empty batches and NaN logits as torch 1.13 (CPU) answers them, on every backend.
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

class CrossEntropyTest : public test::BackendTest {
 protected:
};

INSTANTIATE_TEST_SUITE_P(Backends, CrossEntropyTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// ------------------------------------------------------------------------------------------------
// CrossEntropyLoss

constexpr int kClasses = 10;

std::vector<std::int64_t> random_targets(int n, unsigned seed) { return test::random_targets(n, kClasses, seed); }

// The definition, in double: term_i = log(sum_c exp(x_ic)) - x_it (max-shifted so 1e4 logits fit
// in double too), dlogits = (softmax - onehot) * scale.
struct CrossEntropyReference {
  std::vector<double> terms;
  double loss = 0.0;
  std::vector<double> softmax;
};
CrossEntropyReference cross_entropy_reference(const std::vector<float>& logits, const std::vector<std::int64_t>& t) {
  const int n = static_cast<int>(t.size());
  CrossEntropyReference ref;
  ref.terms.resize(n);
  ref.softmax.resize(logits.size());
  for (int i = 0; i < n; ++i) {
    const float* x = &logits[static_cast<std::size_t>(i) * kClasses];
    double m = x[0], s = 0.0;
    for (int c = 0; c < kClasses; ++c) m = std::max<double>(m, x[c]);
    for (int c = 0; c < kClasses; ++c) s += std::exp(x[c] - m);
    ref.terms[i] = std::log(s) + m - x[t[i]];
    for (int c = 0; c < kClasses; ++c) ref.softmax[static_cast<std::size_t>(i) * kClasses + c] = std::exp(x[c] - m) / s;
    ref.loss += ref.terms[i] / n;
  }
  return ref;
}

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

TEST_P(CrossEntropyTest, CrossEntropyMatchesDoubleReference) {
  unsigned seed = 100;
  for (int n : {1, 7, 64})
    for (float magnitude : {3.0f, 1e4f}) {
      const auto logits = random_vector(static_cast<std::size_t>(n) * kClasses, ++seed, -magnitude, magnitude);
      const auto targets = random_targets(n, ++seed);
      DeviceBuffer dlogits_in = upload(*device_, stream_, logits), dtargets = upload(*device_, stream_, targets);
      DeviceBuffer per_sample = device_->allocate(n * sizeof(float)), loss = device_->allocate(sizeof(float));
      DeviceBuffer dlogits = device_->allocate(static_cast<std::size_t>(n) * kClasses * sizeof(float));
      kernels::cross_entropy_forward(stream_, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(),
                                     per_sample.as<float>(), loss.as<float>());
      const auto ref = cross_entropy_reference(logits, targets);
      const auto got_terms = download<float>(stream_, per_sample);
      const float got_loss = download<float>(stream_, loss)[0];
      // fp32 per-sample terms: expf/logf are within ~2 ulp, the sum of 10 exps in [1, 10] adds
      // ~10 ulp relative, and x_t - max rounds once relative to itself: ~1e-6 absolute for
      // O(1) terms; for 1e4 logits the term is ~(max - x_t) and 2e-6 relative covers its one rounding.
      EXPECT_TRUE(all_close(got_terms, to_float(ref.terms), 2e-6, 2e-6)) << "n=" << n << " magnitude=" << magnitude;
      // The mean: <= 64 terms, each in its own reduction lane, combined by an 8-level tree.
      EXPECT_NEAR(got_loss, ref.loss, 2e-6 * (1.0 + std::fabs(ref.loss))) << "n=" << n << " magnitude=" << magnitude;
      EXPECT_TRUE(std::isfinite(got_loss));
      for (float t : got_terms) EXPECT_TRUE(std::isfinite(t) && t >= 0.0f) << t;

      // dloss / mean_over: the plain mean (1, n) and an outer scale with a larger mean (0.5, 4n),
      // as when a data-parallel rank's gradient is averaged over the global batch.
      for (auto [dloss, mean_over] : {std::pair{1.0f, n}, std::pair{0.5f, 4 * n}}) {
        kernels::cross_entropy_backward(stream_, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(),
                                        dloss, mean_over, dlogits.as<float>());
        std::vector<float> want(ref.softmax.size());
        for (int i = 0; i < n; ++i)
          for (int c = 0; c < kClasses; ++c) {
            const std::size_t k = static_cast<std::size_t>(i) * kClasses + c;
            want[k] = static_cast<float>((ref.softmax[k] - (c == targets[i] ? 1.0 : 0.0)) * dloss / mean_over);
          }
        // softmax entries in [0, 1] with ~10 ulp relative error (exp / sum), scaled by <= 1.
        EXPECT_TRUE(all_close(download<float>(stream_, dlogits), want, 1e-5, 1e-6))
            << "n=" << n << " magnitude=" << magnitude << " dloss=" << dloss << " mean_over=" << mean_over;
      }
    }
}

// The backward is the gradient of the forward as implemented (fp32, on the backend), by central
// differences of the device loss.
TEST_P(CrossEntropyTest, CrossEntropyGradientMatchesFiniteDifferences) {
  const int n = 3;
  const auto logits = random_vector(n * kClasses, 7, -2.0f, 2.0f);
  const auto targets = random_targets(n, 8);
  DeviceBuffer dtargets = upload(*device_, stream_, targets), dlogits_in = upload(*device_, stream_, logits);
  DeviceBuffer per_sample = device_->allocate(n * sizeof(float)), loss = device_->allocate(sizeof(float));
  DeviceBuffer dlogits = device_->allocate(n * kClasses * sizeof(float));
  kernels::cross_entropy_backward(stream_, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(), 1.0f, n,
                                  dlogits.as<float>());
  const auto grad = download<float>(stream_, dlogits);

  const auto device_loss = [&](const std::vector<float>& x) {
    stream_.copy(dlogits_in.data(), x.data(), x.size() * sizeof(float));
    kernels::cross_entropy_forward(stream_, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(),
                                   per_sample.as<float>(), loss.as<float>());
    return static_cast<double>(download<float>(stream_, loss)[0]);
  };
  // eps = 1e-2: the truncation error eps^2/6 * |L'''| is < 1e-5 (|L'''| <= ~0.4/n for softmax
  // cross-entropy), while the fp32 loss (~2.3) carries ~1e-6 absolute rounding that the
  // difference quotient divides by 2*eps: <= ~1e-4. Gradients are O(1/n) = 0.3 here, so a
  // wrong scale, sign or class index would miss by far more than the 3e-4 allowed (< 3e-5 observed).
  const float eps = 1e-2f;
  std::vector<float> fd(logits.size());
  for (std::size_t k = 0; k < logits.size(); ++k) {
    auto plus = logits, minus = logits;
    plus[k] += eps;
    minus[k] -= eps;
    // The step actually taken after rounding logits +- eps to fp32.
    const double step = static_cast<double>(plus[k]) - minus[k];
    fd[k] = static_cast<float>((device_loss(plus) - device_loss(minus)) / step);
  }
  EXPECT_TRUE(all_close(grad, fd, 0.0, 3e-4));
}

// A bad target cannot make a kernel index out of bounds: the sample's outputs are NaN on every
// backend, and the simulated stream also fails with an error naming the target and the sample.
TEST_P(CrossEntropyTest, CrossEntropyInvalidTarget) {
  const int n = 3;
  const auto logits = random_vector(n * kClasses, 9);
  for (std::int64_t bad : {std::int64_t{kClasses}, std::int64_t{-1}}) {
    const std::vector<std::int64_t> targets{2, bad, 0};
    Stream stream = device_->create_stream();  // a failed sim stream stays failed
    DeviceBuffer dlogits_in = upload(*device_, stream, logits), dtargets = upload(*device_, stream, targets);
    DeviceBuffer per_sample = device_->allocate(n * sizeof(float)), loss = device_->allocate(sizeof(float));
    DeviceBuffer dlogits = device_->allocate(n * kClasses * sizeof(float));
    stream.synchronize();
    kernels::cross_entropy_forward(stream, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(),
                                   per_sample.as<float>(), loss.as<float>());
    if (GetParam() == "sim") {
      try {
        stream.synchronize();
        ADD_FAILURE() << "target " << bad << ": the sim stream did not fail";
      } catch (const InvalidArgument& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("cross_entropy_forward"), std::string::npos) << what;
        EXPECT_NE(what.find("target " + std::to_string(bad)), std::string::npos) << what;
        EXPECT_NE(what.find("sample 1"), std::string::npos) << what;
      }
      EXPECT_THROW(stream.synchronize(), InvalidArgument);  // sticky
    } else {
      stream.synchronize();
    }
    // Read back on a healthy stream of the same device (the failed one refuses new work).
    Stream reader = device_->create_stream();
    const auto terms = download<float>(reader, per_sample);
    EXPECT_TRUE(std::isfinite(terms[0]) && std::isnan(terms[1]) && std::isfinite(terms[2]))
        << terms[0] << " " << terms[1] << " " << terms[2];
    EXPECT_TRUE(std::isnan(download<float>(reader, loss)[0]));

    Stream backward = device_->create_stream();
    kernels::cross_entropy_backward(backward, n, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(), 1.0f, n,
                                    dlogits.as<float>());
    if (GetParam() == "sim") {
      EXPECT_THROW(backward.synchronize(), InvalidArgument);
    } else {
      backward.synchronize();
    }
    const auto grad = download<float>(reader, dlogits);
    for (int c = 0; c < kClasses; ++c) {
      EXPECT_TRUE(std::isfinite(grad[c]) && std::isnan(grad[kClasses + c]) && std::isfinite(grad[2 * kClasses + c]))
          << "class " << c;
    }
  }
}

TEST_P(CrossEntropyTest, CrossEntropyRejectsBadShapes) {
  DeviceBuffer buf = device_->allocate(64);
  EXPECT_THROW(kernels::cross_entropy_forward(stream_, -1, kClasses, buf.as<float>(), buf.as<std::int64_t>(),
                                              buf.as<float>(), buf.as<float>()),
               InvalidArgument);
  EXPECT_THROW(kernels::cross_entropy_forward(stream_, 1, 0, buf.as<float>(), buf.as<std::int64_t>(), buf.as<float>(),
                                              buf.as<float>()),
               InvalidArgument);
  EXPECT_THROW(kernels::cross_entropy_backward(stream_, 1, kClasses, buf.as<float>(), buf.as<std::int64_t>(), 1.0f, 0,
                                               buf.as<float>()),
               InvalidArgument);
  if (GetParam() == "sim") {  // logits of 2 rows x 10 classes do not fit in 64 bytes
    EXPECT_THROW(kernels::cross_entropy_forward(stream_, 2, kClasses, buf.as<float>(), buf.as<std::int64_t>(),
                                                buf.as<float>(), buf.as<float>()),
                 DeviceMismatch);
  }
  stream_.synchronize();  // nothing was queued: the stream is healthy
}

// PyTorch: the mean over an empty batch is NaN (0 / 0), not 0.
TEST_P(CrossEntropyTest, CrossEntropyEmptyBatchIsNaN) {
  DeviceBuffer loss = device_->allocate(sizeof(float)), scratch = device_->allocate(sizeof(float));
  kernels::cross_entropy_forward(stream_, 0, kClasses, scratch.as<float>(), scratch.as<std::int64_t>(),
                                 scratch.as<float>(), loss.as<float>());
  EXPECT_TRUE(std::isnan(download<float>(stream_, loss)[0]));
}

// A NaN logit makes the loss NaN, as torch's cross_entropy (1.13: F.cross_entropy([[nan, 1, 2]],
// [1]) is nan): divergence must reach the loss, where dp_train's guard sees it.
TEST_P(CrossEntropyTest, CrossEntropyOfANaNLogitIsNaN) {
  std::vector<float> logits(2 * kClasses, 0.5f);
  logits[kClasses + 3] = std::nanf("");
  const std::vector<std::int64_t> targets = {1, 1};
  DeviceBuffer dlogits_in = upload(*device_, stream_, logits), dtargets = upload(*device_, stream_, targets);
  DeviceBuffer per_sample = device_->allocate(2 * sizeof(float)), loss = device_->allocate(sizeof(float));
  kernels::cross_entropy_forward(stream_, 2, kClasses, dlogits_in.as<float>(), dtargets.as<std::int64_t>(),
                                 per_sample.as<float>(), loss.as<float>());
  const auto terms = download<float>(stream_, per_sample);
  EXPECT_TRUE(std::isfinite(terms[0])) << "the clean sample's term";
  EXPECT_TRUE(std::isnan(terms[1]));
  EXPECT_TRUE(std::isnan(download<float>(stream_, loss)[0]));
}

}  // namespace
}  // namespace dp
