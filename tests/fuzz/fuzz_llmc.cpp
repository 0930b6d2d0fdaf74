// fuzz_llmc.cpp — llm.c's readers (dp/io/llmc.h): the first byte chooses a model file (0 mod 4), a
// tokenizer file (2 mod 4) or a token shard (odd) and, for a shard, the context and batch of its
// samples; the rest is the file.
// Whatever it holds, a model read has llm.c's layout and finite sizes, a shard's samples lie inside
// it with ids below the vocabulary, or the reader throws dp::Error — never a crash or a read out of
// bounds (the shard is mapped: a read past it would fault).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dp/io/llmc.h"
#include "dp/runtime/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string path = dp::fuzz::write("llmc.bin", data + 1, size - 1);
  try {
    if (data[0] % 4 == 2) {
      const dp::llmc::Tokenizer tokenizer = dp::llmc::read_tokenizer(path);
      if (tokenizer.eot < 0 || static_cast<std::size_t>(tokenizer.eot) >= tokenizer.tokens.size()) __builtin_trap();
      for (std::size_t id = 0; id < tokenizer.tokens.size(); ++id)
        if (tokenizer.tokens[id].empty() || tokenizer.printable(static_cast<int>(id)).size() > 255) __builtin_trap();
      // The file's own bytes as a prompt: what encodes decodes back to them.
      const std::string_view text(reinterpret_cast<const char*>(data + 1), std::min<std::size_t>(size - 1, 4096));
      try {
        std::string decoded;
        for (const int id : tokenizer.encode(text)) decoded += tokenizer.tokens.at(static_cast<std::size_t>(id));
        if (decoded != text) __builtin_trap();
      } catch (const dp::Error&) {  // a byte no token starts with
      }
      return 0;
    }
    if (data[0] % 2 == 0) {
      const dp::llmc::Model model = dp::llmc::read_model(path);
      const auto layout = dp::llmc::parameter_layout(model.config);
      if (model.tensors.order.size() != layout.size()) __builtin_trap();
      for (const auto& [name, shape] : layout)
        if (model.tensors.at(name).shape != shape) __builtin_trap();
      return 0;
    }
    const int vocab = 300, context = 1 + (data[0] >> 1) % 8, batch = 1 + (data[0] >> 4) % 4;
    std::vector<std::shared_ptr<const dp::llmc::TokenShard>> shards{
        std::make_shared<const dp::llmc::TokenShard>(path, vocab)};
    const dp::llmc::TokenSamples samples(shards, context, batch, vocab, (data[0] >> 6) % 2 == 1);
    std::vector<std::int32_t> inputs(static_cast<std::size_t>(context));
    std::vector<std::int64_t> targets(static_cast<std::size_t>(context));
    for (std::size_t position = 0; position < samples.size(); ++position) {
      const std::size_t i = samples.sample_at(position, data[0] % 3);  // a later epoch's order too
      if (i >= samples.size()) __builtin_trap();
      samples.fill(i, {}, inputs.data());
      samples.fill_targets(i, targets.data());
      for (int t = 0; t < context; ++t)
        if (!(inputs[t] >= 0 && inputs[t] < vocab) || targets[t] < 0 || targets[t] >= vocab) __builtin_trap();
    }
  } catch (const dp::Error&) {
  }
  return 0;
}
