// dp/io/llmc.h — llm.c's files: the GPT-2 model files train_gpt2.c reads (header magic 20240326,
// version 3 fp32 or 5 bf16) under nanoGPT's tensor names, and the token shards of its dev/data
// scripts (magic 20240520, uint16 tokens) as training samples in llm.c's DataLoader order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/io/sample_source.h"

namespace dp::llmc {

inline constexpr std::int32_t kModelMagic = 20240326;
inline constexpr std::int32_t kTokensMagic = 20240520;
inline constexpr std::int32_t kTokenizerMagic = 20240328;
// Both files begin with 256 int32s of header.
inline constexpr std::size_t kHeaderBytes = 256 * sizeof(std::int32_t);

// A model file's header: version, then maxT, V, L, NH, C and the padded Vp (train_gpt2.c's order of
// the fields is magic, version, maxT, V, L, NH, C, Vp).
struct ModelConfig {
  int max_seq_len = 0;   // maxT: wpe's rows
  int vocab = 0;         // V
  int layers = 0;        // L
  int heads = 0;         // NH
  int channels = 0;      // C
  int padded_vocab = 0;  // Vp >= V: wte's rows
};

// train_gpt2.c's parameter tensors in its file's order, under nanoGPT's names, with their shapes:
// wte (Vp, C), wpe (maxT, C), then each per-layer tensor for every layer in turn (ln_1 weight and
// bias, c_attn weight (3C, C) and bias, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj), then ln_f.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_layout(const ModelConfig& config);

// Whether `path` is a readable file that begins with the model magic.
bool is_model_file(const std::string& path);

// The header of a model file and its version, checked as read_model checks them (the file's size
// included), without reading the parameters.
std::pair<ModelConfig, int> read_model_header(const std::string& path);

struct Model {
  ModelConfig config;
  int version = 3;            // 3: fp32 values; 5: bf16, read here into fp32
  safetensors::File tensors;  // F32, parameter_layout's names and shapes, in its order
};
// Throws dp::Error naming `path` and what is wrong: not a regular file, a short header, the wrong
// magic or version, sizes out of range (non-positive, C not a multiple of NH, Vp < V), a file
// shorter or longer than the header's sizes make it (truncated or trailing bytes).
Model read_model(const std::string& path);
// Writes version 3 (fp32) with dp::write_atomically; `tensors` must hold parameter_layout's F32
// tensors (InvalidArgument naming the first that is missing or misshapen).
void write_model(const std::string& path, const ModelConfig& config, const safetensors::File& tensors);

// One token shard, mapped read-only: memory is the file's pages, whatever its size.
class TokenShard {
 public:
  // Throws dp::Error naming `path`: not a regular file, a short header, the wrong magic or version
  // (1), no tokens, a size other than the header's count makes it, a token id >= `vocab`.
  TokenShard(const std::string& path, int vocab);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  std::size_t size() const { return count_; }
  std::uint16_t operator[](std::size_t i) const { return tokens_[i]; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* mapping_ = nullptr;
  std::size_t bytes_ = 0, count_ = 0;
  const std::uint16_t* tokens_ = nullptr;
};

// llm.c's tokenizer file (gpt2_tokenizer.bin, written by its train_gpt2.py): every token's bytes,
// and the <|endoftext|> id. The file holds no BPE merges, so llm.c's own decodes only.
struct Tokenizer {
  std::vector<std::string> tokens;  // by id; none empty
  int eot = 0;                      // <|endoftext|>
  // llm.c's safe_printf: a token of one byte that is neither printable nor white space prints as
  // nothing (a lone control byte, half of a UTF-8 character); any other token, its bytes.
  std::string printable(int id) const;
  // `text` as ids whose bytes, one after another, are `text`: at each place the longest token that
  // starts there (the lowest id of equal ones). Without GPT-2's merges this is not tiktoken's BPE,
  // which may cut a word otherwise; every id decodes to the text's own bytes all the same. Throws
  // dp::Error naming the first byte no token starts with (GPT-2's 256 byte tokens cover them all).
  std::vector<int> encode(std::string_view text) const;
};
// Throws dp::Error naming `path` and what is wrong: not a regular file, a short header, the wrong
// magic, a version other than 1 (GPT-2's 50257 tokens, <|endoftext|> 50256) or 2 (the id in the
// header), no tokens or more than 2^24, an <|endoftext|> outside them, an empty token, a file that
// ends before its last token or goes on after it.
Tokenizer read_tokenizer(const std::string& path);

// The shards a pattern names (glob(3), as llm.c's DataLoader globs them, in glob's sorted order).
// Throws dp::Error when none matches.
std::vector<std::string> glob_shards(const std::string& pattern);

// Token shards as samples of `context` + 1 tokens the way llm.c's DataLoader serves them to one
// process: a batch is batch x context + 1 consecutive tokens starting at a multiple of batch x
// context within a shard (the shard's last partial batch unused), sample j of a batch the
// context + 1 tokens starting j x context into it. A sample's index counts batches in the shards'
// glob order, then its place in its batch. In order, every epoch: the shards in glob order, each
// one's batches in turn. Shuffled (llm.c's training loader): one mt19937 seeded 42 permutes the
// shards, then each shard's batches as it is reached (llm.c's random_permutation), and the samples
// keep their places within a batch; at each wrap-around (a new epoch) the same generator permutes
// the shards' order again, in place, and each shard's batches anew, as llm.c's dataloader_reset.
class TokenSamples : public SampleSource {
 public:
  TokenSamples(std::vector<std::shared_ptr<const TokenShard>> shards, int context, int batch, int vocab, bool shuffle);

  std::size_t size() const override { return first_batch_.back() * static_cast<std::size_t>(batch_); }
  std::vector<std::int64_t> sample_shape() const override { return {context_}; }
  int num_classes() const override { return vocab_; }
  std::int64_t label(std::size_t index) const override;
  int targets_per_sample() const override { return context_; }
  DType sample_dtype() const override { return DType::i32; }
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override;
  void fill_targets(std::size_t index, std::int64_t* out) const override;
  bool keeps_its_order() const override { return true; }
  std::size_t sample_at(std::size_t position, std::int64_t epoch) const override;

 private:
  struct Batch {
    std::uint32_t shard;
    std::uint32_t first;  // in tokens / (batch x context)
  };
  // llm.c's loader between epochs: its generator, its shard order, and the epoch's batches.
  struct Epoch {
    std::int64_t number = -1;
    std::mt19937 rng{42};
    std::vector<std::uint32_t> shard_order;
    std::vector<Batch> batches;
  };
  void advance(Epoch& epoch) const;
  // Sample `index`'s shard and first token.
  std::pair<const TokenShard*, std::size_t> start(std::size_t index) const;

  std::vector<std::shared_ptr<const TokenShard>> shards_;
  int context_, batch_, vocab_;
  bool shuffle_;
  std::vector<std::size_t> first_batch_;  // per shard, its first batch's number; last: every batch
  mutable std::mutex mutex_;              // the loader's threads ask for positions
  mutable Epoch epoch_;                   // the last epoch asked for
};

}  // namespace dp::llmc
