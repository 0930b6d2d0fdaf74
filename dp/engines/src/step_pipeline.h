// step_pipeline.h — the training steps an engine has submitted and not yet waited for
// (Engine::submit_step): their slots, their losses, and the failure that stops later steps.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

#include "dp/engines/engine.h"
#include "dp/runtime/device.h"

namespace dp::engines {

// The training steps an engine has submitted and not yet waited for (Engine::submit_step), in
// their slots. See Note [step slots] (dp/engines/engine.h).
class StepPipeline {
 public:
  static constexpr int kSlots = kStepsInFlight;
  StepPipeline() = default;
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;
  // Waits for what is in flight; failures are dropped (a destructor never throws; get() of the
  // failed step's StepLoss still throws).
  ~StepPipeline();

  // The next step's slot, once the step that used it last has its loss (rethrows that step's
  // failure, unless its StepLoss::get() has reported it already).
  int next_slot();
  // The step just submitted in `slot` (next_slot()'s): `wait` waits for its loss and returns it,
  // `query` says whether `wait` would not block.
  StepLoss submitted(int slot, std::function<float()> wait, std::function<bool()> query);
  // The same for a loss that is the pinned floats at `losses` once `ready` has passed: the mean of
  // `count` (micro-batches' losses, added in their order; one: that float as it is).
  StepLoss submitted(int slot, const Event& ready, const float* losses, int count = 1);
  // A step whose loss is already known (DDP across processes): takes `slot` without anything in flight.
  StepLoss known(int slot, float loss);
  // Enqueues a step's work through `enqueue`, which returns submitted()'s or known()'s StepLoss. If
  // it throws, work it enqueued before may still read its slot, which the slot's events do not
  // cover (the step's last record never came), so every later step is refused with that failure
  // (next_slot rethrows it), as a CUDA context refuses work after a fault.
  StepLoss enqueue(const std::function<StepLoss()>& enqueue);
  // Waits for the loss of every step in flight; rethrows the first failure no get() has reported.
  void drain();

 private:
  std::array<std::shared_ptr<StepLoss::State>, kSlots> pending_;
  std::uint64_t submitted_ = 0;
  std::exception_ptr refused_;  // what a step failed with while it was being enqueued
};

}  // namespace dp::engines
