// test_amp.cpp — bf16 autocast (Model::set_autocast, EngineOptions::amp) against PyTorch's CPU
// autocast: the MLP, the ConvNet and ResNet-8, one step from the same parameters, single, dp and ddp
// (tests/golden/make_amp_goldens.py); the autocast kernels' bits on every backend; what autocast
// keeps in bf16.
#include <bit>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <gtest/gtest.h>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/ops.h"
#include "dp/models/convnet.h"
#include "dp/models/mlp.h"
#include "dp/models/resnet.h"
#include "dp/nn/layers.h"
#include "dp/nn/loss.h"
#include "dp/nn/sequential.h"
#include "dp/runtime/bfloat16.h"
#include "forwarding_model.h"
#include "golden_model.h"
#include "test_util.h"

namespace dp {
namespace {

double norm(const std::vector<float>& a) {
  double s = 0.0;
  for (float v : a) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}
double distance(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    s += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
  return std::sqrt(s);
}

// The tolerance. dp and torch round to bf16 at the same places (every Linear/Conv2d output,
// BatchNorm, pooling and residual outputs, every gradient of a bf16 tensor) and multiply the same
// bf16 values exactly; only their fp32 summation orders differ, which moves a sum by a few fp32
// ulps (2^-24 relative) and so flips its bf16 rounding (one bf16 ulp: 2^-7 relative, bf16 having an
// 8-bit significand) only for the rare sum that lies that close to a rounding boundary. The MLP's
// and the ConvNet's logits come out bit for bit torch's, and so do most of their gradients. Two
// things move the rest:
//  - torch's CPU kernels are not all "accumulate in fp32, round once" (what cuBLAS, cuDNN and dp
//    do): its small bf16 GEMMs (the MLP's 17 -> 10 layer) round other intermediates, and its bf16
//    sums over a batch too: up to ~0.7% of a gradient's norm, as far as fp32 is from bf16 there;
//  - a deep net amplifies each flip: one bf16 ulp into a 3x3 convolution moves 144 sums, some of
//    which flip in turn; through ResNet-8's seven convolutions the few flips of the first BatchNorm
//    grow to differences of ~10% of a gradient's norm (measured: at most 11.8%), about half of the
//    distance between torch's fp32 and bf16 gradients. Block by block from torch's own inputs and
//    gradients (AmpTeacherForced below) the same gradients agree to 2^-9.
// Hence, per tensor, relative to its norm: 2^-6 for the MLP and the ConvNet and 2^-2 for ResNet-8;
// a tensor whose value is rounding noise (a convolution bias before BatchNorm, zero in exact
// arithmetic: torch's fp32 and bf16 values differ by as much as the value) to half of that noise.
// And to show that the result is bf16's and not fp32's: the logits are closer to torch's bf16 ones
// than torch's fp32 ones are, and so are all the gradients together, by at least a factor 0.75
// (ConvNet, ResNet-8).
double tolerance(const std::string& model) { return model == "amp_resnet8" ? 1.0 / 4 : 1.0 / 64; }

::testing::AssertionResult close_in_norm(const std::vector<float>& got, const std::vector<float>& want,
                                         double allowed) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  const double d = distance(got, want);
  if (d <= allowed + 1e-7) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "|got - want| = " << d << " > " << allowed << " (|want| = " << norm(want)
                                       << ")";
}

std::vector<float> slice(const std::vector<float>& v, std::size_t begin, std::size_t count) {
  return {v.begin() + static_cast<std::ptrdiff_t>(begin), v.begin() + static_cast<std::ptrdiff_t>(begin + count)};
}

// The model's train-mode logits of samples [begin, begin + count) of the golden's input (a fresh
// forward: BatchNorm normalises with those samples' statistics).
std::vector<float> logits(Model& model, const Stream& stream, const std::vector<float>& x, int begin, int count) {
  const std::size_t per_sample = x.size() / 8;
  const DeviceBuffer input = test::upload(
      model.device(), stream,
      slice(x, static_cast<std::size_t>(begin) * per_sample, static_cast<std::size_t>(count) * per_sample));
  const float* out = model.forward(stream, input.as<float>(), count, Mode::train);
  return test::to_host(stream, out, static_cast<std::size_t>(count) * 10);
}

using AmpCase = std::tuple<std::string, EngineKind>;
class AmpGolden : public ::testing::TestWithParam<AmpCase> {};

TEST_P(AmpGolden, OneStepMatchesTorchAutocast) {
  const auto& [name, kind] = GetParam();
  const auto golden = safetensors::read(test::golden_path(name));
  const int batch = std::stoi(golden.metadata.at("batch"));
  ASSERT_EQ(batch, 8);
  const std::string mode = std::string(to_string(kind));
  auto rt = test::sim_runtime(2);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  auto model = test::golden_model(golden, device);
  load_state_dict(*model, stream, golden, "init.");
  const auto x = golden.at("data.input").to_f32();
  const auto y = golden.at("data.target").to_i64();

  // The logits, at the model: the whole batch (single), or each half as a replica sees it.
  {
    auto probe = model->replicate(device);
    load_state_dict(*probe, stream, golden, "init.");
    probe->set_autocast(Autocast::bf16);
    std::vector<float> got = logits(*probe, stream, x, 0, batch / 2 * (kind == EngineKind::single ? 2 : 1));
    if (kind != EngineKind::single) {
      const auto second = logits(*probe, stream, x, batch / 2, batch / 2);
      got.insert(got.end(), second.begin(), second.end());
    }
    const auto want = golden.at(mode + ".output").to_f32();
    EXPECT_TRUE(close_in_norm(got, want, norm(want) / 32)) << "logits";
    if (kind == EngineKind::single) {
      const auto fp32 = golden.at("fp32.output").to_f32();
      EXPECT_LT(distance(got, want), distance(fp32, want)) << "dp's autocast logits are closer to torch's fp32";
    }
  }

  // One engine step: loss, the gradients (DP: reduced onto the source; DDP: averaged), the update.
  OptimizerOptions sgd = SgdOptions{std::stof(golden.metadata.at("lr")), std::stof(golden.metadata.at("momentum")),
                                    std::stof(golden.metadata.at("weight_decay")), false};
  EngineOptions options;
  options.kind = kind;
  options.amp = Autocast::bf16;
  if (kind != EngineKind::single) options.device_ids = std::vector<int>{0, 1};
  auto engine = make_engine(*rt, *model, sgd, options);
  float loss = 0.0f;
  if (kind == EngineKind::ddp) {
    const Batch batches[] = {Batch{x.data(), y.data(), 4}, Batch{x.data() + 4 * 784, y.data() + 4, 4}};
    loss = engine->train_step(batches);
    const auto want = golden.at("ddp.loss").to_f32();
    EXPECT_NEAR(loss, (want[0] + want[1]) / 2, 2e-2 * std::fabs(want[0] + want[1]) / 2) << "loss";
  } else {
    const Batch batches[] = {Batch{x.data(), y.data(), batch}};
    loss = engine->train_step(batches);
    const float want = golden.at(mode + ".loss").to_f32()[0];
    EXPECT_NEAR(loss, want, 2e-2 * std::fabs(want)) << "loss";
  }
  engine->synchronize();
  Model& trained = engine->model();
  const Stream s = trained.device().create_stream();
  double squared = 0.0, fp32_squared = 0.0;
  for (const TensorRef& g : trained.gradients()) {
    const auto got = test::to_host(s, g.as<float>(), g.numel());
    const auto want = golden.at(mode + ".grad." + g.name).to_f32();
    // How far torch's fp32 gradient is from its bf16 one (single: the whole batch's).
    const double noise =
        distance(golden.at("fp32.grad." + g.name).to_f32(), golden.at("single.grad." + g.name).to_f32());
    EXPECT_TRUE(close_in_norm(got, want, std::max(tolerance(name) * norm(want), noise / 2)))
        << "gradient of " << g.name;
    squared += distance(got, want) * distance(got, want);
    fp32_squared += noise * noise;
  }
  // (Not for the MLP: torch's small-GEMM rounding, as large as bf16's own effect there, sets it
  // apart; its logits, bit for bit torch's, say bf16.)
  if (name != "amp_mlp") {
    EXPECT_LT(std::sqrt(squared), 0.75 * std::sqrt(fp32_squared))
        << "the gradients are not closer to bf16's than fp32's";
  }
  if (kind == EngineKind::single) {
    // The fp32 master weights after SGD: within the gradients' tolerance times the step.
    for (const TensorRef& p : trained.parameters()) {
      const auto got = test::to_host(s, p.as<float>(), p.numel());
      const auto want = golden.at("after." + p.name).to_f32();
      const auto init = golden.at("init." + p.name).to_f32();
      std::vector<float> step_got(got.size()), step_want(got.size());
      for (std::size_t i = 0; i < got.size(); ++i) step_got[i] = got[i] - init[i], step_want[i] = want[i] - init[i];
      const double noise =
          distance(golden.at("fp32.grad." + p.name).to_f32(), golden.at("single.grad." + p.name).to_f32());
      // The first SGD step is lr * (gradient + weight_decay * parameter): the gradient's tolerance.
      EXPECT_TRUE(close_in_norm(step_got, step_want,
                                std::max(tolerance(name) * norm(step_want), 0.05 * noise / 2 + 1e-3 * norm(step_want))))
          << "update of " << p.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, AmpGolden,
                         ::testing::Combine(::testing::Values("amp_mlp", "amp_convnet", "amp_resnet8"),
                                            ::testing::Values(EngineKind::single, EngineKind::dp, EngineKind::ddp)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::string(to_string(std::get<1>(info.param)));
                         });

// One block of ResNet-8 as a model of its own, its layers named as make_resnet8 names them.
std::unique_ptr<Model> resnet8_block(Device& device, const std::string& block) {
  using namespace nn;
  Layers layers;
  std::vector<std::int64_t> shape;
  if (block == "stem") {
    layers.push_back(make_conv2d("conv1", 1, 16, 3, 1, 1, false));
    layers.push_back(make_batchnorm2d("bn1", 16));
    layers.push_back(make_relu("relu"));
    shape = {1, 28, 28};
  } else if (block == "head") {
    layers.push_back(make_global_avgpool2d("avgpool"));
    layers.push_back(make_flatten("flatten"));
    layers.push_back(make_linear("fc", 64, 10));
    shape = {64, 7, 7};
  } else {
    const int index = block.back() - '0';
    const int in = index == 1 ? 16 : 16 << (index - 2), out = 16 << (index - 1), stride = index == 1 ? 1 : 2;
    const int side = index == 3 ? 14 : 28;
    Layers body, shortcut;
    body.push_back(make_conv2d("conv1", in, out, 3, stride, 1, false));
    body.push_back(make_batchnorm2d("bn1", out));
    body.push_back(make_relu("relu"));
    body.push_back(make_conv2d("conv2", out, out, 3, 1, 1, false));
    body.push_back(make_batchnorm2d("bn2", out));
    if (stride != 1) {
      shortcut.push_back(make_conv2d("downsample.0", in, out, 1, stride, 0, false));
      shortcut.push_back(make_batchnorm2d("downsample.1", out));
    }
    layers.push_back(make_residual(block + ".0", std::move(body), std::move(shortcut)));
    shape = {in, side, side};
  }
  return std::make_unique<SequentialModel>(block, device, std::move(layers), shape);
}

// ResNet-8 block by block, each from torch's own input and output gradient (teacher-forced), so
// that no difference of an earlier block reaches it: a block's output and its parameters' gradients
// can then differ from torch's only by the block's own summation orders, whose rare flips its 2 to 4
// convolutions do not amplify much (compare the 2^-2 of the whole model, above). Bound, per tensor
// relative to its norm: 2^-9, what one-ulp flips (2^-7 relative each) of up to 1/16 of the elements
// give (2^-7 * sqrt(1/16)); measured at most 5.9e-4 (layer2.0.conv1.weight), the head exact. And at
// least 99% of every block's outputs equal torch's bit for bit.
TEST(AmpTeacherForced, ResNet8BlocksMatchTorchAutocast) {
  const auto golden = safetensors::read(test::golden_path("amp_resnet8"));
  auto rt = test::sim_runtime(1);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  for (const std::string block : {"stem", "layer1", "layer2", "layer3", "head"}) {
    SCOPED_TRACE(block);
    auto model = resnet8_block(device, block);
    for (const TensorRef& p : model->parameters()) {
      const auto values = golden.at("init." + p.name).to_f32();
      stream.copy(p.data, values.data(), p.bytes());
    }
    model->set_autocast(Autocast::bf16);
    const std::string tf = "tf." + block + ".";
    const auto x = golden.at(tf + "input").to_f32();
    const DeviceBuffer input = test::upload(device, stream, x);
    const auto want = golden.at(tf + "output").to_f32();
    const auto got = test::to_host(stream, model->forward(stream, input.as<float>(), 8, Mode::train), want.size());
    std::size_t equal = 0;
    for (std::size_t i = 0; i < got.size(); ++i) equal += got[i] == want[i];
    EXPECT_GE(static_cast<double>(equal), 0.99 * static_cast<double>(got.size())) << "outputs equal to torch's";
    EXPECT_TRUE(close_in_norm(got, want, norm(want) / 512)) << "output";
    const DeviceBuffer grad = test::upload(device, stream, golden.at(tf + "grad_output").to_f32());
    model->zero_grad(stream);
    model->backward(stream, grad.as<float>());
    for (const TensorRef& g : model->gradients()) {
      const auto mine = test::to_host(stream, g.as<float>(), g.numel());
      const auto theirs = golden.at("single.grad." + g.name).to_f32();
      EXPECT_TRUE(close_in_norm(mine, theirs, norm(theirs) / 512)) << "gradient of " << g.name;
    }
  }
}

// What autocast keeps: bf16 logits (every value a bf16 value, widened), bf16-rounded parameter
// gradients for Linear and Conv2d, fp32 ones for BatchNorm, and half the saved activation bytes.
TEST(Autocast, KeepsTheActivationsInBf16AndTheMasterWeightsInFp32) {
  auto rt = test::sim_runtime(1);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  auto model = models::make_convnet(device, 3);
  const int batch = 16;
  const auto x = test::random_vector(static_cast<std::size_t>(batch) * 784, 5, 0.0f, 1.0f);
  const DeviceBuffer input = test::upload(device, stream, x);
  model->forward(stream, input.as<float>(), batch, Mode::train);
  const std::size_t fp32_bytes = model->saved_activation_bytes();
  model->set_autocast(Autocast::bf16);
  EXPECT_EQ(model->replicate(device)->autocast(), Autocast::bf16) << "a replica keeps autocast";
  const float* out = model->forward(stream, input.as<float>(), batch, Mode::train);
  const std::size_t bf16_bytes = model->saved_activation_bytes();
  EXPECT_GT(fp32_bytes, 0u);
  // The activations halve; max-pool's int32 indices (16x14x14 and 32x7x7 per sample) and
  // BatchNorm's fp32 statistics stay as they are.
  const double indices = batch * (16 * 14 * 14 + 32 * 7 * 7) * 4.0, statistics = 4.0 * (16 + 32) * 4.0;
  EXPECT_GT(static_cast<double>(bf16_bytes), 0.5 * static_cast<double>(fp32_bytes)) << bf16_bytes << " " << fp32_bytes;
  EXPECT_EQ(static_cast<double>(bf16_bytes), 0.5 * (static_cast<double>(fp32_bytes) + indices + statistics))
      << bf16_bytes << " " << fp32_bytes;
  for (float v : test::to_host(stream, out, static_cast<std::size_t>(batch) * 10))
    ASSERT_EQ(bf16_to_float(bf16_from_float(v)), v) << "a logit that is not a bf16 value";
  std::vector<float> dlogits(static_cast<std::size_t>(batch) * 10, 0.01f);
  const DeviceBuffer d = test::upload(device, stream, dlogits);
  model->zero_grad(stream);
  model->backward(stream, d.as<float>());
  for (const TensorRef& g : model->gradients()) {
    const auto values = test::to_host(stream, g.as<float>(), g.numel());
    bool all_bf16 = true;
    for (float v : values) all_bf16 = all_bf16 && bf16_to_float(bf16_from_float(v)) == v;
    const bool autocast_layer = g.name.find(".1.") == std::string::npos;  // layerK.1 is BatchNorm
    if (autocast_layer)
      EXPECT_TRUE(all_bf16) << g.name << ": a Linear/Conv2d gradient is a widened bf16 one";
    else
      EXPECT_FALSE(all_bf16) << g.name << ": BatchNorm's gradients are fp32";
  }
  model->set_autocast(Autocast::off);
  EXPECT_EQ(model->autocast(), Autocast::off);
}

// torch's two adds under autocast: torchvision's in-place `out += identity` keeps the body's bf16;
// nanoGPT's `x + f(x)` promotes to fp32 when x is fp32. x (fp32) + Linear(x) (bf16): promoted, the
// output is the fp32 sum of x and the bf16 branch widened (not a bf16 value) and the branch's
// gradient is the output gradient rounded to bf16 (the cast's backward); in place, the output is
// the sum rounded to bf16.
TEST(Autocast, AResidualAddPromotesOrKeepsTheBodysDtypeAsTorchsAddsDo) {
  auto rt = test::sim_runtime(1);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  const int batch = 4, width = 8;
  const auto x = test::random_vector(static_cast<std::size_t>(batch) * width, 7);
  const DeviceBuffer input = test::upload(device, stream, x);
  std::vector<float> outputs[2], grads[2];
  for (const nn::ResidualAdd add : {nn::ResidualAdd::in_place, nn::ResidualAdd::promote}) {
    nn::Layers body, layers;
    body.push_back(nn::make_linear("fc", width, width));
    layers.push_back(nn::make_residual("res", std::move(body), {}, false, add));
    nn::SequentialModel model("res", device, std::move(layers), {width, 1, 1});
    model.initialize(5);  // the same weights in both models
    model.set_autocast(Autocast::bf16);
    const float* out = model.forward(stream, input.as<float>(), batch, Mode::train);
    const auto k = static_cast<std::size_t>(add == nn::ResidualAdd::promote);
    outputs[k] = test::to_host(stream, out, x.size());
    std::vector<float> dy(x.size());
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.1f + 1e-3f * static_cast<float>(i);  // not bf16 values
    const DeviceBuffer d = test::upload(device, stream, dy);
    model.zero_grad(stream);
    model.backward(stream, d.as<float>(), {});
    grads[k] = test::to_host(stream, model.gradients()[1].as<float>(), width);  // fc.bias: the summed dy
    if (add == nn::ResidualAdd::promote) {
      bool all_bf16 = true;
      for (float v : outputs[k]) all_bf16 = all_bf16 && bf16_to_float(bf16_from_float(v)) == v;
      EXPECT_FALSE(all_bf16) << "promoted: the sum is fp32";
    } else {
      for (float v : outputs[k]) ASSERT_EQ(bf16_to_float(bf16_from_float(v)), v) << "in place: the sum is bf16";
    }
  }
  // The same sums, one rounded to bf16.
  for (std::size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(outputs[0][i], bf16_to_float(bf16_from_float(outputs[1][i]))) << i;
  // Either way the branch's gradient is dy rounded to bf16: in place the model's bf16 output rounds
  // it (the backward of `logits.float()`), promoted the add's cast does: the same gradients.
  EXPECT_EQ(grads[0], grads[1]);
}

// A model that does not implement autocast (Model's default) is refused by make_engine, naming it,
// before anything is built; fp32 it trains.
TEST(Autocast, AModelWithoutItIsRefused) {
  struct Fp32Only : test::ForwardingModel {
    using ForwardingModel::ForwardingModel;
    void set_autocast(Autocast autocast) override { Model::set_autocast(autocast); }
    Autocast autocast() const override { return Model::autocast(); }
    std::unique_ptr<Model> replicate(Device& device) const override {
      return std::make_unique<Fp32Only>(inner().replicate(device));
    }
  };
  auto rt = test::sim_runtime(1);
  Fp32Only model(models::make_mlp(rt->device(0), {8}, 1));
  EngineOptions options;
  options.amp = Autocast::bf16;
  try {
    make_engine(*rt, model, SgdOptions{0.1f}, options);
    FAIL() << "autocast accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("does not support autocast bf16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(model.name()), std::string::npos) << e.what();
  }
  options.amp = Autocast::off;
  EXPECT_NO_THROW(make_engine(*rt, model, SgdOptions{0.1f}, options));
}

TEST(Autocast, NamesAndRefusals) {
  EXPECT_EQ(parse_autocast("bf16"), Autocast::bf16);
  EXPECT_EQ(parse_autocast("off"), Autocast::off);
  EXPECT_EQ(to_string(Autocast::bf16), "bf16");
  try {
    parse_autocast("fp16");
    FAIL() << "fp16 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'fp16'"), std::string::npos) << e.what();
  }
}

// The autocast kernels give the shared functors' bits on the device.
class AutocastOnBackend : public test::BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, AutocastOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(AutocastOnBackend, ConversionKernelsGiveTheHostBits) {
  std::vector<float> x = test::random_vector(4099, 11, -10.0f, 10.0f);
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = std::numeric_limits<float>::infinity();
  x[2] = 3.0e38f;
  x[3] = 1.0e-40f;
  x[4] = 1.00390625f;  // 1 + 2^-8: a tie, to even
  const std::vector<float> base = test::random_vector(x.size(), 12, -1.0f, 1.0f);
  const auto n = static_cast<kernels::index_t>(x.size());
  const DeviceBuffer in = up(x);
  DeviceBuffer bits = device_->allocate(x.size() * sizeof(std::uint16_t));
  DeviceBuffer rounded = floats(x.size());
  DeviceBuffer sum = up(base), written = floats(x.size());
  kernels::to_bf16(stream_, n, in.as<float>(), bits.as<std::uint16_t>());
  kernels::round_to_bf16(stream_, n, in.as<float>(), rounded.as<float>());
  kernels::add_bf16_rounded(stream_, n, in.as<float>(), sum.as<float>(), true);
  kernels::add_bf16_rounded(stream_, n, in.as<float>(), written.as<float>(), false);
  const auto got_bits = down<std::uint16_t>(bits);
  const auto got_rounded = down<float>(rounded), got_sum = down<float>(sum), got_written = down<float>(written);
  const auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; };
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t want = bf16_from_float(x[i]);
    ASSERT_EQ(got_bits[i], want) << i << ": " << x[i];
    ASSERT_TRUE(same(got_rounded[i], bf16_to_float(want))) << i;
    ASSERT_TRUE(same(got_written[i], bf16_to_float(want))) << i;
    if (i == 0)  // NaN: its payload is the device's
      ASSERT_TRUE(std::isnan(got_sum[i]));
    else
      ASSERT_TRUE(same(got_sum[i], base[i] + bf16_to_float(want))) << i;
  }
  EXPECT_EQ(got_bits[4], 0x3f80u);
}

// Under autocast a transformer's residual stream is fp32 and each branch ends in a bf16 Linear, so
// the stream's gradient is rounded to bf16 once per branch (the cast's backward). The LayerNorm
// that writes that gradient (the next branch's first layer, or ln_f) writes the rounding with it:
// no separate cast in the backward, and the bits of the model whose blocks a Dropout(0) separates
// (an exact identity that asks for no copy, so every branch rounds the gradient itself).
class StreamGradientCopy : public AutocastOnBackend {
 protected:
  static constexpr int kBatch = 2, kTokens = 5, kWidth = 16, kClasses = 7;
  // The model `layers(separated)` gives, under autocast, fp32 tokens in.
  std::unique_ptr<nn::SequentialModel> model(nn::Layers layers) {
    auto m = std::make_unique<nn::SequentialModel>("stream", *device_, std::move(layers),
                                                   std::vector<std::int64_t>{kTokens, 1, kWidth});
    m->set_autocast(Autocast::bf16);
    return m;
  }
  // A pre-LayerNorm residual branch: x + Linear(LayerNorm(x)).
  static std::unique_ptr<nn::Layer> branch(const std::string& name) {
    nn::Layers body;
    body.push_back(nn::make_layernorm(name + ".ln", kWidth));
    body.push_back(nn::make_linear(name + ".fc", kWidth, kWidth));
    return nn::make_residual(name, std::move(body), {}, false, nn::ResidualAdd::promote);
  }
  // One backward of each from the same parameters: every gradient bit for bit the same; returns the
  // casts (to_bf16 launches) each backward made.
  std::pair<std::uint64_t, std::uint64_t> expect_same_gradients(const std::function<nn::Layers(bool)>& layers) {
    const auto x = test::random_vector(static_cast<std::size_t>(kBatch) * kTokens * kWidth, 31, -2.0f, 2.0f);
    const auto dy = test::random_vector(static_cast<std::size_t>(kBatch) * kTokens * kClasses, 32);
    const DeviceBuffer input = up(x), grad_output = up(dy);
    auto fused = model(layers(false)), apart = model(layers(true));
    EXPECT_EQ(fused->param_count(), apart->param_count());
    fused->initialize(3);
    stream_.copy(apart->params_flat(), fused->params_flat(), fused->param_count() * sizeof(float));
    std::vector<float> grads[2];
    std::uint64_t casts[2] = {0, 0};
    nn::SequentialModel* models[2] = {fused.get(), apart.get()};
    for (int k = 0; k < 2; ++k) {
      models[k]->forward(stream_, input.as<float>(), kBatch, Mode::train);
      models[k]->zero_grad(stream_);
      (void)traffic();
      runtime_->reset_memory_traffic();
      models[k]->backward(stream_, grad_output.as<float>(), {});
      const auto t = traffic();
      casts[k] = t.contains("to_bf16") ? t.at("to_bf16").second : 0;
      grads[k] = test::to_host(stream_, models[k]->grads_flat(), models[k]->param_count());
    }
    for (std::size_t i = 0; i < grads[0].size(); ++i)
      if (std::bit_cast<std::uint32_t>(grads[0][i]) != std::bit_cast<std::uint32_t>(grads[1][i])) {
        ADD_FAILURE() << "gradient element " << i << ": " << grads[0][i] << " against " << grads[1][i];
        break;
      }
    return {casts[0], casts[1]};
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, StreamGradientCopy, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// Two GPT blocks (attention's place taken by a Linear), ln_f and a head.
TEST_P(StreamGradientCopy, TheStreamsGradientIsRoundedWhereItIsWritten) {
  const auto [fused, apart] = expect_same_gradients([](bool separated) {
    nn::Layers layers;
    for (int b = 0; b < 2; ++b) {
      nn::Layers mlp, branches;
      mlp.push_back(nn::make_layernorm("ln_2", kWidth));
      mlp.push_back(nn::make_linear("mlp.c_fc", kWidth, 4 * kWidth));
      mlp.push_back(nn::make_gelu("mlp.gelu"));
      mlp.push_back(nn::make_linear("mlp.c_proj", 4 * kWidth, kWidth));
      branches.push_back(branch("attn"));
      if (separated) branches.push_back(nn::make_dropout("apart", 0.0));
      branches.push_back(nn::make_residual("", std::move(mlp), {}, false, nn::ResidualAdd::promote));
      layers.push_back(nn::make_sequential(fmt::format("h.{}", b), std::move(branches)));
      if (separated) layers.push_back(nn::make_dropout(fmt::format("apart.{}", b), 0.0));
    }
    layers.push_back(nn::make_layernorm("ln_f", kWidth));
    layers.push_back(nn::make_linear("head", kWidth, kClasses));
    return layers;
  });
  // One cast is the head's: its bf16 output's fp32 gradient (the backward of `logits.float()`).
  EXPECT_EQ(fused, 1u) << "every rounding of the stream's gradient made where it is written";
  EXPECT_EQ(apart, 5u) << "the separated model: each of its four branches rounds its own";
}

// A residual whose body holds branches that make copies of their own, and whose projection
// shortcut reads the rounded gradient after its body's backward: each chain's copies are its own.
TEST_P(StreamGradientCopy, ANestedResidualsCopiesLeaveItsOwnAlone) {
  expect_same_gradients([](bool separated) {
    nn::Layers body, shortcut, layers;
    body.push_back(branch("a"));
    body.push_back(branch("b"));
    shortcut.push_back(nn::make_linear("proj", kWidth, kWidth));
    layers.push_back(nn::make_residual("outer", std::move(body), std::move(shortcut), false, nn::ResidualAdd::promote));
    if (separated) layers.push_back(nn::make_dropout("apart", 0.0));
    layers.push_back(branch("c"));
    layers.push_back(nn::make_linear("head", kWidth, kClasses));
    return layers;
  });
}

// Under Bf16Operands a GEMM of bf16 values is their exact products accumulated in fp32: bf16 tensor
// cores on cuda (cublasGemmEx, CUBLAS_COMPUTE_32F_FAST_16BF), OpenBLAS's fp32 GEMM on sim; each
// within fp32 summation error (k * 2^-24 * sum |a b|) of the sum in double, transposed or not.
TEST_P(AutocastOnBackend, Bf16OperandGemmSumsExactProductsInFp32) {
  const int m = 37, n = 53, k = 300;
  const auto bf16_values = [](std::vector<float> v) {
    for (float& x : v) x = bf16_to_float(bf16_from_float(x));
    return v;
  };
  const auto a = bf16_values(test::random_vector(static_cast<std::size_t>(m) * k, 21, -2.0f, 2.0f));
  const auto b = bf16_values(test::random_vector(static_cast<std::size_t>(k) * n, 22, -2.0f, 2.0f));
  const DeviceBuffer da = up(a), db = up(b);
  for (const bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "A and B transposed" : "plain");
    // Transposed, the same buffers are read as A^T (k, m) and B^T (n, k): C = (A^T)^T-shaped below.
    DeviceBuffer c = floats(static_cast<std::size_t>(m) * n);
    {
      const kernels::Bf16Operands tensor_cores;
      if (trans)
        kernels::gemm(stream_, true, true, m, n, k, 1.0f, da.as<float>(), m, db.as<float>(), k, 0.0f, c.as<float>(), n);
      else
        kernels::gemm(stream_, false, false, m, n, k, 1.0f, da.as<float>(), k, db.as<float>(), n, 0.0f, c.as<float>(),
                      n);
    }
    EXPECT_FALSE(kernels::Bf16Operands::active()) << "the scope ends with its object";
    const auto got = down<float>(c);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double sum = 0.0, magnitude = 0.0;
        for (int l = 0; l < k; ++l) {
          const double x = trans ? a[static_cast<std::size_t>(l) * m + i] : a[static_cast<std::size_t>(i) * k + l];
          const double y = trans ? b[static_cast<std::size_t>(j) * k + l] : b[static_cast<std::size_t>(l) * n + j];
          sum += x * y;
          magnitude += std::fabs(x * y);
        }
        ASSERT_NEAR(got[static_cast<std::size_t>(i) * n + j], sum, k * std::ldexp(magnitude, -24) + 1e-30)
            << i << "," << j;
      }
  }
}

// The ConvNet under autocast on this backend against the sim: the sim itself bit for bit; cuda (bf16
// tensor-core GEMMs, its own summation order) within the ConvNet's tolerance above, the
// convolution biases before BatchNorm (rounding noise around 0) aside.
TEST_P(AutocastOnBackend, ConvNetStepMatchesTheSim) {
  auto sim = test::sim_runtime(1);
  const Stream sim_stream = sim->device(0).create_stream();
  auto here = models::make_convnet(*device_, 7);
  auto there = models::make_convnet(sim->device(0), 7);
  here->set_autocast(Autocast::bf16);
  there->set_autocast(Autocast::bf16);
  const int batch = 16;
  const auto x = test::random_vector(static_cast<std::size_t>(batch) * 784, 8, 0.0f, 1.0f);
  const auto dlogits = test::random_vector(static_cast<std::size_t>(batch) * 10, 9, -0.1f, 0.1f);
  const DeviceBuffer x_here = up(x), d_here = up(dlogits);
  const DeviceBuffer x_there = test::upload(sim->device(0), sim_stream, x),
                     d_there = test::upload(sim->device(0), sim_stream, dlogits);
  const auto out_here = test::to_host(stream_, here->forward(stream_, x_here.as<float>(), batch, Mode::train), 160);
  const auto out_there =
      test::to_host(sim_stream, there->forward(sim_stream, x_there.as<float>(), batch, Mode::train), 160);
  const bool exact = GetParam() == "sim";
  if (exact) {
    EXPECT_EQ(out_here, out_there);
  } else {
    EXPECT_TRUE(close_in_norm(out_here, out_there, norm(out_there) / 64)) << "logits";
  }
  here->zero_grad(stream_);
  here->backward(stream_, d_here.as<float>());
  there->zero_grad(sim_stream);
  there->backward(sim_stream, d_there.as<float>());
  const auto grads_there = there->gradients();
  std::size_t i = 0;
  for (const TensorRef& g : here->gradients()) {
    const auto got = test::to_host(stream_, g.as<float>(), g.numel());
    const auto want = test::to_host(sim_stream, grads_there[i++].as<float>(), g.numel());
    if (exact) {
      EXPECT_EQ(got, want) << g.name;
    } else if (g.name != "layer1.0.bias" && g.name != "layer2.0.bias") {
      EXPECT_TRUE(close_in_norm(got, want, norm(want) / 64)) << g.name;
    }
  }
}

// The convolution shapes a library is likeliest to refuse on bf16 storage (one input channel, as the
// ConvNet's first layer; three, as an RGB stem; a 1x1 stride-2 downsample): under autocast each runs
// on this backend, on the library's bf16 path where it says it has one (conv2d_supports_bf16) and
// widened to fp32 where it does not, and gives the sim's output and gradients (the sim's bits on
// the sim; within bf16's rounding of them on cuda).
TEST_P(AutocastOnBackend, ConvolutionsALibraryMayRefuseRunWidenedOrNot) {
  struct Case {
    const char* name;
    int in, out, kernel, stride, pad, side;
  };
  auto sim = test::sim_runtime(1);
  const Stream sim_stream = sim->device(0).create_stream();
  for (const Case c : {Case{"c_in 1, 5x5", 1, 16, 5, 1, 2, 28}, Case{"c_in 3, 3x3", 3, 16, 3, 1, 1, 32},
                       Case{"1x1 stride 2", 16, 32, 1, 2, 0, 14}}) {
    SCOPED_TRACE(c.name);
    const int batch = 4;
    const kernels::Conv2dShape shape{batch, c.in, c.side, c.side, c.out, c.kernel, c.kernel, c.stride, c.pad};
    const auto make = [&](Device& device) {
      nn::Layers layers;
      layers.push_back(nn::make_conv2d("conv", c.in, c.out, c.kernel, c.stride, c.pad));
      auto model = std::make_unique<nn::SequentialModel>("conv", device, std::move(layers),
                                                         std::vector<std::int64_t>{c.in, c.side, c.side});
      model->initialize(3);
      model->set_autocast(Autocast::bf16);
      return model;
    };
    auto here = make(*device_), there = make(sim->device(0));
    const auto in_count = static_cast<std::size_t>(batch) * c.in * c.side * c.side;
    const auto out_count = static_cast<std::size_t>(batch) * c.out * shape.h_out() * shape.w_out();
    const auto x = test::random_vector(in_count, 5, 0.0f, 1.0f), dy = test::random_vector(out_count, 6);
    const DeviceBuffer x_here = up(x), d_here = up(dy);
    const DeviceBuffer x_there = test::upload(sim->device(0), sim_stream, x),
                       d_there = test::upload(sim->device(0), sim_stream, dy);
    const auto y_here =
        test::to_host(stream_, here->forward(stream_, x_here.as<float>(), batch, Mode::train), out_count);
    const auto y_there =
        test::to_host(sim_stream, there->forward(sim_stream, x_there.as<float>(), batch, Mode::train), out_count);
    here->zero_grad(stream_);
    here->backward(stream_, d_here.as<float>(), {});
    there->zero_grad(sim_stream);
    there->backward(sim_stream, d_there.as<float>(), {});
    const auto dw_here = test::to_host(stream_, here->gradients()[0].as<float>(), here->gradients()[0].numel());
    const auto dw_there = test::to_host(sim_stream, there->gradients()[0].as<float>(), there->gradients()[0].numel());
    RecordProperty(c.name, kernels::conv2d_supports_bf16(stream_, shape) ? "library bf16" : "widened to fp32");
    if (GetParam() == "sim") {
      EXPECT_EQ(y_here, y_there);
      EXPECT_EQ(dw_here, dw_there);
    } else {
      EXPECT_TRUE(close_in_norm(y_here, y_there, norm(y_there) / 64)) << "output";
      EXPECT_TRUE(close_in_norm(dw_here, dw_there, norm(dw_there) / 64)) << "weight gradient";
    }
  }
}

}  // namespace
}  // namespace dp
