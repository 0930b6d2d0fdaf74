// test_env_train.cpp — dp_train started as torchrun starts processes (env://: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; no mpirun): 2 processes x 2 simulated devices must write, byte for
// byte, the checkpoint of 1 process x 4 devices, and a process that fails (before training or in
// the middle of it) or never starts must end the job with a message naming it — never a hang. Built where dp has the
// env:// process group (gloo).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <string>
#include <unistd.h>

#include "test_util.h"
#include "tool_test.h"

namespace {

using Result = dp::test::CommandResult;
Result run(const std::string& args) { return dp::test::run_command(std::string(DP_TRAIN_BIN) + " " + args); }

class EnvTrain : public dp::test::ToolTest {};
// Processes started as torchrun starts them: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, no
// mpirun. Returns both exit codes and outputs; `second` empty: process 1 never starts.
struct EnvJob {
  int code0 = -1, code1 = -1;
  std::string out0, out1;
  double seconds = 0;
};
EnvJob env_job(const std::filesystem::path& dir, int port, const std::string& first, const std::string& second,
               int timeout_s = 60) {
  const auto env = [&](int rank) {
    return fmt::format(
        "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE RANK={} WORLD_SIZE=2 "
        "MASTER_ADDR=127.0.0.1 MASTER_PORT={} DP_TIMEOUT_S={} timeout 120 {} ",
        rank, port, timeout_s, DP_TRAIN_BIN);
  };
  const std::string out0 = (dir / "env0.txt").string(), out1 = (dir / "env1.txt").string();
  std::string script = env(0) + first + " >" + out0 + " 2>&1 & p0=$!; ";
  script += second.empty() ? "c1=-1; " : env(1) + second + " >" + out1 + " 2>&1; c1=$?; ";
  script += "wait $p0; c0=$?; echo codes $c0 $c1";
  const auto start = std::chrono::steady_clock::now();
  const auto r = dp::test::run_command("sh -c '" + script + "'");
  EnvJob job;
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::sscanf(r.output.substr(r.output.find("codes")).c_str(), "codes %d %d", &job.code0, &job.code1);
  std::ifstream a(out0), b(out1);
  job.out0.assign(std::istreambuf_iterator<char>(a), std::istreambuf_iterator<char>());
  job.out1.assign(std::istreambuf_iterator<char>(b), std::istreambuf_iterator<char>());
  return job;
}

// Two env:// processes of 2 simulated devices write the checkpoint of one process of 4, byte for
// byte, with and without SyncBatchNorm; a bad file on one stops both within seconds; a process that
// never starts ends the other after the timeout, naming it.
TEST_F(EnvTrain, TwoProcessesOfTwoDevicesWriteTheCheckpointOfOneProcessOfFour) {
  const int base_port = 20000 + static_cast<int>(::getpid() % 20000);
  int port = base_port;
  for (const std::string model : {"--model mlp --hidden 32", "--model convnet --sync-bn"}) {
    SCOPED_TRACE(model);
    const std::string common =
        model + " --mode ddp --backend sim --synthetic 120 --batch-size 6 --lr 0.01 --seed 7 --steps 6 --log-every 1";
    ASSERT_EQ(run(common + " --devices 4 --save " + path("one.safetensors")).code, 0);
    const EnvJob two = env_job(dir_, ++port, common + " --devices 2 --save " + path("two.safetensors"),
                               common + " --devices 2 --save " + path("two.safetensors"));
    ASSERT_EQ(two.code0, 0) << two.out0 << two.out1;
    ASSERT_EQ(two.code1, 0) << two.out1;
    EXPECT_EQ(read_file(path("one.safetensors")), read_file(path("two.safetensors"))) << "checkpoint bytes differ";
    EXPECT_NE(two.out0.find("in each of 2 processes"), std::string::npos) << two.out0;
  }
  const std::string common = "--model mlp --hidden 8 --mode ddp --backend sim --devices 2 --batch-size 4 --steps 3";
  const EnvJob bad = env_job(dir_, ++port, common + " --synthetic 40", common + " --data " + path("no-such-dir"));
  EXPECT_NE(bad.code0, 0) << bad.out0;
  EXPECT_EQ(bad.code1, 2) << bad.out1;
  EXPECT_LT(bad.seconds, 30.0);
  EXPECT_NE(bad.out1.find("no-such-dir"), std::string::npos) << bad.out1;
  // A process that fails in the middle of training (as a crash would) ends the other at once.
  const EnvJob crash = env_job(dir_, ++port, common + " --synthetic 400 --steps 1000",
                               common + " --synthetic 400 --steps 1000 --debug-fail-at-step 5");
  EXPECT_NE(crash.code0, 0) << crash.out0;
  EXPECT_NE(crash.code1, 0) << crash.out1;
  EXPECT_NE(crash.out0.find("process 1"), std::string::npos) << crash.out0;
  EXPECT_LT(crash.seconds, 30.0);
  const EnvJob alone = env_job(dir_, ++port, common + " --synthetic 40", "", 3);
  EXPECT_NE(alone.code0, 0) << alone.out0;
  EXPECT_NE(alone.out0.find("process 1"), std::string::npos) << alone.out0;
  EXPECT_LT(alone.seconds, 30.0);
}

}  // namespace
