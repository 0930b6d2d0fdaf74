// data.cpp — IDX parsing with validation, the synthetic set, the sampler, the background loader.
#include "dp/data.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <fstream>
#include <random>

#include "dp/error.h"

namespace dp {
namespace {

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open ({})", path, std::strerror(errno)));
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::uint32_t big_endian(const std::vector<std::uint8_t>& bytes, std::size_t at) {
  return (std::uint32_t{bytes[at]} << 24) | (std::uint32_t{bytes[at + 1]} << 16) | (std::uint32_t{bytes[at + 2]} << 8) |
         std::uint32_t{bytes[at + 3]};
}

}  // namespace

Dataset load_mnist(const std::string& dir) {
  const std::string images_path = dir + "/train-images-idx3-ubyte";
  const std::string labels_path = dir + "/train-labels-idx1-ubyte";
  const auto images = read_file(images_path);
  const auto labels = read_file(labels_path);
  if (images.size() < 16)
    throw Error(fmt::format("{}: truncated: {} bytes, an IDX3 header needs 16", images_path, images.size()));
  if (big_endian(images, 0) != 0x803)
    throw Error(fmt::format("{}: wrong magic 0x{:08x} (expected 0x00000803, unsigned byte images of 3 dimensions)",
                            images_path, big_endian(images, 0)));
  const std::uint32_t count = big_endian(images, 4), rows = big_endian(images, 8), cols = big_endian(images, 12);
  if (rows != 28 || cols != 28)
    throw Error(fmt::format("{}: images are {}x{}, the models need 28x28", images_path, rows, cols));
  const std::uint64_t want = 16 + std::uint64_t{count} * rows * cols;
  if (images.size() != want)
    throw Error(fmt::format("{}: {} bytes but the header promises {} images of {}x{} ({} bytes){}", images_path,
                            images.size(), count, rows, cols, want, images.size() < want ? ": truncated" : ""));
  if (labels.size() < 8)
    throw Error(fmt::format("{}: truncated: {} bytes, an IDX1 header needs 8", labels_path, labels.size()));
  if (big_endian(labels, 0) != 0x801)
    throw Error(fmt::format("{}: wrong magic 0x{:08x} (expected 0x00000801, unsigned byte labels)", labels_path,
                            big_endian(labels, 0)));
  const std::uint32_t label_count = big_endian(labels, 4);
  if (labels.size() != 8 + std::uint64_t{label_count})
    throw Error(fmt::format("{}: {} bytes but the header promises {} labels{}", labels_path, labels.size(), label_count,
                            labels.size() < 8 + std::uint64_t{label_count} ? ": truncated" : ""));
  if (label_count != count)
    throw Error(fmt::format("{} has {} images but {} has {} labels", images_path, count, labels_path, label_count));
  if (count == 0) throw Error(fmt::format("{}: the data set is empty", images_path));
  Dataset data;
  data.pixels.assign(images.begin() + 16, images.end());
  data.labels.resize(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::uint8_t label = labels[8 + i];
    if (label >= 10)
      throw Error(fmt::format("{}: label {} of sample {} is not a class in [0, 10)", labels_path, label, i));
    data.labels[i] = label;
  }
  return data;
}

Dataset make_synthetic(std::size_t samples, std::uint64_t seed) {
  if (samples == 0) throw InvalidArgument("synthetic data set needs at least 1 sample");
  std::mt19937_64 rng(seed);
  // Class patterns: a few bright horizontal and vertical strokes per class.
  std::vector<std::uint8_t> patterns(10 * 784, 0);
  for (int c = 0; c < 10; ++c)
    for (int stroke = 0; stroke < 4; ++stroke) {
      const bool horizontal = (rng() & 1) != 0;
      const int line = 4 + static_cast<int>(rng() % 20), from = static_cast<int>(rng() % 10),
                length = 8 + static_cast<int>(rng() % 10);
      for (int k = 0; k < length && from + k < 28; ++k) {
        const int r = horizontal ? line : from + k, col = horizontal ? from + k : line;
        patterns[static_cast<std::size_t>(c) * 784 + static_cast<std::size_t>(r) * 28 + static_cast<std::size_t>(col)] =
            255;
      }
    }
  Dataset data;
  data.pixels.resize(samples * 784);
  data.labels.resize(samples);
  for (std::size_t i = 0; i < samples; ++i) {
    const int label = static_cast<int>(rng() % 10);
    data.labels[i] = label;
    for (std::size_t p = 0; p < 784; ++p) {
      const int noise = static_cast<int>(rng() % 64);
      const int value = patterns[static_cast<std::size_t>(label) * 784 + p] ? 255 - noise : noise / 2;
      data.pixels[i * 784 + p] = static_cast<std::uint8_t>(value);
    }
  }
  return data;
}

std::vector<std::int64_t> permutation(std::size_t n, std::uint64_t seed) {
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::int64_t>(i);
  // Fisher-Yates with our own bounded draws: std::shuffle's use of the engine is unspecified.
  std::mt19937_64 rng(seed);
  for (std::size_t i = n; i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(rng() % i);
    std::swap(out[i - 1], out[j]);
  }
  return out;
}

DistributedSampler::DistributedSampler(std::size_t dataset_size, int num_replicas, int rank, bool shuffle,
                                       std::uint64_t seed)
    : size_(dataset_size), replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed) {
  if (dataset_size == 0) throw InvalidArgument("DistributedSampler over an empty data set");
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    throw InvalidArgument(fmt::format("DistributedSampler: rank {} of {} replicas", rank, num_replicas));
  num_samples_ = (size_ + static_cast<std::size_t>(replicas_) - 1) / static_cast<std::size_t>(replicas_);
}

std::vector<std::int64_t> DistributedSampler::indices() const {
  std::vector<std::int64_t> all;
  if (shuffle_) {
    all = permutation(size_, seed_ + static_cast<std::uint64_t>(epoch_));
  } else {
    all.resize(size_);
    for (std::size_t i = 0; i < size_; ++i) all[i] = static_cast<std::int64_t>(i);
  }
  const std::size_t total = num_samples_ * static_cast<std::size_t>(replicas_);
  for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i % size_]);  // pad with the head
  std::vector<std::int64_t> mine;
  for (std::size_t i = static_cast<std::size_t>(rank_); i < total; i += static_cast<std::size_t>(replicas_))
    mine.push_back(all[i]);
  return mine;
}

BatchLoader::BatchLoader(Runtime& runtime, const Dataset& data, std::vector<std::vector<std::int64_t>> batches,
                         int depth)
    : data_(data), batches_(std::move(batches)) {
  if (depth < 1) throw InvalidArgument("BatchLoader depth must be >= 1");
  std::size_t largest = 1;
  for (const auto& b : batches_) largest = std::max(largest, b.size());
  // depth + 1 slots: `depth` being filled or waiting, one held by the consumer.
  slots_.resize(static_cast<std::size_t>(depth) + 1);
  for (auto& slot : slots_) {
    slot.inputs = runtime.allocate_pinned(largest * data_.sample_pixels() * sizeof(float));
    slot.targets = runtime.allocate_pinned(largest * sizeof(std::int64_t));
  }
  worker_ = std::thread([this] { produce(); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void BatchLoader::produce() {
  const std::size_t depth = slots_.size() - 1;
  for (std::size_t k = 0; k < batches_.size(); ++k) {
    {
      std::unique_lock lock(mutex_);
      // Slot k % (depth+1) is free once batch k-(depth+1) was handed out and the consumer moved on.
      cv_.wait(lock, [&] { return stop_ || k < consumed_ + depth; });
      if (stop_) return;
    }
    Slot& slot = slots_[k % slots_.size()];
    const auto& indices = batches_[k];
    float* inputs = slot.inputs.as<float>();
    std::int64_t* targets = slot.targets.as<std::int64_t>();
    const std::size_t pixels = data_.sample_pixels();
    for (std::size_t i = 0; i < indices.size(); ++i) {
      const auto index = static_cast<std::size_t>(indices[i]);
      const std::uint8_t* src = data_.pixels.data() + index * pixels;
      for (std::size_t p = 0; p < pixels; ++p) inputs[i * pixels + p] = static_cast<float>(src[p]) / 255.0f;
      targets[i] = data_.labels[index];
    }
    slot.size = static_cast<int>(indices.size());
    {
      std::lock_guard lock(mutex_);
      ++produced_;
    }
    cv_.notify_all();
  }
}

HostBatch BatchLoader::next() {
  std::unique_lock lock(mutex_);
  if (consumed_ >= batches_.size()) throw Error("BatchLoader: all batches were consumed");
  cv_.wait(lock, [&] { return produced_ > consumed_; });
  const Slot& slot = slots_[consumed_ % slots_.size()];
  ++consumed_;
  cv_.notify_all();
  return HostBatch{slot.inputs.as<float>(), slot.targets.as<std::int64_t>(), slot.size};
}

}  // namespace dp
