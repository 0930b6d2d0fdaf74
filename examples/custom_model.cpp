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
#include <cstdio>
#include <cstdlib>
#include <dp/engines/engine.h>
#include <dp/io/checkpoint.h>
#include <dp/io/data.h>
#include <dp/io/safetensors.h>
#include <dp/nn/layers.h>
#include <dp/nn/sequential.h>
#include <dp/runtime/device.h>
#include <dp/runtime/error.h>
#include <memory>
#include <string>
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

}  // namespace

int main(int argc, char** argv) try {
  const std::string output = argc > 1 ? argv[1] : "custom_model.safetensors";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 20;
  if (steps < 1) throw dp::InvalidArgument("STEPS must be at least 1");

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

  // Each rank's shard of a learnable synthetic set, as DistributedSampler deals it.
  const dp::Dataset data = dp::make_synthetic(512, 3);
  const int batch = 16;
  std::vector<std::vector<float>> inputs(2);
  std::vector<std::vector<std::int64_t>> targets(2);
  float first = 0.0f, last = 0.0f;
  for (int step = 0; step < steps; ++step) {
    std::vector<dp::Batch> shards;
    for (int rank = 0; rank < 2; ++rank) {
      dp::DistributedSampler sampler(data.size(), 2, rank, /*shuffle=*/true, /*seed=*/0);
      sampler.set_epoch(step * batch / static_cast<int>(sampler.num_samples()));
      const auto indices = sampler.indices();
      inputs[rank].clear();
      targets[rank].clear();
      for (int i = 0; i < batch; ++i) {
        const auto index = static_cast<std::size_t>(indices[(step * batch + i) % indices.size()]);
        for (std::size_t p = 0; p < data.sample_pixels(); ++p)
          inputs[rank].push_back(data.pixels[index * data.sample_pixels() + p] / 255.0f);
        targets[rank].push_back(data.labels[index]);
      }
      shards.push_back(dp::Batch{inputs[rank].data(), targets[rank].data(), batch});
    }
    const float loss = ddp->train_step(shards);
    if (step == 0) first = loss;
    last = loss;
  }
  ddp->synchronize();

  // The state dict with PyTorch's names (stem.0.weight, block.conv1.weight, head.3.bias, ...).
  dp::safetensors::write(output, dp::state_dict(ddp->model(), runtime->device(0).create_stream()));
  std::printf("custom_model: %s, %zu parameters, loss %.4f -> %.4f over %d DDP steps, saved %s\n",
              dp::to_string(runtime->backend()).data(), model->param_count(), first, last, steps, output.c_str());
  return last < first ? 0 : 1;
} catch (const dp::Error& e) {
  std::fprintf(stderr, "custom_model: %s\n", e.what());
  return 2;
}
