// test_low_precision.cpp — formats narrower than fp32: bfloat16 as the GPU rounds it
// (dp/runtime/bfloat16.h), the bf16 all-reduce of every communicator, DDP's bf16 gradient reduction
// (torch's bf16_compress_hook), and TF32 GEMMs (Precision::tf32). The kernel, GEMM and collective
// bodies run on sim and on cuda where there is a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <limits>
#include <string>
#include <vector>

#include "ddp_data.h"
#include "dp/engines/ddp.h"
#include "dp/engines/trainer.h"
#include "dp/kernels/ops.h"
#include "dp/models/convnet.h"
#include "dp/runtime/bfloat16.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/device_group.h"
#include "dp/runtime/precision.h"
#include "test_util.h"

namespace dp {
namespace {

std::uint16_t bits_of(std::uint32_t float_bits) {
  float x = 0.0f;
  std::memcpy(&x, &float_bits, sizeof(x));
  return bf16_from_float(x);
}

// Round to nearest, ties to even, on the bits; NaN to CUDA's 0x7fff; overflow to infinity.
TEST(Bf16, RoundsToNearestEvenAsTheGpu) {
  EXPECT_EQ(bits_of(0x3f800000u), 0x3f80u);  // 1
  EXPECT_EQ(bits_of(0x3f808000u), 0x3f80u);  // 1 + 2^-8: a tie, to the even 1
  EXPECT_EQ(bits_of(0x3f818000u), 0x3f82u);  // a tie above an odd value: up
  EXPECT_EQ(bits_of(0x3f808001u), 0x3f81u);  // just above the tie
  EXPECT_EQ(bits_of(0x3f807fffu), 0x3f80u);  // just below it
  EXPECT_EQ(bits_of(0xbf808001u), 0xbf81u);  // negative values round their magnitude
  EXPECT_EQ(bits_of(0x7f7fffffu), 0x7f80u);  // the largest float: past bf16's largest, infinity
  EXPECT_EQ(bits_of(0x7f7f7fffu), 0x7f7fu);  // bf16's largest stays
  EXPECT_EQ(bits_of(0xff800000u), 0xff80u);  // -infinity
  EXPECT_EQ(bits_of(0x7fc00000u), 0x7fffu);  // NaN: the GPU's one bf16 NaN
  EXPECT_EQ(bits_of(0xffc00001u), 0x7fffu);
  EXPECT_EQ(bits_of(0x00008000u), 0x0000u);  // subnormal tie to even (0)
  EXPECT_EQ(bits_of(0x00018000u), 0x0002u);
  EXPECT_EQ(bits_of(0x80000000u), 0x8000u);          // -0 keeps its sign
  for (std::uint32_t b = 0; b < 0x10000u; b += 7) {  // every bf16 value is a float exactly
    const auto h = static_cast<std::uint16_t>(b);
    if ((h & 0x7fffu) > 0x7f80u) continue;  // NaNs
    EXPECT_EQ(bf16_from_float(bf16_to_float(h)), h);
  }
  EXPECT_EQ(bf16_add(bf16_from_float(1.0f), bf16_from_float(0.00390625f)), 0x3f80u);  // 1 + 2^-8: tie to even
  EXPECT_EQ(bf16_add(bf16_from_float(1.0f), bf16_from_float(0.01171875f)), 0x3f82u);  // 1 + 3 * 2^-8 -> up
}

class LowPrecisionOnBackend : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Backends, LowPrecisionOnBackend, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

// The compression kernels give the shared functors' bits on the device.
TEST_P(LowPrecisionOnBackend, CompressionKernelsGiveTheHostBits) {
  DP_RUNTIME_OR_SKIP(rt, GetParam(), 1);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  std::vector<float> x = test::random_vector(4099, 3, -10.0f, 10.0f);
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = std::numeric_limits<float>::infinity();
  x[2] = 3.0e38f;
  x[3] = 1.0e-40f;
  const float scale = 1.0f / 3.0f;
  const DeviceBuffer in = test::upload(device, stream, x);
  DeviceBuffer packed = device.allocate(x.size() * sizeof(std::uint16_t));
  DeviceBuffer out = device.allocate(x.size() * sizeof(float));
  const auto n = static_cast<kernels::index_t>(x.size());
  kernels::to_bf16_scaled(stream, n, in.as<float>(), scale, packed.as<std::uint16_t>());
  kernels::from_bf16(stream, n, packed.as<std::uint16_t>(), out.as<float>());
  const auto got = test::download<std::uint16_t>(stream, packed);
  const auto widened = test::download<float>(stream, out);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t want = bf16_from_float(bf16_to_float(bf16_from_float(x[i])) * scale);
    ASSERT_EQ(got[i], want) << i << ": " << x[i];
    const float back = bf16_to_float(want);
    ASSERT_TRUE(std::memcmp(&widened[i], &back, sizeof(float)) == 0) << i;
  }
}

// Every rank gets the bf16 sum, each addition rounded to bf16 in the ring's order (the sim ring and
// the device ring: bit for bit; NCCL adds in its own order: within bf16's rounding per addition),
// and the ring moves half the bytes of the fp32 all-reduce.
TEST_P(LowPrecisionOnBackend, AllReduceSumsInBf16WithHalfTheBytes) {
  const bool sim = GetParam() == "sim";
  for (int n = 1; n <= 4; ++n) {
    for (const std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{1001}}) {
      SCOPED_TRACE(fmt::format("N={} count={}", n, count));
      DP_RUNTIME_OR_SKIP(rt, GetParam(), n);
      std::vector<int> ids(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
      DeviceGroup group(*rt, ids);
      const auto comm = Communicator::create(group);
      const bool exact = sim || shares_a_gpu(group);
      std::vector<std::vector<std::uint16_t>> inputs;
      for (int r = 0; r < n; ++r) {
        std::vector<std::uint16_t> v(count);
        const auto values = test::random_vector(count, static_cast<unsigned>(10 * r + count), -4.0f, 4.0f);
        for (std::size_t i = 0; i < count; ++i) v[i] = bf16_from_float(values[i]);
        inputs.push_back(v);
      }
      std::vector<DeviceBuffer> data;
      std::vector<Stream> streams;
      for (int r = 0; r < n; ++r) {
        streams.push_back(group.device(r).create_stream());
        data.push_back(test::upload(group.device(r), streams.back(), inputs[static_cast<std::size_t>(r)]));
      }
      rt->reset_link_traffic();
      group.run([&](int r) {
        comm->all_reduce_bf16(r, streams[static_cast<std::size_t>(r)],
                              data[static_cast<std::size_t>(r)].as<std::uint16_t>(), count);
      });
      // The ring's order: chunk c starts at rank c and collects ranks c+1, ..., c+n-1 in turn.
      std::vector<std::uint16_t> want(count);
      for (int c = 0; c < n; ++c) {
        const std::size_t begin = count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n);
        const std::size_t end = count * static_cast<std::size_t>(c + 1) / static_cast<std::size_t>(n);
        for (std::size_t i = begin; i < end; ++i) {
          std::uint16_t acc = inputs[static_cast<std::size_t>(c)][i];
          for (int k = 1; k < n; ++k) acc = bf16_add(inputs[static_cast<std::size_t>((c + k) % n)][i], acc);
          want[i] = acc;
        }
      }
      for (int r = 0; r < n; ++r) {
        const auto got =
            test::download<std::uint16_t>(streams[static_cast<std::size_t>(r)], data[static_cast<std::size_t>(r)]);
        if (exact) {
          EXPECT_EQ(got, want) << "rank " << r;
          continue;
        }
        for (std::size_t i = 0; i < count; ++i) {
          double magnitude = 0.0;
          for (int k = 0; k < n; ++k) magnitude += std::fabs(bf16_to_float(inputs[static_cast<std::size_t>(k)][i]));
          EXPECT_NEAR(bf16_to_float(got[i]), bf16_to_float(want[i]), n * magnitude * 0x1p-8) << "rank " << r;
        }
      }
      if (!sim) continue;
      std::uint64_t sent = 0;
      for (int r = 0; r < n; ++r) sent += rt->bytes_sent(r);
      EXPECT_EQ(sent, 2u * static_cast<std::uint64_t>(n - 1) * count * sizeof(std::uint16_t)) << "half of fp32's";
    }
  }
}

// DDP with GradReduce::bf16 computes torch's bf16_compress_hook. Two ranks with the same shard make
// it exact: each compresses bf16(g) / 2 (a power of two: exact), their bf16 sum is bf16(g) again,
// so the reduced gradient is the one-device gradient rounded to bf16, bit for bit; and both
// replicas stay identical.
TEST_P(LowPrecisionOnBackend, DdpReducesGradientsAsBf16CompressHook) {
  DP_RUNTIME_OR_SKIP(rt, GetParam(), 2);
  const SgdOptions sgd{0.05f, 0.0f, 0.0f, false};
  auto model = models::make_convnet(rt->device(0), 7), reference = models::make_convnet(rt->device(0), 7);
  EngineOptions options;
  options.device_ids = std::vector<int>{0, 1};
  options.grad_reduce = GradReduce::bf16;
  options.bucket_cap_mb = 0.02;  // several buckets
  options.first_bucket_mb = 0.01;
  options.check_replicas = true;
  DistributedDataParallel ddp(*rt, *model, sgd, options);
  SingleDeviceTrainer single(*reference, sgd);
  const test::Data data = test::make_data(6, 5);
  std::vector<Batch> same = test::shards(data, 0, 1, 6);
  same.push_back(same.front());
  const float loss = ddp.train_step(same);
  EXPECT_EQ(loss, single.train_step(data.x.data(), data.y.data(), 6));
  ddp.synchronize();
  const Stream stream = rt->device(0).create_stream();
  const auto grads_of = [&](const Model& m) {
    std::vector<float> g(m.param_count());
    Stream s = m.device().create_stream();
    s.copy(g.data(), m.grads_flat(), g.size() * sizeof(float));
    s.synchronize();
    return g;
  };
  const std::vector<float> one_device = grads_of(*reference);
  for (int r = 0; r < 2; ++r) {
    const std::vector<float> reduced = grads_of(ddp.replica(r));
    ASSERT_EQ(reduced.size(), one_device.size());
    for (std::size_t i = 0; i < reduced.size(); ++i) {
      const float want = bf16_to_float(bf16_from_float(one_device[i]));
      ASSERT_EQ(std::memcmp(&reduced[i], &want, sizeof(float)), 0)
          << "rank " << r << " element " << i << ": " << reduced[i] << " vs bf16(" << one_device[i] << ")";
    }
  }
}

// TF32: 10 explicit mantissa bits, to nearest with ties away from zero.
TEST(Tf32, RoundsToNearestTiesAway) {
  const auto tf32 = [](std::uint32_t float_bits) {
    float x = 0.0f;
    std::memcpy(&x, &float_bits, sizeof(x));
    const float r = kernels::round_to_tf32(x);
    std::uint32_t out = 0;
    std::memcpy(&out, &r, sizeof(out));
    return out;
  };
  EXPECT_EQ(tf32(0x3f800000u), 0x3f800000u);
  EXPECT_EQ(tf32(0x3f801000u), 0x3f802000u);  // 1 + 2^-11: a tie, away from zero (not to even)
  EXPECT_EQ(tf32(0x3f800fffu), 0x3f800000u);
  EXPECT_EQ(tf32(0xbf801000u), 0xbf802000u);  // negative ties go away from zero too
  EXPECT_EQ(tf32(0x3f803000u), 0x3f804000u);
  EXPECT_EQ(tf32(0x7f7fffffu), 0x7f800000u);  // the largest float rounds to infinity
  EXPECT_EQ(tf32(0xff800000u), 0xff800000u);
  EXPECT_EQ(tf32(0x7fc00123u), 0x7fc00123u);  // NaN as it is
}

// A GEMM under Precision::tf32 multiplies TF32-rounded operands exactly and accumulates in fp32:
// visibly off the fp32 product where the operands' low mantissa bits matter. The sim rounds to
// nearest, ties away (round_to_tf32), so it is within fp32 accumulation error of the rounded
// operands' product. How a GPU's tensor cores convert fp32 to TF32 is not documented (round or
// truncate), so on cuda only the TF32 bound holds: each product off by at most two roundings of 2^-10.
// The shape is one cuBLAS runs on tensor cores: extents and leading dimensions multiples of 16.
TEST_P(LowPrecisionOnBackend, Tf32GemmRoundsBothOperands) {
  RuntimeOptions options;
  options.backend = GetParam();
  options.sim_devices = 1;
  options.precision = Precision::tf32;
  if (GetParam() == "cuda" && Runtime::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto rt = Runtime::create(options);
  Device& device = rt->device(0);
  const Stream stream = device.create_stream();
  const int m = 32, n = 16, k = 256;
  std::vector<float> a = test::random_vector(static_cast<std::size_t>(m) * k, 1, -1.0f, 1.0f);
  std::vector<float> b = test::random_vector(static_cast<std::size_t>(k) * n, 2, -1.0f, 1.0f);
  for (float& x : a) x = 1.0f + 0x1p-12f * std::round(x * 8.0f);  // values TF32 cannot hold
  const DeviceBuffer da = test::upload(device, stream, a), db = test::upload(device, stream, b);
  DeviceBuffer dc = device.allocate(static_cast<std::size_t>(m) * n * sizeof(float));
  kernels::gemm(stream, false, false, m, n, k, 1.0f, da.as<float>(), k, db.as<float>(), n, 0.0f, dc.as<float>(), n);
  const std::vector<float> c = test::download<float>(stream, dc);
  double worst_rounded = 0.0, worst_exact = 0.0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double rounded = 0.0, exact = 0.0, magnitude = 0.0;
      for (int p = 0; p < k; ++p) {
        const float x = a[static_cast<std::size_t>(i * k + p)], y = b[static_cast<std::size_t>(p * n + j)];
        rounded += static_cast<double>(kernels::round_to_tf32(x)) * kernels::round_to_tf32(y);
        exact += static_cast<double>(x) * y;
        magnitude += std::fabs(static_cast<double>(x) * y);
      }
      const double got = c[static_cast<std::size_t>(i * n + j)];
      worst_rounded = std::max(worst_rounded, std::fabs(got - rounded) / magnitude);
      worst_exact = std::max(worst_exact, std::fabs(got - exact) / magnitude);
    }
  EXPECT_GT(worst_exact, 1e-5) << "the operands were rounded";
  if (GetParam() == "cuda") {
    EXPECT_LT(worst_exact, 2 * 0x1p-10 + k * 0x1p-24) << "within TF32's rounding of both operands";
    return;
  }
  EXPECT_LT(worst_rounded, k * 0x1p-24) << "fp32 accumulation of the TF32 products";
  EXPECT_GT(worst_exact, 16 * worst_rounded) << "the operands were rounded";
}

}  // namespace
}  // namespace dp
