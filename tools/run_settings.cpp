// run_settings.cpp — a checkpoint's description of its run, written by --save and taken back by
// --resume, --init and --eval-only.
#include "run_settings.h"

#include <charconv>
#include <fmt/format.h>
#include <optional>
#include <string>
#include <vector>

namespace dp_train {
namespace {

std::string text(double v) { return fmt::format("{}", v); }  // shortest form that reads back exactly

// One setting: its flag, its tag, and how to read, compare and take a tag's value.
struct Setting {
  const char* flag;
  const char* tag;
  enum Scope { always, optimizer_kind, resume_only } scope;
  bool structural;  // the model's shape: a contradiction is an error
  std::string (*current)(const Options&);
  void (*take)(Options&, const std::string&);
};

double number(const std::string& tag, const std::string& value) {
  double v = 0.0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || error != std::errc() || end != value.data() + value.size())
    throw UsageError(fmt::format("metadata 'dp.{}' = '{}' is not a number", tag, value));
  return v;
}
long integer(const std::string& tag, const std::string& value) {
  long v = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || error != std::errc() || end != value.data() + value.size() || v < 0)
    throw UsageError(fmt::format("metadata 'dp.{}' = '{}' is not a count", tag, value));
  return v;
}
bool boolean(const std::string& tag, const std::string& value) {
  if (value != "true" && value != "false")
    throw UsageError(fmt::format("metadata 'dp.{}' = '{}' is not true or false", tag, value));
  return value == "true";
}

const std::vector<Setting>& settings() {
  using S = Setting;
  static const std::vector<Setting> all = {
      {"--model", "model", S::always, true, [](const Options& o) { return o.model; },
       [](Options& o, const std::string& v) {
         if (v != "mlp" && v != "convnet" && v != "resnet8" && v != "resnet18" && v != "resnet34")
           throw UsageError(fmt::format("metadata 'dp.model' = '{}' is not a model dp_train knows", v));
         o.model = v;
       }},
      {"--hidden", "hidden", S::always, true, [](const Options& o) { return o.model == "mlp" ? o.hidden : ""; },
       [](Options& o, const std::string& v) {
         if (!v.empty()) o.hidden = v;
       }},
      {"--num-classes", "num_classes", S::always, true,
       [](const Options& o) { return o.num_classes ? fmt::format("{}", *o.num_classes) : std::string(); },
       [](Options& o, const std::string& v) {
         if (!v.empty()) o.num_classes = static_cast<int>(integer("num_classes", v));
       }},
      {"--image-size", "image_size", S::always, false,
       [](const Options& o) { return o.model == "resnet18" || o.model == "resnet34" ? text(o.image_size) : ""; },
       [](Options& o, const std::string& v) {
         if (!v.empty()) o.image_size = static_cast<int>(integer("image_size", v));
       }},
      {"--resize", "resize", S::always, false,
       [](const Options& o) { return o.resize ? fmt::format("{}", *o.resize) : std::string(); },
       [](Options& o, const std::string& v) {
         if (!v.empty()) o.resize = static_cast<int>(integer("resize", v));
       }},
      {"--normalize", "normalize", S::always, false, [](const Options& o) { return o.normalize; },
       [](Options& o, const std::string& v) { o.normalize = v; }},
      {"--dropout", "dropout", S::always, false, [](const Options& o) { return text(o.dropout); },
       [](Options& o, const std::string& v) { o.dropout = number("dropout", v); }},
      {"--label-smoothing", "label_smoothing", S::always, false,
       [](const Options& o) { return text(o.label_smoothing); },
       [](Options& o, const std::string& v) { o.label_smoothing = number("label_smoothing", v); }},
      {"--amp", "amp", S::resume_only, false, [](const Options& o) { return o.amp; },
       [](Options& o, const std::string& v) {
         if (v != "off" && v != "bf16") throw UsageError(fmt::format("metadata 'dp.amp' = '{}' is not off or bf16", v));
         o.amp = v;
       }},
      {"--grad-reduce", "grad_reduce", S::resume_only, false, [](const Options& o) { return o.grad_reduce; },
       [](Options& o, const std::string& v) {
         if (v != "fp32" && v != "bf16")
           throw UsageError(fmt::format("metadata 'dp.grad_reduce' = '{}' is not fp32 or bf16", v));
         o.grad_reduce = v;
       }},
      {"--optimizer", "optimizer", S::optimizer_kind, false, [](const Options& o) { return o.optimizer; },
       [](Options& o, const std::string& v) {
         if (v != "sgd" && v != "adamw")
           throw UsageError(fmt::format("metadata 'dp.optimizer' = '{}' is not sgd or adamw", v));
         o.optimizer = v;
       }},
      {"--lr", "lr", S::resume_only, false, [](const Options& o) { return text(o.lr); },
       [](Options& o, const std::string& v) { o.lr = number("lr", v); }},
      {"--momentum", "momentum", S::resume_only, false, [](const Options& o) { return text(o.momentum); },
       [](Options& o, const std::string& v) { o.momentum = static_cast<float>(number("momentum", v)); }},
      {"--weight-decay", "weight_decay", S::resume_only, false, [](const Options& o) { return text(o.weight_decay); },
       [](Options& o, const std::string& v) { o.weight_decay = number("weight_decay", v); }},
      {"--nesterov", "nesterov", S::resume_only, false, [](const Options& o) { return fmt::format("{}", o.nesterov); },
       [](Options& o, const std::string& v) { o.nesterov = boolean("nesterov", v); }},
      {"--beta1", "beta1", S::resume_only, false, [](const Options& o) { return text(o.beta1); },
       [](Options& o, const std::string& v) { o.beta1 = number("beta1", v); }},
      {"--beta2", "beta2", S::resume_only, false, [](const Options& o) { return text(o.beta2); },
       [](Options& o, const std::string& v) { o.beta2 = number("beta2", v); }},
      {"--eps", "eps", S::resume_only, false, [](const Options& o) { return text(o.eps); },
       [](Options& o, const std::string& v) { o.eps = number("eps", v); }},
      {"--scale-lr", "scale_lr", S::resume_only, false, [](const Options& o) { return fmt::format("{}", o.scale_lr); },
       [](Options& o, const std::string& v) { o.scale_lr = boolean("scale_lr", v); }},
      {"--schedule", "schedule", S::resume_only, false, [](const Options& o) { return o.schedule; },
       [](Options& o, const std::string& v) {
         if (v != "none" && v != "step" && v != "cosine")
           throw UsageError(fmt::format("metadata 'dp.schedule' = '{}' is not none, step or cosine", v));
         o.schedule = v;
       }},
      {"--warmup-steps", "warmup_steps", S::resume_only, false,
       [](const Options& o) { return fmt::format("{}", o.warmup_steps); },
       [](Options& o, const std::string& v) { o.warmup_steps = integer("warmup_steps", v); }},
      {"--step-size", "step_size", S::resume_only, false,
       [](const Options& o) { return fmt::format("{}", o.step_size); },
       [](Options& o, const std::string& v) { o.step_size = integer("step_size", v); }},
      {"--gamma", "gamma", S::resume_only, false, [](const Options& o) { return text(o.gamma); },
       [](Options& o, const std::string& v) { o.gamma = number("gamma", v); }},
      {"--eta-min", "eta_min", S::resume_only, false, [](const Options& o) { return text(o.eta_min); },
       [](Options& o, const std::string& v) { o.eta_min = number("eta_min", v); }},
      {"--t-max", "t_max", S::resume_only, false,
       [](const Options& o) { return o.t_max ? fmt::format("{}", *o.t_max) : std::string(); },
       [](Options& o, const std::string& v) { o.t_max = integer("t_max", v); }},
  };
  return all;
}

}  // namespace

std::map<std::string, std::string> run_settings(const Options& o, long t_max) {
  Options resolved = o;
  resolved.t_max = o.schedule == "cosine" ? std::optional<long>(t_max) : std::nullopt;  // T_max is cosine's alone
  std::map<std::string, std::string> tags;
  for (const Setting& s : settings())
    if (s.scope != Setting::optimizer_kind) tags[s.tag] = s.current(resolved);  // the training state's own key
  return tags;
}

void apply_optimizer_defaults(Options& o) {
  const bool adamw = o.optimizer == "adamw";
  if (!o.given.count("--lr")) o.lr = adamw ? 1e-3 : 0.01;
  if (!o.given.count("--weight-decay")) o.weight_decay = adamw ? 1e-2 : 0.0;
}

void adopt_run_settings(Options& o, const std::string& path, const std::map<std::string, std::string>& tags,
                        bool resuming) {
  std::vector<std::string> taken;
  bool kind_taken = false;
  for (const Setting& s : settings()) {
    if (s.scope == Setting::resume_only && !resuming) continue;
    if (s.scope == Setting::optimizer_kind && o.eval_only) continue;
    const auto tag = tags.find(s.tag);
    if (tag == tags.end()) continue;  // a checkpoint from before the tag existed
    if (s.tag == std::string("hidden") && tags.count("model") && tags.at("model") != "mlp") continue;
    const std::string now = s.current(o);
    if (o.given.count(s.flag)) {
      if (now == tag->second) continue;
      const bool refused =
          (s.structural && !(o.init_non_strict && !resuming)) || (s.scope == Setting::optimizer_kind && resuming);
      if (refused)
        throw UsageError(fmt::format("{} {}: the checkpoint {} was saved with {} {}{}", s.flag, now, path, s.flag,
                                     tag->second,
                                     s.structural ? " (leave the flag out to take the checkpoint's)" : ""));
      say("note: the checkpoint {} was saved with {} {}; continuing with {}\n", path, s.flag,
          tag->second.empty() ? "(none)" : tag->second, now.empty() ? "(none)" : now);
      continue;
    }
    if (now == tag->second) continue;
    s.take(o, tag->second);
    if (s.scope == Setting::optimizer_kind) kind_taken = true;
    taken.push_back(fmt::format("{} {}", s.flag, tag->second.empty() ? "(none)" : tag->second));
  }
  // A kind taken from the checkpoint brings its defaults, unless the checkpoint's own values came too.
  if (kind_taken && !resuming) apply_optimizer_defaults(o);
  if (!taken.empty()) {
    std::string list;
    for (const auto& t : taken) list += (list.empty() ? "" : ", ") + t;
    say("dp_train: from the checkpoint {}: {}\n", path, list);
  }
}

}  // namespace dp_train
