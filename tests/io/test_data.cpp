// test_data.cpp — DistributedSampler's index rules, the seeded permutation, the synthetic set and
// the background loader (its producer thread runs under ThreadSanitizer in CI).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <numeric>
#include <set>
#include <thread>
#include <zlib.h>

#include "dp/io/data.h"
#include "dp/runtime/error.h"
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

// The order is computed a position at a time: a permutation of [0, n) for every n (the domain of
// the network is a power of 4 above n, so most sizes cycle-walk), seeded, the same from index()
// as from indices(), and for an epoch of 2^40 samples no table is made (a vector of its indices
// would need 8 TiB).
TEST(DistributedSampler, TheShuffleIsAPermutationComputedOnePositionAtATime) {
  for (const std::size_t n : {1u, 2u, 3u, 5u, 16u, 17u, 1000u, 4097u}) {
    SCOPED_TRACE(n);
    auto perm = permutation(n, 11);
    EXPECT_EQ(perm, permutation(n, 11));
    std::sort(perm.begin(), perm.end());
    std::vector<std::int64_t> iota(n);
    std::iota(iota.begin(), iota.end(), 0);
    EXPECT_EQ(perm, iota);
  }
  EXPECT_NE(permutation(1000, 11), permutation(1000, 12));
  DistributedSampler sampler(1001, 3, 2, true, 5);
  sampler.set_epoch(4);
  const auto all = sampler.indices();
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(sampler.index(i), all[i]);
  EXPECT_THROW(sampler.index(all.size()), InvalidArgument);
  const DistributedSampler huge(std::size_t{1} << 40, 2, 1, true, 3);
  std::set<std::int64_t> seen;
  for (std::size_t i = 0; i < 1000; ++i) {
    const std::int64_t index = huge.index(i * 7919);
    EXPECT_GE(index, 0);
    EXPECT_LT(index, std::int64_t{1} << 40);
    seen.insert(index);
  }
  EXPECT_EQ(seen.size(), 1000u);
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
    const Batch batch = loader.next();
    ASSERT_EQ(batch.size, static_cast<int>(plan[k].size()));
    for (int i = 0; i < batch.size; ++i) {
      const auto index = static_cast<std::size_t>(plan[k][static_cast<std::size_t>(i)]);
      EXPECT_EQ(batch.targets[i], data.labels[index]);
      for (std::size_t p = 0; p < 784; p += 97)
        EXPECT_EQ(batch.inputs.features()[static_cast<std::size_t>(i) * 784 + p],
                  static_cast<float>(data.pixels[index * 784 + p]) / 255.0f);
    }
    // Pinned staging: the copy to the device is asynchronous, finished before the next batch.
    stream.copy(on_device.data(), batch.inputs.data(), static_cast<std::size_t>(batch.size) * 784 * sizeof(float));
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

// A batch's lease (what an engine holds while it copies the batch in place) keeps its memory from
// being refilled, and alive after the loader has gone; held leases never stall the loader (a lent
// buffer is replaced by new pinned memory).
TEST(BatchLoader, ABatchsLeaseKeepsItsMemory) {
  auto rt = test::sim_runtime(1);
  const Dataset data = make_synthetic(20, 5);
  std::vector<std::vector<std::int64_t>> plan;
  for (std::int64_t k = 0; k < 10; ++k) plan.push_back({k, k + 10});
  const auto expect_batch = [&](const Batch& batch, std::size_t k) {
    ASSERT_EQ(batch.size, 2);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto index = static_cast<std::size_t>(plan[k][i]);
      EXPECT_EQ(batch.targets[i], data.labels[index]) << "batch " << k;
      EXPECT_EQ(batch.inputs.features()[i * 784 + 300], static_cast<float>(data.pixels[index * 784 + 300]) / 255.0f)
          << "batch " << k;
    }
  };
  std::vector<Batch> kept;  // every other batch, with its lease
  {
    BatchLoader loader(*rt, data, plan, 1);  // 3 buffers: batch 3 goes where batch 0 was
    for (std::size_t k = 0; k < plan.size(); ++k) {
      Batch batch = loader.next();
      ASSERT_TRUE(batch.lease);
      EXPECT_TRUE(rt->is_pinned(batch.inputs.data(), 2 * 784 * sizeof(float)));
      EXPECT_TRUE(rt->is_pinned(batch.targets, 2 * sizeof(std::int64_t)));
      expect_batch(batch, k);
      if (k % 2 == 0) kept.push_back(std::move(batch));
      for (std::size_t i = 0; i < kept.size(); ++i) expect_batch(kept[i], 2 * i);  // none overwritten
    }
  }  // the loader goes while batches are lent
  for (std::size_t i = 0; i < kept.size(); ++i) expect_batch(kept[i], 2 * i);
  kept.clear();  // frees them
}

// A plan of 10^12 steps costs nothing up front: the loader asks for each batch just before it fills
// it, never more than its depth ahead of the consumer.
TEST(BatchLoader, AsksThePlanLazily) {
  auto rt = test::sim_runtime(1);
  const Dataset data = make_synthetic(10, 1);
  std::atomic<std::size_t> asked{0};
  BatchLoader loader(*rt, data, std::size_t{1'000'000'000'000}, 2, [&](std::size_t k) {
    ++asked;
    return std::vector<std::int64_t>{static_cast<std::int64_t>(k % 10), static_cast<std::int64_t>((k + 3) % 10)};
  });
  EXPECT_EQ(loader.count(), std::size_t{1'000'000'000'000});
  for (int k = 0; k < 5; ++k) EXPECT_EQ(loader.next().targets[0], data.labels[static_cast<std::size_t>(k % 10)]);
  EXPECT_LE(asked.load(), 5u + 2u) << "at most depth (2) batches ahead";
  // A plan that breaks its promises fails next(), naming the batch.
  BatchLoader bad(*rt, data, 2, 1, [](std::size_t k) { return std::vector<std::int64_t>(k + 1, 0); });
  EXPECT_EQ(bad.next().size, 1);
  EXPECT_THROW(bad.next(), InvalidArgument) << "2 samples where 1 was planned for";
  BatchLoader outside(*rt, data, 1, 1, [](std::size_t) { return std::vector<std::int64_t>{10}; });
  EXPECT_THROW(outside.next(), InvalidArgument) << "sample 10 of a 10-sample set";
}

TEST(BatchLoader, NormalizesAsTorchvision) {
  auto rt = test::sim_runtime(1);
  const Dataset data = make_synthetic(4, 2);
  BatchLoader loader(*rt, data, {{0, 3}}, 2, Normalize{0.2860f, 0.3530f});
  const Batch batch = loader.next();
  for (std::size_t p = 0; p < 2 * 784; p += 13) {
    const std::size_t index = p < 784 ? p : 3 * 784 + (p - 784);
    // ToTensor, then Normalize: two fp32 roundings, the same ones torchvision makes.
    const float want = (static_cast<float>(data.pixels[index]) / 255.0f - 0.2860f) / 0.3530f;
    EXPECT_EQ(batch.inputs.features()[p], want) << p;
  }
  EXPECT_THROW(BatchLoader(*rt, data, {{0}}, 2, Normalize{0.0f, 0.0f}), InvalidArgument);
}

// A source whose sample i is {i, epoch, rank, the thread's ...} so a test sees who made what with
// which key; sample `bad` fails as an unreadable file does.
class KeyedSource : public SampleSource {
 public:
  explicit KeyedSource(std::size_t n, std::size_t bad = SIZE_MAX) : n_(n), bad_(bad) {}
  std::size_t size() const override { return n_; }
  std::vector<std::int64_t> sample_shape() const override { return {3, 1, 2}; }
  int num_classes() const override { return 7; }
  std::int64_t label(std::size_t index) const override { return static_cast<std::int64_t>(index % 7); }
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override {
    if (index == bad_) throw Error(fmt::format("sample {}: unreadable", index));
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // long enough for the workers to share
    const float values[6] = {static_cast<float>(index),
                             static_cast<float>(key.epoch),
                             static_cast<float>(key.rank),
                             static_cast<float>(key.seed),
                             1.0f,
                             2.0f};
    std::memcpy(out.features(), values, sizeof(values));
  }

 private:
  std::size_t n_, bad_;
};

// Workers fill a batch's samples together; every sample lands in its place with its batch's key.
TEST(BatchLoader, WorkersFillEachSampleInItsPlaceWithItsEpochsKey) {
  auto rt = test::sim_runtime(1);
  for (int workers : {0, 1, 3}) {
    LoaderOptions options;
    options.workers = workers;
    options.key = SampleKey{42, 5, 0};
    options.epoch_of = [](std::size_t k) { return static_cast<std::int64_t>(k / 3); };
    auto source = std::make_shared<KeyedSource>(100);
    BatchLoader loader(
        *rt, source, 9, 16,
        [](std::size_t k) {
          std::vector<std::int64_t> indices;
          for (std::size_t i = 0; i < 16 - k; ++i) indices.push_back(static_cast<std::int64_t>((k * 11 + i * 3) % 100));
          return indices;
        },
        options);
    for (std::size_t k = 0; k < 9; ++k) {
      const Batch batch = loader.next();
      ASSERT_EQ(batch.size, static_cast<int>(16 - k));
      for (std::size_t i = 0; i < 16 - k; ++i) {
        const auto index = static_cast<float>((k * 11 + i * 3) % 100);
        const float* sample = batch.inputs.features() + i * 6;
        EXPECT_EQ(sample[0], index) << "workers " << workers << " batch " << k << " sample " << i;
        EXPECT_EQ(sample[1], static_cast<float>(k / 3));
        EXPECT_EQ(sample[2], 5.0f);
        EXPECT_EQ(sample[3], 42.0f);
        EXPECT_EQ(batch.targets[i], static_cast<std::int64_t>(index) % 7);
      }
    }
  }
}

// A sample that cannot be made fails next() with its error (naming it), whichever thread made it.
TEST(BatchLoader, ASampleThatFailsFailsItsBatch) {
  auto rt = test::sim_runtime(1);
  for (int workers : {0, 2}) {
    LoaderOptions options;
    options.workers = workers;
    BatchLoader loader(*rt, std::make_shared<KeyedSource>(40, 13), {{0, 1, 2}, {10, 11, 12, 13, 14, 15}}, options);
    EXPECT_EQ(loader.next().size, 3);
    try {
      loader.next();
      ADD_FAILURE() << "sample 13 is unreadable";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "sample 13: unreadable");
    }
  }
  LoaderOptions bad;
  bad.workers = -1;
  EXPECT_THROW(BatchLoader(*rt, std::make_shared<KeyedSource>(4), {{0}}, bad), InvalidArgument);
}

TEST(EvalShard, CountsEverySampleOnceForAnyWorldSize) {
  for (std::size_t size : {1u, 7u, 10u, 10000u})
    for (int world = 1; world <= 5; ++world) {
      std::vector<int> seen(size, 0);
      for (int rank = 0; rank < world; ++rank)
        for (auto i : eval_shard(size, world, rank)) ++seen[static_cast<std::size_t>(i)];
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<std::ptrdiff_t>(size)) << size << "/" << world;
    }
  EXPECT_EQ(eval_shard(10, 3, 1), (std::vector<std::int64_t>{1, 4, 7}));
  EXPECT_EQ(eval_shard(2, 3, 2), (std::vector<std::int64_t>{}));  // no padding: this rank has nothing
  EXPECT_THROW(eval_shard(10, 3, 3), InvalidArgument);
}

// IDX files written by the tests: plain, gzip-compressed (zlib), or damaged.
class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("dp_idx_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::string be32(std::uint32_t v) {
    return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
  }
  // The bytes of an images and a labels file of `count` samples.
  static std::pair<std::string, std::string> idx(std::uint32_t count) {
    std::string images = be32(0x803) + be32(count) + be32(28) + be32(28), labels = be32(0x801) + be32(count);
    for (std::uint32_t i = 0; i < count * 784; ++i) images += static_cast<char>((i * 31 + i / 784) % 256);
    for (std::uint32_t i = 0; i < count; ++i) labels += static_cast<char>((i * 3) % 10);
    return {images, labels};
  }
  void write(const std::string& name, const std::string& bytes, bool gzip) {
    const std::string path = (dir_ / name).string() + (gzip ? ".gz" : "");
    if (!gzip) {
      std::ofstream(path, std::ios::binary) << bytes;
      return;
    }
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    gzclose(f);
  }
  void write_split(const std::string& prefix, std::uint32_t count, bool gzip) {
    const auto [images, labels] = idx(count);
    write(prefix + "-images-idx3-ubyte", images, gzip);
    write(prefix + "-labels-idx1-ubyte", labels, gzip);
  }
  std::string read_bytes(const std::string& name) {
    std::ifstream in(dir_ / name, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  std::string error_of(Split split = Split::train) {
    try {
      load_mnist(dir_.string(), split);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }
  std::filesystem::path dir_;
};

TEST_F(IdxFiles, GzipAndPlainGiveTheSameDataAndBothSplitsAreFound) {
  write_split("train", 30, false);
  write_split("t10k", 7, true);
  EXPECT_TRUE(has_split(dir_.string(), Split::train));
  EXPECT_TRUE(has_split(dir_.string(), Split::test));
  const Dataset plain = load_mnist(dir_.string()), test = load_mnist(dir_.string(), Split::test);
  EXPECT_EQ(plain.size(), 30u);
  EXPECT_EQ(test.size(), 7u);
  std::filesystem::remove(dir_ / "train-images-idx3-ubyte");
  std::filesystem::remove(dir_ / "train-labels-idx1-ubyte");
  write_split("train", 30, true);
  const Dataset gz = load_mnist(dir_.string());
  EXPECT_EQ(gz.pixels, plain.pixels);
  EXPECT_EQ(gz.labels, plain.labels);
  // The loader turns both into the same batches, bit for bit.
  auto rt = test::sim_runtime(1);
  BatchLoader a(*rt, plain, {{0, 29, 5}}), b(*rt, gz, {{0, 29, 5}});
  const Batch x = a.next(), y = b.next();
  EXPECT_EQ(std::memcmp(x.inputs.data(), y.inputs.data(), 3 * 784 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(x.targets, y.targets, 3 * sizeof(std::int64_t)), 0);
}

TEST_F(IdxFiles, DamagedFilesAreRefusedNamingTheFile) {
  write_split("train", 20, true);
  const std::string gz = read_bytes("train-images-idx3-ubyte.gz");
  // Cut short: the gzip stream ends inside the data.
  std::ofstream(dir_ / "train-images-idx3-ubyte.gz", std::ios::binary) << gz.substr(0, gz.size() / 2);
  EXPECT_NE(error_of().find("train-images-idx3-ubyte.gz: corrupt or truncated gzip stream"), std::string::npos)
      << error_of();
  // Corrupt: the deflate data garbled in the middle.
  std::string garbled = gz;
  for (std::size_t i = gz.size() / 3; i < gz.size() / 3 + 64; ++i) garbled[i] = static_cast<char>(~garbled[i]);
  std::ofstream(dir_ / "train-images-idx3-ubyte.gz", std::ios::binary) << garbled;
  EXPECT_NE(error_of().find("corrupt or truncated gzip stream"), std::string::npos) << error_of();
  // Trailing data after what the header declares (plain file).
  std::filesystem::remove(dir_ / "train-images-idx3-ubyte.gz");
  write("train-images-idx3-ubyte", idx(20).first + "extra", false);
  EXPECT_NE(error_of().find("trailing data"), std::string::npos) << error_of();
  // Truncated plain data.
  write("train-images-idx3-ubyte", idx(20).first.substr(0, 16 + 784 * 3), false);
  EXPECT_NE(error_of().find("truncated"), std::string::npos) << error_of();
  // Not a regular file: a directory where the images should be.
  std::filesystem::remove(dir_ / "train-images-idx3-ubyte");
  std::filesystem::create_directory(dir_ / "train-images-idx3-ubyte");
  EXPECT_NE(error_of().find("train-images-idx3-ubyte: not a regular file"), std::string::npos) << error_of();
  // Missing: neither the plain nor the .gz name.
  EXPECT_NE(error_of(Split::test).find("t10k-images-idx3-ubyte: cannot open (no such file, nor "), std::string::npos)
      << error_of(Split::test);
  EXPECT_FALSE(has_split(dir_.string(), Split::test));
}

// zlib's gzread ignores bytes after a gzip stream that do not start another one: the reader refuses
// them, naming the file; a second gzip member (as `cat a.gz b.gz` makes) is read as gunzip reads it.
TEST_F(IdxFiles, TrailingDataAfterAGzipStreamIsRefused) {
  write_split("train", 20, true);
  const Dataset whole = load_mnist(dir_.string());
  const std::string gz = read_bytes("train-images-idx3-ubyte.gz");
  std::ofstream(dir_ / "train-images-idx3-ubyte.gz", std::ios::binary) << gz << std::string(70, '\0');
  EXPECT_NE(error_of().find("train-images-idx3-ubyte.gz: trailing data after the end of the gzip stream"),
            std::string::npos)
      << error_of();
  std::ofstream(dir_ / "train-labels-idx1-ubyte.gz", std::ios::binary | std::ios::app) << "garbage";
  std::ofstream(dir_ / "train-images-idx3-ubyte.gz", std::ios::binary) << gz;
  EXPECT_NE(error_of().find("train-labels-idx1-ubyte.gz: trailing data"), std::string::npos) << error_of();
  // Two members: the images split after the header, each part its own gzip stream.
  write_split("train", 20, true);
  const std::string images = idx(20).first;
  write("part1", images.substr(0, 16), true);
  write("part2", images.substr(16), true);
  std::ofstream(dir_ / "train-images-idx3-ubyte.gz", std::ios::binary)
      << read_bytes("part1.gz") << read_bytes("part2.gz");
  const Dataset joined = load_mnist(dir_.string());
  EXPECT_EQ(joined.pixels, whole.pixels);
  EXPECT_EQ(joined.labels, whole.labels);
}

TEST(FindDataDir, DirectoriesAndPackageNames) {
  EXPECT_EQ(find_data_dir(::testing::TempDir()), ::testing::TempDir());
  try {
    find_data_dir("no-such-data-set-xyz");
    ADD_FAILURE() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/usr/share/datasets/no-such-data-set-xyz"), std::string::npos) << e.what();
    // No Debian package of that name exists: the hint is to download the files.
    EXPECT_EQ(std::string(e.what()).find("dataset-no-such-data-set-xyz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("download the four IDX files"), std::string::npos) << e.what();
  }
  // Debian has dataset-fashion-mnist, not dataset-mnist: MNIST's hint names only what exists.
  if (!std::filesystem::exists("/usr/share/datasets/mnist") && !std::filesystem::exists("mnist")) {
    try {
      find_data_dir("mnist");
      ADD_FAILURE() << "mnist was found";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find("dataset-mnist"), std::string::npos) << message;
      EXPECT_NE(
          message.find("pass --data DIR, or use --data fashion-mnist after apt-get install dataset-fashion-mnist"),
          std::string::npos)
          << message;
    }
  }
  EXPECT_EQ(find_data_dir("/no/such/dir"), "/no/such/dir");  // reading it then names the missing file
  EXPECT_THROW(find_data_dir(""), Error);
}

}  // namespace
}  // namespace dp
