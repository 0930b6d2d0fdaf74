// train_loop.cpp — a dp_train run's training loop: steps, logs, evaluations, periodic and final checkpoints, stop
// signals (train_stages.h).
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

// Text: the test loss (nats per byte predicted) in bits per byte, the unit byte-level models are
// compared in; nothing for other data.
std::optional<double> bits_per_byte(const Options& o, const dp::EvalTotals& totals) {
  if (o.text.empty()) return std::nullopt;
  return totals.mean_loss() / std::log(2.0);
}

std::string bits_per_byte_text(const Options& o, const dp::EvalTotals& totals) {
  const auto bpb = bits_per_byte(o, totals);
  return bpb ? fmt::format(" | test {:.4f} bits/byte", *bpb) : std::string();
}

// The training loop: a line per --log-every steps, and after every epoch its train loss, the test
// loss and accuracy (--eval), throughput, elapsed time and the ETA.
void write_checkpoint(const Options& o, dp::Engine& engine, const Plan& plan, const std::string& path, long step);

// SIGTERM and SIGINT while training: the run finishes the step in flight, saves and exits with
// 128 + the signal (143, 130), as a preempted job should. A second signal ends it at once (the
// handler is reset after the first).
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signal) { g_stop_signal.store(signal); }

class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, &term_);
    sigaction(SIGINT, &action, &interrupt_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &term_, nullptr);
    sigaction(SIGINT, &interrupt_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction term_ {
  }, interrupt_{};
};

// --save-every: NAME.safetensors -> NAME.step<S>.safetensors beside it (NAME.step<S> without that
// extension).
std::filesystem::path periodic_path(const std::string& save, long step) {
  const std::filesystem::path path(save);
  const bool safetensors = path.extension() == ".safetensors";
  const std::string stem = safetensors ? path.stem().string() : path.filename().string();
  return path.parent_path() / fmt::format("{}.step{}{}", stem, step, safetensors ? ".safetensors" : "");
}

// --keep K: every NAME.step<S> checkpoint beside --save but the K of the latest steps is removed.
void prune_periodic(const std::string& save, long keep) {
  if (keep <= 0) return;
  const std::filesystem::path path(save);
  std::vector<std::pair<long, std::filesystem::path>> found;
  std::error_code ec;
  const auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file(ec)) continue;
    if (const auto step = periodic_step(save, entry.path())) found.emplace_back(*step, entry.path());
  }
  std::sort(found.begin(), found.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < found.size(); ++i)
    std::filesystem::remove(found[i].second, ec);
}

// Training time over a stretch of steps: from `start`, less the pauses inside it (evaluations,
// checkpoints), so that a rate over the stretch is its steps' alone.
struct TrainingTime {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double paused = 0.0;

  double seconds() const { return std::max(1e-9, since(start) - paused); }
};

class TrainLoop {
 public:
  TrainLoop(const Options& o, const Plan& plan, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
            MetricsLog& metrics, Loaders& loaders)
      : o_(o),
        plan_(plan),
        engine_(engine),
        runtime_(runtime),
        test_(inputs.test),
        metrics_(metrics),
        loaders_(loaders) {}

  // Non-zero: the exit code of a run that stopped (a non-finite loss).
  int run();
  // The steps taken when run() returned 0: the planned end, or the step a stop signal ended it at.
  long reached() const { return reached_; }
  // 0, or the signal (SIGTERM, SIGINT) that stopped the run.
  int stop_signal() const { return stop_signal_; }

 private:
  // Pipelined (--pipeline on), step s is submitted before step s-1's loss is read, so the host
  // prepares and submits the next batch while the devices compute. Only within an epoch: the step
  // that ends one (or the run) is finished at once, since evaluating and saving need its state
  // with no later step applied. Everything printed and written is the same either way.
  struct Submitted {
    long s;
    double lr;
    long samples;
    dp::StepLoss loss;
  };

  std::vector<dp::Batch> next_batches(long& samples);
  int finish(Submitted& step);
  int finish_pending(std::optional<Submitted>& pending);
  void log_step(long s, long epoch, double lr, bool last);
  // On a terminal, the line updated in place after step s: where the run is, its loss and rate, and
  // when its epoch and the run will end (`extra`: the log step's gradient norm).
  void draw_progress(long s, long epoch, double lr, const std::string& extra = "");
  int end_epoch(long s, long epoch);
  // --eval-every: an evaluation after step s (not at an epoch's end, which evaluates anyway).
  bool eval_due(long s) const {
    return o_.eval_every > 0 && (s + 1) % o_.eval_every == 0 && plan_.epochs.into(s + 1) != 0 && s + 1 != end_step();
  }
  int evaluate_at(long s, long epoch);
  // --save-best: after an evaluation at `steps`, its checkpoint when the accuracy beats the best so
  // far (the first evaluation's always); whether it wrote one.
  bool save_if_best(const dp::EvalTotals& totals, long steps);
  long end_step() const { return plan_.end_step(); }
  // Time since `from` that was not training: out of the rates' windows.
  void pause(std::chrono::steady_clock::time_point from) {
    const double seconds = since(from);
    since_log_.paused += seconds;
    this_epoch_.paused += seconds;
    paused_total_ += seconds;
  }
  // Seconds of training since the loop began (pauses left out): when each step's loss was read.
  double training_clock() const { return since(t0_) - paused_total_; }
  // The stop signal every process agrees on before step s (0: none): under several processes the
  // first signalled process's, so that all stop at the same step.
  int agreed_stop(long s) const;
  // --save-every / --save-every-epoch after `steps` steps: whether one is due, and writing it.
  bool periodic_due(long steps) const {
    return (o_.save_every > 0 && steps % o_.save_every == 0) || (o_.save_every_epoch && plan_.epochs.into(steps) == 0);
  }
  void save_periodic(long steps);

  const Options& o_;
  const Plan& plan_;
  dp::Engine& engine_;
  dp::Runtime& runtime_;
  std::shared_ptr<const dp::SampleSource> test_;
  MetricsLog& metrics_;
  Loaders& loaders_;
  // mpirun forwards output through a pseudo-terminal: lines, not a progress line.
  const bool terminal_ = ::isatty(STDOUT_FILENO) != 0 && !g_job.several();
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  TrainingTime since_log_, this_epoch_;
  std::chrono::steady_clock::time_point drawn_ = t0_;  // the progress line's last update
  long samples_since_log_ = 0, steps_since_log_ = 0;
  // The rate of a log line spans at least kRateSteps steps: losses are read as the pipeline gives
  // them back, two of them at times back to back, and a window of one such step would log a rate of
  // millions of samples/s. `recent_`: (training_clock(), samples) of the last kRateSteps + 1 steps.
  static constexpr std::size_t kRateSteps = 4;
  std::deque<std::pair<double, long>> recent_;
  double paused_total_ = 0.0;
  float loss_ = 0.0f;
  double epoch_loss_sum_ = 0.0;  // sum of step loss x step samples: the epoch's mean per sample
  long epoch_samples_ = 0;
  long reached_ = 0;
  int stop_signal_ = 0;
  // --save-best's measure of an evaluation: a language model's held-out loss (nanoGPT's
  // best_val_loss: lower is better), else the test accuracy (higher is better).
  bool language_model() const { return model_of(o_).takes(dp::models::ModelArg::gpt); }
  double measure(const dp::EvalTotals& totals) const {
    return language_model() ? totals.mean_loss() : totals.accuracy();
  }
  std::string measure_text(double value) const {
    return language_model() ? fmt::format("test loss {:.4f}", value)
                            : fmt::format("test accuracy {:.2f}%", 100 * value);
  }
  // A language model's tokens per second beside its samples, in the step and epoch lines.
  std::string tokens_text(double samples_per_s) const {
    return language_model() ? fmt::format(" tokens/s {:.0f}", samples_per_s * o_.context) : std::string();
  }
  std::optional<double> best_;  // --save-best: the best measure of this run's evaluations
  long best_step_ = 0;          // and the step of the checkpoint it wrote
  // A diverged run's note on the best checkpoint it wrote before (it stays: a good model), or "".
  std::string kept() const {
    return best_ ? fmt::format("; --save-best {} holds step {}'s model ({})", o_.save_best, best_step_,
                               measure_text(*best_))
                 : "";
  }
};

int TrainLoop::agreed_stop(long s) const {
  if (o_.signal_at_step > 0 && s + 1 == o_.signal_at_step && g_job.primary()) std::raise(SIGTERM);
  const int local = g_stop_signal.load();
  if (!g_job.several()) return local;
  for (const int signal : g_job.processes()->all_gather(local))
    if (signal != 0) return signal;
  return 0;
}

void TrainLoop::save_periodic(long steps) {
  const auto began = std::chrono::steady_clock::now();
  const std::filesystem::path path = periodic_path(o_.save, steps);
  write_checkpoint(o_, engine_, plan_, path.string(), steps);
  if (g_job.primary()) prune_periodic(o_.save, o_.keep);
  pause(began);
}

int TrainLoop::run() {
  reached_ = end_step();
  std::optional<Submitted> pending;  // submitted, its loss not yet read
  for (long s = plan_.start_step; s < end_step(); ++s) {
    if (const int signal = agreed_stop(s)) {
      if (const int code = finish_pending(pending)) return code;
      reached_ = s;
      stop_signal_ = signal;
      say("\ndp_train: {}: stopping after step {} of {}\n", signal == SIGINT ? "SIGINT" : "SIGTERM", s, end_step());
      return 0;
    }
    const double lr = lr_at(o_, plan_.world, s, plan_.schedule);
    engine_.set_lr(lr);
    long samples = 0;
    const std::vector<dp::Batch> batches = next_batches(samples);
    if (s + 1 == o_.fail_at_step) {
      // What the step before reports comes first, as without pipelining.
      if (const int code = finish_pending(pending)) return code;
      throw dp::Error(fmt::format("failing at step {} as asked (--debug-fail-at-step)", s + 1));
    }
    std::optional<Submitted> submitted;
    try {
      submitted.emplace(Submitted{s, lr, samples, engine_.submit_step(batches)});
    } catch (...) {  // the step before is reported first (its log line, or its divergence), as step by step
      const std::exception_ptr failure = std::current_exception();
      try {
        if (const int code = finish_pending(pending)) return code;
      } catch (...) {
        // The step before failed too: by itself (its failure is the cause), or cut short when this
        // step's failure aborted the collectives it was still running (this one is).
        if (!dp::tools::is_consequence(std::current_exception())) throw;
      }
      std::rethrow_exception(failure);
    }
    if (const int code = finish_pending(pending)) return code;
    // A step after which something reads the state (an epoch's evaluation, a checkpoint, a stop
    // request, which every process checks before the next step) is finished before the next.
    const bool ends_epoch = plan_.epochs.into(s + 1) == 0 || s + 1 == end_step();
    const bool checkpoint = periodic_due(s + 1) && s + 1 < end_step();
    const bool evaluation = eval_due(s);
    if (o_.pipeline && !ends_epoch && !checkpoint && !evaluation) {
      pending = std::move(*submitted);
    } else if (const int code = finish(*submitted)) {
      return code;
    }
    if (evaluation)
      if (const int code = evaluate_at(s, plan_.epochs.of(s))) return code;
    if (checkpoint) save_periodic(s + 1);
  }
  // The training's time; evaluations and checkpoints (paused) apart.
  const double all = since(t0_);
  say("dp_train: {} step(s) in {:.2f} s, final loss {:.6f}{}\n", plan_.total_steps, training_clock(), loss_,
      paused_total_ > 0.005 ? fmt::format(" ({:.2f} s more evaluating and saving)", all - training_clock()) : "");
  return 0;
}

std::vector<dp::Batch> TrainLoop::next_batches(long& samples) {
  std::vector<dp::Batch> batches;
  // Rank after rank, each rank's micro-batches together (Engine::batches_per_step), as the loader makes them.
  for (long b = 0; b < engine_.batches_per_forward() * plan_.micro; ++b) {
    batches.push_back(loaders_->next());
    samples += batches.back().size;
  }
  samples *= plan_.shards / engine_.batches_per_forward();  // every rank's batch has this process's size
  return batches;
}

int TrainLoop::finish_pending(std::optional<Submitted>& pending) {
  if (!pending) return 0;
  const int code = finish(*pending);
  pending.reset();
  return code;
}

// Reads a submitted step's loss, then logs it and closes its epoch.
int TrainLoop::finish(Submitted& step) {
  const long s = step.s;
  loss_ = step.loss.get();
  const long epoch = plan_.epochs.of(s);
  // The loss of every rank: every process stops here.
  if (const int code = diverged(o_, loss_, "loss", fmt::format(" at step {} (epoch {})", s + 1, epoch + 1), kept()))
    return code;
  samples_since_log_ += step.samples;
  ++steps_since_log_;
  recent_.emplace_back(training_clock(), step.samples);
  if (recent_.size() > kRateSteps + 1) recent_.pop_front();
  epoch_loss_sum_ += static_cast<double>(loss_) * static_cast<double>(step.samples);
  epoch_samples_ += step.samples;
  const bool last = s + 1 == end_step();
  if ((s + 1) % o_.log_every == 0 || last)
    log_step(s, epoch, step.lr, last);
  else if (terminal_ && since(drawn_) >= 0.2)
    draw_progress(s, epoch, step.lr);
  // The end of an epoch (or of a run that stops inside one): its summary.
  if (plan_.epochs.into(s + 1) == 0 || last) return end_epoch(s, epoch);
  return 0;
}

void TrainLoop::log_step(long s, long epoch, double lr, bool last) {
  double rate = static_cast<double>(samples_since_log_) / since_log_.seconds();
  if (steps_since_log_ < static_cast<long>(kRateSteps)) {
    // The last kRateSteps steps, or every step since the loop began while there are fewer.
    const bool full = recent_.size() == kRateSteps + 1;
    long samples = 0;
    for (std::size_t i = full ? 1 : 0; i < recent_.size(); ++i) samples += recent_[i].second;
    rate = static_cast<double>(samples) / std::max(1e-9, recent_.back().first - (full ? recent_.front().first : 0.0));
  }
  // --clip-grad-norm: the step's norm before clipping (a wait for the step's update: at log lines only).
  const std::optional<float> grad_norm = engine_.last_grad_norm();
  const std::string line =
      fmt::format("step {:>6} epoch {:>3} loss {:.6f} lr {:.5g}{} samples/s {:.1f}{}", s + 1, epoch + 1, loss_, lr,
                  grad_norm ? fmt::format(" grad-norm {:.4g}", *grad_norm) : "", rate, tokens_text(rate));
  nlohmann::json record = {{"kind", "step"}, {"step", s + 1},         {"epoch", epoch + 1},     {"loss", loss_},
                           {"lr", lr},       {"samples_per_s", rate}, {"elapsed_s", since(t0_)}};
  if (grad_norm) record["grad_norm"] = *grad_norm;
  if (language_model()) record["tokens_per_s"] = rate * o_.context;
  metrics_.write(record);
  if (terminal_) {
    draw_progress(s, epoch, lr, grad_norm ? fmt::format(" | grad-norm {:.4g}", *grad_norm) : "");
    if (last) say("\n");
    std::fflush(stdout);
  } else {
    say("{}\n", line);
  }
  since_log_ = TrainingTime{};
  samples_since_log_ = 0;
  steps_since_log_ = 0;
}

void TrainLoop::draw_progress(long s, long epoch, double lr, const std::string& extra) {
  const long into = plan_.epochs.into(s) + 1, epoch_steps = plan_.epochs.steps;
  const double epoch_seconds = this_epoch_.seconds(), elapsed = since(t0_);
  const long done = s + 1 - plan_.start_step;
  // Steps of this epoch taken by this run (a resumed run starts inside one).
  const long epoch_done = std::min(into, done);
  const double per_step = epoch_seconds / static_cast<double>(std::max(epoch_done, 1L));
  const double epoch_eta = per_step * static_cast<double>(std::min(epoch_steps - into, end_step() - (s + 1)));
  const double run_eta = elapsed / static_cast<double>(std::max(done, 1L)) * static_cast<double>(end_step() - (s + 1));
  // \x1b[K: the rest of the terminal line cleared, where a longer line stood before.
  say("\rstep {}/{} | epoch {} {}/{} | loss {:.6f} | lr {:.5g} | {:.1f} samples/s{} | ETA epoch {}, run {}\x1b[K",
      s + 1, end_step(), epoch + 1, into, epoch_steps, loss_, lr,
      static_cast<double>(epoch_samples_) / std::max(epoch_seconds, 1e-9), extra, duration_text(epoch_eta),
      duration_text(run_eta));
  std::fflush(stdout);
  drawn_ = std::chrono::steady_clock::now();
}

int TrainLoop::evaluate_at(long s, long epoch) {
  const auto began = std::chrono::steady_clock::now();
  const dp::EvalTotals totals = evaluate(engine_, runtime_, test_, o_.batch_size, o_.workers);
  if (const int code = diverged(o_, totals.mean_loss(), fmt::format("the test loss after step {}", s + 1), "", kept()))
    return code;
  if (terminal_) say("\r\x1b[K");  // the progress line cleared
  say("eval  step {:>6} epoch {:>3} | test loss {:.4f} | test acc {:.2f}%{}\n", s + 1, epoch + 1, totals.mean_loss(),
      100.0 * totals.accuracy(), bits_per_byte_text(o_, totals));
  std::fflush(stdout);
  nlohmann::json record = {{"kind", "eval"},
                           {"step", s + 1},
                           {"epoch", epoch + 1},
                           {"test_loss", totals.mean_loss()},
                           {"test_accuracy", totals.accuracy()},
                           {"test_samples", totals.samples}};
  if (const auto bpb = bits_per_byte(o_, totals)) record["test_bits_per_byte"] = *bpb;
  if (save_if_best(totals, s + 1)) record["saved_best"] = o_.save_best;
  metrics_.write(record);
  pause(began);
  return 0;
}

bool TrainLoop::save_if_best(const dp::EvalTotals& totals, long steps) {
  const double value = measure(totals);
  if (o_.save_best.empty() || (best_ && (language_model() ? value >= *best_ : value <= *best_))) return false;
  best_ = value;
  best_step_ = steps;
  write_checkpoint(o_, engine_, plan_, o_.save_best, steps);
  say("dp_train: saved {} ({}, the best so far) at step {}\n", o_.save_best, measure_text(value), steps);
  return true;
}

int TrainLoop::end_epoch(long s, long epoch) {
  const auto began = std::chrono::steady_clock::now();
  const double train_seconds = this_epoch_.seconds();
  std::optional<dp::EvalTotals> totals;
  if (test_) totals = evaluate(engine_, runtime_, test_, o_.batch_size, o_.workers);
  if (totals)
    if (const int code =
            diverged(o_, totals->mean_loss(), fmt::format("the test loss after step {}", s + 1), "", kept()))
      return code;
  const double done = static_cast<double>(s + 1 - plan_.start_step), elapsed = since(t0_);
  const double eta = elapsed / done * static_cast<double>(end_step() - (s + 1));
  const double train_loss = epoch_loss_sum_ / static_cast<double>(std::max(epoch_samples_, 1L));
  const double rate = static_cast<double>(epoch_samples_) / std::max(1e-9, train_seconds);
  const bool complete = plan_.epochs.into(s + 1) == 0;
  if (terminal_) say("\r\x1b[K");  // the progress line cleared
  say("epoch {:>3}{} | train loss {:.4f}{} | {:.1f} samples/s{} | elapsed {} | ETA {}\n", epoch + 1,
      complete ? "" : " (partial)", train_loss,
      totals ? fmt::format(" | test loss {:.4f} | test acc {:.2f}%{}", totals->mean_loss(), 100.0 * totals->accuracy(),
                           bits_per_byte_text(o_, *totals))
             : "",
      rate, language_model() ? fmt::format(" | {:.0f} tokens/s", rate * o_.context) : std::string(),
      duration_text(elapsed), duration_text(eta));
  std::fflush(stdout);
  nlohmann::json record = {
      {"kind", "epoch"},          {"epoch", epoch + 1},    {"step", s + 1},        {"complete", complete},
      {"train_loss", train_loss}, {"samples_per_s", rate}, {"elapsed_s", elapsed}, {"eta_s", eta},
      {"precision", o_.precision}};
  if (language_model()) record["tokens_per_s"] = rate * o_.context;
  for (const auto& [tag, value] : dp::tools::per_epoch_settings(o_, dp::to_string(o_.mode))) record[tag] = value;
  record["test_loss"] = totals ? nlohmann::json(totals->mean_loss()) : nlohmann::json(nullptr);
  record["test_accuracy"] = totals ? nlohmann::json(totals->accuracy()) : nlohmann::json(nullptr);
  if (totals) record["test_samples"] = totals->samples;
  if (const auto bpb = totals ? bits_per_byte(o_, *totals) : std::nullopt) record["test_bits_per_byte"] = *bpb;
  if (totals && save_if_best(*totals, s + 1)) record["saved_best"] = o_.save_best;
  metrics_.write(record);
  epoch_loss_sum_ = 0.0;
  epoch_samples_ = 0;
  pause(began);  // the evaluation is not training time
  this_epoch_ = TrainingTime{};
  return 0;
}

// No later step checks the last step's update with its loss: the model the run ends with must give
// a finite loss, in evaluation (as a checkpoint is used), on the first global batch of the training
// data. The test set already checked it when there is one.
int check_final_model(const Options& o, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs) {
  if (inputs.test) return 0;
  const std::size_t count = static_cast<std::size_t>(o.batch_size) * static_cast<std::size_t>(engine.world_size());
  const dp::EvalTotals totals =
      evaluate(engine, runtime, std::make_shared<dp::FirstSamples>(inputs.data, count), o.batch_size, o.workers);
  return diverged(o, totals.mean_loss(), "the loss of the final model on the first batch");
}

// The training state after `step` steps into `path` (process 0 writes it; the others' replicas are
// equal). The schedule's T_max and the end it is planned to reach are the whole run's, so a run
// resumed from a checkpoint taken part-way continues the same curve to the same end; where the
// epoch of its next step began and the epochs' length let it number its epochs on.
dp::TrainingProgress checkpoint_progress(const Options& o, const Plan& plan, long step) {
  dp::TrainingProgress progress;
  progress.step = step;
  progress.epoch = plan.epochs.of(step);
  progress.seed = o.seed;
  progress.tags = run_settings(o, resolved_t_max(o, plan.end_step()));
  progress.tags["mode"] = dp::to_string(o.mode);
  progress.tags["world"] = fmt::format("{}", plan.world);
  progress.tags["end_step"] = fmt::format("{}", plan.end_step());
  if (plan.end_epoch) progress.tags["end_epoch"] = fmt::format("{}", *plan.end_epoch);
  progress.tags["epoch_start"] = fmt::format("{}", plan.epochs.start(step));
  progress.tags["epoch_steps"] = fmt::format("{}", plan.epochs.steps);
  return progress;
}

void write_checkpoint(const Options& o, dp::Engine& engine, const Plan& plan, const std::string& path, long step) {
  engine.synchronize();
  // Every process: under ZeRO the whole state is gathered from every rank.
  const std::vector<dp::Optimizer*> whole = engine.whole_optimizers();
  if (!g_job.primary()) return;
  dp::TrainingState::save(path, engine.model(), *whole.front(), checkpoint_progress(o, plan, step));
}

void save(const Options& o, dp::Engine& engine, const Plan& plan, long step) {
  engine.synchronize();
  if (!o.save.empty()) {
    // Every process: the whole optimizer state may be a collective (ZeRO); process 0 writes.
    write_checkpoint(o, engine, plan, o.save, step);
    say("dp_train: saved {}{}\n", o.save,
        step < plan.start_step + plan.total_steps ? fmt::format(" at step {}", step) : "");
  }
  g_job.collectives_end();
  g_job.agree_or_stop();
}

// With the data loaded, the model built and the loaders' threads started, the address space they
// take is known: the limit (ulimit -v) must still leave room for what the first steps map, the
// sim's GEMM buffers above all (tools/address_space.h).
void check_address_space_left(const Options& o, const Devices& devices, const Inputs& inputs) {
  const std::uint64_t count = devices.ids.size();
  const std::uint64_t eval_threads = inputs.test ? count * (1 + static_cast<std::uint64_t>(o.workers)) : 0;
  dp::tools::check_address_space(0, devices.cuda ? 0 : count, eval_threads, "the data and model loaded");
}

// Trains, checks the final model and saves it. SIGTERM and SIGINT are the run's until the save is
// done: one during the steps stops the run after the step in flight (exit 143, 130, saved); one
// after the last step leaves a complete run, which is checked and saved as if none had come (exit 0).
int train(const Options& o, const Plan& plan, dp::Engine& engine, dp::Runtime& runtime, const Inputs& inputs,
          MetricsLog& metrics, Loaders& loaders) {
  const StopSignals signals;
  TrainLoop loop(o, plan, engine, runtime, inputs, metrics, loaders);
  if (const int code = loop.run()) return code;
  if (o.signal_at_step == plan.end_step() + 1 && !loop.stop_signal() && g_job.primary()) std::raise(SIGTERM);
  if (const int code = check_final_model(o, engine, runtime, inputs)) return code;
  save(o, engine, plan, loop.reached());
  if (loop.stop_signal()) return 128 + loop.stop_signal();
  if (const int late = g_stop_signal.load())
    say("dp_train: {} after the last step: the run is complete{}\n", late == SIGINT ? "SIGINT" : "SIGTERM",
        o.save.empty() ? "" : fmt::format(", {} saved", o.save));
  return 0;
}

}  // namespace dp_train
