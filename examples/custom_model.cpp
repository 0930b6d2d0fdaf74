// custom_model.cpp — a user's own network, built from dp::nn outside the library, trained with DDP
// and saved as a checkpoint PyTorch loads. Only dp's public headers; the same code runs on GPUs
// (backend "cuda") or on simulated devices ("sim", the default where there is no GPU).
//
// The network, as PyTorch would write it (the state-dict names are the same):
//   class Net(nn.Module):
//       def __init__(self):
//           super().__init__()
//           self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
//           self.block = Block(8)    # conv1/bn1/relu/conv2/bn2, out = relu(body(x) + x)
//           self.pool = nn.AvgPool2d(2)
//           self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 10))
//   Net().load_state_dict(safetensors.torch.load_file("custom_model.safetensors"))
//
// Usage: custom_model [OUTPUT.safetensors] [STEPS]
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <dp/engines/engine.h>
#include <dp/io/atomic_file.h>
#include <dp/io/checkpoint.h>
#include <dp/io/data.h>
#include <dp/io/safetensors.h>
#include <dp/nn/layers.h>
#include <dp/nn/sequential.h>
#include <dp/runtime/device.h>
#include <dp/runtime/error.h>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

std::unique_ptr<dp::Model> make_net(dp::Device& device) {
  using namespace dp::nn;
  Layers stem;
  stem.push_back(make_conv2d("0", 1, 8, 3, 1, 1, /*bias=*/false));
  stem.push_back(make_batchnorm2d("1", 8));
  stem.push_back(make_relu("2"));
  Layers body;
  body.push_back(make_conv2d("conv1", 8, 8, 3, 1, 1, false));
  body.push_back(make_batchnorm2d("bn1", 8));
  body.push_back(make_relu("relu"));
  body.push_back(make_conv2d("conv2", 8, 8, 3, 1, 1, false));
  body.push_back(make_batchnorm2d("bn2", 8));
  Layers head;
  head.push_back(make_global_avgpool2d("0"));
  head.push_back(make_flatten("1"));
  head.push_back(make_dropout("2", 0.2));
  head.push_back(make_linear("3", 8, 10));
  Layers layers;
  layers.push_back(make_sequential("stem", std::move(stem)));
  layers.push_back(make_residual("block", std::move(body)));  // identity shortcut, ReLU after the Add
  layers.push_back(make_avgpool2d("pool", 2, 2));
  layers.push_back(make_sequential("head", std::move(head)));
  auto model =
      std::make_unique<SequentialModel>("net", device, std::move(layers), std::vector<std::int64_t>{1, 28, 28});
  model->initialize(/*seed=*/1);
  return model;
}

constexpr long kMaxSteps = 1'000'000;

constexpr const char* kUsage =
    "usage: custom_model [OUTPUT.safetensors] [STEPS]\n"
    "  Trains a small residual network with DDP on two devices (GPUs when there are two, else\n"
    "  simulated) on synthetic data and saves its state dict for PyTorch.\n"
    "  OUTPUT  the checkpoint to write (default custom_model.safetensors)\n"
    "  STEPS   training steps, a decimal integer in [1, 1000000] (default 20)\n"
    "Exit codes: 0 trained and saved (with 2 or more steps: the loss fell), 1 the loss did not fall\n"
    "or another failure, 2 bad arguments, 3 a non-finite loss (nothing saved).\n";

// Arguments that make no sense: exit 2 with the usage.
struct BadArguments : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string output = "custom_model.safetensors";
  long steps = 20;
  bool help = false;
};

// The command line, checked before any work: a typo must not train, nor become a file's name.
Args parse_args(int argc, char** argv) {
  Args args;
  const std::vector<std::string_view> given(argv + 1, argv + argc);
  for (const std::string_view arg : given) {
    if (arg == "--help" || arg == "-h")
      args.help = true;
    else if (!arg.empty() && arg[0] == '-')
      throw BadArguments("unknown option '" + std::string(arg) + "' (see --help)");
  }
  if (args.help) return args;
  if (given.size() > 2) throw BadArguments("too many arguments (see --help)");
  if (!given.empty()) args.output = std::string(given[0]);
  if (given.size() == 2) {
    const std::string_view text = given[1];
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), args.steps);
    if (text.empty() || error != std::errc() || end != text.data() + text.size() || args.steps < 1 ||
        args.steps > kMaxSteps)
      throw BadArguments("STEPS '" + std::string(text) + "' is not a decimal integer in [1, " +
                         std::to_string(kMaxSteps) + "]");
  }
  try {
    dp::check_writable(args.output);  // refused now, not after the training
  } catch (const dp::Error& e) {
    throw BadArguments(e.what());
  }
  return args;
}

// Each rank's batch of step `step`: its shard of the data set, as DistributedSampler deals it.
std::vector<dp::Batch> shards_of(const dp::Dataset& data, long step, int batch, std::vector<std::vector<float>>& inputs,
                                 std::vector<std::vector<std::int64_t>>& targets) {
  std::vector<dp::Batch> shards;
  for (int rank = 0; rank < 2; ++rank) {
    dp::DistributedSampler sampler(data.size(), 2, rank, /*shuffle=*/true, /*seed=*/0);
    sampler.set_epoch(step * batch / static_cast<long>(sampler.num_samples()));
    const auto indices = sampler.indices();
    inputs[rank].clear();
    targets[rank].clear();
    for (int i = 0; i < batch; ++i) {
      const auto index = static_cast<std::size_t>(indices[static_cast<std::size_t>(step * batch + i) % indices.size()]);
      for (std::size_t p = 0; p < data.sample_pixels(); ++p)
        inputs[rank].push_back(data.pixels[index * data.sample_pixels() + p] / 255.0f);
      targets[rank].push_back(data.labels[index]);
    }
    shards.push_back(dp::Batch{inputs[rank].data(), targets[rank].data(), batch});
  }
  return shards;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse_args(argc, argv);
  if (args.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  // Two devices: GPUs when there are two, else simulated ones.
  dp::RuntimeOptions options;
  options.backend = dp::Runtime::cuda_device_count() >= 2 ? "cuda" : "sim";
  options.sim_devices = 2;
  auto runtime = dp::Runtime::create(options);
  auto model = make_net(runtime->device(0));

  dp::EngineOptions engine;
  engine.kind = dp::EngineKind::ddp;
  engine.device_ids = std::vector<int>{0, 1};
  engine.step.label_smoothing = 0.1;
  engine.step.seed = 7;  // Dropout: rank r draws from seed + r
  auto ddp = dp::make_engine(*runtime, *model, dp::AdamWOptions{3e-3}, engine);

  const dp::Dataset data = dp::make_synthetic(512, 3);  // learnable synthetic samples
  std::vector<std::vector<float>> inputs(2);
  std::vector<std::vector<std::int64_t>> targets(2);
  float first = 0.0f, last = 0.0f;
  for (long step = 0; step < args.steps; ++step) {
    last = ddp->train_step(shards_of(data, step, /*batch=*/16, inputs, targets));
    if (step == 0) first = last;
    if (!std::isfinite(last)) {  // a diverged model is no checkpoint
      std::fprintf(stderr, "custom_model: the loss is %f at step %ld; %s was not written\n", last, step + 1,
                   args.output.c_str());
      return 3;
    }
  }
  ddp->synchronize();

  // The state dict with PyTorch's names (stem.0.weight, block.conv1.weight, head.3.bias, ...).
  dp::safetensors::write(args.output, dp::state_dict(ddp->model(), runtime->device(0).create_stream()));
  std::printf("custom_model: %s, %zu parameters, loss %.4f -> %.4f over %ld DDP step(s), saved %s\n",
              dp::to_string(runtime->backend()).data(), model->param_count(), first, last, args.steps,
              args.output.c_str());
  // Whether it learned needs a trend: two losses at least.
  if (args.steps == 1) std::printf("custom_model: one step: too few to tell whether the loss falls\n");
  if (args.steps >= 2 && !(last < first)) {
    std::fprintf(stderr, "custom_model: the loss did not fall (%.4f -> %.4f over %ld steps)\n", first, last,
                 args.steps);
    return 1;
  }
  return 0;
} catch (const BadArguments& e) {
  std::fprintf(stderr, "custom_model: %s\nusage: custom_model [OUTPUT.safetensors] [STEPS] (--help says more)\n",
               e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "custom_model: %s\n", e.what());
  return dp::exit_code(std::current_exception());  // dp's convention: 2 bad input, 3 non-finite, 1 other
}
