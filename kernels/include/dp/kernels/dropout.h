// dp/kernels/dropout.h — Dropout in training (torch.nn.Dropout's arithmetic) with a counter-based generator,
// Philox4x32-10 from Random123: the backward recomputes the mask instead of storing it.
#pragma once

#include <Random123/philox.h>
#include <cmath>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

// Whether element e is kept is a pure function of (seed, layer_id, step, e), with e the element's
// index in the global tensor. Counter-based rather than a stateful generator, because then:
// - the backward recomputes the mask from the key: nothing is stored between forward and backward;
// - sim and cuda, any device and any thread count draw the same bits for the same element;
// - a run resumed at step k draws what the uninterrupted run drew (there is no generator state to
//   checkpoint, the step is part of the key);
// - a data-parallel rank holding elements [offset, offset + n) of the global batch draws exactly
//   the bits one device holding the whole batch would.
// torch's masks come from its own generator: the masks differ from torch's, the arithmetic not.
// The step may live in device memory (`step_on_device`, of the stream's device): read when the kernel
// runs, not baked into its launch, so a step captured into a graph draws the step of each replay.
struct DropoutKey {
  std::uint64_t seed = 0;                         // the run's seed: Philox's 64-bit key
  std::uint32_t layer_id = 0;                     // which dropout layer: distinct layers draw independent masks
  std::uint32_t step = 0;                         // the training step: a fresh mask every step
  const std::uint32_t* step_on_device = nullptr;  // when set, the step is read from here instead
};

// y[i] = x[i] * noise(element_offset + i) for i in [0, n), as torch's `input * noise` with
// noise.bernoulli_(1 - p).div_(1 - p) (_dropout_impl, Dropout.cpp): noise is 1.0f / float(1 - p)
// for a kept element and 0 for a dropped one, so a dropped element is x * 0 (-0 for a negative x,
// NaN for NaN or infinity), bit for bit torch's values for the same mask.
// x and y (dy and dx) of one storage type, fp32 or bf16 (storage.h: the product rounded once).
// p = 0 copies x (torch returns the input); p = 1 gives x * 0 (torch: input * zeros). p outside
// [0, 1] (or NaN) or a negative element_offset: InvalidArgument. x and y may be the same buffer.
void dropout_forward(const Stream& stream, index_t n, double p, const DropoutKey& key, index_t element_offset, In x,
                     Out y);

// dx = dy * noise, the mask recomputed from the same key and offset (torch: grad * noise).
void dropout_backward(const Stream& stream, index_t n, double p, const DropoutKey& key, index_t element_offset, In dy,
                      Out dx);

// An element is kept iff its 24-bit draw (word >> 8) is at least ceil(p * 2^24), in [1, 2^24] (p = 1:
// 2^24, above every draw); a kept one is multiplied by torch's noise.div_(1 - p): 1 - p in double,
// rounded to float, then a float division.
inline std::uint32_t dropout_threshold(double p) { return static_cast<std::uint32_t>(std::ceil(p * 16777216.0)); }
inline float dropout_noise_kept(double p) { return p < 1.0 ? 1.0f / static_cast<float>(1.0 - p) : 0.0f; }

// ------------------------------------------------------------------------------------------------
// functors

// The random words of elements 4*block .. 4*block + 3: Philox4x32-10 at counter
// {block (low, high 32 bits), layer_id, step} under key {seed (low, high 32 bits)}. Element e
// takes word e % 4 of block e / 4; u = (word >> 8) * 2^-24 in [0, 1) and it is kept iff u >= p.
DP_HD inline r123::Philox4x32::ctr_type dropout_words(const DropoutKey& key, std::uint64_t block) {
  const std::uint32_t step = key.step_on_device ? *key.step_on_device : key.step;
  const r123::Philox4x32::ctr_type counter = {
      {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), key.layer_id, step}};
  const r123::Philox4x32::key_type philox_key = {
      {static_cast<std::uint32_t>(key.seed), static_cast<std::uint32_t>(key.seed >> 32)}};
  return r123::Philox4x32()(counter, philox_key);
}

// An element's noise from its word: noise_kept when the 24-bit draw (word >> 8) reaches the
// threshold, else 0.
DP_HD inline float dropout_noise(std::uint32_t word, std::uint32_t threshold, float noise_kept) {
  return (word >> 8) >= threshold ? noise_kept : 0.0f;
}

// One thread per block of four elements: one Philox call yields the four words. The blocks at
// either end may be partly outside [offset, offset + n) when the offset is not a multiple of 4.
template <class T = float>
struct DropoutApply {
  DropoutKey key;
  // u >= p as integers: (word >> 8) * 2^-24 >= p <=> (word >> 8) >= ceil(p * 2^24) (exact in double).
  std::uint32_t threshold;
  float noise_kept;  // 1.0f / float(1 - p)
  index_t offset, n;
  std::uint64_t first_block;  // offset / 4
  const T* x;
  T* y;
  DP_HD void operator()(index_t b) const {
    const std::uint64_t block = first_block + static_cast<std::uint64_t>(b);
    const r123::Philox4x32::ctr_type words = dropout_words(key, block);
    for (int j = 0; j < 4; ++j) {
      const index_t i = static_cast<index_t>(block * 4 + j) - offset;
      if (i < 0 || i >= n) continue;
      // x * 0 rather than 0 for a dropped element: torch multiplies by its noise either way.
      store(y, i, load(x, i) * dropout_noise(words.v[j], threshold, noise_kept));
    }
  }
};

}  // namespace dp::kernels
