// test_env_train.cpp — dp_train started as torchrun starts processes (env://: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; no mpirun): 2 processes x 2 simulated devices must write, byte for
// byte, the checkpoint of 1 process x 4 devices, and a process that fails (before training or in
// the middle of it) or never starts must end the job with a message naming it — never a hang. Built where dp has the
// env:// process group (gloo).
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <string>
#include <tuple>
#include <unistd.h>

#include "dp/io/safetensors.h"
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

// The shell command of process `rank` of an env:// job of `world` on 127.0.0.1:`port`, started as
// torchrun starts it (no mpirun variables), with `settings` (VAR=value ...) in its environment and
// its output in `out`.
std::string env_process(int rank, int world, int port, const std::string& settings, const std::string& args,
                        const std::string& out) {
  return fmt::format(
      "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE RANK={} WORLD_SIZE={} MASTER_ADDR=127.0.0.1 "
      "MASTER_PORT={} {} {} {} >{} 2>&1",
      rank, world, port, settings, DP_TRAIN_BIN, args, out);
}

// The shell commands of both processes of a job (env_process's) run at once; their exit codes
// ({-1, -1} when the shell said none).
std::array<int, 2> run_both(const std::string& first, const std::string& second) {
  const auto r = dp::test::run_command("bash -c '" + first + " & p0=$!; " + second +
                                       " & p1=$!; wait $p0; c0=$?; wait $p1; c1=$?; echo codes $c0 $c1'");
  std::array<int, 2> codes{-1, -1};
  if (const auto at = r.output.find("codes"); at != std::string::npos)
    std::sscanf(r.output.substr(at).c_str(), "codes %d %d", &codes[0], &codes[1]);
  return codes;
}

// Both processes started at once, with the same arguments, and `meanwhile` run by the shell while
// they train (it sees their pids as $p0 and $p1: dp_train's own, no wrapper between); `killed_at_ns` and `ended_at_ns`
// bracket what `meanwhile` marks with `t=$(date +%s%N)` and the end of the process that was not killed.
struct EnvPair : EnvJob {
  long long killed_at_ns = 0, ended_at_ns = 0;
};
EnvPair env_pair(const std::filesystem::path& dir, int port, const std::string& args, const std::string& meanwhile) {
  const auto env = [&](int rank) {
    return env_process(rank, 2, port, "DP_TIMEOUT_S=60 DP_STALL_WARN_S=2", args,
                       (dir / fmt::format("pair{}.txt", rank)).string());
  };
  const std::string script = env(0) + " & p0=$!; " + env(1) + " & p1=$!; t=0; " + meanwhile +
                             "; wait $p0; c0=$?; e0=$(date +%s%N); wait $p1; c1=$?; e1=$(date +%s%N); "
                             "echo codes $c0 $c1 $t $e0 $e1";
  const auto start = std::chrono::steady_clock::now();
  const auto r = dp::test::run_command("bash -c '" + script + "'");
  EnvPair job;
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  long long e0 = 0, e1 = 0;
  std::sscanf(r.output.substr(r.output.find("codes")).c_str(), "codes %d %d %lld %lld %lld", &job.code0, &job.code1,
              &job.killed_at_ns, &e0, &e1);
  job.ended_at_ns = meanwhile.find("$p1") != std::string::npos ? e0 : e1;  // the survivor's end
  std::ifstream a(dir / "pair0.txt"), b(dir / "pair1.txt");
  job.out0.assign(std::istreambuf_iterator<char>(a), std::istreambuf_iterator<char>());
  job.out1.assign(std::istreambuf_iterator<char>(b), std::istreambuf_iterator<char>());
  return job;
}

// A process stopped for 5 s in the middle of training (SIGSTOP, as a debugger, a swapped-out node
// or a slow decode would hold it) is named by the other (its beat stood still past the 3 s that
// DP_STALL_WARN_S=2 leaves beats) and waited for: the job goes on and writes the checkpoint of an
// undisturbed run, byte for byte. A process killed outright (kill -9) ends the other within 5 s.
// The stop and the kill come 3 s in, once the two have met even on a loaded machine (a kill before
// they meet leaves the other waiting for its peer: DP_TIMEOUT_S bounds that at 60 s, not 10 min).
TEST_F(EnvTrain, ASlowProcessIsWaitedForAndAGoneOneEndsTheJob) {
  const std::string common =
      "--model mlp --hidden 64 --mode ddp --backend sim --devices 2 --synthetic 2000 --batch-size 16 --steps 3000 "
      "--log-every 500";
  const EnvJob calm = env_job(dir_, dp::test::free_tcp_port(), common + " --save " + path("calm.safetensors"),
                              common + " --save " + path("calm.safetensors"));
  ASSERT_EQ(calm.code0, 0) << calm.out0 << calm.out1;
  for (const char* stopped : {"$p1", "$p0"}) {
    SCOPED_TRACE(stopped);
    const std::string saved = path(fmt::format("stopped{}.safetensors", stopped[2]));
    const EnvPair job = env_pair(dir_, dp::test::free_tcp_port(), common + " --save " + saved,
                                 fmt::format("sleep 3; kill -STOP {0}; sleep 5; kill -CONT {0}", stopped));
    EXPECT_EQ(job.code0, 0) << job.out0 << job.out1;
    EXPECT_EQ(job.code1, 0) << job.out1;
    EXPECT_GT(job.seconds, 5.0) << "the stop fell after the run";
    EXPECT_EQ(read_file(path("calm.safetensors")), read_file(saved)) << "checkpoint bytes differ";
    const int other = stopped[2] == '1' ? 0 : 1;
    const std::string& survivor = other == 0 ? job.out0 : job.out1;
    EXPECT_NE(survivor.find(fmt::format("process {} has given no sign of life", 1 - other)), std::string::npos)
        << survivor;
    EXPECT_NE(survivor.find("the job waits for it until DP_TIMEOUT_S"), std::string::npos) << survivor;
    const std::string& resumed = other == 0 ? job.out1 : job.out0;
    EXPECT_EQ(resumed.find("has given no sign of life"), std::string::npos) << "the stopped process blamed its peer\n"
                                                                            << resumed;
  }
  for (const char* killed : {"$p1", "$p0"}) {
    SCOPED_TRACE(killed);
    const EnvPair job =
        env_pair(dir_, dp::test::free_tcp_port(), common, fmt::format("sleep 3; kill -9 {}; t=$(date +%s%N)", killed));
    EXPECT_NE(job.code0, 0) << job.out0;
    EXPECT_NE(job.code1, 0) << job.out1;
    ASSERT_GT(job.killed_at_ns, 0);
    EXPECT_LT(static_cast<double>(job.ended_at_ns - job.killed_at_ns) / 1e9, 5.0) << job.out0 << job.out1;
  }
}

// Launches that cannot make one job end at once, exit code 2, naming the cause, and write nothing:
// another WORLD_SIZE on one process, a second process with a RANK already in the job (the job
// itself goes on), and a MASTER_PORT that another program holds (process 0 cannot listen; process 1
// finds no dp store there and gives up within DP_TIMEOUT_S).
TEST_F(EnvTrain, LaunchMistakesEndAtOnceNamingTheCause) {
  const int port = dp::test::free_tcp_port(), port_dup = dp::test::free_tcp_port(),
            port_foreign = dp::test::free_tcp_port();
  const std::string args =
      "--model mlp --hidden 8 --mode ddp --backend sim --devices 1 --synthetic 400 --batch-size 4 --steps 1500";
  const auto launch = [&](int rank, int world, int on_port, const std::string& out, const std::string& save) {
    return env_process(rank, world, on_port, "DP_TIMEOUT_S=3", args + " --save " + path(save), path(out));
  };
  const auto slurp = [&](const std::string& name) { return read_file(path(name)); };
  const auto timed = [](const std::string& script) {
    const auto start = std::chrono::steady_clock::now();
    const auto r = dp::test::run_command("bash -c '" + script + "'");
    return std::pair{r.output, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
  };
  // WORLD_SIZE 3 beside a process 0 of WORLD_SIZE 2: both refuse.
  auto [codes, seconds] = timed(launch(0, 2, port, "w0.txt", "w0.st") + " & p0=$!; sleep 0.3; " +
                                launch(1, 3, port, "w1.txt", "w1.st") + "; c1=$?; wait $p0; echo codes $? $c1");
  EXPECT_NE(codes.find("codes 2 2"), std::string::npos) << codes << slurp("w0.txt") << slurp("w1.txt");
  EXPECT_LT(seconds, 10.0);
  for (const char* out : {"w0.txt", "w1.txt"})
    EXPECT_NE(slurp(out).find("process 1 has WORLD_SIZE 3, process 0 has 2"), std::string::npos) << slurp(out);
  EXPECT_FALSE(std::filesystem::exists(path("w0.st")) || std::filesystem::exists(path("w1.st")));
  // A second RANK=1: refused, the job goes on and saves.
  std::tie(codes, seconds) =
      timed(launch(0, 2, port_dup, "d0.txt", "d.st") + " & p0=$!; " + launch(1, 2, port_dup, "d1.txt", "d.st") +
            " & p1=$!; sleep 0.5; " + launch(1, 2, port_dup, "dup.txt", "dup.st") +
            "; c=$?; wait $p0; c0=$?; wait $p1; echo codes $c0 $? $c");
  EXPECT_NE(codes.find("codes 0 0 2"), std::string::npos) << codes << slurp("dup.txt") << slurp("d0.txt");
  EXPECT_NE(slurp("dup.txt").find("RANK 1 is already in the job"), std::string::npos) << slurp("dup.txt");
  EXPECT_TRUE(std::filesystem::exists(path("d.st")));
  EXPECT_FALSE(std::filesystem::exists(path("dup.st")));
  // MASTER_PORT held by a program that accepts and says nothing.
  {
    std::ofstream foreign(path("foreign.py"));
    foreign << "import socket, sys, time\n"
               "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8)\n"
               "held = [s.accept() for _ in range(2)]; time.sleep(30)\n";
  }
  std::tie(codes, seconds) = timed(fmt::format(
      "python3 {} {} & f=$!; sleep 0.5; {}; c0=$?; {}; c1=$?; kill $f; echo codes $c0 $c1", path("foreign.py"),
      port_foreign, launch(0, 2, port_foreign, "p0.txt", "p0.st"), launch(1, 2, port_foreign, "p1.txt", "p1.st")));
  EXPECT_NE(codes.find("codes 2 2"), std::string::npos) << codes << slurp("p0.txt") << slurp("p1.txt");
  EXPECT_NE(slurp("p0.txt").find("cannot listen on 127.0.0.1"), std::string::npos) << slurp("p0.txt");
  EXPECT_NE(slurp("p1.txt").find("is not process 0 of a dp job"), std::string::npos) << slurp("p1.txt");
  EXPECT_LT(seconds, 15.0);
  EXPECT_FALSE(std::filesystem::exists(path("p0.st")) || std::filesystem::exists(path("p1.st")));
}

// Two processes handed the same GPU (the sim's stand-in: DP_SIM_GPU_UUID alike in both, as two
// processes of one machine that both take its GPU 0): both refuse before any collective, exit 2,
// naming the GPU and the way out (one process with --devices-per-gpu); nothing is written. The
// same job with a GPU each (prefixes that differ) trains.
TEST_F(EnvTrain, TwoProcessesOnOneGpuAreRefusedNamingIt) {
  const std::string args =
      "--model mlp --hidden 8 --mode ddp --backend sim --devices 1 --synthetic 40 --batch-size 4 --steps 2";
  const auto job = [&](const std::string& uuid0, const std::string& uuid1, const std::string& tag) {
    const int port = dp::test::free_tcp_port();
    const auto launch = [&](int rank, const std::string& uuid) {
      return env_process(rank, 2, port, fmt::format("DP_SIM_GPU_UUID={} DP_TIMEOUT_S=10", uuid),
                         args + " --save " + path(fmt::format("{}{}.st", tag, rank)),
                         path(fmt::format("{}{}.txt", tag, rank)));
    };
    return dp::test::run_command("bash -c '" + launch(0, uuid0) + " & p0=$!; " + launch(1, uuid1) +
                                 "; c1=$?; wait $p0; echo codes $? $c1'")
        .output;
  };
  const std::string shared = job("GPU-shared", "GPU-shared", "same");
  EXPECT_NE(shared.find("codes 2 2"), std::string::npos) << shared << read_file(path("same0.txt"));
  for (const char* out : {"same0.txt", "same1.txt"}) {
    const std::string text = read_file(path(out));
    EXPECT_NE(text.find("processes 0 and 1 drive the same GPU GPU-shared-0"), std::string::npos) << text;
    EXPECT_NE(text.find("--devices-per-gpu"), std::string::npos) << text;
  }
  EXPECT_FALSE(std::filesystem::exists(path("same0.st")) || std::filesystem::exists(path("same1.st")));
  const std::string apart = job("GPU-a", "GPU-b", "apart");
  EXPECT_NE(apart.find("codes 0 0"), std::string::npos) << apart << read_file(path("apart0.txt"));
  EXPECT_TRUE(std::filesystem::exists(path("apart0.st")));
}

// Two env:// processes of 2 simulated devices write the checkpoint of one process of 4, byte for
// byte, with and without SyncBatchNorm, with fixed shards, and with ZeRO-1 and ZeRO-2 (the state
// gathered across the processes for the checkpoint; stage 2 clipping from its slots); a bad file on one stops both
// within seconds; a process that never starts ends the other after the timeout, naming it.
TEST_F(EnvTrain, TwoProcessesOfTwoDevicesWriteTheCheckpointOfOneProcessOfFour) {
  for (const std::string model :
       {"--model mlp --hidden 32", "--model convnet --sync-bn", "--model convnet --shards 8 --graphs off",
        "--model convnet --zero 1 --optimizer adamw", "--model convnet --sync-bn --shards 4",
        "--model convnet --zero 2 --optimizer adamw --clip-grad-norm 0.5 --bucket-cap-mb 0.004 --first-bucket-mb "
        "0.002"}) {
    SCOPED_TRACE(model);
    const std::string common =
        model + " --mode ddp --backend sim --synthetic 120 --batch-size 6 --lr 0.01 --seed 7 --steps 6 --log-every 1";
    ASSERT_EQ(run(common + " --devices 4 --save " + path("one.safetensors")).code, 0);
    const EnvJob two =
        env_job(dir_, dp::test::free_tcp_port(), common + " --devices 2 --save " + path("two.safetensors"),
                common + " --devices 2 --save " + path("two.safetensors"));
    ASSERT_EQ(two.code0, 0) << two.out0 << two.out1;
    ASSERT_EQ(two.code1, 0) << two.out1;
    EXPECT_EQ(read_file(path("one.safetensors")), read_file(path("two.safetensors"))) << "checkpoint bytes differ";
    EXPECT_NE(two.out0.find("in each of 2 processes"), std::string::npos) << two.out0;
  }
  const std::string common = "--model mlp --hidden 8 --mode ddp --backend sim --devices 2 --batch-size 4 --steps 3";
  const EnvJob bad =
      env_job(dir_, dp::test::free_tcp_port(), common + " --synthetic 40", common + " --data " + path("no-such-dir"));
  EXPECT_NE(bad.code0, 0) << bad.out0;
  EXPECT_EQ(bad.code1, 2) << bad.out1;
  EXPECT_LT(bad.seconds, 30.0);
  EXPECT_NE(bad.out1.find("no-such-dir"), std::string::npos) << bad.out1;
  // A process that fails in the middle of training (as a crash would) ends the other at once.
  const EnvJob crash = env_job(dir_, dp::test::free_tcp_port(), common + " --synthetic 400 --steps 1000",
                               common + " --synthetic 400 --steps 1000 --debug-fail-at-step 5");
  EXPECT_NE(crash.code0, 0) << crash.out0;
  EXPECT_NE(crash.code1, 0) << crash.out1;
  EXPECT_NE(crash.out0.find("process 1"), std::string::npos) << crash.out0;
  EXPECT_LT(crash.seconds, 30.0);
  const EnvJob alone = env_job(dir_, dp::test::free_tcp_port(), common + " --synthetic 40", "", 3);
  EXPECT_NE(alone.code0, 0) << alone.out0;
  EXPECT_NE(alone.out0.find("process 1"), std::string::npos) << alone.out0;
  EXPECT_LT(alone.seconds, 30.0);
}

// A desync on either process (one device's extra all-reduce; every device of process 1 skipping a
// bucket, which only the processes' exchange can see) ends both processes within 5 s, exit 4, both
// naming the same call and the two signatures; each leaves its flight record.
TEST_F(EnvTrain, ADesyncOnEitherProcessEndsBothAtOnce) {
  const std::string common =
      "--model mlp --hidden 16 --mode ddp --backend sim --devices 2 --synthetic 64 --batch-size 4 --steps 6";
  for (const std::string fault : {"desync-extra@d3:2", "desync-skip@p1:3"}) {
    SCOPED_TRACE(fault);
    ::setenv("DP_FAULT", fault.c_str(), 1);
    ::setenv("DP_FLIGHT_DIR", dir_.c_str(), 1);
    const EnvJob job = env_job(dir_, dp::test::free_tcp_port(), common, common);
    ::unsetenv("DP_FAULT");
    ::unsetenv("DP_FLIGHT_DIR");
    EXPECT_EQ(job.code0, 4) << job.out0 << job.out1;
    EXPECT_EQ(job.code1, 4) << job.out1;
    EXPECT_LT(job.seconds, 5.0 + 3.0);  // both starts included
    for (const std::string* out : {&job.out0, &job.out1}) {
      EXPECT_NE(out->find("collectives desynchronized at call #"), std::string::npos) << *out;
      EXPECT_NE(out->find("(bucket 0, at reducer.cpp:"), std::string::npos) << *out;
    }
    EXPECT_NE(
        job.out1.find(fault.starts_with("desync-extra") ? "global rank 3 (step 2) issued all_reduce f32 x 1 (DP_FAULT"
                                                        : "global rank 2 (step 3) issued end none x 0"),
        std::string::npos)
        << job.out1;
    EXPECT_TRUE(std::filesystem::exists(dir_ / "dp-flight-0.json"));
    EXPECT_TRUE(std::filesystem::exists(dir_ / "dp-flight-1.json"));
    std::filesystem::remove(dir_ / "dp-flight-0.json");
    std::filesystem::remove(dir_ / "dp-flight-1.json");
  }
}

// Launch mistakes process 0 says at once: a DP_JOB_TOKEN that only one side has (process 0 names
// the refused connection instead of waiting silently), and MASTER_ADDR 0.0.0.0 (every interface).
TEST_F(EnvTrain, TokenMismatchesAndWildcardAddressesAreSaid) {
  const std::string args =
      "--model mlp --hidden 8 --mode ddp --backend sim --devices 1 --synthetic 16 --batch-size 4 --steps 2";
  const auto launch = [&](int rank, const std::string& addr, int port, const std::string& token,
                          const std::string& out) {
    return fmt::format(
        "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE -u DP_JOB_TOKEN {} RANK={} WORLD_SIZE=2 MASTER_ADDR={} "
        "MASTER_PORT={} DP_TIMEOUT_S=4 timeout 60 {} {} >{} 2>&1",
        token.empty() ? "" : "DP_JOB_TOKEN=" + token, rank, addr, port, DP_TRAIN_BIN, args, path(out));
  };
  int port = dp::test::free_tcp_port();
  auto r = dp::test::run_command("sh -c '" + launch(0, "127.0.0.1", port, "abc", "t0.txt") + " & p0=$!; sleep 0.3; " +
                                 launch(1, "127.0.0.1", port, "", "t1.txt") + "; c1=$?; wait $p0; echo codes $? $c1'");
  const std::string t0 = read_file(path("t0.txt")), t1 = read_file(path("t1.txt"));
  EXPECT_NE(t0.find("refused a connection whose DP_JOB_TOKEN differs from process 0's"), std::string::npos) << t0;
  EXPECT_NE(t1.find("DP_JOB_TOKEN differs"), std::string::npos) << t1;
  port = dp::test::free_tcp_port();
  r = dp::test::run_command("sh -c '" + launch(0, "0.0.0.0", port, "", "w0.txt") + " & p0=$!; " +
                            launch(1, "127.0.0.1", port, "", "w1.txt") + "; c1=$?; wait $p0; echo codes $? $c1'");
  EXPECT_NE(r.output.find("codes 0 0"), std::string::npos) << r.output << read_file(path("w0.txt"));
  EXPECT_NE(read_file(path("w0.txt"))
                .find("MASTER_ADDR 0.0.0.0: process 0 listens for the job on every interface of "
                      "this host; anyone who reaches the port may join: set DP_JOB_TOKEN"),
            std::string::npos)
      << read_file(path("w0.txt"));
}

// Process 0 frozen for good (SIGSTOP: it serves the store too): the survivor names it, and ends
// within DP_TIMEOUT_S + 3 s of the stop, exit 6 (a timeout), its abort not waiting for process 0 again
// (a second wait would take another DP_TIMEOUT_S: 8 s or more; a loaded 2-core machine has taken
// 2.0 s past the timeout to write the flight record and exit).
TEST_F(EnvTrain, ASurvivorOfAFrozenProcessZeroEndsAtTheTimeout) {
  const int port = dp::test::free_tcp_port();
  const auto env = [&](int rank) {
    return env_process(rank, 2, port, "DP_TIMEOUT_S=4 DP_STALL_WARN_S=1 DP_FLIGHT_DIR=" + dir_.string(),
                       "--model mlp --hidden 64 --mode ddp --backend sim --devices 2 --synthetic 2000 "
                       "--batch-size 16 --steps 100000 --log-every 1000",
                       path(fmt::format("frozen{}.txt", rank)));
  };
  const auto r = dp::test::run_command(
      "bash -c '" + env(0) + " & p0=$!; " + env(1) +
      " & p1=$!; sleep 3; kill -STOP $p0; t=$(date +%s%N); wait $p1; c1=$?; e1=$(date +%s%N); kill -9 $p0; "
      "wait $p0; echo codes $c1 $t $e1'");
  int code1 = -1;
  long long stopped = 0, ended = 0;
  ASSERT_NE(r.output.find("codes"), std::string::npos) << r.output;
  std::sscanf(r.output.substr(r.output.find("codes")).c_str(), "codes %d %lld %lld", &code1, &stopped, &ended);
  const std::string out1 = read_file(path("frozen1.txt"));
  EXPECT_EQ(code1, 6) << out1;
  EXPECT_LT(static_cast<double>(ended - stopped) / 1e9, 4.0 + 3.0) << out1;
  EXPECT_NE(out1.find("timeout; DP_TIMEOUT_S sets it"), std::string::npos) << out1;
  // Named 3 s into the stop (beats leave 3 s), before the timeout ends the survivor.
  EXPECT_NE(out1.find("process 0 has given no sign of life"), std::string::npos) << out1;
  EXPECT_TRUE(std::filesystem::exists(dir_ / "dp-flight-1.json")) << out1;
}

// A device thread of process 1 stuck for good (its process alive, beating): process 0 names it,
// where it is, from process 1's own report, while both wait; DP_TIMEOUT_S then ends both.
TEST_F(EnvTrain, AStuckDeviceOfAnotherProcessIsNamedByEveryProcess) {
  const int port = dp::test::free_tcp_port();
  const auto env = [&](int rank) {
    return env_process(rank, 2, port, "DP_TIMEOUT_S=8 DP_STALL_WARN_S=2 DP_FAULT=hang@d3:3",
                       "--model mlp --hidden 64 --mode ddp --backend sim --devices 2 --synthetic 2000 "
                       "--batch-size 16 --steps 100 --graphs off",
                       path(fmt::format("stuck{}.txt", rank)));
  };
  const auto [code0, code1] = run_both(env(0), env(1));
  const std::string out0 = read_file(path("stuck0.txt")), out1 = read_file(path("stuck1.txt"));
  EXPECT_NE(code0, 0) << out0;
  EXPECT_NE(code1, 0) << out1;
  EXPECT_NE(out1.find("dp: warning: process 1: device 3 in the step's start of step 3 for "), std::string::npos)
      << out1;
  EXPECT_NE(out0.find("dp: warning: process 1 reports: device 3 in the step's start of step 3 for "), std::string::npos)
      << out0;
  EXPECT_EQ(out0.find("has given no sign of life"), std::string::npos) << "a live process called silent\n" << out0;
}

// A process killed at step 5 (DP_FAULT=exit@pN:5, as SIGKILL) of 2 env:// processes x 2 devices under
// --shards 8: the other (the lowest survivor) writes the last step its devices hold whole to --save
// within 10 s and exits 5; relaunched on one process of 2 devices with --resume, the run ends with
// the checkpoint of the undisturbed run, byte for byte, whichever process was killed (process 0 is
// the store's: its survivor's store wait ends as a loss, not as a timeout).
TEST_F(EnvTrain, AProcessLostUnderShardsLeavesACheckpointThatResumesOnFewerProcesses) {
  const std::string common =
      "--model convnet --mode ddp --backend sim --synthetic 160 --batch-size 2 --shards 8 --lr 0.01 --momentum 0.9 "
      "--seed 7 --log-every 1 --no-eval --graphs off";
  ASSERT_EQ(run(common + " --devices 4 --steps 10 --save " + path("calm.st")).code, 0);
  for (const int killed : {1, 0}) {
    SCOPED_TRACE(fmt::format("process {} killed", killed));
    const int survivor = 1 - killed;
    std::filesystem::remove(path("lost.st"));
    const int port = dp::test::free_tcp_port();
    const auto env = [&](int rank) {
      return env_process(rank, 2, port, fmt::format("DP_TIMEOUT_S=30 DP_FAULT=exit@p{}:5", killed),
                         common + " --devices 2 --steps 10 --save " + path("lost.st"),
                         path(fmt::format("lost{}.txt", rank)));
    };
    const auto start = std::chrono::steady_clock::now();
    const std::array<int, 2> codes = run_both(env(0), env(1));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string out = read_file(path(fmt::format("lost{}.txt", survivor)));
    EXPECT_EQ(codes[killed], 137) << read_file(path(fmt::format("lost{}.txt", killed)));
    EXPECT_EQ(codes[survivor], 5) << out;
    EXPECT_LT(seconds, 10.0) << out;
    ASSERT_NE(out.find(fmt::format("process {} of the job is lost; wrote {} at step ", killed, path("lost.st"))),
              std::string::npos)
        << out;
    const Result resumed = run(fmt::format("--backend sim --synthetic 160 --resume {} --devices 2 --steps 10 --save {}",
                                           path("lost.st"), path("resumed.st")));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const auto a = dp::safetensors::read(path("calm.st")), b = dp::safetensors::read(path("resumed.st"));
    ASSERT_EQ(a.order, b.order);
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs";
  }
}

// A bit flipped on process 1's first device (global device 2) at step 3 is named by both processes
// at that step's replica check: exit 8, the global rank, its device and process, and the tensor.
TEST_F(EnvTrain, AFlippedBitOnAnotherProcessIsNamedByBoth) {
  const int port = dp::test::free_tcp_port();
  const auto env = [&](int rank) {
    return env_process(rank, 2, port, "DP_TIMEOUT_S=30 DP_FAULT=flip-param@d2:3",
                       "--model convnet --mode ddp --backend sim --devices 2 --synthetic 160 --batch-size 2 --steps 6 "
                       "--no-eval --check-replicas 1",
                       path(fmt::format("flip{}.txt", rank)));
  };
  const auto [code0, code1] = run_both(env(0), env(1));
  for (const auto& [code, out] :
       {std::pair{code0, read_file(path("flip0.txt"))}, {code1, read_file(path("flip1.txt"))}}) {
    EXPECT_EQ(code, 8) << out;
    EXPECT_NE(out.find("after step 3 the replicas' parameters differ: global rank 2 (device 0 of process 1) holds "
                       "other bits than the other 3 of 4 replicas, first in 'fc.weight'"),
              std::string::npos)
        << out;
  }
}

// Shadow shards across processes: step 3 checks global device 3's shard (process 1's device 1) on
// process 1's device 0; a GEMM of device 3 flips a bit in that step, and with no third device in
// process 1 both processes end (exit 8), each naming the two devices, and nothing is saved.
TEST_F(EnvTrain, AShadowShardMismatchOnOneProcessEndsBoth) {
  const int port = dp::test::free_tcp_port();
  const auto env = [&](int rank) {
    return env_process(rank, 2, port, "DP_TIMEOUT_S=30 DP_FAULT=flip-gemm@d3:3",
                       fmt::format("--model mlp --hidden 16 --mode ddp --backend sim --devices 2 --synthetic 160 "
                                   "--batch-size 2 --steps 6 --no-eval --shards 4 --shadow-shards 1 --save {}",
                                   path("shadow.st")),
                       path(fmt::format("shadow{}.txt", rank)));
  };
  const auto [code0, code1] = run_both(env(0), env(1));
  const std::string out0 = read_file(path("shadow0.txt")), out1 = read_file(path("shadow1.txt"));
  EXPECT_EQ(code0, 8) << out0;
  EXPECT_EQ(code1, 8) << out1;
  EXPECT_NE(out1.find("shard 3 of step 3 computed by device 1 of process 1 and again by device 0 of process 1 differs"),
            std::string::npos)
      << out1;
  EXPECT_NE(out0.find("process 1 found a shadow shard of step 3 differing between devices d3 and d2"),
            std::string::npos)
      << out0;
  EXPECT_FALSE(std::filesystem::exists(path("shadow.st")));
}

}  // namespace
