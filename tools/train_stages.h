// train_stages.h — what the stages of a dp_train run hand each other (tools/train_run.cpp runs them):
// the checked options, the devices, the inputs, the resumed checkpoint, the built model and the plan,
// and each stage's entry points: the checks (train_checks.cpp), the inputs and the checkpoint to
// resume (train_inputs.cpp), the training loop and the save (train_loop.cpp).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/io/data.h"
#include "dp/io/safetensors.h"
#include "dp/io/training_state.h"
#include "dp/models/registry.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/device.h"
#include "train_options.h"
#include "train_parts.h"

namespace dp_train {

// The run's one loader: each step's batches of every local rank, rank after rank (each rank's
// micro-batches together), on one producer thread and its workers however many ranks or shards.
using Loaders = std::unique_ptr<dp::BatchLoader>;

// What validating the flags works out that later steps use.
struct Checked {
  std::vector<int> hidden;
  Normalization normalize;
};

struct Devices {
  std::vector<int> ids;  // this process's devices, in rank order
  bool cuda = false;
  int highest = 0;
};

struct Inputs {
  std::shared_ptr<const dp::SampleSource> data;  // the training split (none to evaluate a checkpoint)
  std::shared_ptr<const dp::SampleSource> test;  // when evaluating
};

// The checkpoint a run resumes, and where its run stood: the epoch of its next step, where that
// epoch began and how many steps its epochs had, and the end it planned (tags a checkpoint from
// another program may lack).
struct Resumed {
  std::optional<dp::TrainingState> state;
  long start_step = 0;
  long epoch = 0;
  std::optional<long> epoch_start, epoch_steps;
  std::optional<long> end_step, end_epoch;
};

// The model is destroyed before the runtime it lives on.
struct Built {
  std::unique_ptr<dp::Runtime> runtime;
  std::unique_ptr<dp::Model> model;
};

// A run's epochs: epoch `first` begins at step `first_step`, and every epoch has `steps` steps. A
// run resumed on another device count numbers its epochs on from the checkpoint's.
struct Epochs {
  long first = 0, first_step = 0, steps = 1;

  long of(long step) const { return first + (step - first_step) / steps; }
  long into(long step) const { return (step - first_step) % steps; }  // steps into its epoch
  long start(long step) const { return step - into(step); }
};

// The run's length, epochs and learning rates, known once the engine says how many ranks read the data.
struct Plan {
  int world, shards;  // devices training together; ranks reading the data set (1 for single and dp)
  long start_step, total_steps;
  Epochs epochs;
  long planned_end = 0;           // the end asked for: end_step(), unless the checkpoint is past it
  std::optional<long> end_epoch;  // the epoch the run ends with, when it was planned in epochs
  dp::LrSchedule schedule = dp::LrSchedule::constant();
  // Each data rank's batches per step: --accumulate's micro-batches (with shards the engine's shards
  // hold them: 1).
  long micro = 1;

  long end_step() const { return start_step + total_steps; }
};

// ---- the checks (train_checks.cpp)
// A non-finite loss (`what` is `loss`, `where` says " at step 3"): exit code 3, naming what stays on
// disk (--save is not written; `kept`: what this run wrote before, its --save-best); else 0.
int diverged(const Options& o, double loss, const std::string& what, const std::string& where = "",
             const std::string& kept = "");
// --save-every's series beside --save: the step S when `file` is NAME.step<S>(.safetensors).
std::optional<long> periodic_step(const std::string& save, const std::filesystem::path& file);
const dp::models::ModelSpec& model_of(const Options& o);
bool takes_image_folders(const Options& o);
bool image_folders(const Options& o);
// Every output a file of its own, none overwriting an input or --save's periodic series.
void check_distinct_files(const Options& o);
// The flags' combinations, every file to write, the model's and the data's options: UsageError.
Checked validate_options(const Options& o);
// This process's devices (--devices, --device-ids, LOCAL_RANK), checked against the backend's.
Devices choose_devices(const Options& o);
// The learning rate (--scale-lr over `world` devices) within a float.
void check_learning_rate(const Options& o, int world);

// ---- the inputs and the checkpoint to resume (train_inputs.cpp)
// The training data and the test split (image folders, IDX files, text, llm.c token shards,
// synthetic), normalised. `global_batch`: a step's samples (llm.c's batch, for its shards' order).
Inputs load_inputs(Options& o, const Normalization& normalize, int global_batch);
// A checkpoint's hidden sizes (its "dp.hidden" tag) against its tensors' shapes: UsageError.
void check_hidden_tag(const std::string& path, const dp::safetensors::File& file);
// --resume's checkpoint: its settings adopted into `o`, where its run stood, its training state.
Resumed read_resume(Options& o, int world);
// Where the run of resumed.state stood (its step and epoch tags); `path` names it in messages.
void read_progress(const std::string& path, Resumed& resumed);

// ---- the training loop and the save (train_loop.cpp)
// Text: the test loss in bits per byte (none for other data), and as a log line's text ("").
std::optional<double> bits_per_byte(const Options& o, const dp::EvalTotals& totals);
std::string bits_per_byte_text(const Options& o, const dp::EvalTotals& totals);
// What a checkpoint after `step` steps records of the run (its step, epoch, seed and settings).
dp::TrainingProgress checkpoint_progress(const Options& o, const Plan& plan, long step);
// The training state after `step` steps into `path` (process 0 writes it).
void write_checkpoint(const Options& o, dp::Engine& engine, const Plan& plan, const std::string& path, long step);
// The address space left once data, model and loaders are in (ulimit -v), checked: UsageError.
void check_address_space_left(const Options& o, const Devices& devices, const Inputs& inputs);
// ---- after a lost device or process (train_recovery.cpp)
// A failure of train() on `engine` (whose optimizers had taken `steps_at_start` steps when it
// began): another process lost, process 0 writes its devices' last complete step to --save and the
// failure is rethrown; a device lost, the run goes on (--shards, one process: `devices` and
// `resumed` set for the next try, none returned) or the state goes to --save (exit 7 returned);
// any other failure is rethrown.
std::optional<int> after_training_failed(const Options& o, const Plan& plan, dp::Engine& engine,
                                         std::int64_t steps_at_start, const std::exception_ptr& error, Devices& devices,
                                         Resumed& resumed, MetricsLog& metrics);

// Trains, checks the final model and saves it; SIGTERM and SIGINT stop it after the step in flight.
int train(const Options& o, const Plan& plan, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
          MetricsLog& metrics, Loaders& loaders);

}  // namespace dp_train
