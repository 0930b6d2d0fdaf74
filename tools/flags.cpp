// flags.cpp — the checks of the flags' values, the shared flags' engine settings and device rule,
// and the command line both tools parse: --help from the tables, refusals, did-you-mean.
#include "flags.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fmt/ranges.h>

namespace dp::tools {

std::string integer_refusal(const std::string& text, std::uint64_t least, std::uint64_t most) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
    return fmt::format("'{}' is not a non-negative decimal integer", text);
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value > most)
    return fmt::format("'{}' is out of range (at most {})", text, most);
  if (value < least) return fmt::format("'{}' is out of range (at least {})", text, least);
  return "";
}

std::string number_refusal(const std::string& text, const Range& range) {
  double value = std::nan("");
  try {
    std::size_t used = 0;
    value = std::stod(text, &used);
    if (used != text.size()) value = std::nan("");
  } catch (const std::exception&) {
  }
  // NaN passes every comparison a range makes: refused by name.
  if (!std::isfinite(value) || !range.holds(value))
    return fmt::format("'{}' is not a finite number {}", text, range.text);
  if (std::fabs(value) > std::numeric_limits<float>::max())
    return fmt::format("'{}' overflows a float (at most {:g})", text, std::numeric_limits<float>::max());
  return "";
}

std::string or_list(const std::vector<std::string>& items) {
  std::string text;
  for (std::size_t i = 0; i < items.size(); ++i)
    text += (i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
  return text;
}

std::string choice_refusal(const std::string& text, const std::vector<std::string>& choices) {
  if (std::find(choices.begin(), choices.end(), text) != choices.end()) return "";
  return fmt::format("unknown value '{}' (expected {})", text, or_list(choices));
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    std::string item = text.substr(begin, comma - begin);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty() && std::find(items.begin(), items.end(), item) == items.end()) items.push_back(item);
    begin = comma + 1;
  }
  return items;
}

std::string list_refusal(const std::string& text, const std::vector<std::string>& known) {
  const std::vector<std::string> items = split_list(text);
  if (items.empty()) return fmt::format("empty list (expected a comma list of {})", fmt::join(known, ", "));
  for (const std::string& item : items)
    if (std::find(known.begin(), known.end(), item) == known.end())
      return fmt::format("unknown value '{}' (expected a comma list of {})", item, fmt::join(known, ", "));
  return "";
}

std::string tag_of(const std::string& flag) {
  std::string tag = flag.substr(flag.find_first_not_of('-'));
  std::replace(tag.begin(), tag.end(), '-', '_');
  return tag;
}

int default_devices(bool cuda, int cuda_devices) { return cuda ? cuda_devices : kDefaultSimDevices; }

std::string models_help() {
  std::string text = "models:\n";
  for (const dp::models::ModelSpec& spec : dp::models::all_models())
    text += fmt::format("  {:<10} {}\n", spec.name(), spec.description());
  return text;
}

namespace {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "--Batch_Size" and "batch-size" alike: lower case, '-' for '_', no leading dashes.
std::string plain(const std::string& flag) {
  const std::size_t start = flag.find_first_not_of('-');
  std::string name = start == std::string::npos ? "" : flag.substr(start);
  for (char& c : name) c = c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

CommandLine::CommandLine(std::string tool, std::string description, std::string error_prefix)
    : tool_(std::move(tool)), error_prefix_(std::move(error_prefix)), app_(std::move(description), tool_) {
  // As argparse: the last of a repeated flag wins (`$ARGS --lr 0.1`).
  app_.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

void CommandLine::add_flag(Bound bound) {
  CLI::Option* option = nullptr;
  if (bound.metavar.empty()) {
    option = app_.add_flag_callback(
        bound.name, [store = bound.store] { store("true"); }, bound.help);
  } else if (bound.repeatable) {
    option = app_.add_option_function<std::vector<std::string>>(
        bound.name,
        [store = bound.store](const std::vector<std::string>& values) {
          for (const std::string& v : values) store(v);
        },
        bound.help);
    option->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  } else {
    option = app_.add_option_function<std::string>(bound.name, bound.store, bound.help);
  }
  if (!bound.metavar.empty()) option->check(CLI::Validator(bound.refusal, ""));
  if (bound.hidden) option->group("");
  groups_.back().flags.push_back(std::move(bound));
}

std::set<std::string> CommandLine::given() const {
  std::set<std::string> names;
  for (const CLI::Option* option : app_.get_options())
    if (option->count() > 0)
      for (const std::string& name : option->get_lnames()) names.insert("--" + name);
  return names;
}

std::string CommandLine::describe(const Bound& flag) const {
  // A switch is off unless its default_text says otherwise.
  std::string value = flag.metavar.empty() ? "" : flag.default_value();
  if (value.empty() || value == "0") value = flag.default_text.empty() ? value : flag.default_text;
  std::vector<std::string> notes;
  if (!value.empty()) notes.push_back("default " + value);
  if (!flag.torch.empty()) notes.push_back("torch: " + flag.torch);
  return notes.empty() ? flag.help : fmt::format("{} ({})", flag.help, fmt::join(notes, "; "));
}

std::string CommandLine::help() const {
  std::string text = fmt::format("{}\nusage: {} [--flag VALUE | --flag=VALUE]...\n", app_.get_description(), tool_);
  for (const Group& group : groups_) {
    text += fmt::format("\n{}:\n", group.title);
    for (const Bound& flag : group.flags) {
      if (flag.hidden) continue;
      const std::string left = flag.metavar.empty() ? flag.name : flag.name + " " + flag.metavar;
      text += fmt::format("  {:<30} {}\n", left, describe(flag));
    }
  }
  text += fmt::format("  {:<30} this help\n", "-h, --help");
  if (!footer_.empty()) text += "\n" + footer_;
  return text;
}

// The first argument CLI11 did not take, and the known flag it most likely meant: a torch
// spelling of one, the same name in other case or with '_', a unique prefix, or the nearest name
// within a third of its length.
std::string CommandLine::unknown_flag(int argc, const char* const* argv) const {
  const std::vector<std::string> left = app_.remaining();
  std::string unknown;
  for (int i = 1; i < argc && unknown.empty(); ++i) {
    const std::string arg = argv[i];
    if (std::find(left.begin(), left.end(), arg) != left.end() && arg.starts_with("-")) unknown = arg;
  }
  if (unknown.empty())
    return fmt::format("unexpected argument '{}' (every value follows its flag)", left.empty() ? "" : left.back());
  const std::string key = unknown.substr(0, unknown.find('='));
  const std::string wanted = plain(key);
  std::string best, prefixed;
  std::size_t best_distance = std::max<std::size_t>(2, wanted.size() / 3) + 1;
  int prefixes = 0;
  for (const Group& group : groups_) {
    for (const Bound& flag : group.flags) {
      if (flag.hidden) continue;
      const std::string name = plain(flag.name);
      if (std::find(flag.torch_spellings.begin(), flag.torch_spellings.end(), key) != flag.torch_spellings.end() ||
          name == wanted)
        return fmt::format("unknown flag {} (did you mean {}?)", key, flag.name);
      if (wanted.size() >= 2 && name.starts_with(wanted)) {
        ++prefixes;
        prefixed = flag.name;
      }
      std::vector<std::string> spellings = {name};
      for (const std::string& spelling : flag.torch_spellings) spellings.push_back(plain(spelling));
      for (const std::string& spelling : spellings) {
        if (const std::size_t d = edit_distance(wanted, spelling); d < best_distance) {
          best_distance = d;
          best = flag.name;
        }
      }
    }
  }
  if (prefixes == 1) best = prefixed;
  return best.empty() ? fmt::format("unknown flag {} (see --help)", key)
                      : fmt::format("unknown flag {} (did you mean {}?)", key, best);
}

CommandLine::Parsed CommandLine::parse(int argc, const char* const* argv) {
  try {
    app_.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    if (before_help_) before_help_();
    std::fputs(help().c_str(), stdout);
    return Parsed::help;
  } catch (const CLI::ExtrasError&) {
    fmt::print(stderr, "{}{}\n", error_prefix_, unknown_flag(argc, argv));
    return Parsed::refused;
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "{}{}\n", error_prefix_, e.what());
    return Parsed::refused;
  }
  return Parsed::run;
}

}  // namespace dp::tools
