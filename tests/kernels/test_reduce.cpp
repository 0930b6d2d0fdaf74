// test_reduce.cpp — the reduction plan (kernels/reduce_plan.h): the plan for the reference and edge
// shapes, the sim's sums bit for bit against a naive reference written here from the documented
// order, and (where a GPU exists) cuda against sim bit for bit for the reductions and shared functors.
#include <cstring>
#include <gtest/gtest.h>
#include <vector>

#include "dp/kernels/batchnorm.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/detail/reduce_plan.h"
#include "dp/kernels/layernorm.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/loss.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/device.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;
using kernels::kReduceLanes;
using kernels::plan_row_reduce;
using kernels::ReducePlan;

// ------------------------------------------------------------------------------------------------
// the plan

// What every plan must satisfy: the chunks tile each row exactly, stage-1 chunks are whole lane
// strides, and the partials stay bounded.
void expect_valid(const ReducePlan& plan, index_t rows, index_t cols) {
  SCOPED_TRACE(testing::Message() << rows << " x " << cols);
  EXPECT_EQ(plan.rows, rows);
  EXPECT_EQ(plan.cols, cols);
  ASSERT_GE(plan.chunks_per_row, 1);
  if (plan.two_stage()) {
    EXPECT_EQ(plan.chunk % kReduceLanes, 0);
    EXPECT_GE(plan.chunk, kernels::kReduceMinChunk);
    EXPECT_GE(plan.chunk * plan.chunks_per_row, cols);        // covers the row
    EXPECT_LT(plan.chunk * (plan.chunks_per_row - 1), cols);  // no empty chunk
    EXPECT_LE(plan.partials(), kernels::kReduceTargetBlocks);
  } else {
    EXPECT_EQ(plan.chunk, cols);
    EXPECT_EQ(plan.partials(), 0);
  }
}

// The ConvNet's (models/convnet.h) per-channel reductions at batch 1024: BatchNorm statistics and
// gradient sums and the conv bias gradients run over N*H*W per channel: 16 channels of 28*28 and
// 32 channels of 14*14. Each must fill a 132-SM GPU several times (>= 4 * 132 blocks).
TEST(ReducePlan, ConvNetBatch1024FillsTheGpu) {
  const ReducePlan layer1 = plan_row_reduce(16, index_t{1024} * 28 * 28);
  const ReducePlan layer2 = plan_row_reduce(32, index_t{1024} * 14 * 14);
  expect_valid(layer1, 16, 1024 * 28 * 28);
  expect_valid(layer2, 32, 1024 * 14 * 14);
  EXPECT_GE(layer1.blocks(), 528);
  EXPECT_GE(layer2.blocks(), 528);
  // The numbers themselves, pinned: they are the summation order.
  EXPECT_EQ(layer1.chunk, 4096);
  EXPECT_EQ(layer1.chunks_per_row, 196);
  EXPECT_EQ(layer1.blocks(), 3136);
  EXPECT_EQ(layer2.chunk, 4096);
  EXPECT_EQ(layer2.chunks_per_row, 49);
  EXPECT_EQ(layer2.blocks(), 1568);
}

TEST(ReducePlan, ShortRowsAndManyRowsAreOneChunkPerRow) {
  for (auto [rows, cols] : {std::pair<index_t, index_t>{1, 1},
                            {5, 0},
                            {1, 4096},
                            {1, 8191},
                            {64, 10},
                            {7, 1},
                            {8192, 100000},
                            {100000, 5000}}) {
    const ReducePlan plan = plan_row_reduce(rows, cols);
    expect_valid(plan, rows, cols);
    EXPECT_FALSE(plan.two_stage()) << rows << " x " << cols;
    EXPECT_EQ(plan.blocks(), rows);
  }
}

TEST(ReducePlan, LongRowsSplitUpToTheTarget) {
  // N = 1, C = 1, HW % 4 != 0, a prime length, one huge row, rows that leave room for few chunks.
  for (auto [rows, cols] : {std::pair<index_t, index_t>{1, 8193},
                            {1, 7 * 7},
                            {1, 1000003},
                            {3, 70001},
                            {1, index_t{1} << 34},
                            {4000, 100000},
                            {2, 100003},
                            {1, 33 * 33 * 1024}}) {
    const ReducePlan plan = plan_row_reduce(rows, cols);
    expect_valid(plan, rows, cols);
  }
  EXPECT_EQ(plan_row_reduce(1, 8193).chunks_per_row, 2);
  EXPECT_EQ(plan_row_reduce(1, 8193).chunk, 4352);  // ceil(8193 / 2) up to whole lane strides
  EXPECT_EQ(plan_row_reduce(1, index_t{1} << 34).chunks_per_row, kernels::kReduceTargetBlocks);
  EXPECT_EQ(plan_row_reduce(4000, 100000).chunks_per_row, 2);  // 8192 / 4000 chunks per row
}

TEST(ReducePlan, IsAConstantExpressionOfTheShapeAlone) {
  static_assert(plan_row_reduce(16, 802816).blocks() == 3136);
  static_assert(plan_row_reduce(3, 10).chunks_per_row == 1);
}

// ------------------------------------------------------------------------------------------------
// the sim against a naive reference of the documented order

// Lanes summed from a zero in increasing order, then lanes[l] += lanes[l + w] for w = L/2 .. 1.
// Written without the library's helpers, from the order documented in reduce_plan.h.
template <class Term>
float reference_block(index_t count, const Term& term) {
  std::vector<float> lanes(kReduceLanes, 0.0f);
  for (int lane = 0; lane < kReduceLanes; ++lane)
    for (index_t k = lane; k < count; k += kReduceLanes) lanes[lane] = lanes[lane] + term(k);
  for (int width = kReduceLanes / 2; width >= 1; width /= 2)
    for (int lane = 0; lane < width; ++lane) lanes[lane] = lanes[lane] + lanes[lane + width];
  return lanes[0];
}

// Sum of row r of `value(r, c)` in the plan's order.
template <class Value>
std::vector<float> reference_sums(index_t rows, index_t cols, const Value& value) {
  const ReducePlan plan = plan_row_reduce(rows, cols);
  std::vector<float> sums(static_cast<std::size_t>(rows));
  for (index_t r = 0; r < rows; ++r) {
    std::vector<float> chunk_sums;
    for (index_t chunk = 0; chunk < plan.chunks_per_row; ++chunk) {
      const index_t begin = chunk * plan.chunk, count = std::min(plan.chunk, cols - begin);
      chunk_sums.push_back(reference_block(count, [&](index_t k) { return value(r, begin + k); }));
    }
    sums[static_cast<std::size_t>(r)] =
        chunk_sums.size() == 1 ? chunk_sums[0]
                               : reference_block(static_cast<index_t>(chunk_sums.size()),
                                                 [&](index_t k) { return chunk_sums[static_cast<std::size_t>(k)]; });
  }
  return sums;
}

// Same bits (memcmp: -0 and NaN payloads included), reporting the first differing index.
testing::AssertionResult same_bits(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << want[i] << " (" << got.size()
                                         << " elements)";
  return testing::AssertionSuccess();
}

class ReduceSimTest : public testing::Test {
 protected:
  std::unique_ptr<Runtime> runtime_ = test::sim_runtime(1);
  Device& device_ = runtime_->device(0);
  Stream stream_ = device_.create_stream();
};

TEST_F(ReduceSimTest, RowAndColumnSumsFollowThePlanBitForBit) {
  // One and two stages, rows of 1 column, a single row, a length that is no multiple of 4 or of the
  // lanes, a row split into chunks whose last one is short; column sums of two stages over a full
  // tile of columns and a short one (the sim sums 16 columns at once).
  for (const auto& shape : {std::pair<index_t, index_t>{3, 70001},
                            {70001, 3},
                            {9000, 17},
                            {2, 100003},
                            {1, 4097},
                            {1, 8193},
                            {5, 1},
                            {1, 1},
                            {64, 10},
                            {1, 1000003},
                            {7, 255}}) {
    const index_t rows = shape.first, cols = shape.second;
    SCOPED_TRACE(testing::Message() << rows << " x " << cols);
    // Values spread over several binades so that any change of order changes the last bits.
    auto x = test::random_vector(static_cast<std::size_t>(rows * cols), 11, -1.0f, 1.0f);
    for (std::size_t i = 0; i < x.size(); i += 7) x[i] *= 1024.0f;
    DeviceBuffer dx = test::upload(device_, stream_, x);
    DeviceBuffer out = device_.allocate(static_cast<std::size_t>(std::max(rows, cols)) * sizeof(float));
    kernels::row_sum(stream_, rows, cols, dx.as<float>(), out.as<float>());
    auto got = test::download<float>(stream_, out);
    got.resize(static_cast<std::size_t>(rows));
    EXPECT_TRUE(same_bits(got, reference_sums(rows, cols, [&](index_t r, index_t c) {
                            return x[static_cast<std::size_t>(r * cols + c)];
                          })));
    kernels::column_sum(stream_, rows, cols, dx.as<float>(), out.as<float>());
    got = test::download<float>(stream_, out);
    got.resize(static_cast<std::size_t>(cols));
    EXPECT_TRUE(same_bits(got, reference_sums(cols, rows, [&](index_t c, index_t r) {
                            return x[static_cast<std::size_t>(r * cols + c)];
                          })));
  }
}

TEST_F(ReduceSimTest, ChannelSumsFollowThePlanBitForBit) {
  struct Shape {
    index_t n, c, plane;
  };
  // C = 1, N = 1, H*W % 4 != 0 (7*7, 3*3), H*W = 1, and a two-stage one (N*H*W = 60*28*28 > 4096).
  for (const Shape s : {Shape{3, 1, 49}, Shape{1, 5, 9}, Shape{4, 3, 1}, Shape{60, 2, 784}, Shape{1, 1, 1}}) {
    SCOPED_TRACE(testing::Message() << s.n << " x " << s.c << " x " << s.plane);
    const auto x = test::random_vector(static_cast<std::size_t>(s.n * s.c * s.plane), 12);
    DeviceBuffer dx = test::upload(device_, stream_, x);
    std::vector<float> init(static_cast<std::size_t>(s.c), 0.25f);
    DeviceBuffer out = test::upload(device_, stream_, init);
    kernels::channel_sum(stream_, s.n, s.c, s.plane, dx.as<float>(), out.as<float>(), 1.0f);
    auto want = reference_sums(s.c, s.n * s.plane, [&](index_t c, index_t j) {
      const index_t n = j / s.plane;
      return x[static_cast<std::size_t>((n * s.c + c) * s.plane + j % s.plane)];
    });
    for (auto& w : want) w = 1.0f * 0.25f + w;  // StoreSum with beta = 1
    EXPECT_TRUE(same_bits(test::download<float>(stream_, out), want));
  }
}

// BatchNorm's mean is the channel sum of the plan times 1/M; the conv bias gradient is the channel sum.
TEST_F(ReduceSimTest, BatchNormMeanAndConvBiasGradientUseThePlan) {
  const kernels::BatchNormShape bn{32, 3, 17, 19};  // N*H*W = 10336: two chunks per channel
  const index_t plane = 17 * 19, count = 32 * plane, total = count * 3;
  const auto x = test::random_vector(static_cast<std::size_t>(total), 13);
  DeviceBuffer dx = test::upload(device_, stream_, x), y = device_.allocate(total * sizeof(float));
  std::vector<float> ones(3, 1.0f), zeros(3, 0.0f);
  DeviceBuffer gamma = test::upload(device_, stream_, ones), beta = test::upload(device_, stream_, zeros);
  DeviceBuffer mean = device_.allocate(3 * sizeof(float)), invstd = device_.allocate(3 * sizeof(float));
  DeviceBuffer running_mean = test::upload(device_, stream_, zeros), running_var = test::upload(device_, stream_, ones);
  DeviceBuffer batches = device_.allocate(sizeof(std::int64_t));
  stream_.copy(batches.data(), std::vector<std::int64_t>{0}.data(), sizeof(std::int64_t));
  kernels::batchnorm_forward_train(stream_, bn, dx.as<float>(), gamma.as<float>(), beta.as<float>(), y.as<float>(),
                                   mean.as<float>(), invstd.as<float>(), running_mean.as<float>(),
                                   running_var.as<float>(), batches.as<std::int64_t>());
  auto want = reference_sums(3, count, [&](index_t c, index_t j) {
    const index_t n = j / plane;
    return x[static_cast<std::size_t>((n * 3 + c) * plane + j % plane)];
  });
  const float inv_count = 1.0f / static_cast<float>(count);
  for (auto& w : want) w = w * inv_count;
  EXPECT_TRUE(same_bits(test::download<float>(stream_, mean), want));
  ASSERT_TRUE(plan_row_reduce(3, count).two_stage());

  // Conv2d(3 -> 2, 1x1) of x: dbias = per-channel sum of dy, over N*H*W, by the same plan.
  const kernels::Conv2dShape conv{32, 2, 17, 19, 3, 1, 1, 1, 0};
  std::vector<float> w(6, 0.5f), db_init(3, 0.0f);
  DeviceBuffer weight = test::upload(device_, stream_, w), dweight = device_.allocate(6 * sizeof(float));
  DeviceBuffer dbias = test::upload(device_, stream_, db_init);
  DeviceBuffer conv_x = device_.allocate(static_cast<std::size_t>(32 * 2 * plane) * sizeof(float));
  DeviceBuffer workspace = device_.allocate(kernels::conv2d_workspace_floats(conv) * sizeof(float));
  kernels::fill(stream_, conv_x.as<float>(), 32 * 2 * plane, 1.0f);
  kernels::fill(stream_, dweight.as<float>(), 6, 0.0f);
  kernels::conv2d_backward(stream_, conv, conv_x.as<float>(), weight.as<float>(), dx.as<float>(), nullptr,
                           dweight.as<float>(), dbias.as<float>(), workspace.as<float>());
  want = reference_sums(3, count, [&](index_t c, index_t j) {
    const index_t n = j / plane;
    return x[static_cast<std::size_t>((n * 3 + c) * plane + j % plane)];
  });
  for (auto& v : want) v = 1.0f * 0.0f + v;
  EXPECT_TRUE(same_bits(test::download<float>(stream_, dbias), want));
}

// Cross-entropy's mean: the per-sample terms summed by the plan (two chunks at N = 10000), over N.
TEST_F(ReduceSimTest, CrossEntropyMeanUsesThePlan) {
  const int n = 10000, classes = 7;
  ASSERT_TRUE(plan_row_reduce(1, n).two_stage());
  const auto logits = test::random_vector(static_cast<std::size_t>(n) * classes, 14, -4.0f, 4.0f);
  const auto targets = test::random_targets(n, classes, 15);
  DeviceBuffer dl = test::upload(device_, stream_, logits), dt = test::upload(device_, stream_, targets);
  DeviceBuffer per_sample = device_.allocate(n * sizeof(float)), loss = device_.allocate(sizeof(float));
  kernels::cross_entropy_forward(stream_, n, classes, dl.as<float>(), dt.as<std::int64_t>(), per_sample.as<float>(),
                                 loss.as<float>());
  const auto terms = test::download<float>(stream_, per_sample);
  auto want = reference_sums(1, n, [&](index_t, index_t i) { return terms[static_cast<std::size_t>(i)]; });
  want[0] = want[0] / static_cast<float>(n);
  EXPECT_TRUE(same_bits(test::download<float>(stream_, loss), want));
}

// A row's reductions and elementwise pass in one launch (launch_row_fused, LayerNorm's forward and
// its input gradient) give the bits of the separate launches, which follow the plan: rows of one
// chunk, a row not a multiple of the lanes, one row, the longest row of one chunk.
TEST_F(ReduceSimTest, ARowsReductionsAndPassInOneLaunchAreTheSeparateLaunches) {
  using kernels::SumPair;
  for (const auto& [rows, cols] :
       {std::pair<index_t, index_t>{37, 700}, {1, 768}, {3, 1}, {2, kernels::kReduceMinChunk}}) {
    SCOPED_TRACE(testing::Message() << rows << " x " << cols);
    ASSERT_TRUE(kernels::row_fusable(rows, cols));
    const auto n = static_cast<std::size_t>(rows * cols);
    const auto x = test::random_vector(n, 16, -3.0f, 3.0f), dy = test::random_vector(n, 17);
    const auto gamma = test::random_vector(static_cast<std::size_t>(cols), 18, 0.5f, 1.5f),
               beta = test::random_vector(static_cast<std::size_t>(cols), 19);
    DeviceBuffer xd = test::upload(device_, stream_, x), dyd = test::upload(device_, stream_, dy),
                 g = test::upload(device_, stream_, gamma), b = test::upload(device_, stream_, beta);
    std::vector<std::vector<float>> results[2];
    for (const bool fused : {true, false}) {
      DeviceBuffer mean = device_.allocate(n / cols * 4), rstd = device_.allocate(n / cols * 4),
                   y = device_.allocate(n * 4), sums = device_.allocate(2 * n / cols * 4), dx = device_.allocate(n * 4);
      const float* xs = xd.as<float>();
      const kernels::RowElement<float> sum{xs, cols};
      const kernels::BnStoreMean store_mean{mean.as<float>(), 1.0f / static_cast<float>(cols)};
      const kernels::LnRowMoments<float> moments{xs, cols, mean.as<float>()};
      const kernels::LnStoreRstd store_rstd{rstd.as<float>(), static_cast<float>(cols), 1e-5f};
      const kernels::LnNormalize<float, float> normalize{
          cols, xs, mean.as<float>(), rstd.as<float>(), g.as<float>(), b.as<float>(), y.as<float>()};
      const kernels::LnGradTerms<float, float> terms{
          xs, dyd.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(), cols};
      const kernels::LnStoreRowSums store_sums{rows, sums.as<float>()};
      const kernels::LnInputGrad<float, float> input_grad{rows,
                                                          cols,
                                                          xs,
                                                          dyd.as<float>(),
                                                          g.as<float>(),
                                                          mean.as<float>(),
                                                          rstd.as<float>(),
                                                          sums.as<float>(),
                                                          1.0f / static_cast<float>(cols),
                                                          dx.as<float>()};
      if (fused) {
        kernels::launch_row_fused<float, SumPair>(stream_, "forward", rows, cols, sum, store_mean, moments, store_rstd,
                                                  normalize, {});
        kernels::launch_row_fused<SumPair>(stream_, "backward", rows, cols, terms, store_sums, kernels::NoRowReduce{},
                                           kernels::NoRowReduce{}, input_grad, {});
      } else {
        kernels::launch_row_reduce<float>(stream_, "mean", rows, cols, sum, store_mean, {});
        kernels::launch_row_reduce<SumPair>(stream_, "moments", rows, cols, moments, store_rstd, {});
        kernels::launch_2d(stream_, "normalize", rows, cols, normalize, {});
        kernels::launch_row_reduce<SumPair>(stream_, "sums", rows, cols, terms, store_sums, {});
        kernels::launch_2d(stream_, "dx", rows, cols, input_grad, {});
      }
      for (const DeviceBuffer* out : {&mean, &rstd, &y, &sums, &dx})
        results[fused].push_back(test::download<float>(stream_, *out));
    }
    for (std::size_t i = 0; i < results[0].size(); ++i) EXPECT_TRUE(same_bits(results[1][i], results[0][i])) << i;
  }
  // A row reduced in two chunks cannot be: the launcher refuses it.
  const index_t long_row = 2 * kernels::kReduceMinChunk;
  ASSERT_FALSE(kernels::row_fusable(1, long_row));
  EXPECT_THROW(kernels::launch_row_fused<float>(
                   stream_, "long", 1, long_row, kernels::RowElement<float>{nullptr, long_row}, [](index_t, float) {},
                   kernels::NoRowReduce{}, kernels::NoRowReduce{}, [](index_t, index_t) {}, {}),
               InvalidArgument);
}

// clip_grad_norm_ on the sim: a tensor's squared norm is the plan's sum of x^2; the total norm is
// sqrt(sum of the tensors' squared norms); the coefficient clamps at 1, and a NaN norm gives a NaN
// coefficient (torch.clamp keeps NaN), so the gradients become NaN as torch's do.
TEST_F(ReduceSimTest, GradientClippingKernels) {
  const std::vector<float> g = {3.0f, 4.0f, 0.0f, 12.0f};  // tensors {3, 4} (norm 5) and {0, 12} (norm 12)
  DeviceBuffer dg = test::upload(device_, stream_, g);
  DeviceBuffer squares = device_.allocate(2 * sizeof(float)), norm_coef = device_.allocate(2 * sizeof(float));
  kernels::sum_of_squares(stream_, 2, dg.as<float>(), squares.as<float>());
  kernels::sum_of_squares(stream_, 2, dg.as<float>() + 2, squares.as<float>() + 1);
  kernels::clip_coefficient(stream_, 2, squares.as<float>(), 6.5f, norm_coef.as<float>());
  kernels::scale_by(stream_, 4, norm_coef.as<float>() + 1, dg.as<float>());
  EXPECT_EQ(test::download<float>(stream_, squares), (std::vector<float>{25.0f, 144.0f}));
  const auto nc = test::download<float>(stream_, norm_coef);
  EXPECT_EQ(nc[0], 13.0f);
  EXPECT_EQ(nc[1], 6.5f / (13.0f + 1e-6f));
  const auto clipped = test::download<float>(stream_, dg);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_EQ(clipped[i], nc[1] * g[i]) << i;
  kernels::clip_coefficient(stream_, 2, squares.as<float>(), 100.0f, norm_coef.as<float>());
  EXPECT_EQ(test::download<float>(stream_, norm_coef)[1], 1.0f) << "a norm under max_norm: the coefficient is 1";
  const std::vector<float> nan = {std::nanf(""), 1.0f};
  DeviceBuffer dn = test::upload(device_, stream_, nan);
  kernels::sum_of_squares(stream_, 2, dn.as<float>(), squares.as<float>());
  kernels::clip_coefficient(stream_, 1, squares.as<float>(), 1.0f, norm_coef.as<float>());
  const auto nan_coef = test::download<float>(stream_, norm_coef);
  EXPECT_TRUE(std::isnan(nan_coef[0]) && std::isnan(nan_coef[1]));
}

// ------------------------------------------------------------------------------------------------
// cuda against sim, bit for bit (GPU machines only)

// Runs `body(device, stream)` on device 0 of `runtime` and returns its downloads.
template <class Body>
std::vector<std::vector<float>> run_on(Runtime& runtime, const Body& body) {
  Device& device = runtime.device(0);
  Stream stream = device.create_stream();
  return body(device, stream);
}

void expect_same_bits(const std::vector<std::vector<float>>& on_cuda, const std::vector<std::vector<float>>& on_sim) {
  ASSERT_EQ(on_cuda.size(), on_sim.size());
  for (std::size_t i = 0; i < on_cuda.size(); ++i) EXPECT_TRUE(same_bits(on_cuda[i], on_sim[i])) << "output " << i;
}

TEST(ReduceCudaMatchesSim, RowColumnAndChannelSums) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  for (const auto& shape : {std::pair<index_t, index_t>{3, 70001},
                            {2, 100003},
                            {16, 1024 * 49},
                            {5, 1},
                            {1, 1},
                            {64, 10},
                            {1, 1000003},
                            {7, 255}}) {
    const index_t rows = shape.first, cols = shape.second;
    SCOPED_TRACE(testing::Message() << rows << " x " << cols);
    const auto x = test::random_vector(static_cast<std::size_t>(rows * cols), 21);
    auto body = [&](Device& device, Stream& stream) {
      DeviceBuffer dx = test::upload(device, stream, x);
      DeviceBuffer r = device.allocate(rows * sizeof(float)), c = device.allocate(cols * sizeof(float));
      DeviceBuffer ch = device.allocate(sizeof(float));
      kernels::row_sum(stream, rows, cols, dx.as<float>(), r.as<float>());
      kernels::column_sum(stream, rows, cols, dx.as<float>(), c.as<float>());
      kernels::channel_sum(stream, rows, 1, cols, dx.as<float>(), ch.as<float>());  // C = 1: the whole tensor
      return std::vector<std::vector<float>>{test::download<float>(stream, r), test::download<float>(stream, c),
                                             test::download<float>(stream, ch)};
    };
    expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
  }
}

// The BatchNorm statistics, outputs and gradients (reductions and elementwise functors together).
TEST(ReduceCudaMatchesSim, BatchNormForwardAndBackward) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  for (const kernels::BatchNormShape bn : {kernels::BatchNormShape{64, 16, 28, 28}, kernels::BatchNormShape{3, 5, 7, 7},
                                           kernels::BatchNormShape{1, 1, 3, 1}}) {
    const std::size_t c = static_cast<std::size_t>(bn.c), total = static_cast<std::size_t>(bn.n) * c * bn.h * bn.w;
    const auto x = test::random_vector(total, 22, -3.0f, 5.0f), dy = test::random_vector(total, 23);
    const auto gamma = test::random_vector(c, 24), beta = test::random_vector(c, 25);
    auto body = [&](Device& device, Stream& stream) {
      DeviceBuffer dx_in = test::upload(device, stream, x), ddy = test::upload(device, stream, dy);
      DeviceBuffer g = test::upload(device, stream, gamma), b = test::upload(device, stream, beta);
      DeviceBuffer y = device.allocate(total * 4), dx = device.allocate(total * 4), stats = device.allocate(2 * c * 4);
      DeviceBuffer rm = test::upload(device, stream, std::vector<float>(c, 0.0f));
      DeviceBuffer rv = test::upload(device, stream, std::vector<float>(c, 1.0f));
      DeviceBuffer dg = test::upload(device, stream, std::vector<float>(c, 0.0f));
      DeviceBuffer db = test::upload(device, stream, std::vector<float>(c, 0.0f));
      DeviceBuffer sums = device.allocate(2 * c * 4), batches = device.allocate(8);
      stream.copy(batches.data(), std::vector<std::int64_t>{0}.data(), 8);
      float* mean = stats.as<float>();
      kernels::batchnorm_forward_train(stream, bn, dx_in.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(), mean,
                                       mean + c, rm.as<float>(), rv.as<float>(), batches.as<std::int64_t>());
      kernels::batchnorm_backward(stream, bn, dx_in.as<float>(), g.as<float>(), mean, mean + c, ddy.as<float>(),
                                  dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>());
      return std::vector<std::vector<float>>{test::download<float>(stream, y),  test::download<float>(stream, stats),
                                             test::download<float>(stream, rm), test::download<float>(stream, rv),
                                             test::download<float>(stream, dx), test::download<float>(stream, dg),
                                             test::download<float>(stream, db)};
    };
    expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
  }
}

// Bias gradients: Linear's column sum and Conv2d's channel sum (on cuda beside cuDNN's dweight).
TEST(ReduceCudaMatchesSim, LinearAndConvBiasGradients) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const int n = 256, in = 33, out = 10;
  const kernels::Conv2dShape conv{64, 3, 14, 14, 8, 3, 3, 1, 1};
  const std::size_t x_count = 64 * 3 * 14 * 14, y_count = 64 * 8 * 14 * 14;
  const auto dy = test::random_vector(static_cast<std::size_t>(n) * out, 31);
  const auto conv_dy = test::random_vector(y_count, 32), conv_x = test::random_vector(x_count, 33);
  const auto x = test::random_vector(static_cast<std::size_t>(n) * in, 34);
  const auto w = test::random_vector(static_cast<std::size_t>(out) * in, 35), cw = test::random_vector(8 * 27, 36);
  auto body = [&](Device& device, Stream& stream) {
    DeviceBuffer ddy = test::upload(device, stream, dy), dx_in = test::upload(device, stream, x);
    DeviceBuffer dw_in = test::upload(device, stream, w);
    DeviceBuffer dw = test::upload(device, stream, std::vector<float>(w.size(), 0.0f));
    DeviceBuffer dbias = test::upload(device, stream, std::vector<float>(out, 0.5f));
    kernels::linear_backward(stream, n, in, out, dx_in.as<float>(), dw_in.as<float>(), ddy.as<float>(), nullptr,
                             dw.as<float>(), dbias.as<float>());
    DeviceBuffer cdy = test::upload(device, stream, conv_dy), cx = test::upload(device, stream, conv_x);
    DeviceBuffer cweight = test::upload(device, stream, cw);
    DeviceBuffer cdw = test::upload(device, stream, std::vector<float>(cw.size(), 0.0f));
    DeviceBuffer cdb = test::upload(device, stream, std::vector<float>(8, -0.25f));
    DeviceBuffer workspace = device.allocate(kernels::conv2d_workspace_floats(conv) * sizeof(float));
    kernels::conv2d_backward(stream, conv, cx.as<float>(), cweight.as<float>(), cdy.as<float>(), nullptr,
                             cdw.as<float>(), cdb.as<float>(), workspace.as<float>());
    // dweight is GEMM / cuDNN arithmetic (their own summation orders): not compared.
    return std::vector<std::vector<float>>{test::download<float>(stream, dbias), test::download<float>(stream, cdb)};
  };
  expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
}

// Elementwise functors without transcendental functions: the same roundings on both (no contraction).
TEST(ReduceCudaMatchesSim, ElementwiseFunctors) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const std::size_t n = 100003;
  const auto a = test::random_vector(n, 41, -4.0f, 4.0f), b = test::random_vector(n, 42, -4.0f, 4.0f);
  auto body = [&](Device& device, Stream& stream) {
    DeviceBuffer da = test::upload(device, stream, a), db = test::upload(device, stream, b);
    DeviceBuffer sum = device.allocate(n * 4), relu = device.allocate(n * 4), drelu = device.allocate(n * 4);
    kernels::axpy(stream, static_cast<index_t>(n), 0.3f, da.as<float>(), db.as<float>());
    kernels::scale(stream, static_cast<index_t>(n), 1.7f, da.as<float>());
    kernels::add(stream, static_cast<index_t>(n), da.as<float>(), db.as<float>(), sum.as<float>());
    kernels::relu_forward(stream, static_cast<index_t>(n), sum.as<float>(), relu.as<float>());
    kernels::relu_backward(stream, static_cast<index_t>(n), relu.as<float>(), da.as<float>(), drelu.as<float>());
    return std::vector<std::vector<float>>{test::download<float>(stream, db), test::download<float>(stream, sum),
                                           test::download<float>(stream, relu), test::download<float>(stream, drelu)};
  };
  expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
}

// clip_grad_norm_'s kernels: the per-tensor sums of squares (the plan), the coefficient (sqrtf is
// correctly rounded on both) and the scaling, bit for bit; and a gradient that clips and one that does not.
TEST(ReduceCudaMatchesSim, GradientClipping) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const std::size_t n = 100003, m = 517;
  const auto g = test::random_vector(n + m, 43, -2.0f, 2.0f);
  for (const float max_norm : {1.0f, 1e6f}) {
    auto body = [&](Device& device, Stream& stream) {
      DeviceBuffer dg = test::upload(device, stream, g);
      DeviceBuffer squares = device.allocate(2 * sizeof(float)), norm_coef = device.allocate(2 * sizeof(float));
      kernels::sum_of_squares(stream, static_cast<index_t>(n), dg.as<float>(), squares.as<float>());
      kernels::sum_of_squares(stream, static_cast<index_t>(m), dg.as<float>() + n, squares.as<float>() + 1);
      kernels::clip_coefficient(stream, 2, squares.as<float>(), max_norm, norm_coef.as<float>());
      kernels::scale_by(stream, static_cast<index_t>(n + m), norm_coef.as<float>() + 1, dg.as<float>());
      return std::vector<std::vector<float>>{test::download<float>(stream, squares),
                                             test::download<float>(stream, norm_coef),
                                             test::download<float>(stream, dg)};
    };
    expect_same_bits(run_on(*gpu, body), run_on(*sim, body));
  }
}

// Cross-entropy: its mean is a reduction of the plan, but its terms use expf / logf, whose CUDA
// versions are not the host libm's (neither is correctly rounded): the terms may differ in the last
// bits (CUDA's expf is within 2 ulp, glibc's within 1), so the loss and the gradient (softmax: an
// exp, a sum and a quotient) are compared to ~8 ulp.
TEST(ReduceCudaMatchesSim, CrossEntropyWithinUlps) {
  DP_RUNTIME_OR_SKIP(gpu, "cuda", 1);
  auto sim = test::sim_runtime(1);
  const int n = 1024, classes = 10;
  const auto logits = test::random_vector(static_cast<std::size_t>(n) * classes, 51, -5.0f, 5.0f);
  const auto targets = test::random_targets(n, classes, 52);
  auto body = [&](Device& device, Stream& stream) {
    DeviceBuffer dl = test::upload(device, stream, logits), dt = test::upload(device, stream, targets);
    DeviceBuffer per_sample = device.allocate(n * 4), loss = device.allocate(4), dlogits = device.allocate(n * 40);
    kernels::cross_entropy_forward(stream, n, classes, dl.as<float>(), dt.as<std::int64_t>(), per_sample.as<float>(),
                                   loss.as<float>());
    kernels::cross_entropy_backward(stream, n, classes, dl.as<float>(), dt.as<std::int64_t>(), 1.0f, n,
                                    dlogits.as<float>());
    return std::vector<std::vector<float>>{test::download<float>(stream, loss), test::download<float>(stream, dlogits)};
  };
  const auto on_cuda = run_on(*gpu, body), on_sim = run_on(*sim, body);
  EXPECT_TRUE(test::all_close(on_cuda[0], on_sim[0], 1e-6, 0.0));
  EXPECT_TRUE(test::all_close(on_cuda[1], on_sim[1], 1e-6, 1e-9));
}

}  // namespace
}  // namespace dp
