// test_faults.cpp — every failure DP_FAULT injects ends dp_train as docs/training.md ("When a job
// stops") says: a desync (an extra all-reduce, a skipped bucket, a wrong count) within 2 s, exit 4,
// naming the ranks, step, call number, both signatures and both call sites; a device thread stuck
// for good named by the watch while alive and ended at DP_TIMEOUT_S (exit 6); a stall waited for,
// the checkpoint then equal to an undisturbed run's; each abnormal end leaves a flight record.
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>

#include "test_util.h"
#include "tool_test.h"

namespace {

using Result = dp::test::CommandResult;

class Faults : public dp::test::ToolTest {
 protected:
  struct Timed {
    Result r;
    double seconds = 0;
  };
  // dp_train's DDP (or `mode`) on 4 simulated devices, 6 steps, with `env` (DP_FAULT=..., ...) in front.
  Timed train(const std::string& env, const std::string& extra = "", const std::string& mode = "ddp") const {
    const auto start = std::chrono::steady_clock::now();
    Timed t;
    t.r = dp::test::run_command(fmt::format(
        "cd {} && DP_FLIGHT_DIR={} {} timeout 120 {} --model mlp --hidden 32 --mode {} --backend sim --devices 4 "
        "--synthetic 128 --batch-size 8 --steps 6 --seed 3 {}",
        dir_.string(), dir_.string(), env, DP_TRAIN_BIN, mode, extra));
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return t;
  }
  nlohmann::json flight_record() const {
    return nlohmann::json::parse(read_file(path("dp-flight-0.json")), nullptr, false);
  }
};

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "no '" << part << "' in:\n" << text;
}

TEST_F(Faults, EveryInjectedDesyncEndsTheJobAtOnceNamingBothCalls) {
  struct Case {
    const char* fault;
    std::vector<std::string> named;
  };
  const std::vector<Case> cases = {
      {"desync-extra@d1:3",
       {"global rank 0 (step 3) issued all_reduce f32 x ", "(bucket 0, at reducer.cpp:",
        "global rank 1 (step 3) issued all_reduce f32 x 1 (DP_FAULT desync-extra@d1:3, at checked_communicator.cpp:"}},
      {"desync-skip@d2:2",
       {"(bucket 0, at reducer.cpp:", "global rank 2 (step 2) issued end none x 0 (the step, at replica_engine.cpp:"}},
      {"desync-count@d3:4",
       {"global rank 0 (step 4) issued all_reduce f32 x 25450 (bucket 0",
        "global rank 3 (step 4) issued all_reduce f32 x 25451 (bucket 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fault);
    std::filesystem::remove(path("dp-flight-0.json"));
    const Timed t = train(fmt::format("DP_FAULT={}", c.fault));
    EXPECT_EQ(t.r.code, 4) << t.r.output;
    EXPECT_LT(t.seconds, 2.0 + 2.0);  // the run's own start included (a loaded machine)
    expect_has(t.r.output, "collectives desynchronized at call #");
    expect_has(t.r.output, "no rank ran it");
    for (const std::string& part : c.named) expect_has(t.r.output, part);
    const nlohmann::json record = flight_record();
    ASSERT_TRUE(record.is_object()) << t.r.output;
    EXPECT_EQ(record["process"], 0);
    expect_has(record["reason"].get<std::string>(), "exit code 4");
    int failed = 0;
    for (const auto& e : record["entries"]) failed += e["state"] == "failed";
    EXPECT_EQ(failed, 4);  // the mismatched call, on every rank
  }
}

TEST_F(Faults, AThrowOnADeviceThreadEndsTheJobNamingTheDevice) {
  const Timed t = train("DP_FAULT=throw@d2:2");
  EXPECT_EQ(t.r.code, 1) << t.r.output;
  expect_has(t.r.output, "device 2: DP_FAULT throw@d2:2: device 2 fails at step 2");
}

// A device thread that stops for good in a live process: the watch names it (and its phase) after
// DP_STALL_WARN_S while the job goes on waiting; DP_TIMEOUT_S then ends it, exit 6, naming it.
TEST_F(Faults, AStuckDeviceThreadIsNamedThenEndedAtTheTimeout) {
  // Eager steps (no graph replays): every call is a host call in the record.
  const Timed t = train("DP_FAULT=hang@d1:3 DP_STALL_WARN_S=1 DP_TIMEOUT_S=4", "--graphs off");
  EXPECT_EQ(t.r.code, 6) << t.r.output;
  EXPECT_GT(t.seconds, 4.0);
  EXPECT_LT(t.seconds, 4.0 + 2.0 + 1.0);  // DP_TIMEOUT_S + 2 s at most, the run's start included
  expect_has(t.r.output, "dp: warning: process 0: device 1 in the step's start of step 3 for ");
  expect_has(t.r.output, "no progress (still alive; the job ends only at DP_TIMEOUT_S)");
  // The peers waiting in the next call name it, and where it is.
  expect_has(t.r.output,
             "waited 4 s for rank(s) 1 to issue it (timeout; DP_TIMEOUT_S sets it); device 1 in the "
             "step's start of step 3 for ");
  expect_has(t.r.output, "; device 1 does not return (stuck for good)");
  const nlohmann::json record = flight_record();
  ASSERT_TRUE(record.is_object()) << t.r.output;
  expect_has(record["summary"].get<std::string>(), "device 1 in the step's start of step 3");
  expect_has(record["summary"].get<std::string>(), "process 0 device 1 last issued end #");
  // The reader merges the records and names the rank that did not reach the call the others wait in.
  const Result reader =
      dp::test::run_command(fmt::format("python3 {}/scripts/flight_record.py {}", DP_SOURCE_DIR, dir_.string()));
  EXPECT_EQ(reader.code, 0) << reader.output;
  expect_has(reader.output, "communicator 0: rank(s) 1 did not reach all_reduce #");
  expect_has(reader.output, "(bucket 0, f32 x 25450); rank(s) 0, 2, 3 waited in it");
}

// Under ZeRO-2 a rank's compute stream waits for a slot's reduction on the communication stream: a
// device stuck at a step's start (its peers' reduce-scatters, and their slot waits behind them,
// never met) still ends the job at DP_TIMEOUT_S, exit 6, naming it, and nothing is saved.
TEST_F(Faults, AStuckDeviceUnderZeroTwoEndsTheJobAtTheTimeout) {
  const Timed t =
      train("DP_FAULT=hang@d1:3 DP_STALL_WARN_S=1 DP_TIMEOUT_S=4",
            "--graphs off --zero 2 --bucket-cap-mb 0.01 --first-bucket-mb 0.01 --save " + path("zero2.safetensors"));
  EXPECT_EQ(t.r.code, 6) << t.r.output;
  EXPECT_LT(t.seconds, 4.0 + 2.0 + 1.0);  // DP_TIMEOUT_S + 2 s at most, the run's start included
  expect_has(t.r.output, "device 1 does not return (stuck for good)");
  EXPECT_FALSE(std::filesystem::exists(path("zero2.safetensors")));
}

// A stall shorter than the timeout is waited for: a warning, then the run ends as an undisturbed one
// does, its checkpoint byte for byte the same.
TEST_F(Faults, AStallIsWaitedForAndChangesNoBit) {
  const Timed plain = train("", "--save " + path("plain.safetensors"));
  ASSERT_EQ(plain.r.code, 0) << plain.r.output;
  const Timed stalled = train("DP_FAULT=stall@d2:3:2.5 DP_STALL_WARN_S=1", "--save " + path("stalled.safetensors"));
  ASSERT_EQ(stalled.r.code, 0) << stalled.r.output;
  expect_has(stalled.r.output, "dp: warning: process 0: device 2 in the step's start of step 3 for ");
  EXPECT_GT(stalled.seconds, 2.5);
  EXPECT_EQ(read_file(path("plain.safetensors")), read_file(path("stalled.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(path("dp-flight-0.json")));  // no abnormal end
}

// DataParallel's device threads take the faults that act on a device thread as DDP's do, eager or
// replayed from a graph: a throw ends the run naming the device, a device stuck for good is named
// and ended at DP_TIMEOUT_S (exit 6), a stall changes no bit. The kinds with nothing to act on in
// DataParallel (no collectives, one replica) are refused before any work.
TEST_F(Faults, DataParallelDevicesTakeTheDeviceFaults) {
  for (const std::string graphs : {"--graphs off", "--graphs on"}) {
    SCOPED_TRACE(graphs);
    const Timed thrown = train("DP_FAULT=throw@d2:4", graphs, "dp");
    EXPECT_EQ(thrown.r.code, 1) << thrown.r.output;
    expect_has(thrown.r.output, "DP_FAULT throw@d2:4: device 2 fails at step 4");
    // A batch of 2 over 4 devices leaves devices 2 and 3 without a chunk (torch leaves them out of
    // the step): a fault aimed at one still meets its step.
    const Timed idle = train("DP_FAULT=throw@d3:4", graphs + " --batch-size 2", "dp");
    EXPECT_EQ(idle.r.code, 1) << idle.r.output;
    expect_has(idle.r.output, "DP_FAULT throw@d3:4: device 3 fails at step 4");
  }
  const Timed hung = train("DP_FAULT=hang@d1:3 DP_STALL_WARN_S=1 DP_TIMEOUT_S=4", "--graphs off", "dp");
  EXPECT_EQ(hung.r.code, 6) << hung.r.output;
  EXPECT_GT(hung.seconds, 4.0);
  EXPECT_LT(hung.seconds, 4.0 + 2.0 + 1.0) << hung.r.output;
  expect_has(hung.r.output, "dp: warning: process 0: device 1 in the step's start of step 3 for ");
  expect_has(hung.r.output, "device 0 waits in the step's next phase");
  expect_has(hung.r.output, "did not finish its work within 4 s (timeout; DP_TIMEOUT_S sets it)");
  expect_has(hung.r.output, "; process 0 device 1 in the step's start of step 3 for ");  // the culprit
  const Timed plain = train("", "--save " + path("dp_plain.safetensors"), "dp");
  ASSERT_EQ(plain.r.code, 0) << plain.r.output;
  const Timed stalled =
      train("DP_FAULT=stall@d3:2:2 DP_STALL_WARN_S=1", "--save " + path("dp_stalled.safetensors"), "dp");
  ASSERT_EQ(stalled.r.code, 0) << stalled.r.output;
  EXPECT_GT(stalled.seconds, 2.0);
  EXPECT_EQ(read_file(path("dp_plain.safetensors")), read_file(path("dp_stalled.safetensors")));
  const Timed refused = train("DP_FAULT=desync-extra@d1:3", "--save " + path("never.safetensors"), "dp");
  EXPECT_EQ(refused.r.code, 2) << refused.r.output;
  expect_has(refused.r.output, "DP_FAULT desync-extra@d1:3: DataParallel issues no collectives");
  expect_has(train("DP_FAULT=lose@d1:3:optimizer", "", "dp").r.output,
             "DP_FAULT lose@d1:3:optimizer: DataParallel's optimizer runs on the source device (0) alone");
  EXPECT_FALSE(std::filesystem::exists(path("never.safetensors")));
  // The one-device trainer has nothing a fault acts on: refused, not ignored.
  const Timed single = train("DP_FAULT=lose@d0:2", "--save " + path("never.safetensors"), "single");
  EXPECT_EQ(single.r.code, 2) << single.r.output;
  expect_has(single.r.output, "DP_FAULT lose@d0:2:backward: --mode single runs none of its faults");
  EXPECT_FALSE(std::filesystem::exists(path("never.safetensors")));
}

TEST_F(Faults, MalformedSettingsAreRefusedBeforeAnyWork) {
  for (const std::string env : {"DP_FAULT=hang@d1", "DP_FAULT=bogus@d0:1", "DP_FAULT=hang@d4:1",
                                "DP_FAULT=lose@d1:2:loss", "DP_CHECK_COLLECTIVES=yes", "DP_STALL_WARN_S=0"}) {
    SCOPED_TRACE(env);
    const Timed t = train(env, "--save " + path("never.safetensors"));
    EXPECT_EQ(t.r.code, 2) << t.r.output;
    EXPECT_FALSE(std::filesystem::exists(path("never.safetensors")));
  }
  expect_has(train("DP_FAULT=hang@d4:1").r.output, "DP_FAULT item 'hang@d4:1': the job has 4 devices (d0..d3)");
}

// With the check off, a run is bit for bit the checked run (the check only reads signatures).
TEST_F(Faults, TheCheckChangesNoBit) {
  ASSERT_EQ(train("", "--save " + path("checked.safetensors")).r.code, 0);
  ASSERT_EQ(train("DP_CHECK_COLLECTIVES=0", "--save " + path("unchecked.safetensors")).r.code, 0);
  EXPECT_EQ(read_file(path("checked.safetensors")), read_file(path("unchecked.safetensors")));
}

}  // namespace
