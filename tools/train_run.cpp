// train_run.cpp — dp_train's run as named steps, in the order a run takes them: validate, load,
// resume, build the runtime and engine, then evaluate a checkpoint or train, evaluate and save.
#include "train_run.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fmt/format.h>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <signal.h>
#include <span>
#include <thread>
#include <unistd.h>
#include <utility>
#include <variant>
#include <vector>

#include "address_space.h"
#include "dp/engines/engine.h"
#include "dp/io/atomic_file.h"
#include "dp/io/checkpoint.h"
#include "dp/io/data.h"
#include "dp/io/image_folder.h"
#include "dp/io/llmc.h"
#include "dp/io/safetensors.h"
#include "dp/io/text.h"
#include "dp/io/training_state.h"
#include "dp/models/registry.h"
#include "dp/nn/lr_schedule.h"
#include "dp/runtime/device.h"
#include "dp/runtime/process_group.h"
#include "dp/runtime/shape.h"
#include "dp_cli.h"
#include "run_settings.h"
#include "train_cli.h"
#include "train_parts.h"
#include "train_stages.h"

namespace dp_train {

dp::tools::Job g_job("dp_train");

namespace {

// What --init loaded, as torch prints load_state_dict(strict=False)'s result: the keys left out
// either way (none under strict, which refuses them).
void report_init(const std::string& path, const dp::StateDictKeys& keys) {
  const auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (const auto& name : names) text += (text.empty() ? "'" : ", '") + name + "'";
    return "[" + text + "]";
  };
  if (keys.module_prefix)
    say("dp_train: --init {}: tensor names carry DataParallel's 'module.' prefix (dropped)\n", path);
  if (!keys.missing.empty() || !keys.unexpected.empty())
    say("dp_train: --init {}: missing_keys={} unexpected_keys={}\n", path, list(keys.missing), list(keys.unexpected));
}

// --init's tensors: a safetensors file, or llm.c's model file (train_gpt2.c's gpt2_124M.bin and its
// kind), whose sizes must be the run's and whose GELU is GPT-2's tanh form.
dp::safetensors::File read_init(const Options& o) {
  if (!dp::llmc::is_model_file(o.init)) return dp::safetensors::read(o.init);
  dp::llmc::Model file = dp::llmc::read_model(o.init);
  const dp::llmc::ModelConfig& c = file.config;
  if (o.model != "gpt") throw UsageError(fmt::format("--init {}: an llm.c GPT-2 loads into --model gpt", o.init));
  const std::string wanted = fmt::format("--context {} --vocab {} --layers {} --heads {} --width {}", c.max_seq_len,
                                         c.vocab, c.layers, c.heads, c.channels);
  const std::string have = fmt::format("--context {} --vocab {} --layers {} --heads {} --width {}", o.context, o.vocab,
                                       o.layers, o.heads, o.width);
  if (wanted != have)
    throw UsageError(
        fmt::format("--init {}: an llm.c GPT-2 of maxT {}, V {}, L {}, NH {}, C {}: run it with {} (this "
                    "run has {})",
                    o.init, c.max_seq_len, c.vocab, c.layers, c.heads, c.channels, wanted, have));
  if (c.padded_vocab != dp::models::llmc_padded_vocab(c.vocab))
    throw UsageError(
        fmt::format("--init {}: its table has {} rows for a vocabulary of {}; dp pads it to {} as llm.c's "
                    "own scripts do",
                    o.init, c.padded_vocab, c.vocab, dp::models::llmc_padded_vocab(c.vocab)));
  if (o.gelu != "tanh")
    throw UsageError(fmt::format("--init {}: llm.c's GPT-2 computes GELU's tanh form: add --gelu tanh", o.init));
  return std::move(file.tensors);
}

Built build_model(const Options& o, const Checked& checked, const Devices& devices, const Resumed& resumed) {
  dp::RuntimeOptions runtime_options;
  runtime_options.backend = devices.cuda ? "cuda" : "sim";
  runtime_options.sim_devices = devices.highest + 1;
  // Processes of one job that number their devices alike would all crowd the same first cores.
  runtime_options.sim_pin_threads = !g_job.several();
  runtime_options.devices_per_gpu = o.devices_per_gpu;
  runtime_options.precision = dp::parse_precision(o.precision);
  Built built;
  built.runtime = dp::Runtime::create(runtime_options);
  dp::Device& source = built.runtime->device(devices.ids[0]);
  built.model = model_of(o).build(source, model_args(o, checked.hidden), o.seed);
  dp::Model& model = *built.model;
  as_usage_error([&] {
    if (!o.init.empty()) {
      const dp::safetensors::File init = read_init(o);
      check_hidden_tag(o.init, init);
      const dp::StateDictKeys keys = dp::load_state_dict(model, source.create_stream(), init, "", !o.init_non_strict);
      report_init(o.init, keys);
    }
    if (resumed.state) resumed.state->load_model(model);  // before the engine: DDP broadcasts rank 0's values
    return 0;
  });
  return built;
}

// Every process is ready (or all stop with the first failing one's exit code); from here on the
// processes meet in collectives.
void join_collectives(const Options& o, const Devices& devices, const Inputs& inputs) {
  g_job.agree_or_stop();
  if (g_job.several())  // hashes the data
    g_job.agree_on_configuration(configuration(o, devices.ids, devices.cuda, inputs.data.get(), inputs.test.get()));
  g_job.collectives_begin();
}

// What the flags say of the engine: its kind and every setting from the flag table.
dp::EngineOptions engine_options_of(const Options& o) {
  dp::EngineOptions options;
  options.kind = o.mode;
  dp::tools::set_engine_options(o, options, train_flags());
  return options;
}

// The engine, picked once: everything after it runs through dp::Engine.
std::unique_ptr<dp::Engine> build_engine(const Options& o, const Devices& devices, int world, Built& built,
                                         const Resumed& resumed, bool uneven_shards = false) {
  // The schedule needs the run's length, known later; the optimizer starts at the warm-up's first lr
  // and every step sets its own.
  const dp::OptimizerOptions optimizer =
      optimizer_options(o, lr_at(o, world, resumed.start_step, dp::LrSchedule::constant()));
  dp::EngineOptions engine_options = engine_options_of(o);
  engine_options.device_ids = devices.ids;
  engine_options.processes = g_job.processes();
  engine_options.uneven_shards = uneven_shards;  // the survivors of a lost device
  auto engine = dp::make_engine(*built.runtime, *built.model, optimizer, engine_options);
  if (resumed.state)
    as_usage_error([&] {
      resumed.state->load_optimizers(*built.model, engine->whole_optimizers());
      engine->whole_optimizers_loaded();
      return 0;
    });
  return engine;
}

// --generate: nanoGPT's sample.py on the --init checkpoint. The prompt's bytes (the last --context
// of them), then N tokens, each drawn from the softmax of the last position's logits over T (among
// the K likeliest), printed and fed back. A shorter sequence sits at the window's start with zeros
// after it: causal attention keeps them out of every position up to its last. With llm.c's
// tokenizer, as train_gpt2.c samples: from <|endoftext|>, among the tokenizer's ids (not the padded
// rows of the vocabulary), each printed as llm.c's safe_printf prints it.
int generate_text(const Options& o, dp::Engine& engine) {
  const dp::Model& model = engine.model();
  const auto context = static_cast<std::size_t>(model.targets_per_sample());
  const auto vocab = static_cast<std::size_t>(model.output_features());
  std::optional<dp::llmc::Tokenizer> tokenizer;
  if (!o.tokenizer.empty()) tokenizer = as_usage_error([&] { return dp::llmc::read_tokenizer(o.tokenizer); });
  if (!tokenizer && vocab > dp::kByteVocabulary)
    throw UsageError(
        fmt::format("--generate: {} has a vocabulary of {} tokens, not bytes: give llm.c's tokenizer file (--tokenizer "
                    "gpt2_tokenizer.bin) to decode them",
                    o.init, vocab));
  const std::size_t drawn = tokenizer ? tokenizer->tokens.size() : vocab;
  if (drawn > vocab)
    throw UsageError(fmt::format("--tokenizer {} holds {} tokens, more than the {} of {}'s vocabulary", o.tokenizer,
                                 drawn, vocab, o.init));
  // The prompt's bytes, or with llm.c's tokenizer its longest tokens (Tokenizer::encode: nanoGPT's
  // sample.py starts from the prompt's tokens alone; llm.c, which has no prompt, from <|endoftext|>).
  std::vector<int> prompt(o.prompt.begin(), o.prompt.end());
  for (int& t : prompt) t = static_cast<unsigned char>(t);
  if (tokenizer) {
    try {
      prompt = tokenizer->encode(o.prompt);
    } catch (const dp::Error& e) {
      throw UsageError(fmt::format("--prompt: {} {}", e.what(), o.tokenizer));
    }
  }
  if (prompt.empty()) prompt.push_back(tokenizer ? tokenizer->eot : '\n');
  std::mt19937_64 rng(o.seed);  // one stream over every sample
  std::vector<std::int32_t> window(context);
  // As nanoGPT's sample.py prints them: the prompt, then its continuation; samples apart by a rule.
  for (int sample = 0; sample < o.num_samples; ++sample) {
    std::vector<int> tokens = prompt;
    say("{}", o.prompt);
    for (long i = 0; i < o.generate; ++i) {
      const std::size_t n = std::min(tokens.size(), context);
      std::fill(window.begin(), window.end(), 0);
      std::copy(tokens.end() - static_cast<std::ptrdiff_t>(n), tokens.end(), window.begin());
      const dp::Batch batch{window.data(), nullptr, 1};
      const std::vector<float> logits = engine.predict(std::span<const dp::Batch>(&batch, 1));
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
      const int next =
          sample_token(std::span<const float>(logits.data() + (n - 1) * vocab, drawn), o.temperature, o.top_k, u);
      tokens.push_back(next);
      if (!g_job.primary()) continue;
      if (tokenizer)
        std::fputs(tokenizer->printable(next).c_str(), stdout);
      else
        std::fputc(next, stdout);
    }
    say("{}", o.num_samples > 1 ? "\n---------------\n" : "\n");
  }
  std::fflush(stdout);
  return 0;
}

// --eval-only: the checkpoint's test loss and accuracy, and with --predictions each sample's class.
int evaluate_only(const Options& o, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
                  MetricsLog& metrics) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::int32_t> predictions;
  const dp::EvalTotals totals =
      evaluate(engine, runtime, inputs.test, o.batch_size, o.workers, o.predictions.empty() ? nullptr : &predictions);
  g_job.collectives_end();
  const std::string& checkpoint = o.init.empty() ? o.resume : o.init;
  if (const int code = diverged(o, totals.mean_loss(), fmt::format("the test loss of {}", checkpoint))) return code;
  if (!o.predictions.empty()) {
    std::string text;
    for (const std::int32_t c : predictions) text += fmt::format("{}\n", c);
    dp::write_atomically(o.predictions, text);
  }
  const double seconds = since(t0);
  say("dp_train: {} on {} test {}: test loss {:.6f}, test accuracy {:.2f}% ({} correct){} in {}\n", checkpoint,
      totals.samples, o.text.empty() ? "samples" : "tokens", totals.mean_loss(), 100.0 * totals.accuracy(),
      totals.correct, bits_per_byte_text(o, totals), duration_text(seconds));
  nlohmann::json record = {{"kind", "eval"},
                           {"checkpoint", checkpoint},
                           {"test_loss", totals.mean_loss()},
                           {"test_accuracy", totals.accuracy()},
                           {"test_correct", totals.correct},
                           {"test_samples", totals.samples}};
  if (const auto bpb = bits_per_byte(o, totals)) record["test_bits_per_byte"] = *bpb;
  metrics.write(record);
  g_job.agree_or_stop();
  return 0;
}

// Where a resumed run's epochs begin: on from the checkpoint's, whose epoch began at epoch_start.
// With epochs of another length (another device count, batch size or data set), an epoch the
// checkpoint stopped inside starts over at the resumed step, under the same number. A checkpoint
// that does not say (another program's) counts epochs from step 0.
void place_epochs(const Resumed& resumed, Plan& plan) {
  if (!resumed.state || !resumed.epoch_start) return;
  plan.epochs.first = resumed.epoch;
  plan.epochs.first_step = *resumed.epoch_start;
  if (*resumed.epoch_steps == plan.epochs.steps) return;
  if (resumed.start_step != *resumed.epoch_start)
    say("note: the checkpoint stopped {} step(s) into epoch {} of {} steps; this run's epochs have {}: epoch {} "
        "starts over\n",
        resumed.start_step - *resumed.epoch_start, resumed.epoch + 1, *resumed.epoch_steps, plan.epochs.steps,
        resumed.epoch + 1);
  plan.epochs.first_step = resumed.start_step;
}

// The step the run ends at, counted from the start of training (not from the checkpoint): --steps;
// the end of epoch --epochs; else the end the resumed checkpoint's run planned; else one epoch. So
// re-running a stopped command with --resume finishes the run it started, and re-running a
// finished one trains nothing.
long planned_end(const Options& o, const Resumed& resumed, Plan& plan) {
  if (o.steps) return *o.steps;
  std::optional<long> epochs = o.epochs ? std::optional<long>(*o.epochs) : resumed.end_epoch;
  if (!epochs && resumed.end_step) return *resumed.end_step;
  plan.end_epoch = epochs.value_or(1);
  long steps = 0, end = 0;
  if (__builtin_mul_overflow(*plan.end_epoch - plan.epochs.first, plan.epochs.steps, &steps) ||
      __builtin_add_overflow(plan.epochs.first_step, steps, &end))
    throw UsageError(fmt::format("--epochs {} of {} step(s): the run would end past step {}", *plan.end_epoch,
                                 plan.epochs.steps, std::numeric_limits<long>::max()));
  return end;
}

// single and dp read the whole data set in order (one replica); ddp ranks read their shards: this
// process's ranks first_rank() .. first_rank() + batches_per_step() - 1 of world_size().
Plan plan_run(const Options& o, const dp::Engine& engine, const dp::SampleSource& data, int world,
              const Resumed& resumed) {
  const int shards = engine.world_size();
  const std::size_t per_rank_samples = dp::DistributedSampler(data.size(), shards, 0, false, 0).num_samples();
  const long batches = static_cast<long>((per_rank_samples + static_cast<std::size_t>(o.batch_size) - 1) /
                                         static_cast<std::size_t>(o.batch_size));
  // --accumulate K: an epoch's optimizer steps take K of its batches each; the last batches of an
  // epoch, fewer than K, are left out, as torch's `if (i + 1) % K == 0: step()` leaves them.
  // With shards the engine's shards already count the K micro-batches (world_size() = K x V).
  const long micro = engine.batches_per_step() / engine.batches_per_forward();
  const long batches_per_epoch = batches / micro;
  if (batches_per_epoch == 0)
    throw UsageError(
        fmt::format("--accumulate {}: an epoch of {} batch(es) of {} per rank holds no step of {} "
                    "micro-batches",
                    o.accumulate, batches, o.batch_size, o.accumulate));
  Plan plan{world, shards,       resumed.start_step,        0, Epochs{0, 0, batches_per_epoch},
            0,     std::nullopt, dp::LrSchedule::constant()};
  plan.micro = micro;
  place_epochs(resumed, plan);
  plan.planned_end = planned_end(o, resumed, plan);
  plan.total_steps = std::max(0L, plan.planned_end - plan.start_step);
  if (plan.total_steps == 0) return plan;
  plan.schedule = make_schedule(o, plan.end_step());
  check_schedule(o, world, plan.end_step(), plan.schedule);
  return plan;
}

// How the global batch of an optimizer step is made: " (8 per device)", " (3 micro-batches of 16)".
std::string batch_text(const Options& o, const Plan& plan) {
  if (o.shards > 0)
    return o.accumulate > 1
               ? fmt::format(" ({} per shard, {} micro-batches of {} shards)", o.batch_size, o.accumulate, o.shards)
               : fmt::format(" ({} per shard, {} shards)", o.batch_size, o.shards);
  const std::string per_device = plan.shards > 1 ? fmt::format("{} per device", o.batch_size) : "";
  if (o.accumulate > 1)
    return fmt::format(" ({} micro-batches of {}{})", o.accumulate, o.batch_size * plan.shards,
                       per_device.empty() ? "" : ", " + per_device);
  return per_device.empty() ? "" : " (" + per_device + ")";
}

void say_plan(const Options& o, const Plan& plan, const dp::Engine& engine, const dp::Runtime& runtime,
              const dp::SampleSource& data, const Devices& devices) {
  const int processes = g_job.processes()->size();
  // The engine that runs the steps, where it is not the mode's own: "single (fixed shards)".
  const std::string mode = engine.name() == dp::to_string(o.mode)
                               ? std::string(engine.name())
                               : fmt::format("{} ({})", dp::to_string(o.mode), engine.name());
  say("dp_train: {} {} on {} device(s) [{}]{} ({} backend, precision {}{}{}), {} samples, global batch {}{}, {} "
      "step(s) "
      "from step {}\n",
      o.model, mode, plan.world, ids_of(devices.ids),
      processes > 1 ? fmt::format(" in each of {} processes", processes) : "", dp::to_string(runtime.backend()),
      o.precision, o.amp == dp::Autocast::bf16 ? ", autocast bf16" : "",
      dp::tools::banner_settings(o, dp::to_string(o.mode)), data.size(),
      o.batch_size * plan.shards * (o.shards > 0 ? 1 : o.accumulate), batch_text(o, plan), plan.total_steps,
      plan.start_step);
  if (const dp::ZeroStage zero = dp::zero_stage(engine_options_of(o)); zero.stage != o.zero)
    say("note: --zero {} runs as ZeRO stage {} here, keeping the whole gradients: {}\n", o.zero, zero.stage, zero.why);
}

// --resume of a run that has reached the end asked for: nothing is trained or written.
int nothing_to_train(const Options& o, const Plan& plan) {
  g_job.collectives_end();
  say("dp_train: --resume {}: the checkpoint is at step {}, {} (step {}): nothing to train, nothing written\n",
      o.resume, plan.start_step,
      plan.planned_end == plan.start_step ? "the end of its run" : "past the end this run asks for", plan.planned_end);
  g_job.agree_or_stop();
  return 0;
}

// The data order: per step, the sample indices of each local rank's batches, made on the loader's
// thread just before it fills each batch (constant memory, however many steps). One loader for
// every rank, so its threads do not grow with the ranks or shards: batch k of the loader is step
// k / (R x K)'s batch of local rank (k / K) % R, micro-batch k % K.
Loaders make_loaders(const Options& o, const Plan& plan, const dp::Engine& engine, dp::Runtime& runtime,
                     std::shared_ptr<const dp::SampleSource> data) {
  // Micro-batches per step of each rank (with shards, the engine's shards hold them).
  const long micro = plan.micro;
  const long ranks = engine.batches_per_forward(), per_step = ranks * micro;
  const int first = engine.first_rank();
  std::vector<dp::DistributedSampler> samplers;  // index() computes an order: nothing per sample is kept
  for (long local = 0; local < ranks; ++local)
    samplers.emplace_back(data->size(), plan.shards, first + static_cast<int>(local),
                          !o.no_shuffle && !data->keeps_its_order(), o.seed);
  const auto batch = static_cast<std::size_t>(o.batch_size);
  const bool log = o.log_batches;
  const long start_step = plan.start_step;
  const Epochs epochs = plan.epochs;
  const auto step_of = [start_step, per_step](std::size_t k) { return start_step + static_cast<long>(k) / per_step; };
  const auto rank_of = [first, per_step, micro](std::size_t k) {
    return first + (static_cast<long>(k) % per_step) / micro;
  };
  auto batch_plan = [samplers, data, batch, log, step_of, rank_of, first, epochs, per_step, micro](std::size_t k) {
    const long s = step_of(k), epoch = epochs.of(s), rank = rank_of(k);
    const long in_epoch = epochs.into(s) * micro + (static_cast<long>(k) % per_step) % micro;
    dp::DistributedSampler sampler = samplers[static_cast<std::size_t>(rank - first)];
    sampler.set_epoch(epoch);
    const std::size_t begin = static_cast<std::size_t>(in_epoch) * batch;
    std::vector<std::int64_t> mine;
    for (std::size_t i = begin; i < std::min(sampler.num_samples(), begin + batch); ++i)
      mine.push_back(static_cast<std::int64_t>(data->sample_at(static_cast<std::size_t>(sampler.index(i)), epoch)));
    if (log) fmt::print("batch step {} rank {}: {}\n", s, rank, fmt::join(mine, " "));
    return mine;
  };
  // Augmentations draw from (seed, rank, epoch, sample): reproducible, different on every rank,
  // and a resumed run draws what the uninterrupted one would have.
  dp::LoaderOptions options;
  // --workers is per rank, as torch's num_workers per process, up to the machine's threads.
  const long hardware = std::max<long>(o.workers, std::thread::hardware_concurrency());
  options.workers = static_cast<int>(std::min({static_cast<long>(o.workers) * ranks, hardware, 256L}));
  options.depth = static_cast<int>(2 * per_step);  // two steps ahead, as a pipelined engine holds two
  options.key = dp::SampleKey{o.seed, first, 0};
  options.epoch_of = [step_of, epochs](std::size_t k) { return epochs.of(step_of(k)); };
  options.rank_of = rank_of;
  return std::make_unique<dp::BatchLoader>(runtime, data, static_cast<std::size_t>(plan.total_steps * per_step), batch,
                                           batch_plan, std::move(options));
}

// --loader-only: the run's batches read as training would read them, nothing trained; the loader's
// rate (decoding and augmentation included) alone.
// Timed from `t0`, before the loaders were made: the batches they fill ahead count too.
int read_batches_only(const Options& o, const Plan& plan, Loaders& loaders, MetricsLog& metrics,
                      std::chrono::steady_clock::time_point t0) {
  long images = 0;
  for (std::size_t k = 0; k < loaders->count(); ++k) images += loaders->next().size;
  const double seconds = std::max(since(t0), 1e-9);
  say("dp_train: loader: {} images in {} step(s) in {:.2f} s: {:.1f} images/s (--workers {})\n", images,
      plan.total_steps, seconds, static_cast<double>(images) / seconds, o.workers);
  metrics.write({{"kind", "loader"},
                 {"images", images},
                 {"steps", plan.total_steps},
                 {"seconds", seconds},
                 {"images_per_s", static_cast<double>(images) / seconds},
                 {"workers", o.workers}});
  return 0;
}

}  // namespace

void check_options(const Options& o) {
  const Checked checked = validate_options(o);
  const Devices devices = choose_devices(o);
  const int world =
      static_cast<int>(devices.ids.size()) * (o.mode == dp::EngineKind::ddp ? g_job.processes()->size() : 1);
  check_learning_rate(o, world);
  check_memory(o, checked.hidden, devices.ids, devices.cuda, g_job.processes()->size());
}

// The settings the --resume (else --init) checkpoint describes, for the flags not given: read before
// any check, since they choose the model and the optimizer.
void adopt_checkpoint_settings(Options& o) {
  const bool resuming = !o.resume.empty();
  const std::string& path = resuming ? o.resume : o.init;
  if (path.empty()) return;
  check_distinct_files(o);  // an output naming the checkpoint is that mistake, not a bad checkpoint
  if (!resuming && dp::llmc::is_model_file(path)) {
    // llm.c's header says what its GPT-2 is, and GPT-2 computes GELU's tanh form.
    const dp::llmc::ModelConfig c = as_usage_error([&] { return dp::llmc::read_model_header(path).first; });
    adopt_run_settings(o, path,
                       {{"model", "gpt"},
                        {"context", std::to_string(c.max_seq_len)},
                        {"vocab", std::to_string(c.vocab)},
                        {"layers", std::to_string(c.layers)},
                        {"heads", std::to_string(c.heads)},
                        {"width", std::to_string(c.channels)},
                        {"gelu", "tanh"}},
                       false);
    return;
  }
  const dp::safetensors::File file = as_usage_error([&] { return dp::safetensors::read(path); });
  check_hidden_tag(path, file);  // a file contradicting itself is refused before its tags are taken
  std::map<std::string, std::string> tags;
  for (const auto& [key, value] : file.metadata)
    if (key.starts_with("dp.")) tags[key.substr(3)] = value;
  adopt_run_settings(o, path, tags, resuming);
}

namespace {

// One try at training from `resumed` on `devices`: the model, the engine, the plan and the loop.
// A lost device (with --shards) sets `resumed` and `devices` for the next try and returns none.
// `lost_at`: when the try before lost a device (none: this is the first).
std::optional<int> train_once(Options& o, const Checked& checked, Devices& devices, Resumed& resumed,
                              const Inputs& inputs, MetricsLog& metrics,
                              std::optional<std::chrono::steady_clock::time_point> lost_at) {
  const int world =
      static_cast<int>(devices.ids.size()) * (o.mode == dp::EngineKind::ddp ? g_job.processes()->size() : 1);
  Built built = build_model(o, checked, devices, resumed);
  if (!lost_at) join_collectives(o, devices, inputs);
  Loaders loaders;  // outlives the engine: its streams read their pinned batches
  const auto engine = build_engine(o, devices, world, built, resumed, lost_at.has_value());
  if (o.eval_only) {
    return evaluate_only(o, *engine, *built.runtime, inputs, metrics);
  }
  if (o.generate) return generate_text(o, *engine);
  const Plan plan = plan_run(o, *engine, *inputs.data, world, resumed);
  if (plan.total_steps == 0) return nothing_to_train(o, plan);
  say_plan(o, plan, *engine, *built.runtime, *inputs.data, devices);
  const auto loaders_made = std::chrono::steady_clock::now();
  loaders = make_loaders(o, plan, *engine, *built.runtime, inputs.data);
  if (o.loader_only) return read_batches_only(o, plan, loaders, metrics, loaders_made);
  check_address_space_left(o, devices, inputs);
  if (lost_at) {
    // The pause: the state to the host, a new runtime, model and engine, the state back.
    const double seconds = since(*lost_at);
    say("dp_train: training again {:.2f} s after the loss\n", seconds);
    metrics.write({{"kind", "recovered"}, {"step", plan.start_step}, {"devices", devices.ids}, {"seconds", seconds}});
  }
  const std::int64_t steps_at_start = engine->optimizers().front()->steps();
  try {
    return train(o, plan, *engine, *built.runtime, inputs, metrics, loaders);
  } catch (...) {
    return after_training_failed(o, plan, *engine, steps_at_start, std::current_exception(), devices, resumed, metrics);
  }
}

}  // namespace

int run(Options o) {
  adopt_checkpoint_settings(o);
  const Checked checked = validate_options(o);
  Devices devices = choose_devices(o);
  const int world =
      static_cast<int>(devices.ids.size()) * (o.mode == dp::EngineKind::ddp ? g_job.processes()->size() : 1);
  check_learning_rate(o, world);
  // Its file is opened at the first record (validate_options checked the path); a resumed run appends.
  MetricsLog metrics(g_job.primary() ? o.metrics_json : std::string(), !o.resume.empty());
  // What the run needs at the least, in 64 bits, before anything is allocated.
  check_memory(o, checked.hidden, devices.ids, devices.cuda, g_job.processes()->size());
  g_job.set_devices(devices.ids);
  Resumed resumed = read_resume(o, world);  // first: its seed draws the synthetic data
  // A step's samples (one micro-batch's): --batch-size per shard, per ddp rank, or in all.
  const int global_batch = o.batch_size * (o.shards > 0 ? o.shards : o.mode == dp::EngineKind::ddp ? world : 1);
  const Inputs inputs = load_inputs(o, checked.normalize, global_batch);
  if ((o.eval_every || !o.save_best.empty()) && !inputs.test)
    throw UsageError(fmt::format("{} evaluates on the test set, and this run has none (no test split, or --no-eval)",
                                 o.eval_every ? "--eval-every" : "--save-best"));
  std::optional<std::chrono::steady_clock::time_point> lost_at;
  for (;;) {
    if (const std::optional<int> code = train_once(o, checked, devices, resumed, inputs, metrics, lost_at))
      return *code;
    lost_at = std::chrono::steady_clock::now();  // a device was lost and the survivors go on
  }
}

}  // namespace dp_train
