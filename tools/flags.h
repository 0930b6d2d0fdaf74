// flags.h — dp_train's and dp_bench's flags as tables: each flag's name, value (metavar, parser,
// check), help, default and torch equivalent, bound to a tool's options. The flags both tools take
// are one table (shared_flags) with one meaning, torch's; --help and every refusal of a bad command
// line (exit code 2, nothing written) come from the tables.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <fmt/format.h>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dp/engines/engine.h"
#include "dp/models/registry.h"

namespace dp::tools {

// ---------------------------------------------------------------------------------------------
// Values: how a flag's text is checked, stored into the options and read back as text.

// The values of the shared flags that are one of a few names: parsed into these once, in the flag
// table (named), and compared as enums everywhere else.
enum class BackendChoice { automatic, cuda, sim };
inline std::string_view to_string(BackendChoice b) {
  return b == BackendChoice::cuda ? "cuda" : b == BackendChoice::sim ? "sim" : "auto";
}
enum class OptimizerKind { sgd, adamw };
inline std::string_view to_string(OptimizerKind k) { return k == OptimizerKind::adamw ? "adamw" : "sgd"; }

template <class O>
struct Value {
  std::string metavar;                                     // after the name in --help; empty for a switch
  std::function<std::string(const std::string&)> refusal;  // why a text is no value of the flag; "" if it is one
  std::function<void(O&, const std::string&)> store;       // a text refusal() accepts (a switch: "true")
  std::function<std::string(const O&)> text;               // the value as text, "" while unset
  bool repeatable = false;                                 // each occurrence adds a value (--freeze)
  std::function<std::string(const O&)> shown = {};         // --help's text of a default, when not text's
};

// A range of real numbers, named as messages and --help say it (">= 0", "in [0, 1)").
struct Range {
  const char* text;
  bool (*holds)(double);
};
inline constexpr Range kNonNegative{">= 0", [](double v) { return v >= 0.0; }};
inline constexpr Range kPositive{"> 0", [](double v) { return v > 0.0; }};
inline constexpr Range kUnitInterval{"in [0, 1]", [](double v) { return v >= 0.0 && v <= 1.0; }};
inline constexpr Range kBelowOne{"in [0, 1)", [](double v) { return v >= 0.0 && v < 1.0; }};

std::string integer_refusal(const std::string& text, std::uint64_t least, std::uint64_t most);
std::string number_refusal(const std::string& text, const Range& range);
std::string choice_refusal(const std::string& text, const std::vector<std::string>& choices);
// "a, b or c".
std::string or_list(const std::vector<std::string>& items);

template <class T>
struct integer_of {
  using type = T;
};
template <class T>
struct integer_of<std::optional<T>> {
  using type = T;
};

// One of `choices`, into a string member; the metavar lists them unless given.
template <class O, class C>
Value<O> choice(std::string C::*member, std::vector<std::string> choices, std::string metavar = "") {
  static_assert(std::is_base_of_v<C, O>);
  if (metavar.empty())
    for (const auto& c : choices) metavar += (metavar.empty() ? "" : "|") + c;
  return {metavar, [choices](const std::string& text) { return choice_refusal(text, choices); },
          [member](O& o, const std::string& text) { o.*member = text; }, [member](const O& o) { return o.*member; }};
}

// One of `names`, into an enum member: the text becomes the enum here, at the edge, so the code
// compares enums, never text; the member's text (a checkpoint's settings, --help) is its name.
template <class O, class C, class E>
Value<O> named(E C::*member, std::vector<std::pair<std::string, E>> names) {
  static_assert(std::is_base_of_v<C, O>);
  std::vector<std::string> choices;
  std::string metavar;
  for (const auto& [name, value] : names) {
    choices.push_back(name);
    metavar += (metavar.empty() ? "" : "|") + name;
  }
  return {metavar, [choices](const std::string& text) { return choice_refusal(text, choices); },
          [member, names](O& o, const std::string& text) {
            for (const auto& [name, value] : names)
              if (name == text) o.*member = value;
          },
          [member, names](const O& o) {
            for (const auto& [name, value] : names)
              if (value == o.*member) return name;
            return std::string();
          }};
}

// The same, the names being to_string's of `values`.
template <class O, class C, class E>
Value<O> named(E C::*member, std::initializer_list<E> values) {
  std::vector<std::pair<std::string, E>> names;
  for (const E value : values) names.emplace_back(std::string(to_string(value)), value);
  return named<O>(member, std::move(names));
}

// on | off, into a bool member.
template <class O, class C>
Value<O> on_off(bool C::*member) {
  return named<O>(member, std::vector<std::pair<std::string, bool>>{{"on", true}, {"off", false}});
}

// A decimal integer in [least, most] (most: at most the member type's largest value), into an
// integer or optional integer member. CLI11 alone would read 0x10 as 16, -1 into an unsigned as
// 2^64-1, and cap a value past the type's range.
template <class O, class C, class M>
Value<O> integer(M C::*member, std::uint64_t least = 0, std::uint64_t most = std::numeric_limits<std::uint64_t>::max(),
                 std::string metavar = "N") {
  static_assert(std::is_base_of_v<C, O>);
  using Integer = typename integer_of<M>::type;
  static_assert(std::is_integral_v<Integer> && !std::is_same_v<Integer, bool>);
  most = std::min(most, static_cast<std::uint64_t>(std::numeric_limits<Integer>::max()));
  return {metavar, [least, most](const std::string& text) { return integer_refusal(text, least, most); },
          [member](O& o, const std::string& text) {
            if constexpr (!std::is_same_v<M, Integer>) {
              if (text.empty()) {  // a checkpoint's unset value
                o.*member = std::nullopt;
                return;
              }
            }
            std::uint64_t value = 0;
            std::from_chars(text.data(), text.data() + text.size(), value);
            o.*member = static_cast<Integer>(value);
          },
          [member](const O& o) {
            if constexpr (std::is_same_v<M, Integer>)
              return fmt::format("{}", o.*member);
            else
              return (o.*member) ? fmt::format("{}", *(o.*member)) : std::string();
          }};
}

// A finite number in `range`, into a double or float member; also finite as a float, since the
// engine computes in fp32. Read as CLI11 reads it (strtold, then the member's type); shown in the
// shortest text that reads back exactly.
template <class O, class C, class M>
Value<O> number(M C::*member, Range range, std::string metavar = "X") {
  static_assert(std::is_base_of_v<C, O> && std::is_floating_point_v<M>);
  return {metavar,
          [range](const std::string& text) { return number_refusal(text, range); },
          [member](O& o, const std::string& text) { o.*member = static_cast<M>(std::strtold(text.c_str(), nullptr)); },
          [member](const O& o) { return fmt::format("{}", static_cast<double>(o.*member)); },
          false,
          [member](const O& o) { return fmt::format("{}", o.*member); }};  // a float's 0.9, not 0.8999999761581421
}

// Free text; a file or list flag (`may_be_empty` false) refuses an empty value, which names nothing.
template <class O, class C>
Value<O> text(std::string C::*member, std::string metavar, bool may_be_empty = false) {
  static_assert(std::is_base_of_v<C, O>);
  return {metavar,
          [may_be_empty](const std::string& value) { return value.empty() && !may_be_empty ? "empty value" : ""; },
          [member](O& o, const std::string& value) { o.*member = value; }, [member](const O& o) { return o.*member; }};
}

// "a,b,,c" -> {"a", "b", "c"}: items trimmed, empty ones and repeats dropped (the first kept).
std::vector<std::string> split_list(const std::string& text);
std::string list_refusal(const std::string& text, const std::vector<std::string>& known);

// A comma list of some of `known`, into a string member (split_list reads it).
template <class O, class C>
Value<O> list_of(std::string C::*member, std::vector<std::string> known, std::string metavar) {
  static_assert(std::is_base_of_v<C, O>);
  return {metavar, [known](const std::string& text) { return list_refusal(text, known); },
          [member](O& o, const std::string& text) { o.*member = text; }, [member](const O& o) { return o.*member; }};
}

// Repeatable: each occurrence adds one value.
template <class O, class C>
Value<O> texts(std::vector<std::string> C::*member, std::string metavar) {
  static_assert(std::is_base_of_v<C, O>);
  Value<O> value{metavar, [](const std::string& v) { return v.empty() ? "empty value" : ""; },
                 [member](O& o, const std::string& v) { (o.*member).push_back(v); },
                 [member](const O& o) { return fmt::format("{}", fmt::join(o.*member, ",")); }};
  value.repeatable = true;
  return value;
}

// A switch: given, the member is true.
template <class O, class C>
Value<O> on(bool C::*member) {
  static_assert(std::is_base_of_v<C, O>);
  return {"", [](const std::string&) { return std::string(); },
          [member](O& o, const std::string&) { o.*member = true; },
          [member](const O& o) { return fmt::format("{}", o.*member); }};
}

// ---------------------------------------------------------------------------------------------
// Flags and their tables.

// What dp_train's checkpoints record of a flag ("dp.<name>", the flag's name with '_' for '-'), and
// which later runs take it back when the flag is not given (tools/run_settings.h).
enum class Saved { no, always, optimizer_kind, on_resume };

template <class O>
struct Flag {
  std::string name = {};  // "--batch-size"
  Value<O> value = {};
  std::string help = {};   // what it does, one line
  std::string torch = {};  // torch's equivalent, where it has one
  // --help's default where the value's text is empty (an unset optional) or a 0 that means none.
  std::string default_text = {};
  // torch's example scripts' spellings (ImageNet's main.py: -b, -j, --wd): suggested, not taken.
  std::vector<std::string> torch_spellings = {};
  Saved saved = Saved::no;
  bool structural = false;  // saved: the model's shape, which a checkpoint must match
  // Saved only for a model that takes this argument (--hidden: the MLP's).
  std::optional<dp::models::ModelArg> model_arg = std::nullopt;
  bool hidden = false;  // testing hooks: not in --help
  // An engine setting: what the flag sets in the engine's options (set_engine_options).
  void (*engine)(const O&, dp::EngineOptions&) = nullptr;
  // The one mode ("dp", "ddp") the flag applies to; empty: every mode. dp_train refuses a value
  // other than the default elsewhere; dp_bench, which runs every mode, sets it for that mode only.
  std::string applies_to = {};
  // Other modes it applies to, given the rest of the command line (--sync-bn: dp with --shards).
  bool (*also_applies)(const O&, std::string_view mode) = nullptr;
  // dp_train: recorded in each epoch's metrics ("none" where the flag does not apply), and, with a
  // banner text ("... in {}"), named on its first line where it applies.
  bool per_epoch = false;
  std::string banner = {};
};

template <class O>
struct FlagGroup {
  std::string title;  // --help's heading
  std::vector<Flag<O>> flags;
};

// One --help group of several tables, their flags in order.
template <class O>
FlagGroup<O> joined(std::string title, std::vector<std::vector<Flag<O>>> tables) {
  FlagGroup<O> group{std::move(title), {}};
  for (auto& table : tables)
    for (Flag<O>& flag : table) group.flags.push_back(std::move(flag));
  return group;
}

// The tag a checkpoint records a flag's value under: "--weight-decay" -> "weight_decay".
std::string tag_of(const std::string& flag);

// ---------------------------------------------------------------------------------------------
// The flags dp_train and dp_bench share: one meaning, torch's where torch has one.

// --check-replicas' default: a fingerprint of the parameters and optimizer state every 100 steps,
// one read of them on each device and 8 bytes a part between processes.
inline constexpr int kCheckReplicasEvery = 100;

// What both tools' options hold of the shared flags (seed and steps are each tool's own: their
// defaults differ, as dp_train's steps default to whole epochs).
struct SharedOptions {
  BackendChoice backend = BackendChoice::automatic;
  std::string precision = "strict";
  bool graphs = true;          // --graphs on
  bool pipeline = true;        // --pipeline on
  std::optional<int> devices;  // unset: default_devices()
  int devices_per_gpu = 1;
  OptimizerKind optimizer = OptimizerKind::sgd;
  int batch_size = 64;  // global in single and dp, per device in ddp (torch's DataParallel and DDP)
  bool sync_bn = false;
  dp::Autocast amp = dp::Autocast::off;               // torch.autocast(dtype=bfloat16) around the forward
  dp::GradReduce grad_reduce = dp::GradReduce::fp32;  // ddp: the gradient all-reduce (bf16: bf16_compress_hook)
  int shards = 0;                                     // every mode: a step's result fixed to this many shards; 0: off
  double clip_grad_norm = 0.0;  // every mode: clip_grad_norm_(max_norm) before each update; 0: off
  int zero = 0;                 // ddp: the ZeRO stage (1: optimizer state sharded; 2: gradients too); 0: off
  double bucket_cap_mb = dp::EngineOptions{}.bucket_cap_mb;  // ddp: the gradient buckets' caps, MiB
  double first_bucket_mb = dp::EngineOptions{}.first_bucket_mb;
  bool zero_host_copies = true;  // --zero in one process: each rank's part also kept on the host
  // ddp and shards: the replicas' fingerprints compared every N steps (silent corruption); 0: off.
  int check_replicas = kCheckReplicasEvery;
  // shards: every K steps one shard computed again on another device and compared; 0: off.
  int shadow_shards = 0;
  // The model's shape where it has one: the GPT's (model_shape_flags), and the Dropout of mlp and gpt.
  int context = 64, layers = 4, heads = 4, width = 128;
  int vocab = 256;                  // gpt: token ids [0, vocab) (bytes: 256)
  std::string gelu = "exact";       // gpt: nn.GELU() or GPT-2's tanh form
  std::string attention = "fused";  // gpt: the attention without (T, T) matrices, or the reference
  double dropout = 0.0;
};

// The devices a run takes when --devices is not given, in both tools: every dp device of every
// visible GPU (torch's DataParallel: every visible device), or kDefaultSimDevices on sim.
inline constexpr int kDefaultSimDevices = 2;
inline constexpr int kMaxSimDevices = 64;
// The most shards a step may have (--shards V, times --accumulate K in dp_train): each is a loader
// thread with its pinned batches and an input ring on its device, so a bound keeps a mistyped V
// from starting a million threads; 1024 is a shard for each of 1024 GPUs.
inline constexpr int kMaxShards = 1024;
int default_devices(bool cuda, int cuda_devices);

// Whether `flag` applies to `mode` ("single", "dp", "ddp") with the options `o`.
template <class O>
bool applies(const Flag<O>& flag, std::string_view mode, const O& o) {
  return flag.applies_to.empty() || flag.applies_to == mode || (flag.also_applies && flag.also_applies(o, mode));
}

// The shared flags that place a run: the backend, its devices, their precision and how the steps
// are launched.
template <class O>
std::vector<Flag<O>> placement_flags() {
  return {
      {.name = "--backend",
       .value = named<O>(&O::backend, {BackendChoice::automatic, BackendChoice::cuda, BackendChoice::sim}),
       .help = "auto (cuda when a GPU is visible, else sim), cuda, or sim (simulated devices on the host)"},
      {.name = "--devices",
       .value = integer<O>(&O::devices, 1, 1 << 20),
       .help = "use devices 0..N-1 (single: device 0 alone)",
       .torch = "DataParallel(device_ids=range(N)); torchrun --nproc-per-node=N",
       .default_text = fmt::format("every visible GPU, else {} simulated", kDefaultSimDevices),
       .torch_spellings = {"--nproc-per-node", "--nproc_per_node", "--world-size", "--gpus"}},
      {.name = "--devices-per-gpu",
       .value = integer<O>(&O::devices_per_gpu, 1, 64, "K"),
       .help = "K dp devices on each GPU (device d on GPU d/K), so that multi-device runs fit one; same results"},
      {.name = "--precision",
       .value = choice<O>(&O::precision, {"strict", "fast", "tf32"}),
       .help = "strict: exact fp32, deterministic; fast: cuDNN's fastest, TF32 convolutions; tf32: fast, and TF32 "
               "matmuls",
       .torch = "fast: torch's defaults; tf32: torch.backends.cuda.matmul.allow_tf32 = True"},
      {.name = "--graphs",
       .value = on_off<O>(&O::graphs),
       .help = "on: capture the step once per batch size and replay it (emulated on sim); off: launch every "
               "kernel every step",
       .torch = "torch.cuda.CUDAGraph",
       .engine = [](const O& o, dp::EngineOptions& e) { e.graphs = o.graphs; }},
      {.name = "--pipeline",
       .value = on_off<O>(&O::pipeline),
       .help = "on: submit each step before reading the previous step's loss (the same results); off: wait for "
               "each loss"},
  };
}

// The shared flags of the training step: its batch and length, the engines' settings.
template <class O>
std::vector<Flag<O>> step_flags() {
  return {
      {.name = "--batch-size",
       .value = integer<O>(&O::batch_size, 1, std::numeric_limits<int>::max()),
       .help = "samples per step: the global batch in single and dp, per device in ddp, per shard with --shards",
       .torch = "DataLoader(batch_size=N): global for DataParallel, per process for DDP",
       .torch_spellings = {"-b", "--batch_size"},
       .saved = Saved::on_resume},
      {.name = "--steps",
       .value = integer<O>(&O::steps, 1),
       .help = "optimizer steps in all, from step 0 with --resume too (dp_bench: measured steps per run, after "
               "--warmup)",
       .default_text = "one epoch"},
      {.name = "--sync-bn",
       .value = on<O>(&O::sync_bn),
       .help = "ddp (and dp with --shards): BatchNorm statistics over every rank's batch",
       .torch = "nn.SyncBatchNorm.convert_sync_batchnorm(model)",
       .engine = [](const O& o, dp::EngineOptions& e) { e.sync_batchnorm = o.sync_bn; },
       .applies_to = "ddp",
       .also_applies = [](const O& o, std::string_view mode) { return mode == "dp" && o.shards > 0; }},
      {.name = "--amp",
       .value = named<O>(&O::amp, {{"off", dp::Autocast::off}, {"bf16", dp::Autocast::bf16}}),
       .help = "bf16: Linear and Conv2d on bf16 inputs and weights; fp32 accumulation, loss and master weights",
       .torch = "torch.autocast(device_type, dtype=torch.bfloat16)",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.amp = o.amp; },
       .per_epoch = true},
      {.name = "--grad-reduce",
       .value = named<O>(&O::grad_reduce, {{"fp32", dp::GradReduce::fp32}, {"bf16", dp::GradReduce::bf16}}),
       .help = "ddp: all-reduce the gradients in fp32, or in bf16 (half the bytes)",
       .torch = "ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.grad_reduce = o.grad_reduce; },
       .applies_to = "ddp",
       .per_epoch = true,
       .banner = "gradients all-reduced in {}"},
      {.name = "--shards",
       .value = integer<O>(&O::shards, 0, kMaxShards, "V"),
       .help = "fix each step's result to V shards of --batch-size samples: the same bits on any device count "
               "dividing V, in every mode, and a checkpoint resumes on any of them",
       .torch = "DistributedDataParallel over V ranks (one shard each)",
       .default_text = "0 (off)",
       .saved = Saved::on_resume,
       .structural = true,
       .engine = [](const O& o, dp::EngineOptions& e) { e.shards = o.shards; },
       .per_epoch = true},
      {.name = "--clip-grad-norm",
       .value = number<O>(&O::clip_grad_norm, kNonNegative, "MAX"),
       .help = "scale the gradients so that their total L2 norm is at most MAX, before each optimizer step "
               "(on the device, no host sync)",
       .torch = "torch.nn.utils.clip_grad_norm_(model.parameters(), MAX)",
       .default_text = "0 (off)",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.step.clip_grad_norm = o.clip_grad_norm; },
       .per_epoch = true},
  };
}

// The shared flags of the replicas and their update: what each keeps and checks, the optimizer.
template <class O>
std::vector<Flag<O>> update_flags() {
  return {
      {.name = "--check-replicas",
       .value = integer<O>(&O::check_replicas, 0, 1'000'000'000, "N"),
       .help = "every N steps, compare the replicas' parameters and optimizer state by fingerprints made on "
               "their devices: silent corruption ends the run (exit 8) naming the device and the tensor",
       .torch = "Megatron's check_param_hashes_across_dp_replicas",
       .default_text = "100 (0: off)",
       .engine = [](const O& o, dp::EngineOptions& e) { e.check_replicas = o.check_replicas; },
       .applies_to = "ddp",
       .also_applies = [](const O& o, std::string_view) { return o.shards > 0; }},
      {.name = "--shadow-shards",
       .value = integer<O>(&O::shadow_shards, 0, 1'000'000'000, "K"),
       .help = "with --shards: every K steps one shard (rotating over the devices) is computed again on another "
               "device of its process and compared bit for bit before the update; a device that computes wrong is "
               "named by a third and dropped as lost, else the run ends (exit 8)",
       .default_text = "0 (off)",
       .engine = [](const O& o, dp::EngineOptions& e) { e.shadow_shards = o.shadow_shards; }},
      {.name = "--zero",
       .value = integer<O>(&O::zero, 0, 2, "STAGE"),
       .help = "ddp: 1 shards the optimizer state over the ranks (ZeRO stage 1): the gradients are "
               "reduce-scattered, each rank updates its slice, then the parameters are all-gathered; the same "
               "bits and bytes sent, state memory / ranks. 2: also the gradients (stage 2): backward writes "
               "into a few bucket-sized slots and each rank keeps its slice; where gradients must stay whole "
               "(--grad-reduce bf16, --accumulate, --shards) it is stage 1",
       .torch = "ZeroRedundancyOptimizer(params, optimizer_class=...) (1); DeepSpeed zero_optimization stage 2",
       .default_text = "0 (off)",
       .engine = [](const O& o, dp::EngineOptions& e) { e.zero = o.zero; },
       .applies_to = "ddp"},
      {.name = "--zero-host-copies",
       .value = on_off<O>(&O::zero_host_copies),
       .help = "--zero in one process: on: each rank also copies its part of the state to pinned host memory "
               "after every step, so that a lost device's part survives it (two copies of the parameters and state "
               "on the host; a device-to-host copy of 1/ranks of them per device and step); off: a lost device "
               "ends the run with nothing written",
       .engine = [](const O& o, dp::EngineOptions& e) { e.zero_host_copies = o.zero_host_copies; },
       .applies_to = "ddp"},
      {.name = "--bucket-cap-mb",
       .value = number<O>(&O::bucket_cap_mb, kPositive, "MIB"),
       .help = "ddp: the gradient buckets' cap after the first (each bucket is reduced as soon as backward has "
               "filled it, in reverse parameter order; --zero 2 keeps a few of them)",
       .torch = "DistributedDataParallel(model, bucket_cap_mb=MIB)",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.bucket_cap_mb = o.bucket_cap_mb; },
       .applies_to = "ddp"},
      {.name = "--first-bucket-mb",
       .value = number<O>(&O::first_bucket_mb, kPositive, "MIB"),
       .help = "ddp: the first gradient bucket's cap (the last parameters, whose gradients backward computes first)",
       .torch = "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = MIB * 2**20",
       .saved = Saved::on_resume,
       .engine = [](const O& o, dp::EngineOptions& e) { e.first_bucket_mb = o.first_bucket_mb; },
       .applies_to = "ddp"},
      {.name = "--optimizer",
       .value = named<O>(&O::optimizer, {OptimizerKind::sgd, OptimizerKind::adamw}),
       .help = "the optimizer (dp_bench: lr 0.01 and momentum 0.9, or AdamW's defaults)",
       .torch = "torch.optim.SGD, torch.optim.AdamW",
       .saved = Saved::optimizer_kind},
      // Also Dropout's masks (DDP rank r: seed + r).
      {.name = "--seed",
       .value = integer<O>(&O::seed),
       .help = "seed of the initialisation, the synthetic data and the shuffling",
       .torch = "torch.manual_seed(S)",
       .engine = [](const O& o, dp::EngineOptions& e) { e.step.seed = o.seed; }},
  };
}

// The model's shape, dp_train's and dp_bench's alike: the GPT's sizes, its GELU, and the Dropout
// of mlp and gpt. A checkpoint records them all (and refuses another GPT shape on resume).
template <class O>
std::vector<Flag<O>> model_shape_flags() {
  using dp::models::ModelArg;
  return {
      {.name = "--context",
       .value = integer<O>(&O::context, 1, 1 << 16, "T"),
       .help = "gpt: tokens per sample (block_size; wpe's rows)",
       .torch = "GPTConfig(block_size=T)",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--layers",
       .value = integer<O>(&O::layers, 1, 1 << 10, "L"),
       .help = "gpt: transformer blocks",
       .torch = "GPTConfig(n_layer=L)",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--heads",
       .value = integer<O>(&O::heads, 1, 1 << 10, "H"),
       .help = "gpt: attention heads per block (dividing --width)",
       .torch = "GPTConfig(n_head=H)",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--width",
       .value = integer<O>(&O::width, 1, 1 << 16, "C"),
       .help = "gpt: features per token",
       .torch = "GPTConfig(n_embd=C)",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--vocab",
       .value = integer<O>(&O::vocab, 1, 1 << 24, "V"),
       .help = "gpt: token ids 0..V-1 (--text: bytes, 256; GPT-2: 50257); wte's rows padded to a multiple of 128 "
               "as llm.c pads them, the padding without logits",
       .torch = "GPTConfig(vocab_size=V)",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--gelu",
       .value = choice<O>(&O::gelu, {"exact", "tanh"}, "FORM"),
       .help = "gpt: the MLP's GELU, exact (nanoGPT's nn.GELU()) or tanh (GPT-2's and llm.c's approximation)",
       .torch = "nn.GELU(approximate='none' | 'tanh')",
       .saved = Saved::always,
       .structural = true,
       .model_arg = ModelArg::gpt},
      {.name = "--attention",
       .value = choice<O>(&O::attention, {"fused", "unfused"}, "FORM"),
       .help = "gpt: fused (an online softmax over key tiles, no (T, T) matrix in memory; heads of up to 128 "
               "features) or unfused (the score and value GEMMs and the softmax apart: the reference)",
       .torch = "F.scaled_dot_product_attention(is_causal=True) | the explicit softmax(q k^T) v",
       .model_arg = ModelArg::gpt},
      {.name = "--dropout",
       .value = number<O>(&O::dropout, kUnitInterval, "P"),
       .help = "mlp: Dropout(P) after each hidden ReLU; gpt: nanoGPT's dropout (0: none); its masks are read from "
               "device memory, so steps with it replay from graphs",
       .torch = "nn.Dropout(p=P)",
       .saved = Saved::always},
  };
}

// The model arguments of the shape flags: the GPT's configuration (its table padded as llm.c's) and
// the Dropout.
inline dp::models::ModelArgs shape_model_args(const SharedOptions& o) {
  dp::models::ModelArgs args;
  args.dropout = o.dropout;
  args.gpt = {o.vocab, o.context, o.layers, o.heads, o.width};
  args.gpt.vocab_rows = dp::models::llmc_padded_vocab(o.vocab);
  args.gpt.tanh_gelu = o.gelu == "tanh";
  args.gpt.fused_attention = o.attention == "fused";
  return args;
}

template <class O>
FlagGroup<O> shared_flags() {
  static_assert(std::is_base_of_v<SharedOptions, O>);
  return joined<O>("run (dp_train and dp_bench alike)", {placement_flags<O>(), step_flags<O>(), update_flags<O>()});
}

// The engine settings of the flags of `groups` (a tool's whole table) that apply to options.kind:
// the one route from a flag to dp::EngineOptions.
template <class O>
void set_engine_options(const O& o, dp::EngineOptions& options, const std::vector<FlagGroup<O>>& groups) {
  for (const FlagGroup<O>& group : groups)
    for (const Flag<O>& flag : group.flags)
      if (flag.engine && applies(flag, dp::to_string(options.kind), o)) flag.engine(o, options);
}

// The first shared flag the command line sets (a value other than its default) that applies to
// none of `modes`, or null.
template <class O>
const Flag<O>* first_misapplied(const O& o, const std::vector<std::string>& modes) {
  static const FlagGroup<O> shared = shared_flags<O>();
  for (const Flag<O>& flag : shared.flags)
    if (flag.value.text(o) != flag.value.text(O{}) &&
        std::none_of(modes.begin(), modes.end(), [&](const std::string& mode) { return applies(flag, mode, o); }))
      return &flag;
  return nullptr;
}

// dp_train: why the command line sets a flag for a mode it does not apply to ("--sync-bn applies
// to --mode ddp"), or "".
template <class O>
std::string misapplied_flag(const O& o, std::string_view mode) {
  const Flag<O>* flag = first_misapplied(o, {std::string(mode)});
  return flag ? fmt::format("{} applies to --mode {}", flag->name, flag->applies_to) : "";
}

// dp_bench: why the command line sets a flag for none of the modes it runs ("--zero applies to
// --mode ddp, which --modes single,dp leaves out"), or "".
template <class O>
std::string misapplied_flag(const O& o, const std::vector<std::string>& modes) {
  const Flag<O>* flag = first_misapplied(o, modes);
  return flag ? fmt::format("{} applies to --mode {}, which --modes {} leaves out", flag->name, flag->applies_to,
                            fmt::join(modes, ","))
              : "";
}

// dp_train's per-epoch record of the shared flags (Flag::per_epoch), by tag; "none" where one does
// not apply to `mode`.
template <class O>
std::vector<std::pair<std::string, std::string>> per_epoch_settings(const O& o, std::string_view mode) {
  std::vector<std::pair<std::string, std::string>> fields;
  for (const Flag<O>& flag : shared_flags<O>().flags)
    if (flag.per_epoch) fields.emplace_back(tag_of(flag.name), applies(flag, mode, o) ? flag.value.text(o) : "none");
  return fields;
}

// The banner texts of the shared flags that apply to `mode`, each after ", ".
template <class O>
std::string banner_settings(const O& o, std::string_view mode) {
  std::string text;
  for (const Flag<O>& flag : shared_flags<O>().flags)
    if (!flag.banner.empty() && applies(flag, mode, o))
      text += ", " + fmt::format(fmt::runtime(flag.banner), flag.value.text(o));
  return text;
}

// Each shared flag's value as text, for the processes of an mpirun job to agree on (not --devices:
// each process names its own).
template <class O>
std::vector<std::pair<std::string, std::string>> shared_configuration(const O& o) {
  std::vector<std::pair<std::string, std::string>> fields;
  for (const Flag<O>& flag : shared_flags<O>().flags)
    if (flag.name != "--devices") fields.emplace_back(flag.name, flag.value.text(o));
  return fields;
}

// ---------------------------------------------------------------------------------------------
// The command line: a tool's tables bound to its options, parsed with CLI11.

class CommandLine {
 public:
  enum class Parsed { run, help, refused };

  // `tool`: "dp_train"; `error_prefix`: what starts a refusal on stderr ("dp_train: error: ").
  CommandLine(std::string tool, std::string description, std::string error_prefix);

  // Binds every flag of `groups` to `options`; --help shows each one's default as `defaults` holds it.
  template <class O>
  void add(const std::vector<FlagGroup<O>>& groups, O& options, const O& defaults) {
    for (const FlagGroup<O>& group : groups) {
      groups_.push_back({group.title, {}});
      for (const Flag<O>& flag : group.flags) {
        const Value<O>& v = flag.value;
        add_flag(Bound{flag.name, v.metavar, flag.help, flag.torch, flag.default_text, flag.torch_spellings, v.refusal,
                       [store = v.store, &options](const std::string& text) { store(options, text); },
                       [text = v.shown ? v.shown : v.text, &defaults] { return text(defaults); }, v.repeatable,
                       flag.hidden});
      }
    }
  }
  // Called before --help is printed, after every other flag was read: to set the defaults that
  // depend on them (dp_train's --lr is the chosen optimizer's).
  void before_help(std::function<void()> prepare) { before_help_ = std::move(prepare); }
  // Printed after the flags in --help.
  void footer(std::string text) { footer_ = std::move(text); }

  CLI::Option* option(const std::string& name) { return app_.get_option(name); }
  // Reads argv, or prints --help or the refusal.
  Parsed parse(int argc, const char* const* argv);
  // The flags given ("--lr", ...).
  std::set<std::string> given() const;
  std::string help() const;

 private:
  struct Bound {
    std::string name, metavar, help, torch, default_text;
    std::vector<std::string> torch_spellings;
    std::function<std::string(const std::string&)> refusal;
    std::function<void(const std::string&)> store;
    std::function<std::string()> default_value;
    bool repeatable = false, hidden = false;
  };
  struct Group {
    std::string title;
    std::vector<Bound> flags;
  };
  void add_flag(Bound bound);
  std::string unknown_flag(int argc, const char* const* argv) const;
  std::string describe(const Bound& flag) const;

  std::string tool_, error_prefix_, footer_;
  CLI::App app_;
  std::vector<Group> groups_;
  std::function<void()> before_help_;
};

// --help's list of the registry's models, one line each.
std::string models_help();

}  // namespace dp::tools
