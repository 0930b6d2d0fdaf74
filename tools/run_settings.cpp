// run_settings.cpp — a checkpoint's description of its run, written by --save and taken back by
// --resume, --init and --eval-only.
#include "run_settings.h"

#include <fmt/format.h>
#include <optional>
#include <string>
#include <vector>

#include "train_cli.h"

namespace dp_train {
namespace {

using dp::tools::Flag;
using dp::tools::Saved;

// The flags a checkpoint records, in the order train_flags() lists them.
std::vector<const Flag<Options>*> saved_flags() {
  std::vector<const Flag<Options>*> flags;
  for (const auto& group : train_flags())
    for (const Flag<Options>& flag : group.flags)
      if (flag.saved != Saved::no) flags.push_back(&flag);
  return flags;
}

bool takes(const std::string& model, dp::models::ModelArg arg) {
  const dp::models::ModelSpec* spec = dp::models::find_model(model);
  return spec && spec->takes(arg);
}

// The flag's value as a checkpoint records it: empty for an argument the model does not take.
std::string current(const Flag<Options>& flag, const Options& o) {
  if (flag.model_arg && !takes(o.model, *flag.model_arg)) return "";
  return flag.value.text(o);
}

// Takes a checkpoint's value as the flag's own text; empty, it leaves a flag whose default is
// empty (an optional, --normalize) unset.
void take(const Flag<Options>& flag, Options& o, const std::string& value) {
  static const Options defaults;
  const bool may_be_unset = flag.value.text(defaults).empty();
  if (const std::string why = flag.value.refusal(value); !why.empty() && !(value.empty() && may_be_unset))
    throw UsageError(fmt::format("metadata 'dp.{}' = '{}': {}", dp::tools::tag_of(flag.name), value, why));
  flag.value.store(o, value);
}

}  // namespace

std::map<std::string, std::string> run_settings(const Options& o, long t_max) {
  Options resolved = o;
  resolved.t_max =
      o.schedule == Schedule::cosine ? std::optional<long>(t_max) : std::nullopt;  // T_max is cosine's alone
  std::map<std::string, std::string> tags;
  for (const Flag<Options>* flag : saved_flags())
    if (flag->saved != Saved::optimizer_kind) tags[dp::tools::tag_of(flag->name)] = current(*flag, resolved);
  return tags;  // the optimizer's kind is the training state's own key
}

void adopt_run_settings(Options& o, const std::string& path, const std::map<std::string, std::string>& tags,
                        bool resuming) {
  std::vector<std::string> taken;
  bool kind_taken = false;
  for (const Flag<Options>* flag : saved_flags()) {
    if (flag->saved == Saved::on_resume && !resuming) continue;
    if (flag->saved == Saved::optimizer_kind && o.eval_only) continue;
    const auto tag = tags.find(dp::tools::tag_of(flag->name));
    if (tag == tags.end()) continue;  // a checkpoint from before the tag existed
    if (flag->model_arg && tags.count("model") && !takes(tags.at("model"), *flag->model_arg)) continue;
    const std::string now = current(*flag, o);
    const std::string& name = flag->name;
    if (o.given.count(name)) {
      if (now == tag->second) continue;
      const bool refused =
          (flag->structural && !(o.init_non_strict && !resuming)) || (flag->saved == Saved::optimizer_kind && resuming);
      if (refused)
        throw UsageError(fmt::format("{} {}: the checkpoint {} was saved with {} {}{}", name, now, path, name,
                                     tag->second,
                                     flag->structural ? " (leave the flag out to take the checkpoint's)" : ""));
      say("note: the checkpoint {} was saved with {} {}; continuing with {}\n", path, name,
          tag->second.empty() ? "(none)" : tag->second, now.empty() ? "(none)" : now);
      continue;
    }
    if (now == tag->second) continue;
    take(*flag, o, tag->second);
    if (flag->saved == Saved::optimizer_kind) kind_taken = true;
    taken.push_back(fmt::format("{} {}", name, tag->second.empty() ? "(none)" : tag->second));
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
