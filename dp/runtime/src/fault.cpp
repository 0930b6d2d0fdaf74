// fault.cpp — DP_FAULT's grammar, its plan and the step faults' actions.
#include "dp/runtime/fault.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fmt/format.h>
#include <mutex>
#include <set>
#include <thread>
#include <unistd.h>
#include <utility>

#include "dp/runtime/device.h"
#include "dp/runtime/error.h"

namespace dp {
namespace {

// What a kind's ARG is: none, seconds, a phase of the step, or a pass (forward or backward); the
// last two optional, backward by default.
enum class Arg { none, seconds, phase, pass };
struct KindInfo {
  FaultKind kind;
  std::string_view name;
  Arg arg;
};
// The one list of kinds: their spellings and what ARG is to them.
constexpr std::array kFaultKinds{
    KindInfo{FaultKind::desync_extra, "desync-extra", Arg::none},
    KindInfo{FaultKind::desync_skip, "desync-skip", Arg::none},
    KindInfo{FaultKind::desync_count, "desync-count", Arg::none},
    KindInfo{FaultKind::hang, "hang", Arg::none},
    KindInfo{FaultKind::stall, "stall", Arg::seconds},
    KindInfo{FaultKind::exit, "exit", Arg::none},
    KindInfo{FaultKind::throw_error, "throw", Arg::none},
    KindInfo{FaultKind::lose, "lose", Arg::phase},
    KindInfo{FaultKind::flip_param, "flip-param", Arg::none},
    KindInfo{FaultKind::flip_gemm, "flip-gemm", Arg::pass},
};
constexpr std::array<std::pair<FaultPhase, std::string_view>, 4> kFaultPhases{{
    {FaultPhase::forward, "forward"},
    {FaultPhase::backward, "backward"},
    {FaultPhase::collective, "collective"},
    {FaultPhase::optimizer, "optimizer"},
}};

const KindInfo& info(FaultKind kind) {
  for (const KindInfo& k : kFaultKinds)
    if (k.kind == kind) return k;
  throw Error("unknown fault kind");
}

std::string kind_list() {
  std::string out;
  for (const KindInfo& k : kFaultKinds) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

// A whole non-negative decimal integer (no sign, no spaces), at most 18 digits.
std::optional<std::int64_t> whole_number(std::string_view text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  std::int64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

Fault parse_one(std::string_view item) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(
        fmt::format("DP_FAULT item '{}': {}. The grammar is KIND@TARGET:STEP[:ARG][,...] with KIND one of {}, TARGET "
                    "dN (global device N) or pN (process N), STEP the 1-based optimizer step",
                    item, why, kind_list()));
  };
  const std::size_t at = item.find('@');
  if (at == std::string_view::npos) throw bad("no '@' between the kind and the target");
  const std::string_view kind_text = item.substr(0, at);
  Fault fault;
  const KindInfo* kind = nullptr;
  for (const KindInfo& k : kFaultKinds)
    if (k.name == kind_text) kind = &k;
  if (!kind) throw bad(fmt::format("unknown kind '{}'", kind_text));
  fault.kind = kind->kind;
  std::string_view rest = item.substr(at + 1);
  std::vector<std::string_view> fields;
  for (std::size_t colon; (colon = rest.find(':')) != std::string_view::npos; rest.remove_prefix(colon + 1))
    fields.push_back(rest.substr(0, colon));
  fields.push_back(rest);
  if (fields.size() < 2) throw bad("no ':STEP' after the target");
  if (fields.size() > 3) throw bad("more than TARGET:STEP:ARG");
  const std::string_view target = fields[0];
  if (target.size() < 2 || (target[0] != 'd' && target[0] != 'p'))
    throw bad(fmt::format("target '{}' is neither dN nor pN", target));
  const auto index = whole_number(target.substr(1));
  if (!index || *index > 1'000'000) throw bad(fmt::format("target '{}' has no valid index", target));
  fault.process_target = target[0] == 'p';
  fault.target = static_cast<int>(*index);
  const auto step = whole_number(fields[1]);
  if (!step || *step < 1) throw bad(fmt::format("step '{}' is not a whole number >= 1", fields[1]));
  fault.step = *step;
  if (kind->arg == Arg::phase || kind->arg == Arg::pass) {
    if (fields.size() == 3) {
      const std::size_t phases = kind->arg == Arg::pass ? 2 : kFaultPhases.size();  // forward, backward first
      const auto end = kFaultPhases.begin() + static_cast<std::ptrdiff_t>(phases);
      const auto it = std::find_if(kFaultPhases.begin(), end, [&](const auto& p) { return p.second == fields[2]; });
      if (it == end)
        throw bad(
            fmt::format("{} '{}' is none of {}", kind->arg == Arg::pass ? "pass" : "phase", fields[2],
                        kind->arg == Arg::pass ? "forward, backward" : "forward, backward, collective, optimizer"));
      fault.phase = it->first;
    }
  } else if (kind->arg == Arg::seconds) {
    if (fields.size() < 3) throw bad(fmt::format("{} needs ':ARG' (seconds)", kind->name));
    const std::string arg(fields[2]);
    char* end = nullptr;
    fault.arg = std::strtod(arg.c_str(), &end);
    if (arg.empty() || end != arg.c_str() + arg.size() || !std::isfinite(fault.arg) || fault.arg < 0.0 ||
        fault.arg > 86400.0)
      throw bad(fmt::format("ARG '{}' is not a number of seconds in [0, 86400]", arg));
  } else if (fields.size() == 3) {
    throw bad(fmt::format("{} takes no ARG", kind->name));
  }
  return fault;
}

}  // namespace

std::string_view fault_kind_name(FaultKind kind) { return info(kind).name; }

std::string_view fault_phase_name(FaultPhase phase) {
  for (const auto& [p, name] : kFaultPhases)
    if (p == phase) return name;
  return "?";
}

std::string Fault::text() const {
  std::string out = fmt::format("{}@{}{}:{}", fault_kind_name(kind), process_target ? 'p' : 'd', target, step);
  if (info(kind).arg == Arg::seconds) out += fmt::format(":{}", arg);
  if (info(kind).arg == Arg::phase || info(kind).arg == Arg::pass) out += fmt::format(":{}", fault_phase_name(phase));
  return out;
}

std::vector<Fault> parse_faults(std::string_view text) {
  std::vector<Fault> faults;
  if (text.empty()) return faults;
  for (std::size_t begin = 0;;) {
    const std::size_t comma = text.find(',', begin);
    faults.push_back(parse_one(text.substr(begin, comma == std::string_view::npos ? comma : comma - begin)));
    if (comma == std::string_view::npos) break;
    begin = comma + 1;
  }
  return faults;
}

struct FaultPlan::State {
  std::mutex mutex;
  std::set<std::pair<std::size_t, int>> fired;  // (fault, device; -1: the process)
};

FaultPlan::FaultPlan(std::vector<Fault> faults) : faults_(std::move(faults)), state_(std::make_shared<State>()) {}

FaultPlan& FaultPlan::from_environment() {
  // Parsed once; a malformed value is thrown by every call (the first may be caught by a library user).
  static const std::pair<std::shared_ptr<FaultPlan>, std::string> parsed = [] {
    const char* text = std::getenv("DP_FAULT");
    try {
      return std::pair{std::make_shared<FaultPlan>(parse_faults(text ? text : "")), std::string()};
    } catch (const InvalidArgument& e) {
      return std::pair{std::shared_ptr<FaultPlan>(), std::string(e.what())};
    }
  }();
  if (!parsed.first) throw InvalidArgument(parsed.second);
  return *parsed.first;
}

void FaultPlan::check_targets(int processes, int devices_per_process) const {
  for (const Fault& f : faults_) {
    const int limit = f.process_target ? processes : processes * devices_per_process;
    if (f.target >= limit)
      throw InvalidArgument(fmt::format("DP_FAULT item '{}': the job has {} {} ({}0..{}{})", f.text(), limit,
                                        f.process_target ? "processes" : "devices", f.process_target ? 'p' : 'd',
                                        f.process_target ? 'p' : 'd', limit - 1));
  }
}

bool FaultPlan::has(FaultKind kind) const {
  for (const Fault& f : faults_)
    if (f.kind == kind) return true;
  return false;
}

std::optional<Fault> FaultPlan::take(FaultKind kind, int process, int device, std::int64_t step,
                                     std::optional<FaultPhase> phase) {
  for (std::size_t i = 0; i < faults_.size(); ++i) {
    const Fault& f = faults_[i];
    if (f.kind != kind || f.step != step || f.target != (f.process_target ? process : device)) continue;
    if (phase && f.phase != *phase) continue;
    std::lock_guard lock(state_->mutex);
    if (state_->fired.insert({i, device}).second) return f;
  }
  return std::nullopt;
}

std::optional<Fault> FaultPlan::due(FaultKind kind, int process, int device, std::int64_t step,
                                    std::optional<FaultPhase> phase) const {
  for (const Fault& f : faults_)
    if (f.kind == kind && f.step == step && f.target == (f.process_target ? process : device) &&
        (!phase || f.phase == *phase))
      return f;
  return std::nullopt;
}

void fire_step_faults(FaultPlan& plan, int process, int device, std::int64_t step) {
  if (plan.empty()) return;
  if (auto f = plan.take(FaultKind::exit, process, device, step)) {
    std::fflush(nullptr);
    ::kill(::getpid(), SIGKILL);
  }
  if (auto f = plan.take(FaultKind::throw_error, process, device, step))
    throw Error(fmt::format("DP_FAULT {}: device {} fails at step {}", f->text(), device, step));
  if (auto f = plan.take(FaultKind::stall, process, device, step))
    std::this_thread::sleep_for(std::chrono::duration<double>(f->arg));
  if (auto f = plan.take(FaultKind::hang, process, device, step))
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

void fire_lose_faults(FaultPlan& plan, int process, int device, std::int64_t step, std::optional<FaultPhase> phase,
                      Device& target) {
  if (plan.empty()) return;
  const auto f = plan.take(FaultKind::lose, process, device, step, phase);
  if (!f) return;
  const auto where = [&]() -> std::string {
    if (!phase) return fmt::format("as step {}'s graph was replayed", step);
    if (*phase == FaultPhase::collective) return fmt::format("at a collective of step {}", step);
    return fmt::format("in the {} of step {}", fault_phase_name(*phase), step);
  };
  const std::string why = fmt::format("DP_FAULT {}, {}", f->text(), where());
  target.lose(why);
  target.throw_if_lost();
}

}  // namespace dp
