// dp/runtime/progress.h — liveness apart from progress: each device thread keeps a mark of where it
// is (its global rank, the optimizer step, a phase: data, forward, backward, a collective, the
// optimizer, a save, evaluation), and a watch thread per process warns when a thread's mark has not
// moved for max(10 s, 3x the median step), naming it, its phase and what the other threads wait in.
// A warning never ends a job (a slow checkpoint write is no failure); DP_TIMEOUT_S does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/runtime/fault.h"

namespace dp {

class Device;
class ProcessGroup;
class Stream;

namespace progress {

// This thread now works for global rank `global_rank` of process `process` (engines call it on
// their device workers; the main thread is "the process"). Its mark exists from here on.
// `device`: the device the thread drives, which DP_FAULT's lose faults for `fault_device` (its
// global device index, dN; -1: global_rank) make lost.
void bind(int global_rank, int process, Device* device = nullptr, int fault_device = -1);
// A point of the thread's step where DP_FAULT's lose faults of `phase` strike (fire_lose_faults;
// none: any phase, for a step replayed from a graph). set_phase reaches forward, backward and
// optimizer by itself.
void fault_point(std::optional<FaultPhase> phase);
// The thread's rank starts optimizer step `step` (1-based): the mark moves, and DP_FAULT's faults
// due there fire (fire_step_faults). Threads not bound do nothing.
void begin_step(std::int64_t step);
// The thread's phase: a string literal (kept as a pointer), with an optional detail (a layer's
// name, a bucket). Threads not bound do nothing.
void set_phase(const char* phase, std::string detail = {});
// DP_FAULT flip-gemm: whether the GEMM or convolution output this thread just enqueued gets a
// flipped bit, the first of each forward (or backward) pass of the fault's step on its device.
// Never while `stream` captures (a graph would flip at every replay: the engines run eagerly
// when such a fault is planned).
bool flip_this_output(const Stream& stream);
// The thread's rank (-1 when not bound) and step (0 outside a step).
int current_rank();
// The thread's global device index for DP_FAULT's dN (-1 when not bound).
int current_fault_device();
int current_process();
std::int64_t current_step();

// A collective the thread waits in (shown beside the phase while it lasts).
class Waiting {
 public:
  Waiting(std::string what);
  ~Waiting();
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  bool bound_;
};

struct Mark {
  int global_rank = -1;
  int process = 0;
  std::int64_t step = 0;
  std::string phase, detail, waiting;
  double idle_s = 0.0;         // since the mark last moved
  double median_step_s = 0.0;  // of the rank's last steps (0: fewer than 3 known)
};
// Every bound thread's mark, by global rank.
std::vector<Mark> marks();
// "device 1 in forward (fc2) of step 3 for 12.4 s" / "... waits in all_reduce #12 (bucket 0)".
std::string describe(const Mark& mark);

// Starts the process's watch thread once (later calls do nothing); it warns on stderr, once per
// stall, when a mark stays still for max(min_s, 3x its median step). DP_STALL_WARN_S sets min_s
// (default 10).
void start_watch();

// Also watches the other processes of `processes` (a job of several): starts its beats
// (ProcessGroup::start_beats), saying whether one of this process's threads makes no progress, and
// warns on stderr, once per episode, when a peer has given no sign of life for the same limit
// (stopped, swapped out) or reports a thread without progress. A warning never ends the job.
void watch_processes(const std::shared_ptr<ProcessGroup>& processes);

}  // namespace progress

}  // namespace dp
