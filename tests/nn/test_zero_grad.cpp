// test_zero_grad.cpp — zero_grad as torch's zero_grad(set_to_none=True): it
// enqueues nothing, the next backward writes every parameter gradient (Linear, Conv2d with and
// without bias, BatchNorm fused with its ReLU or not, inside Sequential and Residual containers),
// later backwards accumulate, and whatever reads the gradients before that backward still reads
// zeros. Bit for bit against the fill-then-accumulate steps it replaces.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <gtest/gtest.h>
#include <limits>
#include <memory>
#include <vector>

#include "dp/engines/trainer.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/ops.h"
#include "dp/nn/layers.h"
#include "dp/nn/loss.h"
#include "dp/nn/optim.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;

constexpr int kBatch = 3, kClasses = 5;

// Every layer kind with parameters, containers included: Conv2d with bias, BatchNorm fused with the
// ReLU after it, a residual block (Conv2d without bias, a BatchNorm with no ReLU after it, a 1x1
// shortcut) inside a Sequential, and Linear.
std::unique_ptr<nn::SequentialModel> every_parameter_model(Device& device) {
  nn::Layers body, shortcut, block, layers;
  body.push_back(nn::make_conv2d("conv1", 4, 4, 3, 1, 1, false));
  body.push_back(nn::make_batchnorm2d("bn1", 4));
  shortcut.push_back(nn::make_conv2d("0", 4, 4, 1, 1, 0, false));
  block.push_back(nn::make_residual("0", std::move(body), std::move(shortcut), true));
  layers.push_back(nn::make_conv2d("conv", 2, 4, 3, 1, 1, true));
  layers.push_back(nn::make_batchnorm2d("bn", 4));
  layers.push_back(nn::make_relu("relu"));
  layers.push_back(nn::make_sequential("layer1", std::move(block)));
  layers.push_back(nn::make_maxpool2d("pool", 2, 2));
  layers.push_back(nn::make_flatten("flatten"));
  layers.push_back(nn::make_linear("fc", 4 * 3 * 3, kClasses));
  auto model =
      std::make_unique<nn::SequentialModel>("every", device, std::move(layers), std::vector<std::int64_t>{2, 6, 6});
  model->initialize(5);
  return model;
}

// Same value, and same bits unless both are zeros: a -0.0 gradient stays -0.0 when written, where
// 0.0 + -0.0 gave 0.0 (torch's set_to_none does the same).
::testing::AssertionResult same_values(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " values, expected " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] == 0.0f && want[i] == 0.0f) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << ", expected " << want[i];
  }
  return ::testing::AssertionSuccess();
}

class ZeroGrad : public ::testing::Test {
 protected:
  ZeroGrad()
      : rt_(test::sim_runtime(1)),
        device_(rt_->device(0)),
        stream_(device_.create_stream()),
        model_(every_parameter_model(device_)),
        n_(model_->param_count()),
        x_(test::upload(device_, stream_, test::random_vector(kBatch * 2u * 6 * 6, 1))),
        dy1_(test::upload(device_, stream_, test::random_vector(kBatch * kClasses, 2))),
        dy2_(test::upload(device_, stream_, test::random_vector(kBatch * kClasses, 3))) {
    model_->forward(stream_, x_.as<float>(), kBatch, Mode::train);
  }

  // In stream order (a pageable destination: written when the copy returns).
  std::vector<float> read(const float* device_floats, std::size_t count, const Stream* on = nullptr) {
    std::vector<float> host(count);
    (on ? *on : stream_).copy(host.data(), device_floats, count * sizeof(float));
    return host;
  }
  std::vector<float> grads() { return read(model_->grads_flat(), n_); }
  // What a previous step, or garbage, left in the gradient buffer.
  void poison() {
    const std::vector<float> nan(n_, std::numeric_limits<float>::quiet_NaN());
    stream_.copy(model_->grads_flat(), nan.data(), n_ * sizeof(float));
  }
  std::uint64_t launches() const { return rt_->counters(0).launches; }
  std::vector<float> backward_after_zero_grad(const DeviceBuffer& dy) {
    model_->zero_grad(stream_);
    model_->backward(stream_, dy.as<float>());
    return grads();
  }

  std::unique_ptr<Runtime> rt_;
  Device& device_;
  Stream stream_;
  std::unique_ptr<Model> model_;  // through Model: its backward's default argument
  std::size_t n_;
  DeviceBuffer x_, dy1_, dy2_;
};

TEST_F(ZeroGrad, FirstBackwardWritesWhatAFillAndAnAccumulatingBackwardGave) {
  // Before: a fill, then a backward that adds onto the zeros.
  kernels::fill(stream_, model_->grads_flat(), static_cast<index_t>(n_), 0.0f);
  std::uint64_t before = launches();
  model_->backward(stream_, dy1_.as<float>());
  const std::uint64_t accumulating = launches() - before;
  const auto filled = grads();

  // Now: NaN in every gradient, zero_grad (no launch), a backward that writes every one of them,
  // after a forward of its own as the first had (a convolution's backward reuses the input its
  // forward lowered, so each backward is counted after a forward).
  model_->forward(stream_, x_.as<float>(), kBatch, Mode::train);
  poison();
  before = launches();
  model_->zero_grad(stream_);
  EXPECT_EQ(launches(), before) << "zero_grad enqueues nothing";
  model_->backward(stream_, dy1_.as<float>());
  EXPECT_EQ(launches() - before, accumulating) << "the writing backward has no fill of its own";
  const auto written = grads();
  for (std::size_t i = 0; i < n_; ++i) {
    if (std::isnan(written[i])) {
      ADD_FAILURE() << "gradient " << i << " kept the NaN it held: a parameter gradient was not written";
      break;
    }
  }
  EXPECT_TRUE(same_values(written, filled));
  for (float g : filled) {
    if (g != 0.0f) return;  // the comparison above compared something
  }
  FAIL() << "every gradient is zero";
}

TEST_F(ZeroGrad, BackwardsWithoutZeroGradAccumulate) {
  const auto g1 = backward_after_zero_grad(dy1_);
  const auto g2 = backward_after_zero_grad(dy2_);
  poison();
  model_->zero_grad(stream_);
  model_->backward(stream_, dy1_.as<float>());  // writes g1
  model_->backward(stream_, dy2_.as<float>());  // adds g2: the same sums, stored with one more add
  const auto sum = grads();
  std::vector<float> want(n_);
  for (std::size_t i = 0; i < n_; ++i) want[i] = g1[i] + g2[i];
  // Per parameter, so a failure names the layer (every kind: conv with and without bias, both
  // BatchNorms, the shortcut, Linear).
  for (const TensorRef& p : model_->parameters()) {
    SCOPED_TRACE(p.name);
    const auto at = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(p.offset),
                                v.begin() + static_cast<std::ptrdiff_t>(p.offset + p.numel()));
    };
    EXPECT_TRUE(same_values(at(sum), at(want)));
    EXPECT_FALSE(same_values(at(sum), at(g2))) << "the second backward overwrote the first";
  }
  // And a zero_grad in between starts over: g2 alone, whatever the buffer held.
  EXPECT_TRUE(same_values(backward_after_zero_grad(dy2_), g2));
}

TEST_F(ZeroGrad, GradientsReadBeforeTheBackwardAreZeros) {
  const auto g1 = backward_after_zero_grad(dy1_);
  model_->zero_grad(stream_);
  stream_.synchronize();
  // Views taken after a synchronize and read on another stream: the zeros are already there.
  const Stream other = device_.create_stream();
  for (const TensorRef& g : model_->gradients()) {
    SCOPED_TRACE(g.name);
    EXPECT_TRUE(same_values(read(g.as<float>(), g.numel(), &other), std::vector<float>(g.numel(), 0.0f)));
  }
  // The zeros are in memory now: the next backward adds onto them, as after a fill.
  model_->backward(stream_, dy1_.as<float>());
  EXPECT_TRUE(same_values(grads(), g1));

  // grads_address() (what DDP's reducer takes before the backward) fills nothing: the backward
  // after it still writes, over whatever the buffer held.
  backward_after_zero_grad(dy1_);
  poison();
  model_->zero_grad(stream_);
  const std::uint64_t untouched = launches();
  EXPECT_EQ(model_->grads_address(), model_->grads_address());
  EXPECT_EQ(launches(), untouched) << "no fill";
  model_->backward(stream_, dy1_.as<float>());
  EXPECT_TRUE(same_values(grads(), g1)) << "written, not added to the poison";

  // grads_flat() before the backward enqueues the fill, once.
  model_->zero_grad(stream_);
  const std::uint64_t before = launches();
  float* flat = model_->grads_flat();
  EXPECT_EQ(launches(), before + 1) << "the pending fill";
  EXPECT_EQ(model_->grads_flat(), flat);
  EXPECT_EQ(launches(), before + 1) << "filled once";
  EXPECT_TRUE(same_values(read(flat, n_), std::vector<float>(n_, 0.0f)));
  model_->backward(stream_, dy1_.as<float>());
  EXPECT_TRUE(same_values(grads(), g1));
}

TEST_F(ZeroGrad, AnOptimizerStepAfterZeroGradWithoutBackwardSeesZeros) {
  backward_after_zero_grad(dy1_);
  poison();  // stale values a step must not see
  model_->zero_grad(stream_);
  const auto params = read(model_->params_flat(), n_);
  Sgd sgd(device_, n_, SgdOptions{0.1f, 0.0f, 0.0f, false});
  sgd.step(stream_, model_->params_flat(), model_->grads_flat());
  EXPECT_TRUE(same_values(read(model_->params_flat(), n_), params)) << "p - lr * 0 is p";
}

TEST_F(ZeroGrad, AFailedBackwardLeavesTheZerosPending) {
  backward_after_zero_grad(dy1_);
  model_->forward(stream_, x_.as<float>(), kBatch, Mode::eval);  // backward now has nothing to go back through
  poison();
  model_->zero_grad(stream_);
  EXPECT_THROW(model_->backward(stream_, dy1_.as<float>()), InvalidArgument);
  EXPECT_TRUE(same_values(grads(), std::vector<float>(n_, 0.0f)));
}

TEST_F(ZeroGrad, ZeroGradOnAnotherDevicesStreamIsRefused) {
  auto two = test::sim_runtime(2);
  auto model = every_parameter_model(two->device(0));
  EXPECT_THROW(model->zero_grad(two->device(1).create_stream()), DeviceMismatch);
}

// Training with the trainer (zero_grad as a flag, eagerly and with graphs) gives the bits of the
// steps it replaced: fill the gradients, a backward that accumulates onto them, the optimizer.
TEST_F(ZeroGrad, TrainingEqualsTheFillAndAccumulateStepsBitForBit) {
  const int steps = 4;
  const SgdOptions options{0.05f, 0.9f, 1e-3f, false};
  const auto inputs = test::random_vector(kBatch * 2u * 6 * 6 * steps, 7, 0.0f, 1.0f);
  const auto targets = test::random_targets(kBatch * steps, kClasses, 8);
  const std::size_t floats = kBatch * 2u * 6 * 6;

  std::unique_ptr<Model> reference = every_parameter_model(device_);
  {
    Sgd sgd(device_, n_, options);
    CrossEntropyLoss loss(device_);
    DeviceBuffer dlogits = device_.allocate(kBatch * kClasses * sizeof(float));
    for (int k = 0; k < steps; ++k) {
      DeviceBuffer x = test::upload(device_, stream_,
                                    std::vector<float>(inputs.begin() + static_cast<std::ptrdiff_t>(k * floats),
                                                       inputs.begin() + static_cast<std::ptrdiff_t>((k + 1) * floats)));
      DeviceBuffer y =
          test::upload(device_, stream_,
                       std::vector<std::int64_t>(targets.begin() + k * kBatch, targets.begin() + (k + 1) * kBatch));
      const float* logits = reference->forward(stream_, x.as<float>(), kBatch, Mode::train);
      loss.forward_backward(stream_, logits, y.as<std::int64_t>(), kBatch, kClasses, dlogits.as<float>(), kBatch);
      kernels::fill(stream_, reference->grads_flat(), static_cast<index_t>(n_), 0.0f);
      reference->backward(stream_, dlogits.as<float>());  // no zero_grad: adds onto the fill
      sgd.step(stream_, reference->params_flat(), reference->grads_flat());
    }
  }
  const auto want_params = read(reference->params_flat(), n_);
  const auto want_grads = read(reference->grads_flat(), n_);
  // Running statistics and (as two floats' bits) the batch counts: BatchNorm's buffers.
  const auto want_buffers = read(static_cast<const float*>(reference->buffers_flat()), reference->buffers_bytes() / 4);

  for (const bool graphs : {false, true}) {
    SCOPED_TRACE(graphs ? "graphs" : "eager");
    auto model = every_parameter_model(device_);
    {
      SingleDeviceTrainer trainer(*model, options, {}, graphs);
      for (int k = 0; k < steps; ++k)
        trainer.train_step(inputs.data() + k * floats, targets.data() + k * kBatch, kBatch);
      trainer.synchronize();
    }
    EXPECT_TRUE(same_values(read(model->params_flat(), n_), want_params));
    EXPECT_TRUE(same_values(read(model->grads_flat(), n_), want_grads));
    EXPECT_TRUE(same_values(read(static_cast<const float*>(model->buffers_flat()), want_buffers.size()), want_buffers));
  }
}

// The kernels on their own: an empty batch writes zero gradients, or leaves them when accumulating.
TEST_F(ZeroGrad, ConvBackwardOfAnEmptyBatchWritesZeros) {
  const kernels::Conv2dShape s{0, 2, 5, 5, 3, 3, 3, 1, 1};
  const index_t w = 3 * 2 * 3 * 3;
  DeviceBuffer x = device_.allocate(4), weight = test::upload(device_, stream_, test::random_vector(w, 9));
  DeviceBuffer dy = device_.allocate(4), workspace = device_.allocate(4);
  for (const bool accumulate : {true, false}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "write");
    DeviceBuffer dweight = test::upload(device_, stream_, std::vector<float>(w, 2.0f));
    DeviceBuffer dbias = test::upload(device_, stream_, std::vector<float>(3, 2.0f));
    kernels::conv2d_backward(stream_, s, x.as<float>(), weight.as<float>(), dy.as<float>(), nullptr,
                             dweight.as<float>(), dbias.as<float>(), workspace.as<float>(), accumulate);
    const float want = accumulate ? 2.0f : 0.0f;
    EXPECT_TRUE(same_values(read(dweight.as<float>(), w), std::vector<float>(w, want)));
    EXPECT_TRUE(same_values(read(dbias.as<float>(), 3), std::vector<float>(3, want)));
  }
}

}  // namespace
}  // namespace dp
