// train_cli.cpp — dp_train's command line: every flag, its check and its default, into Options.
#include "train_cli.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fmt/format.h>
#include <limits>
#include <string>
#include <vector>

#include "dp_cli.h"
#include "run_settings.h"

namespace dp_train {
namespace {

// A number in `range` (e.g. ">= 0", "in [0, 1)"), named readably (CLI11's own bound is the
// 309-digit largest double). The engine computes in fp32, so the value must also be finite as a
// float: 1e39 would become inf there, and NaN passes every comparison CLI::Range makes.
CLI::Validator finite_number(bool (*in_range)(double), const std::string& range) {
  return CLI::Validator(
      [in_range, range](const std::string& text) {
        double value = std::nan("");
        try {
          std::size_t used = 0;
          value = std::stod(text, &used);
          if (used != text.size()) value = std::nan("");
        } catch (const std::exception&) {
        }
        if (!std::isfinite(value) || !in_range(value))
          return fmt::format("'{}' is not a finite number {}", text, range);
        if (std::fabs(value) > std::numeric_limits<float>::max())
          return fmt::format("'{}' overflows a float (at most {:g})", text, std::numeric_limits<float>::max());
        return std::string();
      },
      range);
}

CLI::Validator non_negative_number() {
  return finite_number([](double v) { return v >= 0.0; }, ">= 0");
}
CLI::Validator positive_number() {
  return finite_number([](double v) { return v > 0.0; }, "> 0");
}
// [0, 1): a decay that must forget (AdamW's betas, as torch.optim.AdamW requires).
CLI::Validator fraction_below_one() {
  return finite_number([](double v) { return v >= 0.0 && v < 1.0; }, "in [0, 1)");
}

// The options are added group by group in the order --help lists them; integers are decimal only
// and within range (dp_cli::add_integer).
void add_model_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model,
                 "mlp, convnet, resnet8 (28x28 grey images) or resnet18, resnet34 (torchvision's, RGB image folders)")
      ->check(CLI::IsMember({"mlp", "convnet", "resnet8", "resnet18", "resnet34"}));
  dp_cli::add_integer(app, "--num-classes", o.num_classes,
                      "resnet18/34: fc's outputs (default: the number of class folders)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--dropout", o.dropout, "mlp: Dropout(P) after each hidden ReLU, P in [0, 1] (default 0: none)")
      ->check(finite_number([](double v) { return v >= 0.0 && v <= 1.0; }, "in [0, 1]"));
  app.add_flag("--sync-bn", o.sync_bn, "ddp: SyncBatchNorm, BatchNorm statistics over all ranks' batches");
  app.add_option("--amp", o.amp,
                 "off (default), or bf16: torch.autocast(dtype=torch.bfloat16) -- Linear and Conv2d on bf16 inputs "
                 "and weights with fp32 accumulation, bf16 activations, fp32 loss and master weights")
      ->check(CLI::IsMember({"off", "bf16"}));
  app.add_option("--grad-reduce", o.grad_reduce,
                 "ddp: fp32 (default), or bf16: gradients all-reduced in bfloat16 as torch's bf16_compress_hook "
                 "(half the bytes, bf16's precision)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--label-smoothing", o.label_smoothing, "CrossEntropyLoss(label_smoothing=S), S in [0, 1]")
      ->check(finite_number([](double v) { return v >= 0.0 && v <= 1.0; }, "in [0, 1]"));
  app.add_option("--hidden", o.hidden, "MLP hidden sizes, e.g. 256,256");
}

void add_device_options(CLI::App& app, Options& o) {
  app.add_option("--mode", o.mode, "single, dp or ddp")->check(CLI::IsMember({"single", "dp", "ddp"}));
  app.add_option("--backend", o.backend, "auto, cuda or sim")->check(CLI::IsMember({"auto", "cuda", "sim"}));
  app.add_option("--precision", o.precision,
                 "strict (default: cuDNN exact fp32 and deterministic, within rounding of the host path), fast "
                 "(PyTorch's defaults: fastest cuDNN algorithm, TF32 convolutions, nondeterministic; the sim "
                 "computes what strict does) or tf32 (fast, and TF32 matmuls as torch's allow_tf32 = True; the sim "
                 "rounds every GEMM operand to TF32)")
      ->check(CLI::IsMember({"strict", "fast", "tf32"}));
  app.add_option("--graphs", o.graphs,
                 "on (default): capture the training step once per batch size and replay it (CUDA graphs; emulated "
                 "on sim; the same results bit for bit), off: launch every kernel every step")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--pipeline", o.pipeline,
                 "on (default): submit each step before reading the previous step's loss, so the host prepares the "
                 "next batch while the devices compute (within an epoch; the same output), off: wait for each loss")
      ->check(CLI::IsMember({"on", "off"}));
  auto* devices = dp_cli::add_integer(app, "--devices", o.devices, "use devices 0..N-1")->check(CLI::Range(1, 1 << 20));
  app.add_option("--device-ids", o.device_ids, "devices in rank order, e.g. 2,0,1")->excludes(devices);
  dp_cli::add_integer(app, "--devices-per-gpu", o.devices_per_gpu,
                      "K dp devices on each GPU (device d on GPU d/K), so that multi-device runs fit one GPU; same "
                      "results bit for bit (default: 1)")
      ->check(CLI::Range(1, 64));
  dp_cli::add_integer(app, "--output-device", o.output_device,
                      "dp: the device that gathers outputs and computes the loss");
}

void add_data_options(CLI::App& app, Options& o) {
  auto* data = app.add_option("--data", o.data,
                              "directory with train-{images-idx3,labels-idx1}-ubyte (and t10k-* for --eval), plain "
                              "or .gz; or an installed data set's name: fashion-mnist, mnist");
  auto* train_dir =
      app.add_option("--train-dir", o.train_dir,
                     "an image folder to train on (torchvision's ImageFolder: a subfolder of JPEG/PNG files per "
                     "class); --data DIR with DIR/train and DIR/val names both")
          ->excludes(data);
  auto* val_dir =
      app.add_option("--val-dir", o.val_dir, "the image folder to evaluate on (its classes: the training folder's)")
          ->excludes(data);
  dp_cli::add_integer(app, "--image-size", o.image_size,
                      "image folders: the size S of the S x S crops (RandomResizedCrop in training, CenterCrop in "
                      "evaluation; default 224)")
      ->check(CLI::Range(1, 1 << 14));
  dp_cli::add_integer(app, "--resize", o.resize,
                      "image folders, evaluation: Resize(R) of the shorter side before CenterCrop (default "
                      "S * 256 / 224)")
      ->check(CLI::Range(1, 1 << 16));
  dp_cli::add_integer(app, "--workers", o.workers,
                      "threads decoding and augmenting each batch, per loader (DataLoader's num_workers; "
                      "default 0: the loader's own thread)")
      ->check(CLI::Range(0, 256));
  app.add_flag("--loader-only", o.loader_only,
               "read the run's batches without training and report the loader's images/s");
  dp_cli::add_integer(app, "--synthetic", o.synthetic, "use N synthetic samples (the default: 2048)")
      ->excludes(data)
      ->excludes(train_dir)
      ->excludes(val_dir)
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 26));
  dp_cli::add_integer(app, "--limit-train", o.limit_train,
                      "train on the first N samples of the training set only (torch's Subset(range(N)))")
      ->check(CLI::Range(std::size_t{1}, std::numeric_limits<std::size_t>::max()));
  dp_cli::add_integer(app, "--limit-test", o.limit_test, "evaluate on the first N samples of the test set only")
      ->check(CLI::Range(std::size_t{1}, std::numeric_limits<std::size_t>::max()));
  dp_cli::add_integer(app, "--batch-size", o.batch_size, "global batch (single, dp) or per device (ddp)");
  auto* epochs = dp_cli::add_integer(app, "--epochs", o.epochs, "full passes over the data (default 1)");
  dp_cli::add_integer(app, "--steps", o.steps, "optimizer steps (crosses epoch boundaries)")->excludes(epochs);
}

void add_optimizer_options(CLI::App& app, Options& o) {
  const CLI::Validator non_negative = non_negative_number();
  app.add_option("--optimizer", o.optimizer, "sgd (torch.optim.SGD) or adamw (torch.optim.AdamW)")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--lr", o.lr, "learning rate (default: sgd 0.01, adamw 1e-3)")->check(non_negative);
  app.add_option("--momentum", o.momentum, "sgd: momentum (dp_train's default 0.9; torch.optim.SGD's is 0)")
      ->check(non_negative);
  app.add_option("--weight-decay", o.weight_decay, "weight decay (default: sgd 0, adamw 1e-2, decoupled as torch's)")
      ->check(non_negative);
  app.add_flag("--nesterov", o.nesterov, "sgd: Nesterov momentum");
  app.add_option("--beta1", o.beta1, "adamw: first-moment decay (default 0.9)")->check(fraction_below_one());
  app.add_option("--beta2", o.beta2, "adamw: second-moment decay (default 0.999)")->check(fraction_below_one());
  app.add_option("--eps", o.eps, "adamw: denominator epsilon (default 1e-8)")->check(non_negative);
  app.add_flag("--scale-lr", o.scale_lr,
               "multiply lr by the world size: every device of every process in ddp (torch's lr *= world_size), the "
               "devices in dp");
  dp_cli::add_integer(app, "--warmup-steps", o.warmup_steps, "linear lr warm-up steps");
  app.add_option("--schedule", o.schedule,
                 "after the warm-up, per step: none, step (StepLR) or cosine (CosineAnnealingLR)")
      ->check(CLI::IsMember({"none", "step", "cosine"}));
  dp_cli::add_integer(app, "--step-size", o.step_size, "step: multiply the lr by --gamma every N steps");
  app.add_option("--gamma", o.gamma, "step: the factor, > 0 (default 0.1)")->check(positive_number());
  dp_cli::add_integer(app, "--t-max", o.t_max, "cosine: steps to anneal over (default: the rest of the run)");
  app.add_option("--eta-min", o.eta_min, "cosine: the lr at the end (default 0)")->check(non_negative);
}

// --eval and --no-eval, read into Options::eval once parsed.
struct EvalFlags {
  bool on = false, off = false;
};

void add_run_options(CLI::App& app, Options& o, EvalFlags& eval_flags) {
  dp_cli::add_integer(app, "--seed", o.seed, "seed of the initialisation, synthetic data and shuffling (0 to 2^64-1)");
  app.add_flag("--no-shuffle", o.no_shuffle, "visit the samples in order (PyTorch's order exactly)");
  auto* init = app.add_option("--init", o.init,
                              "load weights and buffers (safetensors) before training; strict, as torch's "
                              "load_state_dict: every tensor of the model, and only those");
  app.add_flag("--init-non-strict", o.init_non_strict,
               "--init loads what matches and prints the missing and unexpected keys (torch's strict=False); a "
               "shape mismatch stays an error")
      ->needs(init);
  app.add_option("--freeze", o.freeze,
                 "keep the parameters under PREFIX fixed (repeatable; e.g. layer1: layer1.0.weight, ...), as torch's "
                 "requires_grad_(False) for fine-tuning: no update, no optimizer state")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  auto* save = app.add_option("--save", o.save,
                              "write the final state (safetensors) here; also when SIGTERM or SIGINT stops the run "
                              "(after the step in flight; exit code 143 or 130), so that --resume continues it");
  dp_cli::add_integer(app, "--save-every", o.save_every,
                      "also write a checkpoint every N steps, beside --save as NAME.stepS.safetensors")
      ->check(CLI::Range(1L, std::numeric_limits<long>::max()))
      ->needs(save);
  app.add_flag("--save-every-epoch", o.save_every_epoch,
               "also write a checkpoint at the end of every epoch, as --save-every")
      ->needs(save);
  dp_cli::add_integer(app, "--keep", o.keep, "keep only the last K periodic checkpoints (default: every one)")
      ->check(CLI::Range(1L, std::numeric_limits<long>::max()))
      ->needs(save);
  app.add_option("--resume", o.resume, "continue from a checkpoint written by --save");
  dp_cli::add_integer(app, "--log-every", o.log_every, "log every K steps")->check(CLI::Range(1L, 1L << 40));
  app.add_flag("--log-batches", o.log_batches, "print the sample indices of every batch (per rank)");
  auto* eval = app.add_flag("--eval", eval_flags.on,
                            "after every epoch, test loss and accuracy over the whole test set (default: on when "
                            "--data has t10k-* files)");
  app.add_flag("--no-eval", eval_flags.off, "no evaluation")->excludes(eval);
  app.add_flag("--eval-only", o.eval_only, "evaluate the --init checkpoint on the test set, no training");
  app.add_option("--normalize", o.normalize,
                 "MEAN,STD: inputs (pixel/255 - MEAN) / STD, e.g. 0.2860,0.3530; for RGB images one per channel, "
                 "MEANS/STDS, e.g. 0.485,0.456,0.406/0.229,0.224,0.225 (torchvision's Normalize(mean, std))");
  app.add_option("--predictions", o.predictions,
                 "with --eval-only: write each test sample's predicted class here, one per line, in test-set order");
  // Hidden (no group): the failure tests start one process of an mpirun job with it.
  dp_cli::add_integer(app, "--debug-signal-at-step", o.signal_at_step,
                      "testing: process 0 raises SIGTERM before step N")
      ->group("");
  dp_cli::add_integer(app, "--debug-fail-at-step", o.fail_at_step, "testing: fail on this process at step N")
      ->group("");
  app.add_option("--metrics-json", o.metrics_json, "write every logged step and epoch here, one JSON object per line");
}

// The checks CLI11 cannot make, and each optimizer's defaults; false once a refusal is printed.
bool settle_flags(const CLI::App& app, Options& o) {
  // Each optimizer's own flags, and torch's defaults for those not given (torch.optim.AdamW: lr 1e-3,
  // weight_decay 1e-2).
  const bool adamw = o.optimizer == "adamw";
  const std::vector<std::string> other_optimizers_flags = adamw
                                                              ? std::vector<std::string>{"--momentum", "--nesterov"}
                                                              : std::vector<std::string>{"--beta1", "--beta2", "--eps"};
  for (const std::string& flag : other_optimizers_flags) {
    if (app.get_option(flag)->count() > 0) {
      fmt::print(stderr, "dp_train: error: {} does not apply to --optimizer {}\n", flag, o.optimizer);
      return false;
    }
  }
  apply_optimizer_defaults(o);
  // A file flag given an empty value names no file: refused rather than read as "not given".
  for (const char* flag : {"--data", "--train-dir", "--val-dir", "--init", "--save", "--resume", "--metrics-json",
                           "--normalize", "--predictions"}) {
    const auto* option = app.get_option(flag);
    if (option->count() > 0 && option->as<std::string>().empty()) {
      fmt::print(stderr, "dp_train: error: {}: empty value\n", flag);
      return false;
    }
  }
  return true;
}

}  // namespace

Parsed parse_command_line(int argc, const char* const* argv, Options& o) {
  CLI::App app{
      "dp_train: train the reference MLP, ConvNet, ResNet-8 or torchvision's ResNet-18/34 on one device, with "
      "DataParallel or with DDP"};
  // As argparse: the last of a repeated flag wins (`$ARGS --lr 0.1`), and --help shows every default.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  EvalFlags eval_flags;
  add_model_options(app, o);
  add_device_options(app, o);
  add_data_options(app, o);
  add_optimizer_options(app, o);
  add_run_options(app, o, eval_flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? Parsed::help : Parsed::refused;  // prints help, or the message naming the flag
  }
  if (eval_flags.on || eval_flags.off) o.eval = eval_flags.on;
  for (const CLI::Option* option : app.get_options())
    if (option->count() > 0)
      for (const std::string& name : option->get_lnames()) o.given.insert("--" + name);
  return settle_flags(app, o) ? Parsed::run : Parsed::refused;
}

}  // namespace dp_train
