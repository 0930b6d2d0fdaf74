// train_loop.cpp — a complete data-parallel training loop over dp's Engine API, in the shape of a
// PyTorch DDP script: devices, a model, an engine, per-rank samplers feeding pinned batch loaders,
// epochs of pipelined steps, an evaluation and a checkpoint PyTorch can load.
#include <algorithm>
#include <cstdio>
#include <dp/dp.h>
#include <memory>
#include <vector>

int main() try {
  // Every GPU, or 4 simulated devices where there is none; the ConvNet of PyTorch's MNIST example.
  auto runtime = dp::Runtime::create({.backend = "auto", .sim_devices = 4});
  auto model = dp::models::make_convnet(runtime->device(0), /*seed=*/1);
  dp::EngineOptions options;
  options.kind = dp::EngineKind::ddp;  // one replica and optimizer per device, gradients all-reduced
  auto engine = dp::make_engine(*runtime, *model, dp::SgdOptions{0.05f, 0.9f}, options);

  // A learnable synthetic set (dp::load_mnist reads MNIST's files): 2048 samples to train, 512 held out.
  const dp::Dataset data = dp::make_synthetic(2560, /*seed=*/1);
  const std::size_t train = 2048, held_out = 512;
  const int ranks = engine->batches_per_step(), batch = 32, epochs = 2;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    // DistributedSampler per rank, reshuffled every epoch (set_epoch); each rank's loader fills
    // pinned batches ahead of the step on its own thread.
    std::vector<std::unique_ptr<dp::BatchLoader>> loaders;
    std::size_t steps = 0;
    for (int rank = 0; rank < ranks; ++rank) {
      dp::DistributedSampler sampler(train, ranks, rank, /*shuffle=*/true, /*seed=*/0);
      sampler.set_epoch(epoch);
      const std::vector<std::int64_t> indices = sampler.indices();
      std::vector<std::vector<std::int64_t>> batches;
      for (std::size_t i = 0; i < indices.size(); i += batch)
        batches.emplace_back(indices.begin() + static_cast<std::ptrdiff_t>(i),
                             indices.begin() + static_cast<std::ptrdiff_t>(std::min(i + batch, indices.size())));
      steps = batches.size();
      loaders.push_back(std::make_unique<dp::BatchLoader>(*runtime, data, std::move(batches)));
    }
    // Each step is submitted before the previous one's loss is read (as PyTorch defers .item()).
    dp::StepLoss previous;
    double sum = 0.0;
    for (std::size_t step = 0; step < steps; ++step) {
      std::vector<dp::Batch> shards;
      for (auto& loader : loaders) shards.push_back(loader->next());
      dp::StepLoss loss = engine->submit_step(shards);
      if (step > 0) sum += previous.get();
      previous = loss;
    }
    sum += previous.get();
    std::printf("epoch %d: mean train loss %.4f over %zu steps\n", epoch + 1, sum / static_cast<double>(steps), steps);
  }

  // Evaluation: each rank its share of the held-out samples, nothing padded, totals over every rank.
  std::vector<std::vector<float>> pixels(static_cast<std::size_t>(ranks));
  std::vector<std::vector<std::int64_t>> labels(static_cast<std::size_t>(ranks));
  std::vector<dp::Batch> shards;
  for (int rank = 0; rank < ranks; ++rank) {
    for (const std::int64_t k : dp::eval_shard(held_out, ranks, rank)) {
      const std::size_t i = train + static_cast<std::size_t>(k), size = data.sample_pixels();
      for (std::size_t p = 0; p < size; ++p) pixels[rank].push_back(data.pixels[i * size + p] / 255.0f);
      labels[rank].push_back(data.labels[i]);
    }
    shards.push_back(dp::Batch{pixels[rank].data(), labels[rank].data(), static_cast<int>(labels[rank].size())});
  }
  const dp::EvalTotals totals = engine->evaluate(shards);
  std::printf("test: loss %.4f, accuracy %.2f%%\n", totals.mean_loss(), 100.0 * totals.accuracy());

  engine->synchronize();  // the last update has run: the parameters are final
  dp::safetensors::write("train_loop.safetensors", dp::state_dict(engine->model(), runtime->device(0).create_stream()));
  return totals.accuracy() > 0.5 ? 0 : 1;
} catch (const dp::Error& e) {
  std::fprintf(stderr, "train_loop: %s\n", e.what());
  return 2;
}
