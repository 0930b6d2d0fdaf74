// test_train.cpp — drives the real dp_train binary end to end on simulated devices: training
// that learns in every mode, PyTorch's exact data order, bit-exact resume, and every bad input
// refused with a message, a non-zero exit and no output file created or overwritten.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <regex>
#include <signal.h>
#include <sstream>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <zlib.h>

#include "dp/io/atomic_file.h"
#include "dp/io/safetensors.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/error.h"
#include "exit_codes.h"
#include "test_util.h"
#include "tool_test.h"

namespace {

namespace fs = std::filesystem;

using Result = dp::test::CommandResult;

Result run(const std::string& args) { return dp::test::run_command(std::string(DP_TRAIN_BIN) + " " + args); }

// Starts dp_train with `args`, reads its output until `until` appears or `seconds` pass, then sends
// it `signal`: SIGKILL for runs that would go on (nearly) forever; another signal (SIGINT) lets it
// finish as it does on its own, its output read to the end. Gives what it printed, whether `until`
// came, its exit code (-1: killed by the signal) and its peak resident memory. With `stdout_file`,
// its standard output goes to that file (fully buffered, unless dp_train buffers by line) and
// `output` is what reached the file.
struct Started {
  bool seen = false;
  std::string output;
  int exit_code = -1;
  long max_rss_kib = 0;
};
Started start_then_kill(const std::string& args, const std::string& until, int seconds,
                        const std::string& stdout_file = "", int signal = SIGKILL) {
  const std::string command =
      "exec " + std::string(DP_TRAIN_BIN) + " " + args + (stdout_file.empty() ? "" : " >" + stdout_file);
  Started started;
  int fds[2];
  if (::pipe(fds) != 0) return started;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::array<char, 4096> buffer{};
  // Until `until` came; after a signal that lets it finish, until it closed its output.
  for (bool signalled = false; !(started.seen && signal == SIGKILL);) {
    if (started.seen && !signalled) {
      ::kill(pid, signal);
      signalled = true;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left > 0 && !stdout_file.empty()) {  // what has reached the file so far
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      std::ifstream in(stdout_file, std::ios::binary);
      started.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      started.seen = started.output.find(until) != std::string::npos;
      continue;
    }
    pollfd in{fds[0], POLLIN, 0};
    if (left <= 0 || ::poll(&in, 1, static_cast<int>(left)) <= 0) break;
    const ssize_t n = ::read(fds[0], buffer.data(), buffer.size());
    if (n <= 0) break;  // it exited
    started.output.append(buffer.data(), static_cast<std::size_t>(n));
    started.seen = started.seen || started.output.find(until) != std::string::npos;
  }
  ::kill(pid, SIGKILL);  // whatever is still running when the time is up
  int status = 0;
  rusage usage{};
  ::wait4(pid, &status, 0, &usage);
  ::close(fds[0]);
  if (WIFEXITED(status)) started.exit_code = WEXITSTATUS(status);
  started.max_rss_kib = usage.ru_maxrss;
  return started;
}

class TrainTest : public dp::test::ToolTest {
 protected:
  // Asserts a refused run: exit != 0, `message` in the output, and `guard` (if any) untouched.
  void expect_refused(const std::string& args, const std::string& message) {
    const std::string guard = path("existing.safetensors");
    { std::ofstream(guard) << "previous checkpoint"; }
    const Result r = run(args + " --save " + guard);
    EXPECT_EQ(r.code, 2) << "bad input exits with 2: " << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << "expected '" << message << "' in:\n" << r.output;
    std::ifstream in(guard);
    std::stringstream content;
    content << in.rdbuf();
    EXPECT_EQ(content.str(), "previous checkpoint") << "the existing file was touched by: " << args;
    for (const auto& entry : fs::directory_iterator(dir_))
      EXPECT_NE(entry.path().filename().string().front(), '.') << "temporary file left behind: " << entry.path();
  }
  // Every regular file under the test's directory, by path, with its bytes.
  std::map<std::string, std::string> files() const {
    std::map<std::string, std::string> out;
    for (const auto& entry : fs::recursive_directory_iterator(dir_))
      if (entry.is_regular_file()) out[entry.path().string()] = read_file(entry.path().string());
    return out;
  }
  // Runs `program` with `args` in the test's directory (where a file named after an argument would
  // appear): exit `code`, `message` in the output, every file that was there before byte-identical
  // afterwards and none created (no checkpoint, no temporary file).
  void expect_nothing_written(const std::string& args, int code, const std::string& message,
                              const std::string& program = DP_TRAIN_BIN) {
    const auto before = files();
    const Result r = dp::test::run_command("cd " + dir_.string() + " && " + program + " " + args);
    EXPECT_EQ(r.code, code) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << "expected '" << message << "' in:\n" << r.output;
    const auto after = files();
    for (const auto& [name, bytes] : after) {
      const auto it = before.find(name);
      EXPECT_TRUE(it != before.end()) << name << " was created by: " << args;
      EXPECT_TRUE(it == before.end() || it->second == bytes) << name << " was changed by: " << args;
    }
    EXPECT_EQ(after.size(), before.size()) << "files lost by: " << args;
  }
  // Runs `args` (which ends with a flag) with each of `values` and once without the flag: every run
  // succeeds and logs the same losses, at least `at_least` of them; `values[0]` is the default.
  void expect_same_losses(const std::string& args, const std::vector<std::string>& values, std::size_t at_least);
};

std::vector<double> losses(const std::string& output) {
  std::vector<double> out;
  const std::regex line(R"(loss ([0-9.eE+-]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it)
    out.push_back(std::stod((*it)[1].str()));
  return out;
}

void TrainTest::expect_same_losses(const std::string& args, const std::vector<std::string>& values,
                                   std::size_t at_least) {
  const Result unset = run(args.substr(0, args.rfind("--")));
  ASSERT_EQ(unset.code, 0) << unset.output;
  ASSERT_GE(losses(unset.output).size(), at_least) << unset.output;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const Result r = run(args + values[i]);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(losses(r.output), losses(unset.output)) << values[i] << (i == 0 ? " (the default)" : "") << r.output;
  }
}

TEST_F(TrainTest, LossFallsInEveryMode) {
  for (const std::string mode : {"single", "dp", "ddp"}) {
    const Result r =
        run(fmt::format("--model mlp --hidden 64 --mode {} --backend sim --devices 2 --synthetic 256 "
                        "--batch-size 32 --steps 40 --lr 0.05 --log-every 5",
                        mode));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto l = losses(r.output);
    ASSERT_GE(l.size(), 4u) << r.output;
    EXPECT_LT(l.back(), 0.25 * l.front()) << mode << ":\n" << r.output;
  }
  const Result conv =
      run("--model convnet --mode dp --backend sim --device-ids 1,0 --output-device 1 --synthetic 128 "
          "--batch-size 16 --steps 16 --lr 0.02 --log-every 4");
  ASSERT_EQ(conv.code, 0) << conv.output;
  const auto l = losses(conv.output);
  EXPECT_LT(l.back(), 0.5 * l.front()) << conv.output;
  EXPECT_NE(conv.output.find("global batch 16"), std::string::npos) << "prints the effective global batch";
}

std::map<std::string, std::vector<std::vector<int>>> batches_by_rank(const std::string& output) {
  std::map<std::string, std::vector<std::vector<int>>> out;
  const std::regex line(R"(batch step (\d+) rank (\d+): ([0-9 ]*))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    std::vector<int> indices;
    std::istringstream in((*it)[3].str());
    for (int v; in >> v;) indices.push_back(v);
    out[(*it)[2].str()].push_back(indices);
  }
  return out;
}

TEST_F(TrainTest, NoShuffleOrderIsPyTorchs) {
  // single and DP: DataLoader(shuffle=False, drop_last=False): [0,B), [B,2B), ..., a short last
  // batch, then the next epoch starts over.
  for (const std::string mode : {"single", "dp"}) {
    const Result r =
        run(fmt::format("--mode {} --backend sim --devices 3 --synthetic 10 --batch-size 4 --steps 4 "
                        "--no-shuffle --log-batches",
                        mode));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto got = batches_by_rank(r.output);
    EXPECT_EQ(got.at("0"), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}, {0, 1, 2, 3}})) << mode;
  }
  // DDP: DistributedSampler: 10 samples over 3 ranks -> 4 each, padded with sample 0 and 1;
  // rank r takes indices[r::3]; per-rank batches of 3, the last one short.
  const Result r =
      run("--mode ddp --backend sim --devices 3 --synthetic 10 --batch-size 3 --steps 3 --no-shuffle "
          "--log-batches");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto got = batches_by_rank(r.output);
  EXPECT_EQ(got.at("0"), (std::vector<std::vector<int>>{{0, 3, 6}, {9}, {0, 3, 6}}));
  EXPECT_EQ(got.at("1"), (std::vector<std::vector<int>>{{1, 4, 7}, {0}, {1, 4, 7}}));
  EXPECT_EQ(got.at("2"), (std::vector<std::vector<int>>{{2, 5, 8}, {1}, {2, 5, 8}}));
  // With shuffling, every rank sees a permutation seeded by seed + epoch: epochs differ.
  const Result shuffled = run("--mode single --backend sim --synthetic 8 --batch-size 8 --steps 2 --log-batches");
  const auto s = batches_by_rank(shuffled.output).at("0");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_NE(s[0], s[1]);
  EXPECT_EQ(std::set<int>(s[0].begin(), s[0].end()).size(), 8u);
}

TEST_F(TrainTest, ResumeIsBitExactInEveryMode) {
  // SGD with momentum, and AdamW with a cosine schedule (its state: exp_avg, exp_avg_sq, step). The
  // cosine's T_max is given: by default it is the planned length of the run that saved the
  // checkpoint, which the checkpoint keeps (TrainTest.ACheckpointDescribesItsRun).
  const std::pair<std::string, std::string> optimizers[] = {
      {"--lr 0.02 --momentum 0.9 --weight-decay 1e-4", "optimizer.momentum.fc.weight"},
      {"--optimizer adamw --lr 0.002 --weight-decay 0.01 --schedule cosine --t-max 2",
       "optimizer.exp_avg_sq.fc.weight"}};
  for (const auto& [optimizer, state_key] : optimizers)
    for (const std::string mode : {"single", "dp", "ddp"}) {
      SCOPED_TRACE(mode + " " + optimizer);
      const std::string common = fmt::format(
          "--model convnet --mode {} --backend sim --devices 2 --synthetic 48 "
          "--batch-size 10 {} --warmup-steps 4",
          mode, optimizer);
      ASSERT_EQ(run(common + " --steps 6 --save " + path("straight.safetensors")).code, 0);
      const Result first = run(common + " --steps 3 --save " + path("half.safetensors"));
      ASSERT_EQ(first.code, 0) << first.output;
      const Result second =
          run(common + " --steps 6 --resume " + path("half.safetensors") + " --save " + path("resumed.safetensors"));
      ASSERT_EQ(second.code, 0) << second.output;
      const auto a = dp::safetensors::read(path("straight.safetensors"));
      const auto b = dp::safetensors::read(path("resumed.safetensors"));
      ASSERT_EQ(a.order, b.order);
      for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs after resume";
      EXPECT_EQ(a.metadata.at("dp.step"), "6");
      EXPECT_EQ(b.metadata.at("dp.step"), "6");
      EXPECT_TRUE(a.has(state_key));
      EXPECT_FALSE(a.has("module.fc.weight")) << "names carry no module. prefix";
    }
}

// --shards V: on any device count dividing V, in every mode, with graphs on and off, the same
// checkpoint tensors byte for byte, the same losses and the same test totals (each test sample
// counted once, equal to a one-device --eval-only); a checkpoint resumes on another device count
// and mode and continues the same trajectory; resuming with another V is refused naming both.
TEST_F(TrainTest, ShardsMakeTheDeviceCountADeploymentDetail) {
  write_idx("data", 96);
  write_idx("data", 29, 28, 28, 0x803, -1, 0, "t10k");  // 29 test samples: 12 shards of 2 or 3
  const auto tensors_equal = [&](const std::string& a_path, const std::string& b_path) {
    const auto a = dp::safetensors::read(a_path), b = dp::safetensors::read(b_path);
    ASSERT_EQ(a.order, b.order);
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs";
  };
  // Every record but its timings and the mode's own setting (ddp's gradient all-reduce).
  const auto records = [&](const std::string& json) {
    std::vector<nlohmann::json> out;
    std::istringstream in(read_file(json));
    for (std::string line; std::getline(in, line);) {
      auto record = nlohmann::json::parse(line);
      for (const char* key : {"elapsed_s", "eta_s", "samples_per_s", "seconds", "grad_reduce"}) record.erase(key);
      out.push_back(record);
    }
    return out;
  };
  for (const std::string model : {"--model mlp --hidden 16 --dropout 0.25", "--model convnet", "--model resnet8"}) {
    SCOPED_TRACE(model);
    const std::string common = model + " --backend sim --data " + path("data") +
                               " --batch-size 2 --shards 12 --seed 5 --lr 0.02 --momentum 0.9 --log-every 1";
    const Result one =
        run(common + " --steps 6 --mode single --save " + path("one.st") + " --metrics-json " + path("one.json"));
    ASSERT_EQ(one.code, 0) << one.output;
    const auto expected = records(path("one.json"));
    ASSERT_EQ(expected.size(), 8u) << "6 steps and two epochs (4 steps each), with their test totals";
    EXPECT_EQ(expected.back().at("test_samples"), 29);
    for (const auto& [mode, devices, graphs] :
         {std::tuple{"single", 1, "off"}, std::tuple{"dp", 2, "on"}, std::tuple{"dp", 3, "off"},
          std::tuple{"ddp", 4, "on"}, std::tuple{"ddp", 6, "off"}, std::tuple{"dp", 12, "on"}}) {
      SCOPED_TRACE(fmt::format("{} x{} graphs {}", mode, devices, graphs));
      std::filesystem::remove(path("p.json"));
      const Result r = run(fmt::format("{} --steps 6 --mode {} --devices {} --graphs {} --save {} --metrics-json {}",
                                       common, mode, devices, graphs, path("p.st"), path("p.json")));
      ASSERT_EQ(r.code, 0) << r.output;
      tensors_equal(path("one.st"), path("p.st"));
      EXPECT_EQ(records(path("p.json")), expected);
    }
    // 3 steps on 4 devices, then 3 more on 3 devices, on 1 and under dp: 6 steps on 6 devices.
    ASSERT_EQ(run(common + " --steps 3 --mode ddp --devices 4 --save " + path("half.st")).code, 0);
    ASSERT_EQ(run(common + " --steps 6 --mode ddp --devices 6 --save " + path("six.st")).code, 0);
    tensors_equal(path("one.st"), path("six.st"));
    for (const std::string where : {"--mode ddp --devices 3", "--mode single", "--mode dp --devices 2"}) {
      SCOPED_TRACE(where);
      const Result resumed = run(fmt::format("--backend sim --data {} --resume {} --steps 6 {} --save {}", path("data"),
                                             path("half.st"), where, path("resumed.st")));
      ASSERT_EQ(resumed.code, 0) << resumed.output;
      EXPECT_NE(resumed.output.find("--shards 12"), std::string::npos) << "taken from the checkpoint";
      tensors_equal(path("six.st"), path("resumed.st"));
    }
    // The test totals of a one-device --eval-only: with --shards 12 bit for bit.
    for (const std::string shards : {"--shards 12", ""}) {
      std::filesystem::remove(path("eval.json"));
      const Result evaluated =
          run(fmt::format("--eval-only --init {} --backend sim --data {} --batch-size 2 {} "
                          "--metrics-json {}",
                          path("one.st"), path("data"), shards, path("eval.json")));
      ASSERT_EQ(evaluated.code, 0) << evaluated.output;
      const auto totals = records(path("eval.json")).back();
      EXPECT_EQ(totals.at("test_samples"), 29);
      EXPECT_EQ(totals.at("test_accuracy"), expected.back().at("test_accuracy")) << shards;
      // Without shards the same per-sample losses are added in another order (the last bits of a double).
      if (shards.empty())
        EXPECT_NEAR(totals.at("test_loss").get<double>(), expected.back().at("test_loss").get<double>(), 1e-12);
      else
        EXPECT_EQ(totals.at("test_loss"), expected.back().at("test_loss"));
    }
  }
  const std::string half = read_file(path("half.st"));
  const Result other =
      run(fmt::format("--backend sim --data {} --resume {} --steps 6 --shards 6 --mode ddp --devices 3", path("data"),
                      path("half.st")));
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_EQ(read_file(path("half.st")), half) << "the refused resume changed its checkpoint";
  EXPECT_NE(other.output.find("--shards 6: the checkpoint " + path("half.st") + " was saved with --shards 12"),
            std::string::npos)
      << other.output;
  const Result uneven = run("--backend sim --synthetic 64 --batch-size 2 --shards 12 --mode ddp --devices 5 --steps 1");
  EXPECT_EQ(uneven.code, 2) << uneven.output;
  EXPECT_NE(uneven.output.find("12 shards cannot be spread evenly over 5 device(s)"), std::string::npos)
      << uneven.output;
}

// A language model's --save-best keeps the lowest held-out loss (nanoGPT's best_val_loss), not the
// best top-1 byte accuracy; its step lines and records carry tokens/s (samples/s x context).
TEST_F(TrainTest, ALanguageModelSavesItsLowestHeldOutLoss) {
  const Result r =
      run(fmt::format("--model gpt --context 16 --layers 1 --heads 2 --width 32 --text {}/README.md "
                      "--backend sim --batch-size 8 --steps 24 --lr 0.003 --optimizer adamw "
                      "--eval-every 4 --save-best {} --metrics-json {}",
                      DP_SOURCE_DIR, path("best.st"), path("m.json")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(", the best so far) at step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(test loss "), std::string::npos) << r.output;
  std::istringstream in(read_file(path("m.json")));
  double best = 1e30;
  int saves = 0, token_rates = 0;
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.at("kind") == "step") {
      EXPECT_DOUBLE_EQ(record.at("tokens_per_s").get<double>(), 16 * record.at("samples_per_s").get<double>());
      ++token_rates;
    }
    if (!record.contains("test_loss") || record.at("test_loss").is_null()) continue;
    const double loss = record.at("test_loss").get<double>();
    EXPECT_EQ(record.contains("saved_best"), loss < best) << line;
    saves += loss < best;
    best = std::min(best, loss);
  }
  EXPECT_GT(saves, 1);
  EXPECT_GT(token_rates, 0);
  EXPECT_NE(r.output.find(" tokens/s "), std::string::npos) << r.output;
}

// A context of one token (a bigram model) is a sequence like any other: it trains, evaluates and
// samples.
TEST_F(TrainTest, AOneTokenContextTrains) {
  const std::string gpt = "--model gpt --context 1 --layers 1 --heads 1 --width 8 --backend sim ";
  const Result r = run(gpt + fmt::format("--text {}/README.md --steps 3 --save {}", DP_SOURCE_DIR, path("one.st")));
  ASSERT_EQ(r.code, 0) << r.output;
  const Result sample = run(gpt + "--init " + path("one.st") + " --generate 4 --prompt ab");
  EXPECT_EQ(sample.code, 0) << sample.output;
}

// The attention's two forms train to the same loss (the same masks, the same function); a head
// past the fused form's 128 features is refused before anything is written, naming the way out, and
// --attention takes only its two forms.
TEST_F(TrainTest, BothAttentionFormsTrainAndAWideHeadIsRefusedForTheFusedOne) {
  const std::string gpt = fmt::format(
      "--model gpt --context 8 --layers 1 --heads 2 --width 16 --dropout 0.1 "
      "--backend sim --text {}/README.md --steps 3 --batch-size 4 ",
      DP_SOURCE_DIR);
  const Result fused = run(gpt + "--attention fused"), unfused = run(gpt + "--attention unfused");
  ASSERT_EQ(fused.code, 0) << fused.output;
  ASSERT_EQ(unfused.code, 0) << unfused.output;
  const auto final_loss = [](const std::string& out) {
    const auto at = out.find("final loss ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 11));
  };
  ASSERT_GT(final_loss(fused.output), 0.0) << fused.output;
  EXPECT_NEAR(final_loss(fused.output), final_loss(unfused.output), 1e-5) << fused.output << unfused.output;
  const Result wide =
      run(fmt::format("--model gpt --context 8 --layers 1 --heads 1 --width 256 --backend sim --text {}/README.md "
                      "--steps 1 --save {}",
                      DP_SOURCE_DIR, path("wide.st")));
  EXPECT_EQ(wide.code, 2) << wide.output;
  EXPECT_NE(wide.output.find("the fused attention takes heads of up to 128 features, got 256 (--attention unfused"),
            std::string::npos)
      << wide.output;
  EXPECT_FALSE(std::filesystem::exists(path("wide.st")));
  const Result bad = run(gpt + "--attention flash");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("--attention: unknown value 'flash' (expected fused or unfused)"), std::string::npos)
      << bad.output;
}

// --eval-every N evaluates between epochs too (an "eval" record), and --save-best keeps the
// checkpoint of the best test accuracy logged: its step is the first evaluation that reached the
// best, and evaluating it again gives that accuracy. Without a test set both are refused at once.
TEST_F(TrainTest, EvalEveryAndSaveBestKeepTheBestCheckpoint) {
  write_idx("data", 96);
  write_idx("data", 29, 28, 28, 0x803, -1, 0, "t10k");
  const Result r = run("--model mlp --hidden 16 --backend sim --data " + path("data") +
                       " --batch-size 8 --steps 30 --lr 0.2 --eval-every 4 --save-best " + path("best.st") +
                       " --metrics-json " + path("m.json"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::istringstream in(read_file(path("m.json")));
  double best = -1.0;
  long best_step = 0;
  int evals = 0, epochs = 0;
  std::vector<long> eval_steps;
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);
    if (!record.contains("test_accuracy") || record.at("test_accuracy").is_null()) continue;
    (record.at("kind") == "eval" ? evals : epochs) += 1;
    if (record.at("kind") == "eval") eval_steps.push_back(record.at("step").get<long>());
    const double accuracy = record.at("test_accuracy").get<double>();
    const bool saved = record.contains("saved_best");
    EXPECT_EQ(saved, accuracy > best) << line;
    if (accuracy > best) {
      best = accuracy;
      best_step = record.at("step").get<long>();
    }
  }
  // 12 steps an epoch: evaluations at 4, 8, 16, 20, 28 and the epochs' at 12, 24, 30.
  EXPECT_EQ(eval_steps, (std::vector<long>{4, 8, 16, 20, 28}));
  EXPECT_EQ(epochs, 3);
  const auto saved = dp::safetensors::read(path("best.st"));
  EXPECT_EQ(saved.metadata.at("dp.step"), std::to_string(best_step));
  std::filesystem::remove(path("again.json"));
  const Result again = run("--eval-only --init " + path("best.st") + " --backend sim --data " + path("data") +
                           " --batch-size 8 --metrics-json " + path("again.json"));
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_EQ(nlohmann::json::parse(read_file(path("again.json"))).at("test_accuracy").get<double>(), best);

  const Result none = run("--backend sim --synthetic 64 --steps 2 --eval-every 1 --save-best " + path("b2.st") +
                          " --metrics-json " + path("none.json"));
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("--eval-every evaluates on the test set, and this run has none"), std::string::npos)
      << none.output;
  EXPECT_FALSE(std::filesystem::exists(path("b2.st")) || std::filesystem::exists(path("none.json")));
  const Result same = run("--backend sim --data " + path("data") + " --steps 2 --save " + path("x.st") +
                          " --save-best " + path("x.st"));
  EXPECT_EQ(same.code, 2) << same.output;
  EXPECT_NE(same.output.find("--save and --save-best name the same file"), std::string::npos) << same.output;
  EXPECT_EQ(run("--backend sim --data " + path("data") + " --steps 2 --eval-every 0").code, 2);
}

// On a terminal (a pseudo-terminal, through script(1)) the log is one line updated in place: the
// step of the total, the epoch's progress, loss, rate and both ETAs, cleared before the epoch's
// line; into a file or a pipe, plain lines without a carriage return or an escape.
TEST_F(TrainTest, AProgressLineOnATerminalPlainLinesElsewhere) {
  if (dp::test::run_command("command -v script").code != 0) GTEST_SKIP() << "no script(1) for a pseudo-terminal";
  const std::string args =
      std::string(DP_TRAIN_BIN) + " --backend sim --synthetic 256 --batch-size 8 --steps 50 " + "--log-every 25";
  const Result tty = dp::test::run_command("script -qec '" + args + "' /dev/null");
  ASSERT_EQ(tty.code, 0) << tty.output;
  EXPECT_NE(tty.output.find("\rstep 25/50 | epoch 1 25/32 | loss "), std::string::npos) << tty.output;
  EXPECT_NE(tty.output.find("| ETA epoch "), std::string::npos) << tty.output;
  EXPECT_NE(tty.output.find("\r\x1b[Kepoch   1 | train loss"), std::string::npos) << tty.output;
  const Result plain = run(args.substr(std::string(DP_TRAIN_BIN).size() + 1));
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_EQ(plain.output.find('\r'), std::string::npos) << plain.output;
  EXPECT_EQ(plain.output.find('\x1b'), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("step     25 epoch   1 loss "), std::string::npos) << plain.output;
}

// --accumulate K: K micro-batches per optimizer step in every mode, graphs on or off the same
// bits; epochs and --steps count optimizer steps (an epoch of 60 batches: 20 steps of 3); with
// shards, K micro-batches of V shards are one step of K x V shards, bit for bit; bad values exit 2.
TEST_F(TrainTest, AccumulationCountsOptimizerStepsAndIsShardsWithShards) {
  const std::string common = "--model convnet --backend sim --synthetic 240 --batch-size 4 --seed 3 --log-every 5";
  for (const std::string mode : {"--mode single", "--mode dp --devices 2", "--mode ddp --devices 2"}) {
    SCOPED_TRACE(mode);
    for (const std::string graphs : {"on", "off"}) {
      const Result r = run(common + " " + mode + " --accumulate 3 --steps 25 --graphs " + graphs + " --save " +
                           path(graphs + ".st") + " --metrics-json " + path(graphs + ".json"));
      ASSERT_EQ(r.code, 0) << r.output;
    }
    EXPECT_EQ(read_file(path("on.st")), read_file(path("off.st"))) << "graphs change the bits";
    std::istringstream in(read_file(path("on.json")));
    std::vector<long> epoch_ends;
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.at("kind") == "epoch") epoch_ends.push_back(record.at("step").get<long>());
    }
    // 60 batches of 4 an epoch: 20 steps of 3; ddp's ranks read 30 each: 10 steps.
    const bool ddp = mode == "--mode ddp --devices 2";
    EXPECT_EQ(epoch_ends, ddp ? (std::vector<long>{10, 20, 25}) : (std::vector<long>{20, 25}));
    std::filesystem::remove(path("on.json"));
    std::filesystem::remove(path("off.json"));
  }
  const std::string shards = "--model convnet --backend sim --synthetic 240 --batch-size 2 --seed 3 --steps 4";
  ASSERT_EQ(run(shards + " --mode ddp --devices 2 --shards 4 --accumulate 3 --save " + path("k3.st")).code, 0);
  ASSERT_EQ(run(shards + " --mode dp --devices 3 --shards 12 --save " + path("v12.st")).code, 0);
  const auto a = dp::safetensors::read(path("k3.st")), b = dp::safetensors::read(path("v12.st"));
  ASSERT_EQ(a.order, b.order);
  for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name;
  const Result zero = run(common + " --accumulate 0 --steps 1");
  EXPECT_EQ(zero.code, 2) << zero.output;
  const Result big = run(common + " --accumulate 61 --steps 1 --save " + path("big.st"));
  EXPECT_EQ(big.code, 2) << big.output;
  EXPECT_NE(big.output.find("--accumulate 61: an epoch of 60 batch(es) of 4 per rank holds no step"), std::string::npos)
      << big.output;
  EXPECT_FALSE(std::filesystem::exists(path("big.st")));
}

// --shards V builds the fixed-shards engine in every mode, and the banner names it beside the mode.
TEST_F(TrainTest, ShardsRunOnTheFixedShardsEngineAndTheBannerSaysSo) {
  const Result single = run("--backend sim --synthetic 64 --mode single --shards 4 --steps 1");
  ASSERT_EQ(single.code, 0) << single.output;
  EXPECT_NE(single.output.find("dp_train: mlp single (fixed shards) on 1 device(s)"), std::string::npos)
      << single.output;
  const Result ddp = run("--backend sim --synthetic 64 --mode ddp --devices 2 --steps 1");
  ASSERT_EQ(ddp.code, 0) << ddp.output;
  EXPECT_NE(ddp.output.find("dp_train: mlp ddp on 2 device(s)"), std::string::npos) << ddp.output;
}

// --zero 1 (ZeRO stage 1, the buckets reduce-scattered) and --zero 2 (the gradients in bucket slots
// too, small buckets): the checkpoint of 10 steps is byte for byte plain DDP's on 2, 3 and 4 devices,
// with SGD's momentum and with AdamW, with a frozen layer and decay groups, with clipping and
// accumulation, and under --shards; a checkpoint resumes from and to either stage; other modes
// refuse it, and a stage past 2.
TEST_F(TrainTest, ZeroWritesPlainDdpsCheckpointAndResumesEitherWay) {
  const std::string common =
      "--model convnet --backend sim --synthetic 240 --batch-size 4 --seed 3 --mode ddp --bucket-cap-mb 0.004 "
      "--first-bucket-mb 0.002";
  for (const int devices : {2, 3, 4}) {
    for (const std::string optimizer : {" --optimizer sgd", " --optimizer adamw"}) {
      for (const std::string more : {"", " --freeze layer1 --decay matrices --weight-decay 0.1",
                                     " --clip-grad-norm 0.5 --accumulate 2", " --shards 12"}) {
        const std::string args = fmt::format("{} --devices {} --steps 10{}{}", common, devices, optimizer, more);
        ASSERT_EQ(run(args + " --save " + path("plain.st")).code, 0);
        for (const int stage : {1, 2}) {
          SCOPED_TRACE(fmt::format("{} devices{}{}, --zero {}", devices, optimizer, more, stage));
          const Result zero = run(args + fmt::format(" --zero {} --save ", stage) + path("zero.st"));
          ASSERT_EQ(zero.code, 0) << zero.output;
          EXPECT_EQ(read_file(path("plain.st")), read_file(path("zero.st"))) << "checkpoint bytes differ";
          // Clipping, accumulation and shards keep the gradients whole: stage 2 runs as 1, and says so.
          const bool noted = zero.output.find("note: --zero 2 runs as ZeRO stage 1 here") != std::string::npos;
          EXPECT_EQ(noted,
                    stage == 2 && (more.find("clip") != std::string::npos || more.find("shards") != std::string::npos))
              << zero.output;
        }
      }
    }
  }
  const std::string two = common + " --optimizer adamw --devices 2";
  ASSERT_EQ(run(two + " --steps 10 --save " + path("ten.st")).code, 0);
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {" --zero 1", ""}, {"", " --zero 1"}, {" --zero 2", ""}, {"", " --zero 2"}, {" --zero 1", " --zero 2"}}) {
    SCOPED_TRACE("first half" + first + ", second" + second);
    ASSERT_EQ(run(two + " --steps 5" + first + " --save " + path("half.st")).code, 0);
    const Result resumed = run("--backend sim --synthetic 240 --mode ddp --devices 2 --resume " + path("half.st") +
                               " --steps 10" + second + " --save " + path("resumed.st"));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_EQ(read_file(path("ten.st")), read_file(path("resumed.st"))) << "resumed checkpoint differs";
  }
  const Result dp = run("--backend sim --synthetic 64 --mode dp --devices 2 --steps 1 --zero 1");
  EXPECT_EQ(dp.code, 2) << dp.output;
  EXPECT_NE(dp.output.find("--zero applies to --mode ddp"), std::string::npos) << dp.output;
  EXPECT_EQ(run("--backend sim --synthetic 64 --mode ddp --devices 2 --steps 1 --zero 3").code, 2);
}

// --shards V with --sync-bn: a dp device per shard (V of them), on 4, 2 or 1 simulated GPUs
// (--devices-per-gpu), graphs on and off, ddp or dp: the same checkpoint tensors byte for byte;
// fewer dp devices than shards are refused, naming the way out (and dp without shards, as ever).
TEST_F(TrainTest, ShardsWithSyncBatchNormAreTheSameOnAnyGpuCount) {
  const std::string common =
      "--model convnet --sync-bn --shards 4 --mode ddp --backend sim --synthetic 160 --batch-size 3 --seed 5 "
      "--steps 5 --lr 0.05 --devices 4";
  ASSERT_EQ(run(common + " --save " + path("one.st")).code, 0);
  for (const std::string variant :
       {"--devices-per-gpu 2", "--devices-per-gpu 4", "--devices-per-gpu 2 --graphs off", "--mode dp"}) {
    SCOPED_TRACE(variant);
    const Result r = run(common + " " + variant + " --save " + path("p.st"));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto a = dp::safetensors::read(path("one.st")), b = dp::safetensors::read(path("p.st"));
    ASSERT_EQ(a.order, b.order);
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name;
  }
  const Result plain_dp = run("--model convnet --sync-bn --mode dp --backend sim --synthetic 64 --devices 2 --steps 1");
  EXPECT_EQ(plain_dp.code, 2) << plain_dp.output;
  EXPECT_NE(plain_dp.output.find("--sync-bn applies to --mode ddp"), std::string::npos) << plain_dp.output;
  const Result fewer =
      run("--model convnet --sync-bn --shards 4 --mode ddp --backend sim --synthetic 64 --devices 2 "
          "--steps 1");
  EXPECT_EQ(fewer.code, 2) << fewer.output;
  EXPECT_NE(fewer.output.find("sync_batchnorm with 4 shards needs a device per shard, not 2"), std::string::npos)
      << fewer.output;
}

// --amp bf16 resumes bit for bit, and a resumed run keeps the checkpoint's autocast when the flag
// is not given again (as the other run settings that only a resume takes from the checkpoint).
TEST_F(TrainTest, AutocastResumesBitExactAndKeepsItsSetting) {
  const std::string common = "--model resnet8 --mode ddp --backend sim --devices 2 --synthetic 48 --batch-size 6";
  ASSERT_EQ(run(common + " --amp bf16 --steps 4 --save " + path("straight.safetensors")).code, 0);
  const Result first = run(common + " --amp bf16 --steps 2 --save " + path("half.safetensors"));
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_EQ(dp::safetensors::read(path("half.safetensors")).metadata.at("dp.amp"), "bf16");
  const Result second =
      run(common + " --steps 4 --resume " + path("half.safetensors") + " --save " + path("resumed.safetensors"));
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_NE(second.output.find("autocast bf16"), std::string::npos) << second.output;
  const auto a = dp::safetensors::read(path("straight.safetensors"));
  const auto b = dp::safetensors::read(path("resumed.safetensors"));
  ASSERT_EQ(a.order, b.order);
  for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs after resume";
  // fp32 from the same start is another run: autocast changed the result.
  ASSERT_EQ(run(common + " --steps 4 --save " + path("fp32.safetensors")).code, 0);
  EXPECT_NE(dp::safetensors::read(path("fp32.safetensors")).at("fc.weight").data, a.at("fc.weight").data);
}

// Dropout's masks are a function of the seed and the step: a resumed run draws what the
// uninterrupted one drew (single: the seed; ddp: seed + rank), and label smoothing is part of the
// loss on both sides. (That other seeds draw other masks: test_engine.cpp.)
TEST_F(TrainTest, DropoutResumesWithTheSameMasks) {
  for (const std::string mode : {"single", "ddp"}) {
    SCOPED_TRACE(mode);
    const std::string common = fmt::format(
        "--model mlp --hidden 32 --dropout 0.3 --label-smoothing 0.1 --mode {} --backend sim --devices 2 "
        "--synthetic 40 --batch-size 8 --lr 0.05",
        mode);
    ASSERT_EQ(run(common + " --steps 6 --seed 5 --save " + path("straight.safetensors")).code, 0);
    ASSERT_EQ(run(common + " --steps 3 --seed 5 --save " + path("half.safetensors")).code, 0);
    const Result second = run(common + " --steps 6 --seed 5 --resume " + path("half.safetensors") + " --save " +
                              path("resumed.safetensors"));
    ASSERT_EQ(second.code, 0) << second.output;
    const auto a = dp::safetensors::read(path("straight.safetensors"));
    const auto b = dp::safetensors::read(path("resumed.safetensors"));
    for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs after resume";
  }
  const Result refused = run("--model convnet --dropout 0.5 --backend sim --synthetic 8 --steps 1");
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.output.find("--dropout applies to --model mlp"), std::string::npos) << refused.output;
}

// --sync-bn: DDP over 2 ranks of 6 trains as one device on their 12 samples. With --no-shuffle,
// DistributedSampler deals rank r the samples r, r+2, ..., so each step's two shards together are
// exactly single's batch of 12: the loss of every step agrees (to the printed digits and summation
// order). Refused outside ddp.
TEST_F(TrainTest, SyncBatchNormTrainsAsOneDeviceOnTheGlobalBatch) {
  const std::string common = " --model convnet --backend sim --synthetic 48 --steps 4 --no-shuffle --log-every 1";
  const Result ddp = run("--mode ddp --sync-bn --devices 2 --batch-size 6" + common);
  ASSERT_EQ(ddp.code, 0) << ddp.output;
  const Result single = run("--mode single --batch-size 12" + common);
  ASSERT_EQ(single.code, 0) << single.output;
  const auto a = losses(ddp.output), b = losses(single.output);
  ASSERT_GE(a.size(), 4u);
  ASSERT_GE(b.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(a[i], b[i], 1e-5 + 1e-5 * b[i]) << "step " << i;
  const Result refused = run("--model convnet --mode dp --sync-bn --backend sim --devices 2 --synthetic 8 --steps 1");
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.output.find("--sync-bn applies to --mode ddp"), std::string::npos) << refused.output;
}

TEST_F(TrainTest, InitAcceptsModulePrefixedNames) {
  ASSERT_EQ(run("--backend sim --synthetic 16 --batch-size 8 --steps 1 --save " + path("a.safetensors")).code, 0);
  auto file = dp::safetensors::read(path("a.safetensors"));
  dp::safetensors::File prefixed;
  for (const auto& name : file.order)
    if (name.rfind("optimizer.", 0) != 0) prefixed.add("module." + name, file.at(name));
  dp::safetensors::write(path("prefixed.safetensors"), prefixed);
  const Result r = run("--backend sim --synthetic 16 --batch-size 8 --steps 1 --init " + path("prefixed.safetensors"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor names carry DataParallel's 'module.' prefix"), std::string::npos) << r.output;
}

// --init is strict, as torch's load_state_dict: a tensor the model has no place for is refused as a
// missing one is (a training checkpoint's optimizer state aside). --init-non-strict loads what
// matches and prints missing_keys and unexpected_keys as torch returns them; the tensors it did not
// load keep their initialisation, and a shape mismatch stays an error.
TEST_F(TrainTest, InitIsStrictUnlessToldOtherwise) {
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 --seed 3";
  ASSERT_EQ(run(base + " --save " + path("good.safetensors")).code, 0);
  const auto good = dp::safetensors::read(path("good.safetensors"));
  dp::safetensors::File extra = good, missing = good;
  extra.add("head.weight", good.at("fc2.bias"));
  missing.tensors.erase("fc2.bias");
  missing.order.erase(std::find(missing.order.begin(), missing.order.end(), "fc2.bias"));
  dp::safetensors::write(path("extra.safetensors"), extra);
  dp::safetensors::write(path("missing.safetensors"), missing);
  const std::string init = base + " --init ";
  expect_nothing_written(init + path("extra.safetensors") + " --save " + path("out.safetensors"), 2,
                         "checkpoint tensor 'head.weight' is not the model's");
  expect_nothing_written(init + path("missing.safetensors") + " --save " + path("out.safetensors"), 2,
                         "checkpoint has no tensor 'fc2.bias'");
  // Non-strict, the extra tensor aside, trains from exactly what a strict load of the good file gives.
  ASSERT_EQ(run(init + path("good.safetensors") + " --save " + path("strict.safetensors")).code, 0);
  const Result with_extra =
      run(init + path("extra.safetensors") + " --init-non-strict --save " + path("loose.safetensors"));
  ASSERT_EQ(with_extra.code, 0) << with_extra.output;
  EXPECT_NE(with_extra.output.find("missing_keys=[] unexpected_keys=['head.weight']"), std::string::npos)
      << with_extra.output;
  const auto strict = dp::safetensors::read(path("strict.safetensors"));
  const auto loose = dp::safetensors::read(path("loose.safetensors"));
  for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"})
    EXPECT_EQ(loose.at(name).data, strict.at(name).data) << name;
  const Result with_missing = run(init + path("missing.safetensors") + " --init-non-strict");
  ASSERT_EQ(with_missing.code, 0) << with_missing.output;
  EXPECT_NE(with_missing.output.find("missing_keys=['fc2.bias'] unexpected_keys=[]"), std::string::npos)
      << with_missing.output;
  dp::safetensors::File bad_shape = extra;
  bad_shape.tensors["fc1.bias"].shape = {4, 4};
  dp::safetensors::write(path("shape.safetensors"), bad_shape);
  expect_refused(init + path("shape.safetensors") + " --init-non-strict",
                 "'fc1.bias' has shape [4, 4], the model expects [16]");
  expect_refused(base + " --init-non-strict", "--init-non-strict requires --init");
}

TEST_F(TrainTest, BadDataIsRefused) {
  const std::string base = "--backend sim --batch-size 4 --steps 1 --data ";
  expect_refused(base + path("nothing"), "train-images-idx3-ubyte: cannot open");
  write_idx("truncated", 10, 28, 28, 0x803, -1, 100);
  expect_refused(base + path("truncated"), "truncated");
  write_idx("magic", 10, 28, 28, 0x802);
  expect_refused(base + path("magic"), "wrong magic");
  write_idx("labels", 10, 28, 28, 0x803, 7);
  expect_refused(base + path("labels"), "label 10 of sample 7");
  write_idx("size", 10, 32, 32);
  expect_refused(base + path("size"), "images are 32x32, the models need 28x28");
  write_idx("good", 10);
  EXPECT_EQ(run(base + path("good")).code, 0);
}

// A text file of a repeated 10-byte pattern: a one-block GPT learns it (every held-out byte
// predicted), single and DDP on 2 devices, and --generate continues a prompt with it.
TEST_F(TrainTest, GptLearnsTextAndSamplesWhatItLearned) {
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "abcdefghij";
  { std::ofstream(path("abc.txt"), std::ios::binary) << text; }
  const std::string gpt = "--backend sim --model gpt --context 16 --layers 1 --heads 2 --width 32 ";
  const std::string train = gpt + "--text " + path("abc.txt") +
                            " --steps 150 --batch-size 16 --optimizer adamw --lr 1e-2 --log-every 50 --seed 3 ";
  for (const std::string mode : {"", "--mode ddp --devices 2 "}) {
    SCOPED_TRACE(mode);
    const Result r = run(train + mode + "--save " + path("abc.safetensors"));
    ASSERT_EQ(r.code, 0) << r.output;
    // 2000 held-out bytes in windows of 16 (124 windows, 1984 tokens), every one predicted.
    EXPECT_NE(r.output.find("test acc 100.00%"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("bits/byte"), std::string::npos) << r.output;
    const Result eval = run(gpt + "--text " + path("abc.txt") + " --eval-only --init " + path("abc.safetensors"));
    ASSERT_EQ(eval.code, 0) << eval.output;
    EXPECT_NE(eval.output.find("on 1984 test tokens"), std::string::npos) << eval.output;
  }
  // A GPT resumes bit for bit (the tied table under both names, AdamW's state per parameter).
  const std::string half = train + "--mode ddp --devices 2 --no-eval ";
  ASSERT_EQ(run(half + "--save " + path("full.safetensors")).code, 0);
  ASSERT_EQ(run(half + "--steps 70 --save " + path("part.safetensors")).code, 0);
  const Result resumed = run(half + "--resume " + path("part.safetensors") + " --save " + path("resumed.safetensors"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(read_file(path("full.safetensors")), read_file(path("resumed.safetensors"))) << "resume is bit-exact";
  const Result sample = run(gpt + "--init " + path("abc.safetensors") + " --generate 25 --prompt cde --top-k 1");
  ASSERT_EQ(sample.code, 0) << sample.output;
  EXPECT_NE(sample.output.find("cdefghijabcdefghijabcdefghij\n"), std::string::npos)
      << sample.output << " (the prompt echoed)";
  // --num-samples: nanoGPT's sample.py's samples, each after the prompt, a rule after each.
  const Result three =
      run(gpt + "--init " + path("abc.safetensors") + " --generate 5 --prompt cde --top-k 1 --num-samples 3");
  ASSERT_EQ(three.code, 0) << three.output;
  EXPECT_NE(three.output.find("cdefghij\n---------------\ncdefghij\n---------------\ncdefghij\n---------------\n"),
            std::string::npos)
      << three.output;
  // Sampling at a temperature draws from the seed: the same bytes again, other bytes with another.
  const std::string warm = gpt + "--init " + path("abc.safetensors") + " --generate 40 --temperature 5 --seed ";
  EXPECT_EQ(run(warm + "1").output, run(warm + "1").output);
  EXPECT_NE(run(warm + "1").output, run(warm + "2").output);
}

TEST_F(TrainTest, BadTextIsRefused) {
  const std::string base = "--backend sim --model gpt --context 8 --layers 1 --heads 1 --width 8 --steps 1 ";
  expect_refused(base + "--text " + path("nothing.txt"), "nothing.txt: no such file");
  expect_refused(base + "--text " + dir_.string(), "not a regular file");
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  expect_refused(base + "--text " + path("fifo"), "fifo: not a regular file");
  { std::ofstream(path("short.txt")) << std::string(89, 'x'); }
  expect_refused(base + "--text " + path("short.txt"), "89 bytes is too short for --context 8");
  expect_refused(base, "--model gpt trains on text: give --text FILE");
  { std::ofstream(path("ok.txt")) << std::string(200, 'x'); }
  expect_refused("--backend sim --steps 1 --text " + path("ok.txt"), "--text trains a language model (--model gpt)");
  const Result no_init = run(base + "--generate 5");
  EXPECT_EQ(no_init.code, 2);
  EXPECT_NE(no_init.output.find("--generate samples from a checkpoint: give it with --init"), std::string::npos)
      << no_init.output;
}

TEST_F(TrainTest, BadCheckpointsAreRefused) {
  ASSERT_EQ(
      run("--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 --save " + path("good.safetensors")).code,
      0);
  const auto good = dp::safetensors::read(path("good.safetensors"));
  auto variant = [&](const std::string& name, auto&& edit) {
    dp::safetensors::File f = good;
    edit(f);
    dp::safetensors::write(path(name), f);
    return path(name);
  };
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 --init ";
  expect_refused(base + variant("missing.safetensors",
                                [](auto& f) {
                                  f.tensors.erase("fc2.bias");
                                  f.order.erase(std::find(f.order.begin(), f.order.end(), "fc2.bias"));
                                }),
                 "checkpoint has no tensor 'fc2.bias'");
  expect_refused(base + variant("shape.safetensors",
                                [](auto& f) {
                                  f.tensors["fc1.bias"].shape = {4, 4};
                                }),
                 "'fc1.bias' has shape [4, 4], the model expects [16]");
  expect_refused(base + variant("dtype.safetensors",
                                [](auto& f) {
                                  auto& t = f.tensors["fc1.bias"];
                                  t.dtype = "I32";
                                }),
                 "'fc1.bias' has dtype I32, the model expects F32");
  {
    std::ifstream in(path("good.safetensors"), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(path("cut.safetensors"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  expect_refused(base + path("cut.safetensors"), "cut.safetensors");
  expect_refused(
      "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 --resume " + path("missing.safetensors"),
      "checkpoint has no tensor 'fc2.bias'");
  // Training state is input too: every number is range-checked, the model kind must match.
  const std::string resume = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 --resume ";
  expect_refused(resume + variant("negative.safetensors", [](auto& f) { f.metadata["dp.step"] = "-3"; }),
                 "metadata 'dp.step' = '-3' is not a number");
  expect_refused(resume + variant("nostate.safetensors", [](auto& f) { f.metadata.erase("dp.optimizer_steps"); }),
                 "metadata 'dp.optimizer_steps' is missing");
  expect_refused(
      "--model convnet --backend sim --synthetic 16 --batch-size 8 --steps 1 --resume " + path("good.safetensors"),
      "was saved with --model mlp");
}

TEST_F(TrainTest, BadFlagsAreRefused) {
  expect_refused("--backend sim --model resnet", "--model");
  expect_refused("--backend sim --mode fsdp", "--mode");
  expect_refused("--backend tpu", "--backend");
  expect_refused("--backend sim --batch-size 0 --steps 1", "--batch-size: '0' is out of range (at least 1)");
  expect_refused("--backend sim --mode dp --devices 65 --steps 1", "at most 64 devices");
  if (dp::Runtime::cuda_device_count() == 0) {
    expect_refused("--backend cuda --steps 1", "--backend cuda:");
    expect_refused("--backend cuda --mode ddp --steps 1", "--backend cuda:");
  } else {  // a machine with GPUs trains on them: refused only for devices it does not have
    expect_refused("--backend cuda --mode ddp --devices 4096 --steps 1", "CUDA device(s) are available");
  }
  expect_refused("--backend sim --mode dp --devices 2 --output-device 3 --steps 1",
                 "--output-device 3 is not among the devices [0,1]");
  expect_refused("--backend sim --mode dp --device-ids 0,1,0 --steps 1", "device 0 appears twice");
  expect_refused("--backend sim --hidden 12,x --steps 1", "--hidden '12,x': 'x' is not an integer");
  expect_refused("--backend sim --steps 1 --epochs 1", "excludes");
  expect_refused("--backend sim --steps 1 --optimizer adamw --momentum 0.5",
                 "--momentum does not apply to --optimizer adamw");
  expect_refused("--backend sim --steps 1 --beta1 0.8", "--beta1 does not apply to --optimizer sgd");
  expect_refused("--backend sim --steps 1 --optimizer adam", "--optimizer");
  expect_refused("--backend sim --steps 1 --precision fp16", "--precision");
  expect_refused("--backend sim --steps 1 --mode ddp --grad-reduce fp16", "--grad-reduce");
  expect_refused("--backend sim --steps 1 --graphs maybe", "--graphs");
}

// --precision strict|fast: both accepted; the sim has one arithmetic, so the losses are identical
// (on cuda, fast may pick TF32 convolutions and differ by their rounding).
TEST_F(TrainTest, PrecisionFastIsStrictOnTheSim) {
  expect_same_losses(
      "--model convnet --backend sim --synthetic 32 --batch-size 8 --steps 3 --log-every 1 --no-shuffle --precision ",
      {"strict", "fast"}, 3);
}

// --precision tf32 (TF32 GEMMs) and --grad-reduce bf16 (DDP's bf16_compress_hook) train, at their
// own precision: the losses move off strict fp32's by about their rounding, no more; the run says
// which it used. Both refuse what they do not apply to.
TEST_F(TrainTest, Tf32AndBf16GradientsTrainCloseToFp32) {
  const std::string args =
      "--model convnet --backend sim --synthetic 64 --batch-size 8 --steps 4 --log-every 1 "
      "--no-shuffle --mode ddp --devices 2";
  const Result fp32 = run(args);
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  for (const std::string extra : {" --precision tf32", " --grad-reduce bf16", " --precision tf32 --grad-reduce bf16",
                                  " --amp bf16", " --amp bf16 --grad-reduce bf16"}) {
    const Result r = run(args + extra);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto want = losses(fp32.output), got = losses(r.output);
    ASSERT_EQ(got.size(), want.size()) << r.output;
    EXPECT_NE(got, want) << extra << ": rounds differently from fp32";
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.02 * want[i]) << extra << " step " << i;
    EXPECT_NE(r.output.find(extra.find("tf32") != std::string::npos ? "precision tf32" : "precision strict"),
              std::string::npos)
        << r.output;
    if (extra.find("grad-reduce bf16") != std::string::npos) {
      EXPECT_NE(r.output.find("gradients all-reduced in bf16"), std::string::npos) << r.output;
    }
    EXPECT_EQ(r.output.find("autocast bf16") != std::string::npos, extra.find("--amp bf16") != std::string::npos)
        << r.output;
  }
  expect_refused("--backend sim --synthetic 16 --steps 1 --grad-reduce bf16", "--grad-reduce applies to --mode ddp");
  expect_refused("--backend sim --synthetic 16 --steps 1 --precision bf16", "--precision");
  expect_refused("--backend sim --synthetic 16 --steps 1 --amp fp16", "--amp");
  expect_refused("--backend sim --synthetic 16 --loader-only --eval-only", "not with --eval-only");
}

// --graphs on (the default) replays a captured step; every loss, through the last partial batch
// of each epoch (another batch size, another graph) and the lr warm-up, equals the eager run's.
TEST_F(TrainTest, GraphsOnEqualGraphsOffBitForBit) {
  for (const char* mode : {"single", "dp", "ddp"}) {
    SCOPED_TRACE(mode);
    expect_same_losses(fmt::format("--model convnet --mode {} --backend sim --devices 2 --synthetic 44 --batch-size 8 "
                                   "--epochs 2 --warmup-steps 3 --log-every 1 --no-shuffle --graphs ",
                                   mode),
                       {"on", "off"}, 4);
  }
}

// Several dp devices on one (simulated) GPU: the same checkpoint, bit for bit, as one device per GPU,
// in dp and ddp, with and without SyncBatchNorm. A value that does not fit is refused up front.
TEST_F(TrainTest, DevicesPerGpuGivesTheSameCheckpoint) {
  const std::string common = " --model convnet --backend sim --devices 4 --synthetic 64 --batch-size 8 --steps 3";
  for (const char* mode : {"dp", "ddp", "ddp --sync-bn"}) {
    SCOPED_TRACE(mode);
    std::vector<std::string> saved;
    for (const int per_gpu : {1, 2, 4}) {
      saved.push_back(path(fmt::format("k{}.safetensors", per_gpu)));
      const Result r =
          run(fmt::format("--mode {}{} --devices-per-gpu {} --save {}", mode, common, per_gpu, saved.back()));
      ASSERT_EQ(r.code, 0) << r.output;
    }
    EXPECT_EQ(read_file(saved[1]), read_file(saved[0])) << "2 devices per GPU";
    EXPECT_EQ(read_file(saved[2]), read_file(saved[0])) << "4 devices per GPU";
  }
  expect_refused("--mode ddp" + common + " --devices-per-gpu 3", "--devices-per-gpu 3 does not divide");
  expect_refused("--mode ddp" + common + " --devices-per-gpu 0", "--devices-per-gpu");
  expect_refused("--mode ddp" + common + " --devices-per-gpu -2", "--devices-per-gpu");
}

// --pipeline on (the default) submits each step before reading the previous step's loss; every
// logged loss, the epoch summaries, the checkpoint saved, and where a divergence stops are the same
// as waiting for each loss.
TEST_F(TrainTest, PipelineOnEqualsPipelineOffBitForBit) {
  const auto file = [](const std::string& name) { return read_file(name); };
  for (const char* mode : {"single", "dp", "ddp"}) {
    SCOPED_TRACE(mode);
    const std::string args = fmt::format(
        "--mode {} --backend sim --devices 2 --synthetic 44 --batch-size 8 --epochs 2 --warmup-steps 3 "
        "--log-every 1 ",
        mode);
    const std::string on_ckpt = path(fmt::format("on_{}.safetensors", mode));
    const std::string off_ckpt = path(fmt::format("off_{}.safetensors", mode));
    const Result on = run(args + "--pipeline on --save " + on_ckpt),
                 off = run(args + "--pipeline off --save " + off_ckpt);
    ASSERT_EQ(on.code, 0) << on.output;
    ASSERT_EQ(off.code, 0) << off.output;
    ASSERT_GE(losses(on.output).size(), 8u) << on.output;  // 6 steps or more, and 2 epoch summaries
    EXPECT_EQ(losses(on.output), losses(off.output)) << on.output;
    EXPECT_EQ(file(on_ckpt), file(off_ckpt));
    // Divergence: the same first non-finite step is named, and nothing is saved either way.
    const Result on_nan = run(args + "--lr 1e30 --pipeline on"), off_nan = run(args + "--lr 1e30 --pipeline off");
    EXPECT_EQ(on_nan.code, 3) << on_nan.output;
    EXPECT_EQ(off_nan.code, 3) << off_nan.output;
    const std::regex stop(R"(loss is \S+ at step \d+ \(epoch \d+\))");
    std::smatch on_stop, off_stop;
    ASSERT_TRUE(std::regex_search(on_nan.output, on_stop, stop)) << on_nan.output;
    ASSERT_TRUE(std::regex_search(off_nan.output, off_stop, stop)) << off_nan.output;
    EXPECT_EQ(on_stop.str(), off_stop.str());
    EXPECT_EQ(losses(on_nan.output), losses(off_nan.output)) << on_nan.output;
  }
}

// A run that diverges after --save-best wrote a checkpoint says so: exit 3, --save not written, and
// the best checkpoint (a model from before the divergence) named with its step; it stays as written.
TEST_F(TrainTest, ADivergedRunNamesTheBestCheckpointItKeeps) {
  write_idx("data", 96);
  write_idx("data", 29, 28, 28, 0x803, -1, 0, "t10k");
  // lr 0.1 for 4 steps, then 1e14: the loss is no longer finite a few steps later (in file order:
  // whether it diverges or only grows, every ReLU dead, depends on the batches).
  const Result r =
      run("--model mlp --hidden 16 --backend sim --data " + path("data") +
          " --batch-size 8 --steps 12 --lr 0.1 --schedule step --step-size 4 --gamma 1e15 --eval-every 2 --no-shuffle"
          " --save-best " +
          path("best.st") + " --save " + path("last.st"));
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("was not written"), std::string::npos) << r.output;
  const std::size_t at = r.output.find("--save-best " + path("best.st") + " holds step ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const auto saved = dp::safetensors::read(path("best.st"));
  const std::string step = saved.metadata.at("dp.step");
  EXPECT_EQ(r.output.substr(at).find("holds step " + step + "'s model"),
            std::string("--save-best " + path("best.st") + " ").size())
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(path("last.st")));
}

TEST_F(TrainTest, NonFiniteLossStopsAndKeepsTheLastCheckpoint) {
  const std::string guard = path("last_good.safetensors");
  ASSERT_EQ(run("--backend sim --synthetic 32 --batch-size 8 --steps 1 --save " + guard).code, 0);
  const auto before = fs::last_write_time(guard);
  std::ifstream in(guard, std::ios::binary);
  const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Result r =
      run("--backend sim --synthetic 32 --batch-size 8 --steps 20 --lr 1e30 --resume " + guard + " --save " + guard);
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("loss is"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was not written"), std::string::npos) << r.output;
  std::ifstream again(guard, std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>()), original);
  EXPECT_EQ(fs::last_write_time(guard), before);
}

}  // namespace

namespace {

std::vector<double> learning_rates(const std::string& output) {
  std::vector<double> out;
  const std::regex line(R"( lr ([0-9.eE+-]+))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it)
    out.push_back(std::stod((*it)[1].str()));
  return out;
}

// --optimizer adamw starts from torch.optim.AdamW's defaults (lr 1e-3) unless told otherwise.
TEST_F(TrainTest, AdamWTakesTorchsDefaults) {
  const Result r = run("--backend sim --synthetic 32 --batch-size 8 --steps 2 --optimizer adamw --log-every 1");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto lrs = learning_rates(r.output);
  ASSERT_EQ(lrs.size(), 2u);
  EXPECT_EQ(lrs[0], 0.001);
}

TEST_F(TrainTest, LinearScalingAndWarmup) {
  // --scale-lr: target = lr x devices; warm-up from the unscaled lr (Goyal et al.).
  const Result scaled =
      run("--mode dp --backend sim --devices 2 --synthetic 64 --batch-size 8 --steps 6 --lr 0.1 "
          "--scale-lr --warmup-steps 4 --log-every 1");
  ASSERT_EQ(scaled.code, 0) << scaled.output;
  const auto a = learning_rates(scaled.output);
  ASSERT_EQ(a.size(), 6u);
  const double want_a[] = {0.1, 0.125, 0.15, 0.175, 0.2, 0.2};
  for (std::size_t i = 0; i < 6; ++i) EXPECT_NEAR(a[i], want_a[i], 1e-6) << "step " << i;
  // Without scaling: from target / W up to the target.
  const Result plain =
      run("--mode ddp --backend sim --devices 2 --synthetic 64 --batch-size 8 --steps 5 --lr 0.1 "
          "--warmup-steps 4 --log-every 1");
  ASSERT_EQ(plain.code, 0) << plain.output;
  const auto b = learning_rates(plain.output);
  ASSERT_EQ(b.size(), 5u);
  const double want_b[] = {0.025, 0.04375, 0.0625, 0.08125, 0.1};
  for (std::size_t i = 0; i < 5; ++i) EXPECT_NEAR(b[i], want_b[i], 1e-6) << "step " << i;
}

}  // namespace

namespace {

// gzip -c FILE > FILE.gz, then removes FILE (zlib writes what gzip would).
void gzip_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gzFile out = gzopen((file.string() + ".gz").c_str(), "wb");
  ASSERT_NE(out, nullptr);
  ASSERT_EQ(gzwrite(out, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(out);
  fs::remove(file);
}

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST_F(TrainTest, GzipDataTrainsExactlyAsPlain) {
  write_idx("plain", 40);
  write_idx("gz", 40);
  gzip_file(dir_ / "gz" / "train-images-idx3-ubyte");
  gzip_file(dir_ / "gz" / "train-labels-idx1-ubyte");
  const std::string args = "--backend sim --mode ddp --devices 2 --batch-size 8 --steps 4 --log-every 1 --data ";
  const Result plain = run(args + path("plain")), gz = run(args + path("gz"));
  ASSERT_EQ(plain.code, 0) << plain.output;
  ASSERT_EQ(gz.code, 0) << gz.output;
  EXPECT_EQ(losses(gz.output), losses(plain.output)) << "the same batches give the same losses, bit for bit";
  // A damaged stream is bad input: exit 2, naming the file.
  std::ifstream in(dir_ / "gz" / "train-images-idx3-ubyte.gz", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(dir_ / "gz" / "train-images-idx3-ubyte.gz", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_refused(args + path("gz"), "train-images-idx3-ubyte.gz: corrupt or truncated gzip stream");
}

TEST_F(TrainTest, EvaluatesEveryTestSampleOnceAndEquallyInEveryMode) {
  write_idx("data", 48);
  write_idx("data", 10, 28, 28, 0x803, -1, 0, "t10k");  // 10 does not divide by 3 devices
  const std::string data = " --backend sim --data " + path("data");
  const Result trained = run("--model convnet --batch-size 8 --steps 6 --lr 0.02 --save " + path("ckpt.safetensors") +
                             " --metrics-json " + path("train.jsonl") + data);
  ASSERT_EQ(trained.code, 0) << trained.output;
  EXPECT_NE(trained.output.find("test acc"), std::string::npos) << "evaluation is on when there is a test split";
  // The metrics: every logged step, then the epoch with its test figures.
  const auto records = json_lines(path("train.jsonl"));
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records.front().at("kind"), "step");
  const auto& epoch = records.back();
  EXPECT_EQ(epoch.at("kind"), "epoch");
  EXPECT_EQ(epoch.at("epoch"), 1);
  EXPECT_EQ(epoch.at("test_samples"), 10);
  for (const char* key : {"train_loss", "test_loss", "test_accuracy", "samples_per_s"})
    EXPECT_TRUE(epoch.at(key).is_number()) << key;
  EXPECT_GE(epoch.at("test_accuracy").get<double>(), 0.0);
  EXPECT_LE(epoch.at("test_accuracy").get<double>(), 1.0);

  // The checkpoint evaluated in every mode over 3 devices: the same samples, the same result.
  const std::regex line(R"(on (\d+) test samples: test loss ([0-9.]+), test accuracy [0-9.]+% \((\d+) correct\))");
  std::vector<std::smatch> found;
  std::vector<std::string> outputs;
  for (const std::string mode : {"single", "dp", "ddp"}) {
    const Result r = run(fmt::format("--model convnet --mode {} --devices 3 --batch-size 2 --eval-only --init {}{}",
                                     mode, path("ckpt.safetensors"), data));
    ASSERT_EQ(r.code, 0) << r.output;
    outputs.push_back(r.output);
  }
  std::vector<std::array<std::string, 3>> results;
  for (const std::string& output : outputs) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(output, m, line)) << output;
    results.push_back({m[1].str(), m[2].str(), m[3].str()});
  }
  // Sample by sample: each mode predicts the same class for every test sample.
  std::vector<std::string> predictions;
  for (const std::string mode : {"single", "ddp"}) {
    const std::string file = path("predictions_" + mode + ".txt");
    const Result r =
        run(fmt::format("--model convnet --mode {} --devices 3 --batch-size 2 --eval-only --init {} "
                        "--predictions {}{}",
                        mode, path("ckpt.safetensors"), file, data));
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream in(file);
    predictions.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  EXPECT_EQ(std::count(predictions[0].begin(), predictions[0].end(), '\n'), 10);
  EXPECT_EQ(predictions[1], predictions[0]);
  for (const auto& r : results) {
    EXPECT_EQ(r[0], "10") << "every test sample exactly once";
    EXPECT_EQ(r[2], results[0][2]) << "the same samples correct in every mode";
    EXPECT_NEAR(std::stod(r[1]), std::stod(results[0][1]), 1e-5) << "the same test loss";
  }
}

TEST_F(TrainTest, EvaluationAndMetricsInputsAreChecked) {
  write_idx("data", 16);
  expect_refused("--backend sim --synthetic 16 --batch-size 8 --steps 1 --eval", "has no test split");
  expect_refused("--backend sim --data " + path("data") + " --batch-size 8 --steps 1 --eval", "has no test split");
  expect_refused("--backend sim --synthetic 16 --steps 1 --normalize 0.5", "--normalize '0.5'");
  expect_refused("--backend sim --synthetic 16 --steps 1 --normalize 0.5,0", "stds > 0");
  expect_refused("--backend sim --data " + path("data") + " --eval-only", "--eval-only evaluates a checkpoint");
  expect_refused("--backend sim --synthetic 16 --steps 1 --metrics-json " + path("no/such/dir/m.jsonl"),
                 "--metrics-json");
  expect_refused("--backend sim --data no-such-data-set-xyz --steps 1", "/usr/share/datasets/no-such-data-set-xyz");
}

}  // namespace

namespace {

// --metrics-json goes through the checks --save does, before any work: a run refused later (a
// missing --init, bad data) leaves an existing metrics file byte-identical and creates none; a FIFO,
// a device or a symbolic link is refused at once (a FIFO hung in open()); and it may not name the
// file another output or an input names.
TEST_F(TrainTest, MetricsJsonIsCheckedUpFrontAndWrittenOnlyByARunThatStarts) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 --steps 1 --metrics-json ";
  const std::string old_log = path("old.jsonl");
  { std::ofstream(old_log) << "{\"kind\": \"step\"}\n"; }
  const std::string before = read_file(old_log);
  for (const std::string& later : {" --init " + path("missing.safetensors"), " --data " + path("no-such-dir")}) {
    const Result r = run(base + old_log + later);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(read_file(old_log), before) << "a refused run changed the metrics file: " << later;
  }
  const Result fresh = run(base + path("new.jsonl") + " --init " + path("missing.safetensors"));
  EXPECT_EQ(fresh.code, 2) << fresh.output;
  EXPECT_FALSE(fs::exists(path("new.jsonl"))) << "a refused run created its metrics file";

  ASSERT_EQ(::mkfifo(path("fifo.jsonl").c_str(), 0644), 0);
  expect_refused(base + path("fifo.jsonl"), "not a regular file");
  expect_refused(base + "/dev/full", "not a regular file");
  fs::create_symlink(old_log, path("link.jsonl"));
  expect_refused(base + path("link.jsonl"), "not a regular file");
  EXPECT_EQ(read_file(old_log), before);

  const std::string guard = path("existing.safetensors");
  expect_refused(base + guard, "--save and --metrics-json name the same file");
  expect_refused(base + path("m.jsonl") + " --init " + path("m.jsonl"), "would overwrite the --init input");
  // A run that starts writes the file.
  const Result ok = run(base + path("ran.jsonl"));
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(read_file(path("ran.jsonl")).find("\"kind\""), std::string::npos);
}

// Resuming with other settings than the checkpoint's run: every changed flag is said (the new value
// wins, as a PyTorch user expects) or refused with exit 2 where the checkpoint cannot go on (another
// --hidden: its tensors do not fit; --momentum 0 would drop its momentum buffers), and the resumed
// run keeps the checkpoint's seed. On another device count the epochs go on from the checkpoint's.
TEST_F(TrainTest, ResumingWithOtherSettingsIsNotedOrRefused) {
  const std::string common = "--model mlp --hidden 16 --mode ddp --backend sim --synthetic 48 --batch-size 4 ";
  const std::string saved = path("two.safetensors");
  // 48 samples over 2 devices in batches of 4: 2 epochs of 6 steps.
  ASSERT_EQ(run(common + "--devices 2 --dropout 0.1 --epochs 2 --save " + saved).code, 0);
  // Over 3 devices in batches of 8, an epoch is 2 steps: epoch 3 is steps 13 and 14, not "epoch 7".
  const Result more = run(common + "--devices 3 --dropout 0.2 --batch-size 8 --seed 9 --epochs 3 --resume " + saved);
  ASSERT_EQ(more.code, 0) << more.output;
  for (const char* note :
       {"trained on 2 device(s); continuing on 3", "trained with --dropout 0.1; continuing with 0.2",
        "was saved with --batch-size 4; continuing with 8", "trained with --seed 0; continuing with its seed, not 9",
        "2 step(s) from step 12", "epoch   3 | train loss"})
    EXPECT_NE(more.output.find(note), std::string::npos) << note << " in:\n" << more.output;
  EXPECT_EQ(more.output.find("epoch   7"), std::string::npos) << more.output;
  const Result same = run(common + "--devices 2 --dropout 0.1 --epochs 3 --resume " + saved);
  ASSERT_EQ(same.code, 0) << same.output;
  EXPECT_EQ(same.output.find("note:"), std::string::npos) << same.output;
  EXPECT_NE(same.output.find("epoch   3 | train loss"), std::string::npos) << same.output;
  expect_nothing_written(common + "--devices 2 --hidden 32 --epochs 3 --resume " + saved + " --save " + saved, 2,
                         "was saved with --hidden 16");
  expect_refused(common + "--devices 2 --dropout 0.1 --momentum 0 --epochs 3 --resume " + saved,
                 "which --momentum 0 would drop");
}

TEST_F(TrainTest, NonFiniteValuesAreNeverTrainedFromNorSaved) {
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 ";
  ASSERT_EQ(run(base + "--save " + path("good.safetensors")).code, 0);
  dp::safetensors::File poisoned = dp::safetensors::read(path("good.safetensors"));
  auto& weight = poisoned.tensors.at("fc1.weight");
  const float nan = std::nanf("");
  std::memcpy(weight.data.data() + 3 * sizeof(float), &nan, sizeof(float));
  dp::safetensors::write(path("nan_weight.safetensors"), poisoned);
  expect_refused(base + "--init " + path("nan_weight.safetensors"), "'fc1.weight' holds a non-finite value");
  dp::safetensors::File momentum = dp::safetensors::read(path("good.safetensors"));
  std::memcpy(momentum.tensors.at("optimizer.momentum.fc2.bias").data.data(), &nan, sizeof(float));
  dp::safetensors::write(path("nan_momentum.safetensors"), momentum);
  expect_refused(base + "--resume " + path("nan_momentum.safetensors"),
                 "momentum buffer 'optimizer.momentum.fc2.bias' holds a non-finite value");
  // Divergence through ReLU (which keeps NaN, as torch.relu does) stops the run: exit 3, the
  // checkpoint already there untouched.
  { std::ofstream(path("kept.safetensors")) << "previous checkpoint"; }
  const Result diverged =
      run("--model convnet --backend sim --synthetic 64 --batch-size 16 --steps 10 --lr 1e30 "
          "--save " +
          path("kept.safetensors"));
  EXPECT_EQ(diverged.code, 3) << diverged.output;
  EXPECT_NE(diverged.output.find("was not written"), std::string::npos) << diverged.output;
  std::ifstream kept(path("kept.safetensors"));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "previous checkpoint");
}

// The last step's update has no later step whose loss would show the divergence: the final model's
// evaluation loss does (the first batch's without a test split, the test set's with one), and a
// non-finite one stops the run with exit 3 before anything is written.
TEST_F(TrainTest, DivergenceOnTheLastStepSavesNothing) {
  const std::string base = "--backend sim --hidden 16 --synthetic 64 --batch-size 8 ";
  ASSERT_EQ(run(base + "--steps 1 --save " + path("good.safetensors")).code, 0);
  expect_nothing_written(
      base + "--steps 2 --lr 1e30 --resume " + path("good.safetensors") + " --save " + path("good.safetensors"), 3,
      "the loss of the final model on the first batch is");
  write_idx("data", 16);
  write_idx("data", 8, 28, 28, 0x803, -1, 0, "t10k");
  const std::string data = "--backend sim --hidden 16 --batch-size 8 --steps 1 --data " + path("data");
  expect_nothing_written(data + " --lr 1e30 --save " + path("good.safetensors"), 3, "the test loss after step 1 is");
  // A checkpoint whose weights overflow the forward pass evaluates to a non-finite loss: exit 3.
  dp::safetensors::File huge = dp::safetensors::read(path("good.safetensors"));
  for (auto& [name, tensor] : huge.tensors) {
    std::vector<float> values = tensor.to_f32();
    for (float& v : values) v = 1e28f;
    tensor = dp::safetensors::make_f32(tensor.shape, values.data());
  }
  dp::safetensors::write(path("huge.safetensors"), huge);
  expect_nothing_written("--backend sim --hidden 16 --batch-size 8 --eval-only --data " + path("data") + " --init " +
                             path("huge.safetensors") + " --predictions " + path("predictions.txt"),
                         3, "the test loss of " + path("huge.safetensors") + " is");
}

// A checkpoint's buffers hold what training leaves there: a negative running variance is an
// invalid state, refused (exit 2, naming the tensor) rather than evaluated into a NaN loss.
TEST_F(TrainTest, InvalidBufferValuesAreRefused) {
  write_idx("data", 16);
  write_idx("data", 8, 28, 28, 0x803, -1, 0, "t10k");
  const std::string data = "--model convnet --backend sim --batch-size 8 --data " + path("data");
  ASSERT_EQ(run(data + " --steps 1 --save " + path("good.safetensors")).code, 0);
  dp::safetensors::File bad = dp::safetensors::read(path("good.safetensors"));
  auto& var = bad.tensors.at("layer2.1.running_var");
  const float minus_one = -1.0f;
  std::memcpy(var.data.data() + 5 * sizeof(float), &minus_one, sizeof(float));
  dp::safetensors::write(path("bad_var.safetensors"), bad);
  const std::string message = "checkpoint tensor 'layer2.1.running_var' holds -1 at element 5: an invalid state";
  expect_nothing_written(data + " --eval-only --init " + path("bad_var.safetensors"), 2, message);
  expect_nothing_written(
      data + " --steps 1 --resume " + path("bad_var.safetensors") + " --save " + path("good.safetensors"), 2, message);
  bad = dp::safetensors::read(path("good.safetensors"));
  const std::int64_t negative = -2;
  bad.tensors.at("layer1.1.num_batches_tracked") = dp::safetensors::make_i64({}, &negative);
  dp::safetensors::write(path("bad_count.safetensors"), bad);
  expect_nothing_written(data + " --eval-only --init " + path("bad_count.safetensors"), 2,
                         "'layer1.1.num_batches_tracked' holds -2: an invalid state");
}

// An optimizer buffer must have its parameter's shape, not only its element count: a transposed
// momentum would add each value to another weight.
TEST_F(TrainTest, OptimizerBuffersOfAnotherShapeAreRefused) {
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 ";
  ASSERT_EQ(run(base + "--save " + path("good.safetensors")).code, 0);
  dp::safetensors::File transposed = dp::safetensors::read(path("good.safetensors"));
  transposed.tensors.at("optimizer.momentum.fc1.weight").shape = {784, 16};
  dp::safetensors::write(path("transposed.safetensors"), transposed);
  expect_nothing_written(base + "--resume " + path("transposed.safetensors") + " --save " + path("good.safetensors"), 2,
                         "momentum buffer 'optimizer.momentum.fc1.weight' has shape [784, 16], its parameter "
                         "'fc1.weight' has shape [16, 784]");
}

// Runs saving to one target at once each write their own temporary file: every run exits 0, the
// last to rename wins, and the target is a whole checkpoint with no temporary file left.
TEST_F(TrainTest, ConcurrentSavesToOneTargetAllSucceed) {
  const std::string target = path("same.safetensors");
  std::string command;
  for (int i = 0; i < 4; ++i)
    command += fmt::format(
        "({} --backend sim --hidden 1024 --synthetic 16 --batch-size 8 --steps 1 --save {} "
        ">/dev/null 2>&1; echo \"run {} exit $?\") & ",
        DP_TRAIN_BIN, target, i);
  const Result r = dp::test::run_command(command + "wait");
  for (int i = 0; i < 4; ++i) EXPECT_NE(r.output.find(fmt::format("run {} exit 0", i)), std::string::npos) << r.output;
  const dp::safetensors::File saved = dp::safetensors::read(target);
  EXPECT_EQ(saved.tensors.at("fc1.weight").shape, (std::vector<std::int64_t>{1024, 784}));
  EXPECT_EQ(saved.metadata.at("dp.step"), "1");
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_NE(entry.path().filename().string().front(), '.') << "temporary file left behind: " << entry.path();
}

TEST_F(TrainTest, SpecialFilesAreNotReadAsData) {
  // A link to /dev/zero would read forever, a FIFO block forever, /proc/self/mem fail mid-read:
  // each is refused naming the file (exit 2).
  write_idx("zero", 10);
  fs::remove(dir_ / "zero" / "train-images-idx3-ubyte");
  fs::create_symlink("/dev/zero", dir_ / "zero" / "train-images-idx3-ubyte");
  expect_refused("--backend sim --batch-size 4 --steps 1 --data " + path("zero"),
                 "train-images-idx3-ubyte: not a regular file");
  write_idx("fifo", 10);
  fs::remove(dir_ / "fifo" / "train-labels-idx1-ubyte");
  ASSERT_EQ(::mkfifo((dir_ / "fifo" / "train-labels-idx1-ubyte").c_str(), 0644), 0);
  expect_refused("--backend sim --batch-size 4 --steps 1 --data " + path("fifo"),
                 "train-labels-idx1-ubyte: not a regular file");
  // A directory in the image file's place is not read as one (exit 2, naming it).
  write_idx("dir", 10);
  fs::remove(dir_ / "dir" / "train-images-idx3-ubyte");
  fs::create_directory(dir_ / "dir" / "train-images-idx3-ubyte");
  expect_refused("--backend sim --batch-size 4 --steps 1 --data " + path("dir"),
                 "train-images-idx3-ubyte: not a regular file");
  write_idx("mem", 10);
  fs::remove(dir_ / "mem" / "train-images-idx3-ubyte");
  fs::create_symlink("/proc/self/mem", dir_ / "mem" / "train-images-idx3-ubyte");
  expect_refused("--backend sim --batch-size 4 --steps 1 --data " + path("mem"), "train-images-idx3-ubyte");
  // A momentum buffer of the wrong dtype on --resume names the file and the tensor.
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --steps 1 ";
  ASSERT_EQ(run(base + "--save " + path("good.safetensors")).code, 0);
  dp::safetensors::File file = dp::safetensors::read(path("good.safetensors"));
  file.tensors["optimizer.momentum.fc1.bias"].dtype = "I32";
  dp::safetensors::write(path("i32.safetensors"), file);
  expect_refused(base + "--resume " + path("i32.safetensors"), "momentum buffer 'optimizer.momentum.fc1.bias'");
}

// The collectives' timeout comes from the environment: a value that is no positive number of
// seconds is refused before anything runs, naming the variable.
TEST_F(TrainTest, ABadCollectiveTimeoutIsRefused) {
  for (const char* value : {"abc", "0", "-5", "10s"}) {
    const Result r = dp::test::run_command(
        fmt::format("DP_TIMEOUT_S={} {} --backend sim --synthetic 16 --steps 1", value, DP_TRAIN_BIN));
    EXPECT_EQ(r.code, 2) << value << "\n" << r.output;
    EXPECT_NE(r.output.find(fmt::format("DP_TIMEOUT_S='{}'", value)), std::string::npos) << r.output;
  }
}

// Shards are bounded (dp::tools::kMaxShards: a loader thread each): a V or a V x K beyond it, from
// the command line or from a checkpoint's settings on --resume, is refused before any work, exit 2,
// the files as they were.
TEST_F(TrainTest, ShardsBeyondTheBoundAreRefusedAtOnce) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 --steps 2 ";
  expect_refused(base + "--shards 1000000", "--shards: '1000000' is out of range (at most 1024)");
  expect_refused(base + "--shards 64 --accumulate 32", "--shards 64 x --accumulate 32: 2048 shards per step");
  ASSERT_EQ(run(base + "--steps 1 --shards 2 --save " + path("two.safetensors")).code, 0);
  auto file = dp::safetensors::read(path("two.safetensors"));
  ASSERT_EQ(file.metadata.at("dp.shards"), "2");
  file.metadata["dp.shards"] = "1000000";
  dp::safetensors::write(path("forged.safetensors"), file);
  const std::string forged = read_file(path("forged.safetensors"));
  const Result r = run(base + "--resume " + path("forged.safetensors") + " --save " + path("forged.safetensors"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("metadata 'dp.shards' = '1000000'"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(path("forged.safetensors")), forged) << "the checkpoint was touched";
}

TEST_F(TrainTest, OptionValuesAreCheckedBeforeAnyWork) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 --steps 1 ";
  expect_refused(base + "--lr nan", "--lr: 'nan' is not a finite number >= 0");
  expect_refused(base + "--lr 1e39", "--lr: '1e39' overflows a float");
  expect_refused(base + "--lr -1", "--lr: '-1' is not a finite number >= 0");
  expect_refused(base + "--momentum nan", "--momentum: 'nan'");
  expect_refused(base + "--clip-grad-norm -1", "--clip-grad-norm: '-1' is not a finite number >= 0");
  expect_refused(base + "--clip-grad-norm inf", "--clip-grad-norm: 'inf' is not a finite number >= 0");
  expect_refused(base + "--accumulate 0", "--accumulate");
  expect_refused(base + "--eval-every 0", "--eval-every");
  expect_refused(base + "--eval-every 2", "--eval-every evaluates on the test set, and this run has none");
  expect_refused(base + "--accumulate 3", "--accumulate 3: an epoch of 2 batch(es) of 8 per rank holds no step");
  expect_refused(base + "--save-best " + path("existing.safetensors"), "--save and --save-best name the same file");
  // A file of --save's periodic series: --save-every would overwrite it and --keep delete it.
  expect_refused(base + "--save-every 1 --keep 1 --save-best " + path("existing.step3.safetensors"),
                 "is a file of --save " + path("existing.safetensors") + "'s periodic series");
  expect_refused(base + "--save-best " + path("existing.step12.safetensors"), "'s periodic series");
  // A flag of another model's argument (the flag table's model_arg) is refused, not ignored.
  expect_refused(base + "--model convnet --heads 4", "--heads applies to --model gpt, not --model convnet");
  expect_refused(base + "--model convnet --hidden 8", "--hidden applies to --model mlp, not --model convnet");
  expect_refused(base + "--zero 3", "--zero");
  expect_refused(base + "--mode ddp --devices 2 --bucket-cap-mb 0", "--bucket-cap-mb: '0' is not a finite number > 0");
  expect_refused(base + "--mode dp --devices 2 --zero 1", "--zero applies to --mode ddp");
  expect_refused(base + "--mode ddp --devices 5 --shards 12", "12 shards cannot be spread evenly over 5 device(s)");
  expect_refused(base + "--model convnet --mode ddp --devices 2 --shards 4 --sync-bn",
                 "sync_batchnorm with 4 shards needs a device per shard, not 2");
  expect_refused(base + "--weight-decay nan", "--weight-decay: 'nan'");
  expect_refused(base + "--nesterov --momentum 0", "nesterov momentum requires a momentum > 0");
  expect_refused(base + "--devices 0x10", "--devices: '0x10' is not a non-negative decimal integer");
  expect_refused(base + "--seed -1", "--seed: '-1' is not a non-negative decimal integer");
  expect_refused(base + "--init ''", "--init: empty value");
  expect_refused(base + "--resume ''", "--resume: empty value");
  expect_refused(base + "--metrics-json ''", "--metrics-json: empty value");
  expect_refused("--backend sim --steps 1 --data ''", "--data: empty value");
  const Result empty_save = run(base + "--save ''");
  EXPECT_EQ(empty_save.code, 2) << empty_save.output;
  EXPECT_NE(empty_save.output.find("--save: empty value"), std::string::npos) << empty_save.output;
  // Integers past their type are refused with the bound, never capped to it.
  const std::string no_steps = "--backend sim --synthetic 16 --batch-size 8 ";
  expect_refused(base + "--seed 18446744073709551616",
                 "--seed: '18446744073709551616' is out of range (at most 18446744073709551615)");
  expect_refused(no_steps + "--steps 99999999999999999999999",
                 "--steps: '99999999999999999999999' is out of range (at most 9223372036854775807)");
  expect_refused(base + "--warmup-steps 9223372036854775808",
                 "--warmup-steps: '9223372036854775808' is out of range (at most 9223372036854775807)");
  expect_refused(base + "--schedule cosine --t-max 99999999999999999999999",
                 "--t-max: '99999999999999999999999' is out of range (at most 9223372036854775807)");
  expect_refused(no_steps + "--epochs 2147483648", "--epochs: '2147483648' is out of range (at most 2147483647)");
  expect_refused("--backend sim --synthetic 16 --steps 1 --batch-size 2147483648",
                 "--batch-size: '2147483648' is out of range (at most 2147483647)");
  expect_refused(base + "--step-size 0x10", "--step-size: '0x10' is not a non-negative decimal integer");
  // Sizes that cannot fit are refused with the figure, before anything is allocated.
  expect_refused("--backend sim --synthetic 67108864 --steps 1", "GiB of host memory");
  expect_refused("--backend sim --mode ddp --devices 2 --batch-size 1073741824 --synthetic 16 --steps 1",
                 "a global batch of 2147483648 samples");
  expect_refused("--backend sim --hidden 100000,100000,100000 --synthetic 16 --steps 1", "GiB of host memory");
  // Any uint64 seed trains and resumes.
  ASSERT_EQ(run(base + "--seed 18446744073709551615 --save " + path("seed.safetensors")).code, 0);
  const Result resumed = run(no_steps + "--steps 2 --resume " + path("seed.safetensors"));
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("1 step(s) from step 1"), std::string::npos) << resumed.output;
}

TEST_F(TrainTest, SaveTargetsMustBeRegularFilesInWritableDirectories) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 --steps 1 --save ";
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0644), 0);
  Result r = run(base + path("fifo"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is not a regular file"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_fifo(path("fifo"))) << "the FIFO is still a FIFO";
  { std::ofstream(path("real")) << "precious"; }
  fs::create_symlink(path("real"), path("link"));
  r = run(base + path("link"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(fs::is_symlink(path("link")));
  r = run(base + path("no/such/dir/x.safetensors"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
  // Refused before step 1, not after the training it would throw away.
  EXPECT_EQ(r.output.find("step(s) in"), std::string::npos) << r.output;
  // A device node is refused and left a device node (as root the rename would replace /dev/null),
  // and no temporary file is made beside it.
  struct stat before {};
  ASSERT_EQ(::stat("/dev/null", &before), 0);
  r = run(base + "/dev/null");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("/dev/null: exists and is not a regular file"), std::string::npos) << r.output;
  struct stat after {};
  ASSERT_EQ(::stat("/dev/null", &after), 0);
  EXPECT_TRUE(S_ISCHR(after.st_mode));
  EXPECT_EQ(after.st_rdev, before.st_rdev);
  EXPECT_EQ(after.st_ino, before.st_ino);
  for (const auto& entry : fs::directory_iterator("/dev"))
    EXPECT_NE(entry.path().filename().string().rfind(dp::atomic_temp_prefix("/dev/null"), 0), 0u) << entry.path();
  // /proc and /sys pass access(W_OK) for root, but no file can be created there: refused before step 1.
  for (const std::string target : {"/proc/x.safetensors", "/sys/x.safetensors"}) {
    r = run(base + target);
    EXPECT_EQ(r.code, 2) << target << "\n" << r.output;
    EXPECT_NE(r.output.find("--save " + target + ": "), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step(s) in"), std::string::npos) << r.output;
  }
  // The longest file name (255 characters) saves: the temporary name is short whatever the target's.
  const std::string longest = path(std::string(255 - std::strlen(".safetensors"), 'n') + ".safetensors");
  r = run(base + longest);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(dp::safetensors::read(longest).tensors.count("fc1.weight"), 1u);
  r = run(base + path(std::string(256, 'n')));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("file name longer than 255 characters"), std::string::npos) << r.output;
}

// The steps are generated as they are trained, not planned up front: the largest --steps and
// --epochs start at once, in little memory, and would train on (so the test stops them).
TEST_F(TrainTest, HugeStepAndEpochCountsStartAtOnceInLittleMemory) {
  const std::string base = "--backend sim --hidden 16 --synthetic 16 --batch-size 8 --log-every 1 ";
  for (const auto& [flag, steps] :
       {std::pair<std::string, std::string>{"--steps 9223372036854775807", "9223372036854775807 step(s)"},
        {"--epochs 2147483647", "4294967294 step(s)"}}) {
    // 400 steps (200 epochs of 2), then killed: nothing grew with the run's length or its steps.
    const Started started = start_then_kill(base + flag, "epoch 200 |", 4);
    EXPECT_TRUE(started.seen) << flag << ": 200 epochs did not finish within 4 s:\n" << started.output;
    EXPECT_NE(started.output.find(steps), std::string::npos) << started.output;
    EXPECT_NE(started.output.find("step      1 epoch   1 loss"), std::string::npos) << started.output;
    EXPECT_LT(started.max_rss_kib, 256L * 1024) << flag << ": peak resident memory " << started.max_rss_kib << " KiB";
  }
  // Resumed at step 1, --steps counts from the start of training: the largest ends at the largest
  // step, never past it.
  ASSERT_EQ(run(base + "--steps 1 --save " + path("one.safetensors")).code, 0);
  const Started resumed =
      start_then_kill(base + "--steps 9223372036854775807 --resume " + path("one.safetensors"), "step      3 ", 4);
  EXPECT_TRUE(resumed.seen) << resumed.output;
  EXPECT_NE(resumed.output.find("9223372036854775806 step(s) from step 1"), std::string::npos) << resumed.output;
}

}  // namespace

namespace {

TEST_F(TrainTest, SchedulesFollowTheWarmUp) {
  const std::string base = "--backend sim --synthetic 64 --batch-size 8 --lr 0.1 --log-every 1 ";
  const Result step = run(base + "--steps 7 --schedule step --step-size 3 --gamma 0.5");
  ASSERT_EQ(step.code, 0) << step.output;
  const std::vector<double> want_step = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025};
  const auto got_step = learning_rates(step.output);
  ASSERT_EQ(got_step.size(), want_step.size()) << step.output;
  for (std::size_t i = 0; i < want_step.size(); ++i) EXPECT_NEAR(got_step[i], want_step[i], 1e-6) << i;
  // Two warm-up steps, then cosine over the remaining 8 steps of the run (T_max = 10 - 2).
  const Result cosine = run(base + "--steps 10 --schedule cosine --warmup-steps 2");
  ASSERT_EQ(cosine.code, 0) << cosine.output;
  const auto got = learning_rates(cosine.output);
  ASSERT_EQ(got.size(), 10u) << cosine.output;
  EXPECT_NEAR(got[0], 0.05, 1e-6);
  EXPECT_NEAR(got[1], 0.075, 1e-6);
  const dp::LrSchedule annealing = dp::LrSchedule::cosine(8);
  for (std::size_t s = 2; s < 10; ++s)
    EXPECT_NEAR(got[s], static_cast<float>(annealing.lr(0.1, static_cast<std::int64_t>(s - 2))), 1e-6) << s;
  expect_refused(base + "--steps 1 --schedule step --step-size 0", "StepLR: step_size must be >= 1");
}

}  // namespace

namespace {

// Every floating-point flag is checked as the float the engine computes with: NaN passes every
// comparison a range makes, and 1e39 is a finite double but inf as a float. Each is refused naming
// the flag, before anything is written (a NaN dropout once trained as 0 and was saved as nan).
TEST_F(TrainTest, FloatFlagsAreFiniteFloatsInTheirRange) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 --steps 1 ";
  for (const std::string value : {"nan", "inf", "-0.1", "1.5", "1e39"})
    expect_refused(base + "--dropout " + value, "--dropout: '" + value + "' is not a finite number in [0, 1]");
  expect_refused(base + "--label-smoothing nan", "--label-smoothing: 'nan' is not a finite number in [0, 1]");
  expect_refused(base + "--label-smoothing 1.5", "--label-smoothing: '1.5' is not a finite number in [0, 1]");
  for (const std::string flag : {"--lr", "--momentum", "--weight-decay"})
    expect_refused(base + flag + " 1e39", flag + ": '1e39' overflows a float");
  expect_refused(base + "--schedule cosine --eta-min 1e39", "--eta-min: '1e39' overflows a float");
  expect_refused(base + "--schedule step --gamma 1e39", "--gamma: '1e39' overflows a float");
  expect_refused(base + "--schedule step --gamma 0", "--gamma: '0' is not a finite number > 0");
  expect_refused(base + "--schedule step --gamma nan", "--gamma: 'nan' is not a finite number > 0");
  const std::string adamw = base + "--optimizer adamw ";
  expect_refused(adamw + "--eps 1e39", "--eps: '1e39' overflows a float");
  expect_refused(adamw + "--beta1 nan", "--beta1: 'nan' is not a finite number in [0, 1)");
  expect_refused(adamw + "--beta2 1", "--beta2: '1' is not a finite number in [0, 1)");
  // The ends of the ranges still train (torch's Dropout(1) zeroes everything, as here).
  EXPECT_EQ(run(base + "--dropout 1 --label-smoothing 1").code, 0);
}

// A learning rate that only becomes non-finite once scaled or scheduled is refused as well (exit 2,
// nothing saved), rather than training with inf.
TEST_F(TrainTest, LearningRatesPastTheLargestFloatAreRefused) {
  const std::string base = "--backend sim --synthetic 16 --batch-size 8 ";
  // 0.01, 1e28, then 1e58: past the largest float at the run's third step.
  expect_refused(base + "--steps 3 --schedule step --gamma 1e30",
                 "--schedule step: the learning rate of step 3 would be 1e+58, past the largest float");
  expect_refused(base + "--steps 1 --lr 2e38 --scale-lr --mode dp --device-ids 0,1",
                 "--lr 2e+38 x 2 device(s) (--scale-lr): the scaled learning rate 4e+38 overflows a float");
  expect_refused(base + "--steps 1 --lr 2e38 --scale-lr --mode ddp --devices 2", "the scaled learning rate 4e+38");
  // A growing schedule that stays within float trains.
  const Result growing = run(base + "--steps 3 --schedule step --gamma 1e10 --lr 1e-30 --log-every 1");
  EXPECT_EQ(growing.code, 0) << growing.output;
}

// Standard output is line-buffered: each progress line reaches a file as it is printed, so a run
// killed without a chance to flush (SIGKILL) keeps every line it logged.
TEST_F(TrainTest, ProgressLinesReachAFileBeforeAKill) {
  const Started started =
      start_then_kill("--backend sim --hidden 16 --synthetic 2048 --batch-size 8 --steps 100000000 --log-every 1",
                      "\nstep ", 60, path("stdout.txt"));
  ASSERT_TRUE(started.seen) << "no step line reached the file:\n" << started.output;
  EXPECT_TRUE(std::regex_search(started.output,
                                std::regex(R"(\nstep +1 epoch +1 loss [0-9.]+ lr [0-9.e+-]+ samples/s [0-9.]+\n)")))
      << started.output;
  EXPECT_EQ(started.output.back(), '\n') << "a line cut by the kill: the output was block-buffered";
}

// A bare --data name that is no installed data set gets a hint that works: Debian packages
// Fashion-MNIST (dataset-fashion-mnist), not MNIST.
TEST_F(TrainTest, AMissingDataSetNameGetsAHintThatWorks) {
  if (fs::exists("/usr/share/datasets/mnist") || fs::exists("mnist")) GTEST_SKIP() << "an MNIST is installed";
  const std::string base = "--backend sim --batch-size 4 --steps 1 --data mnist";
  expect_refused(base, "download the four IDX files");
  expect_refused(base,
                 "into a directory and pass --data DIR, or use --data fashion-mnist after apt-get install "
                 "dataset-fashion-mnist");
  const Result r = run(base);
  EXPECT_EQ(r.output.find("dataset-mnist"), std::string::npos) << "no such Debian package:\n" << r.output;
}

// zlib's gzread ignores whatever follows a gzip stream; dp refuses it (exit 2, naming the file).
TEST_F(TrainTest, TrailingDataAfterAGzipStreamIsRefused) {
  write_idx("gz", 16);
  gzip_file(dir_ / "gz" / "train-images-idx3-ubyte");
  const std::string args = "--backend sim --batch-size 8 --steps 1 --data " + path("gz");
  ASSERT_EQ(run(args).code, 0);
  std::ofstream(dir_ / "gz" / "train-images-idx3-ubyte.gz", std::ios::binary | std::ios::app) << std::string(70, 'x');
  expect_refused(args, "train-images-idx3-ubyte.gz: trailing data after the end of the gzip stream");
}

// A checkpoint must say one thing: a header naming a key twice (readers keep different ones), a
// dp.hidden tag its tensors contradict or a model dp_train does not know is refused by --init,
// --resume and --eval-only alike.
TEST_F(TrainTest, SelfContradictoryCheckpointsAreRefused) {
  write_idx("data", 16);
  write_idx("data", 8, 28, 28, 0x803, -1, 0, "t10k");
  const std::string base = "--backend sim --hidden 16 --batch-size 8 --data " + path("data");
  ASSERT_EQ(run(base + " --steps 1 --save " + path("good.safetensors")).code, 0);
  // The header as written with a metadata key repeated (another value), its length prefix updated.
  const std::string bytes = read_file(path("good.safetensors"));
  std::uint64_t length = 0;
  std::memcpy(&length, bytes.data(), sizeof(length));
  const std::string data = bytes.substr(8 + length);
  std::string header = bytes.substr(8, length);
  const std::string tag = R"("dp.dropout":"0")";
  ASSERT_NE(header.find(tag), std::string::npos) << header;
  header.replace(header.find(tag), tag.size(), tag + R"(,"dp.dropout":"0.5")");
  header.append((8 - header.size() % 8) % 8, ' ');
  length = header.size();
  std::ofstream(path("twice.safetensors"), std::ios::binary)
      << std::string(reinterpret_cast<const char*>(&length), sizeof(length)) << header << data;
  // A tag the tensors contradict: 64 hidden units where fc1.weight has 16 rows, or a layer too many.
  dp::safetensors::File file = dp::safetensors::read(path("good.safetensors"));
  file.metadata["dp.hidden"] = "64";
  dp::safetensors::write(path("hidden64.safetensors"), file);
  file.metadata["dp.hidden"] = "16,16";
  dp::safetensors::write(path("hidden16x2.safetensors"), file);
  file.metadata["dp.hidden"] = "16";
  file.metadata["dp.model"] = "nosuch";
  dp::safetensors::write(path("nosuch.safetensors"), file);
  const std::pair<std::string, std::string> cases[] = {
      {"nosuch.safetensors",
       "metadata 'dp.model' = 'nosuch': unknown value 'nosuch' (expected mlp, convnet, resnet8, resnet18, resnet34 or "
       "gpt)"},
      {"twice.safetensors", "header names 'dp.dropout' twice in one object"},
      {"hidden64.safetensors",
       "metadata 'dp.hidden' = '64' contradicts the tensors: fc1.weight has shape [16, 784] (expected 64 rows)"},
      {"hidden16x2.safetensors",
       "metadata 'dp.hidden' = '16,16' contradicts the tensors: fc2.weight has shape [10, 16]"}};
  for (const auto& [name, message] : cases) {
    expect_nothing_written(base + " --steps 1 --init " + path(name) + " --save " + path("good.safetensors"), 2,
                           message);
    expect_nothing_written(base + " --steps 1 --resume " + path(name) + " --save " + path("good.safetensors"), 2,
                           message);
    expect_nothing_written(base + " --eval-only --init " + path(name) + " --predictions " + path("p.txt"), 2, message);
  }
}

// examples/custom_model: its arguments are checked before any work (exit 2, nothing written), and
// a run of one step, too short to show a trend, succeeds.
class CustomModelTest : public TrainTest {
 protected:
  void expect_custom_model_refused(const std::string& args, const std::string& message) {
    expect_nothing_written(args, 2, message, DP_CUSTOM_MODEL_BIN);
  }
};

TEST_F(CustomModelTest, ArgumentsAreCheckedAndOneStepWorks) {
  { std::ofstream(path("cm.safetensors")) << "previous checkpoint"; }
  expect_nothing_written("--help", 0, "usage: custom_model [OUTPUT.safetensors] [STEPS]", DP_CUSTOM_MODEL_BIN);
  expect_custom_model_refused(path("cm.safetensors") + " 3x", "STEPS '3x' is not a decimal integer in [1, 1000000]");
  expect_custom_model_refused(path("cm.safetensors") + " 1000001", "STEPS '1000001' is not a decimal integer");
  expect_custom_model_refused(path("cm.safetensors") + " 0", "STEPS '0' is not a decimal integer");
  expect_custom_model_refused(path("cm.safetensors") + " -- -5", "unknown option '--'");
  expect_custom_model_refused(path("cm.safetensors") + " 1 extra", "too many arguments");
  expect_custom_model_refused(path("no/such/dir/cm.safetensors") + " 1", "does not exist");
  EXPECT_EQ(read_file(path("cm.safetensors")), "previous checkpoint");
  const Result one = dp::test::run_command(std::string(DP_CUSTOM_MODEL_BIN) + " " + path("cm.safetensors") + " 1");
  EXPECT_EQ(one.code, 0) << one.output;
  EXPECT_NE(one.output.find("one step: too few to tell whether the loss falls"), std::string::npos) << one.output;
  EXPECT_EQ(dp::safetensors::read(path("cm.safetensors")).tensors.count("head.3.weight"), 1u);
}

}  // namespace

// One exit code per cause, for dp_train and dp_bench alike: a failure on one device of several is
// judged by its cause (an out-of-memory on device 1 of a DDP run is 2, as on one device).
TEST(ExitCodes, EachCauseHasOneCodeWhereverItHappens) {
  using dp::tools::judge;
  const auto on_device = [](std::exception_ptr cause) {
    return std::make_exception_ptr(dp::WorkerError(1, "device 1: failed", std::move(cause), 2));
  };
  const auto oom = std::make_exception_ptr(dp::OutOfMemory(1, 100, 0, 50));
  const auto diverged = std::make_exception_ptr(dp::NonFiniteError("loss is nan"));
  EXPECT_EQ(judge(oom).code, 2);
  EXPECT_EQ(judge(on_device(oom)).code, 2);
  EXPECT_EQ(judge(std::make_exception_ptr(std::bad_alloc())).code, 2);
  EXPECT_EQ(judge(on_device(std::make_exception_ptr(std::bad_alloc()))).code, 2);
  EXPECT_EQ(judge(std::make_exception_ptr(dp::tools::UsageError("bad flag"))).code, 2);
  EXPECT_EQ(judge(diverged).code, 3);
  EXPECT_EQ(judge(on_device(diverged)).code, 3);
  EXPECT_EQ(judge(std::make_exception_ptr(std::runtime_error("bug"))).code, 1);
  EXPECT_EQ(judge(on_device(nullptr)).code, 1);
  // The library's own decider, which custom_model (an embedding program) uses.
  EXPECT_EQ(dp::exit_code(std::make_exception_ptr(dp::InvalidArgument("bad shape"))), 2);
  // A bad input file, also when a loader thread finds it mid-run.
  EXPECT_EQ(judge(std::make_exception_ptr(dp::DataError("a.png: truncated PNG"))).code, 2);
  // A collective aborted because of another failure is a consequence, never the cause to report.
  EXPECT_TRUE(dp::tools::is_consequence(on_device(std::make_exception_ptr(dp::CollectiveAborted("aborted")))));
  EXPECT_FALSE(dp::tools::is_consequence(on_device(diverged)));
  EXPECT_EQ(dp::exit_code(on_device(oom)), 2);
  EXPECT_EQ(dp::exit_code(on_device(diverged)), 3);
  EXPECT_EQ(dp::exit_code(std::make_exception_ptr(dp::Error("a broken invariant"))), 1);
}

// A process limit (ulimit -v) too small for the run: refused before anything runs, exit 2, naming
// the limit; and the process ends (OpenBLAS's pool threads, retrying a buffer they cannot map, are
// not joined at exit). Before, the run printed std::bad_alloc and then spun at 100% CPU.
TEST_F(TrainTest, AnAddressSpaceLimitTooSmallIsRefusedAndTheProcessEnds) {
  // 1 GB: enough to load the program with the CUDA libraries, too little for these runs. Their
  // outputs name files that exist: refused, they leave them as they were.
  const std::string guard = path("existing.out");
  for (const std::string& tool :
       {std::string(DP_TRAIN_BIN) + " --model mlp --synthetic 1500000 --steps 1 --save " + guard,
        std::string(DP_BENCH_BIN) + " --models mlp --modes single --devices 8 --steps 1 --json " + guard}) {
    { std::ofstream(guard) << "previous output"; }
    const auto r = dp::test::run_command("ulimit -v 1000000 && timeout 60 " + tool + " --backend sim");
    EXPECT_EQ(r.code, 2) << tool << "\n" << r.output;
    EXPECT_NE(r.output.find("of address space"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(ulimit -v)"), std::string::npos) << r.output;
    EXPECT_EQ(read_file(guard), "previous output") << tool;
  }
}

// A checkpoint describes its run: --eval-only and --init take the model, its hidden sizes and its
// input normalisation from it unless given, and --resume also the optimizer, its hyper-parameters
// and the schedule with its T_max, so a resumed cosine schedule continues its curve. A given flag
// that contradicts it is refused where the model could not hold the checkpoint, else noted (the
// given value wins, as PyTorch users expect of --lr).
TEST_F(TrainTest, ACheckpointDescribesItsRun) {
  write_idx("data", 40);
  write_idx("data", 12, 28, 28, 0x803, -1, 0, "t10k");
  const std::string data = " --backend sim --batch-size 8 --data " + path("data");
  ASSERT_EQ(
      run("--model mlp --hidden 24 --normalize 0.3,0.4 --steps 4 --lr 0.05 --save " + path("mlp.safetensors") + data)
          .code,
      0);
  const std::regex accuracy(R"(test loss [0-9.]+, test accuracy [0-9.]+%)");
  const auto evaluated = [&](const std::string& flags) {
    const Result r = run("--eval-only --init " + path("mlp.safetensors") + flags + data);
    EXPECT_EQ(r.code, 0) << r.output;
    std::smatch m;
    return std::regex_search(r.output, m, accuracy) ? m.str() + "\n" + r.output : "no accuracy in: " + r.output;
  };
  const std::string full = evaluated(" --model mlp --hidden 24 --normalize 0.3,0.4");
  const std::string bare = evaluated("");
  EXPECT_EQ(bare.substr(0, bare.find('\n')), full.substr(0, full.find('\n'))) << bare;
  EXPECT_NE(bare.find("from the checkpoint"), std::string::npos) << bare;
  EXPECT_NE(bare.find("--hidden 24"), std::string::npos) << bare;
  const std::string other = evaluated(" --normalize 0.5,0.5");  // given: wins, with a note
  EXPECT_NE(other.find("was saved with --normalize 0.3,0.4; continuing with 0.5,0.5"), std::string::npos) << other;
  expect_refused("--eval-only --init " + path("mlp.safetensors") + " --model convnet" + data,
                 "was saved with --model mlp");
  expect_refused("--eval-only --init " + path("mlp.safetensors") + " --hidden 32" + data, "was saved with --hidden 24");

  // A resumed cosine schedule continues the checkpoint's curve (its T_max, 10, not the resumed run's
  // own length), and the optimizer's settings come back without being repeated.
  const std::string run_flags = "--model convnet --optimizer adamw --lr 0.003 --schedule cosine --t-max 10 --seed 4";
  ASSERT_EQ(run(run_flags + " --steps 6 --save " + path("straight.safetensors") + data).code, 0);
  ASSERT_EQ(run(run_flags + " --steps 3 --save " + path("half.safetensors") + data).code, 0);
  const Result resumed =
      run("--steps 6 --resume " + path("half.safetensors") + " --save " + path("resumed.safetensors") + data);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  for (const char* taken : {"--model convnet", "--optimizer adamw", "--lr 0.003", "--schedule cosine", "--t-max 10"})
    EXPECT_NE(resumed.output.find(taken), std::string::npos) << taken << " in:\n" << resumed.output;
  const auto a = dp::safetensors::read(path("straight.safetensors"));
  const auto b = dp::safetensors::read(path("resumed.safetensors"));
  for (const auto& name : a.order) EXPECT_EQ(a.at(name).data, b.at(name).data) << name << " differs after resume";
  EXPECT_EQ(b.metadata.at("dp.t_max"), "10");
  const Result faster = run("--steps 4 --lr 0.01 --resume " + path("half.safetensors") + data);
  EXPECT_EQ(faster.code, 0) << faster.output;
  EXPECT_NE(faster.output.find("was saved with --lr 0.003; continuing with 0.01"), std::string::npos) << faster.output;
  expect_refused("--steps 1 --optimizer sgd --resume " + path("half.safetensors") + data,
                 "was saved with --optimizer adamw");
}

// Habits from argparse and torch: the last of a repeated flag wins (`$ARGS --lr 0.1`), --help shows
// every default, and --limit-train / --limit-test take the first N samples of a split.
TEST_F(TrainTest, RepeatedFlagsDefaultsAndSubsets) {
  const std::string base = "--backend sim --hidden 16 --synthetic 32 --batch-size 8 --steps 2 --seed 2";
  ASSERT_EQ(run(base + " --lr 0.5 --save " + path("a.safetensors") + " --lr 0.02").code, 0);
  ASSERT_EQ(run(base + " --lr 0.02 --save " + path("b.safetensors")).code, 0);
  EXPECT_EQ(read_file(path("a.safetensors")), read_file(path("b.safetensors"))) << "the last --lr won";
  const Result help = run("--help");
  EXPECT_EQ(help.code, 0);
  for (const char* shown : {"(default 0.9; torch: SGD(momentum=X))", "torch.optim.SGD's default is 0",
                            "(default 64; torch: DataLoader(batch_size=N)", "--limit-train", "lr *= world_size"})
    EXPECT_NE(help.output.find(shown), std::string::npos) << shown;
  write_idx("data", 40);
  write_idx("data", 12, 28, 28, 0x803, -1, 0, "t10k");
  const Result subset = run("--backend sim --model mlp --batch-size 8 --epochs 1 --limit-train 16 --limit-test 5 " +
                            std::string("--metrics-json ") + path("m.jsonl") + " --data " + path("data"));
  ASSERT_EQ(subset.code, 0) << subset.output;
  EXPECT_NE(subset.output.find("16 samples"), std::string::npos) << subset.output;
  EXPECT_EQ(json_lines(path("m.jsonl")).back().at("test_samples"), 5);
  EXPECT_NE(subset.output.find("2 step(s)"), std::string::npos) << subset.output;
}

// --help is one line per flag: what it does, its default (--lr's and --weight-decay's those of the
// optimizer chosen) and torch's equivalent, without CLI11's type and validator names.
TEST_F(TrainTest, HelpIsOneLinePerFlag) {
  const Result help = run("--help");
  ASSERT_EQ(help.code, 0) << help.output;
  for (const char* noise : {"UINT", "INT:", "DECIMAL", "TEXT", "FLOAT", "in [1 - ", "Excludes:", "Needs:"})
    EXPECT_EQ(help.output.find(noise), std::string::npos) << noise << " in:\n" << help.output;
  std::istringstream lines(help.output);
  int flags = 0;
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("  --")) {
      EXPECT_FALSE(line.starts_with("   ")) << "a flag's help continues on a line of its own: " << line;
      continue;
    }
    ++flags;
    EXPECT_NE(line.find_first_not_of(' ', line.find(' ', 4)), std::string::npos) << "no description: " << line;
  }
  EXPECT_GE(flags, 60);
  for (const char* shown : {"--batch-size N", "(default 64;", "--lr X", "the learning rate (default 0.01;",
                            "weight decay (adamw: decoupled) (default 0;", "resnet34 ", "--grad-reduce fp32|bf16"})
    EXPECT_NE(help.output.find(shown), std::string::npos) << shown;
  const Result adamw = run("--optimizer adamw --help");
  ASSERT_EQ(adamw.code, 0) << adamw.output;
  EXPECT_NE(adamw.output.find("the learning rate (default 0.001;"), std::string::npos) << adamw.output;
  EXPECT_NE(adamw.output.find("weight decay (adamw: decoupled) (default 0.01;"), std::string::npos) << adamw.output;
}

// A misspelt or unknown flag is refused (exit 2, nothing written) with the flag it most likely
// meant: torch's example scripts' spellings, '_' for '-', a prefix, a typo.
TEST_F(TrainTest, UnknownFlagsSuggestTheirNearestFlag) {
  const std::string base = "--backend sim --synthetic 16 --steps 1 ";
  expect_refused(base + "-b 8", "unknown flag -b (did you mean --batch-size?)");
  expect_refused(base + "--batch_size 8", "unknown flag --batch_size (did you mean --batch-size?)");
  expect_refused(base + "--batch=8", "unknown flag --batch (did you mean --batch-size?)");
  expect_refused(base + "--learning-rate 0.1", "unknown flag --learning-rate (did you mean --lr?)");
  expect_refused(base + "--wd 0.1", "unknown flag --wd (did you mean --weight-decay?)");
  expect_refused(base + "--optimiser adamw", "unknown flag --optimiser (did you mean --optimizer?)");
  expect_refused(base + "--frobnicate", "unknown flag --frobnicate (see --help)");
  expect_refused(base + "stray", "unexpected argument 'stray'");
  // An unknown model is refused naming the known ones, on the command line and in a checkpoint.
  expect_refused(base + "--model nosuch",
                 "--model: unknown value 'nosuch' (expected mlp, convnet, resnet8, resnet18, resnet34 or gpt)");
}

// --freeze PREFIX keeps those parameters bit-identical through training, in every mode (torch's
// requires_grad_(False): no update, no momentum), while the rest train; a prefix that names no
// parameter is refused.
TEST_F(TrainTest, FrozenParametersStayFixedInEveryMode) {
  const std::string base = "--model convnet --backend sim --devices 2 --synthetic 32 --batch-size 8 --seed 6";
  ASSERT_EQ(run(base + " --steps 1 --save " + path("start.safetensors")).code, 0);
  const auto start = dp::safetensors::read(path("start.safetensors"));
  for (const std::string mode : {"single", "dp", "ddp"}) {
    SCOPED_TRACE(mode);
    const Result r = run(base + " --mode " + mode + " --steps 3 --freeze layer1 --freeze fc.bias --init " +
                         path("start.safetensors") + " --save " + path("frozen.safetensors"));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto after = dp::safetensors::read(path("frozen.safetensors"));
    for (const char* name : {"layer1.0.weight", "layer1.0.bias", "layer1.1.weight", "layer1.1.bias", "fc.bias"})
      EXPECT_EQ(after.at(name).data, start.at(name).data) << name << " moved";
    for (const char* name : {"layer2.0.weight", "fc.weight"})
      EXPECT_NE(after.at(name).data, start.at(name).data) << name << " did not train";
    const auto momentum = after.at("optimizer.momentum.layer1.0.weight").to_f32();
    EXPECT_TRUE(std::all_of(momentum.begin(), momentum.end(), [](float v) { return v == 0.0f; }));
  }
  expect_refused(base + " --steps 1 --freeze layer3", "frozen 'layer3' names no parameter of the model");
}

// A preemption: SIGTERM (here raised by the run itself before step 4) lets the step in flight
// finish, saves --save and exits with 143; the same command with --resume (no --steps: to the end
// the checkpoint's run planned, its cosine schedule included) writes the uninterrupted run's
// checkpoint byte for byte, in every mode and with the pipeline on or off. --save-every N writes
// NAME.step<S> checkpoints beside --save, and --keep K leaves exactly the last K.
TEST_F(TrainTest, APreemptedRunResumesBitExactAndPeriodicCheckpointsAreKept) {
  for (const std::string mode : {"single", "dp", "ddp"})
    for (const std::string pipeline : {"on", "off"}) {
      SCOPED_TRACE(mode + " pipeline " + pipeline);
      const std::string common = fmt::format(
          "--model convnet --mode {} --pipeline {} --backend sim --devices 2 --synthetic 40 --batch-size 4 --seed 3 "
          "--lr 0.05 --schedule cosine --steps 8",
          mode, pipeline);
      ASSERT_EQ(run(common + " --save " + path("straight.safetensors")).code, 0);
      const Result cut = run(common + " --debug-signal-at-step 4 --save " + path("cut.safetensors"));
      EXPECT_EQ(cut.code, 143) << cut.output;
      EXPECT_NE(cut.output.find("SIGTERM: stopping after step 3 of 8"), std::string::npos) << cut.output;
      EXPECT_EQ(dp::safetensors::read(path("cut.safetensors")).metadata.at("dp.step"), "3");
      const std::string again = fmt::format(
          "--model convnet --mode {} --pipeline {} --backend sim --devices 2 --synthetic 40 --batch-size 4 --seed 3 "
          "--lr 0.05 --schedule cosine",
          mode, pipeline);
      const Result resumed = run(again + " --resume " + path("cut.safetensors") + " --save " + path("cut.safetensors"));
      ASSERT_EQ(resumed.code, 0) << resumed.output;
      EXPECT_NE(resumed.output.find("5 step(s) from step 3"), std::string::npos) << resumed.output;
      EXPECT_EQ(read_file(path("straight.safetensors")), read_file(path("cut.safetensors"))) << "resume differs";
    }
  const std::string periodic = "--backend sim --hidden 8 --synthetic 32 --batch-size 4 --steps 10 --save-every 2";
  ASSERT_EQ(run(periodic + " --keep 3 --save " + path("p.safetensors")).code, 0);
  std::vector<std::string> kept;
  for (const auto& entry : std::filesystem::directory_iterator(dir_))
    if (entry.path().filename().string().starts_with("p.step")) kept.push_back(entry.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"p.step4.safetensors", "p.step6.safetensors", "p.step8.safetensors"}));
  EXPECT_EQ(dp::safetensors::read(path("p.step6.safetensors")).metadata.at("dp.step"), "6");
  const Result no_save = run("--backend sim --steps 1 --save-every 2");
  EXPECT_EQ(no_save.code, 2);
  EXPECT_NE(no_save.output.find("--save-every requires --save"), std::string::npos) << no_save.output;
}

// A real SIGINT (Ctrl-C) in the middle of a long run: it stops after the step in flight, saves
// and exits with 130; the checkpoint resumes.
TEST_F(TrainTest, SigintStopsALongRunWithItsCheckpoint) {
  const Started stopped =
      start_then_kill("--backend sim --hidden 8 --synthetic 64 --batch-size 4 --steps 100000000 --log-every 1 --save " +
                          path("long.safetensors"),
                      "step     20 ", 60, "", SIGINT);
  const std::string& output = stopped.output;
  ASSERT_TRUE(stopped.seen) << output;
  EXPECT_EQ(stopped.exit_code, 130) << output;
  EXPECT_NE(output.find("SIGINT: stopping after step"), std::string::npos) << output;
  const long step = std::stol(dp::safetensors::read(path("long.safetensors")).metadata.at("dp.step"));
  EXPECT_GE(step, 20);
  EXPECT_LT(step, 100000000);
  const Result resumed =
      run(fmt::format("--backend sim --hidden 8 --synthetic 64 --batch-size 4 --steps {} --resume {}", step + 2,
                      path("long.safetensors")));
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find(fmt::format("2 step(s) from step {}", step)), std::string::npos) << resumed.output;
}

// What an env:// launch cannot be: under torchrun's elastic agent (refused naming what to use), a
// RANK without MASTER_ADDR (naming the missing variable), a RANK outside WORLD_SIZE; WORLD_SIZE=1 is
// a job of one process. (A real two-process launch: tests/env/test_env_train.cpp.)
TEST_F(TrainTest, EnvLaunchesAreRefusedNamingMpirun) {
  const std::string args = " --backend sim --hidden 8 --synthetic 16 --batch-size 8 --steps 1";
  const auto with = [&](const std::string& environment) {
    return dp::test::run_command("env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_SIZE " + environment + " " +
                                 DP_TRAIN_BIN + args);
  };
  const Result bad_rank = with("RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500");
  EXPECT_EQ(bad_rank.code, 2) << bad_rank.output;
  EXPECT_NE(bad_rank.output.find("RANK='2' is not an integer in [0, 1]"), std::string::npos) << bad_rank.output;
  const Result no_master = with("RANK=1 WORLD_SIZE=2");
  EXPECT_EQ(no_master.code, 2) << no_master.output;
  EXPECT_NE(no_master.output.find("but MASTER_ADDR is not"), std::string::npos) << no_master.output;
  const Result elastic = with("TORCHELASTIC_RUN_ID=job7");
  EXPECT_EQ(elastic.code, 2) << elastic.output;
  EXPECT_NE(elastic.output.find("torchrun's elastic agent (TORCHELASTIC_RUN_ID is set)"), std::string::npos);
  EXPECT_EQ(
      with(fmt::format("RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={}", dp::test::free_tcp_port())).code, 0);
  const Result bench = dp::test::run_command(std::string("env RANK=0 WORLD_SIZE=2 ") + DP_BENCH_BIN +
                                             " --backend sim --models mlp --steps 1");
  EXPECT_EQ(bench.code, 2) << bench.output;
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --epochs and --steps count from the start of training, on --resume too: the preempted command
// re-run with --resume finishes the run it planned (not N more), writing the uninterrupted run's
// checkpoint byte for byte; re-run once more, it trains nothing, says so, exits 0 at once and
// leaves the checkpoint untouched.
TEST_F(TrainTest, RerunningAPreemptedCommandWithResumeFinishesItsPlan) {
  // 40 samples in batches of 4 (ddp: 2 devices of 4): epochs of 10 steps (ddp: 5).
  for (const std::string& length : {std::string("--epochs 3"), std::string("--steps 17")})
    for (const std::string mode : {"single", "ddp"}) {
      SCOPED_TRACE(mode + " " + length);
      const std::string command = fmt::format(
          "--model mlp --hidden 16 --mode {} --backend sim --devices 2 --synthetic 40 --batch-size 4 --seed 3 "
          "--lr 0.05 --schedule cosine {} --save {}",
          mode, length, path("run.safetensors"));
      ASSERT_EQ(run(command).code, 0);
      const std::string straight = read_file(path("run.safetensors"));
      fs::remove(path("run.safetensors"));
      const Result cut = run(command + " --debug-signal-at-step 7");
      ASSERT_EQ(cut.code, 143) << cut.output;
      EXPECT_EQ(dp::safetensors::read(path("run.safetensors")).metadata.at("dp.step"), "6");
      const Result resumed = run(command + " --resume " + path("run.safetensors"));
      ASSERT_EQ(resumed.code, 0) << resumed.output;
      EXPECT_EQ(read_file(path("run.safetensors")), straight) << "the resumed run differs:\n" << resumed.output;

      const auto before = files();
      const auto written = fs::last_write_time(path("run.safetensors"));
      const auto t0 = std::chrono::steady_clock::now();
      const Result again = run(command + " --resume " + path("run.safetensors"));
      EXPECT_LT(seconds_since(t0), 10.0);
      EXPECT_EQ(again.code, 0) << again.output;
      EXPECT_NE(again.output.find("the end of its run"), std::string::npos) << again.output;
      EXPECT_NE(again.output.find("nothing to train, nothing written"), std::string::npos) << again.output;
      EXPECT_EQ(again.output.find("step(s) from step"), std::string::npos) << again.output;
      EXPECT_EQ(files(), before) << "a finished run's --resume changed a file";
      EXPECT_EQ(fs::last_write_time(path("run.safetensors")), written);
    }
}

// The synthetic data are drawn from the seed: a resumed run draws them from the checkpoint's seed,
// whatever --seed says, so resuming with another --seed writes what resuming without it writes.
TEST_F(TrainTest, AResumedRunDrawsItsDataFromTheCheckpointsSeed) {
  const std::string common = "--model mlp --hidden 16 --backend sim --synthetic 64 --batch-size 8 --lr 0.05 ";
  ASSERT_EQ(run(common + "--seed 5 --steps 6 --save " + path("straight.safetensors")).code, 0);
  ASSERT_EQ(run(common + "--seed 5 --steps 3 --save " + path("half.safetensors")).code, 0);
  const Result plain =
      run(common + "--steps 6 --resume " + path("half.safetensors") + " --save " + path("plain.safetensors"));
  ASSERT_EQ(plain.code, 0) << plain.output;
  const Result seeded =
      run(common + "--seed 7 --steps 6 --resume " + path("half.safetensors") + " --save " + path("seeded.safetensors"));
  ASSERT_EQ(seeded.code, 0) << seeded.output;
  EXPECT_NE(seeded.output.find("trained with --seed 5; continuing with its seed, not 7"), std::string::npos)
      << seeded.output;
  EXPECT_EQ(losses(seeded.output), losses(plain.output)) << seeded.output;
  EXPECT_EQ(read_file(path("seeded.safetensors")), read_file(path("plain.safetensors")));
  EXPECT_EQ(read_file(path("seeded.safetensors")), read_file(path("straight.safetensors")));
}

// SIGTERM after the last step (here raised by the run itself, as --debug-signal-at-step does, once
// the steps are done: during the final model check and the save) no longer kills the finished run:
// the save completes, the run is complete, exit 0, and the checkpoint is the unsignalled run's.
TEST_F(TrainTest, ASignalAfterTheLastStepStillSavesTheFinishedRun) {
  const std::string common = "--model mlp --hidden 16 --backend sim --synthetic 64 --batch-size 8 --steps 6 --save ";
  ASSERT_EQ(run(common + path("quiet.safetensors")).code, 0);
  { std::ofstream(path("signalled.safetensors")) << "previous checkpoint"; }
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run(common + path("signalled.safetensors") + " --debug-signal-at-step 7");
  EXPECT_LT(seconds_since(t0), 30.0);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(
      r.output.find("SIGTERM after the last step: the run is complete, " + path("signalled.safetensors") + " saved"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(read_file(path("signalled.safetensors")), read_file(path("quiet.safetensors")));
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_NE(entry.path().filename().string().front(), '.') << "temporary file left behind: " << entry.path();
  // One step earlier it stops the run before its last step: saved, exit 143.
  const Result early = run(common + path("early.safetensors") + " --debug-signal-at-step 6");
  EXPECT_EQ(early.code, 143) << early.output;
  EXPECT_EQ(dp::safetensors::read(path("early.safetensors")).metadata.at("dp.step"), "5");
}

// A file-size limit (ulimit -f) the checkpoint does not fit: below the model's own size, refused
// before any work; above it but below the file, the save fails with EFBIG (SIGXFSZ is ignored, so
// the process is not killed half-way). Exit 2 naming the file and the limit either way, the old
// checkpoint as it was and no temporary file left.
TEST_F(TrainTest, AFileSizeLimitTheCheckpointDoesNotFitIsRefusedKeepingTheOldFile) {
  // 6,370 parameters: 25 KB of weights, about 52 KB with the momentum buffers.
  const std::string args =
      "--model mlp --hidden 8 --backend sim --synthetic 64 --batch-size 16 --steps 6 --save " + path("old.safetensors");
  ASSERT_EQ(run(args).code, 0);
  for (const auto& [blocks, message] :
       {std::pair<int, std::string>{1, "past the file-size limit (ulimit -f) of 1024 bytes"},
        {30, "write failed (File too large: the file-size limit (ulimit -f) is 30720 bytes); the file is as it was"}}) {
    SCOPED_TRACE(blocks);
    const auto t0 = std::chrono::steady_clock::now();
    // bash's ulimit -f counts KiB (/bin/sh's may count 512-byte blocks).
    expect_nothing_written(args, 2, message,
                           fmt::format("bash -c 'ulimit -f {} && exec \"$0\" \"$@\"' {}", blocks, DP_TRAIN_BIN));
    EXPECT_LT(seconds_since(t0), 30.0);
  }
}

// A limit (ulimit -v) just above what the run's up-front estimate once was: the sim's GEMMs map
// OpenBLAS's 128 MiB buffer per thread, malloc an arena per thread, each thread its stack. Whatever
// the limit, the run either is refused at once (exit 2, naming the limit, nothing written) or
// trains to the end; it never hangs in OpenBLAS's allocator, which retries forever.
TEST_F(TrainTest, AnyAddressSpaceLimitIsRefusedAtOnceOrTrains) {
  const std::string guard = path("existing.safetensors");
  const std::string args = std::string(DP_TRAIN_BIN) +
                           " --model mlp --mode ddp --devices 4 --backend sim --synthetic 4096 --batch-size 32 "
                           "--steps 20 --save " +
                           guard;
  int refused = 0, trained = 0;
  for (int mib = 1000; mib <= 4000; mib += 150) {
    SCOPED_TRACE(mib);
    { std::ofstream(guard) << "previous checkpoint"; }
    const auto t0 = std::chrono::steady_clock::now();
    const Result r = dp::test::run_command(fmt::format("ulimit -v {}; timeout -k 5 60 {}", mib * 1024, args));
    const double seconds = seconds_since(t0);
    ASSERT_TRUE(r.code == 0 || r.code == 2) << "exit " << r.code << " after " << seconds << " s:\n" << r.output;
    if (r.code == 2) {
      ++refused;
      EXPECT_NE(r.output.find("of address space"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("(ulimit -v)"), std::string::npos) << r.output;
      EXPECT_LT(seconds, 10.0) << r.output;
      EXPECT_EQ(read_file(guard), "previous checkpoint");
    } else {
      ++trained;
      EXPECT_EQ(dp::safetensors::read(guard).metadata.at("dp.step"), "20");
    }
    for (const auto& entry : fs::directory_iterator(dir_))
      EXPECT_NE(entry.path().filename().string().front(), '.') << "temporary file left behind: " << entry.path();
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 0);
}

// The samples/s of a --log-every line is the samples since the last line over the training time
// since it: when the window spans an epoch's end, neither inflated by restarting the window there
// nor deflated by the epoch's evaluation.
TEST_F(TrainTest, TheLoggedRateIsTheMeasuredOne) {
  // 512 samples in batches of 32: epochs of 16 steps; the first line, at step 17, spans the first
  // epoch's end (its evaluation with a test split).
  write_idx("data", 512);
  write_idx("data", 64, 28, 28, 0x803, -1, 0, "t10k");
  for (const std::string& data : {std::string("--synthetic 512"), "--data " + path("data")}) {
    SCOPED_TRACE(data);
    const Result r = run("--model convnet --backend sim --batch-size 32 --steps 20 --log-every 17 --metrics-json " +
                         path("m.jsonl") + " " + data);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto records = json_lines(path("m.jsonl"));
    const auto first = std::find_if(records.begin(), records.end(),
                                    [](const nlohmann::json& record) { return record.at("kind") == "step"; });
    ASSERT_NE(first, records.end()) << r.output;
    ASSERT_EQ(first->at("step"), 17);
    // The window starts with the loop, as elapsed_s does: at most elapsed_s is not training.
    const double measured = 17.0 * 32.0 / first->at("elapsed_s").get<double>();
    const double logged = first->at("samples_per_s").get<double>();
    EXPECT_GE(logged, measured * 0.9) << r.output;
    EXPECT_LT(logged, measured * 2.0) << r.output;
  }
}

}  // namespace
