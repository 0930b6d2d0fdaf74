// dp/runtime/fault.h — fault injection: DP_FAULT makes a failure happen on purpose, at a chosen
// optimizer step on a chosen device or process, so that every way a job can fail is reproducible on
// the sim and on cuda (and tested). Off unless DP_FAULT is set; a malformed value is InvalidArgument.
//
//   DP_FAULT=KIND@TARGET:STEP[:ARG][,KIND@TARGET:STEP[:ARG]...]
//
// TARGET: dN (global device N: process p's device l, as --device-ids numbers it, is p * devices per
// process + l; with every device of each process, global rank N) or pN
// (process N, all of its devices). STEP: the 1-based optimizer step at which it fires (once). ARG:
// a number, for the kinds that take one. The kinds and what they do are in kFaultKinds (fault.cpp):
// one table, which the parser, the messages and docs/training.md's list follow.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dp {

class Device;

enum class FaultKind {
  desync_extra,  // the target issues one extra all-reduce
  desync_skip,   // the target skips one gradient bucket's reduction
  desync_count,  // the target's next collective has one element more
  hang,          // the device thread stops for good (the process stays alive)
  stall,         // the device thread (or the process) sleeps ARG seconds, then goes on
  exit,          // the process ends at once, as by SIGKILL
  throw_error,   // an exception on the device thread ("throw")
  lose,          // the device is lost as a GPU is after a fatal error (Device::lose), at ARG's phase
  flip_param,    // one bit of one parameter of the device's replica flips after the step's update
  // one bit of the first GEMM or convolution output of each forward (or backward: ARG's pass,
  // default backward) pass the device runs in the step: a device that computes wrong for a step
  flip_gemm,
};

// Where in its step a lose fault strikes: lose@dN:STEP[:PHASE], PHASE one of these names
// (default backward). A step replayed from a graph has no phases of its own on the host: there
// the device is lost as the replay starts, whatever the phase.
enum class FaultPhase { forward, backward, collective, optimizer };
std::string_view fault_phase_name(FaultPhase phase);

// DP_FAULT's spelling of a kind ("desync-extra", "throw").
std::string_view fault_kind_name(FaultKind kind);

struct Fault {
  FaultKind kind = FaultKind::throw_error;
  bool process_target = false;  // pN; else dN
  int target = 0;
  std::int64_t step = 1;
  double arg = 0.0;
  FaultPhase phase = FaultPhase::backward;  // lose
  // DP_FAULT's spelling of this one fault ("stall@d1:3:2.5").
  std::string text() const;
};

// Parses DP_FAULT's grammar; throws InvalidArgument naming the malformed item and the grammar.
std::vector<Fault> parse_faults(std::string_view text);

// The faults of this process's job, each fired at most once.
class FaultPlan {
 public:
  // DP_FAULT's plan, parsed on first use (InvalidArgument when malformed: every later call throws it
  // again). Empty when DP_FAULT is unset or empty.
  static FaultPlan& from_environment();
  explicit FaultPlan(std::vector<Fault> faults);

  bool empty() const { return faults_.empty(); }
  const std::vector<Fault>& faults() const { return faults_; }
  // InvalidArgument when a fault names a device or process the job does not have.
  void check_targets(int processes, int devices_per_process) const;

  // The fault of `kind` due on global device `device` of process `process` at optimizer step `step`
  // (a dN fault on that device, a pN fault on each of its process's devices), if it has not fired
  // there yet; it is then spent there. Thread-safe.
  // `phase`: only a fault of that phase (lose); none: any.
  std::optional<Fault> take(FaultKind kind, int process, int device, std::int64_t step,
                            std::optional<FaultPhase> phase = std::nullopt);
  // Whether a fault of `kind` is planned there (as take, of that phase), without spending it: for
  // the kinds that act more than once in their step (flip-gemm, once per pass).
  std::optional<Fault> due(FaultKind kind, int process, int device, std::int64_t step,
                           std::optional<FaultPhase> phase = std::nullopt) const;
  // Whether any fault of `kind` is planned (a cheap test before computing a step number).
  bool has(FaultKind kind) const;

 private:
  struct State;
  std::vector<Fault> faults_;
  std::shared_ptr<State> state_;  // which faults fired where
};

// What the device-thread kinds do when they fire, where the engines start a rank's step: hang
// (sleeps for good), stall (sleeps ARG s), throw (Error naming the fault), exit (SIGKILL to this
// process). Returns at once when nothing is due.
void fire_step_faults(FaultPlan& plan, int process, int device, std::int64_t step);
// A lose fault due at `phase` (none: any, a replayed step) of step `step` on global device `device`:
// `target` is lost (Device::lose, naming the fault) and DeviceLost thrown. Returns at once otherwise.
void fire_lose_faults(FaultPlan& plan, int process, int device, std::int64_t step, std::optional<FaultPhase> phase,
                      Device& target);

}  // namespace dp
