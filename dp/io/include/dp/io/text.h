// dp/io/text.h — a text file as training data for a byte-level language model: its bytes are the
// tokens (vocabulary 256, no tokenizer), the first 90 % trained on, the last 10 % held out. A sample
// is a window of context + 1 bytes: `context` byte ids as the model's int32 token ids and the `context`
// bytes after each as its next-token targets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dp/io/sample_source.h"

namespace dp {

inline constexpr int kByteVocabulary = 256;

// The bytes of a text file and where its held-out tail begins (size - size / 10).
struct TextCorpus {
  std::vector<std::uint8_t> bytes;
  std::size_t split = 0;
};

// Reads `path` whole. Throws dp::Error naming the file and the problem: missing, not a regular file
// (a directory, a FIFO), unreadable, or too short to hold one window of context + 1 bytes in each
// split (at least 10 * (context + 1) bytes).
TextCorpus load_text(const std::string& path, int context);

// The windows of one split. Training: a window at every offset of the split (size - context
// samples), drawn in the sampler's shuffled order (keyed by seed and epoch, sharded per rank, as
// every data set). Held out: the split cut into disjoint windows ((size - 1) / context samples), so
// each byte is predicted at most once and validation loss is per byte.
class TextWindows : public SampleSource {
 public:
  enum class Split { train, held_out };
  TextWindows(std::shared_ptr<const TextCorpus> corpus, Split split, int context);

  std::size_t size() const override { return count_; }
  std::vector<std::int64_t> sample_shape() const override { return {context_}; }
  int num_classes() const override { return kByteVocabulary; }
  std::int64_t label(std::size_t index) const override { return byte(start(index) + 1); }
  int targets_per_sample() const override { return context_; }
  DType sample_dtype() const override { return DType::i32; }
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override;
  void fill_targets(std::size_t index, std::int64_t* out) const override;

 private:
  std::size_t start(std::size_t index) const { return begin_ + index * stride_; }
  std::int64_t byte(std::size_t at) const { return corpus_->bytes[at]; }

  std::shared_ptr<const TextCorpus> corpus_;
  int context_;
  std::size_t begin_ = 0, stride_ = 1, count_ = 0;
};

}  // namespace dp
