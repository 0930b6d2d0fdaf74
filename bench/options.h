// options.h — dp_bench's command line: its flags, their checks, and the runtime they ask for.
// A bad command line is a UsageError: "dp_bench: <message>" on stderr and exit code 2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/runtime/device.h"
#include "dp_job.h"
#include "exit_codes.h"

namespace dp_bench {

inline const std::vector<std::string> kModels = {"mlp", "convnet", "resnet8", "resnet18"};
// dp_bench's ResNet-18: torchvision's, 10 classes, on 3 x 32 x 32 inputs (CIFAR's size).
inline constexpr int kResNet18Side = 32;
// The floats of one input sample of each model.
inline std::size_t model_sample_floats(const std::string& model) {
  return model == "resnet18" ? 3 * kResNet18Side * kResNet18Side : 28 * 28;
}
inline const std::vector<std::string> kModes = {"single", "dp", "ddp"};

using dp::tools::UsageError;  // a bad command line: "dp_bench: <message>", exit code 2

// The members the JSON report shows are named as its keys (report.cpp writes them by name).
struct Options {
  std::string backend = "auto";
  std::string precision = "strict";
  std::string graphs = "on";
  std::string pipeline = "on";
  bool profile = false;
  std::optional<int> devices;
  int devices_per_gpu = 1;
  std::string models = "mlp,convnet";
  std::string optimizer = "sgd";
  bool sync_bn = false;
  std::string broadcast_buffers = "on";  // ddp: buffers broadcast from rank 0 before each forward
  std::string amp = "off";               // torch.autocast(dtype=bfloat16) around the forward: off or bf16
  std::string grad_reduce = "fp32";      // ddp: the gradient all-reduce in fp32 or bf16
  std::string modes = "single,dp,ddp";
  int batch_per_device = 64;
  int steps = 20;
  int warmup = 5;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  std::string json_path;
  std::string trace_path;
  std::uint64_t seed = 1;
};

// Reads argv into `o`. Returns the exit code when the program stops here: --help (0) or a command
// line CLI11 refuses (2, its message printed), each agreed with the job's other processes.
std::optional<int> parse_command_line(int argc, char** argv, Options& o, const dp::tools::Job& job);

// Throws UsageError on a value CLI11 cannot check by itself.
void validate(const Options& o);

// "a,b,,c" -> {"a","b","c"}, each checked against `known`, duplicates dropped (first one kept).
std::vector<std::string> parse_list(const std::string& text, const std::vector<std::string>& known, const char* flag);

// The runtime the options ask for, checking the device count against what the backend has.
std::unique_ptr<dp::Runtime> make_runtime(const Options& o, int& devices);

// Whether the measured steps record spans (busy time, GEMM rates, the trace): always on sim; on cuda
// only when asked (--profile or --trace), since each kernel then records two timing events.
bool records_spans(const dp::Runtime& rt, const Options& o);

}  // namespace dp_bench
