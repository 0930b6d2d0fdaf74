// fuzz_text.cpp — the text reader (dp::load_text) and its windows (dp::TextWindows): the first byte
// is the context (1..64), the rest the file. Whatever it holds, the reader returns a corpus whose
// windows lie inside it, with byte ids in [0, 256) as inputs and the next bytes as targets, or
// throws dp::Error — never crashes or reads out of bounds.
#include <cstdint>
#include <memory>
#include <vector>

#include "dp/io/text.h"
#include "dp/runtime/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const int context = 1 + data[0] % 64;
  dp::fuzz::write("text.txt", data + 1, size - 1);
  try {
    const auto corpus =
        std::make_shared<const dp::TextCorpus>(dp::load_text((dp::fuzz::scratch() / "text.txt").string(), context));
    if (corpus->bytes.size() != size - 1 || corpus->split > corpus->bytes.size()) __builtin_trap();
    std::vector<std::int32_t> inputs(static_cast<std::size_t>(context));
    std::vector<std::int64_t> targets(static_cast<std::size_t>(context));
    for (const auto split : {dp::TextWindows::Split::train, dp::TextWindows::Split::held_out}) {
      const dp::TextWindows windows(corpus, split, context);
      if (windows.size() == 0 || windows.targets_per_sample() != context) __builtin_trap();
      for (const std::size_t i : {std::size_t{0}, windows.size() / 2, windows.size() - 1}) {
        windows.fill(i, {}, inputs.data());
        windows.fill_targets(i, targets.data());
        for (int t = 0; t < context; ++t) {
          if (!(inputs[t] >= 0 && inputs[t] < 256) || targets[t] < 0 || targets[t] >= 256) __builtin_trap();
          // Each target is the next input: the window's bytes shifted by one.
          if (t + 1 < context && targets[t] != inputs[t + 1]) __builtin_trap();
        }
      }
    }
  } catch (const dp::Error&) {
  }
  return 0;
}
