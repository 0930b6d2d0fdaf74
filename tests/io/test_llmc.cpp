// test_llmc.cpp — llm.c's files (dp/io/llmc.h): model files written and read back (fp32, and bf16
// read into fp32), every malformed file refused with what is wrong, token shards mapped and
// checked, and their samples in llm.c's DataLoader order, shuffled by llm.c's mt19937.
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <sys/stat.h>
#include <vector>

#include "dp/io/llmc.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace {

using dp::llmc::ModelConfig;
namespace fs = std::filesystem;

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void put(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string header(const std::vector<std::int32_t>& fields) {
  std::array<std::int32_t, 256> h{};
  std::copy(fields.begin(), fields.end(), h.begin());
  return std::string(reinterpret_cast<const char*>(h.data()), sizeof(h));
}

// A tiny GPT-2 whose every value says where it is: tensor t's element i is t + i / 1024.
dp::safetensors::File tiny(const ModelConfig& c) {
  dp::safetensors::File file;
  int t = 0;
  for (const auto& [name, shape] : dp::llmc::parameter_layout(c)) {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    std::vector<float> values(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(t) + static_cast<float>(i) / 1024;
    file.add(name, dp::safetensors::make_f32(shape, values.data()));
    ++t;
  }
  return file;
}

const ModelConfig kTiny{8, 10, 2, 2, 4, 128};  // maxT, V, L, NH, C, Vp

void expect_refused(const std::string& path, const std::string& part) {
  try {
    (void)dp::llmc::read_model(path);
    ADD_FAILURE() << path << " read";
  } catch (const dp::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// llm.c's rand.h is torch's and the standard's mt19937: its own comment's first draws after
// manual_seed(137), which std::mt19937 must give for dp's order of shards to be llm.c's.
TEST(Llmc, StdMt19937IsLlmcsGenerator) {
  std::mt19937 rng(137);
  for (const std::uint32_t expected : {4053805790u, 2173880614u, 380293709u, 1237255315u, 2986595568u})
    EXPECT_EQ(rng(), expected);
}

// Written as train_gpt2.py writes (header, then the tensors in train_gpt2.c's order, fp32) and read
// back bit for bit; a bf16 file (version 5) is read into fp32.
TEST(Llmc, AModelFileRoundTripsAndBf16IsWidened) {
  dp::test::TempDir dir("llmc_model");
  const std::string path = (dir / "tiny.bin").string();
  const dp::safetensors::File file = tiny(kTiny);
  dp::llmc::write_model(path, kTiny, file);
  const std::string bytes = bytes_of(path);
  ASSERT_GE(bytes.size(), dp::llmc::kHeaderBytes);
  EXPECT_EQ(bytes.substr(0, 1024), header({20240326, 3, 8, 10, 2, 2, 4, 128}));
  // wte (Vp x C) first, then wpe, then every layer's ln_1.weight before any ln_1.bias.
  const auto layout = dp::llmc::parameter_layout(kTiny);
  EXPECT_EQ(layout[0].first, "transformer.wte.weight");
  EXPECT_EQ(layout[2].first, "transformer.h.0.ln_1.weight");
  EXPECT_EQ(layout[3].first, "transformer.h.1.ln_1.weight");
  EXPECT_EQ(layout.back().first, "transformer.ln_f.bias");
  const dp::llmc::Model back = dp::llmc::read_model(path);
  EXPECT_EQ(back.version, 3);
  EXPECT_EQ(back.config.padded_vocab, 128);
  EXPECT_EQ(back.tensors.order, file.order);
  for (const auto& name : file.order) EXPECT_EQ(back.tensors.at(name).data, file.at(name).data) << name;
  EXPECT_TRUE(dp::llmc::is_model_file(path));

  // Version 5: each value's top 16 bits.
  std::string bf16 = header({20240326, 5, 8, 10, 2, 2, 4, 128});
  for (const auto& name : file.order) {
    const auto values = file.at(name).to_f32();
    for (const float v : values) {
      std::uint32_t word = 0;
      std::memcpy(&word, &v, 4);
      const auto half = static_cast<std::uint16_t>(word >> 16);
      bf16.append(reinterpret_cast<const char*>(&half), 2);
    }
  }
  put((dir / "bf16.bin").string(), bf16);
  const dp::llmc::Model wide = dp::llmc::read_model((dir / "bf16.bin").string());
  EXPECT_EQ(wide.version, 5);
  const auto expect = file.at("transformer.wpe.weight").to_f32();
  const auto got = wide.tensors.at("transformer.wpe.weight").to_f32();
  ASSERT_EQ(got.size(), expect.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &expect[i], 4);
    std::memcpy(&b, &got[i], 4);
    EXPECT_EQ(b, a & 0xffff0000u) << i;
  }
}

// Every way a model file can be wrong, named.
TEST(Llmc, MalformedModelFilesAreRefusedNamingTheProblem) {
  dp::test::TempDir dir("llmc_bad_model");
  const std::string good = (dir / "good.bin").string();
  dp::llmc::write_model(good, kTiny, tiny(kTiny));
  const std::string bytes = bytes_of(good);
  const std::string body = bytes.substr(1024);
  const auto file = [&](const std::string& name, const std::string& content) {
    put((dir / name).string(), content);
    return (dir / name).string();
  };
  expect_refused((dir / "absent.bin").string(), "no such llm.c model file");
  expect_refused(file("short.bin", bytes.substr(0, 100)), "shorter than llm.c's 1024-byte header");
  expect_refused(file("magic.bin", header({20240520, 3, 8, 10, 2, 2, 4, 128}) + body), "not an llm.c model file");
  expect_refused(file("version.bin", header({20240326, 4, 8, 10, 2, 2, 4, 128}) + body), "version 4");
  expect_refused(file("heads.bin", header({20240326, 3, 8, 10, 2, 3, 4, 128}) + body), "not a multiple of NH");
  expect_refused(file("padded.bin", header({20240326, 3, 8, 10, 2, 2, 4, 9}) + body), "Vp = 9 is below V = 10");
  expect_refused(file("zero.bin", header({20240326, 3, 0, 10, 2, 2, 4, 128}) + body), "maxT is 0");
  expect_refused(file("huge.bin", header({20240326, 3, 8, 10, 2, 2, 4, 2000000000}) + body), "Vp is 2000000000");
  expect_refused(file("truncated.bin", bytes.substr(0, bytes.size() - 4)), "(truncated)");
  expect_refused(file("trailing.bin", bytes + "xx"), "(trailing bytes)");
  ASSERT_EQ(::mkfifo((dir / "fifo.bin").c_str(), 0600), 0);
  expect_refused((dir / "fifo.bin").string(), "not a regular file");
  EXPECT_FALSE(dp::llmc::is_model_file((dir / "fifo.bin").string()));
  EXPECT_FALSE(dp::llmc::is_model_file((dir / "magic.bin").string()));
  // A write of tensors not in llm.c's layout is refused before anything is written.
  dp::safetensors::File wrong = tiny(kTiny);
  wrong.tensors["transformer.wpe.weight"].shape = {4, 8};
  EXPECT_THROW(dp::llmc::write_model((dir / "out.bin").string(), kTiny, wrong), dp::InvalidArgument);
  EXPECT_FALSE(fs::exists(dir / "out.bin"));
}

std::string shard(const std::vector<std::uint16_t>& tokens, std::int32_t magic = 20240520, std::int32_t version = 1,
                  std::int64_t count = -1) {
  std::string out = header({magic, version, static_cast<std::int32_t>(count < 0 ? tokens.size() : count)});
  out.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return out;
}

// A shard is mapped and its every id checked against the vocabulary; a bad one is named.
TEST(Llmc, TokenShardsAreCheckedAsTheyAreMapped) {
  dp::test::TempDir dir("llmc_tokens");
  std::vector<std::uint16_t> tokens(100);
  std::iota(tokens.begin(), tokens.end(), std::uint16_t{0});
  const auto file = [&](const std::string& name, const std::string& content) {
    put((dir / name).string(), content);
    return (dir / name).string();
  };
  const dp::llmc::TokenShard good(file("good.bin", shard(tokens)), 256);
  ASSERT_EQ(good.size(), 100u);
  EXPECT_EQ(good[57], 57);
  const auto refused = [&](const std::string& path, int vocab, const std::string& part) {
    try {
      const dp::llmc::TokenShard s(path, vocab);
      ADD_FAILURE() << path << " read";
    } catch (const dp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  refused(file("magic.bin", shard(tokens, 20240326)), 256, "not an llm.c token shard");
  refused(file("version.bin", shard(tokens, 20240520, 2)), 256, "version 2");
  refused(file("empty.bin", shard({})), 256, "of 0 tokens");
  refused(file("truncated.bin", shard(tokens, 20240520, 1, 101)), 256, "(truncated)");
  refused(file("trailing.bin", shard(tokens) + "x"), 256, "(trailing bytes)");
  refused(file("short.bin", "abc"), 256, "shorter than llm.c's 1024-byte header");
  refused((dir / "good.bin").string(), 50, "token 50 is id 50, outside the vocabulary of 50");
  EXPECT_THROW(dp::llmc::glob_shards((dir / "nothing_*.bin").string()), dp::Error);
  EXPECT_EQ(dp::llmc::glob_shards((dir / "g*.bin").string()), std::vector<std::string>{(dir / "good.bin").string()});
}

// llm.c's tokenizer file: the header (magic 20240328, version, count, <|endoftext|>), then each
// token as a length byte and its bytes. Read whole, decoded as llm.c prints; every flaw named.
std::string tokenizer_file(const std::vector<std::string>& tokens, std::int32_t version = 2, std::int32_t eot = 1,
                           std::int32_t magic = 20240328) {
  std::string out = header({magic, version, static_cast<std::int32_t>(tokens.size()), eot});
  for (const std::string& t : tokens) out += static_cast<char>(t.size()) + t;
  return out;
}

// The file holds no merges: a text goes in as the longest token at each place (the lowest id of
// equal ones), and its ids decode to the text's bytes; a byte no token starts with is named.
TEST(Llmc, TheTokenizerEncodesATextByItsLongestTokens) {
  dp::llmc::Tokenizer t;
  t.tokens = {"t", "h", "e", " ", "th", "the", " the", "e ", "the", "x"};
  t.eot = 9;
  EXPECT_EQ(t.encode("the the"), (std::vector<int>{5, 6}));
  EXPECT_EQ(t.encode("thee the"), (std::vector<int>{5, 7, 5}));
  EXPECT_EQ(t.encode(""), std::vector<int>{});
  for (const std::string text : {"the the", "thee the", "t h e", "ethe "}) {
    std::string decoded;
    for (const int id : t.encode(text)) decoded += t.tokens[static_cast<std::size_t>(id)];
    EXPECT_EQ(decoded, text);
  }
  try {
    (void)t.encode("the\x01");
    ADD_FAILURE() << "no error";
  } catch (const dp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte 3 (0x01) of the text starts no token"), std::string::npos) << e.what();
  }
}

TEST(Llmc, TheTokenizerFileIsReadAsLlmcReadsItAndItsFlawsNamed) {
  dp::test::TempDir dir("llmc_tokenizer");
  const auto file = [&](const std::string& name, const std::string& bytes) {
    const std::string path = (dir / name).string();
    put(path, bytes);
    return path;
  };
  const std::vector<std::string> tokens = {"a", "<|endoftext|>", " the", "\x01", "\xe2", "\n", std::string(255, 'x')};
  const dp::llmc::Tokenizer t = dp::llmc::read_tokenizer(file("good.bin", tokenizer_file(tokens)));
  EXPECT_EQ(t.tokens, tokens);
  EXPECT_EQ(t.eot, 1);
  // safe_printf: a lone byte that is neither printable nor white space prints as nothing.
  EXPECT_EQ(t.printable(2), " the");
  EXPECT_EQ(t.printable(3), "");
  EXPECT_EQ(t.printable(4), "");
  EXPECT_EQ(t.printable(5), "\n");
  const auto refused = [&](const std::string& name, const std::string& bytes, const std::string& named) {
    SCOPED_TRACE(name);
    try {
      dp::llmc::read_tokenizer(file(name, bytes));
      ADD_FAILURE() << "accepted";
    } catch (const dp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  refused("magic.bin", tokenizer_file(tokens, 2, 1, 20240326), "not llm.c's tokenizer file");
  refused("version.bin", tokenizer_file(tokens, 3), "tokenizer version 3");
  refused("v1.bin", tokenizer_file(tokens, 1), "version 1 holds GPT-2's 50257 tokens, not 7");
  refused("eot.bin", tokenizer_file(tokens, 2, 7), "<|endoftext|> is id 7, outside its 7 tokens");
  refused("empty.bin", tokenizer_file({"a", "", "b"}, 2, 0), "token 1 is empty");
  refused("truncated.bin", tokenizer_file(tokens).substr(0, 1024 + 10), "(truncated)");
  refused("trailing.bin", tokenizer_file(tokens) + "z", "1 bytes after its 7 tokens (trailing bytes)");
  refused("short.bin", "abc", "shorter than llm.c's 1024-byte header");
  refused("none.bin", header({20240328, 2, 0, 0}), "0 tokens, outside 1..2^24");
}

// llm.c's DataLoader (dataloader.h) for one process, written out here as it is there: the shards
// permuted once they are counted, each shard's batches permuted as it is loaded, both by
// random_permutation over one generator seeded 42; past the last shard, dataloader_reset permutes
// the shard order again in place and the shards are loaded anew; a batch's B x T + 1 tokens read
// from header + index x B x T tokens; sample b of it starts b x T tokens in.
std::vector<std::vector<std::uint16_t>> llmc_batches(const std::vector<std::vector<std::uint16_t>>& shards, int B,
                                                     int T, bool shuffle, int count) {
  std::mt19937 rng(42);
  const auto random_permutation = [&](std::vector<int>& data) {
    for (int i = static_cast<int>(data.size()) - 1; i > 0; i--) std::swap(data[i], data[rng() % (i + 1)]);
  };
  std::vector<int> shard_indices(shards.size());
  std::iota(shard_indices.begin(), shard_indices.end(), 0);
  std::vector<std::vector<std::uint16_t>> out;
  while (static_cast<int>(out.size()) < count) {
    if (shuffle) random_permutation(shard_indices);
    for (std::size_t s = 0; s < shards.size() && static_cast<int>(out.size()) < count; ++s) {
      const auto& tokens = shards[static_cast<std::size_t>(shard_indices[s])];
      const std::size_t batch_tokens = static_cast<std::size_t>(B) * T;
      std::vector<int> intra((tokens.size() * 2 - 2) / (batch_tokens * 2));
      std::iota(intra.begin(), intra.end(), 0);
      if (shuffle) random_permutation(intra);
      for (const int idx : intra)
        if (static_cast<int>(out.size()) < count)
          out.emplace_back(tokens.begin() + static_cast<std::ptrdiff_t>(idx * batch_tokens),
                           tokens.begin() + static_cast<std::ptrdiff_t>((idx + 1) * batch_tokens + 1));
    }
  }
  return out;
}

TEST(Llmc, TokenSamplesComeInLlmcsOrder) {
  dp::test::TempDir dir("llmc_order");
  const int B = 3, T = 4;
  std::vector<std::vector<std::uint16_t>> contents;
  std::vector<std::shared_ptr<const dp::llmc::TokenShard>> shards;
  for (int s = 0; s < 3; ++s) {
    std::vector<std::uint16_t> tokens(static_cast<std::size_t>(40 + 13 * s));
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>((s * 1000 + i) % 3001);
    const std::string path = (dir / fmt::format("shard_{}.bin", s)).string();
    put(path, shard(tokens));
    contents.push_back(tokens);
    shards.push_back(std::make_shared<const dp::llmc::TokenShard>(path, 3001));
  }
  for (const bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "shuffled" : "in order");
    const dp::llmc::TokenSamples samples(shards, T, B, 3001, shuffle);
    EXPECT_TRUE(samples.keeps_its_order());
    // (40 - 1) / 12 + (53 - 1) / 12 + (66 - 1) / 12 = 3 + 4 + 5 batches of 3 samples.
    ASSERT_EQ(samples.size(), 12u * B);
    // Three epochs: llm.c draws a new order at each wrap-around; asked for out of turn (the third
    // first, then back to the first, as a resumed run may), each epoch's order is the same.
    const auto batches = llmc_batches(contents, B, T, shuffle, 36);
    ASSERT_EQ(batches.size(), 36u);
    if (shuffle) {
      EXPECT_NE(batches[0], batches[12]) << "a new epoch, a new order";
    }
    std::vector<std::int32_t> inputs(T);
    std::vector<std::int64_t> targets(T);
    for (std::size_t j = 0; j < batches.size(); ++j)
      for (int b = 0; b < B; ++b) {
        const std::size_t k = (j * 7 + 24) % batches.size();  // every batch, the epochs out of turn
        const std::size_t position = (k % 12) * B + static_cast<std::size_t>(b);
        const std::size_t index = samples.sample_at(position, static_cast<std::int64_t>(k / 12));
        samples.fill(index, {}, inputs.data());
        samples.fill_targets(index, targets.data());
        for (int t = 0; t < T; ++t) {
          EXPECT_EQ(inputs[static_cast<std::size_t>(t)], batches[k][static_cast<std::size_t>(b * T + t)]);
          EXPECT_EQ(targets[static_cast<std::size_t>(t)], batches[k][static_cast<std::size_t>(b * T + t + 1)]);
        }
        EXPECT_EQ(samples.label(index), targets[0]);
      }
  }
  // A shard too short for one batch is named.
  EXPECT_THROW(dp::llmc::TokenSamples(shards, 20, 3, 3001, false), dp::Error);
}

}  // namespace
