// test_silent_corruption.cpp — the replicas' fingerprints (--check-replicas N, docs/training.md
// "Silent corruption"): a bit flipped in one parameter of one device (DP_FAULT flip-param) is named
// at the next check, the device and the tensor, exit 8, and no checkpoint is written; healthy runs
// never trip it, checked every step; the check changes no bit.
#include <filesystem>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <string>

#include "test_util.h"
#include "tool_test.h"

namespace {

using Result = dp::test::CommandResult;

class SilentCorruption : public dp::test::ToolTest {
 protected:
  Result train(const std::string& env, const std::string& args) const {
    return dp::test::run_command(
        fmt::format("cd {} && {} timeout 300 {} --backend sim --no-eval {}", dir_.string(), env, DP_TRAIN_BIN, args));
  }
};

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "no '" << part << "' in:\n" << text;
}

TEST_F(SilentCorruption, AFlippedParameterIsNamedAtTheNextCheck) {
  const std::string gpt =
      fmt::format("--model gpt --context 16 --layers 1 --heads 2 --width 32 --text {}/README.md", DP_SOURCE_DIR);
  for (const auto& [model, tensor] :
       {std::pair<std::string, std::string>{"--model convnet --synthetic 240", "fc.weight"},
        {gpt, "transformer.h.0.attn.c_attn.weight"}}) {
    for (const auto& [every, found] : {std::pair{1, 7}, std::pair{5, 10}}) {
      SCOPED_TRACE(fmt::format("{}, every {}", model, every));
      const Result r = train("DP_FAULT=flip-param@d2:7", fmt::format("{} --batch-size 2 --mode ddp --devices 4 "
                                                                     "--steps 12 --check-replicas {} --save out.st",
                                                                     model, every));
      EXPECT_EQ(r.code, 8) << r.output;
      expect_has(r.output, fmt::format("silent corruption: after step {} the replicas' parameters differ: global rank "
                                       "2 (device 2) holds other bits than the other 3 of 4 replicas, first in '{}'",
                                       found, tensor));
      EXPECT_FALSE(std::filesystem::exists(path("out.st"))) << "a checkpoint after the corruption";
    }
  }
  // Under fixed shards too (a dp-mode run of shards), graphs off.
  const Result shards = train("DP_FAULT=flip-param@d1:3",
                              "--model mlp --hidden 16 --synthetic 240 --batch-size 2 "
                              "--mode dp --devices 3 --shards 6 --graphs off --steps 6 "
                              "--check-replicas 1");
  EXPECT_EQ(shards.code, 8) << shards.output;
  expect_has(shards.output, "global rank 1 (device 1) holds other bits than the other 2 of 3 replicas");
}

// Checked every step, healthy runs never trip the check: 10,000 steps of MLP DDP and 1,000 of
// ConvNet DDP, graphs on; and a checked run's checkpoint is an unchecked one's, byte for byte.
TEST_F(SilentCorruption, HealthyRunsNeverTripItAndItChangesNoBit) {
  const Result mlp = train("",
                           "--model mlp --hidden 16 --synthetic 512 --batch-size 8 --mode ddp --devices 2 "
                           "--steps 10000 --check-replicas 1");
  EXPECT_EQ(mlp.code, 0) << mlp.output;
  const std::string convnet = "--model convnet --synthetic 256 --batch-size 4 --mode ddp --devices 2 --steps 1000 ";
  ASSERT_EQ(train("", convnet + "--check-replicas 1 --save checked.st").code, 0);
  ASSERT_EQ(train("", convnet + "--check-replicas 0 --save unchecked.st").code, 0);
  EXPECT_EQ(read_file(path("checked.st")), read_file(path("unchecked.st")));
}

}  // namespace
