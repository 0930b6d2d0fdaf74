// test_data.cpp — DistributedSampler's index rules, the seeded permutation, the synthetic set and
// the background loader (its producer thread runs under ThreadSanitizer in CI).
#include <gtest/gtest.h>
#include <numeric>
#include <set>

#include "dp/data.h"
#include "dp/error.h"
#include "test_util.h"

namespace dp {
namespace {

TEST(DistributedSampler, PadsWithTheHeadAndInterleavesRanks) {
  // torch: 10 samples, 3 replicas -> num_samples 4, total 12, padded with indices 0 and 1.
  const std::vector<std::vector<std::int64_t>> want = {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}};
  for (int rank = 0; rank < 3; ++rank) {
    DistributedSampler sampler(10, 3, rank, false, 0);
    EXPECT_EQ(sampler.num_samples(), 4u);
    EXPECT_EQ(sampler.indices(), want[static_cast<std::size_t>(rank)]) << "rank " << rank;
  }
  // Fewer samples than replicas: the head repeats more than once.
  EXPECT_EQ(DistributedSampler(2, 5, 4, false, 0).indices(), (std::vector<std::int64_t>{0}));
  EXPECT_EQ(DistributedSampler(2, 5, 3, false, 0).indices(), (std::vector<std::int64_t>{1}));
  EXPECT_THROW(DistributedSampler(0, 1, 0, false, 0), InvalidArgument);
  EXPECT_THROW(DistributedSampler(5, 2, 2, false, 0), InvalidArgument);
}

TEST(DistributedSampler, ShuffleIsSeededByEpochAndSharedByRanks) {
  DistributedSampler r0(9, 2, 0, true, 42), r1(9, 2, 1, true, 42);
  const auto a0 = r0.indices(), a1 = r1.indices();
  // Together the ranks cover every sample (plus one pad) of one permutation.
  std::set<std::int64_t> seen(a0.begin(), a0.end());
  seen.insert(a1.begin(), a1.end());
  EXPECT_EQ(seen.size(), 9u);
  const auto perm = permutation(9, 42);
  for (std::size_t i = 0; i < a0.size(); ++i) EXPECT_EQ(a0[i], perm[(2 * i) % 9]);
  r0.set_epoch(1);
  EXPECT_NE(r0.indices(), a0) << "a new epoch reshuffles";
  r0.set_epoch(0);
  EXPECT_EQ(r0.indices(), a0) << "the same epoch gives the same order";
  auto sorted = permutation(1000, 7);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> iota(1000);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
}

TEST(SyntheticData, IsDeterministicAndValid) {
  const Dataset a = make_synthetic(100, 3), b = make_synthetic(100, 3), c = make_synthetic(100, 4);
  EXPECT_EQ(a.pixels, b.pixels);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_NE(a.pixels, c.pixels);
  EXPECT_EQ(a.pixels.size(), 100u * 784);
  for (auto label : a.labels) EXPECT_TRUE(label >= 0 && label < 10);
  EXPECT_THROW(make_synthetic(0, 1), InvalidArgument);
}

TEST(BatchLoader, DeliversEveryBatchInOrderFromPinnedMemory) {
  auto rt = test::sim_runtime(1);
  const Dataset data = make_synthetic(50, 9);
  std::vector<std::vector<std::int64_t>> plan;
  for (int k = 0; k < 20; ++k) plan.push_back({k % 50, (k * 7) % 50, (k * 13 + 1) % 50});
  plan.push_back({49});  // a short last batch
  BatchLoader loader(*rt, data, plan, 2);
  DeviceBuffer on_device = rt->device(0).allocate(3 * 784 * sizeof(float));
  Stream stream = rt->device(0).create_stream();
  for (std::size_t k = 0; k < plan.size(); ++k) {
    const HostBatch batch = loader.next();
    ASSERT_EQ(batch.size, static_cast<int>(plan[k].size()));
    for (int i = 0; i < batch.size; ++i) {
      const auto index = static_cast<std::size_t>(plan[k][static_cast<std::size_t>(i)]);
      EXPECT_EQ(batch.targets[i], data.labels[index]);
      for (std::size_t p = 0; p < 784; p += 97)
        EXPECT_EQ(batch.inputs[static_cast<std::size_t>(i) * 784 + p],
                  static_cast<float>(data.pixels[index * 784 + p]) / 255.0f);
    }
    // Pinned staging: the copy to the device is asynchronous, finished before the next batch.
    stream.copy(on_device.data(), batch.inputs, static_cast<std::size_t>(batch.size) * 784 * sizeof(float));
    stream.synchronize();
  }
  EXPECT_THROW(loader.next(), Error);
}

TEST(BatchLoader, StopsCleanlyWhenDroppedEarly) {
  auto rt = test::sim_runtime(1);
  const Dataset data = make_synthetic(10, 1);
  std::vector<std::vector<std::int64_t>> plan(100, std::vector<std::int64_t>{1, 2, 3});
  BatchLoader loader(*rt, data, plan, 3);
  EXPECT_EQ(loader.next().size, 3);
}  // the producer is blocked on a full queue: the destructor must wake and join it

}  // namespace
}  // namespace dp
