// test_lost_device.cpp — a device lost in training (DP_FAULT lose@dN:STEP[:PHASE]), as
// docs/training.md ("When a device fails") says: under --shards the survivors take its shards and
// the run ends with the checkpoint of an undisturbed run, byte for byte, in every mode, with graphs
// on and off, whatever the phase; without --shards the last completed step is saved (exit 7) and
// resumes on the remaining devices; where no survivor holds the whole state nothing is written.
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "test_util.h"
#include "tool_test.h"

namespace {

using Result = dp::test::CommandResult;

class LostDevice : public dp::test::ToolTest {
 protected:
  // dp_train on simulated devices with `env` (DP_FAULT=...) in front, SGD with momentum unless
  // `optimizer` says otherwise.
  Result train(const std::string& env, const std::string& args, const std::string& optimizer = "--momentum 0.9") const {
    return dp::test::run_command(
        fmt::format("cd {} && {} timeout 120 {} --backend sim --synthetic 240 --batch-size 2 "
                    "--seed 5 --lr 0.02 {} --no-eval {}",
                    dir_.string(), env, DP_TRAIN_BIN, optimizer, args));
  }
  // lost.st resumed to step 8 on the devices a loss of device 2 left, into resumed.st.
  Result resume_on_survivors(const std::string& args = "") const {
    return dp::test::run_command(
        fmt::format("cd {} && {} --backend sim --synthetic 240 --resume lost.st --steps 8 --device-ids 0,1,3 {} "
                    "--save resumed.st",
                    dir_.string(), DP_TRAIN_BIN, args));
  }
  // The tensors of two checkpoints, byte for byte (their tags may differ: the device count).
  void expect_same_tensors(const std::string& a_path, const std::string& b_path) const {
    const auto a = dp::safetensors::read(path(a_path)), b = dp::safetensors::read(path(b_path));
    ASSERT_EQ(a.order, b.order);
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs";
  }
  std::vector<nlohmann::json> records(const std::string& kind, const std::string& json) const {
    std::vector<nlohmann::json> out;
    std::istringstream in(read_file(path(json)));
    for (std::string line; std::getline(in, line);)
      if (auto record = nlohmann::json::parse(line); record.value("kind", "") == kind) out.push_back(record);
    return out;
  }
};

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "no '" << part << "' in:\n" << text;
}

// 4 devices, 12 shards: device 2 lost at step 3, then device 0 at step 5; the survivors (3, then 2)
// go on and step 8's checkpoint is the undisturbed run's.
TEST_F(LostDevice, UnderShardsTheSurvivorsGoOnAndKeepTheBits) {
  for (const std::string model : {"--model convnet", "--model mlp --hidden 16 --dropout 0.25"}) {
    const std::string common = model + " --shards 12 --steps 8 --devices 4";
    for (const std::string mode : {"ddp", "dp"}) {
      ASSERT_EQ(train("", common + " --mode " + mode + " --save ref.st").code, 0);
      for (const std::string graphs : {"on", "off"})
        for (const std::string phase : {"backward", "collective"}) {
          SCOPED_TRACE(fmt::format("{} {} graphs {} {}", model, mode, graphs, phase));
          std::filesystem::remove(path("lost.st"));
          std::filesystem::remove(path("lost.json"));
          const Result r = train(
              fmt::format("DP_FAULT=lose@d2:3:{},lose@d0:5", phase),
              fmt::format("{} --mode {} --graphs {} --save lost.st --metrics-json lost.json", common, mode, graphs));
          ASSERT_EQ(r.code, 0) << r.output;
          expect_has(r.output, fmt::format("device 2 is lost (DP_FAULT lose@d2:3:{}", phase));
          expect_has(r.output, "12 shards go on from step 2 on device(s) [0,1,3], 4 shard(s) each");
          expect_has(r.output, "12 shards go on from step 4 on device(s) [1,3], 6 shard(s) each");
          expect_same_tensors("ref.st", "lost.st");
          const auto lost = records("device_lost", "lost.json");
          ASSERT_EQ(lost.size(), 2u);
          EXPECT_EQ(lost[0].at("device"), 2);
          EXPECT_EQ(lost[0].at("step"), 2);
          EXPECT_EQ(lost[0].at("devices"), nlohmann::json::parse("[0,1,3]"));
          EXPECT_EQ(lost[1].at("device"), 0);
          EXPECT_EQ(lost[1].at("devices"), nlohmann::json::parse("[1,3]"));
          for (const auto& back : records("recovered", "lost.json")) EXPECT_LT(back.at("seconds").get<double>(), 2.0);
        }
    }
  }
}

// Each phase of a step, one device lost: the same bits (the optimizer's may leave the step done).
TEST_F(LostDevice, EveryPhaseOfTheStepIsSurvived) {
  const std::string common = "--model convnet --shards 4 --steps 5 --devices 4 --mode ddp --graphs off";
  ASSERT_EQ(train("", common + " --save ref.st").code, 0);
  for (const std::string phase : {"forward", "backward", "collective", "optimizer"}) {
    SCOPED_TRACE(phase);
    const Result r = train("DP_FAULT=lose@d1:2:" + phase, common + " --save lost.st");
    ASSERT_EQ(r.code, 0) << r.output;
    expect_has(r.output, "4 shards go on from step ");
    expect_has(r.output, "on device(s) [0,2,3]");
    expect_same_tensors("ref.st", "lost.st");
  }
}

// ZeRO-1 spreads the optimizer state over the devices; in one process each rank also keeps its part
// in host memory after every step, so a lost device's part survives it: under --shards the run goes
// on with the undisturbed run's bits, whatever the phase (the optimizer's may leave the other ranks
// one step ahead of the lost one), graphs on and off; without --shards the last step every rank
// kept is saved and resumes.
TEST_F(LostDevice, ZeroKeepsEachRanksPartOnTheHost) {
  for (const std::string model :
       {"--model convnet --momentum 0.9", "--model mlp --hidden 16 --dropout 0.25 --optimizer adamw"}) {
    const std::string common = model + " --mode ddp --zero 1 --devices 4";
    const std::string shards = common + " --shards 12 --steps 8";
    ASSERT_EQ(train("", shards + " --save ref.st", "").code, 0);
    for (const std::string graphs : {"on", "off"})
      for (const std::string phase : {"backward", "optimizer"}) {
        SCOPED_TRACE(fmt::format("{} graphs {} {}", model, graphs, phase));
        std::filesystem::remove(path("lost.st"));
        std::filesystem::remove(path("lost.json"));
        const Result r =
            train(fmt::format("DP_FAULT=lose@d2:3:{},lose@d0:5:{}", phase, phase),
                  fmt::format("{} --graphs {} --save lost.st --metrics-json lost.json", shards, graphs), "");
        ASSERT_EQ(r.code, 0) << r.output;
        expect_has(r.output, "12 shards go on from step 2 on device(s) [0,1,3], 4 shard(s) each");
        expect_has(r.output, "12 shards go on from step 4 on device(s) [1,3], 6 shard(s) each");
        expect_same_tensors("ref.st", "lost.st");
        const auto recovered = records("recovered", "lost.json");
        ASSERT_EQ(recovered.size(), 2u);
        for (const auto& back : recovered) EXPECT_LT(back.at("seconds").get<double>(), 2.0);
      }
    SCOPED_TRACE(model + " without --shards");
    ASSERT_EQ(train("", common + " --steps 2 --save two.st", "").code, 0);
    const Result r = train("DP_FAULT=lose@d2:3", common + " --steps 8 --save lost.st", "");
    ASSERT_EQ(r.code, 7) << r.output;
    expect_has(r.output, "wrote lost.st at step 2: resume it on the remaining device(s) with --resume lost.st");
    expect_same_tensors("two.st", "lost.st");
    const Result resumed = resume_on_survivors("--mode ddp --zero 1");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_EQ(dp::safetensors::read(path("resumed.st")).metadata.at("dp.step"), "8");
    // Without the host copies the lost part is gone: nothing written, a file already there kept.
    std::ofstream(path("kept.st")) << "an earlier file";
    const Result off = train("DP_FAULT=lose@d2:3", common + " --steps 8 --zero-host-copies off --save kept.st", "");
    ASSERT_EQ(off.code, 7) << off.output;
    expect_has(off.output, "--zero-host-copies off kept no copy): nothing written");
    EXPECT_EQ(read_file(path("kept.st")), "an earlier file");
  }
}

// Without --shards the global batch cannot be kept: the last completed step goes to --save (the
// step a run of that length saves), exit 7 names how to resume, and the resume works.
TEST_F(LostDevice, WithoutShardsTheLastCompletedStepIsSavedAndResumes) {
  for (const std::string model : {"--model convnet", "--model mlp --hidden 16"}) {
    SCOPED_TRACE(model);
    const std::string common = model + " --mode ddp --devices 4";
    ASSERT_EQ(train("", common + " --steps 2 --save two.st").code, 0);
    const Result r = train("DP_FAULT=lose@d2:3", common + " --steps 8 --save lost.st");
    ASSERT_EQ(r.code, 7) << r.output;
    expect_has(r.output, "device 2 is lost (DP_FAULT lose@d2:3:backward");
    expect_has(r.output,
               "wrote lost.st at step 2: resume it on the remaining device(s) with --resume lost.st "
               "--device-ids 0,1,3 (with --shards the run would have gone on by itself, bit for bit)");
    expect_same_tensors("two.st", "lost.st");
    EXPECT_EQ(dp::safetensors::read(path("lost.st")).metadata.at("dp.step"), "2");
    const Result resumed = resume_on_survivors();
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_EQ(dp::safetensors::read(path("resumed.st")).metadata.at("dp.step"), "8");
  }
}

// DataParallel's source holds the whole state (the module, its buffers and its optimizer): a lost
// device other than the source leaves it at the last update that ran (the running statistics as
// they were then), which goes to --save, exit 7, as for DDP; eager steps or replayed ones, lost in
// the forward or the backward, with BatchNorm or without.
TEST_F(LostDevice, DataParallelSavesTheSourcesLastStep) {
  for (const std::string model : {"--model mlp --hidden 16", "--model convnet"}) {
    const std::string common = model + " --mode dp --devices 4 --batch-size 8";  // a chunk each
    ASSERT_EQ(train("", common + " --steps 2 --save two.st").code, 0);
    for (const std::string graphs : {"on", "off"})
      for (const std::string phase : {"forward", "backward"}) {
        SCOPED_TRACE(model + " graphs " + graphs + " " + phase);
        std::filesystem::remove(path("lost.st"));
        const Result r = train("DP_FAULT=lose@d2:3:" + phase, common + " --steps 8 --save lost.st --graphs " + graphs);
        ASSERT_EQ(r.code, 7) << r.output;
        expect_has(r.output, "device 2 is lost (DP_FAULT lose@d2:3:" + phase);
        expect_has(r.output,
                   "wrote lost.st at step 2: resume it on the remaining device(s) with --resume lost.st "
                   "--device-ids 0,1,3");
        expect_same_tensors("two.st", "lost.st");
      }
  }
}

// Rank 0 of DDP alone holds the running statistics of its step (as in torch): lost, nothing holds
// the whole state, and nothing is written; a file already at --save stays as it was.
TEST_F(LostDevice, WhereNoSurvivorHoldsTheWholeStateNothingIsWritten) {
  std::ofstream(path("kept.st")) << "an earlier file";
  const Result r = train("DP_FAULT=lose@d0:3", "--model convnet --mode ddp --devices 4 --steps 8 --save kept.st");
  ASSERT_EQ(r.code, 7) << r.output;
  expect_has(r.output, "device 0 is lost (DP_FAULT lose@d0:3:backward");
  expect_has(r.output, "no surviving device holds the whole training state");
  EXPECT_EQ(read_file(path("kept.st")), "an earlier file");
  // DataParallel: its source lost.
  const Result source = train("DP_FAULT=lose@d0:3", "--model convnet --mode dp --devices 4 --steps 8 --save kept.st");
  ASSERT_EQ(source.code, 7) << source.output;
  expect_has(source.output, "DataParallel's state lived on the source device, the one lost");
  EXPECT_EQ(read_file(path("kept.st")), "an earlier file");
}

}  // namespace
