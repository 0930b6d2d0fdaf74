// dp/runtime/flight_record.h — what every collective is, and the record of the last ones: each call
// carries a signature (operation, dtype, element count, root, purpose, call site) and a sequence
// number per communicator; the communicators check that every rank issues the same signature
// before the operation runs (CollectiveMismatch otherwise), and note each call in the process's
// flight record, the last N per device, written as JSON when a job ends abnormally.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dp/runtime/call_site.h"

namespace dp {

// Trivially copyable: it travels between processes as bytes. Texts are NUL-terminated, cut to fit.
struct CollectiveSignature {
  std::array<char, 24> op{};       // "all_reduce"
  std::array<char, 8> dtype{};     // "f32", "bf16", "bytes"
  std::uint64_t count = 0;         // elements (bytes for "bytes")
  std::int32_t root = -1;          // a rooted operation's global root rank
  std::array<char, 48> purpose{};  // "bucket 3", "SyncBatchNorm", "parameters" (CollectivePurpose)
  std::array<char, 64> site{};     // the purpose's call site, "reducer.cpp:112"

  // Whether two ranks' calls are the same operation (the sites may differ).
  bool matches(const CollectiveSignature& other) const;
  // "all_reduce f32 x 1024 (bucket 3, at reducer.cpp:112)"
  std::string describe() const;
};

CollectiveSignature make_signature(std::string_view op, std::string_view dtype, std::uint64_t count, int root = -1);

// What the collectives this thread issues next are for, named in their signatures; restores the
// previous purpose when it goes (nestable). `where` is the call site the signature names.
class CollectivePurpose {
 public:
  explicit CollectivePurpose(std::string_view what, CallSite where = CallSite::here());
  ~CollectivePurpose();
  CollectivePurpose(const CollectivePurpose&) = delete;
  CollectivePurpose& operator=(const CollectivePurpose&) = delete;

 private:
  std::array<char, 48> saved_purpose_{};
  std::array<char, 64> saved_site_{};
};

// Whether the communicators check every collective's signature across the ranks before it runs:
// on unless DP_CHECK_COLLECTIVES=0 (anything else but 0 or 1 is InvalidArgument).
bool collectives_checked();
// Overrides DP_CHECK_COLLECTIVES for the communicators created from here on (dp_bench measures the
// check's cost by running a configuration both ways).
void set_collectives_checked(bool on);
// What the check has cost this process so far: the agreements its ranks made (one per rank and
// checked call; a captured call is checked once, its replays never) and the host time they spent in
// them, from arriving to leaving with the verdict (waiting for the last rank included, which the
// collective would otherwise wait for on the device: an upper bound of the check's own cost).
struct CollectiveCheckTotals {
  std::uint64_t agreements = 0;
  std::uint64_t ns = 0;
};
CollectiveCheckTotals collective_check_totals();
// Counts one agreement of `ns` nanoseconds (the communicators' check calls it).
void count_collective_check(std::uint64_t ns);

// captured: issued into a graph being captured (its replays run it without the host: not recorded).
enum class CollectiveState { issued, done, failed, captured };

struct FlightEntry {
  int communicator = 0;   // its index in the process (the same on every process)
  std::uint64_t seq = 0;  // the call's number on its communicator (the same on every rank)
  int global_rank = 0;
  std::int64_t step = 0;  // the optimizer step the device thread was in (0: none)
  CollectiveSignature signature;
  std::uint64_t bytes = 0;
  CollectiveState state = CollectiveState::issued;
  double issued_s = 0.0;  // seconds since the record started
  double done_s = -1.0;   // the host saw it complete (not known for captured calls)
};

class FlightRecorder {
 public:
  // The process's record (capacity DP_FLIGHT_ENTRIES, default 2000 per device).
  static FlightRecorder& process();

  // A new entry for `global_rank`'s call, state issued; returns its id for done().
  std::uint64_t issued(const FlightEntry& entry);
  void done(int global_rank, std::uint64_t id, bool failed = false);
  void captured(int global_rank, std::uint64_t id);
  // Every device's last entries, oldest first.
  std::vector<FlightEntry> entries() const;
  double now_s() const;
  // Clears the record (tests).
  void clear();

  // The summary line: the devices that are neither idle nor waiting in a collective (progress.h's
  // marks: where a stuck one stands), then each device's last collective, those behind the
  // furthest first ("process 0 device 1 last issued all_reduce #411 (bucket 3) 12.4 s ago; process 0
  // device 0 is in all_reduce #412 (bucket 3) since 12.4 s"); `process` names the process.
  std::string summary(int process = -1) const;
  // The record as JSON: {"process", "reason", "summary", "marks": progress marks, "entries"}; the
  // tools write it to flight_dir()/dp-flight-<process>.json (scripts/flight_record.py merges them).
  std::string json(int process, std::string_view reason) const;

  struct Impl;

 private:
  FlightRecorder();
  Impl* impl_;
};

// The flight record's directory: DP_FLIGHT_DIR, else `fallback` (the directory of --save), else ".".
std::string flight_dir(const std::string& fallback = {});

}  // namespace dp
