// test_llmc_train.cpp — dp_train on llm.c's own ground (docs/transformer.md, "llm.c"): from an
// llm.c model file and token shard it reproduces train_gpt2.c's 41 per-step losses (the golden that
// scripts/llmc.py golden made with llm.c's CPU trainer), on one device and under DDP; bad llm.c
// files end the run with exit 2 naming the problem and write nothing; the converter round-trips a
// model file byte for byte.
#include <array>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "dp/io/llmc.h"
#include "dp/io/safetensors.h"
#include "test_util.h"
#include "tool_test.h"

namespace {

using Result = dp::test::CommandResult;

class LlmcTrain : public dp::test::ToolTest {
 protected:
  std::string golden(const std::string& name) const {
    return fmt::format("{}/tests/golden/llmc/{}", DP_SOURCE_DIR, name);
  }
  Result train(const std::string& args) const {
    return dp::test::run_command(
        fmt::format("cd {} && timeout 300 {} --backend sim --no-eval {}", dir_.string(), DP_TRAIN_BIN, args));
  }
  // dp's initial small GPT-2 (the golden's start: --seed's default) as an llm.c model file: one
  // step at learning rate 0 changes nothing, and its checkpoint's model tensors are written in
  // llm.c's layout.
  std::string initial_model() const {
    const Result init = train(fmt::format(
        "--model gpt --gelu tanh --context 64 --layers 4 --heads 4 --width 128 --vocab 256 --tokens {} --steps 1 "
        "--lr 0 --save init.st",
        golden("tokens.bin")));
    EXPECT_EQ(init.code, 0) << init.output;
    const dp::safetensors::File checkpoint = dp::safetensors::read(path("init.st"));
    const dp::llmc::ModelConfig config{64, 256, 4, 4, 128, 256};
    dp::safetensors::File model;
    for (const auto& [name, shape] : dp::llmc::parameter_layout(config)) model.add(name, checkpoint.at(name));
    dp::llmc::write_model(path("gpt2_124M.bin"), config, model);
    return path("gpt2_124M.bin");
  }
  std::vector<double> losses(const std::string& json) const {
    std::vector<double> out;
    std::istringstream in(read_file(path(json)));
    for (std::string line; std::getline(in, line);)
      if (auto record = nlohmann::json::parse(line); record.value("kind", "") == "step")
        out.push_back(record.at("loss").get<double>());
    return out;
  }
};

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "no '" << part << "' in:\n" << text;
}

// train_gpt2.c's settings (AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8, no decay, no clipping, B 4,
// T 64, its shuffled batches): every step's loss within 1e-4 of llm.c's (they agree to about 1e-6:
// the sums run in other orders); the sizes and GELU come from the model file's header. Under DDP
// (2 devices of 2 samples: llm.c's batch of 4) the same.
TEST_F(LlmcTrain, ItReproducesTrainGpt2sLosses) {
  const std::string model = initial_model();
  const nlohmann::json expected = nlohmann::json::parse(read_file(golden("train_gpt2_losses.json")));
  const auto reference = expected.at("losses").get<std::vector<double>>();
  ASSERT_EQ(reference.size(), 41u);
  const std::string common = fmt::format(
      "--init {} --tokens {} --steps 41 --optimizer adamw --lr 1e-4 --beta1 0.9 --beta2 0.999 --eps 1e-8 "
      "--weight-decay 0 --log-every 1",
      model, golden("tokens.bin"));
  for (const std::string mode : {"--batch-size 4", "--mode ddp --devices 2 --batch-size 2"}) {
    SCOPED_TRACE(mode);
    std::filesystem::remove(path("m.json"));
    const Result r = train(fmt::format("{} {} --metrics-json m.json", common, mode));
    ASSERT_EQ(r.code, 0) << r.output;
    expect_has(r.output, "gpt2_124M.bin: --model gpt, --gelu tanh");  // the sizes are the defaults
    const std::vector<double> ours = losses("m.json");
    ASSERT_EQ(ours.size(), reference.size());
    for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_NEAR(ours[i], reference[i], 1e-4) << "step " << i;
  }
}

// A bad llm.c file (model or tokens) is exit 2 naming it, and --save is never written.
TEST_F(LlmcTrain, BadLlmcFilesAreRefusedAndNothingIsWritten) {
  const std::string model = initial_model();
  const std::string bytes = read_file(model);
  {
    std::ofstream out(path("cut.bin"), std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 8));
  }
  std::string tokens = read_file(golden("tokens.bin"));
  {
    std::ofstream out(path("wide.bin"), std::ios::binary);
    tokens[1024 + 2 * 7 + 1] = 1;  // token 7 becomes 256 + its byte: past the vocabulary of 256
    out.write(tokens.data(), static_cast<std::streamsize>(tokens.size()));
  }
  const struct {
    std::string args, says;
  } cases[] = {
      {fmt::format("--init {} --tokens {}", path("cut.bin"), golden("tokens.bin")), "(truncated)"},
      {fmt::format("--init {} --tokens {}", model, path("wide.bin")), "token 7 is id "},
      {fmt::format("--init {} --tokens {}", model, path("none_*.bin")), "no token shard matches"},
      {fmt::format("--init {} --tokens {} --width 64", model, golden("tokens.bin")),
       "the checkpoint " + model + " was saved with --width 128"},
      {fmt::format("--init {} --tokens {} --gelu exact", model, golden("tokens.bin")), "saved with --gelu tanh"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = train(c.args + " --steps 2 --save out.st");
    EXPECT_EQ(r.code, 2) << r.output;
    expect_has(r.output, c.says);
    EXPECT_FALSE(std::filesystem::exists(path("out.st")));
  }
}

// scripts/llmc.py: llm.c -> safetensors -> llm.c is the same file, byte for byte; the safetensors
// file trains as the llm.c one does (its metadata carries the sizes and the GELU).
// A vocabulary larger than bytes (an llm.c checkpoint's) samples with llm.c's tokenizer file: from
// <|endoftext|>, among the vocabulary's ids only (the padded rows of the table never, though here
// they would win every draw), each token printed as its bytes; a prompt encoded by its longest
// tokens. Without the tokenizer, or with a prompt it cannot encode, the run is refused.
TEST_F(LlmcTrain, GenerationDecodesAnLlmcVocabularyWithItsTokenizer) {
  const dp::llmc::ModelConfig config{16, 300, 1, 2, 16, 384};  // Vp: 300 padded to 128s, as llm.c pads
  dp::safetensors::File model;
  std::uint32_t state = 7;
  for (const auto& [name, shape] : dp::llmc::parameter_layout(config)) {
    std::size_t n = 1;
    for (const std::int64_t d : shape) n *= static_cast<std::size_t>(d);
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) {
      state = state * 1664525u + 1013904223u;
      values[i] = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.2f;
      if (name == "transformer.wte.weight" && i / 16 >= 300) values[i] = 1.0f;  // the padded rows
    }
    dp::safetensors::Tensor t{"F32", shape, std::vector<std::byte>(n * sizeof(float))};
    std::memcpy(t.data.data(), values.data(), t.data.size());
    model.add(name, std::move(t));
  }
  dp::llmc::write_model(path("model.bin"), config, model);
  std::array<std::int32_t, 256> header{20240328, 2, 300, 299};
  std::string tokenizer(reinterpret_cast<const char*>(header.data()), sizeof(header));
  for (int id = 0; id < 300; ++id) {
    const std::string token = fmt::format("[{}]", id);
    tokenizer += static_cast<char>(token.size()) + token;
  }
  std::ofstream(path("tokenizer.bin"), std::ios::binary) << tokenizer;
  const auto generate = [&](const std::string& args) {
    return dp::test::run_command(fmt::format("cd {} && timeout 120 {} --backend sim --init model.bin --generate 40 {}",
                                             dir_.string(), DP_TRAIN_BIN, args));
  };
  const Result r = generate("--tokenizer tokenizer.bin --seed 3");
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<int> ids;
  const std::regex piece(R"(\[(\d+)\])");
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), piece); it != std::sregex_iterator(); ++it)
    ids.push_back(std::stoi((*it)[1]));
  ASSERT_EQ(ids.size(), 40u) << r.output;
  for (const int id : ids) EXPECT_LT(id, 300) << "a padded row was drawn";
  EXPECT_EQ(generate("--tokenizer tokenizer.bin --seed 3").output, r.output) << "the same seed, the same sample";
  const Result bytes = generate("");
  EXPECT_EQ(bytes.code, 2) << bytes.output;
  expect_has(bytes.output, "has a vocabulary of 300 tokens, not bytes: give llm.c's tokenizer file");
  // A prompt goes in as the longest tokens at each place: "[12][7]" is ids 12 and 7 (not 1 first).
  const Result prompted = generate("--tokenizer tokenizer.bin --seed 3 --prompt '[12][7]'");
  ASSERT_EQ(prompted.code, 0) << prompted.output;
  std::vector<int> continued;
  for (auto it = std::sregex_iterator(prompted.output.begin(), prompted.output.end(), piece);
       it != std::sregex_iterator(); ++it)
    continued.push_back(std::stoi((*it)[1]));
  ASSERT_EQ(continued.size(), 42u) << prompted.output;
  EXPECT_EQ(continued[0], 12);
  EXPECT_EQ(continued[1], 7);
  EXPECT_NE(std::vector<int>(continued.begin() + 2, continued.end()), ids) << "the prompt changes the sample";
  const Result prompt = generate("--tokenizer tokenizer.bin --prompt hello");
  EXPECT_EQ(prompt.code, 2) << prompt.output;
  expect_has(prompt.output, "--prompt: byte 0 (0x68) of the text starts no token of the tokenizer tokenizer.bin");
  const Result broken = generate("--tokenizer model.bin");
  EXPECT_EQ(broken.code, 2) << broken.output;
  expect_has(broken.output, "not llm.c's tokenizer file");
}

TEST_F(LlmcTrain, TheConverterRoundTripsAModelFile) {
  if (dp::test::run_command("/usr/bin/python3 -c 'import numpy'").code != 0)
    GTEST_SKIP() << "no /usr/bin/python3 with numpy for scripts/llmc.py";
  const std::string model = initial_model();
  const std::string script = fmt::format("/usr/bin/python3 {}/scripts/llmc.py", DP_SOURCE_DIR);
  const Result there = dp::test::run_command(fmt::format("{} to-safetensors {} {}", script, model, path("m.st")));
  ASSERT_EQ(there.code, 0) << there.output;
  const Result back = dp::test::run_command(fmt::format("{} to-llmc {} {}", script, path("m.st"), path("back.bin")));
  ASSERT_EQ(back.code, 0) << back.output;
  EXPECT_EQ(read_file(path("back.bin")), read_file(model));
  const Result trained = train(fmt::format("--init {} --tokens {} --steps 2", path("m.st"), golden("tokens.bin")));
  EXPECT_EQ(trained.code, 0) << trained.output;
  // The script refuses what is not an llm.c model, exit 2, writing nothing.
  const Result bad =
      dp::test::run_command(fmt::format("{} to-safetensors {} {}", script, golden("tokens.bin"), path("no.st")));
  EXPECT_EQ(bad.code, 2) << bad.output;
  expect_has(bad.output, "not an llm.c model file");
  EXPECT_FALSE(std::filesystem::exists(path("no.st")));
}

}  // namespace
