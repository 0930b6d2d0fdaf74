// dp/nn/batch.h — a batch of samples in host memory, as the data loader hands it out and the engines
// take it: `size` inputs (size x the model's input_shape floats) and their int64 class targets.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

namespace dp {

struct Batch {
  Batch() = default;
  Batch(const float* inputs, const std::int64_t* targets, int size, std::shared_ptr<const void> lease = {})
      : inputs(inputs), targets(targets), size(size), lease(std::move(lease)) {}

  const float* inputs = nullptr;
  const std::int64_t* targets = nullptr;  // may be null where only a forward runs
  int size = 0;
  // Lends the memory beyond the call, as a pinned tensor copied with non_blocking=True (and
  // record_stream) does in PyTorch. Empty: a training step reads `inputs` and `targets` before it
  // returns (it copies them into its own pinned staging on the host). Set, with both in pinned
  // memory of the engine's runtime (Runtime::is_pinned): the step copies straight from them to its
  // devices on a copy stream, with no host copy, and keeps a copy of `lease` until those copies have
  // run (it lets go at a later submission, at synchronize(), or when it goes away). The memory must
  // stay allocated and unchanged while any copy of the lease lives: its deleter is where the owner
  // learns that it may be reused (BatchLoader's batches come with one).
  std::shared_ptr<const void> lease;
};

}  // namespace dp
