// The sim's own bodies of shared functors (host_run, host_add_terms: launch.h) against the per-element
// form the GPU runs, bit for bit, on shapes that reach every edge: padding, strides that skip
// inputs, overlapping windows, planes that split a reduction pass, NaN and ties. The functors run
// on host memory here, with no stream, so a difference can only be the host body's.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <gtest/gtest.h>
#include <limits>
#include <random>
#include <vector>

#include "dp/kernels/attention.h"
#include "dp/kernels/batchnorm.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/elementwise.h"
#include "dp/kernels/gelu.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/maxpool.h"
#include "dp/kernels/optimizer.h"
#include "test_util.h"

namespace dp::kernels {
namespace {

std::vector<float> random_floats(std::size_t n, unsigned seed, bool coarse = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = coarse ? std::round(dist(rng) * 2.0f) / 2.0f : dist(rng);  // coarse: many ties
  return v;
}

// Bit patterns, so that -0 against +0 and NaN payloads count as differences.
std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

template <class T>
constexpr bool kHostBodies =
    HasHostRun<MaxPoolBackward<T>>&& HasHostRun2d<MaxPoolForward<T>>&& HasHostRun2d<BnNormalize<T>>&& HasHostRun2d<
        BnInputGrad<T>>&& HasHostAddRow<ColumnElement<T>, float>&& HasHostAddTerms<ChannelValue<T>, float>&&
        HasHostAddTerms<BnCenteredMoments<T>, SumPair>&& HasHostAddTerms<BnGradTerms<T>, SumPair>;
static_assert(kHostBodies<float> && kHostBodies<std::uint16_t>);
static_assert(HasHostRun<Im2col> && HasHostRun<Col2im>);
static_assert(HasHostRun<AttentionFusedForward<float>> && HasHostRun<AttentionFusedBackwardQuery<float>> &&
              HasHostRun<AttentionFusedBackwardKey<std::uint16_t>>);
static_assert(HasHostRun<SgdUpdate> && HasHostRun<AdamWUpdate> && HasHostRun<BroadcastBias<float>> &&
              HasHostRun<BroadcastBias<std::uint16_t>>);
static_assert(HasHostAddTerms<RowElement<float>, float> && HasHostAddTerms<RowElement<std::uint16_t>, float>);
static_assert(HasHostRun<GeluForward<float>> && HasHostRun<GeluBackward<std::uint16_t>>);

const Pool2dShape kPools[] = {{2, 3, 28, 28, 2, 2, 0}, {2, 2, 7, 5, 2, 2, 0}, {2, 3, 9, 8, 3, 2, 1},
                              {1, 2, 7, 5, 3, 2, 1},   {1, 2, 6, 7, 3, 1, 1}, {2, 1, 4, 3, 3, 3, 0}};

TEST(HostPaths, MaxPoolForwardAndBackward) {
  unsigned seed = 1;
  for (const Pool2dShape& s : kPools) {
    const std::size_t in = static_cast<std::size_t>(s.n) * s.c * s.h * s.w;
    const std::size_t rows = static_cast<std::size_t>(s.n) * s.c * s.h_out(), out = rows * s.w_out();
    std::vector<float> x = random_floats(in, ++seed, true);
    x[in / 3] = std::numeric_limits<float>::quiet_NaN();
    x[in / 2] = -std::numeric_limits<float>::infinity();
    std::vector<float> y1(out), y2(out);
    std::vector<std::int32_t> a1(out), a2(out);
    const MaxPoolForward<float> f1{s, x.data(), y1.data(), a1.data()}, f2{s, x.data(), y2.data(), a2.data()};
    for (std::size_t r = 0; r < rows; ++r)
      for (int c = 0; c < s.w_out(); ++c) f1(static_cast<index_t>(r), c);
    f2.host_run(static_cast<index_t>(rows), s.w_out());
    EXPECT_EQ(bits(y1), bits(y2));
    EXPECT_EQ(a1, a2);

    std::vector<float> dy = random_floats(out, ++seed);
    dy[0] = -0.0f;  // 0 + -0 is +0 on both paths
    std::vector<float> dx1(in, 7.0f), dx2(in, 7.0f);
    const MaxPoolBackward<float> b1{s, a1.data(), dy.data(), dx1.data()}, b2{s, a1.data(), dy.data(), dx2.data()};
    for (std::size_t i = 0; i < in; ++i) b1(static_cast<index_t>(i));
    b2.host_run(static_cast<index_t>(in));
    EXPECT_EQ(bits(dx1), bits(dx2));
  }
}

TEST(HostPaths, Im2colAndCol2im) {
  const Conv2dShape shapes[] = {{3, 1, 28, 28, 16, 5, 5, 1, 2}, {2, 4, 14, 14, 8, 5, 5, 1, 2},
                                {2, 3, 9, 7, 4, 3, 3, 2, 1},    {1, 2, 8, 8, 3, 3, 3, 3, 2},
                                {2, 2, 5, 6, 2, 1, 1, 1, 0},    {1, 3, 4, 4, 2, 4, 4, 1, 0},
                                {2, 2, 7, 9, 3, 3, 5, 2, 2}};
  unsigned seed = 100;
  for (const Conv2dShape& s : shapes) {
    const ConvGeometry g = conv_geometry(s);
    const std::size_t taps = static_cast<std::size_t>(s.c_in) * s.kh * s.kw, cols = static_cast<std::size_t>(g.cols);
    const std::size_t in = static_cast<std::size_t>(s.n) * s.c_in * s.h * s.w;
    const std::vector<float> x = random_floats(in, ++seed);
    std::vector<float> c1(taps * cols, 5.0f), c2(taps * cols, 5.0f);
    const index_t rows = static_cast<index_t>(taps) * s.n * g.h_out;
    const Im2col i1{g, x.data(), c1.data()}, i2{g, x.data(), c2.data()};
    for (index_t r = 0; r < rows; ++r) i1(r);
    i2.host_run(rows);
    EXPECT_EQ(bits(c1), bits(c2));

    const std::vector<float> dcol = random_floats(taps * cols, ++seed);
    std::vector<float> d1(in, 3.0f), d2(in, 3.0f);
    const Col2im k1{g, dcol.data(), d1.data()}, k2{g, dcol.data(), d2.data()};
    for (std::size_t i = 0; i < in; ++i) k1(static_cast<index_t>(i));
    k2.host_run(static_cast<index_t>(in));
    EXPECT_EQ(bits(d1), bits(d2));
  }
}

// Per-channel reductions: each host_add_terms pass of kReduceLanes terms, added to lanes that
// already hold partial sums, against lane + map(row, col + k), with planes shorter than, equal to
// and longer than a pass, and passes that start mid-plane.
TEST(HostPaths, ChannelReductionTerms) {
  struct Case {
    index_t n, c, plane;
  };
  for (const Case k : {Case{3, 2, 5}, Case{4, 3, 256}, Case{2, 2, 784}, Case{5, 1, 300}}) {
    const std::size_t count = static_cast<std::size_t>(k.n * k.c * k.plane);
    const std::vector<float> x = random_floats(count, 7), dy = random_floats(count, 8),
                             relu_y = random_floats(count, 9);
    const std::vector<float> mean = random_floats(static_cast<std::size_t>(k.c), 10);
    std::vector<float> invstd = random_floats(static_cast<std::size_t>(k.c), 11);
    for (auto& v : invstd) v = std::fabs(v) + 0.5f;
    const ChannelElement at{k.c, k.plane};
    const ChannelValue<float> value{at, x.data()};
    const BnCenteredMoments<float> moments{at, x.data(), mean.data()};
    const BnGradTerms<float> grads{at, x.data(), dy.data(), mean.data(), invstd.data(), relu_y.data()};
    const BnGradTerms<float> plain{at, x.data(), dy.data(), mean.data(), invstd.data(), nullptr};
    const index_t row_length = k.n * k.plane;
    for (index_t c = 0; c < k.c; ++c)
      for (index_t begin = 0; begin < row_length; begin += 97) {
        const index_t width = std::min<index_t>(kReduceLanes, row_length - begin);
        const std::vector<float> start = random_floats(static_cast<std::size_t>(width), 12 + c);
        std::vector<float> v = start;
        std::vector<SumPair> m(static_cast<std::size_t>(width));
        for (std::size_t q = 0; q < m.size(); ++q) m[q] = SumPair{start[q], -start[q]};
        std::vector<SumPair> g = m, p = m;
        value.host_add_terms(c, begin, width, v.data());
        moments.host_add_terms(c, begin, width, m.data());
        grads.host_add_terms(c, begin, width, g.data());
        plain.host_add_terms(c, begin, width, p.data());
        for (index_t q = 0; q < width; ++q) {
          const auto at_q = static_cast<std::size_t>(q);
          const SumPair lane{start[at_q], -start[at_q]};
          const auto pair_bits = [](SumPair s) { return bits({s.a, s.b}); };
          ASSERT_EQ(bits({v[at_q]}), bits({start[at_q] + value(c, begin + q)}));
          ASSERT_EQ(pair_bits(m[at_q]), pair_bits(lane + moments(c, begin + q)));
          ASSERT_EQ(pair_bits(g[at_q]), pair_bits(lane + grads(c, begin + q)));
          ASSERT_EQ(pair_bits(p[at_q]), pair_bits(lane + plain(c, begin + q)));
        }
      }
  }
}

TEST(HostPaths, BatchNormNormalizeAndInputGradient) {
  const index_t n = 3, c = 4, plane = 49, count = n * c * plane;
  const auto size = static_cast<std::size_t>(count);
  const std::vector<float> x = random_floats(size, 20), dy = random_floats(size, 21), relu_y = random_floats(size, 22);
  const std::vector<float> mean = random_floats(4, 23), gamma = random_floats(4, 24), beta = random_floats(4, 25);
  const std::vector<float> sums = random_floats(8, 26);
  std::vector<float> invstd = random_floats(4, 27);
  for (auto& v : invstd) v = std::fabs(v) + 0.5f;
  const ChannelElement at{c, plane};
  for (bool relu : {false, true}) {
    std::vector<float> y1(size), y2(size);
    const BnNormalize<float> f1{at, x.data(), mean.data(), invstd.data(), gamma.data(), beta.data(), y1.data(), relu};
    const BnNormalize<float> f2{at, x.data(), mean.data(), invstd.data(), gamma.data(), beta.data(), y2.data(), relu};
    for (index_t r = 0; r < n * c; ++r)
      for (index_t j = 0; j < plane; ++j) f1(r, j);
    f2.host_run(n * c, plane);
    EXPECT_EQ(bits(y1), bits(y2));

    const BnInputGradTerm<float> term{
        x.data(), dy.data(), gamma.data(), mean.data(), invstd.data(), 1.0f / 147.0f, relu ? relu_y.data() : nullptr};
    std::vector<float> d1(size), d2(size);
    const BnInputGrad<float> g1{at, term, sums.data(), d1.data()}, g2{at, term, sums.data(), d2.data()};
    for (index_t r = 0; r < n * c; ++r)
      for (index_t j = 0; j < plane; ++j) g1(r, j);
    g2.host_run(n * c, plane);
    EXPECT_EQ(bits(d1), bits(d2));
  }
}

// bf16 storage (autocast): each functor reading and writing bf16 bits gives what its fp32 form gives
// on the widened values, rounded once (the chain's widen / compute / round), and its host body
// agrees with the per-element form, overlapping pooling windows included.
using test::bf16_bits;
using test::bf16_values;

TEST(HostPaths, Bf16StorageIsWidenComputeRound) {
  unsigned seed = 300;
  for (const Pool2dShape& s : kPools) {
    const std::size_t in = static_cast<std::size_t>(s.n) * s.c * s.h * s.w;
    const std::size_t rows = static_cast<std::size_t>(s.n) * s.c * s.h_out(), out = rows * s.w_out();
    const std::vector<std::uint16_t> x = bf16_bits(random_floats(in, ++seed, true));
    const std::vector<float> x32 = bf16_values(x);
    std::vector<float> y32(out);
    std::vector<std::uint16_t> y1(out), y2(out);
    std::vector<std::int32_t> a32(out), a1(out), a2(out);
    const MaxPoolForward<float> f32{s, x32.data(), y32.data(), a32.data()};
    const MaxPoolForward<std::uint16_t> f1{s, x.data(), y1.data(), a1.data()}, f2{s, x.data(), y2.data(), a2.data()};
    f32.host_run(static_cast<index_t>(rows), s.w_out());
    for (std::size_t r = 0; r < rows; ++r)
      for (int c = 0; c < s.w_out(); ++c) f1(static_cast<index_t>(r), c);
    f2.host_run(static_cast<index_t>(rows), s.w_out());
    EXPECT_EQ(y1, bf16_bits(y32));
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(a1, a32);
    EXPECT_EQ(a1, a2);

    const std::vector<std::uint16_t> dy = bf16_bits(random_floats(out, ++seed));
    const std::vector<float> dy32 = bf16_values(dy);
    std::vector<float> dx32(in);
    std::vector<std::uint16_t> dx1(in, 7), dx2(in, 7);
    const MaxPoolBackward<float> b32{s, a1.data(), dy32.data(), dx32.data()};
    const MaxPoolBackward<std::uint16_t> b1{s, a1.data(), dy.data(), dx1.data()},
        b2{s, a1.data(), dy.data(), dx2.data()};
    b32.host_run(static_cast<index_t>(in));
    for (std::size_t i = 0; i < in; ++i) b1(static_cast<index_t>(i));
    b2.host_run(static_cast<index_t>(in));
    EXPECT_EQ(dx1, bf16_bits(dx32));
    EXPECT_EQ(dx1, dx2);
  }

  const index_t n = 3, c = 4, plane = 49, count = n * c * plane;
  const auto size = static_cast<std::size_t>(count);
  const std::vector<std::uint16_t> x = bf16_bits(random_floats(size, 40)), dy = bf16_bits(random_floats(size, 41)),
                                   relu_y = bf16_bits(random_floats(size, 42));
  const std::vector<float> x32 = bf16_values(x), dy32 = bf16_values(dy), relu_y32 = bf16_values(relu_y);
  const std::vector<float> mean = random_floats(4, 43), gamma = random_floats(4, 44), beta = random_floats(4, 45);
  const std::vector<float> sums = random_floats(8, 46);
  std::vector<float> invstd = random_floats(4, 47);
  for (auto& v : invstd) v = std::fabs(v) + 0.5f;
  const ChannelElement at{c, plane};
  for (bool relu : {false, true}) {
    std::vector<float> y32(size);
    std::vector<std::uint16_t> y1(size), y2(size);
    const BnNormalize<float> f32{at,           x32.data(),  mean.data(), invstd.data(),
                                 gamma.data(), beta.data(), y32.data(),  relu};
    const BnNormalize<std::uint16_t> f1{at,           x.data(),    mean.data(), invstd.data(),
                                        gamma.data(), beta.data(), y1.data(),   relu};
    const BnNormalize<std::uint16_t> f2{at,           x.data(),    mean.data(), invstd.data(),
                                        gamma.data(), beta.data(), y2.data(),   relu};
    f32.host_run(n * c, plane);
    for (index_t r = 0; r < n * c; ++r)
      for (index_t j = 0; j < plane; ++j) f1(r, j);
    f2.host_run(n * c, plane);
    EXPECT_EQ(y1, bf16_bits(y32));
    EXPECT_EQ(y1, y2);

    const BnInputGradTerm<float> t32{x32.data(),
                                     dy32.data(),
                                     gamma.data(),
                                     mean.data(),
                                     invstd.data(),
                                     1.0f / 147.0f,
                                     relu ? relu_y32.data() : nullptr};
    const BnInputGradTerm<std::uint16_t> t16{
        x.data(), dy.data(), gamma.data(), mean.data(), invstd.data(), 1.0f / 147.0f, relu ? relu_y.data() : nullptr};
    std::vector<float> d32(size);
    std::vector<std::uint16_t> d1(size), d2(size);
    const BnInputGrad<float> g32{at, t32, sums.data(), d32.data()};
    const BnInputGrad<std::uint16_t> g1{at, t16, sums.data(), d1.data()}, g2{at, t16, sums.data(), d2.data()};
    g32.host_run(n * c, plane);
    for (index_t r = 0; r < n * c; ++r)
      for (index_t j = 0; j < plane; ++j) g1(r, j);
    g2.host_run(n * c, plane);
    EXPECT_EQ(d1, bf16_bits(d32));
    EXPECT_EQ(d1, d2);

    // The backward's sums read bf16 as the fp32 terms of the widened values.
    const BnGradTerms<float> s32{at,          x32.data(),    dy32.data(),
                                 mean.data(), invstd.data(), relu ? relu_y32.data() : nullptr};
    const BnGradTerms<std::uint16_t> s16{at,          x.data(),      dy.data(),
                                         mean.data(), invstd.data(), relu ? relu_y.data() : nullptr};
    const int terms = static_cast<int>(n * plane) - 5;  // from j = 5 to the channel's end
    std::vector<SumPair> l32(static_cast<std::size_t>(terms)), l16(static_cast<std::size_t>(terms));
    s32.host_add_terms(1, 5, terms, l32.data());
    s16.host_add_terms(1, 5, terms, l16.data());
    for (int q = 0; q < terms; ++q) {
      EXPECT_EQ(bits({l32[q].a, l32[q].b}), bits({l16[q].a, l16[q].b}));
      const SumPair one = s16(2, q), ref = s32(2, q);
      EXPECT_EQ(bits({one.a, one.b}), bits({ref.a, ref.b}));
    }
  }
}

// GELU in both forms, fp32 and bf16 storage, the backward in place too (dx over dy), on values that
// reach both branches of tanh and erf, their saturation, NaN, infinities and signed zeros.
TEST(HostPaths, GeluForwardAndBackward) {
  const std::size_t n = 1003;  // not a multiple of any vector width
  std::vector<float> x = random_floats(n, 50);
  for (std::size_t i = 0; i < n; i += 7) x[i] *= 6.0f;
  x[1] = std::numeric_limits<float>::quiet_NaN();
  x[2] = std::numeric_limits<float>::infinity();
  x[3] = -std::numeric_limits<float>::infinity();
  x[4] = -0.0f;
  x[5] = 0.0f;
  x[6] = 1e-30f;
  const std::vector<float> dy = random_floats(n, 51);
  for (GeluForm form : {GeluForm::exact, GeluForm::tanh}) {
    SCOPED_TRACE(form == GeluForm::tanh ? "tanh" : "exact");
    std::vector<float> y1(n), y2(n), dx1(n), dx2 = dy;
    const GeluForward<float> f1{form, x.data(), y1.data()}, f2{form, x.data(), y2.data()};
    for (std::size_t i = 0; i < n; ++i) f1(static_cast<index_t>(i));
    f2.host_run(static_cast<index_t>(n));
    EXPECT_EQ(bits(y1), bits(y2));
    const GeluBackward<float> b1{form, x.data(), dy.data(), dx1.data()}, b2{form, x.data(), dx2.data(), dx2.data()};
    for (std::size_t i = 0; i < n; ++i) b1(static_cast<index_t>(i));
    b2.host_run(static_cast<index_t>(n));
    EXPECT_EQ(bits(dx1), bits(dx2));

    const std::vector<std::uint16_t> xb = bf16_bits(x), dyb = bf16_bits(dy);
    std::vector<std::uint16_t> yb1(n), yb2(n), dxb1(n), dxb2(n);
    const GeluForward<std::uint16_t> g1{form, xb.data(), yb1.data()}, g2{form, xb.data(), yb2.data()};
    for (std::size_t i = 0; i < n; ++i) g1(static_cast<index_t>(i));
    g2.host_run(static_cast<index_t>(n));
    EXPECT_EQ(yb1, yb2);
    const GeluBackward<std::uint16_t> c1{form, xb.data(), dyb.data(), dxb1.data()},
        c2{form, xb.data(), dyb.data(), dxb2.data()};
    for (std::size_t i = 0; i < n; ++i) c1(static_cast<index_t>(i));
    c2.host_run(static_cast<index_t>(n));
    EXPECT_EQ(dxb1, dxb2);
  }
}

// Every combination of SGD's options, with the scalars on the host and in (here: host) memory.
TEST(HostPaths, OptimizerUpdates) {
  const std::size_t n = 301;
  const std::vector<float> grads = random_floats(n, 30), params0 = random_floats(n, 31), buf0 = random_floats(n, 32);
  for (int flags = 0; flags < 32; ++flags) {
    const bool decay = flags & 1, momentum = flags & 2, nesterov = flags & 4, first = flags & 8, device = flags & 16;
    const SgdScalars scalars{0.03f, first ? 1.0f : 0.0f};
    std::vector<float> p1 = params0, p2 = params0, b1 = buf0, b2 = buf0;
    SgdUpdate f{0.05f,        momentum ? 0.9f : 0.0f,         decay ? 1e-2f : 0.0f,       nesterov, first, p1.data(),
                grads.data(), momentum ? b1.data() : nullptr, device ? &scalars : nullptr};
    for (std::size_t i = 0; i < n; ++i) f(static_cast<index_t>(i));
    f.params = p2.data();
    f.buf = momentum ? b2.data() : nullptr;
    f.host_run(static_cast<index_t>(n));
    EXPECT_EQ(bits(p1), bits(p2)) << flags;
    EXPECT_EQ(bits(b1), bits(b2)) << flags;
  }
  for (bool device : {false, true}) {
    const AdamWScalars scalars{0.999f, -1.1e-3f, 0.3f};
    std::vector<float> p1 = params0, p2 = params0, m1 = buf0, m2 = buf0, v1(n, 0.25f), v2(n, 0.25f);
    AdamWUpdate f{0.9999f,
                  0.9f,
                  0.1f,
                  0.999f,
                  1e-3f,
                  -1e-3f,
                  0.2f,
                  1e-8f,
                  p1.data(),
                  grads.data(),
                  m1.data(),
                  v1.data(),
                  device ? &scalars : nullptr};
    for (std::size_t i = 0; i < n; ++i) f(static_cast<index_t>(i));
    f.params = p2.data();
    f.exp_avg = m2.data();
    f.exp_avg_sq = v2.data();
    f.host_run(static_cast<index_t>(n));
    EXPECT_EQ(bits(p1), bits(p2)) << device;
    EXPECT_EQ(bits(m1), bits(m2)) << device;
    EXPECT_EQ(bits(v1), bits(v2)) << device;
  }
}

TEST(HostPaths, LinearBiasAndRowColumnTerms) {
  const std::vector<float> bias = random_floats(7, 40), x = random_floats(7 * 300, 41);
  std::vector<float> y1(7 * 5), y2(7 * 5);
  const BroadcastBias<float> f1{bias.data(), 7, y1.data()}, f2{bias.data(), 7, y2.data()};
  for (index_t i = 0; i < 35; ++i) f1(i);
  f2.host_run(35);
  EXPECT_EQ(bits(y1), bits(y2));
  const RowElement<float> rows{x.data(), 300};
  const ColumnElement<float> columns{x.data(), 7};
  const std::vector<float> start = random_floats(kReduceLanes, 42);
  for (index_t r = 0; r < 7; ++r) {
    std::vector<float> got = start;
    rows.host_add_terms(r, 40, 256, got.data());
    for (index_t k = 0; k < 256; ++k) {
      const auto at = static_cast<std::size_t>(k);
      ASSERT_EQ(bits({got[at]}), bits({start[at] + rows(r, 40 + k)}));
    }
  }
  // A column sum's row of terms: columns [1, 6) of matrix row r, each to its own column's lane.
  for (index_t r = 0; r < 300; r += 37) {
    std::vector<float> got = start;
    columns.host_add_row(r, 1, 5, got.data());
    for (index_t j = 0; j < 5; ++j) {
      const auto at = static_cast<std::size_t>(j);
      ASSERT_EQ(bits({got[at]}), bits({start[at] + columns(1 + j, r)}));
    }
    ASSERT_EQ(bits({got[5]}), bits({start[5]}));  // lanes past count untouched
  }
}

// The fused attention's three passes, per row (the GPU's form: every dot read where its rows lie)
// against the host's (each matrix's rows transposed, a tile's dots as independent chains), with
// and without attn_dropout, T past and not a multiple of the key tile (the GPU's, 32, and the host's
// backward one, 64), and T = 1.
TEST(HostPaths, FusedAttention) {
  for (const AttentionShape s : {AttentionShape{2, 45, 2, 8}, AttentionShape{1, 1, 3, 4}, AttentionShape{1, 64, 1, 33},
                                 AttentionShape{1, 150, 2, 8}})
    for (const double p : {0.0, 0.3}) {
      const index_t c = s.width(), tokens = static_cast<index_t>(s.batch) * s.tokens, rows = attention_fused_rows(s);
      const auto n = static_cast<std::size_t>(tokens * c), r = static_cast<std::size_t>(rows);
      const std::vector<float> qkv = random_floats(3 * n, 50), dy = random_floats(n, 51);
      const AttentionRows shape{s.tokens,
                                s.heads,
                                s.head_dim,
                                c,
                                1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                                p > 0.0,
                                {3, 4, 5},
                                dropout_threshold(p),
                                dropout_noise_kept(p),
                                12};
      std::vector<float> y[2], lse[2], dqkv[2], delta[2];
      for (int form = 0; form < 2; ++form) {
        y[form].assign(n, 0.0f);
        lse[form].assign(r, 0.0f);
        dqkv[form].assign(3 * n, 0.0f);
        delta[form].assign(r, 0.0f);
        const AttentionFusedForward<float> forward{shape, qkv.data(), y[form].data(), lse[form].data()};
        const AttentionFusedBackwardQuery<float> query{
            shape, qkv.data(), y[form].data(), lse[form].data(), dy.data(), dqkv[form].data(), delta[form].data()};
        const AttentionFusedBackwardKey<float> key{shape,     qkv.data(),         lse[form].data(),
                                                   dy.data(), delta[form].data(), dqkv[form].data()};
        if (form == 0) {
          for (index_t i = 0; i < rows; ++i) forward(i);
          for (index_t i = 0; i < rows; ++i) query(i);
          for (index_t i = 0; i < rows; ++i) key(i);
        } else {
          forward.host_run(rows);
          query.host_run(rows);
          key.host_run(rows);
        }
      }
      EXPECT_EQ(bits(y[0]), bits(y[1])) << s.tokens << " " << p;
      EXPECT_EQ(bits(lse[0]), bits(lse[1])) << s.tokens << " " << p;
      EXPECT_EQ(bits(dqkv[0]), bits(dqkv[1])) << s.tokens << " " << p;
      EXPECT_EQ(bits(delta[0]), bits(delta[1])) << s.tokens << " " << p;
    }
}

}  // namespace
}  // namespace dp::kernels
