// test_fusion.cpp — the fused kernels against the unfused sequences they
// replace: cross-entropy forward + backward in one launch, BatchNorm with a following ReLU (forward,
// the ReLU mask inside the backward, eval) and the chain that fuses them, a residual block's sum and
// ReLU, and max-pool backward as one gather. Bit for bit on every backend (fusing must not move a
// rounding), and, where a GPU exists, cuda against sim for the fused functors.
#include <cmath>
#include <cstring>
#include <gtest/gtest.h>
#include <utility>
#include <vector>

#include "dp/kernels/batchnorm.h"
#include "dp/kernels/loss.h"
#include "dp/kernels/maxpool.h"
#include "dp/kernels/ops.h"
#include "dp/nn/loss.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/device.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;

// Same bits (memcmp: -0 and NaN payloads included), reporting the first differing index. Across
// backends a NaN matches any NaN: a GPU's arithmetic returns the canonical NaN (0x7fffffff) where
// x86 keeps an operand's payload (docs/cuda-rules.md), and no dp result depends on a payload.
template <class T>
testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want, bool any_nan = false) {
  if (got.size() != want.size()) return testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && !(any_nan && std::isnan(got[i]) && std::isnan(want[i])))
      return testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << want[i] << " (" << got.size()
                                         << " elements)";
  return testing::AssertionSuccess();
}

void expect_same_bits(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                      bool any_nan = false) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same_bits(got[i], want[i], any_nan)) << "output " << i;
}

class FusionTest : public test::BackendTest {};

INSTANTIATE_TEST_SUITE_P(Backends, FusionTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// ------------------------------------------------------------------------------------------------
// cross-entropy

// forward then backward, or both in one launch: per_sample, loss, dlogits.
std::vector<std::vector<float>> cross_entropy(Device& device, const Stream& stream, bool fused, int n, int classes,
                                              const std::vector<float>& logits,
                                              const std::vector<std::int64_t>& targets, float dloss, int mean_over,
                                              double label_smoothing) {
  DeviceBuffer dl = test::upload(device, stream, logits), dt = test::upload(device, stream, targets);
  DeviceBuffer per_sample = device.allocate(static_cast<std::size_t>(n) * 4), loss = device.allocate(4);
  DeviceBuffer dlogits = device.allocate(logits.size() * 4);
  if (fused) {
    kernels::cross_entropy_forward_backward(stream, n, classes, dl.as<float>(), dt.as<std::int64_t>(),
                                            per_sample.as<float>(), loss.as<float>(), dloss, mean_over,
                                            dlogits.as<float>(), label_smoothing);
  } else {
    kernels::cross_entropy_forward(stream, n, classes, dl.as<float>(), dt.as<std::int64_t>(), per_sample.as<float>(),
                                   loss.as<float>(), label_smoothing);
    kernels::cross_entropy_backward(stream, n, classes, dl.as<float>(), dt.as<std::int64_t>(), dloss, mean_over,
                                    dlogits.as<float>(), label_smoothing);
  }
  return {test::download<float>(stream, per_sample), test::download<float>(stream, loss),
          test::download<float>(stream, dlogits)};
}

// A batch of 16 (one block of the plan), an odd one, and 70001 samples (a two-stage mean); with and
// without label smoothing, a loss scale and a mean over more rows than these (DP's slices).
TEST_P(FusionTest, CrossEntropyForwardBackwardEqualsTheTwoCalls) {
  for (const int n : {16, 37, 70001})
    for (const double eps : {0.0, 0.1})
      for (const auto& [dloss, extra] : {std::pair<float, int>{1.0f, 0}, {0.25f, 5}}) {
        SCOPED_TRACE(testing::Message() << "n " << n << " eps " << eps << " dloss " << dloss);
        const int classes = 10;
        // Wide logits: large values exercise the max shift, equal ones the ties.
        std::vector<float> logits = test::random_vector(static_cast<std::size_t>(n) * classes, 60 + n, -30.0f, 30.0f);
        logits[3] = logits[4];
        const auto targets = test::random_targets(n, classes, 61);
        expect_same_bits(cross_entropy(*device_, stream_, true, n, classes, logits, targets, dloss, n + extra, eps),
                         cross_entropy(*device_, stream_, false, n, classes, logits, targets, dloss, n + extra, eps));
      }
}

// A target outside [0, C): the fused map writes NaN as both entry points do (run on the host: the
// sim stream would fail the step, which cross_entropy_forward's own tests cover).
TEST(FusionHost, CrossEntropyInvalidTargetGivesNaNRowAndTerm) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  for (const std::int64_t t : {std::int64_t{-1}, std::int64_t{3}}) {
    float per_sample = 0.0f, dlogits[3] = {};
    const kernels::CrossEntropyForwardBackwardTerm<> plain{logits.data(), &t,   3,           1.0f,
                                                           1.0f,          0.0f, &per_sample, dlogits};
    EXPECT_TRUE(std::isnan(plain(0, 0)));
    EXPECT_TRUE(std::isnan(per_sample));
    for (const float d : dlogits) EXPECT_TRUE(std::isnan(d));
    per_sample = 0.0f;
    const kernels::SmoothedCrossEntropyForwardBackwardTerm<> smoothed{
        logits.data(), &t, 3, 0.9f, 0.1f / 3, 1.0f, 0.9f + 0.1f / 3, 0.1f / 3, &per_sample, dlogits};
    const kernels::SmoothedTerms terms = smoothed(0, 0);
    EXPECT_TRUE(std::isnan(terms.nll) && std::isnan(terms.smooth) && std::isnan(per_sample));
  }
}

// The loss object's entry point, as the engines call it.
TEST_P(FusionTest, CrossEntropyLossForwardBackwardEqualsTheTwoCalls) {
  const int n = 24, classes = 10;
  const auto logits = test::random_vector(static_cast<std::size_t>(n) * classes, 62, -5.0f, 5.0f);
  const auto targets = test::random_targets(n, classes, 63);
  DeviceBuffer dl = up(logits), dt = up(targets), fused = floats(logits.size()), apart = floats(logits.size());
  for (const double eps : {0.0, 0.2}) {
    CrossEntropyLoss one(*device_, eps), two(*device_, eps);
    const float* l1 =
        one.forward_backward(stream_, dl.as<float>(), dt.as<std::int64_t>(), n, classes, fused.as<float>(), n, 0.5f);
    const float* l2 = two.forward(stream_, dl.as<float>(), dt.as<std::int64_t>(), n, classes);
    two.backward(stream_, dl.as<float>(), dt.as<std::int64_t>(), n, classes, apart.as<float>(), n, 0.5f);
    std::vector<float> loss1(1), loss2(1);
    stream_.copy(loss1.data(), l1, 4);
    stream_.copy(loss2.data(), l2, 4);
    stream_.synchronize();
    EXPECT_TRUE(same_bits(loss1, loss2));
    EXPECT_TRUE(same_bits(down<float>(fused), down<float>(apart)));
  }
}

// Autocast's logits: bf16 storage read widened, the loss that of the widened logits, the gradient
// that loss's fp32 gradient rounded once (torch's fp32 loss on `logits.float()` and the cast's
// backward), with and without label smoothing, over a GPT-sized row as well.
TEST_P(FusionTest, CrossEntropyLossOnBf16LogitsIsTheWidenedLossAndItsGradientRounded) {
  for (const int classes : {10, 1000})
    for (const double eps : {0.0, 0.2}) {
      SCOPED_TRACE(testing::Message() << "classes " << classes << " eps " << eps);
      const int n = 24;
      const auto bits = test::bf16_bits(
          test::random_vector(static_cast<std::size_t>(n) * static_cast<std::size_t>(classes), 64, -8.0f, 8.0f));
      const auto targets = test::random_targets(n, classes, 65);
      DeviceBuffer d16 = up(bits), d32 = up(test::bf16_values(bits)), dt = up(targets);
      DeviceBuffer g16 = device_->allocate(bits.size() * 2), g32 = floats(bits.size());
      CrossEntropyLoss narrow(*device_, eps), wide(*device_, eps);
      const float* l16 = narrow.forward_backward(stream_, d16.as<std::uint16_t>(), dt.as<std::int64_t>(), n, classes,
                                                 g16.as<std::uint16_t>(), n + 3, 0.5f, true);
      const float* l32 = wide.forward_backward(stream_, d32.as<float>(), dt.as<std::int64_t>(), n, classes,
                                               g32.as<float>(), n + 3, 0.5f);
      std::vector<float> loss16(1), loss32(1);
      stream_.copy(loss16.data(), l16, 4);
      stream_.copy(loss32.data(), l32, 4);
      stream_.synchronize();
      EXPECT_TRUE(same_bits(loss16, loss32));
      EXPECT_EQ(down<std::uint16_t>(g16), test::bf16_bits(down<float>(g32)));
    }
}

// ------------------------------------------------------------------------------------------------
// BatchNorm + ReLU

struct BnOutputs {
  std::vector<std::vector<float>> floats;
  std::int64_t batches = 0;
};

// Train forward, backward (the gradient arriving at the ReLU's output), eval forward: with the ReLU
// fused, or as ReLU kernels of their own.
BnOutputs batchnorm_relu(Device& device, const Stream& stream, bool fused, const kernels::BatchNormShape& bn,
                         const std::vector<float>& x, const std::vector<float>& gamma, const std::vector<float>& beta,
                         const std::vector<float>& dy) {
  const std::size_t c = static_cast<std::size_t>(bn.c), total = x.size();
  DeviceBuffer dx_in = test::upload(device, stream, x), ddy = test::upload(device, stream, dy);
  DeviceBuffer g = test::upload(device, stream, gamma), b = test::upload(device, stream, beta);
  DeviceBuffer pre = device.allocate(total * 4), y = device.allocate(total * 4), dpre = device.allocate(total * 4);
  DeviceBuffer dx = device.allocate(total * 4), eval = device.allocate(total * 4), stats = device.allocate(2 * c * 4);
  DeviceBuffer rm = test::upload(device, stream, std::vector<float>(c, 0.0f));
  DeviceBuffer rv = test::upload(device, stream, std::vector<float>(c, 1.0f));
  DeviceBuffer dg = test::upload(device, stream, std::vector<float>(c, 0.5f));  // accumulated into
  DeviceBuffer db = test::upload(device, stream, std::vector<float>(c, -0.5f));
  DeviceBuffer sums = device.allocate(2 * c * 4);
  DeviceBuffer batches = test::upload(device, stream, std::vector<std::int64_t>{7});
  float* mean = stats.as<float>();
  const auto n = static_cast<index_t>(total);
  if (fused) {
    kernels::batchnorm_forward_train(stream, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(), mean,
                                     mean + c, rm.as<float>(), rv.as<float>(), batches.as<std::int64_t>(), true);
    kernels::batchnorm_backward(stream, bn, dx_in.as<float>(), g.as<float>(), mean, mean + c, ddy.as<float>(),
                                dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>(), y.as<float>());
    kernels::batchnorm_forward_eval(stream, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(), rm.as<float>(),
                                    rv.as<float>(), eval.as<float>(), true);
  } else {
    kernels::batchnorm_forward_train(stream, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(), pre.as<float>(), mean,
                                     mean + c, rm.as<float>(), rv.as<float>(), batches.as<std::int64_t>());
    kernels::relu_forward(stream, n, pre.as<float>(), y.as<float>());
    kernels::relu_backward(stream, n, y.as<float>(), ddy.as<float>(), dpre.as<float>());
    kernels::batchnorm_backward(stream, bn, dx_in.as<float>(), g.as<float>(), mean, mean + c, dpre.as<float>(),
                                dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>());
    kernels::batchnorm_forward_eval(stream, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(), rm.as<float>(),
                                    rv.as<float>(), pre.as<float>());
    kernels::relu_forward(stream, n, pre.as<float>(), eval.as<float>());
  }
  BnOutputs out;
  for (const DeviceBuffer* buffer : {&y, &stats, &rm, &rv, &dx, &dg, &db, &sums, &eval})
    out.floats.push_back(test::download<float>(stream, *buffer));
  out.batches = test::download<std::int64_t>(stream, batches)[0];
  return out;
}

// Inputs whose normalised values are negative, positive and exactly zero (a channel with gamma = 0
// and beta = 0 is all zeros: ReLU's gradient at 0 is 0), and negative zeros in dy.
TEST_P(FusionTest, BatchNormReluEqualsBatchNormThenRelu) {
  for (const kernels::BatchNormShape bn : {kernels::BatchNormShape{8, 3, 28, 28}, kernels::BatchNormShape{3, 5, 3, 7},
                                           kernels::BatchNormShape{2, 2, 1, 1}}) {
    SCOPED_TRACE(testing::Message() << bn.n << "x" << bn.c << "x" << bn.h << "x" << bn.w);
    const std::size_t c = static_cast<std::size_t>(bn.c), total = static_cast<std::size_t>(bn.n) * c * bn.h * bn.w;
    const auto x = test::random_vector(total, 70, -3.0f, 5.0f);
    auto dy = test::random_vector(total, 71);
    for (std::size_t i = 0; i < total; i += 7) dy[i] = -0.0f;
    auto gamma = test::random_vector(c, 72), beta = test::random_vector(c, 73);
    gamma[0] = 0.0f;
    beta[0] = 0.0f;
    const BnOutputs fused = batchnorm_relu(*device_, stream_, true, bn, x, gamma, beta, dy);
    const BnOutputs apart = batchnorm_relu(*device_, stream_, false, bn, x, gamma, beta, dy);
    expect_same_bits(fused.floats, apart.floats);
    EXPECT_EQ(fused.batches, 8);  // counted once, by the variance pass
    EXPECT_EQ(apart.batches, 8);
  }
}

// SyncBatchNorm's entry points take the same fused ReLU (one replica here: the all-reduce adds
// nothing, so only the fusion is under test).
TEST_P(FusionTest, SyncBatchNormReluEqualsSyncBatchNormThenRelu) {
  const kernels::BatchNormShape bn{4, 3, 5, 6};
  const std::size_t c = 3, total = 4 * 3 * 5 * 6;
  const auto n = static_cast<index_t>(total);
  const index_t count = 4 * 5 * 6;
  const auto x = test::random_vector(total, 78, -3.0f, 5.0f), dy = test::random_vector(total, 79);
  auto run = [&](bool fused) {
    DeviceBuffer dx_in = up(x), ddy = up(dy), g = up(test::random_vector(c, 82)), b = up(test::random_vector(c, 83));
    DeviceBuffer pre = floats(total), y = floats(total), dpre = floats(total), dx = floats(total);
    DeviceBuffer stats = floats(2 * c), scratch = floats(2 * c), sums = floats(2 * c);
    DeviceBuffer rm = up(std::vector<float>(c, 0.0f)), rv = up(std::vector<float>(c, 1.0f));
    DeviceBuffer dg = up(std::vector<float>(c, 0.0f)), db = up(std::vector<float>(c, 0.0f));
    DeviceBuffer batches = up(std::vector<std::int64_t>{0});
    float* mean = stats.as<float>();
    // The phases as nn's BatchNorm2d runs them, with nothing to all-reduce between them.
    kernels::sync_batchnorm_sums(stream_, bn, dx_in.as<float>(), mean, count);
    kernels::sync_batchnorm_moments(stream_, bn, dx_in.as<float>(), mean, scratch.as<float>(), count);
    kernels::sync_batchnorm_normalize(stream_, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(),
                                      fused ? y.as<float>() : pre.as<float>(), mean, mean + c, rm.as<float>(),
                                      rv.as<float>(), batches.as<std::int64_t>(), scratch.as<float>(), count, fused);
    if (!fused) {
      kernels::relu_forward(stream_, n, pre.as<float>(), y.as<float>());
      kernels::relu_backward(stream_, n, y.as<float>(), ddy.as<float>(), dpre.as<float>());
    }
    const float* dy_in = fused ? ddy.as<float>() : dpre.as<float>();
    const float* relu_y = fused ? y.as<float>() : nullptr;
    kernels::sync_batchnorm_backward_sums(stream_, bn, dx_in.as<float>(), g.as<float>(), mean, mean + c, dy_in,
                                          dg.as<float>(), db.as<float>(), sums.as<float>(), count, relu_y);
    kernels::sync_batchnorm_backward_dx(stream_, bn, dx_in.as<float>(), g.as<float>(), mean, mean + c, dy_in,
                                        dx.as<float>(), sums.as<float>(), count, relu_y);
    std::vector<std::vector<float>> got;
    for (const DeviceBuffer* buffer : {&y, &stats, &rm, &rv, &dx, &dg, &db}) got.push_back(down<float>(*buffer));
    EXPECT_EQ(down<std::int64_t>(batches)[0], 1);
    return got;
  };
  expect_same_bits(run(true), run(false));
}

// A model with BatchNorm2d followed by ReLU (the chain fuses them) against the same model with the
// ReLU inside a Sequential of its own (nothing to fuse): identical state-dict names and parameters,
// and the same bits for the train forward, the gradients, the running statistics and eval.
std::unique_ptr<nn::SequentialModel> bn_relu_model(Device& device, bool wrap_relu) {
  using namespace nn;
  Layers layers;
  layers.push_back(make_conv2d("0", 1, 4, 3, 1, 1));
  layers.push_back(make_batchnorm2d("1", 4));
  if (wrap_relu) {
    Layers inner;
    inner.push_back(make_relu("0"));
    layers.push_back(make_sequential("2", std::move(inner)));
  } else {
    layers.push_back(make_relu("2"));
  }
  layers.push_back(make_maxpool2d("3", 2, 2));
  layers.push_back(make_batchnorm2d("4", 4));  // the last layers: the fused pair writes the output
  layers.push_back(make_relu("5"));
  auto model =
      std::make_unique<SequentialModel>("bn_relu", device, std::move(layers), std::vector<std::int64_t>{1, 8, 8});
  model->initialize(11);
  return model;
}

TEST_P(FusionTest, ChainFusesBatchNormAndReluWithoutChangingResults) {
  const int batch = 6, out = 4 * 4 * 4;
  const auto input = test::random_vector(static_cast<std::size_t>(batch) * 64, 80);
  const auto dy = test::random_vector(static_cast<std::size_t>(batch) * out, 81);
  DeviceBuffer x = up(input), ddy = up(dy);
  auto run = [&](bool wrap_relu) {
    auto model = bn_relu_model(*device_, wrap_relu);
    std::vector<std::vector<float>> got;
    std::vector<std::string> names;
    for (const TensorRef& p : model->parameters()) names.push_back(p.name);
    for (const TensorRef& b : model->buffers()) names.push_back(b.name);
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias",
                                               "1.running_mean", "1.running_var", "1.num_batches_tracked",
                                               "4.running_mean", "4.running_var", "4.num_batches_tracked"}));
    for (int step = 0; step < 2; ++step) {
      const float* y = model->forward(stream_, x.as<float>(), batch, Mode::train);
      std::vector<float> host(static_cast<std::size_t>(batch) * out);
      stream_.copy(host.data(), y, host.size() * 4);
      model->zero_grad(stream_);
      model->backward(stream_, ddy.as<float>(), {});
      stream_.synchronize();
      got.push_back(host);
      std::vector<float> grads(model->param_count());
      stream_.copy(grads.data(), model->grads_flat(), grads.size() * 4);
      std::vector<float> stats(model->buffers_bytes() / 4);
      stream_.copy(stats.data(), model->buffers_flat(), stats.size() * 4);
      stream_.synchronize();
      got.push_back(grads);
      got.push_back(stats);
    }
    const float* y = model->forward(stream_, x.as<float>(), batch, Mode::eval);
    std::vector<float> host(static_cast<std::size_t>(batch) * out);
    stream_.copy(host.data(), y, host.size() * 4);
    stream_.synchronize();
    got.push_back(host);
    return got;
  };
  expect_same_bits(run(false), run(true));
}

// ------------------------------------------------------------------------------------------------
// a residual block's sum and ReLU

std::vector<std::vector<float>> add_then_relu(Device& device, const Stream& stream, bool fused,
                                              const std::vector<float>& a, const std::vector<float>& b) {
  const auto n = static_cast<index_t>(a.size());
  DeviceBuffer da = test::upload(device, stream, a), db = test::upload(device, stream, b);
  DeviceBuffer out = device.allocate(a.size() * 4);
  if (fused) {
    kernels::add_relu(stream, n, da.as<float>(), db.as<float>(), out.as<float>());
  } else {
    kernels::add(stream, n, da.as<float>(), db.as<float>(), out.as<float>());
    kernels::relu_forward(stream, n, out.as<float>(), out.as<float>());
  }
  return {test::download<float>(stream, out)};
}

// Sums that are positive, negative, exactly 0 and -0, and NaN.
std::pair<std::vector<float>, std::vector<float>> add_relu_inputs() {
  auto a = test::random_vector(100003, 94), b = test::random_vector(100003, 95);
  for (std::size_t i = 0; i < a.size(); i += 11) b[i] = -a[i];
  a[1] = -0.0f;
  b[1] = -0.0f;
  a[2] = std::nanf("");
  return {a, b};
}

TEST_P(FusionTest, AddReluEqualsAddThenRelu) {
  const auto [a, b] = add_relu_inputs();
  const auto fused = add_then_relu(*device_, stream_, true, a, b);
  expect_same_bits(fused, add_then_relu(*device_, stream_, false, a, b));
  EXPECT_TRUE(std::isnan(fused[0][2]));
  EXPECT_FALSE(std::signbit(fused[0][1])) << "relu(-0 + -0) is +0";
}

// ------------------------------------------------------------------------------------------------
// max-pool backward: one gather, no zero fill

// Non-overlapping windows (stride >= kernel, the ConvNet's 2x2/2): what the removed zero fill and
// scatter wrote (0 + dy at each chosen input, +0 elsewhere), bit for bit, -0 gradients included.
TEST_P(FusionTest, MaxPoolBackwardGatherEqualsZeroFillAndScatter) {
  for (const kernels::MaxPoolShape s :
       {kernels::MaxPoolShape{2, 3, 28, 28, 2, 2, 0}, kernels::MaxPoolShape{2, 2, 7, 5, 2, 2, 0},
        kernels::MaxPoolShape{1, 2, 9, 9, 2, 3, 1}, kernels::MaxPoolShape{2, 1, 4, 3, 3, 3, 0}}) {
    SCOPED_TRACE(testing::Message() << s.h << "x" << s.w << " k" << s.kernel << " s" << s.stride << " p" << s.pad);
    const std::size_t in = static_cast<std::size_t>(s.n) * s.c * s.h * s.w;
    const std::size_t out = static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out();
    const auto x = test::random_vector(in, 90);
    auto dy = test::random_vector(out, 91);
    for (std::size_t i = 0; i < out; i += 5) dy[i] = -0.0f;
    DeviceBuffer dx_in = up(x), ddy = up(dy), y = floats(out), dx = up(std::vector<float>(in, 99.0f));
    DeviceBuffer argmax = device_->allocate(out * sizeof(std::int32_t));
    kernels::maxpool_forward(stream_, s, dx_in.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
    kernels::maxpool_backward(stream_, s, argmax.as<std::int32_t>(), ddy.as<float>(), dx.as<float>());
    const auto chosen = down<std::int32_t>(argmax);
    std::vector<float> want(in, 0.0f);
    const std::size_t plane_out = static_cast<std::size_t>(s.h_out()) * s.w_out();
    for (std::size_t o = 0; o < out; ++o)
      want[o / plane_out * s.h * s.w + static_cast<std::size_t>(chosen[o])] = 0.0f + dy[o];
    EXPECT_TRUE(same_bits(down<float>(dx), want));
  }
}

// ------------------------------------------------------------------------------------------------
// cuda against sim (GPU machines only)

template <class Body>
auto run_on(Runtime& runtime, const Body& body) {
  Device& device = runtime.device(0);
  Stream stream = device.create_stream();
  return body(device, stream);
}

// The fused BatchNorm + ReLU functors: the same bits on both backends, like the unfused ones.
TEST(FusionCudaMatchesSim, BatchNormRelu) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  for (const kernels::BatchNormShape bn :
       {kernels::BatchNormShape{64, 16, 28, 28}, kernels::BatchNormShape{3, 5, 7, 7}}) {
    const std::size_t c = static_cast<std::size_t>(bn.c), total = static_cast<std::size_t>(bn.n) * c * bn.h * bn.w;
    const auto x = test::random_vector(total, 74, -3.0f, 5.0f), dy = test::random_vector(total, 75);
    const auto gamma = test::random_vector(c, 76), beta = test::random_vector(c, 77);
    auto body = [&](Device& device, Stream& stream) {
      return batchnorm_relu(device, stream, true, bn, x, gamma, beta, dy).floats;
    };
    expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
  }
}

// The fused cross-entropy: expf / logf differ between CUDA and the host libm in the last bits (see
// test_reduce.cpp's CrossEntropyWithinUlps), so within ~8 ulp; on the GPU itself, fused equals the
// two calls bit for bit (FusionTest above, cuda instance).
TEST(FusionCudaMatchesSim, CrossEntropyForwardBackwardWithinUlps) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const int n = 1024, classes = 10;
  const auto logits = test::random_vector(static_cast<std::size_t>(n) * classes, 64, -5.0f, 5.0f);
  const auto targets = test::random_targets(n, classes, 65);
  for (const double eps : {0.0, 0.1}) {
    auto body = [&](Device& device, Stream& stream) {
      return cross_entropy(device, stream, true, n, classes, logits, targets, 1.0f, n, eps);
    };
    const auto on_cuda = run_on(*gpu, body), on_sim = run_on(*sim, body);
    EXPECT_TRUE(test::all_close(on_cuda[0], on_sim[0], 1e-6, 1e-9));
    EXPECT_TRUE(test::all_close(on_cuda[1], on_sim[1], 1e-6, 0.0));
    EXPECT_TRUE(test::all_close(on_cuda[2], on_sim[2], 1e-6, 1e-9));
  }
}

TEST(FusionCudaMatchesSim, AddRelu) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const auto inputs = add_relu_inputs();
  auto body = [&](Device& device, Stream& stream) {
    return add_then_relu(device, stream, true, inputs.first, inputs.second);
  };
  expect_same_bits(run_on(*gpu, body), run_on(*sim, body), true);
}

// Max-pool backward's gather, non-overlapping windows included: no arithmetic but `0 + dy`, so the
// same bits.
TEST(FusionCudaMatchesSim, MaxPoolBackwardGather) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  for (const kernels::MaxPoolShape s :
       {kernels::MaxPoolShape{16, 16, 28, 28, 2, 2, 0}, kernels::MaxPoolShape{2, 3, 28, 28, 3, 2, 1}}) {
    const std::size_t in = static_cast<std::size_t>(s.n) * s.c * s.h * s.w;
    const std::size_t out = static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out();
    const auto x = test::random_vector(in, 92), dy = test::random_vector(out, 93);
    auto body = [&](Device& device, Stream& stream) {
      DeviceBuffer dx_in = test::upload(device, stream, x), ddy = test::upload(device, stream, dy);
      DeviceBuffer y = device.allocate(out * 4), dx = device.allocate(in * 4);
      DeviceBuffer argmax = device.allocate(out * sizeof(std::int32_t));
      kernels::maxpool_forward(stream, s, dx_in.as<float>(), y.as<float>(), argmax.as<std::int32_t>());
      kernels::maxpool_backward(stream, s, argmax.as<std::int32_t>(), ddy.as<float>(), dx.as<float>());
      return std::vector<std::vector<float>>{test::download<float>(stream, y), test::download<float>(stream, dx)};
    };
    expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
  }
}

}  // namespace
}  // namespace dp
