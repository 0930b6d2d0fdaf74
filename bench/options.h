// options.h — dp_bench's command line: its flags (a table: tools/flags.h), and the runtime they ask
// for.
// A bad command line is a UsageError: "dp_bench: <message>" on stderr and exit code 2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/models/registry.h"
#include "dp/runtime/device.h"
#include "dp_job.h"
#include "exit_codes.h"
#include "flags.h"

namespace dp_bench {

inline const std::vector<std::string> kModes = {"single", "dp", "ddp"};

using dp::tools::UsageError;  // a bad command line: "dp_bench: <message>", exit code 2

// The shared flags' members (backend, devices, batch_size, ...) are SharedOptions' (tools/flags.h).
// The members the JSON report shows are named as its keys (report.cpp writes them by name).
struct Options : dp::tools::SharedOptions {
  bool profile = false;
  std::string models = "mlp,convnet";
  bool broadcast_buffers = true;  // ddp: buffers broadcast from rank 0 before each forward
  std::string modes = "single,dp,ddp";
  int steps = 20;
  int warmup = 5;
  std::string json_path;
  std::string trace_path;
  std::uint64_t seed = 1;
  std::string roofline = "h100";  // the GPU whose peaks the roofline estimate uses (roofline.h)
  bool check_cost = false;        // ddp: also measured with the collectives' check off
};

// What dp_bench builds each model of the registry with: the MLP's default sizes; torchvision's
// ResNets with 10 classes on 3 x 32 x 32 inputs (CIFAR's); the run's model shape flags (the GPT's
// sizes and GELU, --dropout), dp_train's.
// `model` is a registry model's name or gpt2: the registry's gpt at GPT-2 124M's shape (12 layers,
// 12 heads, 768 wide, context 1024, vocabulary 50304, GELU's tanh form), whatever the shape flags say.
dp::models::ModelArgs model_args(const Options& o, const std::string& model);
const dp::models::ModelSpec& model_spec(const std::string& model);

// Every flag of dp_bench, in --help's order: the shared ones, then its own.
const std::vector<dp::tools::FlagGroup<Options>>& flag_groups();

// Reads argv into `o`. Returns the exit code when the program stops here: --help (0) or a command
// line CLI11 refuses (2, its message printed), each agreed with the job's other processes.
std::optional<int> parse_command_line(int argc, char** argv, Options& o, const dp::tools::Job& job);

// The runtime the options ask for, checking the device count against what the backend has.
// `one_process`: the job has no other process (the sim then keeps each device's threads on a core).
std::unique_ptr<dp::Runtime> make_runtime(const Options& o, int& devices, bool one_process);

// Whether the measured steps record spans (busy time, GEMM rates, the trace): always on sim; on cuda
// only when asked (--profile or --trace), since each kernel then records two timing events.
bool records_spans(const dp::Runtime& rt, const Options& o);

}  // namespace dp_bench
