// A user's program, built against an installed dp with find_package(dp): the README's example,
// on simulated devices, plus a host -> device -> device -> host trip.
#include <cmath>
#include <cstdio>
#include <dp/dp.h>
#include <filesystem>
#include <vector>

int main() {
  auto runtime = dp::Runtime::create({.backend = "sim", .sim_devices = 3});

  // Copies and link accounting.
  std::vector<float> host(1000), back(1000, 0.0f);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  auto a = runtime->device(0).allocate(host.size() * sizeof(float));
  auto b = runtime->device(1).allocate(host.size() * sizeof(float));
  dp::Stream s0 = runtime->device(0).create_stream(), s1 = runtime->device(1).create_stream();
  s0.copy(a.data(), host.data(), a.size());
  dp::Event ready = runtime->device(0).create_event();
  s0.record(ready);
  s1.wait(ready);
  s1.copy(b.data(), a.data(), a.size());
  s1.copy(back.data(), b.data(), b.size());
  if (back != host || runtime->link_traffic(0, 1).bytes != a.size()) {
    std::puts("consumer: copy FAILED");
    return 1;
  }

  // The README's training example.
  const int batch = 12;
  std::vector<float> images(static_cast<std::size_t>(batch) * 784);
  std::vector<std::int64_t> labels(batch);
  for (std::size_t i = 0; i < images.size(); ++i) images[i] = static_cast<float>((i * 37) % 256) / 255.0f;
  for (int i = 0; i < batch; ++i) labels[static_cast<std::size_t>(i)] = i % 10;
  auto model = dp::models::make_convnet(runtime->device(0), 0);
  dp::SgdOptions sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f};
  dp::DataParallel dp_engine(*runtime, *model, sgd, {.device_ids = std::vector{0, 1, 2}, .output_device = 2});
  float loss = dp_engine.train_step(images.data(), labels.data(), batch);
  std::printf("DataParallel step: loss %.4f\n", loss);

  auto module = dp::models::make_convnet(runtime->device(0), 0);
  dp::DistributedDataParallel ddp(*runtime, *module, sgd, {.bucket_cap_mb = 25});
  std::vector<dp::Batch> shards;
  for (int r = 0; r < ddp.world_size(); ++r) shards.push_back({images.data() + r * 4 * 784, labels.data() + r * 4, 4});
  const float ddp_loss = ddp.train_step(shards);
  std::printf("DDP step: loss %.4f\n", ddp_loss);
  loss += ddp_loss;
  {
    auto guard = ddp.no_sync();
    ddp.forward_backward(shards, 0.5f);
  }
  ddp.forward_backward(shards, 0.5f);
  ddp.optimizer_step();
  ddp.synchronize();
  dp::Stream stream = runtime->device(0).create_stream();
  const auto state = dp::state_dict(ddp.replica(0), stream);
  if (!std::isfinite(loss) || !state.has("layer1.1.running_var")) {
    std::puts("consumer: training FAILED");
    return 1;
  }

  // The README's Engine example: the same step through the one interface, then its training state.
  auto engine_model = dp::models::make_convnet(runtime->device(0), 0);
  auto engine =
      dp::make_engine(*runtime, *engine_model, sgd, {.kind = dp::EngineKind::ddp, .device_ids = std::vector{0, 1}});
  std::vector<dp::Batch> batches;
  for (int r = 0; r < engine->batches_per_step(); ++r)
    batches.push_back({images.data() + r * 6 * 784, labels.data() + r * 6, 6});
  engine->set_lr(0.05f);
  const float step_loss = engine->train_step(batches);
  const std::vector<float> logits = engine->predict(batches);
  engine->synchronize();
  const std::string path = (std::filesystem::temp_directory_path() / "dp_consumer_run.safetensors").string();
  dp::TrainingState::save(path, engine->model(), *engine->optimizers()[0], {.step = 1});
  const auto resumed = dp::TrainingState::read(path);
  std::filesystem::remove(path);
  if (!std::isfinite(step_loss) || logits.size() != 12u * 10u || resumed.progress().step != 1 ||
      resumed.optimizer_steps() != 1) {
    std::puts("consumer: engine FAILED");
    return 1;
  }
  std::printf("consumer: ok (loss %.4f, %zu tensors in the state dict)\n", loss, state.tensors.size());
  return 0;
}
