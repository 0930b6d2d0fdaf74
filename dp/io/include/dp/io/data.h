// dp/io/data.h — training data: MNIST IDX files (validated), a learnable synthetic set, PyTorch's
// DistributedSampler index rules, and a loader that prepares the next batches in a background
// thread into pinned staging buffers so devices do not wait for the host.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dp/io/sample_source.h"
#include "dp/nn/batch.h"
#include "dp/runtime/device.h"

namespace dp {

struct Dataset {
  int rows = 28, cols = 28;
  std::vector<std::uint8_t> pixels;  // N x rows x cols
  std::vector<std::int64_t> labels;  // N, in [0, 10)
  std::size_t size() const { return labels.size(); }
  std::size_t sample_pixels() const { return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols); }
};

// The two splits of an MNIST-format data set: `train` (files train-*) and `test` (files t10k-*).
enum class Split { train, test };

// Where the data set a --data argument names lives: a path as given (reading it names any missing
// file), a directory in the working directory, or, for a bare name such as "fashion-mnist", the
// Debian data set package's directory /usr/share/datasets/<name>. Throws Error naming what was
// looked for when a bare name is neither.
std::string find_data_dir(const std::string& dir_or_name);

// Whether `dir` holds the image and label files of `split` (plain or .gz).
bool has_split(const std::string& dir, Split split);

// Reads DIR/<prefix>-images-idx3-ubyte and DIR/<prefix>-labels-idx1-ubyte (prefix train or t10k),
// each plain or gzip-compressed (the same name + ".gz"), streamed: the header first, then exactly
// the bytes it declares (big-endian IDX, magic 0x803 / 0x801). Throws dp::Error naming the file and
// the problem: missing, not a regular file, truncated, trailing data, a corrupt gzip stream, wrong
// magic, images not 28x28, counts that differ, a label >= 10.
Dataset load_mnist(const std::string& dir, Split split = Split::train);

// `samples` images of 10 classes: each class a fixed random pattern of strokes plus per-sample
// noise, so a model can learn it quickly. Deterministic in `seed`.
Dataset make_synthetic(std::size_t samples, std::uint64_t seed);

// The permutation of [0, n) used for shuffling, seeded, the same on every platform, and computed
// one position at a time: a keyed bijection (a balanced Feistel network of Philox rounds over the
// smallest domain of an even number of bits that holds n, cycle-walked back into [0, n): fewer
// than four rounds of the network per position on average), so no table of n indices is kept.
class Shuffle {
 public:
  Shuffle(std::uint64_t n, std::uint64_t seed);
  std::uint64_t operator()(std::uint64_t position) const;

 private:
  std::uint64_t once(std::uint64_t x) const;
  std::uint64_t n_, seed_;
  int half_bits_;
};

// torch.utils.data.DistributedSampler(num_replicas, rank, shuffle, seed, drop_last=False):
// num_samples = ceil(N / R); the index list (a permutation seeded with seed + epoch when shuffling,
// identical on all ranks) is padded by repeating its head to R * num_samples, and rank r takes
// indices[r::R]. With R = 1 and no shuffle it is simply 0..N-1 (the order single and DP use).
// Nothing is stored: index(i) computes the i-th of this rank's indices, so an epoch of a billion
// samples (every offset of a 1 GiB text) costs no memory.
class DistributedSampler {
 public:
  DistributedSampler(std::size_t dataset_size, int num_replicas, int rank, bool shuffle, std::uint64_t seed);
  void set_epoch(std::int64_t epoch) {
    epoch_ = epoch;
    if (shuffle_) order_ = Shuffle(size_, seed_ + static_cast<std::uint64_t>(epoch));
  }
  std::int64_t epoch() const { return epoch_; }
  std::size_t num_samples() const { return num_samples_; }
  // This rank's i-th index of the current epoch, i < num_samples().
  std::int64_t index(std::size_t i) const;
  // All of them (num_samples() values).
  std::vector<std::int64_t> indices() const;

 private:
  std::size_t size_;
  int replicas_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  std::int64_t epoch_ = 0;
  std::size_t num_samples_;
  std::optional<Shuffle> order_;  // the epoch's order, when shuffling
};

// Shuffle's permutation of [0, n), whole.
std::vector<std::int64_t> permutation(std::size_t n, std::uint64_t seed);

// Evaluation's share of rank `rank` of `replicas`: indices rank, rank + replicas, ... below `size`.
// Unlike DistributedSampler nothing is padded, so every sample is counted exactly once (ranks may
// hold one sample more than others).
std::vector<std::int64_t> eval_shard(std::size_t size, int replicas, int rank);

// torchvision's ToTensor then Normalize((mean,), (std,)): x = (pixel / 255 - mean) / std in fp32.
// The default leaves pixel / 255 as it is.
struct Normalize {
  float mean = 0.0f;
  float std = 1.0f;
};

// An MNIST-format Dataset as a SampleSource: {1, rows, cols} samples of pixel / 255, normalised,
// and 10 classes. Holds the Dataset (moved in) or, made from a reference, reads one that outlives it.
class DatasetSource : public SampleSource {
 public:
  explicit DatasetSource(Dataset data, Normalize normalize = {});
  DatasetSource(const Dataset* data, Normalize normalize);
  DatasetSource(const DatasetSource&) = delete;
  DatasetSource& operator=(const DatasetSource&) = delete;
  std::size_t size() const override { return data_->size(); }
  std::vector<std::int64_t> sample_shape() const override { return {1, data_->rows, data_->cols}; }
  int num_classes() const override { return 10; }
  std::int64_t label(std::size_t index) const override { return data_->labels[index]; }
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override;
  const Dataset& data() const { return *data_; }

 private:
  Dataset owned_;
  const Dataset* data_;
  Normalize normalize_;
};

// The first `count` samples of `source` (torch.utils.data.Subset(source, range(count))).
class FirstSamples : public SampleSource {
 public:
  FirstSamples(std::shared_ptr<const SampleSource> source, std::size_t count)
      : source_(std::move(source)), count_(std::min(count, source_->size())) {}
  std::size_t size() const override { return count_; }
  std::vector<std::int64_t> sample_shape() const override { return source_->sample_shape(); }
  int num_classes() const override { return source_->num_classes(); }
  std::int64_t label(std::size_t index) const override { return source_->label(index); }
  int targets_per_sample() const override { return source_->targets_per_sample(); }
  void fill_targets(std::size_t index, std::int64_t* out) const override { source_->fill_targets(index, out); }
  DType sample_dtype() const override { return source_->sample_dtype(); }
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override { source_->fill(index, key, out); }

 private:
  std::shared_ptr<const SampleSource> source_;
  std::size_t count_;
};

// The sample indices of batch k. A loader asks for k = 0, 1, ... in order, on its own thread, just
// before it fills the batch: a plan of millions of steps takes no memory up front.
using BatchPlan = std::function<std::vector<std::int64_t>(std::size_t k)>;

// How a BatchLoader works: `depth` batches made ahead of the consumer; `workers` threads making
// each batch's samples together (torch's DataLoader num_workers; 0: the loader's own thread alone);
// the key of every sample's random draws, with the epoch batch k belongs to (none: epoch 0) and the
// rank whose batch k is (none: key.rank), for a loader that makes the batches of several ranks in turn.
struct LoaderOptions {
  int depth = 2;
  int workers = 0;
  SampleKey key;
  std::function<std::int64_t(std::size_t k)> epoch_of;
  std::function<std::int64_t(std::size_t k)> rank_of;
};

// Fills batches in a background thread, `depth` ahead of the consumer, into pinned buffers.
// A batch returned by next() stays valid until the following call to next(), and for as long as a
// copy of its lease (Batch::lease) lives: an engine copies it to its devices straight from the
// loader's memory and lets go once that copy has run. The loader cycles through depth + 2 buffers
// (the batch being consumed, one an engine may still copy from, `depth` ahead); a buffer still
// lent when its turn comes stays with its lease (freed when the last copy goes, after the loader
// too) and the loader takes new pinned memory in its place, as PyTorch's pinned batches are new
// tensors: holding batches costs memory, never a stall.
class BatchLoader {
 public:
  // `count` batches of at most `max_batch` samples each (the pinned staging is sized for it; a larger
  // batch, or an index outside `data`, fails next()).
  BatchLoader(Runtime& runtime, const Dataset& data, std::size_t count, std::size_t max_batch, BatchPlan plan,
              int depth = 2, Normalize normalize = {});
  // A plan held in memory: `batches`, the sample indices of each batch in consumption order.
  BatchLoader(Runtime& runtime, const Dataset& data, std::vector<std::vector<std::int64_t>> batches, int depth = 2,
              Normalize normalize = {});
  // Batches of samples `source` makes (decoded, augmented), on `options.workers` threads.
  BatchLoader(Runtime& runtime, std::shared_ptr<const SampleSource> source, std::size_t count, std::size_t max_batch,
              BatchPlan plan, LoaderOptions options = {});
  BatchLoader(Runtime& runtime, std::shared_ptr<const SampleSource> source,
              std::vector<std::vector<std::int64_t>> batches, LoaderOptions options = {});
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  std::size_t count() const { return count_; }
  // Throws once all batches were consumed, or what making the batch threw (a bad plan).
  // One batch ready on the host: the source's samples (size x C x H x W of its sample_dtype(); for a
  // Dataset, float32 pixels / 255 normalised) and int64 labels, in pinned memory the batch's lease lends (copies to a
  // device are asynchronous).
  Batch next();

 private:
  struct Memory {
    PinnedBuffer inputs, targets;
    // Leases handed out and not yet released; a release (on any thread, maybe after the loader has
    // gone) publishes that its holder's reads of the memory are done.
    std::atomic<int> leases{0};
  };
  struct Slot {
    std::shared_ptr<Memory> memory;  // shared with the leases of the batches handed out from it
    int size = 0;
  };
  std::shared_ptr<Memory> make_memory() const;
  // A plan held in memory, measured before it moves into the loader.
  struct Held {
    std::size_t count, max_batch;
    BatchPlan plan;
    static Held of(std::vector<std::vector<std::int64_t>> batches);
  };
  BatchLoader(Held held, Runtime& runtime, std::shared_ptr<const SampleSource> source, LoaderOptions options);
  void produce();
  // Fills samples [0, n) of batch k on this thread and the workers, each taking the next sample.
  void fill_batch(std::size_t k, const std::vector<std::int64_t>& indices, InputsOut inputs);
  void work();
  void take_samples();

  Runtime& runtime_;
  std::shared_ptr<const SampleSource> source_;
  std::size_t count_, max_batch_, sample_elements_;
  BatchPlan plan_;
  LoaderOptions options_;
  // The batch the workers help fill: its samples, where they go, the next one to take, how many
  // are done, the threads still in it, the first failure. Set under job_mutex_ while no thread is
  // in a job; `next` is taken without it.
  struct Job {
    const std::vector<std::int64_t>* indices = nullptr;
    InputsOut inputs;
    SampleKey key;
    std::atomic<std::size_t> next{0};
    std::size_t done = 0;
    int active = 0;
    std::uint64_t generation = 0;
    std::exception_ptr error;
  } job_;
  std::mutex job_mutex_;
  std::condition_variable job_cv_, done_cv_;
  bool quit_ = false;
  std::vector<std::thread> workers_;
  std::exception_ptr error_;  // what the producer failed with, for next() to throw
  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::size_t produced_ = 0, consumed_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace dp
