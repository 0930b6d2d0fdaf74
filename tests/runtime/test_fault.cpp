// test_fault.cpp — DP_FAULT's grammar (KIND@TARGET:STEP[:ARG][,...]): what it accepts, what it
// refuses (InvalidArgument naming the item: the tools' exit 2), and when a planned fault fires.
#include <chrono>
#include <gtest/gtest.h>
#include <string>
#include <vector>

#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "test_util.h"

namespace dp {
namespace {

TEST(Fault, TheGrammarIsParsed) {
  const std::vector<Fault> faults = parse_faults("desync-extra@d1:3,stall@p0:2:1.5,throw@d12:1,exit@p3:40");
  ASSERT_EQ(faults.size(), 4u);
  EXPECT_EQ(faults[0].kind, FaultKind::desync_extra);
  EXPECT_FALSE(faults[0].process_target);
  EXPECT_EQ(faults[0].target, 1);
  EXPECT_EQ(faults[0].step, 3);
  EXPECT_EQ(faults[1].kind, FaultKind::stall);
  EXPECT_TRUE(faults[1].process_target);
  EXPECT_DOUBLE_EQ(faults[1].arg, 1.5);
  EXPECT_EQ(faults[2].target, 12);
  EXPECT_EQ(faults[3].kind, FaultKind::exit);
  EXPECT_EQ(faults[3].step, 40);
  for (const Fault& f : faults) EXPECT_EQ(parse_faults(f.text())[0].text(), f.text());  // the spelling round-trips
  EXPECT_TRUE(parse_faults("").empty());
  for (const char* kind :
       {"desync-extra", "desync-skip", "desync-count", "hang", "exit", "throw", "lose", "flip-param", "flip-gemm"})
    EXPECT_EQ(fault_kind_name(parse_faults(std::string(kind) + "@d0:1")[0].kind), kind);
}

// lose@dN:STEP[:PHASE]: the phase is a name, backward unless given, and spelled out in text().
TEST(Fault, ALoseFaultNamesItsPhase) {
  const std::vector<Fault> faults = parse_faults("lose@d2:3,lose@d0:5:collective,lose@p1:1:forward");
  ASSERT_EQ(faults.size(), 3u);
  EXPECT_EQ(faults[0].kind, FaultKind::lose);
  EXPECT_EQ(faults[0].phase, FaultPhase::backward);
  EXPECT_EQ(faults[0].text(), "lose@d2:3:backward");
  EXPECT_EQ(faults[1].phase, FaultPhase::collective);
  EXPECT_EQ(faults[2].phase, FaultPhase::forward);
  EXPECT_TRUE(faults[2].process_target);
  for (const Fault& f : faults) EXPECT_EQ(parse_faults(f.text())[0].text(), f.text());
  for (const FaultPhase p : {FaultPhase::forward, FaultPhase::backward, FaultPhase::collective, FaultPhase::optimizer})
    EXPECT_EQ(parse_faults("lose@d0:1:" + std::string(fault_phase_name(p)))[0].phase, p);
  // Taken at its phase only, or at any (a replayed step's), once.
  FaultPlan plan(parse_faults("lose@d1:2:optimizer,lose@d3:2"));
  EXPECT_FALSE(plan.take(FaultKind::lose, 0, 1, 2, FaultPhase::backward));
  EXPECT_TRUE(plan.take(FaultKind::lose, 0, 1, 2, FaultPhase::optimizer));
  EXPECT_FALSE(plan.take(FaultKind::lose, 0, 1, 2, FaultPhase::optimizer));
  EXPECT_TRUE(plan.take(FaultKind::lose, 0, 3, 2, std::nullopt));
}

// flip-gemm@dN:STEP[:forward|backward]: the pass is backward unless given; it is due in every
// pass of its step (due() spends nothing), and no other phase is a pass.
TEST(Fault, AFlipGemmFaultNamesItsPassAndIsDueWithoutBeingSpent) {
  const std::vector<Fault> faults = parse_faults("flip-gemm@d1:5,flip-gemm@d2:3:forward");
  ASSERT_EQ(faults.size(), 2u);
  EXPECT_EQ(faults[0].kind, FaultKind::flip_gemm);
  EXPECT_EQ(faults[0].phase, FaultPhase::backward);
  EXPECT_EQ(faults[0].text(), "flip-gemm@d1:5:backward");
  EXPECT_EQ(faults[1].phase, FaultPhase::forward);
  for (const Fault& f : faults) EXPECT_EQ(parse_faults(f.text())[0].text(), f.text());
  const FaultPlan plan(faults);
  for (int again = 0; again < 3; ++again) EXPECT_TRUE(plan.due(FaultKind::flip_gemm, 0, 1, 5, FaultPhase::backward));
  EXPECT_FALSE(plan.due(FaultKind::flip_gemm, 0, 1, 5, FaultPhase::forward));
  EXPECT_FALSE(plan.due(FaultKind::flip_gemm, 0, 1, 4, FaultPhase::backward));
  EXPECT_FALSE(plan.due(FaultKind::flip_gemm, 0, 0, 5, FaultPhase::backward));
  EXPECT_TRUE(plan.due(FaultKind::flip_gemm, 0, 2, 3, FaultPhase::forward));
  for (const char* text : {"flip-gemm@d1:2:collective", "flip-gemm@d1:2:optimizer"}) {
    SCOPED_TRACE(text);
    try {
      parse_faults(text);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is none of forward, backward"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("collective, optimizer"), std::string::npos) << e.what();
    }
  }
}

// A lose fault makes its device lost (every later call there throws DeviceLost, exit code 7)
// and leaves the others as they were.
TEST(Fault, ALoseFaultLosesTheDeviceAndOnlyIt) {
  auto runtime = test::sim_runtime(2);
  Device& doomed = runtime->device(1);
  Device& other = runtime->device(0);
  const Stream stream = doomed.create_stream();
  DeviceBuffer buffer = doomed.allocate(64);
  FaultPlan plan(parse_faults("lose@d1:4:forward"));
  EXPECT_NO_THROW(fire_lose_faults(plan, 0, 1, 4, FaultPhase::backward, doomed));  // not its phase
  EXPECT_FALSE(doomed.lost());
  try {
    fire_lose_faults(plan, 0, 1, 4, FaultPhase::forward, doomed);
    ADD_FAILURE() << "not lost";
  } catch (const DeviceLost& e) {
    EXPECT_EQ(e.device(), 1);
    EXPECT_STREQ(e.what(), "device 1 is lost (DP_FAULT lose@d1:4:forward, in the forward of step 4)");
    EXPECT_EQ(exit_code(std::current_exception()), 7);
  }
  EXPECT_TRUE(doomed.lost());
  float value = 0.0f;
  EXPECT_THROW(stream.copy(&value, buffer.data(), sizeof(float)), DeviceLost);
  EXPECT_THROW(stream.synchronize(), DeviceLost);
  EXPECT_THROW((void)doomed.create_stream(), DeviceLost);
  EXPECT_THROW((void)doomed.allocate(4), DeviceLost);
  EXPECT_THROW(doomed.synchronize(), DeviceLost);
  EXPECT_EQ(stream.device(), 1) << "what a stream is can still be asked";
  // The other device works on.
  DeviceBuffer mine = other.allocate(sizeof(float));
  const Stream fine = other.create_stream();
  value = 2.5f;
  fine.copy(mine.data(), &value, sizeof(float));
  float back = 0.0f;
  fine.copy(&back, mine.data(), sizeof(float));
  EXPECT_EQ(back, 2.5f);
}

TEST(Fault, AMalformedValueIsRefusedNamingTheItem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"hang", "no '@'"},
      {"explode@d0:1", "unknown kind 'explode'"},
      {"hang@d0", "no ':STEP'"},
      {"hang@x0:1", "neither dN nor pN"},
      {"hang@d:1", "neither dN nor pN"},
      {"hang@d-1:1", "no valid index"},
      {"hang@d1:0", "step '0'"},
      {"hang@d1:-2", "step '-2'"},
      {"hang@d1:2.5", "step '2.5'"},
      {"hang@d1:1:5", "hang takes no ARG"},
      {"stall@d1:1", "stall needs ':ARG'"},
      {"stall@d1:1:abc", "ARG 'abc'"},
      {"stall@d1:1:-1", "ARG '-1'"},
      {"stall@d1:1:nan", "ARG 'nan'"},
      {"stall@d1:1:2:3", "more than TARGET:STEP:ARG"},
      {"hang@d0:1,", "item ''"},
      {"hang@d0:1,,throw@d1:1", "item ''"},
      {"HANG@d0:1", "unknown kind 'HANG'"},
      {"lose@d1:2:loss", "phase 'loss' is none of forward, backward, collective, optimizer"},
      {"lose@d1:2:backward:1", "more than TARGET:STEP:ARG"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    try {
      parse_faults(text);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("KIND@TARGET:STEP"), std::string::npos) << e.what();
    }
  }
}

TEST(Fault, AFaultFiresOnceWhereAndWhenItIsDue) {
  FaultPlan plan(parse_faults("throw@d2:3,hang@p1:2"));
  EXPECT_TRUE(plan.has(FaultKind::throw_error));
  EXPECT_FALSE(plan.has(FaultKind::stall));
  EXPECT_FALSE(plan.take(FaultKind::throw_error, 0, 2, 2));  // not its step
  EXPECT_FALSE(plan.take(FaultKind::throw_error, 0, 1, 3));  // not its device
  EXPECT_FALSE(plan.take(FaultKind::hang, 0, 2, 3));         // not its kind
  EXPECT_TRUE(plan.take(FaultKind::throw_error, 0, 2, 3));
  EXPECT_FALSE(plan.take(FaultKind::throw_error, 0, 2, 3));  // spent
  // pN: on each device of process N, once each.
  EXPECT_FALSE(plan.take(FaultKind::hang, 0, 0, 2));
  EXPECT_TRUE(plan.take(FaultKind::hang, 1, 2, 2));
  EXPECT_TRUE(plan.take(FaultKind::hang, 1, 3, 2));
  EXPECT_FALSE(plan.take(FaultKind::hang, 1, 3, 2));
}

TEST(Fault, TargetsBeyondTheJobAreRefused) {
  FaultPlan plan(parse_faults("throw@d3:1,hang@p1:1"));
  EXPECT_NO_THROW(plan.check_targets(2, 2));
  EXPECT_THROW(plan.check_targets(1, 4), InvalidArgument);  // p1 of one process
  try {
    plan.check_targets(1, 2);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'throw@d3:1': the job has 2 devices (d0..d1)"), std::string::npos)
        << e.what();
  }
}

TEST(Fault, AThrowFaultThrowsAndAStallSleeps) {
  FaultPlan plan(parse_faults("throw@d0:1,stall@d1:1:0.2"));
  EXPECT_THROW(fire_step_faults(plan, 0, 0, 1), Error);
  EXPECT_NO_THROW(fire_step_faults(plan, 0, 0, 1));  // spent
  const auto start = std::chrono::steady_clock::now();
  fire_step_faults(plan, 0, 1, 1);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
}

}  // namespace
}  // namespace dp
