// sync_bn_golden.h — SyncBatchNorm against PyTorch: torch's definition of SyncBatchNorm is plain
// BatchNorm over the concatenated batch of all ranks, so DDP with sync_batchnorm over R ranks fed
// the R slices of a golden's batch must reproduce torch's single-process training on the whole
// batch (tests/golden/resnet8_sgd: ResNet-8, BatchNorm in every block, batch 6, 3 SGD steps), up to
// summation order — the same tolerance as the one-device golden test (test_models.cpp).
#pragma once

#include <algorithm>
#include <fmt/format.h>
#include <memory>

#include "dp/engines/ddp.h"
#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/models/resnet.h"
#include "test_util.h"

namespace dp::test {

// `devices`: this process's devices (local ranks); `processes`: null for one process. Every
// process's global ranks together must divide the golden's batch of 6.
// `shards`: EngineOptions::shards (a shard per rank), whose order-free sums change no figure here.
inline void expect_sync_bn_matches_torch(Runtime& rt, const std::vector<int>& devices,
                                         std::shared_ptr<ProcessGroup> processes = nullptr, int shards = 0) {
  const auto golden = safetensors::read(golden_path("resnet8_sgd"));
  const auto& meta = golden.metadata;
  auto model = models::make_resnet8(rt.device(devices[0]), 1);
  load_state_dict(*model, rt.device(devices[0]).create_stream(), golden, "init.");
  EngineOptions options;
  options.device_ids = devices;
  options.sync_batchnorm = true;
  options.processes = std::move(processes);
  options.shards = shards;
  options.kind = EngineKind::ddp;
  const auto engine = make_engine(
      rt, *model,
      SgdOptions{std::stof(meta.at("lr")), std::stof(meta.at("momentum")), std::stof(meta.at("weight_decay")), false},
      options);
  auto& ddp = dynamic_cast<ReplicaEngine&>(*engine);
  const int batch = std::stoi(meta.at("batch")), world = ddp.world_size(), per_rank = batch / world;
  ASSERT_EQ(per_rank * world, batch) << "the ranks must split the golden's batch evenly";
  const auto close = [](const std::vector<float>& got, const std::vector<float>& want) {
    float scale = 0.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    return all_close(got, want, 1e-4, 2e-5 * scale + 1e-7);
  };
  for (int k = 0; k < std::stoi(meta.at("steps")); ++k) {
    SCOPED_TRACE(fmt::format("step {}", k));
    const auto x = golden.at(fmt::format("step{}.input", k)).to_f32();
    const auto y = golden.at(fmt::format("step{}.target", k)).to_i64();
    std::vector<Batch> batches;
    for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
      const int row = (ddp.first_rank() + r) * per_rank;
      batches.push_back(Batch{x.data() + static_cast<std::size_t>(row) * 784, y.data() + row, per_rank});
    }
    // Equal slices: the mean of the ranks' mean losses is the batch's mean loss.
    const float loss = ddp.train_step(batches);
    EXPECT_TRUE(close({loss}, golden.at(fmt::format("step{}.loss", k)).to_f32()));
  }
  ddp.synchronize();
  for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
    SCOPED_TRACE(fmt::format("global rank {}", ddp.first_rank() + r));
    const auto state = state_dict(ddp.replica(r), rt.device(devices[static_cast<std::size_t>(r)]).create_stream());
    for (const auto& name : state.order) {
      const auto& want = golden.at("final." + name);
      if (want.dtype == "I64")
        EXPECT_EQ(state.at(name).to_i64(), want.to_i64()) << name;
      else
        EXPECT_TRUE(close(state.at(name).to_f32(), want.to_f32())) << name;
    }
  }
}

}  // namespace dp::test
