// dp/io/sample_source.h — what a BatchLoader fills its batches from: N samples of one shape {C, H, W},
// each made on demand as float32 features (an MNIST image divided and normalised, an image file decoded
// and augmented) or int32 token ids (a window of text) with its class, or its classes (a text window's
// next tokens).
// torch.utils.data.Dataset's __getitem__, with the random draws of an augmentation keyed rather than taken from a
// generator's state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dp/nn/batch.h"
#include "dp/runtime/shape.h"

namespace dp {

// Which draw a random augmentation takes for a sample: a pure function of (seed, rank, epoch,
// sample index), so a run is reproducible, ranks augment differently, and a resumed run draws what
// the uninterrupted one drew (there is no generator state to save).
struct SampleKey {
  std::uint64_t seed = 0;
  std::int64_t rank = 0;
  std::int64_t epoch = 0;
};

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual std::size_t size() const = 0;
  // {C, H, W} of every sample the source makes.
  virtual std::vector<std::int64_t> sample_shape() const = 0;
  // The number of classes; labels lie in [0, num_classes()).
  virtual int num_classes() const = 0;
  virtual std::int64_t label(std::size_t index) const = 0;
  // Class targets per sample: 1 (label()), or a sequence's one per position (next-token targets).
  virtual int targets_per_sample() const { return 1; }
  // Writes sample `index`'s targets_per_sample() targets to `out` (by default its label).
  virtual void fill_targets(std::size_t index, std::int64_t* out) const { *out = label(index); }
  // What a sample's elements are: f32 features, or i32 token ids (a language model's input).
  virtual DType sample_dtype() const { return DType::f32; }
  // Writes sample `index` (< size()) as C*H*W elements (CHW) of sample_dtype() to `out` (of that
  // dtype). Called from several loader threads at once for different samples; throws dp::Error
  // naming what is wrong with the sample (an unreadable file).
  virtual void fill(std::size_t index, const SampleKey& key, InputsOut out) const = 0;

  // Whether the source orders its samples itself (llm.c's token shards): the sampler then visits
  // positions in order instead of shuffling, and sample_at says which sample stands at each.
  virtual bool keeps_its_order() const { return false; }
  // The sample at `position` of epoch `epoch`'s order, for a source that keeps its own order; for
  // the others the position is the sample.
  virtual std::size_t sample_at(std::size_t position, std::int64_t /*epoch*/) const { return position; }

  std::size_t sample_elements() const { return numel(sample_shape()); }
};

}  // namespace dp
