// test_loss_optimizer.cpp — CrossEntropyLoss against double host loops and finite differences, and
// SGD against torch.optim.SGD's formula (exact fp32 equality) and the PyTorch golden files.
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

class LossOptimizerTest : public test::BackendTest {
 protected:
};

INSTANTIATE_TEST_SUITE_P(Backends, LossOptimizerTest, ::testing::Values("sim", "cuda"),
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

TEST_P(LossOptimizerTest, CrossEntropyMatchesDoubleReference) {
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
TEST_P(LossOptimizerTest, CrossEntropyGradientMatchesFiniteDifferences) {
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
TEST_P(LossOptimizerTest, CrossEntropyInvalidTarget) {
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

TEST_P(LossOptimizerTest, CrossEntropyRejectsBadShapes) {
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
TEST_P(LossOptimizerTest, CrossEntropyEmptyBatchIsNaN) {
  DeviceBuffer loss = device_->allocate(sizeof(float)), scratch = device_->allocate(sizeof(float));
  kernels::cross_entropy_forward(stream_, 0, kClasses, scratch.as<float>(), scratch.as<std::int64_t>(),
                                 scratch.as<float>(), loss.as<float>());
  EXPECT_TRUE(std::isnan(download<float>(stream_, loss)[0]));
}

// A NaN logit makes the loss NaN, as torch's cross_entropy (1.13: F.cross_entropy([[nan, 1, 2]],
// [1]) is nan): divergence must reach the loss, where dp_train's guard sees it.
TEST_P(LossOptimizerTest, CrossEntropyOfANaNLogitIsNaN) {
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

// ------------------------------------------------------------------------------------------------
// SGD

// torch/optim/sgd.py (_single_tensor_sgd, dampening 0), one statement per tensor op, each rounded
// to fp32 as ATen rounds it: x.add(y, alpha=a) is one fused multiply-add x + a*y (ATen's
// ufunc::add is vec::fmadd; verified on this machine's torch for both the vector body and the
// scalar tail), x.mul_(m) a plain product.
// The update kernels as the optimizers call them: the options validated, then split into the
// update's constants and its per-step values.
void sgd_kernel(const Stream& stream, kernels::index_t n, const SgdOptions& o, bool first_step, float* params,
                const float* grads, float* buffer) {
  validate(o);
  kernels::sgd_step(stream, n, {o.momentum, o.weight_decay, o.nesterov}, kernels::sgd_scalars(o.lr, first_step), params,
                    grads, buffer);
}
void adamw_kernel(const Stream& stream, kernels::index_t n, const AdamWOptions& o, std::int64_t step, float* params,
                  const float* grads, float* exp_avg, float* exp_avg_sq) {
  validate(o);
  const kernels::AdamWConstants constants{o.beta1, o.beta2, o.eps};
  kernels::adamw_step(stream, n, constants, kernels::adamw_scalars(constants, o.lr, o.weight_decay, step), params,
                      grads, exp_avg, exp_avg_sq);
}

class TorchSgd {
 public:
  explicit TorchSgd(SgdOptions o) : o_(o) {}
  void step(std::vector<float>& params, std::vector<float> d_p) {
    if (buf_.empty() && o_.momentum != 0.0f) buf_.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (o_.weight_decay != 0.0f) d_p[i] = std::fma(params[i], o_.weight_decay, d_p[i]);  // d_p.add(p, alpha=wd)
      if (o_.momentum != 0.0f) {
        if (steps_ == 0) {
          buf_[i] = d_p[i];  // torch.clone(d_p)
        } else {
          const float scaled = buf_[i] * o_.momentum;  // buf.mul_(momentum)
          buf_[i] = scaled + d_p[i];                   // .add_(d_p, alpha=1)
        }
        d_p[i] = o_.nesterov ? std::fma(buf_[i], o_.momentum, d_p[i]) : buf_[i];  // d_p.add(buf, alpha=momentum)
      }
      params[i] = std::fma(d_p[i], -o_.lr, params[i]);  // p.add_(d_p, alpha=-lr)
    }
    ++steps_;
  }
  const std::vector<float>& buffer() const { return buf_; }

 private:
  SgdOptions o_;
  std::vector<float> buf_;
  int steps_ = 0;
};

// Several steps with fresh gradients each, every option combination: parameters and momentum
// buffer equal the reference exactly (all_close with zero tolerance), because the kernel performs
// the same fp32 operations.
TEST_P(LossOptimizerTest, SgdMatchesTorchFormulaExactly) {
  struct Case {
    const char* name;
    SgdOptions options;
  };
  const Case cases[] = {
      {"plain", {0.1f, 0.0f, 0.0f, false}},     {"weight_decay", {0.1f, 0.0f, 1e-2f, false}},
      {"momentum", {0.05f, 0.9f, 0.0f, false}}, {"momentum_weight_decay", {0.05f, 0.9f, 1e-3f, false}},
      {"nesterov", {0.05f, 0.9f, 0.0f, true}},  {"nesterov_weight_decay", {0.01f, 0.5f, 5e-4f, true}},
  };
  const std::size_t n = 4099;  // not a multiple of any block size
  unsigned seed = 200;
  for (const Case& c : cases) {
    auto params = random_vector(n, ++seed);
    DeviceBuffer dparams = upload(*device_, stream_, params);
    DeviceBuffer grads = device_->allocate(n * sizeof(float));
    DeviceBuffer buf = device_->allocate(n * sizeof(float));
    kernels::fill(stream_, buf.as<float>(), n, 123.0f);  // the first step must not read it
    TorchSgd ref(c.options);
    for (int step = 0; step < 4; ++step) {
      const auto g = random_vector(n, ++seed, -2.0f, 2.0f);
      stream_.copy(grads.data(), g.data(), n * sizeof(float));
      sgd_kernel(stream_, n, c.options, step == 0, dparams.as<float>(), grads.as<float>(),
                 c.options.momentum != 0.0f ? buf.as<float>() : nullptr);
      ref.step(params, g);
      EXPECT_TRUE(all_close(download<float>(stream_, dparams), params, 0.0, 0.0)) << c.name << " step " << step;
      if (c.options.momentum != 0.0f) {
        EXPECT_TRUE(all_close(download<float>(stream_, buf), ref.buffer(), 0.0, 0.0)) << c.name << " step " << step;
      }
    }
  }
}

// Whole numbers and powers of two, so every intermediate is exact and the expected values can be
// worked out by hand (lr 0.5, momentum 0.5, weight decay 0.25).
TEST_P(LossOptimizerTest, SgdHandComputedSteps) {
  const std::vector<float> p0{4.0f, -2.0f, 0.0f}, g0{2.0f, 4.0f, -6.0f}, g1{2.0f, 0.0f, 2.0f};
  DeviceBuffer grads = device_->allocate(3 * sizeof(float)), buf = device_->allocate(3 * sizeof(float));
  const auto run = [&](SgdOptions o) {
    DeviceBuffer p = upload(*device_, stream_, p0);
    std::vector<std::vector<float>> out;
    for (const auto* g : {&g0, &g1}) {
      stream_.copy(grads.data(), g->data(), 3 * sizeof(float));
      sgd_kernel(stream_, 3, o, g == &g0, p.as<float>(), grads.as<float>(), buf.as<float>());
      out.push_back(download<float>(stream_, p));
    }
    return out;
  };
  // plain: p -= 0.5 g.  [4,-2,0] - 0.5*[2,4,-6] = [3,-4,3];  - 0.5*[2,0,2] = [2,-4,2]
  auto r = run({0.5f, 0.0f, 0.0f, false});
  EXPECT_EQ(r[0], (std::vector<float>{3.0f, -4.0f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{2.0f, -4.0f, 2.0f}));
  // momentum: buf = g0 = [2,4,-6], p = [3,-4,3]; buf = 0.5*[2,4,-6] + [2,0,2] = [3,2,-1],
  // p = [3,-4,3] - 0.5*[3,2,-1] = [1.5,-5,3.5]
  r = run({0.5f, 0.5f, 0.0f, false});
  EXPECT_EQ(r[0], (std::vector<float>{3.0f, -4.0f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{1.5f, -5.0f, 3.5f}));
  EXPECT_EQ(download<float>(stream_, buf), (std::vector<float>{3.0f, 2.0f, -1.0f}));
  // nesterov: step 0: buf = [2,4,-6], d = g + 0.5 buf = [3,6,-9], p = [4,-2,0] - 0.5 d = [2.5,-5,4.5];
  // step 1: buf = [3,2,-1], d = [2,0,2] + 0.5*[3,2,-1] = [3.5,1,1.5], p = [0.75,-5.5,3.75]
  r = run({0.5f, 0.5f, 0.0f, true});
  EXPECT_EQ(r[0], (std::vector<float>{2.5f, -5.0f, 4.5f}));
  EXPECT_EQ(r[1], (std::vector<float>{0.75f, -5.5f, 3.75f}));
  // weight decay 0.25, no momentum: d = g + 0.25 p = [2+1, 4-0.5, -6+0] = [3,3.5,-6],
  // p = [4,-2,0] - 0.5 d = [2.5,-3.75,3]; d = [2+0.625, 0-0.9375, 2+0.75], p = [1.1875,-3.28125,1.625]
  r = run({0.5f, 0.0f, 0.25f, false});
  EXPECT_EQ(r[0], (std::vector<float>{2.5f, -3.75f, 3.0f}));
  EXPECT_EQ(r[1], (std::vector<float>{1.1875f, -3.28125f, 1.625f}));
}

TEST_P(LossOptimizerTest, SgdRejectsInvalidOptions) {
  DeviceBuffer p = device_->allocate(16 * sizeof(float));
  float* x = p.as<float>();
  EXPECT_THROW(sgd_kernel(stream_, 16, {-0.1f, 0.0f, 0.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, -0.9f, 0.0f, false}, true, x, x, x), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.0f, -1.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.0f, 0.0f, true}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, 16, {0.1f, 0.9f, 0.0f, false}, true, x, x, nullptr), InvalidArgument);
  EXPECT_THROW(sgd_kernel(stream_, -1, {}, true, x, x, nullptr), InvalidArgument);
  if (GetParam() == "sim") {  // 17 floats run past the 16-float allocation
    EXPECT_THROW(sgd_kernel(stream_, 17, {}, true, x, x, nullptr), DeviceMismatch);
  }
  stream_.synchronize();
}

// The golden files of tests/golden: PyTorch's own SGD (CPU, fp32) from `init` with the stored
// gradients must be reproduced bit for bit, momentum buffers after every step and final parameters,
// all parameters of the model in one flat buffer as the engine keeps them.
TEST_P(LossOptimizerTest, SgdMatchesPyTorchGoldensBitForBit) {
  for (const char* name : {"mlp_b7", "mlp_b7_nesterov", "convnet_b7"}) {
    const auto file = safetensors::read(test::golden_path(name));
    const auto& meta = file.metadata;
    const SgdOptions options{std::stof(meta.at("lr")), std::stof(meta.at("momentum")),
                             std::stof(meta.at("weight_decay")), meta.at("nesterov") == "1"};
    const int steps = std::stoi(meta.at("steps"));
    // Parameters are the tensors with a gradient, in file order; flattened one after another.
    std::vector<std::string> ordered;
    for (const auto& key : file.order)
      if (key.rfind("step0.grad.", 0) == 0) ordered.push_back(key.substr(11));
    ASSERT_FALSE(ordered.empty()) << name;
    const auto flat = [&](const std::string& prefix) {
      std::vector<float> out;
      for (const auto& param : ordered) {
        const auto v = file.at(prefix + param).to_f32();
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    const auto init = flat("init.");
    const std::size_t n = init.size();
    DeviceBuffer params = upload(*device_, stream_, init), grads = device_->allocate(n * sizeof(float));
    DeviceBuffer buf = device_->allocate(n * sizeof(float));
    for (int k = 0; k < steps; ++k) {
      const auto g = flat("step" + std::to_string(k) + ".grad.");
      stream_.copy(grads.data(), g.data(), n * sizeof(float));
      sgd_kernel(stream_, n, options, k == 0, params.as<float>(), grads.as<float>(), buf.as<float>());
      EXPECT_TRUE(all_close(download<float>(stream_, buf), flat("step" + std::to_string(k) + ".momentum."), 0.0, 0.0))
          << name << " step " << k;
    }
    EXPECT_TRUE(all_close(download<float>(stream_, params), flat("final."), 0.0, 0.0)) << name;
  }
}

}  // namespace
}  // namespace dp

namespace dp {
namespace {

// Distance in units in the last place between two floats of the same sign (0 = the same bits).
std::int64_t ulps(float a, float b) {
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

// torch.optim.AdamW, 4 steps on 1027 values, for two sets of hyper-parameters
// (tests/golden/make_adamw_goldens.py): parameters and both moments after every step.
TEST_P(LossOptimizerTest, AdamWMatchesPyTorchGoldens) {
  const auto golden = safetensors::read(test::golden_path("adamw"));
  for (const std::string name : {"defaults", "aggressive"}) {
    const auto h = nlohmann::json::parse(golden.metadata.at(name));
    const AdamWOptions options{h.at("lr"), h.at("beta1"), h.at("beta2"), h.at("eps"), h.at("weight_decay")};
    const auto init = golden.at(name + ".init").to_f32();
    const auto n = static_cast<kernels::index_t>(init.size());
    DeviceBuffer params = upload(*device_, stream_, init);
    DeviceBuffer m = upload(*device_, stream_, std::vector<float>(init.size(), 0.0f));
    DeviceBuffer v = upload(*device_, stream_, std::vector<float>(init.size(), 0.0f));
    for (int step = 0; step < 4; ++step) {
      const auto key = [&](const char* what) { return fmt::format("{}.{}.{}", name, what, step); };
      DeviceBuffer grads = upload(*device_, stream_, golden.at(key("grad")).to_f32());
      adamw_kernel(stream_, n, options, step + 1, params.as<float>(), grads.as<float>(), m.as<float>(), v.as<float>());
      for (const auto& [what, buffer] :
           {std::pair{"param", &params}, std::pair{"exp_avg", &m}, std::pair{"exp_avg_sq", &v}}) {
        const auto got = download<float>(stream_, *buffer), want = golden.at(key(what)).to_f32();
        std::int64_t worst = 0;
        for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, ulps(got[i], want[i]));
        EXPECT_EQ(worst, 0) << name << " " << what << " after step " << step + 1 << ": " << worst << " ulp";
      }
    }
  }
}

TEST_P(LossOptimizerTest, AdamWRejectsWhatTorchRejects) {
  DeviceBuffer buf = device_->allocate(16 * sizeof(float));
  float* x = buf.as<float>();
  EXPECT_THROW(adamw_kernel(stream_, 4, {.lr = -1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.beta1 = 1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.beta2 = -0.1}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.eps = std::nan("")}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {.weight_decay = -1.0}, 1, x, x, x, x), InvalidArgument);
  EXPECT_THROW(adamw_kernel(stream_, 4, {}, 0, x, x, x, x), InvalidArgument) << "steps count from 1";
}

}  // namespace
}  // namespace dp
