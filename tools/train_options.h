// train_options.h — dp_train's options, and what every stage of its run shares with its command line:
// the failure the user caused (UsageError, exit 2), the mpirun job and its output rule.
#pragma once

#include <cstdint>
#include <fmt/format.h>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/runtime/error.h"
#include "dp_job.h"
#include "exit_codes.h"
#include "flags.h"

namespace dp_train {

// The shared flags' members (backend, devices, batch_size, ...) are SharedOptions' (tools/flags.h).
// --schedule: the learning rate after the warm-up.
enum class Schedule { none, step, cosine };
inline std::string_view to_string(Schedule s) {
  return s == Schedule::step ? "step" : s == Schedule::cosine ? "cosine" : "none";
}

struct Options : dp::tools::SharedOptions {
  std::string model = "mlp";
  std::string hidden = "256,256";
  double label_smoothing = 0.0;
  int accumulate = 1;  // micro-batches per optimizer step (gradient accumulation)
  dp::EngineKind mode = dp::EngineKind::single;
  std::string device_ids;
  std::optional<int> output_device;
  std::string data;
  std::string text;                // a text file: byte tokens for --model gpt (the last 10 % held out)
  std::string tokens, val_tokens;  // llm.c token shards (a glob each) for --model gpt
  std::string train_dir, val_dir;  // image folders (--data DIR with train/ and val/ names both)
  int image_size = 224;            // image folders: RandomResizedCrop's (train) and CenterCrop's (eval) size
  std::optional<int> resize;       // image folders, eval: Resize's shorter side (default image_size * 256 / 224)
  int workers = 0;                 // threads decoding and augmenting each batch (DataLoader's num_workers)
  std::optional<int> num_classes;  // resnet18/34: fc's outputs (default: the image folder's classes)
  bool loader_only = false;        // read the planned batches without training: the loader's images/s
  std::optional<std::size_t> synthetic;
  std::optional<std::size_t> limit_train, limit_test;  // the first N samples of a split only
  std::optional<int> epochs;
  std::optional<long> steps;  // unset: --epochs' steps
  double lr = 0.01;           // in double, as Python's; each optimizer rounds it as torch's kernels do
  float momentum = 0.9f;
  double weight_decay = 0.0;
  dp::WeightDecayOn decay = dp::WeightDecayOn::all;  // what weight decay applies to: all parameters, or "matrices" only
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool nesterov = false, scale_lr = false, no_shuffle = false;
  long warmup_steps = 0;
  std::uint64_t seed = 0;
  std::string init, save, resume;
  bool init_non_strict = false;
  std::vector<std::string> freeze;  // parameter name prefixes kept fixed
  long log_every = 10;
  Schedule schedule = Schedule::none;
  long step_size = 1;
  double gamma = 0.1, eta_min = 0.0;
  std::optional<long> t_max;
  bool log_batches = false;
  std::optional<bool> eval;  // unset: evaluate when the data has a test split
  bool eval_only = false;
  std::string normalize;     // "MEAN,STD" or "M1,M2,M3/S1,S2,S3"
  std::string metrics_json;  // JSON lines, one per logged step and per epoch
  std::string predictions;   // --eval-only: each test sample's predicted class, one per line
  long generate = 0;         // gpt: print this many tokens sampled from the --init checkpoint, train nothing
  std::string prompt;        // --generate: the bytes the sample continues (empty: a newline)
  std::string tokenizer;     // --generate: llm.c's tokenizer file, for a vocabulary of more than bytes
  int num_samples = 1;       // --generate: samples drawn, one after another
  double temperature = 1.0;  // --generate: logits / T before the softmax
  int top_k = 0;             // --generate: sample among the K likeliest tokens only (0: all)
  long fail_at_step = 0;     // testing only: this process fails at that step, as a crashing rank would
  long signal_at_step = 0;   // testing only: process 0 raises SIGTERM before that step (the last + 1: before the save)
  long save_every = 0;       // also write a checkpoint every N steps (and/or every epoch), keeping the last `keep`
  bool save_every_epoch = false;
  long eval_every = 0;          // also evaluate every N steps (0: at the ends of epochs only)
  std::string save_best;        // the checkpoint with the best test accuracy evaluated so far
  long keep = 0;                // 0: keep every periodic checkpoint
  std::set<std::string> given;  // the flags on the command line ("--lr", ...): a checkpoint's settings fill the rest
};

using dp::tools::UsageError;  // a failure the user caused (bad flag value, bad file): exit code 2

extern dp::tools::Job g_job;  // under mpirun: one process of the job (tools/dp_job.h)

// Standard output is process 0's (torch's "print on rank 0"); errors come from every process.
template <class... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
  if (g_job.primary()) fmt::print(format, std::forward<Args>(args)...);
}

// Each optimizer's defaults where the command line leaves them (torch.optim.AdamW: lr 1e-3,
// weight_decay 1e-2; SGD: 0.01, 0).
inline void apply_optimizer_defaults(Options& o) {
  const bool adamw = o.optimizer == dp::tools::OptimizerKind::adamw;
  if (!o.given.count("--lr")) o.lr = adamw ? 1e-3 : 0.01;
  if (!o.given.count("--weight-decay")) o.weight_decay = adamw ? 1e-2 : 0.0;
}

}  // namespace dp_train
