// llmc.cpp — llm.c's model files and token shards (dp/io/llmc.h).
#include "dp/io/llmc.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <glob.h>
#include <numeric>
#include <random>
#include <span>
#include <sys/mman.h>
#include <sys/stat.h>
#include <tuple>
#include <unistd.h>
#include <unordered_map>

#include "dp/io/atomic_file.h"
#include "dp/runtime/error.h"

namespace dp::llmc {
namespace {

// Bounds that keep every size product inside 64 bits and every shape inside dp's int extents.
constexpr std::int64_t kMaxSize = std::int64_t{1} << 24;

void check_regular(const std::string& path, const char* what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw Error(fmt::format("{}: no such {}", path, what));
  // A FIFO or a device would block or never end: only a file whose size is known is read.
  if (!std::filesystem::is_regular_file(status)) throw Error(fmt::format("{}: not a regular file", path));
}

// The 256 header ints of `path`, and its size in bytes.
std::pair<std::array<std::int32_t, 256>, std::uint64_t> read_header(const std::string& path, const char* what) {
  check_regular(path, what);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot be opened for reading", path));
  std::array<std::int32_t, 256> header{};
  in.read(reinterpret_cast<char*>(header.data()), kHeaderBytes);
  if (in.gcount() != static_cast<std::streamsize>(kHeaderBytes))
    throw Error(fmt::format("{}: {} bytes, shorter than llm.c's {}-byte header", path, in.gcount(), kHeaderBytes));
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(fmt::format("{}: its size cannot be read ({})", path, ec.message()));
  return {header, size};
}

std::uint64_t parameter_count(const ModelConfig& config) {
  std::uint64_t total = 0;
  for (const auto& [name, shape] : parameter_layout(config)) {
    std::uint64_t n = 1;
    for (const std::int64_t d : shape) n *= static_cast<std::uint64_t>(d);
    total += n;
  }
  return total;
}

void check_config(const std::string& path, const ModelConfig& c) {
  const auto in_range = [&](const char* field, std::int64_t value, std::int64_t most) {
    if (value < 1 || value > most)
      throw Error(fmt::format("{}: llm.c header field {} is {}, not in [1, {}]", path, field, value, most));
  };
  in_range("maxT", c.max_seq_len, kMaxSize);
  in_range("V", c.vocab, kMaxSize);
  in_range("L", c.layers, 4096);
  in_range("NH", c.heads, 4096);
  in_range("C", c.channels, 65536);
  in_range("Vp", c.padded_vocab, kMaxSize);
  if (c.channels % c.heads != 0)
    throw Error(fmt::format("{}: llm.c header: C = {} is not a multiple of NH = {}", path, c.channels, c.heads));
  if (c.padded_vocab < c.vocab)
    throw Error(
        fmt::format("{}: llm.c header: the padded vocabulary Vp = {} is below V = {}", path, c.padded_vocab, c.vocab));
}

}  // namespace

std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_layout(const ModelConfig& c) {
  const std::int64_t C = c.channels;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  out.push_back({"transformer.wte.weight", {c.padded_vocab, C}});
  out.push_back({"transformer.wpe.weight", {c.max_seq_len, C}});
  // train_gpt2.c's order: each per-layer tensor for all layers before the next tensor.
  const std::array<std::pair<const char*, std::vector<std::int64_t>>, 12> per_layer{{
      {"ln_1.weight", {C}},
      {"ln_1.bias", {C}},
      {"attn.c_attn.weight", {3 * C, C}},
      {"attn.c_attn.bias", {3 * C}},
      {"attn.c_proj.weight", {C, C}},
      {"attn.c_proj.bias", {C}},
      {"ln_2.weight", {C}},
      {"ln_2.bias", {C}},
      {"mlp.c_fc.weight", {4 * C, C}},
      {"mlp.c_fc.bias", {4 * C}},
      {"mlp.c_proj.weight", {C, 4 * C}},
      {"mlp.c_proj.bias", {C}},
  }};
  for (const auto& [name, shape] : per_layer)
    for (int l = 0; l < c.layers; ++l) out.push_back({fmt::format("transformer.h.{}.{}", l, name), shape});
  out.push_back({"transformer.ln_f.weight", {C}});
  out.push_back({"transformer.ln_f.bias", {C}});
  return out;
}

bool is_model_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  std::int32_t magic = 0;
  in.read(reinterpret_cast<char*>(&magic), sizeof(magic));
  return in.gcount() == sizeof(magic) && magic == kModelMagic;
}

std::pair<ModelConfig, int> read_model_header(const std::string& path) {
  const auto [header, size] = read_header(path, "llm.c model file");
  if (header[0] != kModelMagic)
    throw Error(fmt::format("{}: not an llm.c model file (magic {}, expected {})", path, header[0], kModelMagic));
  const int version = header[1];
  if (version != 3 && version != 5)
    throw Error(fmt::format("{}: llm.c model version {}, not 3 (fp32) or 5 (bf16)", path, version));
  const ModelConfig config{header[2], header[3], header[4], header[5], header[6], header[7]};
  check_config(path, config);
  const std::uint64_t element = version == 3 ? 4 : 2;
  const std::uint64_t expected = kHeaderBytes + parameter_count(config) * element;
  if (size != expected)
    throw Error(fmt::format("{}: {} bytes, but its header's sizes make {} ({})", path, size, expected,
                            size < expected ? "truncated" : "trailing bytes"));
  return {config, version};
}

Model read_model(const std::string& path) {
  Model model;
  std::tie(model.config, model.version) = read_model_header(path);
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(kHeaderBytes));
  std::vector<std::uint16_t> bits;
  for (const auto& [name, shape] : parameter_layout(model.config)) {
    safetensors::Tensor t{"F32", shape, {}};
    const std::size_t n = t.numel();
    t.data.resize(n * sizeof(float));
    if (model.version == 3) {
      in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
    } else {  // bf16: the high half of the fp32 word
      bits.resize(n);
      in.read(reinterpret_cast<char*>(bits.data()), static_cast<std::streamsize>(n * 2));
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint32_t word = static_cast<std::uint32_t>(bits[i]) << 16;
        std::memcpy(t.data.data() + i * sizeof(float), &word, sizeof(word));
      }
    }
    if (!in) throw Error(fmt::format("{}: read error in {}", path, name));
    model.tensors.add(name, std::move(t));
  }
  return model;
}

void write_model(const std::string& path, const ModelConfig& config, const safetensors::File& tensors) {
  check_config(path, config);
  std::array<std::int32_t, 256> header{};
  header[0] = kModelMagic;
  header[1] = 3;
  header[2] = config.max_seq_len;
  header[3] = config.vocab;
  header[4] = config.layers;
  header[5] = config.heads;
  header[6] = config.channels;
  header[7] = config.padded_vocab;
  std::vector<std::span<const std::byte>> pieces{std::as_bytes(std::span(header))};
  for (const auto& [name, shape] : parameter_layout(config)) {
    if (!tensors.has(name)) throw InvalidArgument(fmt::format("{}: no tensor '{}' to write", path, name));
    const safetensors::Tensor& t = tensors.at(name);
    if (t.dtype != "F32" || t.shape != shape)
      throw InvalidArgument(fmt::format("{}: '{}' is {} of shape [{}], llm.c's layout needs F32 [{}]", path, name,
                                        t.dtype, fmt::join(t.shape, ", "), fmt::join(shape, ", ")));
    pieces.push_back(std::span(t.data));
  }
  write_atomically(path, pieces);
}

TokenShard::TokenShard(const std::string& path, int vocab) : path_(path) {
  const auto [header, size] = read_header(path, "token shard");
  if (header[0] != kTokensMagic)
    throw Error(fmt::format("{}: not an llm.c token shard (magic {}, expected {})", path, header[0], kTokensMagic));
  if (header[1] != 1) throw Error(fmt::format("{}: llm.c token shard version {}, not 1", path, header[1]));
  if (header[2] < 1) throw Error(fmt::format("{}: an llm.c token shard of {} tokens", path, header[2]));
  count_ = static_cast<std::size_t>(header[2]);
  const std::uint64_t expected = kHeaderBytes + 2 * static_cast<std::uint64_t>(count_);
  if (size != expected)
    throw Error(fmt::format("{}: {} bytes, but its header's {} tokens make {} ({})", path, size, count_, expected,
                            size < expected ? "truncated" : "trailing bytes"));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot be opened for reading ({})", path, std::strerror(errno)));
  bytes_ = static_cast<std::size_t>(size);
  mapping_ = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mapped_errno = errno;
  ::close(fd);
  if (mapping_ == MAP_FAILED) {
    mapping_ = nullptr;
    throw Error(fmt::format("{}: cannot be mapped ({})", path, std::strerror(mapped_errno)));
  }
  tokens_ = reinterpret_cast<const std::uint16_t*>(static_cast<const std::byte*>(mapping_) + kHeaderBytes);
  // One pass over the ids: an id outside the vocabulary would index past the embedding's table.
  const std::uint16_t* bad = std::find_if(tokens_, tokens_ + count_, [vocab](std::uint16_t t) { return t >= vocab; });
  if (bad != tokens_ + count_) {
    const std::uint16_t id = *bad;
    const auto at = static_cast<std::size_t>(bad - tokens_);
    ::munmap(mapping_, bytes_);
    mapping_ = nullptr;
    throw Error(fmt::format("{}: token {} is id {}, outside the vocabulary of {} (--vocab)", path, at, id, vocab));
  }
}

TokenShard::~TokenShard() {
  if (mapping_) ::munmap(mapping_, bytes_);
}

std::vector<std::string> glob_shards(const std::string& pattern) {
  glob_t found{};
  const int status = ::glob(pattern.c_str(), 0, nullptr, &found);
  std::vector<std::string> out;
  for (std::size_t i = 0; status == 0 && i < found.gl_pathc; ++i) out.emplace_back(found.gl_pathv[i]);
  ::globfree(&found);
  if (out.empty()) throw Error(fmt::format("{}: no token shard matches", pattern));
  return out;
}

Tokenizer read_tokenizer(const std::string& path) {
  const auto [header, size] = read_header(path, "llm.c tokenizer file");
  if (header[0] != kTokenizerMagic)
    throw Error(fmt::format("{}: magic {}, not llm.c's tokenizer file ({})", path, header[0], kTokenizerMagic));
  const std::int32_t version = header[1], count = header[2];
  if (version != 1 && version != 2)
    throw Error(fmt::format("{}: tokenizer version {}; llm.c writes 1 and 2", path, version));
  if (count < 1 || count > (1 << 24)) throw Error(fmt::format("{}: {} tokens, outside 1..2^24", path, count));
  if (version == 1 && count != 50257)
    throw Error(fmt::format("{}: version 1 holds GPT-2's 50257 tokens, not {}", path, count));
  Tokenizer tokenizer;
  tokenizer.eot = version == 1 ? 50256 : header[3];
  if (tokenizer.eot < 0 || tokenizer.eot >= count)
    throw Error(fmt::format("{}: <|endoftext|> is id {}, outside its {} tokens", path, tokenizer.eot, count));
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(kHeaderBytes));
  std::uint64_t at = kHeaderBytes;
  tokenizer.tokens.resize(static_cast<std::size_t>(count));
  for (std::int32_t id = 0; id < count; ++id) {
    unsigned char length = 0;
    in.read(reinterpret_cast<char*>(&length), 1);
    std::string& token = tokenizer.tokens[static_cast<std::size_t>(id)];
    if (in.gcount() == 1 && length > 0) {
      token.resize(length);
      in.read(token.data(), length);
    }
    if (in.gcount() != (length > 0 ? length : 1) || !in)
      throw Error(fmt::format("{}: token {} of {} ends at byte {} of {} (truncated)", path, id, count, at, size));
    if (length == 0) throw Error(fmt::format("{}: token {} is empty (llm.c's tokens are 1 to 255 bytes)", path, id));
    at += 1 + length;
  }
  if (at != size) throw Error(fmt::format("{}: {} bytes after its {} tokens (trailing bytes)", path, size - at, count));
  return tokenizer;
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  std::unordered_map<std::string_view, int> ids;
  std::size_t longest = 0;
  for (std::size_t id = tokens.size(); id-- > 0;) {  // the lowest id of equal tokens last, so it stays
    ids[tokens[id]] = static_cast<int>(id);
    longest = std::max(longest, tokens[id].size());
  }
  std::vector<int> out;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t length = std::min(longest, text.size() - at);
    for (; length > 0; --length)
      if (const auto found = ids.find(text.substr(at, length)); found != ids.end()) {
        out.push_back(found->second);
        break;
      }
    if (length == 0)
      throw Error(fmt::format("byte {} (0x{:02x}) of the text starts no token of the tokenizer", at,
                              static_cast<unsigned char>(text[at])));
    at += length;
  }
  return out;
}

std::string Tokenizer::printable(int id) const {
  const std::string& token = tokens.at(static_cast<std::size_t>(id));
  const auto byte = static_cast<unsigned char>(token[0]);
  if (token.size() == 1 && !(std::isprint(byte) || std::isspace(byte))) return {};
  return token;
}

TokenSamples::TokenSamples(std::vector<std::shared_ptr<const TokenShard>> shards, int context, int batch, int vocab,
                           bool shuffle)
    : shards_(std::move(shards)), context_(context), batch_(batch), vocab_(vocab), shuffle_(shuffle) {
  if (context < 1 || batch < 1 || shards_.empty())
    throw InvalidArgument(
        fmt::format("token samples of {} tokens in batches of {} from {} shard(s)", context, batch, shards_.size()));
  const std::size_t span = static_cast<std::size_t>(context) * static_cast<std::size_t>(batch);
  first_batch_.push_back(0);
  for (const auto& shard : shards_) {
    if (shard->size() < span + 1)
      throw Error(fmt::format("{}: {} tokens hold no batch of {} x {} + 1 (--batch-size x --context + 1)",
                              shard->path(), shard->size(), batch, context));
    first_batch_.push_back(first_batch_.back() + (shard->size() - 1) / span);
  }
}

// llm.c's dataloader_reset and the loads that follow: its generator permutes the shard order in
// place, then each shard's batches from the identity as the shard is reached (random_permutation:
// Fisher-Yates from the end, j = randint32 % (i + 1); std::mt19937 is llm.c's generator).
void TokenSamples::advance(Epoch& epoch) const {
  const auto permute = [&](std::vector<std::uint32_t>& v) {
    for (std::size_t i = v.size(); i-- > 1;) std::swap(v[i], v[epoch.rng() % (i + 1)]);
  };
  if (epoch.shard_order.empty()) {
    epoch.shard_order.resize(shards_.size());
    std::iota(epoch.shard_order.begin(), epoch.shard_order.end(), 0u);
  }
  permute(epoch.shard_order);
  epoch.batches.clear();
  for (const std::uint32_t s : epoch.shard_order) {
    std::vector<std::uint32_t> batches(first_batch_[s + 1] - first_batch_[s]);
    std::iota(batches.begin(), batches.end(), 0u);
    permute(batches);
    for (const std::uint32_t b : batches) epoch.batches.push_back({s, b});
  }
  ++epoch.number;
}

std::size_t TokenSamples::sample_at(std::size_t position, std::int64_t epoch) const {
  if (position >= size() || epoch < 0)
    throw InvalidArgument(fmt::format("token samples: position {} of {}, epoch {}", position, size(), epoch));
  if (!shuffle_) return position;  // every epoch in glob order: the numbering itself
  std::lock_guard lock(mutex_);
  if (epoch_.number > epoch) epoch_ = Epoch{};  // an earlier epoch: the generator's stream from its start
  while (epoch_.number < epoch) advance(epoch_);
  const auto per_batch = static_cast<std::size_t>(batch_);
  const Batch& b = epoch_.batches[position / per_batch];
  return (first_batch_[b.shard] + b.first) * per_batch + position % per_batch;
}

std::pair<const TokenShard*, std::size_t> TokenSamples::start(std::size_t index) const {
  const auto per_batch = static_cast<std::size_t>(batch_);
  const std::size_t batch = index / per_batch;
  if (batch >= first_batch_.back()) throw InvalidArgument(fmt::format("token samples: sample {} of {}", index, size()));
  const auto shard = static_cast<std::size_t>(std::upper_bound(first_batch_.begin(), first_batch_.end(), batch) -
                                              first_batch_.begin() - 1);
  const std::size_t first =
      ((batch - first_batch_[shard]) * per_batch + index % per_batch) * static_cast<std::size_t>(context_);
  return {shards_[shard].get(), first};
}

std::int64_t TokenSamples::label(std::size_t index) const {
  const auto [shard, first] = start(index);
  return (*shard)[first + 1];
}

void TokenSamples::fill(std::size_t index, const SampleKey&, InputsOut out) const {
  const auto [shard, first] = start(index);
  std::int32_t* ids = out.ids();
  for (int t = 0; t < context_; ++t) ids[t] = (*shard)[first + static_cast<std::size_t>(t)];
}

void TokenSamples::fill_targets(std::size_t index, std::int64_t* out) const {
  const auto [shard, first] = start(index);
  for (int t = 0; t < context_; ++t) out[t] = (*shard)[first + 1 + static_cast<std::size_t>(t)];
}

}  // namespace dp::llmc
