// test_transformer_kernels.cpp — a transformer's kernels (LayerNorm, GELU, Embedding, causal
// attention) on each backend against
// PyTorch (tests/golden/make_transformer_goldens.py), their bf16 storage against the fp32 kernels
// on the widened values, and cuda's results against the sim's.
#include <bit>
#include <cmath>
#include <cstdint>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/kernels/attention.h"
#include "dp/kernels/detail/reduce_plan.h"
#include "dp/kernels/dropout.h"
#include "dp/kernels/embedding.h"
#include "dp/kernels/gelu.h"
#include "dp/kernels/layernorm.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

using kernels::index_t;
using test::all_close;

class TransformerKernels : public test::BackendTest {
 protected:
  struct LayerNormResult {
    std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
  };
  LayerNormResult layernorm(index_t rows, index_t cols, const std::vector<float>& x, const std::vector<float>& gamma,
                            const std::vector<float>& beta, const std::vector<float>& dy) {
    DeviceBuffer xd = up(x), g = up(gamma), b = up(beta), dyd = up(dy);
    DeviceBuffer y = floats(x.size()), mean = floats(rows), rstd = floats(rows), dx = floats(x.size());
    DeviceBuffer dg = floats(cols), db = floats(cols), sums = floats(2 * rows);
    kernels::layernorm_forward(stream_, rows, cols, xd.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(),
                               mean.as<float>(), rstd.as<float>());
    kernels::layernorm_backward(stream_, rows, cols, xd.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                dyd.as<float>(), dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                false);
    return {down<float>(y), down<float>(mean), down<float>(rstd), down<float>(dx), down<float>(dg), down<float>(db)};
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, TransformerKernels, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

TEST_P(TransformerKernels, LayerNormMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  int cases = 0;
  for (const auto& [name, text] : golden.metadata) {
    if (name.rfind("layernorm.", 0) != 0) continue;
    ++cases;
    const auto meta = nlohmann::json::parse(text);
    const index_t rows = meta.at("rows"), cols = meta.at("cols");
    const auto r = layernorm(rows, cols, golden.at(name + ".x").to_f32(), golden.at(name + ".gamma").to_f32(),
                             golden.at(name + ".beta").to_f32(), golden.at(name + ".dy").to_f32());
    // fp32 statistics over at most 300 values: a few ulps of the outputs' scale.
    EXPECT_TRUE(all_close(r.y, golden.at(name + ".y").to_f32(), 1e-5, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dx, golden.at(name + ".dx").to_f32(), 1e-4, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dgamma, golden.at(name + ".dgamma").to_f32(), 1e-5, 1e-5)) << name;
    EXPECT_TRUE(all_close(r.dbeta, golden.at(name + ".dbeta").to_f32(), 1e-5, 1e-5)) << name;
  }
  EXPECT_EQ(cases, 4);
  // One value a row: x - mean is exactly 0, so y is beta and the input gradient 0 (torch's CPU kernel,
  // folding the mean into a bias, leaves its rounding noise times 1/sqrt(eps) there instead).
  const auto r = layernorm(3, 1, {2.5f, -7.0f, 1e3f}, {1.5f}, {0.25f}, {1.0f, -2.0f, 3.0f});
  EXPECT_EQ(r.y, (std::vector<float>{0.25f, 0.25f, 0.25f}));
  EXPECT_EQ(r.dx, (std::vector<float>{0.0f, 0.0f, 0.0f}));
  EXPECT_EQ(r.dgamma, (std::vector<float>{0.0f}));
  EXPECT_EQ(r.dbeta, (std::vector<float>{2.0f}));
}

TEST_P(TransformerKernels, GeluMatchesPyTorchInBothForms) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  for (const auto& [form_name, form] : {std::pair{std::string("none"), kernels::GeluForm::exact},
                                        std::pair{std::string("tanh"), kernels::GeluForm::tanh}}) {
    const std::string p = "gelu." + form_name;
    const auto x = golden.at(p + ".x").to_f32(), dy = golden.at(p + ".dy").to_f32();
    const auto n = static_cast<index_t>(x.size());
    DeviceBuffer xd = up(x), dyd = up(dy), y = floats(x.size()), dx = floats(x.size());
    kernels::gelu_forward(stream_, n, form, xd.as<float>(), y.as<float>());
    kernels::gelu_backward(stream_, n, form, xd.as<float>(), dyd.as<float>(), dx.as<float>());
    // torch's CPU kernel is vectorised (its own tanh/erf/exp); a few ulps apart.
    EXPECT_TRUE(all_close(down<float>(y), golden.at(p + ".y").to_f32(), 4e-6, 1e-6)) << p;
    EXPECT_TRUE(all_close(down<float>(dx), golden.at(p + ".dx").to_f32(), 4e-6, 1e-6)) << p;
  }
}

// GELU's arithmetic is one functor for both backends with portable erf, tanh and exp: each backend's
// kernels give the bits of the functor run on the host, for ordinary values, both tails, zeros,
// infinities and NaN, in both forms.
TEST_P(TransformerKernels, GeluGivesTheHostFunctorsBits) {
  std::vector<float> x = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f, 1e30f, -1e30f};
  for (float v = -12.0f; v <= 12.0f; v += 0.00731f) x.push_back(v);
  std::vector<float> dy(x.size());
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = 0.5f + static_cast<float>(i % 17) * 0.125f;
  const auto n = static_cast<index_t>(x.size());
  for (const auto form : {kernels::GeluForm::exact, kernels::GeluForm::tanh}) {
    DeviceBuffer xd = up(x), dyd = up(dy), y = floats(x.size()), dx = floats(x.size());
    kernels::gelu_forward(stream_, n, form, xd.as<float>(), y.as<float>());
    kernels::gelu_backward(stream_, n, form, xd.as<float>(), dyd.as<float>(), dx.as<float>());
    const auto got_y = down<float>(y), got_dx = down<float>(dx);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float want_y = kernels::gelu(x[i], form), want_dx = kernels::gelu_grad(x[i], dy[i], form);
      // A NaN's payload is the hardware's own: NaN is all that must agree there.
      const auto same = [](float a, float b) {
        return (std::isnan(a) && std::isnan(b)) || std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
      };
      ASSERT_TRUE(same(got_y[i], want_y)) << "gelu(" << x[i] << "): " << got_y[i] << " vs " << want_y;
      ASSERT_TRUE(same(got_dx[i], want_dx)) << "gelu'(" << x[i] << "): " << got_dx[i] << " vs " << want_dx;
    }
  }
}

TEST_P(TransformerKernels, EmbeddingMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  const auto ids64 = golden.at("embedding.ids").to_i64();
  std::vector<std::int32_t> ids(ids64.begin(), ids64.end());
  const auto weight = golden.at("embedding.weight").to_f32(), dy = golden.at("embedding.dy").to_f32();
  const index_t tokens = static_cast<index_t>(ids.size()), vocab = 11, dim = 5;
  DeviceBuffer idd = up(ids), w = up(weight), dyd = up(dy), y = floats(ids.size() * 5),
               dw = up(std::vector<float>(55, 9.0f));
  DeviceBuffer order = device_->allocate(ids.size() * 4), offsets = device_->allocate((vocab + 1) * 4);
  kernels::embedding_forward(stream_, tokens, vocab, dim, idd.as<std::int32_t>(), w.as<float>(), y.as<float>());
  kernels::embedding_backward(stream_, tokens, vocab, dim, idd.as<std::int32_t>(), dyd.as<float>(), dw.as<float>(),
                              order.as<std::int32_t>(), offsets.as<std::int32_t>(), false);
  EXPECT_EQ(down<float>(y), golden.at("embedding.y").to_f32()) << "a gather is exact";
  // Rows no token names are written 0 (ids 0 and 10); the others sum up to 4 terms in token order.
  EXPECT_TRUE(all_close(down<float>(dw), golden.at("embedding.dweight").to_f32(), 1e-6, 1e-7));
  const auto got = down<float>(dw);
  for (int c = 0; c < 5; ++c) EXPECT_EQ(got[static_cast<std::size_t>(c)], 0.0f);
  // Accumulating adds the same sums to what the gradient held.
  kernels::embedding_backward(stream_, tokens, vocab, dim, idd.as<std::int32_t>(), dyd.as<float>(), dw.as<float>(),
                              order.as<std::int32_t>(), offsets.as<std::int32_t>(), true);
  const auto twice = down<float>(dw);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(twice[i], got[i] + got[i]) << i;
}

// An id outside the vocabulary: NaN for its row on both backends (a kernel cannot throw), and the
// sim's stream fails as torch's "index out of range in self" would.
TEST_P(TransformerKernels, AnEmbeddingIdOutsideTheVocabularyGivesNaNAndFailsTheSimStream) {
  const std::vector<std::int32_t> ids = {1, 2, 11};
  std::vector<float> weight(55);
  for (std::size_t i = 0; i < weight.size(); ++i) weight[i] = static_cast<float>(i);
  DeviceBuffer idd = up(ids), w = up(weight), y = floats(15);
  stream_.synchronize();
  Stream stream = device_->create_stream();  // a failed sim stream stays failed
  kernels::embedding_forward(stream, 3, 11, 5, idd.as<std::int32_t>(), w.as<float>(), y.as<float>());
  if (GetParam() == "sim") {
    try {
      stream.synchronize();
      ADD_FAILURE() << "id 11 of a vocabulary of 11 was gathered";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("token 2 has id 11, outside the vocabulary [0, 11)"), std::string::npos)
          << e.what();
    }
  } else {
    stream.synchronize();
  }
  const auto got = down<float>(y);
  for (int c = 0; c < 5; ++c) {
    EXPECT_EQ(got[static_cast<std::size_t>(c)], static_cast<float>(5 + c)) << "token 0, id 1";
    EXPECT_EQ(got[static_cast<std::size_t>(5 + c)], static_cast<float>(10 + c)) << "token 1, id 2";
    EXPECT_TRUE(std::isnan(got[static_cast<std::size_t>(10 + c)])) << "token 2, id 11: " << got[10 + c];
  }
}

TEST_P(TransformerKernels, CausalAttentionMatchesPyTorch) {
  const auto golden = safetensors::read(test::golden_path("transformer_layers"));
  int cases = 0;
  for (const auto& [name, text] : golden.metadata) {
    if (name.rfind("attention.", 0) != 0) continue;
    ++cases;
    const auto meta = nlohmann::json::parse(text);
    const kernels::AttentionShape s{meta.at("batch"), meta.at("tokens"), meta.at("heads"), meta.at("head_dim")};
    const auto qkv = golden.at(name + ".qkv").to_f32(), dy = golden.at(name + ".dy").to_f32();
    DeviceBuffer q = up(qkv), dyd = up(dy), probs = floats(static_cast<std::size_t>(s.probs())), y = floats(dy.size()),
                 dqkv = floats(qkv.size()), scratch = floats(static_cast<std::size_t>(s.probs()));
    kernels::attention_forward(stream_, s, q.as<float>(), probs.as<float>(), y.as<float>());
    kernels::attention_backward(stream_, s, q.as<float>(), probs.as<float>(), dyd.as<float>(), dqkv.as<float>(),
                                scratch.as<float>());
    EXPECT_TRUE(all_close(down<float>(probs), golden.at(name + ".probs").to_f32(), 1e-5, 1e-7)) << name;
    EXPECT_TRUE(all_close(down<float>(y), golden.at(name + ".y").to_f32(), 1e-5, 1e-6)) << name;
    EXPECT_TRUE(all_close(down<float>(dqkv), golden.at(name + ".dqkv").to_f32(), 1e-4, 1e-6)) << name;
    // The mask: nothing above the diagonal, exactly.
    const auto p = down<float>(probs);
    for (index_t m = 0; m < static_cast<index_t>(s.batch) * s.heads; ++m)
      for (int i = 0; i < s.tokens; ++i)
        for (int j = i + 1; j < s.tokens; ++j)
          ASSERT_EQ(p[static_cast<std::size_t>((m * s.tokens + i) * s.tokens + j)], 0.0f);
  }
  EXPECT_EQ(cases, 3);
}

// A strided batched GEMM (attention's per-head products over the batch) is the loop of its GEMMs:
// bit for bit on the sim (the same library call per product), within fp32 rounding on cuda (cuBLAS
// may pick another kernel for the batched call), on fp32 and bf16 operands, transposed or not; and it
// counts each product's operands (a shared one, stride 0, once).
TEST_P(TransformerKernels, GemmBatchedIsTheLoopOfGemms) {
  const int m = 5, n = 7, k = 4, batch = 3;
  const std::int64_t stride_a = 40, stride_b = 50, stride_c = 45;  // a gap after each operand
  const auto a = test::random_vector(static_cast<std::size_t>(stride_a * batch), 21),
             b = test::random_vector(static_cast<std::size_t>(stride_b * batch), 22);
  DeviceBuffer ad = up(a), bd = up(b), a16d = up(test::bf16_bits(a)), b16d = up(test::bf16_bits(b));
  for (const bool bf16 : {false, true})
    for (const bool trans_a : {false, true}) {
      const int lda = trans_a ? m : k;
      const kernels::In in_a = bf16 ? kernels::In(a16d.as<std::uint16_t>()) : kernels::In(ad.as<float>());
      const kernels::In in_b = bf16 ? kernels::In(b16d.as<std::uint16_t>()) : kernels::In(bd.as<float>());
      DeviceBuffer batched = up(std::vector<float>(static_cast<std::size_t>(stride_c * batch), 0.5f)),
                   looped = up(std::vector<float>(static_cast<std::size_t>(stride_c * batch), 0.5f));
      stream_.synchronize();
      runtime_->reset_memory_traffic();
      kernels::gemm_batched(stream_, trans_a, false, m, n, k, 0.75f, in_a, lda, stride_a, in_b, n, stride_b, 0.5f,
                            batched.as<float>(), n, stride_c, batch);
      const std::uint64_t bytes = traffic().at("gemm").first;
      const std::uint64_t element = bf16 ? 2 : 4;
      // Each product's matrices once: not the gaps between them.
      EXPECT_EQ(bytes, batch * ((m * k + k * n) * element + m * n * 4u)) << bf16 << trans_a;
      for (int i = 0; i < batch; ++i) {
        const auto* ap = static_cast<const std::byte*>(in_a.data) + i * stride_a * static_cast<std::int64_t>(element);
        const auto* bp = static_cast<const std::byte*>(in_b.data) + i * stride_b * static_cast<std::int64_t>(element);
        kernels::gemm(stream_, trans_a, false, m, n, k, 0.75f, kernels::In(ap, bf16), lda, kernels::In(bp, bf16), n,
                      0.5f, looped.as<float>() + i * stride_c, n);
      }
      if (GetParam() == "sim")
        EXPECT_EQ(down<float>(batched), down<float>(looped)) << "bf16 " << bf16 << " trans_a " << trans_a;
      else
        EXPECT_TRUE(all_close(down<float>(batched), down<float>(looped), 1e-6, 1e-6)) << bf16 << trans_a;
      // B shared by every product (stride 0): read once.
      runtime_->reset_memory_traffic();
      kernels::gemm_batched(stream_, trans_a, false, m, n, k, 0.75f, in_a, lda, stride_a, in_b, n, 0, 0.5f,
                            batched.as<float>(), n, stride_c, batch);
      EXPECT_EQ(traffic().at("gemm").first, batch * (m * k * element + m * n * 4u) + k * n * element)
          << bf16 << trans_a;
    }
}

// bf16 storage: the fp32 kernels' values on the widened inputs, rounded once (the statistics, the
// sums and the parameter gradients identical).
TEST_P(TransformerKernels, Bf16StorageIsTheFp32ResultRounded) {
  const index_t rows = 12, cols = 40;
  const auto size = static_cast<std::size_t>(rows * cols);
  const auto x16 = test::bf16_bits(test::random_vector(size, 1, -3.0f, 3.0f)),
             dy16 = test::bf16_bits(test::random_vector(size, 2));
  const auto x = test::bf16_values(x16), dy = test::bf16_values(dy16);
  const auto gamma = test::random_vector(static_cast<std::size_t>(cols), 3, 0.5f, 1.5f),
             beta = test::random_vector(static_cast<std::size_t>(cols), 4);
  const LayerNormResult want = layernorm(rows, cols, x, gamma, beta, dy);
  DeviceBuffer xd = up(x16), g = up(gamma), b = up(beta), dyd = up(dy16);
  DeviceBuffer y = device_->allocate(size * 2), dx = device_->allocate(size * 2), mean = floats(rows),
               rstd = floats(rows), dg = floats(cols), db = floats(cols), sums = floats(2 * rows);
  kernels::layernorm_forward(stream_, rows, cols, xd.as<std::uint16_t>(), g.as<float>(), b.as<float>(),
                             y.as<std::uint16_t>(), mean.as<float>(), rstd.as<float>());
  kernels::layernorm_backward(stream_, rows, cols, xd.as<std::uint16_t>(), g.as<float>(), mean.as<float>(),
                              rstd.as<float>(), dyd.as<std::uint16_t>(), dx.as<std::uint16_t>(), dg.as<float>(),
                              db.as<float>(), sums.as<float>(), false);
  const auto rounded = test::bf16_bits;
  EXPECT_EQ(down<std::uint16_t>(y), rounded(want.y));
  EXPECT_EQ(down<std::uint16_t>(dx), rounded(want.dx));
  EXPECT_EQ(down<float>(mean), want.mean);
  EXPECT_EQ(down<float>(rstd), want.rstd);
  EXPECT_EQ(down<float>(dg), want.dgamma);
  EXPECT_EQ(down<float>(db), want.dbeta);

  // Mixed: an fp32 x (the residual stream) with a bf16 y and dy (a reader that rounds): y is the
  // fp32 y rounded, dx the fp32 kernels' on the widened dy, bit for bit.
  {
    const auto x32v = test::random_vector(size, 5, -3.0f, 3.0f);
    const LayerNormResult fp32 = layernorm(rows, cols, x32v, gamma, beta, dy);
    DeviceBuffer xw = up(x32v), y16 = device_->allocate(size * 2), dxw = floats(size);
    kernels::layernorm_forward(stream_, rows, cols, xw.as<float>(), g.as<float>(), b.as<float>(),
                               y16.as<std::uint16_t>(), mean.as<float>(), rstd.as<float>());
    kernels::layernorm_backward(stream_, rows, cols, xw.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                dyd.as<std::uint16_t>(), dxw.as<float>(), dg.as<float>(), db.as<float>(),
                                sums.as<float>(), false);
    EXPECT_EQ(down<std::uint16_t>(y16), test::bf16_bits(fp32.y));
    EXPECT_EQ(down<float>(dxw), fp32.dx);
    EXPECT_EQ(down<float>(dg), fp32.dgamma);
    EXPECT_EQ(down<float>(db), fp32.dbeta);
  }

  DeviceBuffer gy = device_->allocate(size * 2), gdx = device_->allocate(size * 2);
  DeviceBuffer x32 = up(x), dy32 = up(dy), gy32 = floats(size), gdx32 = floats(size);
  for (const auto form : {kernels::GeluForm::exact, kernels::GeluForm::tanh}) {
    kernels::gelu_forward(stream_, rows * cols, form, xd.as<std::uint16_t>(), gy.as<std::uint16_t>());
    kernels::gelu_backward(stream_, rows * cols, form, xd.as<std::uint16_t>(), dyd.as<std::uint16_t>(),
                           gdx.as<std::uint16_t>());
    kernels::gelu_forward(stream_, rows * cols, form, x32.as<float>(), gy32.as<float>());
    kernels::gelu_backward(stream_, rows * cols, form, x32.as<float>(), dy32.as<float>(), gdx32.as<float>());
    EXPECT_EQ(down<std::uint16_t>(gy), rounded(down<float>(gy32)));
    EXPECT_EQ(down<std::uint16_t>(gdx), rounded(down<float>(gdx32)));
  }
}

// A residual's shortcut gradient added by LayerNorm's backward (dx_add) gives the bits of the add
// after it, in fp32 and bf16 storage, for rows reduced in one launch with the pass and apart; an
// fp32 dx's bf16 copy written in the same pass (dx_rounded) is the bits of to_bf16 after it.
TEST_P(TransformerKernels, LayerNormAddsTheShortcutsGradientAsTheAddAfterIt) {
  for (const bool bf16 : {false, true})
    for (const auto& [rows, cols] : {std::pair<index_t, index_t>{12, 40}, {1, 2 * kernels::kReduceMinChunk + 3}}) {
      SCOPED_TRACE(testing::Message() << (bf16 ? "bf16 " : "fp32 ") << rows << " x " << cols);
      const auto size = static_cast<std::size_t>(rows * cols);
      auto storage = [&](const std::vector<float>& v) { return bf16 ? up(test::bf16_bits(v)) : up(v); };
      DeviceBuffer x = storage(test::random_vector(size, 21, -3.0f, 3.0f)), dy = storage(test::random_vector(size, 22)),
                   add = storage(test::random_vector(size, 23));
      DeviceBuffer g = up(test::random_vector(static_cast<std::size_t>(cols), 24, 0.5f, 1.5f)),
                   b = up(test::random_vector(static_cast<std::size_t>(cols), 25));
      const std::size_t element = bf16 ? 2 : 4;
      DeviceBuffer y = device_->allocate(size * element), mean = floats(rows), rstd = floats(rows), dg = floats(cols),
                   db = floats(cols), sums = floats(2 * rows);
      const kernels::In xin(x.data(), bf16), dyin(dy.data(), bf16), addin(add.data(), bf16);
      kernels::layernorm_forward(stream_, rows, cols, xin, g.as<float>(), b.as<float>(), kernels::Out(y.data(), bf16),
                                 mean.as<float>(), rstd.as<float>());
      DeviceBuffer apart = device_->allocate(size * element), together = device_->allocate(size * element);
      kernels::layernorm_backward(stream_, rows, cols, xin, g.as<float>(), mean.as<float>(), rstd.as<float>(), dyin,
                                  kernels::Out(apart.data(), bf16), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                  false);
      kernels::add(stream_, rows * cols, kernels::In(apart.data(), bf16), addin, kernels::Out(apart.data(), bf16));
      kernels::layernorm_backward(stream_, rows, cols, xin, g.as<float>(), mean.as<float>(), rstd.as<float>(), dyin,
                                  kernels::Out(together.data(), bf16), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                  false, addin);
      if (bf16) {
        EXPECT_EQ(down<std::uint16_t>(together), down<std::uint16_t>(apart));
        EXPECT_THROW(
            kernels::layernorm_backward(stream_, rows, cols, xin, g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                        dyin, kernels::Out(together.data(), bf16), dg.as<float>(), db.as<float>(),
                                        sums.as<float>(), false, addin, kernels::Out(apart.as<std::uint16_t>())),
            InvalidArgument)
            << "a bf16 copy of a bf16 dx";
        continue;
      }
      EXPECT_EQ(down<float>(together), down<float>(apart));
      DeviceBuffer copy = device_->allocate(size * 2), cast = device_->allocate(size * 2);
      for (const bool with_add : {false, true}) {
        kernels::layernorm_backward(stream_, rows, cols, xin, g.as<float>(), mean.as<float>(), rstd.as<float>(), dyin,
                                    kernels::Out(together.data(), bf16), dg.as<float>(), db.as<float>(),
                                    sums.as<float>(), false, with_add ? addin : kernels::In(),
                                    kernels::Out(copy.as<std::uint16_t>()));
        kernels::to_bf16(stream_, rows * cols, together.as<float>(), cast.as<std::uint16_t>());
        EXPECT_EQ(down<std::uint16_t>(copy), down<std::uint16_t>(cast)) << (with_add ? "with dx_add" : "alone");
      }
    }
}

// The reductions follow the plan: cuda's LayerNorm statistics, sums and gradients are the sim's bits.
TEST(TransformerKernelsCudaMatchesSim, LayerNorm) {
  auto sim = test::sim_runtime(1);
  auto cuda = test::runtime_or_skip("cuda", 1);
  if (!cuda) GTEST_SKIP() << "no CUDA device";
  const index_t rows = 33, cols = 700;
  const auto size = static_cast<std::size_t>(rows * cols);
  const auto x = test::random_vector(size, 5, -4.0f, 4.0f), dy = test::random_vector(size, 6);
  const auto gamma = test::random_vector(static_cast<std::size_t>(cols), 7),
             beta = test::random_vector(static_cast<std::size_t>(cols), 8);
  std::vector<std::vector<float>> results[2];
  Runtime* runtimes[2] = {sim.get(), cuda.get()};
  for (int k = 0; k < 2; ++k) {
    Device& device = runtimes[k]->device(0);
    const Stream stream = device.create_stream();
    DeviceBuffer xd = test::upload(device, stream, x), g = test::upload(device, stream, gamma),
                 b = test::upload(device, stream, beta), dyd = test::upload(device, stream, dy);
    DeviceBuffer y = device.allocate(size * 4), mean = device.allocate(rows * 4), rstd = device.allocate(rows * 4),
                 dx = device.allocate(size * 4), dg = device.allocate(cols * 4), db = device.allocate(cols * 4),
                 sums = device.allocate(2 * rows * 4), copy = device.allocate(size * 2);
    kernels::layernorm_forward(stream, rows, cols, xd.as<float>(), g.as<float>(), b.as<float>(), y.as<float>(),
                               mean.as<float>(), rstd.as<float>());
    kernels::layernorm_backward(stream, rows, cols, xd.as<float>(), g.as<float>(), mean.as<float>(), rstd.as<float>(),
                                dyd.as<float>(), dx.as<float>(), dg.as<float>(), db.as<float>(), sums.as<float>(),
                                false, nullptr, kernels::Out(copy.as<std::uint16_t>()));
    for (const DeviceBuffer* buffer : {&y, &mean, &rstd, &dx, &dg, &db})
      results[k].push_back(test::download<float>(stream, *buffer));
    const auto bits = test::download<std::uint16_t>(stream, copy);
    results[k].emplace_back(bits.begin(), bits.end());
  }
  for (std::size_t i = 0; i < results[0].size(); ++i) EXPECT_EQ(results[0][i], results[1][i]) << "tensor " << i;
}

// The embedding's gradient sums in token order: cuda's bits are the sim's. Attention's GEMMs are
// cuBLAS's and its softmax uses the platform's expf: within fp32 rounding of the sim's.
TEST(TransformerKernelsCudaMatchesSim, EmbeddingAndAttention) {
  auto sim = test::sim_runtime(1);
  auto cuda = test::runtime_or_skip("cuda", 1);
  if (!cuda) GTEST_SKIP() << "no CUDA device";
  const index_t tokens = 3000, vocab = 256, dim = 48;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  for (std::size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<std::int32_t>((t * 7919 + t / 5) % vocab);
  const auto weight = test::random_vector(static_cast<std::size_t>(vocab * dim), 9),
             dy = test::random_vector(static_cast<std::size_t>(tokens * dim), 10);
  const kernels::AttentionShape s{2, 24, 3, 8};
  const auto qkv = test::random_vector(static_cast<std::size_t>(2 * 24 * 3 * 24), 11),
             ady = test::random_vector(static_cast<std::size_t>(2 * 24 * 24), 12);
  std::vector<std::vector<float>> results[2];
  Runtime* runtimes[2] = {sim.get(), cuda.get()};
  for (int k = 0; k < 2; ++k) {
    Device& device = runtimes[k]->device(0);
    const Stream stream = device.create_stream();
    DeviceBuffer idd = test::upload(device, stream, ids), w = test::upload(device, stream, weight),
                 dyd = test::upload(device, stream, dy), y = device.allocate(dy.size() * 4),
                 dw = device.allocate(weight.size() * 4), order = device.allocate(ids.size() * 4),
                 offsets = device.allocate((vocab + 1) * 4);
    kernels::embedding_forward(stream, tokens, vocab, dim, idd.as<std::int32_t>(), w.as<float>(), y.as<float>());
    kernels::embedding_backward(stream, tokens, vocab, dim, idd.as<std::int32_t>(), dyd.as<float>(), dw.as<float>(),
                                order.as<std::int32_t>(), offsets.as<std::int32_t>(), false);
    DeviceBuffer q = test::upload(device, stream, qkv), ad = test::upload(device, stream, ady),
                 probs = device.allocate(static_cast<std::size_t>(s.probs()) * 4), ay = device.allocate(ady.size() * 4),
                 dq = device.allocate(qkv.size() * 4),
                 scratch = device.allocate(static_cast<std::size_t>(s.probs()) * 4);
    kernels::attention_forward(stream, s, q.as<float>(), probs.as<float>(), ay.as<float>());
    kernels::attention_backward(stream, s, q.as<float>(), probs.as<float>(), ad.as<float>(), dq.as<float>(),
                                scratch.as<float>());
    for (const DeviceBuffer* buffer : {&y, &dw, &probs, &ay, &dq})
      results[k].push_back(test::download<float>(stream, *buffer));
    // With attn_dropout: the same Philox masks on both backends.
    DeviceBuffer dropped = device.allocate(static_cast<std::size_t>(s.probs()) * 4);
    const kernels::AttentionDropout dropout{0.25, {7, 11, 3}, 40, dropped.as<float>()};
    kernels::attention_forward(stream, s, q.as<float>(), probs.as<float>(), ay.as<float>(), dropout);
    kernels::attention_backward(stream, s, q.as<float>(), probs.as<float>(), ad.as<float>(), dq.as<float>(),
                                scratch.as<float>(), dropout);
    for (const DeviceBuffer* buffer : {&dropped, &ay, &dq})
      results[k].push_back(test::download<float>(stream, *buffer));
  }
  EXPECT_EQ(results[0][0], results[1][0]) << "embedding forward";
  EXPECT_EQ(results[0][1], results[1][1]) << "embedding weight gradient";
  for (std::size_t i = 2; i < 8; ++i)
    EXPECT_TRUE(all_close(results[1][i], results[0][i], 1e-5, 1e-6)) << "attention " << i;
}

// attn_dropout is dropout_forward on the probabilities: y = dropped . v, with dropped the kept
// probabilities over 1 - p (from the same key and element offset), and the backward's dv that
// product's transpose; checked against the pieces on the host.
TEST(TransformerKernels, AttentionDropoutWeighsTheValuesWithTheDroppedProbabilities) {
  auto rt = test::sim_runtime(1);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  const kernels::AttentionShape s{2, 5, 2, 3};
  const std::size_t n = static_cast<std::size_t>(s.probs()), c = static_cast<std::size_t>(s.width());
  const auto qkv = test::random_vector(2 * 5 * 3 * c, 21), dy = test::random_vector(2 * 5 * c, 22);
  DeviceBuffer q = test::upload(device, stream, qkv), d = test::upload(device, stream, dy),
               probs = device.allocate(n * 4), dropped = device.allocate(n * 4), y = device.allocate(dy.size() * 4),
               dq = device.allocate(qkv.size() * 4), scratch = device.allocate(n * 4), ones = device.allocate(n * 4),
               mask = device.allocate(n * 4);
  const kernels::DropoutKey key{5, 9, 2};
  const kernels::AttentionDropout dropout{0.5, key, 100, dropped.as<float>()};
  kernels::attention_forward(stream, s, q.as<float>(), probs.as<float>(), y.as<float>(), dropout);
  kernels::attention_backward(stream, s, q.as<float>(), probs.as<float>(), d.as<float>(), dq.as<float>(),
                              scratch.as<float>(), dropout);
  kernels::fill(stream, ones.as<float>(), static_cast<index_t>(n), 1.0f);
  kernels::dropout_forward(stream, static_cast<index_t>(n), 0.5, key, 100, ones.as<float>(), mask.as<float>());
  const auto p = test::download<float>(stream, probs), m = test::download<float>(stream, mask),
             got_dropped = test::download<float>(stream, dropped), got_y = test::download<float>(stream, y),
             got_dq = test::download<float>(stream, dq);
  int kept = 0, dropped_count = 0;
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got_dropped[i], p[i] * m[i]) << i;
    if (p[i] > 0.0f) (m[i] == 0.0f ? dropped_count : kept)++;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(dropped_count, 0);
  // y[b, i, h*D + e] = sum_j dropped[b, h, i, j] v[b, j, h*D + e]; dv[b, j, hD+e] = sum_i dropped[b,h,i,j]
  // dy[b,i,hD+e].
  const int T = s.tokens, D = s.head_dim, H = s.heads;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i)
        for (int e = 0; e < D; ++e) {
          double want_y = 0.0, want_dv = 0.0;
          for (int j = 0; j < T; ++j) {
            const std::size_t pij = ((static_cast<std::size_t>(b) * H + h) * T + i) * T + j;
            const std::size_t pji = ((static_cast<std::size_t>(b) * H + h) * T + j) * T + i;
            want_y += got_dropped[pij] * qkv[(static_cast<std::size_t>(b) * T + j) * 3 * c + 2 * c + h * D + e];
            want_dv += got_dropped[pji] * dy[(static_cast<std::size_t>(b) * T + j) * c + h * D + e];
          }
          EXPECT_NEAR(got_y[(static_cast<std::size_t>(b) * T + i) * c + h * D + e], want_y, 1e-5);
          EXPECT_NEAR(got_dq[(static_cast<std::size_t>(b) * T + i) * 3 * c + 2 * c + h * D + e], want_dv, 1e-5);
        }
}

}  // namespace
}  // namespace dp
