// test_conv2d.cpp — Conv2d forward/backward on every backend against a direct convolution in double,
// finite differences, gradient accumulation, operand checks; on cuda also cuDNN vs the im2col path.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <iostream>
#include <limits>
#include <oneapi/dnnl/dnnl.h>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/kernels/conv2d.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

// OpenMP's C API (libgomp, oneDNN's runtime, which dp links).
extern "C" void omp_set_num_threads(int threads);
extern "C" int omp_get_max_threads();

namespace dp {
namespace {

using kernels::Conv2dShape;
using test::download;
using test::random_vector;
using test::upload;

std::string describe(const Conv2dShape& s) {
  return "N=" + std::to_string(s.n) + " C_in=" + std::to_string(s.c_in) + " H=" + std::to_string(s.h) +
         " W=" + std::to_string(s.w) + " C_out=" + std::to_string(s.c_out) + " K=" + std::to_string(s.kh) + "x" +
         std::to_string(s.kw) + " stride=" + std::to_string(s.stride) + " pad=" + std::to_string(s.pad);
}

std::size_t x_size(const Conv2dShape& s) { return std::size_t(s.n) * s.c_in * s.h * s.w; }
std::size_t w_size(const Conv2dShape& s) { return std::size_t(s.c_out) * s.c_in * s.kh * s.kw; }
std::size_t y_size(const Conv2dShape& s) { return std::size_t(s.n) * s.c_out * s.h_out() * s.w_out(); }

// Inputs of one forward + backward, uniform in [-1, 1]. b empty = no bias (and no dbias).
struct Inputs {
  std::vector<float> x, w, b, dy, dw0, db0;  // dw0 / db0: what the gradients accumulate into
};
Inputs make_inputs(const Conv2dShape& s, bool bias, unsigned seed) {
  Inputs in;
  in.x = random_vector(x_size(s), seed);
  in.w = random_vector(w_size(s), seed + 1);
  in.dy = random_vector(y_size(s), seed + 2);
  in.dw0 = random_vector(w_size(s), seed + 3);
  if (bias) {
    in.b = random_vector(s.c_out, seed + 4);
    in.db0 = random_vector(s.c_out, seed + 5);
  }
  return in;
}

// ------------------------------------------------------------------------------------------------
// Direct convolution, one output element at a time, as plain loops in double. Each returns the
// exact value (fp32 inputs, double products and sums: exact to ~1e-16) and the sum of |terms|,
// which bounds the fp32 rounding error of any evaluation order (within_rounding below).

struct Exact {
  double value = 0.0, magnitude = 0.0;
  int terms = 0;  // summands, including a bias or an accumulated initial value
  void add(double term) {
    value += term;
    magnitude += std::fabs(term);
    ++terms;
  }
};

// y[n, co, oh, ow] = b[co] + sum_{c, ki, kj} x[n, c, oh*stride - pad + ki, ow*stride - pad + kj] * w[co, c, ki, kj]
Exact direct_y(const Conv2dShape& s, const Inputs& in, std::size_t i) {
  const int ow = int(i % s.w_out()), oh = int(i / s.w_out() % s.h_out()), co = int(i / s.w_out() / s.h_out() % s.c_out);
  const int n = int(i / s.w_out() / s.h_out() / s.c_out);
  Exact e;
  if (!in.b.empty()) e.add(in.b[co]);
  for (int c = 0; c < s.c_in; ++c)
    for (int ki = 0; ki < s.kh; ++ki)
      for (int kj = 0; kj < s.kw; ++kj) {
        const int ih = oh * s.stride - s.pad + ki, iw = ow * s.stride - s.pad + kj;
        if (ih < 0 || ih >= s.h || iw < 0 || iw >= s.w) continue;  // zero padding
        e.add(double(in.x[((std::size_t(n) * s.c_in + c) * s.h + ih) * s.w + iw]) *
              in.w[((std::size_t(co) * s.c_in + c) * s.kh + ki) * s.kw + kj]);
      }
  return e;
}

// dx[n, c, ih, iw] = sum over every (co, ki, kj, oh, ow) with oh*stride - pad + ki = ih (same for w)
// of dy[n, co, oh, ow] * w[co, c, ki, kj].
Exact direct_dx(const Conv2dShape& s, const Inputs& in, std::size_t i) {
  const int iw = int(i % s.w), ih = int(i / s.w % s.h), c = int(i / s.w / s.h % s.c_in),
            n = int(i / s.w / s.h / s.c_in);
  Exact e;
  for (int co = 0; co < s.c_out; ++co)
    for (int ki = 0; ki < s.kh; ++ki)
      for (int kj = 0; kj < s.kw; ++kj) {
        const int th = ih + s.pad - ki, tw = iw + s.pad - kj;
        if (th < 0 || tw < 0 || th % s.stride || tw % s.stride) continue;
        const int oh = th / s.stride, ow = tw / s.stride;
        if (oh >= s.h_out() || ow >= s.w_out()) continue;
        e.add(double(in.dy[((std::size_t(n) * s.c_out + co) * s.h_out() + oh) * s.w_out() + ow]) *
              in.w[((std::size_t(co) * s.c_in + c) * s.kh + ki) * s.kw + kj]);
      }
  return e;
}

// dw[co, c, ki, kj] = dw0 + times * sum_{n, oh, ow} dy[n, co, oh, ow] * x[n, c, oh*stride - pad + ki, ...]
Exact direct_dw(const Conv2dShape& s, const Inputs& in, std::size_t i, int times = 1) {
  const int kj = int(i % s.kw), ki = int(i / s.kw % s.kh), c = int(i / s.kw / s.kh % s.c_in),
            co = int(i / s.kw / s.kh / s.c_in);
  Exact e;
  e.add(in.dw0[i]);
  for (int t = 0; t < times; ++t)
    for (int n = 0; n < s.n; ++n)
      for (int oh = 0; oh < s.h_out(); ++oh)
        for (int ow = 0; ow < s.w_out(); ++ow) {
          const int ih = oh * s.stride - s.pad + ki, iw = ow * s.stride - s.pad + kj;
          if (ih < 0 || ih >= s.h || iw < 0 || iw >= s.w) continue;
          e.add(double(in.dy[((std::size_t(n) * s.c_out + co) * s.h_out() + oh) * s.w_out() + ow]) *
                in.x[((std::size_t(n) * s.c_in + c) * s.h + ih) * s.w + iw]);
        }
  return e;
}

// db[co] = db0 + times * sum_{n, oh, ow} dy[n, co, oh, ow]
Exact direct_db(const Conv2dShape& s, const Inputs& in, std::size_t co, int times = 1) {
  Exact e;
  e.add(in.db0[co]);
  const std::size_t hw = std::size_t(s.h_out()) * s.w_out();
  for (int t = 0; t < times; ++t)
    for (int n = 0; n < s.n; ++n)
      for (std::size_t q = 0; q < hw; ++q) e.add(in.dy[(n * s.c_out + co) * hw + q]);
  return e;
}

// fp32 evaluation of a sum of k fp32 products (or fp32 values), in ANY order, blocked, pairwise or
// with FMA, is within gamma_k * sum|terms| of the exact sum, gamma_k = k*u / (1 - k*u), u = 2^-24
// (Higham, Accuracy and Stability of Numerical Algorithms, §3.1): any path through the summation
// tree has at most k roundings. The inputs are exact and the reference error (~1e-16) is
// negligible, so this is a rigorous tolerance for every path (OpenBLAS, cuBLAS, cuDNN's
// dot-product algorithms) without a fudge factor; elements with no terms must be exactly 0.
double gamma(int k) {
  const double u = std::ldexp(1.0, -24);
  return k * u / (1.0 - k * u);
}

// got[i] vs the direct value for every i in `indices` (all of them when empty).
::testing::AssertionResult within_rounding(const std::vector<float>& got, const std::vector<Exact>& want,
                                           const std::vector<std::size_t>& indices) {
  int shown = 0;
  std::size_t bad = 0;
  std::string detail;
  for (std::size_t j = 0; j < want.size(); ++j) {
    const std::size_t i = indices.empty() ? j : indices[j];
    const double diff = std::fabs(double(got.at(i)) - want[j].value);
    const double tol = gamma(want[j].terms) * want[j].magnitude;
    if (!(diff <= tol)) {
      ++bad;
      if (shown++ < 5)
        detail += " [" + std::to_string(i) + "] got " + std::to_string(got[i]) + " want " +
                  std::to_string(want[j].value) + " tol " + std::to_string(tol);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << want.size() << " checked elements differ:" << detail;
}

// Direct values at `indices` (every element of a tensor of `size` when indices is empty).
template <class F>
std::vector<Exact> direct_at(std::size_t size, const std::vector<std::size_t>& indices, F&& f) {
  std::vector<Exact> out;
  if (indices.empty())
    for (std::size_t i = 0; i < size; ++i) out.push_back(f(i));
  else
    for (std::size_t i : indices) out.push_back(f(i));
  return out;
}

// ------------------------------------------------------------------------------------------------

// Results of one conv2d_forward + conv2d_backward on a stream.
struct Outputs {
  std::vector<float> y, dx, dw, db;
};

// reuse: the backward is told that the forward lowered x (when it says it did), as a layer does.
Outputs run_conv(Device& device, const Stream& stream, const Conv2dShape& s, const Inputs& in, bool reuse = false) {
  const bool bias = !in.b.empty();
  DeviceBuffer x = upload(device, stream, in.x), w = upload(device, stream, in.w), dy = upload(device, stream, in.dy);
  DeviceBuffer dw = upload(device, stream, in.dw0);
  DeviceBuffer b = bias ? upload(device, stream, in.b) : DeviceBuffer{};
  DeviceBuffer db = bias ? upload(device, stream, in.db0) : DeviceBuffer{};
  DeviceBuffer y = device.allocate(y_size(s) * sizeof(float));
  // dx starts as NaN: the backward must overwrite every element.
  DeviceBuffer dx = upload(device, stream, std::vector<float>(x_size(s), std::numeric_limits<float>::quiet_NaN()));
  DeviceBuffer ws = device.allocate(kernels::conv2d_workspace_floats(s) * sizeof(float));
  const bool lowered = kernels::conv2d_forward(stream, s, x.as<float>(), w.as<float>(), bias ? b.as<float>() : nullptr,
                                               y.as<float>(), ws.as<float>());
  kernels::conv2d_backward(stream, s, x.as<float>(), w.as<float>(), dy.as<float>(), dx.as<float>(), dw.as<float>(),
                           bias ? db.as<float>() : nullptr, ws.as<float>(), true, reuse && lowered);
  Outputs out{download<float>(stream, y), download<float>(stream, dx), download<float>(stream, dw), {}};
  if (bias) out.db = download<float>(stream, db);
  return out;
}

// The weight gradient of a backward without dx, written (accumulate = false) over NaN.
std::vector<float> first_weight_grad(Device& device, const Stream& stream, const Conv2dShape& s, const Inputs& in) {
  DeviceBuffer x = upload(device, stream, in.x), w = upload(device, stream, in.w), dy = upload(device, stream, in.dy);
  DeviceBuffer dw = upload(device, stream, std::vector<float>(w_size(s), std::numeric_limits<float>::quiet_NaN()));
  DeviceBuffer ws = device.allocate(kernels::conv2d_workspace_floats(s) * sizeof(float));
  kernels::conv2d_backward(stream, s, x.as<float>(), w.as<float>(), dy.as<float>(), nullptr, dw.as<float>(), nullptr,
                           ws.as<float>(), false);
  return download<float>(stream, dw);
}

// Checks every output of run_conv against the direct convolution, at `sample` random indices per
// tensor (0: all of them).
void expect_direct(const Conv2dShape& s, const Inputs& in, const Outputs& out, std::size_t sample = 0) {
  std::mt19937 gen(7);
  auto pick = [&](std::size_t size) {
    std::vector<std::size_t> idx;
    if (sample == 0 || sample >= size) return idx;
    idx = {0, size - 1};
    std::uniform_int_distribution<std::size_t> dist(0, size - 1);
    while (idx.size() < sample) idx.push_back(dist(gen));
    return idx;
  };
  const auto iy = pick(y_size(s)), ix = pick(x_size(s)), iw = pick(w_size(s));
  EXPECT_TRUE(within_rounding(out.y, direct_at(y_size(s), iy, [&](std::size_t i) { return direct_y(s, in, i); }), iy))
      << "y: " << describe(s);
  EXPECT_TRUE(within_rounding(out.dx, direct_at(x_size(s), ix, [&](std::size_t i) { return direct_dx(s, in, i); }), ix))
      << "dx: " << describe(s);
  EXPECT_TRUE(within_rounding(out.dw, direct_at(w_size(s), iw, [&](std::size_t i) { return direct_dw(s, in, i); }), iw))
      << "dweight: " << describe(s);
  if (!in.b.empty()) {
    EXPECT_TRUE(within_rounding(out.db, direct_at(s.c_out, {}, [&](std::size_t i) { return direct_db(s, in, i); }), {}))
        << "dbias: " << describe(s);
  }
}

// Restores the convolution-library switch a test changed (the sim's answer is the switch itself).
class LibrarySetting {
 public:
  explicit LibrarySetting(bool enabled) : saved_(kernels::conv_library_enabled(Backend::sim)) {
    kernels::set_conv_library(enabled);
  }
  ~LibrarySetting() { kernels::set_conv_library(saved_); }
  LibrarySetting(const LibrarySetting&) = delete;
  LibrarySetting& operator=(const LibrarySetting&) = delete;

 private:
  bool saved_;
};

// Restores the weight-gradient choice a test changed.
class WeightGradSetting {
 public:
  explicit WeightGradSetting(kernels::ConvWeightGrad how) : saved_(kernels::conv_weight_grad()) {
    kernels::set_conv_weight_grad(how);
  }
  ~WeightGradSetting() { kernels::set_conv_weight_grad(saved_); }
  WeightGradSetting(const WeightGradSetting&) = delete;
  WeightGradSetting& operator=(const WeightGradSetting&) = delete;

 private:
  kernels::ConvWeightGrad saved_;
};

// Odd and non-square sizes, strides 1-3, padding 0-2, kernels 1/3/5 (and 2x3), batch 1-3, C_in 1-3,
// with and without bias; the last two are the reference model's layers at a small batch.
const std::vector<std::pair<Conv2dShape, bool>> kShapes = {
    {{1, 1, 5, 5, 1, 1, 1, 1, 0}, false},    {{3, 3, 7, 9, 4, 3, 3, 1, 1}, true},
    {{3, 3, 9, 6, 5, 5, 5, 2, 2}, true},     {{1, 3, 8, 11, 2, 3, 3, 2, 0}, true},
    {{3, 1, 6, 5, 3, 1, 1, 2, 0}, false},    {{2, 2, 6, 7, 3, 2, 3, 1, 1}, true},
    {{1, 2, 10, 8, 2, 3, 3, 3, 1}, true},    {{3, 1, 5, 4, 2, 5, 5, 1, 2}, false},
    {{1, 3, 4, 4, 2, 3, 3, 1, 2}, true},     {{2, 1, 28, 28, 16, 5, 5, 1, 2}, true},
    {{2, 16, 14, 14, 32, 5, 5, 1, 2}, true},
};

// The index maps divide by multiply-high and shift; they must agree with / and % for every
// non-negative int numerator: exhaustively for small values, then at the edges and at random.
TEST(Conv2dFastDivmod, MatchesIntegerDivision) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> any(0, std::numeric_limits<int>::max());
  std::vector<int> divisors = {1,
                               2,
                               3,
                               5,
                               7,
                               14,
                               25,
                               28,
                               196,
                               784,
                               12544,
                               50176,
                               65535,
                               65536,
                               65537,
                               (1 << 30) - 1,
                               1 << 30,
                               (1 << 30) + 1,
                               std::numeric_limits<int>::max()};
  for (int k = 0; k < 50; ++k) divisors.push_back(any(gen) >> (k % 31));
  for (int d : divisors) {
    if (d <= 0) continue;
    const kernels::FastDivmod by(d);
    std::vector<int> numerators = {0, d - 1, d, std::numeric_limits<int>::max(), std::numeric_limits<int>::max() - 1};
    for (int n = 0; n < 2000; ++n) numerators.push_back(n);
    for (int k = 0; k < 2000; ++k) numerators.push_back(any(gen));
    for (int n : numerators) {
      int r = -1;
      const int q = by.divmod(n, r);
      ASSERT_TRUE(q == n / d && r == n % d) << n << " / " << d << ": got " << q << " r " << r;
    }
  }
}

class Conv2dTest : public test::BackendTest {
 protected:
  Backend backend() const { return GetParam() == "cuda" ? Backend::cuda : Backend::sim; }
  // Why the tests of the backend's convolution library (cuDNN, oneDNN) cannot run here, or null.
  // (GTEST_SKIP only returns from the function it is in, so the test body skips itself.)
  const char* no_library() const {
    return kernels::conv_library_enabled(backend()) ? nullptr : "dp was built without cuDNN";
  }
  const char* no_cudnn() const { return GetParam() != "cuda" ? "cuDNN: cuda only" : no_library(); }
};

INSTANTIATE_TEST_SUITE_P(Backends, Conv2dTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// 1. Every output element of forward and backward against the direct convolution, by the default
// path: the backend's library (cuDNN when available, oneDNN).
TEST_P(Conv2dTest, MatchesDirectConvolution) {
  unsigned seed = 100;
  for (const auto& [shape, bias] : kShapes) {
    const Inputs in = make_inputs(shape, bias, seed += 10);
    expect_direct(shape, in, run_conv(*device_, stream_, shape, in));
  }
}

// A backward that reuses the x its forward lowered (the shared path says it left it in the
// workspace; the libraries' forwards lower nothing) gives the same bits as one that lowers x again.
TEST_P(Conv2dTest, BackwardReusingTheLoweredInputGivesTheSameBits) {
  unsigned seed = 300;
  for (const auto& [shape, bias] : kShapes) {
    const Inputs in = make_inputs(shape, bias, seed += 10);
    const Outputs again = run_conv(*device_, stream_, shape, in), reused = run_conv(*device_, stream_, shape, in, true);
    const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    };
    EXPECT_TRUE(same(again.y, reused.y) && same(again.dx, reused.dx) && same(again.dw, reused.dw) &&
                same(again.db, reused.db));
  }
  const Conv2dShape s{2, 3, 6, 6, 4, 3, 3, 1, 1};
  DeviceBuffer x = device_->allocate(x_size(s) * sizeof(float)), w = device_->allocate(w_size(s) * sizeof(float)),
               y = device_->allocate(y_size(s) * sizeof(float)),
               ws = device_->allocate(kernels::conv2d_workspace_floats(s) * sizeof(float));
  EXPECT_EQ(kernels::conv2d_forward(stream_, s, x.as<float>(), w.as<float>(), nullptr, y.as<float>(), ws.as<float>()),
            !kernels::conv_library_enabled(backend()));
}

// The reference model's layers at batch 64 (one GEMM over N*H*W = 50176 and 12544 columns),
// checked at sampled elements: the full direct reference would dominate the test time.
TEST_P(Conv2dTest, ReferenceModelLayersAtBatch64) {
  for (const Conv2dShape& shape :
       {Conv2dShape{64, 1, 28, 28, 16, 5, 5, 1, 2}, Conv2dShape{64, 16, 14, 14, 32, 5, 5, 1, 2}}) {
    const Inputs in = make_inputs(shape, true, 900);
    expect_direct(shape, in, run_conv(*device_, stream_, shape, in), 64);
  }
}

// 2. Central differences of L = sum(y * r) against the backward with dy = r.
// L is linear in each of x, weight and bias taken alone, so central differences have no
// truncation error at any step: the only error is fp32 rounding in the forward. A large step
// (0.25 on O(1) inputs) therefore only helps: each perturbed y element carries ~u*|y| ~ 1e-7 of
// rounding, summed in quadrature over the <= 49 outputs one input affects (C_out*KH*KW for x,
// N*H_out*W_out for a bias) ~ 1e-6, over the step 2*0.25 ~ 2e-6 (measured: <= 7e-7). The step is
// the representable difference of the perturbed fp32 values, and L is summed in double on the
// host. Tolerance 1e-4 absolute + 1e-4 relative: ~50x the expected error, yet a wrong tap, sign
// or index is an O(0.1) error.
TEST_P(Conv2dTest, FiniteDifferenceGradients) {
  for (const Conv2dShape& shape : {Conv2dShape{2, 3, 5, 6, 3, 3, 3, 2, 1}, Conv2dShape{1, 2, 4, 5, 2, 2, 3, 1, 2}}) {
    Inputs in = make_inputs(shape, true, 300);
    in.dw0.assign(w_size(shape), 0.0f);
    in.db0.assign(shape.c_out, 0.0f);
    const std::vector<float> r = in.dy;
    const Outputs analytic = run_conv(*device_, stream_, shape, in);

    DeviceBuffer x = device_->allocate(x_size(shape) * sizeof(float)),
                 w = device_->allocate(w_size(shape) * sizeof(float));
    DeviceBuffer b = device_->allocate(shape.c_out * sizeof(float)),
                 y = device_->allocate(y_size(shape) * sizeof(float));
    DeviceBuffer ws = device_->allocate(kernels::conv2d_workspace_floats(shape) * sizeof(float));
    auto loss = [&](const Inputs& p) {
      stream_.copy(x.data(), p.x.data(), x.size());
      stream_.copy(w.data(), p.w.data(), w.size());
      stream_.copy(b.data(), p.b.data(), b.size());
      kernels::conv2d_forward(stream_, shape, x.as<float>(), w.as<float>(), b.as<float>(), y.as<float>(),
                              ws.as<float>());
      const auto yv = download<float>(stream_, y);
      double l = 0.0;
      for (std::size_t i = 0; i < yv.size(); ++i) l += double(yv[i]) * r[i];
      return l;
    };
    const float step = 0.25f;
    auto check = [&](std::vector<float> Inputs::*tensor, const std::vector<float>& grad, const char* name) {
      std::mt19937 gen(11);
      std::uniform_int_distribution<std::size_t> dist(0, grad.size() - 1);
      for (int k = 0; k < 8; ++k) {
        const std::size_t i = k == 0 ? 0 : k == 1 ? grad.size() - 1 : dist(gen);
        Inputs plus = in, minus = in;
        (plus.*tensor)[i] += step;
        (minus.*tensor)[i] -= step;
        const double h = double((plus.*tensor)[i]) - double((minus.*tensor)[i]);
        const double numeric = (loss(plus) - loss(minus)) / h;
        EXPECT_NEAR(grad[i], numeric, 1e-4 + 1e-4 * std::fabs(numeric)) << name << "[" << i << "] " << describe(shape);
      }
    };
    check(&Inputs::x, analytic.dx, "dx");
    check(&Inputs::w, analytic.dw, "dweight");
    check(&Inputs::b, analytic.db, "dbias");
  }
}

// 3. dweight and dbias accumulate (PyTorch .grad); dx is overwritten; null dx / dbias are skipped.
TEST_P(Conv2dTest, BackwardAccumulatesWeightAndBiasGradients) {
  const Conv2dShape s{3, 2, 7, 6, 4, 3, 3, 1, 1};
  const Inputs in = make_inputs(s, true, 500);
  DeviceBuffer x = upload(*device_, stream_, in.x), w = upload(*device_, stream_, in.w),
               dy = upload(*device_, stream_, in.dy);
  DeviceBuffer dw = upload(*device_, stream_, in.dw0), db = upload(*device_, stream_, in.db0);
  DeviceBuffer dx = upload(*device_, stream_, std::vector<float>(x_size(s), 1e30f));
  DeviceBuffer ws = device_->allocate(kernels::conv2d_workspace_floats(s) * sizeof(float));
  auto backward = [&](float* dx_ptr, float* db_ptr) {
    kernels::conv2d_backward(stream_, s, x.as<float>(), w.as<float>(), dy.as<float>(), dx_ptr, dw.as<float>(), db_ptr,
                             ws.as<float>());
  };
  backward(dx.as<float>(), db.as<float>());
  backward(dx.as<float>(), db.as<float>());
  // Twice: dw = dw0 + 2*grad, a sum of twice the terms (same bound argument as above).
  EXPECT_TRUE(within_rounding(download<float>(stream_, dw),
                              direct_at(w_size(s), {}, [&](std::size_t i) { return direct_dw(s, in, i, 2); }), {}));
  EXPECT_TRUE(within_rounding(download<float>(stream_, db),
                              direct_at(s.c_out, {}, [&](std::size_t i) { return direct_db(s, in, i, 2); }), {}));
  EXPECT_TRUE(within_rounding(download<float>(stream_, dx),
                              direct_at(x_size(s), {}, [&](std::size_t i) { return direct_dx(s, in, i); }), {}));
  // A third call without dx and dbias: only dweight moves.
  const auto dx_before = download<float>(stream_, dx), db_before = download<float>(stream_, db);
  backward(nullptr, nullptr);
  EXPECT_TRUE(within_rounding(download<float>(stream_, dw),
                              direct_at(w_size(s), {}, [&](std::size_t i) { return direct_dw(s, in, i, 3); }), {}));
  EXPECT_EQ(download<float>(stream_, dx), dx_before);
  EXPECT_EQ(download<float>(stream_, db), db_before);
}

// 4. An operand of another device throws DeviceMismatch before anything is enqueued (sim checks
// pointers; on cuda the GPU faults on its own).
TEST_P(Conv2dTest, ForeignOperandsThrowBeforeAnyWork) {
  if (GetParam() != "sim") GTEST_SKIP() << "operand ownership is checked by the sim only";
  const Conv2dShape s{2, 2, 6, 6, 3, 3, 3, 1, 1};
  const std::size_t wsf = kernels::conv2d_workspace_floats(s);
  Device& other = runtime_->device(0);
  ASSERT_NE(&other, device_);
  const std::vector<float> sentinel_y(y_size(s), 7.0f), sentinel_w(w_size(s), 7.0f);
  DeviceBuffer x = upload(*device_, stream_, random_vector(x_size(s), 1)),
               w = upload(*device_, stream_, random_vector(w_size(s), 2));
  DeviceBuffer b = upload(*device_, stream_, random_vector(s.c_out, 3)),
               dy = upload(*device_, stream_, random_vector(y_size(s), 4));
  DeviceBuffer y = upload(*device_, stream_, sentinel_y), dw = upload(*device_, stream_, sentinel_w);
  DeviceBuffer dx = device_->allocate(x_size(s) * sizeof(float)), db = device_->allocate(s.c_out * sizeof(float));
  DeviceBuffer ws = device_->allocate(wsf * sizeof(float));
  DeviceBuffer foreign = other.allocate(std::max(wsf, x_size(s) + y_size(s)) * sizeof(float));
  float* f = foreign.as<float>();
  auto forward = [&](const float* xp, const float* wp, const float* bp, float* yp, float* wsp) {
    kernels::conv2d_forward(stream_, s, xp, wp, bp, yp, wsp);
  };
  auto backward = [&](const float* xp, const float* wp, const float* dyp, float* dxp, float* dwp, float* dbp,
                      float* wsp) { kernels::conv2d_backward(stream_, s, xp, wp, dyp, dxp, dwp, dbp, wsp); };
  float *X = x.as<float>(), *W = w.as<float>(), *B = b.as<float>(), *Y = y.as<float>(), *WS = ws.as<float>();
  float *DY = dy.as<float>(), *DX = dx.as<float>(), *DW = dw.as<float>(), *DB = db.as<float>();
  EXPECT_THROW(forward(f, W, B, Y, WS), DeviceMismatch);
  EXPECT_THROW(forward(X, f, B, Y, WS), DeviceMismatch);
  EXPECT_THROW(forward(X, W, f, Y, WS), DeviceMismatch);
  EXPECT_THROW(forward(X, W, B, f, WS), DeviceMismatch);
  EXPECT_THROW(backward(f, W, DY, DX, DW, DB, WS), DeviceMismatch);
  EXPECT_THROW(backward(X, f, DY, DX, DW, DB, WS), DeviceMismatch);
  EXPECT_THROW(backward(X, W, f, DX, DW, DB, WS), DeviceMismatch);
  EXPECT_THROW(backward(X, W, DY, DX, DW, f, WS), DeviceMismatch);
  EXPECT_THROW(backward(X, W, DY, f, DW, DB, WS), DeviceMismatch);  // dx is written last: checked first anyway
  EXPECT_THROW(backward(X, W, DY, DX, f, DB, WS), DeviceMismatch);
  // Nothing ran: y and dweight still hold their sentinels.
  EXPECT_EQ(download<float>(stream_, y), sentinel_y);
  EXPECT_EQ(download<float>(stream_, dw), sentinel_w);
  // The shared path's workspace (the library's path takes none): foreign, or one float short.
  const LibrarySetting off(false);
  EXPECT_THROW(forward(X, W, B, Y, f), DeviceMismatch);
  EXPECT_THROW(backward(X, W, DY, DX, DW, DB, f), DeviceMismatch);
  EXPECT_THROW(forward(X, W, B, Y, ws.as<float>() + 1), DeviceMismatch);
  EXPECT_EQ(download<float>(stream_, y), sentinel_y);
}

// A convolution whose library does all of it needs no workspace (oneDNN on the sim; cuDNN with the
// weight gradient left to it): none is asked for, a null one is taken, and the results are those
// computed with one. The shared path asks for its whole scratch.
TEST_P(Conv2dTest, NoWorkspaceWhereTheLibraryDoesItAll) {
  if (const char* why = no_library()) GTEST_SKIP() << why;
  const Conv2dShape s{4, 3, 10, 10, 5, 3, 3, 1, 1};
  const WeightGradSetting library(kernels::ConvWeightGrad::library);
  EXPECT_EQ(kernels::conv2d_workspace_floats(stream_, s), 0u);
  const Inputs in = make_inputs(s, true, 4444);
  const Outputs with = run_conv(*device_, stream_, s, in);
  DeviceBuffer x = upload(*device_, stream_, in.x), w = upload(*device_, stream_, in.w);
  DeviceBuffer b = upload(*device_, stream_, in.b), y = device_->allocate(y_size(s) * sizeof(float));
  kernels::conv2d_forward(stream_, s, x.as<float>(), w.as<float>(), b.as<float>(), y.as<float>(), nullptr);
  EXPECT_EQ(download<float>(stream_, y), with.y);
  const LibrarySetting off(false);
  EXPECT_EQ(kernels::conv2d_workspace_floats(stream_, s), kernels::conv2d_workspace_floats(s));
}

TEST_P(Conv2dTest, RejectsInvalidShapesAndNullOperands) {
  DeviceBuffer buf = device_->allocate(4096 * sizeof(float));
  float* p = buf.as<float>();
  for (const Conv2dShape& bad : {Conv2dShape{1, 1, 4, 4, 1, 3, 3, 0, 0}, Conv2dShape{1, 1, 4, 4, 1, 3, 3, 1, -1},
                                 Conv2dShape{1, 1, 2, 2, 1, 5, 5, 1, 1}, Conv2dShape{1, 0, 4, 4, 1, 3, 3, 1, 0},
                                 Conv2dShape{1, 1, 4, 4, 1, 2, 0, 1, 0}}) {
    EXPECT_THROW(kernels::conv2d_workspace_floats(bad), InvalidArgument) << describe(bad);
    EXPECT_THROW(kernels::conv2d_forward(stream_, bad, p, p, nullptr, p, p), InvalidArgument) << describe(bad);
    EXPECT_THROW(kernels::conv2d_backward(stream_, bad, p, p, p, p, p, nullptr, p), InvalidArgument) << describe(bad);
  }
  const Conv2dShape ok{1, 1, 4, 4, 1, 3, 3, 1, 0};
  {
    const LibrarySetting off(false);  // the shared path needs its workspace
    EXPECT_THROW(kernels::conv2d_forward(stream_, ok, p, p, nullptr, p, nullptr), InvalidArgument);
  }
  EXPECT_THROW(kernels::conv2d_forward(stream_, ok, nullptr, p, nullptr, p, p), InvalidArgument);
  EXPECT_THROW(kernels::conv2d_backward(stream_, ok, p, p, p, p, nullptr, nullptr, p), InvalidArgument);
  // col (C_in*KH*KW = 9, N*H_out*W_out = 4) + mat (C_out = 1, 4).
  EXPECT_EQ(kernels::conv2d_workspace_floats(ok), 9u * 4 + 1u * 4);
}

// 5. The backend's library (cuDNN, its weight gradient by whichever path the plan timed faster;
// oneDNN) and the shared im2col path on the same device, each against the direct convolution with
// the rounding bound (so the two agree within twice that bound).
TEST_P(Conv2dTest, LibraryMatchesIm2colPath) {
  if (const char* why = no_library()) GTEST_SKIP() << why;
  std::vector<std::pair<Conv2dShape, bool>> shapes = kShapes;
  shapes.push_back({{64, 1, 28, 28, 16, 5, 5, 1, 2}, true});
  shapes.push_back({{64, 16, 14, 14, 32, 5, 5, 1, 2}, true});
  unsigned seed = 700;
  for (const auto& [shape, bias] : shapes) {
    const Inputs in = make_inputs(shape, bias, seed += 10);
    Outputs with_library, with_im2col;
    {
      const LibrarySetting on(true);
      with_library = run_conv(*device_, stream_, shape, in);
    }
    {
      const LibrarySetting off(false);
      with_im2col = run_conv(*device_, stream_, shape, in);
    }
    const std::size_t sample = shape.n >= 64 ? 64 : 0;
    expect_direct(shape, in, with_library, sample);
    expect_direct(shape, in, with_im2col, sample);
  }
}

// 6. Each weight-gradient path of the library path, forced and timed, against the direct
// convolution; forced to im2col + GEMM it gives the shared path's bits (the same kernels and GEMM).
// Without a library (cuda built without cuDNN), where every choice runs the shared path, the
// choices give the same bits.
TEST_P(Conv2dTest, WeightGradientPaths) {
  const bool library = no_library() == nullptr;
  std::vector<std::pair<Conv2dShape, bool>> shapes = kShapes;
  if (library) shapes.push_back({{64, 16, 14, 14, 32, 5, 5, 1, 2}, true});
  unsigned seed = 900;
  for (const auto& shape_and_bias : shapes) {
    const Conv2dShape& shape = shape_and_bias.first;
    const bool bias = shape_and_bias.second;
    const Inputs in = make_inputs(shape, bias, seed += 10);
    Outputs shared;
    {
      const LibrarySetting off(false);
      shared = run_conv(*device_, stream_, shape, in);
    }
    for (const auto how :
         {kernels::ConvWeightGrad::library, kernels::ConvWeightGrad::gemm, kernels::ConvWeightGrad::timed}) {
      const WeightGradSetting setting(how);
      const Outputs out = run_conv(*device_, stream_, shape, in);
      const std::string what = describe(shape) + " (choice " + std::to_string(static_cast<int>(how)) + ")";
      // The first backward after zero_grad: no input gradient (a first layer), dweight written over
      // NaN rather than added to.
      Inputs fresh = in;
      std::fill(fresh.dw0.begin(), fresh.dw0.end(), 0.0f);
      EXPECT_TRUE(
          within_rounding(first_weight_grad(*device_, stream_, shape, in),
                          direct_at(w_size(shape), {}, [&](std::size_t i) { return direct_dw(shape, fresh, i); }), {}))
          << "written dweight: " << what;
      if (!library) {
        EXPECT_EQ(out.dw, shared.dw) << what;
        EXPECT_EQ(out.dx, shared.dx) << what;
        continue;
      }
      expect_direct(shape, in, out, shape.n >= 64 ? 64 : 0);
      // In strict, cuda's `timed` is the shared GEMM, a fixed choice (no timing).
      const bool fixed_gemm = how == kernels::ConvWeightGrad::timed && GetParam() == "cuda";
      if (how == kernels::ConvWeightGrad::gemm || fixed_gemm) {
        EXPECT_EQ(out.dw, shared.dw) << what;
      }
    }
  }
}

// Precision::fast and tf32 choose cuDNN algorithms by timing them (cudnnFind*Ex) on scratch operands
// taken from the device's pool; they count in the device's MemoryStats like any other device memory,
// so the first run of a shape (the search) allocates more and peaks higher than the second (the
// cached plan).
TEST_P(Conv2dTest, CudnnPlanSearchMemoryIsCounted) {
  if (const char* why = no_cudnn()) GTEST_SKIP() << why;
  RuntimeOptions options;
  options.backend = "cuda";
  options.precision = Precision::fast;
  auto fast = Runtime::create(options);
  Device& device = fast->device(0);
  const Stream stream = device.create_stream();
  const Conv2dShape shape{8, 3, 20, 20, 7, 3, 3, 1, 1};  // a shape no other test plans
  const Inputs in = make_inputs(shape, true, 4242);
  const auto measure = [&] {
    stream.synchronize();
    const MemoryStats before = device.memory();
    device.reset_peak_memory();
    (void)run_conv(device, stream, shape, in);
    const MemoryStats after = device.memory();
    return std::pair{after.allocations_made - before.allocations_made, after.peak - before.in_use};
  };
  const auto [first_allocations, first_peak] = measure();
  const auto [second_allocations, second_peak] = measure();
  EXPECT_GT(first_allocations, second_allocations);
  EXPECT_GT(first_peak, second_peak);
}

// Precision::strict chooses by a fixed order and runs nothing to choose, and plans are kept per GPU
// for the process (Note [shared plans]): the first run of a shape allocates no more than the second,
// and every dp device of a GPU (virtual ones included), in every runtime, computes the same bits.
TEST_P(Conv2dTest, StrictCudnnPlansAreTheSameOnEveryDeviceOfAGpu) {
  if (const char* why = no_cudnn()) GTEST_SKIP() << why;
  const Conv2dShape shape{8, 3, 18, 18, 5, 3, 3, 1, 1};
  const Inputs in = make_inputs(shape, true, 4343);
  auto first = test::cuda_runtime(2), second = test::cuda_runtime(2);
  const auto run_on = [&](Runtime& runtime, int d, std::uint64_t* allocations = nullptr) {
    Device& device = runtime.device(d);
    const Stream stream = device.create_stream();
    const std::uint64_t before = device.memory().allocations_made;
    Outputs out = run_conv(device, stream, shape, in);
    if (allocations) *allocations = device.memory().allocations_made - before;
    return out;
  };
  std::uint64_t first_allocations = 0, second_allocations = 0;
  const Outputs reference = run_on(*first, 0, &first_allocations);
  (void)run_on(*first, 0, &second_allocations);
  EXPECT_EQ(first_allocations, second_allocations) << "no search memory in strict";
  for (const auto& [runtime, d] : {std::pair{first.get(), 1}, std::pair{second.get(), 0}, std::pair{second.get(), 1}}) {
    const Outputs out = run_on(*runtime, d);
    EXPECT_EQ(out.y, reference.y) << "device " << d;
    EXPECT_EQ(out.dx, reference.dx) << "device " << d;
    EXPECT_EQ(out.dw, reference.dw) << "device " << d;
    EXPECT_EQ(out.db, reference.db) << "device " << d;
  }
}

// Streams of one device each have their own cuDNN handle but share its plans (under a mutex); the
// sim's streams share oneDNN's plans process-wide, each executing on its own thread with its own
// scratch. Two threads driving their own streams concurrently must both get correct results.
TEST_P(Conv2dTest, LibraryConcurrentStreamsOfOneDevice) {
  if (const char* why = no_library()) GTEST_SKIP() << why;
  const Conv2dShape s{8, 3, 12, 10, 6, 3, 3, 1, 1};
  const Inputs in = make_inputs(s, true, 800);
  std::vector<Outputs> results(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      try {
        const Stream stream = device_->create_stream();
        for (int rep = 0; rep < 10; ++rep) results[t] = run_conv(*device_, stream, s, in);
      } catch (const std::exception& e) {  // an exception escaping a thread would abort the binary
        errors[t] = e.what();
      }
    });
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 2; ++t) {
    ASSERT_EQ(errors[t], "") << "thread " << t;
    expect_direct(s, in, results[t]);
  }
}

// The sim's oneDNN runs on the stream's thread alone, whatever OpenMP allows the caller: a plan
// built on a thread allowed 4 would otherwise split its work for 4 and start an OpenMP team of them
// on the stream, each simulated device then oversubscribing the host. The caller's setting is
// left as it was (the calling thread may be the embedding application's).
TEST_P(Conv2dTest, SimLibraryUsesTheStreamsThreadAlone) {
  if (GetParam() != "sim") GTEST_SKIP() << "the sim's library";
  const auto threads = [] {
    return std::distance(std::filesystem::directory_iterator("/proc/self/task"), std::filesystem::directory_iterator{});
  };
  const Conv2dShape s{8, 16, 14, 14, 32, 5, 5, 1, 2};  // a shape no other test plans
  const Inputs in = make_inputs(s, true, 4343);
  (void)run_conv(*device_, stream_, Conv2dShape{1, 1, 5, 5, 1, 1, 1, 1, 0},
                 make_inputs({1, 1, 5, 5, 1, 1, 1, 1, 0}, false, 1));
  const auto before = threads();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(4);
  const Outputs out = run_conv(*device_, stream_, s, in);
  EXPECT_EQ(omp_get_max_threads(), 4);
  omp_set_num_threads(saved);
  EXPECT_EQ(threads(), before) << "an OpenMP team was started";
  expect_direct(s, in, out);
}

// cpu0's caches as sysfs lists them ("L1 Data 32K,L1 Instruction 32K,L2 Unified 1024K,..."), as
// tests/golden/make_conv_goldens.py records them; "" without sysfs.
std::string cpu_caches() {
  const std::filesystem::path root = "/sys/devices/system/cpu/cpu0/cache";
  std::vector<std::string> indices;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(root, error))
    if (entry.path().filename().string().rfind("index", 0) == 0) indices.push_back(entry.path().filename().string());
  std::sort(indices.begin(), indices.end());
  std::string out;
  for (const std::string& index : indices) {
    const auto read = [&](const char* name) {
      std::ifstream in(root / index / name);
      std::string value;
      std::getline(in, value);
      return value;
    };
    out += (out.empty() ? "L" : ",L") + read("level") + " " + read("type") + " " + read("size");
  }
  return out;
}

// The sim's convolutions are oneDNN's direct convolutions set up as PyTorch sets up its own, on the
// same library: where oneDNN picks the kernels it picked when the goldens were made (the same
// instruction set and caches, which size their blocking: tests/golden/make_conv_goldens.py records
// both), forward, input gradient and
// weight gradient are PyTorch's bits; elsewhere PyTorch's values within fp32 rounding of a
// reordered sum (at most 1568 terms here). The bias gradient is dp's own reduction, not compared.
TEST_P(Conv2dTest, SimConvolutionsArePyTorchs) {
  if (GetParam() != "sim") GTEST_SKIP() << "the sim's library";
  const auto golden = safetensors::read(test::golden_path("conv_layers"));
  const bool same_kernels = golden.metadata.at("onednn_isa") == std::to_string(dnnl_get_effective_cpu_isa()) &&
                            golden.metadata.at("caches") == cpu_caches();
  std::istringstream cases(golden.metadata.at("cases"));
  int checked = 0;
  for (std::string item; std::getline(cases, item, ',');) {
    const std::string name = item.substr(0, item.find(':'));
    std::istringstream extents(item.substr(item.find(':') + 1));
    std::vector<int> e;
    for (std::string v; std::getline(extents, v, 'x');) e.push_back(std::stoi(v));
    ASSERT_EQ(e.size(), 8u) << item;
    const Conv2dShape s{e[0], e[1], e[2], e[3], e[4], e[5], e[5], e[6], e[7]};
    const auto get = [&](const char* key) { return golden.at(name + "." + key).to_f32(); };
    DeviceBuffer x = upload(*device_, stream_, get("x")), w = upload(*device_, stream_, get("weight")),
                 b = upload(*device_, stream_, get("bias")), dy = upload(*device_, stream_, get("dy"));
    DeviceBuffer y = device_->allocate(y_size(s) * sizeof(float)), dx = device_->allocate(x_size(s) * sizeof(float)),
                 dw = device_->allocate(w_size(s) * sizeof(float)),
                 ws = device_->allocate(kernels::conv2d_workspace_floats(s) * sizeof(float));
    kernels::conv2d_forward(stream_, s, x.as<float>(), w.as<float>(), b.as<float>(), y.as<float>(), ws.as<float>());
    kernels::conv2d_backward(stream_, s, x.as<float>(), w.as<float>(), dy.as<float>(), dx.as<float>(), dw.as<float>(),
                             nullptr, ws.as<float>(), false);
    for (const auto& [key, buffer] :
         {std::pair<const char*, const DeviceBuffer*>{"y", &y}, {"dx", &dx}, {"dweight", &dw}}) {
      const std::vector<float> want = get(key), got = download<float>(stream_, *buffer);
      ASSERT_EQ(got.size(), want.size()) << name << "." << key;
      if (same_kernels) {
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << name << "." << key;
      } else {
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 2e-4 + 1e-4 * std::fabs(want[i])) << name << "." << key << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
  if (!same_kernels) std::cout << "another instruction set or caches than the goldens': compared within rounding\n";
}

}  // namespace
}  // namespace dp
