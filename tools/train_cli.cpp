// train_cli.cpp — dp_train's flags as tables (tools/flags.h: the shared ones, then dp_train's own),
// the relations between them, and each optimizer's defaults, read into Options.
#include "train_cli.h"

#include <cstdio>
#include <fmt/format.h>
#include <limits>
#include <string>
#include <vector>

#include "flags.h"

namespace dp_train {
namespace {

using dp::tools::Flag;
using dp::tools::FlagGroup;
using dp::tools::Saved;
using O = Options;
namespace flag = dp::tools;

// --eval and --no-eval: Options::eval set either way, unset when neither is given.
dp::tools::Value<O> evaluation(bool value) {
  return {"", [](const std::string&) { return std::string(); }, [value](O& o, const std::string&) { o.eval = value; },
          [](const O& o) { return o.eval ? fmt::format("{}", *o.eval) : std::string(); }};
}

// The model and its shape: which one, its sizes (the GPT's and the Dropout: dp_bench's too).
std::vector<Flag<O>> model_architecture_flags() {
  std::vector<Flag<O>> flags = {
      {.name = "--model",
       .value = flag::choice<O>(&O::model, dp::models::model_names(), "NAME"),
       .help = "the model (listed below)",
       .torch = "torchvision.models.resnet18(num_classes=K) for resnet18",
       .torch_spellings = {"-a", "--arch"},
       .saved = Saved::always,
       .structural = true},
      {.name = "--hidden",
       .value = flag::text<O>(&O::hidden, "H1,H2,...", true),
       .help = "mlp: the hidden layers' sizes",
       .saved = Saved::always,
       .structural = true,
       .model_arg = dp::models::ModelArg::hidden},
  };
  for (Flag<O>& shape : dp::tools::model_shape_flags<O>()) flags.push_back(std::move(shape));
  return flags;
}

// What the model's inputs and its loss are made of: classes, image sizes and transforms, dropout,
// micro-batches, label smoothing.
std::vector<Flag<O>> model_input_flags() {
  return {
      {.name = "--num-classes",
       .value = flag::integer<O>(&O::num_classes, 1, 1 << 20, "K"),
       .help = "resnet18/34: fc's outputs",
       .torch = "resnet18(num_classes=K)",
       .default_text = "the number of class folders",
       .saved = Saved::always,
       .structural = true},
      {.name = "--image-size",
       .value = flag::integer<O>(&O::image_size, 1, 1 << 14, "S"),
       .help = "image folders: S x S crops (random-resized in training, centred in evaluation)",
       .torch = "RandomResizedCrop(S), CenterCrop(S)",
       .saved = Saved::always,
       .model_arg = dp::models::ModelArg::image_size},
      {.name = "--resize",
       .value = flag::integer<O>(&O::resize, 1, 1 << 16, "R"),
       .help = "image folders, evaluation: the shorter side resized to R before the crop",
       .torch = "Resize(R)",
       .default_text = "S * 256 / 224",
       .saved = Saved::always},
      {.name = "--normalize",
       .value = flag::text<O>(&O::normalize, "MEAN,STD"),
       .help = "inputs (pixel/255 - MEAN) / STD; per RGB channel as MEANS/STDS (0.485,0.456,0.406/0.229,...)",
       .torch = "transforms.Normalize(mean, std)",
       .saved = Saved::always},
      {.name = "--accumulate",
       .value = flag::integer<O>(&O::accumulate, 1, 1 << 20, "K"),
       .help = "K micro-batches of --batch-size per optimizer step, each loss / K, the gradients reduced "
               "once (ddp: no_sync for the first K-1); --steps and the schedule count optimizer steps",
       .torch = "(loss / K).backward() per micro-batch, with ddp.no_sync() but for the last; optimizer.step() "
                "every K",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.accumulate = o.accumulate; }},
      {.name = "--label-smoothing",
       .value = flag::number<O>(&O::label_smoothing, flag::kUnitInterval, "S"),
       .help = "the cross-entropy's label smoothing",
       .torch = "CrossEntropyLoss(label_smoothing=S)",
       .saved = Saved::always,
       .engine = [](const O& o, dp::EngineOptions& e) { e.step.label_smoothing = o.label_smoothing; }},
  };
}

// The model and what shapes its inputs: the flags a checkpoint records first (run_settings.h).
FlagGroup<O> model_flags() {
  return dp::tools::joined<O>("model and its inputs", {model_architecture_flags(), model_input_flags()});
}

// The optimizer's hyper-parameters.
std::vector<Flag<O>> optimizer_setting_flags() {
  return {
      {.name = "--lr",
       .value = flag::number<O>(&O::lr, flag::kNonNegative),
       .help = "the learning rate",
       .torch = "optim.SGD(lr=X), optim.AdamW(lr=X)",
       .torch_spellings = {"--learning-rate", "--learning_rate"},
       .saved = Saved::on_resume},
      {.name = "--momentum",
       .value = flag::number<O>(&O::momentum, flag::kNonNegative),
       .help = "sgd: momentum (torch.optim.SGD's default is 0)",
       .torch = "SGD(momentum=X)",
       .saved = Saved::on_resume},
      {.name = "--weight-decay",
       .value = flag::number<O>(&O::weight_decay, flag::kNonNegative),
       .help = "weight decay (adamw: decoupled)",
       .torch = "weight_decay=X",
       .torch_spellings = {"--wd"},
       .saved = Saved::on_resume},
      {.name = "--decay",
       .value = flag::named<O>(&O::decay, {{"all", dp::WeightDecayOn::all}, {"matrices", dp::WeightDecayOn::matrices}}),
       .help = "what --weight-decay applies to: every parameter, or the matrices only (biases and "
               "norm weights in a group without decay, as nanoGPT's configure_optimizers)",
       .torch = "AdamW([{'params': 2-D, 'weight_decay': X}, {'params': 1-D, 'weight_decay': 0}])",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.weight_decay_on = o.decay; }},
      {.name = "--nesterov",
       .value = flag::on<O>(&O::nesterov),
       .help = "sgd: Nesterov momentum",
       .torch = "SGD(nesterov=True)",
       .saved = Saved::on_resume},
      {.name = "--beta1",
       .value = flag::number<O>(&O::beta1, flag::kBelowOne),
       .help = "adamw: the first moment's decay",
       .torch = "AdamW(betas=(X, _))",
       .saved = Saved::on_resume},
      {.name = "--beta2",
       .value = flag::number<O>(&O::beta2, flag::kBelowOne),
       .help = "adamw: the second moment's decay",
       .torch = "AdamW(betas=(_, X))",
       .saved = Saved::on_resume},
      {.name = "--eps",
       .value = flag::number<O>(&O::eps, flag::kNonNegative),
       .help = "adamw: the denominator's epsilon",
       .torch = "AdamW(eps=X)",
       .saved = Saved::on_resume},
      {.name = "--scale-lr",
       .value = flag::on<O>(&O::scale_lr),
       .help = "multiply the lr by the devices training (in ddp: of every process)",
       .torch = "lr *= world_size",
       .saved = Saved::on_resume},
  };
}

// The learning rate's schedule over the steps.
std::vector<Flag<O>> schedule_flags() {
  return {
      {.name = "--schedule",
       .value = flag::named<O>(&O::schedule, {Schedule::none, Schedule::step, Schedule::cosine}),
       .help = "the lr per step after the warm-up",
       .torch = "StepLR, CosineAnnealingLR",
       .saved = Saved::on_resume},
      {.name = "--warmup-steps",
       .value = flag::integer<O>(&O::warmup_steps),
       .help = "linear lr warm-up steps (from lr / N, or from lr with --scale-lr)",
       .saved = Saved::on_resume},
      {.name = "--step-size",
       .value = flag::integer<O>(&O::step_size),
       .help = "step: multiply the lr by --gamma every N steps",
       .torch = "StepLR(step_size=N)",
       .saved = Saved::on_resume},
      {.name = "--gamma",
       .value = flag::number<O>(&O::gamma, flag::kPositive),
       .help = "step: the factor",
       .torch = "StepLR(gamma=X)",
       .saved = Saved::on_resume},
      {.name = "--eta-min",
       .value = flag::number<O>(&O::eta_min, flag::kNonNegative),
       .help = "cosine: the lr at the end",
       .torch = "CosineAnnealingLR(eta_min=X)",
       .saved = Saved::on_resume},
      {.name = "--t-max",
       .value = flag::integer<O>(&O::t_max),
       .help = "cosine: steps to anneal over",
       .torch = "CosineAnnealingLR(T_max=N)",
       .default_text = "the rest of the run",
       .saved = Saved::on_resume},
  };
}

FlagGroup<O> optimizer_flags() {
  return dp::tools::joined<O>("optimizer and learning rate", {optimizer_setting_flags(), schedule_flags()});
}

FlagGroup<O> engine_flags() {
  return {"engine and devices",
          {
              {.name = "--mode",
               .value = flag::named<O>(
                   &O::mode,
                   {{"single", dp::EngineKind::single}, {"dp", dp::EngineKind::dp}, {"ddp", dp::EngineKind::ddp}}),
               .help = "one device, DataParallel, or DistributedDataParallel (a rank per device)",
               .torch = "nn.DataParallel(model), DistributedDataParallel(model)"},
              {.name = "--device-ids",
               .value = flag::text<O>(&O::device_ids, "I,J,...", true),
               .help = "the devices in rank order, e.g. 2,0,1",
               .torch = "DataParallel(device_ids=[I, J, ...])",
               .torch_spellings = {"--gpu"}},
              {.name = "--output-device",
               .value = flag::integer<O>(&O::output_device, 0, std::numeric_limits<int>::max(), "D"),
               .help = "dp: the device that gathers the outputs and computes the loss",
               .torch = "DataParallel(output_device=D)",
               .default_text = "the first device",
               .engine = [](const O& o, dp::EngineOptions& e) { e.output_device = o.output_device; }},
          }};
}

FlagGroup<O> data_flags() {
  return {
      "data",
      {
          {.name = "--data",
           .value = flag::text<O>(&O::data, "DIR"),
           .help = "IDX files (train-*, t10k-* to evaluate; plain or .gz), an installed set (fashion-mnist, mnist), "
                   "or an image folder holding train/ and val/"},
          {.name = "--text",
           .value = flag::text<O>(&O::text, "FILE"),
           .help = "a text file for --model gpt: its bytes are the tokens, the last 10 % held out, windows of "
                   "--context + 1 bytes"},
          {.name = "--tokens",
           .value = flag::text<O>(&O::tokens, "PATTERN"),
           .help = "llm.c token shards for --model gpt (a glob, e.g. 'fineweb_train_*.bin'): samples of --context + "
                   "1 tokens in llm.c's DataLoader order (its batches of the global batch, shuffled as train_gpt2.c "
                   "shuffles them unless --no-shuffle)"},
          {.name = "--val-tokens",
           .value = flag::text<O>(&O::val_tokens, "PATTERN"),
           .help = "llm.c token shards to evaluate on, in order"},
          {.name = "--train-dir",
           .value = flag::text<O>(&O::train_dir, "DIR"),
           .help = "an image folder to train on: a subfolder of JPEG/PNG files per class",
           .torch = "datasets.ImageFolder(DIR)"},
          {.name = "--val-dir",
           .value = flag::text<O>(&O::val_dir, "DIR"),
           .help = "the image folder to evaluate on (the training folder's classes)"},
          {.name = "--synthetic",
           .value = flag::integer<O>(&O::synthetic, 1, std::size_t{1} << 26),
           .help = "train on N synthetic samples",
           .default_text = "2048 without --data"},
          {.name = "--limit-train",
           .value = flag::integer<O>(&O::limit_train, 1),
           .help = "train on the first N samples only",
           .torch = "Subset(ds, range(N))"},
          {.name = "--limit-test",
           .value = flag::integer<O>(&O::limit_test, 1),
           .help = "evaluate on the first N samples only",
           .torch = "Subset(ds, range(N))"},
          {.name = "--epochs",
           .value = flag::integer<O>(&O::epochs, 1),
           .help = "passes over the training data in all, from epoch 1 with --resume too",
           .default_text = "1"},
          {.name = "--no-shuffle",
           .value = flag::on<O>(&O::no_shuffle),
           .help = "visit the samples in order",
           .torch = "DataLoader(shuffle=False), DistributedSampler(shuffle=False)",
           .saved = Saved::on_resume},
          {.name = "--workers",
           .value = flag::integer<O>(&O::workers, 0, 256),
           .help = "threads decoding and augmenting each batch, per loader (0: the loader's own)",
           .torch = "DataLoader(num_workers=N)",
           .torch_spellings = {"-j"}},
          {.name = "--loader-only",
           .value = flag::on<O>(&O::loader_only),
           .help = "read the run's batches without training; report the loader's images/s"},
      }};
}

FlagGroup<O> checkpoint_flags() {
  return {"checkpoints",
          {
              {.name = "--init",
               .value = flag::text<O>(&O::init, "FILE"),
               .help = "load weights and buffers (safetensors) before training: every tensor, and only those",
               .torch = "model.load_state_dict(sd)"},
              {.name = "--init-non-strict",
               .value = flag::on<O>(&O::init_non_strict),
               .help = "--init loads what matches and prints the rest (a shape mismatch stays an error)",
               .torch = "load_state_dict(sd, strict=False)"},
              {.name = "--freeze",
               .value = flag::texts<O>(&O::freeze, "PREFIX"),
               .help = "keep the parameters under PREFIX fixed: no update, no optimizer state (repeatable)",
               .torch = "p.requires_grad_(False)",
               .engine = [](const O& o, dp::EngineOptions& e) { e.frozen = o.freeze; }},
              {.name = "--save",
               .value = flag::text<O>(&O::save, "FILE"),
               .help = "write the final state here; also when SIGTERM or SIGINT stops the run (exit 143, 130)",
               .torch = "torch.save(model.state_dict(), FILE)"},
              {.name = "--save-every",
               .value = flag::integer<O>(&O::save_every, 1),
               .help = "also a checkpoint every N steps, beside --save as NAME.stepS.safetensors",
               .default_text = "none"},
              {.name = "--save-every-epoch",
               .value = flag::on<O>(&O::save_every_epoch),
               .help = "also a checkpoint at the end of every epoch"},
              {.name = "--keep",
               .value = flag::integer<O>(&O::keep, 1, std::numeric_limits<long>::max(), "K"),
               .help = "keep only the last K periodic checkpoints",
               .default_text = "every one"},
              {.name = "--resume",
               .value = flag::text<O>(&O::resume, "FILE"),
               .help = "continue a --save checkpoint's run to its planned end: weights, optimizer state, step, seed",
               .torch = "load_state_dict of the model, optimizer and scheduler"},
          }};
}

FlagGroup<O> output_flags() {
  return {
      "evaluation and output",
      {
          {.name = "--eval",
           .value = evaluation(true),
           .help = "after every epoch, the test loss and accuracy over the whole test set",
           .default_text = "on when the data has a test split"},
          {.name = "--no-eval", .value = evaluation(false), .help = "no evaluation"},
          {.name = "--eval-every",
           .value = flag::integer<O>(&O::eval_every, 1, std::uint64_t{1} << 40),
           .help = "also evaluate every N steps (the test loss and accuracy, a line and an \"eval\" record)",
           .torch = "if step % N == 0: validate(model)",
           .default_text = "at the end of each epoch only"},
          {.name = "--save-best",
           .value = flag::text<O>(&O::save_best, "FILE"),
           .help = "write the checkpoint of the best test accuracy so far here, at each evaluation that improves it",
           .torch = "if acc > best_acc: torch.save(model.state_dict(), FILE)"},
          {.name = "--eval-only",
           .value = flag::on<O>(&O::eval_only),
           .help = "evaluate the --init checkpoint on the test set, train nothing",
           .torch_spellings = {"-e", "--evaluate"}},
          {.name = "--generate",
           .value = flag::integer<O>(&O::generate, 1, std::uint64_t{1} << 30, "N"),
           .help = "gpt: print N tokens sampled from the --init checkpoint after --prompt, train nothing",
           .torch = "model.generate(idx, N, temperature, top_k) (nanoGPT)"},
          {.name = "--num-samples",
           .value = flag::integer<O>(&O::num_samples, 1, 1 << 20, "N"),
           .help = "--generate: N samples, each printed after the prompt, a rule of dashes between them",
           .torch = "sample.py's num_samples (nanoGPT's default 10)",
           .default_text = "1"},
          {.name = "--prompt",
           .value = flag::text<O>(&O::prompt, "BYTES"),
           .help = "--generate: the text the sample continues",
           .default_text = "a newline"},
          {.name = "--tokenizer",
           .value = flag::text<O>(&O::tokenizer, "FILE"),
           .help = "--generate: llm.c's tokenizer file (gpt2_tokenizer.bin), which decodes a vocabulary larger than "
                   "bytes (an llm.c checkpoint's) and encodes --prompt by its longest tokens (the file holds no BPE "
                   "merges); without --prompt each sample starts at its <|endoftext|>, as llm.c's do",
           .torch = "llm.c's tokenizer_init and tokenizer_decode"},
          {.name = "--temperature",
           .value = flag::number<O>(&O::temperature, flag::kPositive, "T"),
           .help = "--generate: the logits divided by T before the softmax"},
          {.name = "--top-k",
           .value = flag::integer<O>(&O::top_k, 0, 1 << 24, "K"),
           .help = "--generate: sample among the K likeliest tokens only (0: all)"},
          {.name = "--predictions",
           .value = flag::text<O>(&O::predictions, "FILE"),
           .help = "--eval-only: each test sample's predicted class, one per line"},
          {.name = "--log-every",
           .value = flag::integer<O>(&O::log_every, 1, std::uint64_t{1} << 40, "K"),
           .help = "log every K steps",
           .torch_spellings = {"-p", "--print-freq"}},
          {.name = "--log-batches",
           .value = flag::on<O>(&O::log_batches),
           .help = "print the sample indices of every batch (per rank)"},
          {.name = "--metrics-json",
           .value = flag::text<O>(&O::metrics_json, "FILE"),
           .help = "every logged step and epoch, one JSON object per line"},
          // The failure tests start one process of an mpirun job with these.
          {.name = "--debug-signal-at-step",
           .value = flag::integer<O>(&O::signal_at_step),
           .help = "process 0 raises SIGTERM before step N (the last step + 1: before the final check and save)",
           .hidden = true},
          {.name = "--debug-fail-at-step",
           .value = flag::integer<O>(&O::fail_at_step),
           .help = "this process fails at step N",
           .hidden = true},
      }};
}

// The flags that go together or exclude each other.
void relate(dp::tools::CommandLine& cli) {
  cli.option("--devices")->excludes(cli.option("--device-ids"));
  for (const char* flag : {"--train-dir", "--val-dir", "--synthetic"}) cli.option("--data")->excludes(flag);
  for (const char* flag : {"--train-dir", "--val-dir"}) cli.option("--synthetic")->excludes(flag);
  for (const char* flag : {"--data", "--train-dir", "--val-dir", "--synthetic"}) {
    cli.option("--text")->excludes(flag);
    cli.option("--tokens")->excludes(flag);
  }
  cli.option("--text")->excludes("--tokens");
  cli.option("--val-tokens")->needs(cli.option("--tokens"));
  cli.option("--steps")->excludes(cli.option("--epochs"));
  cli.option("--eval")->excludes(cli.option("--no-eval"));
  cli.option("--init-non-strict")->needs(cli.option("--init"));
  for (const char* flag : {"--prompt", "--temperature", "--top-k", "--num-samples", "--tokenizer"})
    cli.option(flag)->needs("--generate");
  for (const char* flag : {"--save-every", "--save-every-epoch", "--keep"}) cli.option(flag)->needs("--save");
}

// Each optimizer's flags are refused with the other; false once a refusal is printed.
bool check_optimizer_flags(const Options& o) {
  const bool adamw = o.optimizer == dp::tools::OptimizerKind::adamw;
  const std::vector<std::string> other_optimizers_flags = adamw
                                                              ? std::vector<std::string>{"--momentum", "--nesterov"}
                                                              : std::vector<std::string>{"--beta1", "--beta2", "--eps"};
  for (const std::string& flag : other_optimizers_flags) {
    if (o.given.count(flag)) {
      fmt::print(stderr, "dp_train: error: {} does not apply to --optimizer {}\n", flag, to_string(o.optimizer));
      return false;
    }
  }
  return true;
}

}  // namespace

const std::vector<FlagGroup<Options>>& train_flags() {
  static const std::vector<FlagGroup<O>> groups = {
      model_flags(), dp::tools::shared_flags<O>(), optimizer_flags(), engine_flags(),
      data_flags(),  checkpoint_flags(),           output_flags()};
  return groups;
}

std::string models_taking(dp::models::ModelArg arg) {
  std::vector<std::string> names;
  for (const dp::models::ModelSpec& spec : dp::models::all_models())
    if (spec.takes(arg)) names.emplace_back(spec.name());
  return dp::tools::or_list(names);
}

std::string misapplied_model_flag(const Options& o) {
  const dp::models::ModelSpec& model = dp::models::model_spec(o.model);
  for (const FlagGroup<Options>& group : train_flags())
    for (const Flag<Options>& flag : group.flags)
      if (flag.model_arg && o.given.count(flag.name) && !model.takes(*flag.model_arg))
        return fmt::format("{} applies to --model {}, not --model {}", flag.name, models_taking(*flag.model_arg),
                           o.model);
  return "";
}

Parsed parse_command_line(int argc, const char* const* argv, Options& o) {
  dp::tools::CommandLine cli(
      "dp_train", "dp_train: train a reference model on one device, with DataParallel or with DistributedDataParallel",
      "dp_train: error: ");
  Options defaults;
  cli.add(train_flags(), o, defaults);
  relate(cli);
  // --help shows the lr and weight decay of the optimizer chosen (torch.optim.AdamW: 1e-3, 1e-2).
  cli.before_help([&] {
    defaults.optimizer = o.optimizer;
    apply_optimizer_defaults(defaults);
  });
  cli.footer(dp::tools::models_help());
  switch (cli.parse(argc, argv)) {
    case dp::tools::CommandLine::Parsed::help: return Parsed::help;
    case dp::tools::CommandLine::Parsed::refused: return Parsed::refused;
    case dp::tools::CommandLine::Parsed::run: break;
  }
  o.given = cli.given();
  if (!check_optimizer_flags(o)) return Parsed::refused;
  apply_optimizer_defaults(o);
  return Parsed::run;
}

}  // namespace dp_train
