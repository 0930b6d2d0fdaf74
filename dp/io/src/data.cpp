// data.cpp — IDX parsing with validation, the synthetic set, the sampler, the background loader.
#include "dp/io/data.h"

#include <Random123/philox.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <memory>
#include <optional>
#include <random>
#include <zlib.h>

#include "dp/runtime/error.h"

namespace dp {
namespace {

// One IDX file, plain or gzip-compressed, read as a stream: nothing is held beyond a 64 KiB block
// and what the caller asks for, so a forged header cannot make us buffer a whole huge file. Inflated here rather than
// with gzread, which silently ignores whatever follows a gzip stream that is not another one.
class IdxStream {
 public:
  explicit IdxStream(std::string path) : path_(std::move(path)) {
    std::error_code ec;
    // Regular files only: a directory, a FIFO or a device (a link to /dev/zero) would block, read
    // forever or fail with a message naming no file.
    if (!std::filesystem::is_regular_file(path_, ec)) throw Error(fmt::format("{}: not a regular file", path_));
    file_.reset(std::fopen(path_.c_str(), "rb"));
    if (!file_) throw Error(fmt::format("{}: cannot open ({})", path_, std::strerror(errno)));
    // gzip's magic bytes first: inflated; any other file is read as it is.
    gzip_ = refill() >= 2 && in_[0] == 0x1f && in_[1] == 0x8b;
    if (gzip_ && inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) throw Error(fmt::format("{}: zlib failed", path_));
  }
  ~IdxStream() {
    if (gzip_) inflateEnd(&z_);
  }
  IdxStream(const IdxStream&) = delete;
  IdxStream& operator=(const IdxStream&) = delete;

  const std::string& path() const { return path_; }

  // Up to `bytes` more bytes; fewer only at the end of the data. Throws on a corrupt gzip stream.
  std::size_t read(void* out, std::size_t bytes) {
    auto* to = static_cast<unsigned char*>(out);
    if (gzip_) return inflate_into(to, bytes);
    std::size_t got = 0;
    while (got < bytes && (at_ < have_ || refill() > 0)) {
      const std::size_t n = std::min(bytes - got, have_ - at_);
      std::memcpy(to + got, in_.data() + at_, n);
      at_ += n;
      got += n;
    }
    return got;
  }

  // The header: `words` big-endian 32-bit integers.
  template <std::size_t N>
  std::array<std::uint32_t, N> header(const char* kind) {
    unsigned char bytes[4 * N];
    const std::size_t got = read(bytes, sizeof bytes);
    if (got < sizeof bytes)
      throw Error(fmt::format("{}: truncated: {} bytes, an {} header needs {}", path_, got, kind, sizeof bytes));
    std::array<std::uint32_t, N> words{};
    for (std::size_t i = 0; i < N; ++i)
      words[i] = (std::uint32_t{bytes[4 * i]} << 24) | (std::uint32_t{bytes[4 * i + 1]} << 16) |
                 (std::uint32_t{bytes[4 * i + 2]} << 8) | std::uint32_t{bytes[4 * i + 3]};
    return words;
  }

  // Exactly `bytes` of data and then the end of the file: grown as it arrives (memory follows what
  // the file really holds, not what its header claims).
  std::vector<std::uint8_t> body(std::uint64_t bytes, const std::string& what) {
    std::vector<std::uint8_t> out;
    constexpr std::uint64_t kChunk = 16u << 20;
    while (out.size() < bytes) {
      const std::size_t at = out.size();
      const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, bytes - at));
      out.resize(at + want);
      const std::size_t got = read(out.data() + at, want);
      if (got < want)
        throw Error(fmt::format("{}: truncated: the header promises {} ({} bytes) but the data ends after {}", path_,
                                what, bytes, at + got));
    }
    unsigned char extra = 0;
    if (read(&extra, 1) != 0)
      throw Error(fmt::format("{}: trailing data after the {} ({} bytes) the header declares", path_, what, bytes));
    return out;
  }

 private:
  [[noreturn]] void fail(const char* why) {
    throw Error(fmt::format("{}: corrupt or truncated gzip stream ({})", path_, why));
  }

  // The next block of the file into in_; 0 at its end.
  std::size_t refill() {
    at_ = 0;
    have_ = std::fread(in_.data(), 1, in_.size(), file_.get());
    if (have_ == 0 && std::ferror(file_.get()))
      throw Error(fmt::format("{}: read failed ({})", path_, std::strerror(errno)));
    return have_;
  }

  std::size_t inflate_into(unsigned char* out, std::size_t bytes) {
    std::size_t got = 0;
    while (got < bytes && !ended_) {
      if (at_ == have_ && refill() == 0) fail("unexpected end of file");
      z_.next_in = in_.data() + at_;
      z_.avail_in = static_cast<uInt>(have_ - at_);
      z_.next_out = out + got;
      z_.avail_out = static_cast<uInt>(std::min<std::size_t>(bytes - got, std::size_t{1} << 30));
      const uInt room = z_.avail_out;
      const int code = inflate(&z_, Z_NO_FLUSH);
      got += room - z_.avail_out;
      at_ = have_ - z_.avail_in;
      if (code == Z_STREAM_END) {
        end_member();
      } else if (code != Z_OK && code != Z_BUF_ERROR) {
        fail(z_.msg ? z_.msg : "inflate failed");
      }
    }
    return got;
  }

  // After a gzip member: the end of the file, or another member (as `cat a.gz b.gz` makes, which
  // gunzip reads whole). Anything else is refused: it is not data the file's header declares.
  void end_member() {
    if (at_ == have_ && refill() == 0) {
      ended_ = true;
      return;
    }
    if (in_[at_] != 0x1f)
      throw Error(fmt::format("{}: trailing data after the end of the gzip stream (not another gzip member)", path_));
    inflateReset(&z_);
  }

  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, &std::fclose};
  std::vector<unsigned char> in_ = std::vector<unsigned char>(1 << 16);  // in_[at_, have_): read, not yet used
  std::size_t at_ = 0, have_ = 0;
  bool gzip_ = false, ended_ = false;
  z_stream z_{};
};

const char* prefix(Split split) { return split == Split::train ? "train" : "t10k"; }

// DIR/name, or DIR/name.gz when only that exists; nullopt when neither does.
std::optional<std::string> existing_idx(const std::string& dir, const std::string& name) {
  const std::string plain = fmt::format("{}/{}", dir, name), gz = plain + ".gz";
  std::error_code ec;
  if (std::filesystem::exists(plain, ec)) return plain;
  if (std::filesystem::exists(gz, ec)) return gz;
  return std::nullopt;
}

// existing_idx, or Error naming both names.
std::string idx_path(const std::string& dir, const std::string& name) {
  if (auto path = existing_idx(dir, name)) return *path;
  throw Error(fmt::format("{}/{}: cannot open (no such file, nor {}.gz)", dir, name, name));
}

}  // namespace

std::string find_data_dir(const std::string& dir_or_name) {
  if (dir_or_name.empty()) throw Error("--data: empty path (a directory, or a data set name such as fashion-mnist)");
  std::error_code ec;
  // A path is taken as given: if it is wrong, reading names the file that is missing.
  if (dir_or_name.find('/') != std::string::npos || std::filesystem::is_directory(dir_or_name, ec)) return dir_or_name;
  const std::string package = fmt::format("/usr/share/datasets/{}", dir_or_name);
  if (std::filesystem::is_directory(package, ec)) return package;
  // Only a package Debian really has is suggested: it packages Fashion-MNIST, not MNIST.
  const std::string hint =
      dir_or_name == "fashion-mnist"
          ? "Debian: apt-get install dataset-fashion-mnist"
          : "download the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
            "t10k-labels-idx1-ubyte; plain or .gz) from a source of your choice into a directory and pass --data DIR, "
            "or use --data fashion-mnist after apt-get install dataset-fashion-mnist";
  throw Error(fmt::format("{}: no such directory, nor an installed data set {} ({})", dir_or_name, package, hint));
}

bool has_split(const std::string& dir, Split split) {
  for (const char* kind : {"images-idx3-ubyte", "labels-idx1-ubyte"})
    if (!existing_idx(dir, fmt::format("{}-{}", prefix(split), kind))) return false;
  return true;
}

Dataset load_mnist(const std::string& dir, Split split) {
  IdxStream images(idx_path(dir, fmt::format("{}-images-idx3-ubyte", prefix(split))));
  IdxStream labels(idx_path(dir, fmt::format("{}-labels-idx1-ubyte", prefix(split))));
  const auto [magic, count, rows, cols] = images.header<4>("IDX3");
  if (magic != 0x803)
    throw Error(fmt::format("{}: wrong magic 0x{:08x} (expected 0x00000803, unsigned byte images of 3 dimensions)",
                            images.path(), magic));
  if (rows != 28 || cols != 28)
    throw Error(fmt::format("{}: images are {}x{}, the models need 28x28", images.path(), rows, cols));
  const auto [label_magic, label_count] = labels.header<2>("IDX1");
  if (label_magic != 0x801)
    throw Error(fmt::format("{}: wrong magic 0x{:08x} (expected 0x00000801, unsigned byte labels)", labels.path(),
                            label_magic));
  if (label_count != count)
    throw Error(fmt::format("{} has {} images but {} has {} labels", images.path(), count, labels.path(), label_count));
  if (count == 0) throw Error(fmt::format("{}: the data set is empty", images.path()));
  Dataset data;
  data.pixels = images.body(std::uint64_t{count} * rows * cols, fmt::format("{} images of {}x{}", count, rows, cols));
  const auto raw_labels = labels.body(count, fmt::format("{} labels", count));
  data.labels.resize(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::uint8_t label = raw_labels[i];
    if (label >= 10)
      throw Error(fmt::format("{}: label {} of sample {} is not a class in [0, 10)", labels.path(), label, i));
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

std::vector<std::int64_t> eval_shard(std::size_t size, int replicas, int rank) {
  if (replicas < 1 || rank < 0 || rank >= replicas)
    throw InvalidArgument(fmt::format("eval_shard: rank {} of {} replicas", rank, replicas));
  std::vector<std::int64_t> mine;
  for (std::size_t i = static_cast<std::size_t>(rank); i < size; i += static_cast<std::size_t>(replicas))
    mine.push_back(static_cast<std::int64_t>(i));
  return mine;
}

Shuffle::Shuffle(std::uint64_t n, std::uint64_t seed) : n_(n), seed_(seed), half_bits_(1) {
  if (n == 0) throw InvalidArgument("Shuffle of an empty range");
  while (half_bits_ < 32 && (std::uint64_t{1} << (2 * half_bits_)) < n) ++half_bits_;
}

// One pass of the network over the 2 * half_bits_ domain: six rounds, each mixing one half into the
// other with Philox4x32-10 keyed by the seed (counter: the half, the round).
std::uint64_t Shuffle::once(std::uint64_t x) const {
  const std::uint64_t mask = (std::uint64_t{1} << half_bits_) - 1;
  std::uint64_t left = x >> half_bits_, right = x & mask;
  const r123::Philox4x32::key_type key = {{static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32)}};
  for (std::uint32_t round = 0; round < 6; ++round) {
    const r123::Philox4x32::ctr_type counter = {
        {static_cast<std::uint32_t>(right), static_cast<std::uint32_t>(right >> 32), round, 0x5eed}};
    const auto r = r123::Philox4x32()(counter, key);
    const std::uint64_t f = (static_cast<std::uint64_t>(r[1]) << 32 | r[0]) & mask;
    const std::uint64_t next = left ^ f;
    left = right;
    right = next;
  }
  return left << half_bits_ | right;
}

std::uint64_t Shuffle::operator()(std::uint64_t position) const {
  if (position >= n_) throw InvalidArgument(fmt::format("Shuffle: position {} of {}", position, n_));
  // The network permutes the whole domain; following a position's cycle until it lands below n is
  // a permutation of [0, n) (cycle walking).
  std::uint64_t x = once(position);
  while (x >= n_) x = once(x);
  return x;
}

std::vector<std::int64_t> permutation(std::size_t n, std::uint64_t seed) {
  const Shuffle shuffle(n, seed);
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::int64_t>(shuffle(i));
  return out;
}

DistributedSampler::DistributedSampler(std::size_t dataset_size, int num_replicas, int rank, bool shuffle,
                                       std::uint64_t seed)
    : size_(dataset_size), replicas_(num_replicas), rank_(rank), shuffle_(shuffle), seed_(seed) {
  if (dataset_size == 0) throw InvalidArgument("DistributedSampler over an empty data set");
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    throw InvalidArgument(fmt::format("DistributedSampler: rank {} of {} replicas", rank, num_replicas));
  num_samples_ = (size_ + static_cast<std::size_t>(replicas_) - 1) / static_cast<std::size_t>(replicas_);
  set_epoch(0);
}

std::int64_t DistributedSampler::index(std::size_t i) const {
  if (i >= num_samples_)
    throw InvalidArgument(fmt::format("DistributedSampler: index {} of {} samples", i, num_samples_));
  // Position i * R + r of the epoch's list, padded to R * num_samples by repeating its head.
  const std::size_t position = (i * static_cast<std::size_t>(replicas_) + static_cast<std::size_t>(rank_)) % size_;
  return static_cast<std::int64_t>(order_ ? (*order_)(position) : position);
}

std::vector<std::int64_t> DistributedSampler::indices() const {
  std::vector<std::int64_t> mine(num_samples_);
  for (std::size_t i = 0; i < num_samples_; ++i) mine[i] = index(i);
  return mine;
}

namespace {

void check_normalize(Normalize normalize) {
  if (!(normalize.std > 0.0f) || !std::isfinite(normalize.std) || !std::isfinite(normalize.mean))
    throw InvalidArgument(fmt::format("normalisation needs a finite mean and a std > 0, got mean {} std {}",
                                      normalize.mean, normalize.std));
}

}  // namespace

DatasetSource::DatasetSource(Dataset data, Normalize normalize)
    : owned_(std::move(data)), data_(&owned_), normalize_(normalize) {
  check_normalize(normalize);
}

DatasetSource::DatasetSource(const Dataset* data, Normalize normalize) : data_(data), normalize_(normalize) {
  check_normalize(normalize);
}

void DatasetSource::fill(std::size_t index, const SampleKey&, InputsOut to) const {
  float* out = to.features();
  const std::size_t pixels = data_->sample_pixels();
  const std::uint8_t* src = data_->pixels.data() + index * pixels;
  // As torchvision: ToTensor divides by 255, Normalize subtracts and divides, each rounded in fp32
  // (mean 0, std 1 leave the quotient exactly as it is).
  for (std::size_t p = 0; p < pixels; ++p)
    out[p] = (static_cast<float>(src[p]) / 255.0f - normalize_.mean) / normalize_.std;
}

namespace {

// A Dataset the caller keeps alive, read in place.
std::shared_ptr<const SampleSource> borrowed(const Dataset& data, Normalize normalize) {
  return std::make_shared<DatasetSource>(&data, normalize);
}

LoaderOptions with_depth(int depth) {
  LoaderOptions options;
  options.depth = depth;
  return options;
}

}  // namespace

BatchLoader::BatchLoader(Runtime& runtime, const Dataset& data, std::vector<std::vector<std::int64_t>> batches,
                         int depth, Normalize normalize)
    : BatchLoader(Held::of(std::move(batches)), runtime, borrowed(data, normalize), with_depth(depth)) {}

BatchLoader::BatchLoader(Runtime& runtime, std::shared_ptr<const SampleSource> source,
                         std::vector<std::vector<std::int64_t>> batches, LoaderOptions options)
    : BatchLoader(Held::of(std::move(batches)), runtime, std::move(source), std::move(options)) {}

BatchLoader::Held BatchLoader::Held::of(std::vector<std::vector<std::int64_t>> batches) {
  Held held{batches.size(), 1, {}};
  for (const auto& b : batches) held.max_batch = std::max(held.max_batch, b.size());
  auto shared = std::make_shared<std::vector<std::vector<std::int64_t>>>(std::move(batches));
  held.plan = [shared](std::size_t k) { return std::move((*shared)[k]); };  // each batch is asked for once
  return held;
}

BatchLoader::BatchLoader(Held held, Runtime& runtime, std::shared_ptr<const SampleSource> source, LoaderOptions options)
    : BatchLoader(runtime, std::move(source), held.count, held.max_batch, std::move(held.plan), std::move(options)) {}

BatchLoader::BatchLoader(Runtime& runtime, const Dataset& data, std::size_t count, std::size_t max_batch,
                         BatchPlan plan, int depth, Normalize normalize)
    : BatchLoader(runtime, borrowed(data, normalize), count, max_batch, std::move(plan), with_depth(depth)) {}

BatchLoader::BatchLoader(Runtime& runtime, std::shared_ptr<const SampleSource> source, std::size_t count,
                         std::size_t max_batch, BatchPlan plan, LoaderOptions options)
    : runtime_(runtime),
      source_(std::move(source)),
      count_(count),
      max_batch_(std::max<std::size_t>(max_batch, 1)),
      sample_elements_(source_ ? source_->sample_elements() : 0),
      plan_(std::move(plan)),
      options_(std::move(options)) {
  if (!source_) throw InvalidArgument("BatchLoader needs a sample source");
  if (options_.depth < 1) throw InvalidArgument("BatchLoader depth must be >= 1");
  if (options_.workers < 0 || options_.workers > 256)
    throw InvalidArgument(fmt::format("BatchLoader workers must be in [0, 256], got {}", options_.workers));
  if (!plan_) throw InvalidArgument("BatchLoader needs a plan");
  // depth + 2 slots: `depth` being filled or waiting, one held by the consumer, one an engine may
  // still be copying from (its lease: a pipelined engine holds the last two batches at most), so a
  // steady training loop never needs new memory.
  slots_.resize(static_cast<std::size_t>(options_.depth) + 2);
  for (auto& slot : slots_) slot.memory = make_memory();
  // The producer fills too, so `workers` threads in all make samples (DataLoader's num_workers).
  for (int w = 1; w < options_.workers; ++w) workers_.emplace_back([this] { work(); });
  worker_ = std::thread([this] { produce(); });
}

std::shared_ptr<BatchLoader::Memory> BatchLoader::make_memory() const {
  auto memory = std::make_shared<Memory>();
  memory->inputs = runtime_.allocate_pinned(max_batch_ * sample_elements_ * dtype_size(source_->sample_dtype()));
  memory->targets = runtime_.allocate_pinned(max_batch_ * static_cast<std::size_t>(source_->targets_per_sample()) *
                                             sizeof(std::int64_t));
  return memory;
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  {
    std::lock_guard lock(job_mutex_);
    quit_ = true;
  }
  job_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

// A worker: joins each job as it is posted and takes its samples until none is left.
void BatchLoader::work() {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(job_mutex_);
      job_cv_.wait(lock, [&] { return quit_ || job_.generation != seen; });
      if (quit_) return;
      seen = job_.generation;
      // A job already finished (this thread woke late) is gone: its samples may no longer exist.
      if (job_.indices == nullptr) continue;
      ++job_.active;  // the producer ends this job only once this thread has left it
    }
    take_samples();
  }
}

// Fills the job's samples one at a time, the next one not yet taken, then reports (its part done,
// its first failure) and leaves the job. The caller joined it under job_mutex_.
void BatchLoader::take_samples() {
  const std::vector<std::int64_t>& indices = *job_.indices;
  std::size_t filled = 0;
  std::exception_ptr error;
  for (std::size_t i; (i = job_.next.fetch_add(1, std::memory_order_relaxed)) < indices.size();) {
    try {
      source_->fill(static_cast<std::size_t>(indices[i]), job_.key, job_.inputs.advanced(i * sample_elements_));
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    ++filled;
  }
  std::lock_guard lock(job_mutex_);
  job_.done += filled;
  --job_.active;
  if (error && !job_.error) job_.error = error;
  if (job_.active == 0) done_cv_.notify_all();
}

void BatchLoader::fill_batch(std::size_t k, const std::vector<std::int64_t>& indices, InputsOut inputs) {
  SampleKey key = options_.key;
  key.epoch = options_.epoch_of ? options_.epoch_of(k) : 0;
  if (options_.rank_of) key.rank = options_.rank_of(k);
  if (workers_.empty()) {
    for (std::size_t i = 0; i < indices.size(); ++i)
      source_->fill(static_cast<std::size_t>(indices[i]), key, inputs.advanced(i * sample_elements_));
    return;
  }
  {
    std::lock_guard lock(job_mutex_);
    job_.indices = &indices;
    job_.inputs = inputs;
    job_.key = key;
    job_.next.store(0, std::memory_order_relaxed);
    job_.done = 0;
    job_.error = nullptr;
    job_.active = 1;  // this thread
    ++job_.generation;
  }
  job_cv_.notify_all();
  take_samples();
  std::unique_lock lock(job_mutex_);
  // Every sample made and every worker gone from the job: its fields may change for the next one.
  done_cv_.wait(lock, [&] { return job_.active == 0; });
  job_.indices = nullptr;  // ended: a worker waking only now does not join it
  if (job_.error) std::rethrow_exception(job_.error);
}

void BatchLoader::produce() {
  const std::size_t depth = slots_.size() - 2;
  for (std::size_t k = 0; k < count_; ++k) {
    const std::size_t index = k % slots_.size();
    {
      std::unique_lock lock(mutex_);
      // Slot k % (depth+2) is free once batch k-(depth+2) was handed out and the consumer is two
      // batches past it.
      cv_.wait(lock, [&] { return stop_ || k < consumed_ + depth; });
      if (stop_) return;
    }
    try {
      Slot& slot = slots_[index];
      // Still lent (an engine copying from it, a caller keeping the batch): it stays with its leases.
      // Acquire: a lease released has finished reading before this slot is written again.
      if (slot.memory->leases.load(std::memory_order_acquire) != 0) slot.memory = make_memory();
      const std::vector<std::int64_t> indices = plan_(k);
      if (indices.size() > max_batch_)
        throw InvalidArgument(fmt::format("BatchLoader: batch {} has {} samples, more than the {} planned for", k,
                                          indices.size(), max_batch_));
      std::int64_t* targets = slot.memory->targets.as<std::int64_t>();
      for (std::size_t i = 0; i < indices.size(); ++i) {
        if (indices[i] < 0 || static_cast<std::size_t>(indices[i]) >= source_->size())
          throw InvalidArgument(fmt::format("BatchLoader: sample {} of batch {} is outside the {} samples", indices[i],
                                            k, source_->size()));
        source_->fill_targets(static_cast<std::size_t>(indices[i]),
                              targets + i * static_cast<std::size_t>(source_->targets_per_sample()));
      }
      fill_batch(k, indices, {slot.memory->inputs.data(), source_->sample_dtype()});
      slot.size = static_cast<int>(indices.size());
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      cv_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      ++produced_;
    }
    cv_.notify_all();
  }
}

Batch BatchLoader::next() {
  std::unique_lock lock(mutex_);
  if (consumed_ >= count_) throw Error("BatchLoader: all batches were consumed");
  cv_.wait(lock, [&] { return produced_ > consumed_ || error_; });
  if (produced_ <= consumed_) std::rethrow_exception(error_);
  const Slot& slot = slots_[consumed_ % slots_.size()];
  ++consumed_;
  std::shared_ptr<Memory> memory = slot.memory;  // the producer may replace the slot's memory later
  const int size = slot.size;
  memory->leases.fetch_add(1, std::memory_order_relaxed);  // the producer reads it under mutex_
  lock.unlock();
  cv_.notify_all();
  // The deleter runs where the last copy goes (an engine's ring, on any thread, maybe after the
  // loader has gone) and keeps the memory until then. (If making the lease throws, it runs at once.)
  const Inputs inputs{memory->inputs.data(), source_->sample_dtype()};
  const std::int64_t* targets = memory->targets.as<std::int64_t>();
  std::shared_ptr<const void> lease(inputs.data(), [memory](const void*) {
    memory->leases.fetch_sub(1, std::memory_order_release);  // its holder's reads are done
  });
  return Batch{inputs, targets, size, std::move(lease)};
}

}  // namespace dp
