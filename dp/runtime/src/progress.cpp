// progress.cpp — the device threads' marks and the process's watch thread.
#include "dp/runtime/progress.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fmt/format.h>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "dp/runtime/fault.h"
#include "dp/runtime/process_group.h"

namespace dp::progress {
namespace {

using Clock = std::chrono::steady_clock;

struct State {
  explicit State(int rank) : global_rank(rank) {}
  const int global_rank;        // a state per global rank: fixed
  std::atomic<int> process{0};  // rebinding may change it (another job in the process)
  std::mutex mutex;
  std::int64_t step = 0;
  const char* phase = "idle";
  std::string detail, waiting;
  Clock::time_point moved = Clock::now(), step_started{};
  std::deque<double> step_times;  // the last ones, seconds
  std::uint64_t moves = 0;        // a warning is given once per stall (per value of moves)
  std::uint64_t warned = ~0ull;

  void move() {
    moved = Clock::now();
    ++moves;
  }
};

struct Board {
  std::mutex mutex;
  std::map<int, std::unique_ptr<State>> states;  // by global rank; never removed (threads outlive engines)
};

Board& board() {
  static Board* b = new Board;  // never destroyed: workers may mark progress during exit
  return *b;
}

thread_local State* current = nullptr;
thread_local Device* t_device = nullptr;  // what a lose fault makes lost
thread_local int t_fault_device = -1;
// flip-gemm's pass: the forward or backward the thread is in (set_phase), and whether a flip hit it.
thread_local std::optional<FaultPhase> t_pass;
thread_local bool t_pass_flipped = false;

double median(std::deque<double> values) {
  if (values.size() < 3) return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

Mark snapshot(State& s, Clock::time_point now) {
  std::lock_guard lock(s.mutex);
  Mark m;
  m.global_rank = s.global_rank;
  m.process = s.process.load();
  m.step = s.step;
  m.phase = s.phase;
  m.detail = s.detail;
  m.waiting = s.waiting;
  m.idle_s = std::chrono::duration<double>(now - s.moved).count();
  m.median_step_s = median(s.step_times);
  return m;
}

// Every bound thread's state, by global rank (states are never removed: the pointers stay valid).
std::vector<State*> all_states() {
  std::lock_guard lock(board().mutex);
  std::vector<State*> states;
  for (auto& [rank, s] : board().states) states.push_back(s.get());
  return states;
}

double min_stall_s() {
  static const double value = [] {
    const char* text = std::getenv("DP_STALL_WARN_S");
    if (!text || !*text) return 10.0;
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || *end || !(v > 0.0))
      throw InvalidArgument(fmt::format("DP_STALL_WARN_S='{}' is not a positive number of seconds", text));
    return v;
  }();
  return value;
}

// How long a mark may stand still before it is called stalled: max(DP_STALL_WARN_S, 3x the
// longest median step of this process's ranks).
double stall_limit(const std::vector<Mark>& marks) {
  double longest = 0.0;
  for (const Mark& m : marks) longest = std::max(longest, m.median_step_s);
  return std::max(min_stall_s(), 3.0 * longest);
}

// A thread at work (not between steps, not waiting for a peer) whose mark has stood still for
// max(DP_STALL_WARN_S, 3x its median step).
bool stalled(const Mark& m) {
  return m.phase != "idle" && m.waiting.empty() && m.idle_s >= std::max(min_stall_s(), 3.0 * m.median_step_s);
}

// What the process's beat says of it: "1 <a stalled mark>" when one of its threads makes no
// progress, else "0 <its stillest mark>" (the one a peer waiting for it most likely waits for).
std::string local_status() {
  const std::vector<Mark> all = marks();
  const Mark* still = nullptr;
  for (const Mark& m : all) {
    if (stalled(m)) return "1 " + describe(m);
    if (m.phase != "idle" && (!still || m.idle_s > still->idle_s)) still = &m;
  }
  return still ? "0 " + describe(*still) : std::string("0 between steps");
}

// The process group whose peers the watch names (a weak reference: the watch never keeps a job's
// group alive), and what it said of each peer so far.
struct Peers {
  std::mutex mutex;
  std::weak_ptr<ProcessGroup> group;
  std::map<int, std::pair<bool, bool>> warned;  // by process: {silent, stalled} warned this episode
};
Peers& peers() {
  static Peers* p = new Peers;  // never destroyed, like the board
  return *p;
}

std::string waits_here(const std::vector<Mark>& marks) {
  std::string here;
  for (const Mark& m : marks)
    if (!m.waiting.empty()) here += fmt::format("; here {}", describe(m));
  return here;
}

// A peer that gave no sign of life (its beat's counter still) or says that one of its threads
// makes no progress is named once per episode, with what this process's threads wait in.
void watch_peers(const std::vector<Mark>& marks) {
  std::shared_ptr<ProcessGroup> group;
  {
    std::lock_guard lock(peers().mutex);
    group = peers().group.lock();
  }
  if (!group) return;
  // Beats come about once a second: a counter read twice unchanged is no silence yet.
  const double limit = std::max(stall_limit(marks), 3.0);
  for (const ProcessGroup::PeerBeat& beat : group->peer_beats()) {
    const bool silent = beat.silent_s >= limit;
    const bool stalled_there = !silent && beat.status.starts_with("1 ");
    const std::string said = beat.status.size() > 2 ? beat.status.substr(2) : std::string("nothing yet");
    bool warn_silent = false, warn_stalled = false;
    {
      std::lock_guard lock(peers().mutex);
      auto& [was_silent, was_stalled] = peers().warned[beat.process];
      warn_silent = silent && !was_silent;
      warn_stalled = stalled_there && !was_stalled;
      was_silent = silent;
      was_stalled = stalled_there;
    }
    if (warn_silent)
      std::fprintf(stderr,
                   "dp: warning: process %d has given no sign of life for %.1f s (stopped or swapped out?); the job "
                   "waits for it until DP_TIMEOUT_S; its last word: %s%s\n",
                   beat.process, beat.silent_s, said.c_str(), waits_here(marks).c_str());
    if (warn_stalled)
      std::fprintf(stderr,
                   "dp: warning: process %d reports: %s, no progress (still alive; the job ends only at "
                   "DP_TIMEOUT_S)%s\n",
                   beat.process, said.c_str(), waits_here(marks).c_str());
    if (warn_silent || warn_stalled) std::fflush(stderr);
  }
}

// `peers`: whether to judge the other processes (not right after this process itself stood still:
// then its peers' beats are merely unread).
void watch_once(bool peers) {
  const auto now = Clock::now();
  const std::vector<State*> states = all_states();
  std::vector<Mark> marks;
  for (State* s : states) marks.push_back(snapshot(*s, now));
  if (peers) watch_peers(marks);
  for (std::size_t i = 0; i < states.size(); ++i) {
    const Mark& m = marks[i];
    if (!stalled(m)) continue;
    {
      std::lock_guard lock(states[i]->mutex);
      if (states[i]->warned == states[i]->moves) continue;
      states[i]->warned = states[i]->moves;
    }
    std::string others;
    for (const Mark& o : marks)
      if (o.global_rank != m.global_rank && !o.waiting.empty()) others += fmt::format("; {}", describe(o));
    std::fprintf(stderr,
                 "dp: warning: process %d: %s, no progress (still alive; the job ends only at DP_TIMEOUT_S)%s\n",
                 m.process, describe(m).c_str(), others.c_str());
    std::fflush(stderr);
  }
}

}  // namespace

void bind(int global_rank, int process, Device* device, int fault_device) {
  std::lock_guard lock(board().mutex);
  auto& slot = board().states[global_rank];
  if (!slot) slot = std::make_unique<State>(global_rank);
  slot->process.store(process);
  current = slot.get();
  t_device = device;
  t_fault_device = fault_device >= 0 ? fault_device : global_rank;
}

void fault_point(std::optional<FaultPhase> phase) {
  State* s = current;
  if (!s || !t_device) return;
  FaultPlan& plan = FaultPlan::from_environment();
  if (plan.empty()) return;
  std::int64_t step = 0;
  {
    std::lock_guard lock(s->mutex);
    step = s->step;
  }
  fire_lose_faults(plan, s->process.load(), t_fault_device, step, phase, *t_device);
}

void begin_step(std::int64_t step) {
  State* s = current;
  if (!s) return;
  {
    std::lock_guard lock(s->mutex);
    const auto now = Clock::now();
    if (s->step_started != Clock::time_point{} && s->step + 1 == step) {
      s->step_times.push_back(std::chrono::duration<double>(now - s->step_started).count());
      if (s->step_times.size() > 16) s->step_times.pop_front();
    }
    s->step = step;
    s->step_started = now;
    s->phase = "the step's start";
    s->detail.clear();
    s->move();
  }
  FaultPlan& plan = FaultPlan::from_environment();
  if (!plan.empty()) fire_step_faults(plan, s->process.load(), t_fault_device, step);
}

void set_phase(const char* phase, std::string detail) {
  State* s = current;
  if (!s) return;
  {
    std::lock_guard lock(s->mutex);
    s->phase = phase;
    s->detail = std::move(detail);
    s->move();
  }
  if (!t_device || FaultPlan::from_environment().empty()) return;  // per layer: no fault, no search
  const std::string_view name(phase);
  for (const FaultPhase p : {FaultPhase::forward, FaultPhase::backward}) {
    if (name != fault_phase_name(p) || t_pass == p) continue;
    t_pass = p;  // a new pass (its layers share the phase): flip-gemm may strike it
    t_pass_flipped = false;
  }
  for (const FaultPhase p : {FaultPhase::forward, FaultPhase::backward, FaultPhase::optimizer})
    if (name == fault_phase_name(p)) fault_point(p);
}

bool flip_this_output(const Stream& stream) {
  State* s = current;
  if (!s || !t_pass || t_pass_flipped) return false;
  FaultPlan& plan = FaultPlan::from_environment();
  if (!plan.has(FaultKind::flip_gemm) || stream.capturing()) return false;
  std::int64_t step = 0;
  {
    std::lock_guard lock(s->mutex);
    step = s->step;
  }
  if (!plan.due(FaultKind::flip_gemm, s->process.load(), t_fault_device, step, t_pass)) return false;
  t_pass_flipped = true;
  return true;
}

int current_rank() { return current ? current->global_rank : -1; }
int current_fault_device() { return current ? t_fault_device : -1; }
int current_process() { return current ? current->process.load() : 0; }
std::int64_t current_step() {
  if (!current) return 0;
  std::lock_guard lock(current->mutex);
  return current->step;
}

Waiting::Waiting(std::string what) : bound_(current != nullptr) {
  if (!bound_) return;
  std::lock_guard lock(current->mutex);
  current->waiting = std::move(what);
  current->move();
}

Waiting::~Waiting() {
  if (!bound_ || !current) return;
  std::lock_guard lock(current->mutex);
  current->waiting.clear();
  current->move();
}

std::vector<Mark> marks() {
  const auto now = Clock::now();
  const std::vector<State*> states = all_states();
  std::vector<Mark> out;
  for (State* s : states) out.push_back(snapshot(*s, now));
  return out;
}

std::string describe(const Mark& m) {
  std::string where = m.phase;
  if (!m.detail.empty()) where += fmt::format(" ({})", m.detail);
  if (m.step > 0) where += fmt::format(" of step {}", m.step);
  if (!m.waiting.empty())
    return fmt::format("device {} waits in {} for {:.1f} s ({})", m.global_rank, m.waiting, m.idle_s, where);
  return fmt::format("device {} in {} for {:.1f} s", m.global_rank, where, m.idle_s);
}

void watch_processes(const std::shared_ptr<ProcessGroup>& processes) {
  if (!processes || processes->size() == 1) return;
  start_watch();
  {
    std::lock_guard lock(peers().mutex);
    if (peers().group.lock() == processes) return;
    peers().group = processes;
    peers().warned.clear();
  }
  processes->start_beats(local_status);
}

void start_watch() {
  static std::once_flag once;
  std::call_once(once, [] {
    (void)min_stall_s();  // a malformed DP_STALL_WARN_S is the caller's error, here
    std::thread([] {
      auto last = Clock::now();
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        const auto now = Clock::now();
        watch_once(now - last < std::chrono::milliseconds(1500));  // a longer gap: this process was stopped
        last = now;
      }
    }).detach();
  });
}

}  // namespace dp::progress
