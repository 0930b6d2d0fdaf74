// step_pipeline.cpp — the steps in flight and their losses.
#include "step_pipeline.h"

namespace dp::engines {

StepPipeline::~StepPipeline() {
  for (auto& state : pending_)
    if (state) state->resolve();  // a failure stays in the state, for get()
}

int StepPipeline::next_slot() {
  if (refused_) std::rethrow_exception(refused_);
  const int slot = static_cast<int>(submitted_ % kSlots);
  auto& state = pending_[static_cast<std::size_t>(slot)];
  if (state) {
    std::shared_ptr<StepLoss::State> previous = std::move(state);
    previous->resolve();
    if (previous->error && !previous->reported) std::rethrow_exception(previous->error);
  }
  return slot;
}

StepLoss StepPipeline::submitted(int slot, std::function<float()> wait, std::function<bool()> query) {
  auto state = std::make_shared<StepLoss::State>();
  state->wait = std::move(wait);
  state->query = std::move(query);
  pending_[static_cast<std::size_t>(slot)] = state;
  ++submitted_;
  return StepLoss(std::move(state));
}

StepLoss StepPipeline::submitted(int slot, const Event& ready, const float* losses, int count) {
  return submitted(
      slot,
      [ready, losses, count] {
        ready.synchronize();
        if (count == 1) return losses[0];
        float total = losses[0];
        for (int m = 1; m < count; ++m) total += losses[m];
        return total / static_cast<float>(count);
      },
      [ready] { return ready.query(); });
}

StepLoss StepPipeline::enqueue(const std::function<StepLoss()>& enqueue) {
  try {
    return enqueue();
  } catch (...) {
    refused_ = std::current_exception();
    throw;
  }
}

StepLoss StepPipeline::known(int slot, float loss) {
  auto state = std::make_shared<StepLoss::State>();
  state->value = loss;
  pending_[static_cast<std::size_t>(slot)].reset();
  ++submitted_;
  return StepLoss(std::move(state));
}

void StepPipeline::drain() {
  // Oldest first: the first failure is the one reported.
  std::exception_ptr first;
  for (std::uint64_t i = 0; i < kSlots; ++i) {
    auto& state = pending_[static_cast<std::size_t>((submitted_ + i) % kSlots)];
    if (!state) continue;
    std::shared_ptr<StepLoss::State> done = std::move(state);
    done->resolve();
    if (done->error && !done->reported && !first) first = done->error;
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace dp::engines
