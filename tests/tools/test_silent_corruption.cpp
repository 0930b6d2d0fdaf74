// test_silent_corruption.cpp — the replicas' fingerprints (--check-replicas N, docs/training.md
// "Silent corruption"): a bit flipped in one parameter of one device (DP_FAULT flip-param) is named
// at the next check, the device and the tensor, exit 8, and no checkpoint is written; healthy runs
// never trip it, checked every step; the check changes no bit. And shadow shards (--shadow-shards K
// with --shards): a bit flipped in a GEMM's output (DP_FAULT flip-gemm) is caught before the
// update, the device that computes wrong named by a third and dropped, the run going on to the
// undisturbed run's bits; with no third device both are named, exit 8.
#include <filesystem>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <string>

#include "dp/io/safetensors.h"
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
  // The tensors of two checkpoints, byte for byte (their tags may differ: the device count).
  void expect_same_tensors(const std::string& a_path, const std::string& b_path) const {
    const auto a = dp::safetensors::read(path(a_path)), b = dp::safetensors::read(path(b_path));
    ASSERT_EQ(a.order, b.order);
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs";
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
  // Shadow shards every step: 2,000 steps of MLP and 300 of ConvNet (with BatchNorm, whose running
  // statistics the twin's extra forward must not move), graphs on; the same checkpoint as unchecked.
  const Result shadow_mlp = train("",
                                  "--model mlp --hidden 16 --synthetic 512 --batch-size 8 --mode ddp --devices 2 "
                                  "--shards 2 --shadow-shards 1 --steps 2000");
  EXPECT_EQ(shadow_mlp.code, 0) << shadow_mlp.output;
  const std::string sharded =
      "--model convnet --synthetic 256 --batch-size 4 --mode ddp --devices 3 --shards 6 --steps 300 --check-replicas "
      "0 ";
  ASSERT_EQ(train("", sharded + "--shadow-shards 1 --save shadowed.st").code, 0);
  ASSERT_EQ(train("", sharded + "--save plain.st").code, 0);
  EXPECT_EQ(read_file(path("shadowed.st")), read_file(path("plain.st")));
}

// 4 devices, 8 shards, a shard checked every step: at step 5 the check is device 1's second shard
// (shard 3), recomputed by device 2. Device 1's GEMMs flip a bit in step 5's backward: device 3
// recomputes the shard as device 2 did, device 1 is dropped before any update, and the survivors
// redo step 5 and end where an undisturbed run (checked or not) ends, byte for byte.
TEST_F(SilentCorruption, AShadowShardNamesTheDeviceWhoseGemmFlipsAndTheRunKeepsItsBits) {
  const std::string gpt =
      fmt::format("--model gpt --context 16 --layers 1 --heads 2 --width 32 --text {}/README.md", DP_SOURCE_DIR);
  for (const std::string& model : {std::string("--model convnet --synthetic 240"), gpt}) {
    SCOPED_TRACE(model);
    const std::string common = model + " --batch-size 2 --mode ddp --devices 4 --shards 8 --steps 7 --seed 5";
    ASSERT_EQ(train("", common + " --save ref.st").code, 0);
    const Result healthy = train("", common + " --shadow-shards 1 --save checked.st");
    ASSERT_EQ(healthy.code, 0) << healthy.output;
    expect_same_tensors("ref.st", "checked.st");
    const Result r = train("DP_FAULT=flip-gemm@d1:5:backward", common + " --shadow-shards 1 --save shadow.st");
    ASSERT_EQ(r.code, 0) << r.output;
    expect_has(r.output, "silent corruption: shard 3 of step 5 computed by device 1 and again by device 2 differs");
    expect_has(
        r.output,
        "device 3 recomputed it as device 2 did: device 1 computes wrong and is dropped before the step's update");
    expect_has(r.output, "8 shards go on from step 4 on device(s) [0,2,3]");
    expect_same_tensors("ref.st", "shadow.st");
  }
}

// After a device is dropped the survivors hold uneven shares (8 shards on 3 devices: 3, 3, 2): the
// twin is then the device a shard short, whose recomputation fits in the time the others take
// (device 0's shard recomputed by device 3, not by the next device, 2, which settles it).
TEST_F(SilentCorruption, OnUnevenSharesTheTwinIsTheDeviceAShardShort) {
  const std::string common =
      "--model mlp --hidden 16 --synthetic 240 --batch-size 2 --mode ddp --devices 4 --shards 8 --steps 7 --seed 5";
  ASSERT_EQ(train("", common + " --save ref.st").code, 0);
  const Result r =
      train("DP_FAULT=flip-gemm@d1:5:backward,flip-gemm@d0:6:backward", common + " --shadow-shards 1 --save shadow.st");
  ASSERT_EQ(r.code, 0) << r.output;
  expect_has(r.output, "8 shards go on from step 4 on device(s) [0,2,3], 3 or 2 shards each");
  expect_has(r.output, "of step 6 computed by device 0 and again by device 3 differs");
  expect_has(r.output,
             "device 2 recomputed it as device 3 did: device 0 computes wrong and is dropped before the step's update");
  expect_has(r.output, "on device(s) [2,3]");
  expect_same_tensors("ref.st", "shadow.st");
}

// Two devices: no third to settle a mismatch, so the run ends naming both (exit 8) and writes
// nothing; a forward's flip is caught as a backward's.
TEST_F(SilentCorruption, AShadowShardWithNoThirdDeviceNamesBothAndEnds) {
  const Result r = train("DP_FAULT=flip-gemm@d1:3:forward",
                         "--model mlp --hidden 16 --synthetic 240 --batch-size 2 --mode dp --devices 2 --shards 4 "
                         "--shadow-shards 1 --steps 6 --save out.st");
  EXPECT_EQ(r.code, 8) << r.output;
  expect_has(r.output, "of step 3 computed by device 1 and again by device 0 differs");
  expect_has(r.output, "no third device in this process can tell which of the two computes wrong");
  EXPECT_FALSE(std::filesystem::exists(path("out.st"))) << "a checkpoint after the corruption";
  // Shadow shards check fixed shards: without --shards, or on one device, the run is refused.
  const Result alone = train("",
                             "--model mlp --hidden 16 --synthetic 240 --mode ddp --devices 1 --shards 2 "
                             "--shadow-shards 1 --steps 2 --save out.st");
  EXPECT_EQ(alone.code, 2) << alone.output;
  expect_has(alone.output, "a second device of its process");
  const Result unsharded =
      train("", "--model mlp --hidden 16 --synthetic 240 --mode ddp --devices 2 --shadow-shards 1 --steps 2");
  EXPECT_EQ(unsharded.code, 2) << unsharded.output;
  expect_has(unsharded.output, "it needs shards > 0");
  EXPECT_FALSE(std::filesystem::exists(path("out.st")));
}

}  // namespace
