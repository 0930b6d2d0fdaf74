// dp/kernels/fingerprint.h — a 64-bit fingerprint of device memory, computed on the device in one
// read (no host copy), the same bits on every backend: what the replicas of a step compare to catch
// silent corruption (EngineOptions::check_replicas). And flip_bit, the corruption fault injection
// makes (DP_FAULT flip-param and flip-gemm).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// Word i of a buffer, keyed by its index: splitmix64's finaliser of (i << 32 | word), a bijection of
// the 64-bit input, so for one index two words never map to one value.
DP_HD inline std::uint64_t fingerprint_word(std::uint64_t index, std::uint32_t word) {
  std::uint64_t z = (index << 32 | word) + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The fingerprint is the wrapping sum of fingerprint_word over the words: a sum, so any summation
// order gives the same bits (no backend or reduction plan can change it), and a change of any one
// word always changes it (its term changes, the others do not); two changes cancel with a
// probability of about 2^-64.
struct Fingerprint {
  std::uint64_t value = 0;
  DP_HD Fingerprint operator+(Fingerprint other) const { return {value + other.value}; }
};

// *out = (accumulate ? *out : 0) + the fingerprint of the n words at `words`, word k keyed by index
// first_index + k (so consecutive calls over one buffer's parts add up to its fingerprint).
// n < 2^32 - first_index. Enqueued on `stream`; `out` is device memory.
void fingerprint(const Stream& stream, index_t n, const std::uint32_t* words, std::uint64_t first_index,
                 std::uint64_t* out, bool accumulate);

// Flips bit `bit` (0..31) of the word at `word`: a silent corruption, on purpose.
void flip_bit(const Stream& stream, std::uint32_t* word, int bit);
// DP_FAULT flip-gemm (progress::flip_this_output): bit 31 of the first word of the `bytes` (>= 4)
// of output that the GEMM or convolution just enqueued on `stream` wrote, when the fault strikes:
// the sign of an fp32 output, which a ReLU after it cannot hide (a mantissa bit of a negative
// pre-activation would be zeroed away).
void flip_if_faulty(const Stream& stream, void* output, std::size_t bytes);

// The launchers' functors, here for the tests' host references.
struct FingerprintWords {
  const std::uint32_t* words;
  std::uint64_t first_index;
  DP_HD Fingerprint operator()(index_t, index_t k) const {
    return {fingerprint_word(first_index + static_cast<std::uint64_t>(k), words[k])};
  }
};
struct StoreFingerprint {
  std::uint64_t* out;
  bool accumulate;
  DP_HD void operator()(index_t, Fingerprint sum) const { out[0] = (accumulate ? out[0] : 0) + sum.value; }
};
struct ClearFingerprint {
  std::uint64_t* out;
  DP_HD void operator()(index_t) const { out[0] = 0; }
};
struct FlipBit {
  std::uint32_t* word;
  std::uint32_t mask;
  DP_HD void operator()(index_t) const { word[0] ^= mask; }
};

}  // namespace dp::kernels
