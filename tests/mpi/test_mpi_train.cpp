// test_mpi_train.cpp — dp_train under mpirun, as a user runs it across nodes: 2 processes x 2
// simulated devices must write, byte for byte, the checkpoint of 1 process x 4 devices (MLP and
// ConvNet, with and without SyncBatchNorm, straight and resumed), evaluate the same test set, and
// a failure on one process must stop every process with a message naming it — never a hang.
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "test_util.h"
#include "tool_test.h"

namespace {

namespace fs = std::filesystem;
using dp::test::CommandResult;

std::string slurp(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The training log without its timings: the lines that must match between the two launches.
std::vector<std::string> step_lines(const std::string& output) {
  std::vector<std::string> out;
  const std::regex loss(
      R"(step +\d+ epoch +\d+ loss [0-9.]+ lr [0-9.e+-]+|train loss [0-9.]+|test loss [0-9.]+ \| test acc [0-9.]+%)");
  for (std::sregex_iterator it(output.begin(), output.end(), loss), end; it != end; ++it) out.push_back(it->str());
  return out;
}

class MpiTrain : public dp::test::ToolTest {
 protected:
  static CommandResult one_process(const std::string& args) {
    return dp::test::run_command(fmt::format("{} {}", DP_TRAIN_BIN, args));
  }
  // mpirun -np 2 (MPMD): process 0 gets `args` + `first`, process 1 `args` + `second`.
  static CommandResult each_its_own(const std::string& args, const std::string& first, const std::string& second,
                                    const std::string& environment = "") {
    return dp::test::run_command(fmt::format("{} {} -np 1 {} {} {} : -np 1 {} {} {}", environment, DP_MPIRUN,
                                             DP_TRAIN_BIN, args, first, DP_TRAIN_BIN, args, second));
  }
  // mpirun -np 2: every process gets `args`, plus `extra` on the second one only (MPMD).
  static CommandResult two_processes(const std::string& args, const std::string& extra = "") {
    if (extra.empty()) return dp::test::run_command(fmt::format("{} -np 2 {} {}", DP_MPIRUN, DP_TRAIN_BIN, args));
    return dp::test::run_command(
        fmt::format("{} -np 1 {} {} : -np 1 {} {} {}", DP_MPIRUN, DP_TRAIN_BIN, args, DP_TRAIN_BIN, args, extra));
  }
};

TEST_F(MpiTrain, TwoProcessesOfTwoDevicesWriteTheCheckpointOfOneProcessOfFour) {
  const std::string models[] = {"--model mlp --hidden 64,32 --dropout 0.2", "--model convnet",
                                "--model convnet --sync-bn", "--model convnet --optimizer adamw --sync-bn",
                                "--model resnet8 --shards 4"};
  for (const std::string& model : models) {
    SCOPED_TRACE(model);
    const std::string common = fmt::format(
        "{} --mode ddp --backend sim --synthetic 120 --batch-size 6 --lr 0.005 --scale-lr --seed 7 --log-every 1 "
        "--warmup-steps 2",
        model);
    const CommandResult one = one_process(common + " --devices 4 --steps 6 --save " + path("one.safetensors"));
    ASSERT_EQ(one.code, 0) << one.output;
    const CommandResult two = two_processes(common + " --devices 2 --steps 6 --save " + path("two.safetensors"));
    ASSERT_EQ(two.code, 0) << two.output;
    EXPECT_EQ(slurp(path("one.safetensors")), slurp(path("two.safetensors"))) << "checkpoint bytes differ";
    EXPECT_EQ(step_lines(one.output), step_lines(two.output));
    // 6 steps and 2 epoch summaries (5 steps of 24 samples make an epoch of 120), printed once.
    EXPECT_EQ(step_lines(two.output).size(), 8u) << "process 0 alone prints:\n" << two.output;
    // Resumed across processes from a checkpoint written across processes: the same bytes again.
    const CommandResult half = two_processes(common + " --devices 2 --steps 3 --save " + path("half.safetensors"));
    ASSERT_EQ(half.code, 0) << half.output;
    const CommandResult resumed = two_processes(common + " --devices 2 --steps 6 --resume " + path("half.safetensors") +
                                                " --save " + path("resumed.safetensors"));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_EQ(slurp(path("one.safetensors")), slurp(path("resumed.safetensors"))) << "resumed checkpoint differs";
  }
}

// A preempted job: SIGTERM on process 0 before step 4; every process agrees to stop after step 3,
// process 0 saves, both exit with 143. Re-run with --resume (no --steps: to the end the checkpoint's
// run planned), it writes the uninterrupted run's checkpoint, byte for byte.
TEST_F(MpiTrain, ASignalStopsEveryProcessAtOneStepAndTheResumeIsBitExact) {
  const std::string common =
      "--model convnet --mode ddp --backend sim --synthetic 120 --batch-size 6 --lr 0.005 --seed 7 --log-every 1 "
      "--schedule cosine";
  const CommandResult one = one_process(common + " --devices 4 --steps 6 --save " + path("one.safetensors"));
  ASSERT_EQ(one.code, 0) << one.output;
  const CommandResult cut =
      two_processes(common + " --devices 2 --steps 6 --debug-signal-at-step 4 --save " + path("cut.safetensors"));
  EXPECT_EQ(cut.code, 143) << cut.output;
  EXPECT_NE(cut.output.find("SIGTERM: stopping after step 3 of 6"), std::string::npos) << cut.output;
  ASSERT_TRUE(fs::exists(path("cut.safetensors"))) << cut.output;
  const CommandResult resumed =
      two_processes(common + " --devices 2 --resume " + path("cut.safetensors") + " --save " + path("cut.safetensors"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(slurp(path("one.safetensors")), slurp(path("cut.safetensors"))) << "resumed checkpoint differs";
}

TEST_F(MpiTrain, EvaluationCountsEveryTestSampleOnceAcrossProcesses) {
  // 13 test samples over 4 global ranks: shards of 4, 3, 3, 3; batches of 2.
  write_idx("data", 40);
  write_idx("data", 13, 28, 28, 0x803, -1, 0, "t10k");
  const std::string data = path("data");
  const std::string common = " --model convnet --mode ddp --backend sim --batch-size 2 --steps 4 --data " + data;
  const CommandResult one = one_process(common + " --devices 4");
  const CommandResult two = two_processes(common + " --devices 2");
  ASSERT_EQ(one.code, 0) << one.output;
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_EQ(step_lines(one.output), step_lines(two.output));
  EXPECT_NE(two.output.find("test acc"), std::string::npos) << two.output;
}

TEST_F(MpiTrain, SingleProcessModesAreRefusedUnderMpirun) {
  for (const std::string mode : {"single", "dp"}) {
    const CommandResult r = two_processes("--mode " + mode + " --backend sim --synthetic 32 --steps 1");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("is single-process, but mpirun started 2 processes"), std::string::npos) << r.output;
  }
}

// A bad file on one node: found before any collective, agreed on, every process exits 2.
TEST_F(MpiTrain, ABadFileOnOneProcessStopsEveryProcessWithItsExitCode) {
  { std::ofstream(path("truncated.safetensors")) << "\x10\x00\x00\x00"; }
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = two_processes(
      "--model convnet --mode ddp --backend sim --devices 2 --synthetic 64 --steps 2 --save " + path("out.safetensors"),
      "--init " + path("truncated.safetensors"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("error on process 1 of 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("process 1 (host "), std::string::npos) << "process 0 names the failing one:\n" << r.output;
  EXPECT_FALSE(fs::exists(path("out.safetensors")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// Processes started with different configurations would run different collectives (a hang) or
// train different things (a silent divergence): refused before the first collective, exit 2 on
// every process, naming what differs — also when one process is slower to get there than the
// collectives' timeout (it is loading more data).
TEST_F(MpiTrain, ProcessesMustRunOneConfiguration) {
  const std::string common =
      "--model mlp --hidden 16 --mode ddp --backend sim --batch-size 4 --save " + path("out.safetensors");
  const std::string two = common + " --devices 2 --synthetic 64";
  const CommandResult steps = each_its_own(two, "--steps 2", "--steps 3");
  EXPECT_EQ(steps.code, 2) << steps.output;
  EXPECT_NE(steps.output.find("do not run one configuration"), std::string::npos) << steps.output;
  EXPECT_NE(steps.output.find("--steps (process 0"), std::string::npos) << steps.output;

  // A stale checkpoint on one node.
  ASSERT_EQ(one_process(common + " --synthetic 64 --steps 1 --devices 4").code, 0);
  fs::copy_file(path("out.safetensors"), path("step1.safetensors"));
  ASSERT_EQ(one_process(common + " --synthetic 64 --steps 2 --devices 4").code, 0);
  const CommandResult resume =
      each_its_own(two + " --steps 1", "--resume " + path("out.safetensors"), "--resume " + path("step1.safetensors"));
  EXPECT_EQ(resume.code, 2) << resume.output;
  EXPECT_NE(resume.output.find("--resume"), std::string::npos) << resume.output;

  const auto start = std::chrono::steady_clock::now();
  const CommandResult data =
      each_its_own(common + " --devices 2 --steps 1", "--synthetic 64", "--synthetic 300000", "DP_TIMEOUT_S=1");
  EXPECT_EQ(data.code, 2) << data.output;
  EXPECT_NE(data.output.find("training data"), std::string::npos) << data.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

// --help (or a bad flag) on one process only ends every process at once.
TEST_F(MpiTrain, AnEarlyExitOnOneProcessEndsEveryProcess) {
  const std::string args = "--mode ddp --backend sim --devices 2 --synthetic 64 --steps 2";
  const CommandResult help = two_processes(args, "--help");
  EXPECT_EQ(help.code, 0) << help.output;
  EXPECT_NE(help.output.find("process 1 (host "), std::string::npos) << help.output;
  const CommandResult bad = two_processes(args, "--lr nan");
  EXPECT_EQ(bad.code, 2) << bad.output;
}

// A process failing in the middle of training, while its peers wait in the step's collectives:
// the job ends within seconds, non-zero, and the message names the failing ranks and host.
TEST_F(MpiTrain, AFailingRankStopsEveryProcessWithinSeconds) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = two_processes(
      "--model convnet --mode ddp --backend sim --devices 2 --synthetic 256 --batch-size 4 --steps "
      "1000 --save " +
          path("out.safetensors"),
      "--debug-fail-at-step 3");
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_LT(seconds, 30.0) << r.output;
  EXPECT_NE(r.output.find("error on process 1 of 2 (global ranks 2-3, host "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failing at step 3"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("out.safetensors")));
}

// Under mpirun too, a desync on one process ends both within seconds, exit 4, naming the call.
TEST_F(MpiTrain, ADesyncEndsEveryProcessNamingTheCall) {
  const auto start = std::chrono::steady_clock::now();
  const CommandResult r = each_its_own(
      "--model mlp --hidden 16 --mode ddp --backend sim --devices 2 --synthetic 64 --batch-size 4 --steps 8", "", "",
      "DP_FAULT=desync-count@d2:3 DP_FLIGHT_DIR=" + path(""));
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 4) << r.output;
  EXPECT_LT(seconds, 30.0) << r.output;
  EXPECT_NE(r.output.find("collectives desynchronized at call #"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("global rank 2 (step 3) issued all_reduce f32 x "), std::string::npos) << r.output;
}

// Under mpirun a stopped process (SIGSTOP for 5 s) is named by the other from its beats, which
// travel apart from the collectives, and waited for: the checkpoint is one process of four's.
TEST_F(MpiTrain, AStoppedProcessIsNamedAndWaitedFor) {
  const std::string common =
      "--model mlp --hidden 64 --mode ddp --backend sim --synthetic 2000 --batch-size 16 --seed 7 --steps 8000 "
      "--log-every 500";
  const CommandResult one = one_process(common + " --devices 4 --save " + path("one.safetensors"));
  ASSERT_EQ(one.code, 0) << one.output;
  const std::string train = fmt::format("{} {} --devices 2 --save {}", DP_TRAIN_BIN, common, path("two.safetensors"));
  const std::string pid = path("pid1"), script = path("stop.sh");
  std::ofstream(script) << fmt::format(
      "export DP_STALL_WARN_S=2 DP_TIMEOUT_S=60\n"
      "{} -np 1 {} : -np 1 sh -c 'echo $$ > {}; exec {}' & m=$!\n"
      "sleep 3; kill -STOP $(cat {}); sleep 5; kill -CONT $(cat {}); wait $m\n",
      DP_MPIRUN, train, pid, train, pid, pid);
  const CommandResult r = dp::test::run_command("bash " + script);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("process 1 has given no sign of life"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("process 0 has given no sign of life"), std::string::npos) << r.output;
  EXPECT_EQ(slurp(path("one.safetensors")), slurp(path("two.safetensors"))) << "checkpoint bytes differ";
}

// dp_bench across processes: ddp over all 4 ranks, every device's figures on process 0, the
// traffic split into intra- and inter-node bytes; single runs on process 0 alone.
TEST_F(MpiTrain, BenchGathersEveryProcesssDevices) {
  const CommandResult r = dp::test::run_command(
      fmt::format("{} -np 2 {} --backend sim --devices 2 --models mlp --modes single,ddp --steps 2 --warmup 1 "
                  "--batch-size 8 --json {}",
                  DP_MPIRUN, DP_BENCH_BIN, path("bench.json")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("\nper device\n"), r.output.rfind("\nper device\n")) << "one table, process 0's:\n"
                                                                               << r.output;
  const auto report = nlohmann::json::parse(slurp(path("bench.json")));
  EXPECT_EQ(report.at("processes"), 2);
  EXPECT_EQ(report.at("hosts").size(), 2u);
  for (const auto& run : report.at("runs")) {
    SCOPED_TRACE(run.at("mode").get<std::string>());
    const bool ddp = run.at("mode") == "ddp";
    ASSERT_EQ(run.at("devices"), ddp ? 4 : 1);
    EXPECT_EQ(run.at("global_batch"), ddp ? 32 : 8);
    const auto& devices = run.at("per_device");
    ASSERT_EQ(devices.size(), ddp ? 4u : 1u);
    std::uint64_t net_sent = 0, net_received = 0, intra = 0;
    for (std::size_t i = 0; i < devices.size(); ++i) {
      EXPECT_EQ(devices[i].at("process"), static_cast<int>(i) / 2);
      net_sent += devices[i].at("bytes_sent_inter_node").get<std::uint64_t>();
      net_received += devices[i].at("bytes_received_inter_node").get<std::uint64_t>();
      intra += devices[i].at("bytes_sent").get<std::uint64_t>();
    }
    // The ring over 4 ranks crosses between the processes twice: what one side sends, the other receives.
    EXPECT_EQ(net_sent, net_received);
    EXPECT_EQ(net_sent > 0, ddp);
    EXPECT_EQ(intra > 0, ddp);
  }
}

}  // namespace
