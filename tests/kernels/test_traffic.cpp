// test_traffic.cpp — memory traffic accounting (Runtime::memory_traffic): one Linear and one Conv2d
// layer, forward and backward, counted on each backend as the bytes every launch's operands span,
// each operand once, held to the values worked out by hand below.
#include <gtest/gtest.h>
#include <map>
#include <string>
#include <vector>

#include "dp/kernels/conv2d.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/device.h"
#include "test_util.h"

namespace dp {
namespace {

class TrafficTest : public test::BackendTest {};
INSTANTIATE_TEST_SUITE_P(Backends, TrafficTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(TrafficTest, ALinearLayersStep) {
  const int n = 8, in = 16, out = 4;
  DeviceBuffer x = up(std::vector<float>(n * in, 0.5f)), w = up(std::vector<float>(out * in, 0.25f));
  DeviceBuffer b = up(std::vector<float>(out, 1.0f)), y = floats(n * out), dy = up(std::vector<float>(n * out, 1.0f));
  DeviceBuffer dx = floats(n * in), dw = floats(out * in), db = floats(out);
  stream_.synchronize();
  runtime_->reset_memory_traffic();
  kernels::linear_forward(stream_, n, in, out, x.as<float>(), w.as<float>(), b.as<float>(), y.as<float>());
  kernels::linear_backward(stream_, n, in, out, x.as<float>(), w.as<float>(), dy.as<float>(), dx.as<float>(),
                           dw.as<float>(), db.as<float>(), false);
  // forward: linear_bias {b 4, y 32}; gemm {x 128, W 64, y 32}
  // backward: gemm dW {dy 32, x 128, dW 64}; column_sum {dy 32, db 4}; gemm dx {dy 32, W 64, dx 128}
  const auto t = traffic();
  EXPECT_EQ(t.at("linear_bias"), (std::pair<std::uint64_t, std::uint64_t>{(4 + 32) * 4, 1}));
  EXPECT_EQ(t.at("gemm"), (std::pair<std::uint64_t, std::uint64_t>{3 * (128 + 64 + 32) * 4, 3}));
  EXPECT_EQ(t.at("column_sum"), (std::pair<std::uint64_t, std::uint64_t>{(32 + 4) * 4, 1}));
  EXPECT_EQ(t.size(), 3u);
}

TEST_P(TrafficTest, AConv2dLayersStep) {
  // N 2, C_in 3, 8x8, C_out 4, 3x3, stride 1, pad 1: x 384, W 108, b 4, y 512 floats.
  const kernels::Conv2dShape s{2, 3, 8, 8, 4, 3, 3, 1, 1};
  if (!kernels::conv_library_enabled(GetParam() == "cuda" ? Backend::cuda : Backend::sim))
    GTEST_SKIP() << "no convolution library in this build";
  const kernels::ConvWeightGrad saved = kernels::conv_weight_grad();
  kernels::set_conv_weight_grad(kernels::ConvWeightGrad::library);  // the library's on both backends
  DeviceBuffer x = up(std::vector<float>(384, 0.5f)), w = up(std::vector<float>(108, 0.25f));
  DeviceBuffer b = up(std::vector<float>(4, 1.0f)), y = floats(512), dy = up(std::vector<float>(512, 1.0f));
  DeviceBuffer dx = floats(384), dw = floats(108), db = floats(4);
  DeviceBuffer workspace = floats(kernels::conv2d_workspace_floats(s));
  stream_.synchronize();
  runtime_->reset_memory_traffic();
  kernels::conv2d_forward(stream_, s, x.as<float>(), w.as<float>(), b.as<float>(), y.as<float>(),
                          workspace.as<float>());
  kernels::conv2d_backward(stream_, s, x.as<float>(), w.as<float>(), dy.as<float>(), dx.as<float>(), dw.as<float>(),
                           db.as<float>(), workspace.as<float>(), false);
  const auto t = traffic();
  kernels::set_conv_weight_grad(saved);
  // forward {x, W, b, y}; backward {W, dy, dx} for the input gradient and {x, dW} with dy for the
  // weight gradient, dy once; the bias gradient a channel_sum {dy, db}.
  EXPECT_EQ(t.at("conv2d_forward"), (std::pair<std::uint64_t, std::uint64_t>{(384 + 108 + 4 + 512) * 4, 1}));
  EXPECT_EQ(t.at("conv2d_backward"), (std::pair<std::uint64_t, std::uint64_t>{(108 + 512 + 384 + 384 + 108) * 4, 1}));
  EXPECT_EQ(t.at("channel_sum"), (std::pair<std::uint64_t, std::uint64_t>{(512 + 4) * 4, 1}));
  EXPECT_EQ(t.size(), 3u);
}

TEST_P(TrafficTest, AReplayedGraphAddsNothing) {
  DeviceBuffer x = up(std::vector<float>(64, 1.0f));
  stream_.synchronize();
  runtime_->reset_memory_traffic();
  stream_.begin_capture();
  kernels::scale(stream_, 64, 2.0f, x.as<float>());
  const Graph graph = stream_.end_capture();
  graph.replay();
  graph.replay();
  EXPECT_EQ(traffic().at("scale"), (std::pair<std::uint64_t, std::uint64_t>{64 * 4, 1})) << "counted at capture";
}

}  // namespace
}  // namespace dp
