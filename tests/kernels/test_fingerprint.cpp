// test_fingerprint.cpp — the device fingerprint (dp/kernels/fingerprint.h) on each backend: the
// host's sum of the same terms, bit for bit (cuda against the host result, as every kernel); any one
// bit flipped changes it; parts add up to the whole; flip_bit flips exactly one bit.
#include <cstdint>
#include <gtest/gtest.h>
#include <set>
#include <vector>

#include "dp/kernels/fingerprint.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

class FingerprintTest : public test::BackendTest {
 protected:
  std::uint64_t on_device(const std::vector<std::uint32_t>& words, std::uint64_t first = 0) {
    DeviceBuffer w = up(words), out = device_->allocate(sizeof(std::uint64_t));
    kernels::fingerprint(stream_, static_cast<kernels::index_t>(words.size()), w.as<std::uint32_t>(), first,
                         out.as<std::uint64_t>(), false);
    return down<std::uint64_t>(out)[0];
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, FingerprintTest, ::testing::Values("sim", "cuda"),
                         [](const auto& info) { return info.param; });

std::vector<std::uint32_t> words(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> out(n);
  std::uint32_t x = seed;
  for (auto& w : out) w = x = x * 1664525u + 1013904223u;
  return out;
}

TEST_P(FingerprintTest, IsTheHostsSumOfTheSameTerms) {
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{100003}}) {
    const auto w = words(n, static_cast<std::uint32_t>(n));
    std::uint64_t host = 0;
    const kernels::FingerprintWords term{w.data(), 5};
    for (std::size_t k = 0; k < n; ++k) host += term(0, static_cast<kernels::index_t>(k)).value;
    EXPECT_EQ(on_device(w, 5), host) << n << " words";
  }
}

TEST_P(FingerprintTest, AnyOneBitFlippedChangesIt) {
  const auto w = words(64, 3);
  const std::uint64_t base = on_device(w);
  std::set<std::uint64_t> seen{base};
  for (std::size_t k = 0; k < w.size(); k += 9)
    for (int bit = 0; bit < 32; bit += 5) {
      auto flipped = w;
      flipped[k] ^= 1u << bit;
      EXPECT_TRUE(seen.insert(on_device(flipped)).second) << "word " << k << " bit " << bit;
    }
  // The same words at other places (a swap) change it too.
  auto swapped = w;
  std::swap(swapped[0], swapped[1]);
  EXPECT_NE(on_device(swapped), base);
}

TEST_P(FingerprintTest, PartsAddUpAndFlipBitFlipsOneBit) {
  const auto w = words(1000, 11);
  DeviceBuffer d = up(w), out = device_->allocate(sizeof(std::uint64_t));
  kernels::fingerprint(stream_, 600, d.as<std::uint32_t>(), 0, out.as<std::uint64_t>(), false);
  kernels::fingerprint(stream_, 400, d.as<std::uint32_t>() + 600, 600, out.as<std::uint64_t>(), true);
  kernels::fingerprint(stream_, 0, nullptr, 0, out.as<std::uint64_t>(), true);  // nothing to add
  EXPECT_EQ(down<std::uint64_t>(out)[0], on_device(w));
  kernels::flip_bit(stream_, d.as<std::uint32_t>() + 17, 22);
  const auto after = down<std::uint32_t>(d);
  for (std::size_t k = 0; k < w.size(); ++k) EXPECT_EQ(after[k], k == 17 ? w[k] ^ (1u << 22) : w[k]) << k;
  EXPECT_THROW(kernels::flip_bit(stream_, d.as<std::uint32_t>(), 32), InvalidArgument);
  EXPECT_THROW(kernels::fingerprint(stream_, 2, d.as<std::uint32_t>(), 0xffffffffULL, out.as<std::uint64_t>(), false),
               InvalidArgument);
}

}  // namespace
}  // namespace dp
