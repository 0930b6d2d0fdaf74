// train_parts.h — the pieces dp_train's steps are made of: learning rates and the optimizer, the
// flags' parsing, the metrics log, evaluation, the memory check and the job's shared configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/io/data.h"
#include "dp/models/registry.h"
#include "dp/nn/lr_schedule.h"
#include "train_options.h"

namespace dp_train {

std::vector<int> parse_int_list(const std::string& text, const char* flag);

// The learning rate of step s: linear scaling (--scale-lr, seed 003) and linear warm-up
// (Goyal et al. 2017) from the unscaled lr, or from target/W without scaling, to the target at s = W.
// After the warm-up, `schedule` (--schedule, per optimizer step, counted from the warm-up's end)
// takes the target down; none keeps it. In double, as a Python training loop computes it.
double lr_at(const Options& o, int world, long step, const dp::LrSchedule& schedule);

// The optimizer of --optimizer at learning rate `lr` (SGD: --momentum, --nesterov; AdamW: --beta1,
// --beta2, --eps; both: --weight-decay, which AdamW applies decoupled, as torch.optim.AdamW).
dp::OptimizerOptions optimizer_options(const Options& o, double lr);

// --schedule: none, step (StepLR: x --gamma every --step-size steps) or cosine (CosineAnnealingLR to
// --eta-min over --t-max steps, by default the steps after the warm-up up to the run's last step).
dp::LrSchedule make_schedule(const Options& o, long last_step);
// The cosine schedule's T_max for a run planned to end at `last_step`: --t-max, else the steps after
// the warm-up (a checkpoint keeps it, so a resumed run continues the same curve).
long resolved_t_max(const Options& o, long last_step);

// Refuses (UsageError) a run whose learning rate would grow past the largest float by its last
// step `end_step` (StepLR with --gamma > 1): the warm-up and every schedule are monotonic, so the
// first and last steps bound the run's learning rates, and the first is checked with the flags.
void check_schedule(const Options& o, int world, long end_step, const dp::LrSchedule& schedule);

std::string ids_of(const std::vector<int>& v);

// torchvision's Normalize(mean, std): one value for every channel, or one per channel.
struct Normalization {
  std::vector<float> mean{0.0f}, std{1.0f};
  // The same per-channel values for `channels` channels (one value stands for all); UsageError
  // when the counts differ.
  Normalization for_channels(std::size_t channels) const;
};

// "MEAN,STD" (e.g. Fashion-MNIST's 0.2860,0.3530), or "M1,M2,M3/S1,S2,S3" (a list of means, then
// one of stds, as many of each: ImageNet's 0.485,0.456,0.406/0.229,0.224,0.225).
Normalization parse_normalize(const std::string& text);

// "1m 05s", "42.0 s": durations for people.
std::string duration_text(double seconds);

// Seconds from `from` to now.
double since(std::chrono::steady_clock::time_point from);

// What `load` returns; a dp::Error it throws is the user's input (a bad file), so UsageError (exit 2).
template <class Load>
auto as_usage_error(Load&& load) {
  try {
    return load();
  } catch (const UsageError&) {
    throw;
  } catch (const dp::Error& e) {
    throw UsageError(e.what());
  }
}

// --metrics-json: one JSON object per line, each written with a single write(2) to a file opened
// for appending, so a crash leaves every line logged before it whole (at most the last one cut by a
// full disk).
class MetricsLog {
 public:
  // Writes to `path` (refused up front by validate_options when it is not a regular file or cannot
  // be written). Opened at the first record, once every check has passed, so a refused run leaves
  // an existing file as it was; truncated then, or appended to when resuming (the earlier run's lines stay).
  MetricsLog(const std::string& path, bool append) : path_(path), append_(append) {}
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void write(const nlohmann::json& record);

 private:
  int fd_ = -1;
  std::string path_;
  bool append_ = false;
};

// Test-set loss and accuracy through the engine: every sample exactly once (eval_shard: global
// rank r of the engine's world_size() R takes samples r, r + R, ...; no padding), in batches of
// `batch_size` per rank; a rank whose shard ran out sends an empty batch. Across processes, each
// evaluates its ranks' shards and the engine sums the totals.
// With `predictions`, it is resized to the test set and gets each sample's predicted class.
// The samples come normalised from `test` (made by `workers` threads per loader).
// The token a uniform draw `u` in [0, 1) picks from softmax(logits / temperature), among the top_k
// largest logits (0: all; values tied with the k-th stay in, as nanoGPT's logits < v[-1] mask):
// the inverse of the cumulative distribution, in double, in token order.
int sample_token(std::span<const float> logits, double temperature, int top_k, double u);

dp::EvalTotals evaluate(dp::Engine& engine, dp::Runtime& runtime, std::shared_ptr<const dp::SampleSource> test,
                        int batch_size, int workers, std::vector<std::int32_t>* predictions = nullptr);

// Refuses (exit 2, with the figures) a run that cannot fit, before anything is allocated: what it
// needs at the least — the model's parameters, gradients and momentum and the input batch on each
// device, the synthetic data set and the pinned batches on the host — against the host's memory
// and a simulated device's capacity, and the process's limits: its address space (ulimit -v) and
// the size of a --save checkpoint's file (ulimit -f). (The activations come on top; a run that
// passes this and still does not fit fails with the device's out-of-memory error, also exit 2.)
void check_memory(const Options& o, const std::vector<int>& hidden, const std::vector<int>& ids, bool cuda,
                  int processes);

// What --model is built from: the MLP's parsed --hidden sizes, --dropout, --num-classes (else the
// registry's default), --image-size.
dp::models::ModelArgs model_args(const Options& o, const std::vector<int>& hidden);

// What every process of an mpirun job must agree on (tools/dp_job.h): everything that decides the
// collectives a run makes or the numbers it trains — not which local devices (--device-ids), where
// process 0 writes, nor the testing hook.
std::vector<std::pair<std::string, std::string>> configuration(const Options& o, const std::vector<int>& ids, bool cuda,
                                                               const dp::SampleSource* data,
                                                               const dp::SampleSource* test);

// What identifies a data set's contents in configuration(): its size and a hash of its samples
// (an MNIST set's pixels and labels; an image folder's files, classes and sizes).
std::string data_identity(const dp::SampleSource& set);

}  // namespace dp_train
