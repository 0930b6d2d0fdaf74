// flight_record.cpp — collective signatures, purposes and the process's flight record.
#include "dp/runtime/flight_record.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fmt/format.h>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "dp/runtime/error.h"
#include "dp/runtime/progress.h"

namespace dp {
namespace {

template <std::size_t N>
void put(std::array<char, N>& out, std::string_view text) {
  out.fill('\0');
  std::memcpy(out.data(), text.data(), std::min(text.size(), N - 1));
}
template <std::size_t N>
std::string_view get(const std::array<char, N>& text) {
  return {text.data(), ::strnlen(text.data(), N)};
}

thread_local std::array<char, 48> purpose_now{};
thread_local std::array<char, 64> site_now{};

const char* state_name(CollectiveState s) {
  switch (s) {
    case CollectiveState::issued: return "issued";
    case CollectiveState::done: return "done";
    case CollectiveState::failed: return "failed";
    case CollectiveState::captured: return "captured";
  }
  return "?";
}

}  // namespace

bool CollectiveSignature::matches(const CollectiveSignature& o) const {
  return op == o.op && dtype == o.dtype && count == o.count && root == o.root && purpose == o.purpose;
}

std::string CollectiveSignature::describe() const {
  std::string out = fmt::format("{} {} x {}", get(op), get(dtype), count);
  if (root >= 0) out += fmt::format(" root {}", root);
  const std::string_view p = get(purpose), s = get(site);
  out += fmt::format(" ({}{}{})", p.empty() ? "no purpose" : p, s.empty() ? "" : ", at ", s);
  return out;
}

CollectiveSignature make_signature(std::string_view op, std::string_view dtype, std::uint64_t count, int root) {
  CollectiveSignature s;
  put(s.op, op);
  put(s.dtype, dtype);
  s.count = count;
  s.root = root;
  s.purpose = purpose_now;
  s.site = site_now;
  return s;
}

CollectivePurpose::CollectivePurpose(std::string_view what, CallSite where)
    : saved_purpose_(purpose_now), saved_site_(site_now) {
  put(purpose_now, what);
  std::string_view file = where.file;
  if (const auto slash = file.rfind('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
  put(site_now, fmt::format("{}:{}", file, where.line));
}

CollectivePurpose::~CollectivePurpose() {
  purpose_now = saved_purpose_;
  site_now = saved_site_;
}

namespace {
std::atomic<int> checked_override{-1};  // -1: DP_CHECK_COLLECTIVES decides
}  // namespace

void set_collectives_checked(bool on) { checked_override.store(on ? 1 : 0); }

namespace {
std::atomic<std::uint64_t> check_agreements{0}, check_ns{0};
}  // namespace

CollectiveCheckTotals collective_check_totals() { return {check_agreements.load(), check_ns.load()}; }

void count_collective_check(std::uint64_t ns) {
  check_agreements.fetch_add(1, std::memory_order_relaxed);
  check_ns.fetch_add(ns, std::memory_order_relaxed);
}

bool collectives_checked() {
  if (const int forced = checked_override.load(); forced >= 0) return forced == 1;
  static const int value = [] {
    const char* text = std::getenv("DP_CHECK_COLLECTIVES");
    if (!text || !*text || std::strcmp(text, "1") == 0) return 1;
    if (std::strcmp(text, "0") == 0) return 0;
    return -1;
  }();
  if (value < 0)
    throw InvalidArgument(
        fmt::format("DP_CHECK_COLLECTIVES='{}': 1 (check every collective's signature, the default) or 0",
                    std::getenv("DP_CHECK_COLLECTIVES")));
  return value == 1;
}

struct FlightRecorder::Impl {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::size_t capacity = 2000;
  mutable std::mutex mutex;
  struct Ring {
    std::deque<FlightEntry> entries;
    std::uint64_t first_id = 0;  // id of entries.front()
  };
  std::map<int, Ring> rings;  // by global rank
};

FlightRecorder::FlightRecorder() : impl_(new Impl) {
  if (const char* text = std::getenv("DP_FLIGHT_ENTRIES"); text && *text) {
    char* end = nullptr;
    const long n = std::strtol(text, &end, 10);
    if (end == text || *end || n < 1 || n > 1'000'000)
      throw InvalidArgument(fmt::format("DP_FLIGHT_ENTRIES='{}' is not a whole number in [1, 1000000]", text));
    impl_->capacity = static_cast<std::size_t>(n);
  }
}

FlightRecorder& FlightRecorder::process() {
  static FlightRecorder* recorder = new FlightRecorder;  // never destroyed: workers record during exit
  return *recorder;
}

double FlightRecorder::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->start).count();
}

std::uint64_t FlightRecorder::issued(const FlightEntry& entry) {
  std::lock_guard lock(impl_->mutex);
  Impl::Ring& ring = impl_->rings[entry.global_rank];
  ring.entries.push_back(entry);
  ring.entries.back().issued_s = now_s();
  if (ring.entries.size() > impl_->capacity) {
    ring.entries.pop_front();
    ++ring.first_id;
  }
  return ring.first_id + ring.entries.size() - 1;
}

void FlightRecorder::done(int global_rank, std::uint64_t id, bool failed) {
  std::lock_guard lock(impl_->mutex);
  Impl::Ring& ring = impl_->rings[global_rank];
  if (id < ring.first_id || id >= ring.first_id + ring.entries.size()) return;  // fallen out of the record
  FlightEntry& e = ring.entries[id - ring.first_id];
  e.state = failed ? CollectiveState::failed : CollectiveState::done;
  e.done_s = now_s();
}

void FlightRecorder::captured(int global_rank, std::uint64_t id) {
  std::lock_guard lock(impl_->mutex);
  Impl::Ring& ring = impl_->rings[global_rank];
  if (id >= ring.first_id && id < ring.first_id + ring.entries.size())
    ring.entries[id - ring.first_id].state = CollectiveState::captured;
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  std::lock_guard lock(impl_->mutex);
  std::vector<FlightEntry> out;
  for (const auto& [rank, ring] : impl_->rings) out.insert(out.end(), ring.entries.begin(), ring.entries.end());
  return out;
}

void FlightRecorder::clear() {
  std::lock_guard lock(impl_->mutex);
  impl_->rings.clear();
}

std::string FlightRecorder::summary(int process) const {
  // Each device's last collective; the ones still issued are where the job stands.
  std::string out;
  for (const progress::Mark& m : progress::marks())
    if (m.phase != "idle" && m.waiting.empty() && m.idle_s >= 1.0)  // still for a while: not a rank just failing
      out += fmt::format("{}{}{}", out.empty() ? "" : "; ", process >= 0 ? fmt::format("process {} ", m.process) : "",
                         progress::describe(m));
  // Each device's oldest call still in flight (where it is stuck), else its last one.
  std::map<int, FlightEntry> last, open;
  for (const FlightEntry& e : entries()) {
    if (e.state == CollectiveState::captured) continue;
    last[e.global_rank] = e;
    if (e.state == CollectiveState::issued && !open.count(e.global_rank)) open[e.global_rank] = e;
  }
  for (const auto& [rank, e] : open) last[rank] = e;
  if (last.empty()) return out.empty() ? "no collective was issued" : out;
  const double now = now_s();
  const auto name = [](const FlightEntry& e) {
    return fmt::format("{} #{} ({})", get(e.signature.op), e.seq,
                       get(e.signature.purpose).empty() ? "no purpose" : get(e.signature.purpose));
  };
  // The furthest call (per communicator) any device reached; a device behind it is the culprit.
  std::map<int, std::uint64_t> furthest;
  for (const auto& [rank, e] : last) furthest[e.communicator] = std::max(furthest[e.communicator], e.seq);
  std::vector<std::string> behind, waiting;
  for (const auto& [rank, e] : last) {
    const std::string where =
        process >= 0 ? fmt::format("process {} device {}", process, rank) : fmt::format("device {}", rank);
    if (e.seq < furthest[e.communicator] || e.state != CollectiveState::issued)
      behind.push_back(fmt::format("{} last issued {}{}", where, name(e),
                                   e.state == CollectiveState::issued ? fmt::format(" {:.1f} s ago", now - e.issued_s)
                                                                      : fmt::format(" ({})", state_name(e.state))));
    else
      waiting.push_back(fmt::format("{} is in {} since {:.1f} s", where, name(e), now - e.issued_s));
  }
  for (const auto* list : {&behind, &waiting})
    for (const std::string& s : *list) out += (out.empty() ? "" : "; ") + s;
  return out;
}

std::string FlightRecorder::json(int process, std::string_view reason) const {
  nlohmann::json out;
  out["process"] = process;
  out["reason"] = std::string(reason);
  out["summary"] = summary(process);
  out["time_s"] = now_s();
  nlohmann::json marks = nlohmann::json::array();
  for (const progress::Mark& m : progress::marks())
    marks.push_back({{"global_rank", m.global_rank},
                     {"process", m.process},
                     {"step", m.step},
                     {"phase", m.phase},
                     {"detail", m.detail},
                     {"waiting", m.waiting},
                     {"idle_s", m.idle_s}});
  out["marks"] = marks;
  nlohmann::json list = nlohmann::json::array();
  for (const FlightEntry& e : entries())
    list.push_back({{"communicator", e.communicator},
                    {"seq", e.seq},
                    {"global_rank", e.global_rank},
                    {"step", e.step},
                    {"op", std::string(get(e.signature.op))},
                    {"dtype", std::string(get(e.signature.dtype))},
                    {"count", e.signature.count},
                    {"root", e.signature.root},
                    {"purpose", std::string(get(e.signature.purpose))},
                    {"site", std::string(get(e.signature.site))},
                    {"bytes", e.bytes},
                    {"state", state_name(e.state)},
                    {"issued_s", e.issued_s},
                    {"done_s", e.done_s}});
  out["entries"] = list;
  return out.dump(1);
}

std::string flight_dir(const std::string& fallback) {
  if (const char* dir = std::getenv("DP_FLIGHT_DIR"); dir && *dir) return dir;
  return fallback.empty() ? std::string(".") : fallback;
}

}  // namespace dp
