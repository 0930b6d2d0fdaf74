// batches.h — the engines' batch checks and host batches staged into device memory: a batch is
// checked once per submission, before anything waits or is enqueued.
#pragma once

#include <cstddef>

#include "dp/nn/batch.h"
#include "dp/nn/model.h"
#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"

namespace dp::engines {

// Floats per sample of the model's input.
std::size_t sample_floats(const Model& model);

// Throws InvalidArgument for an empty batch or null inputs.
void check_batch(const Batch& batch);

// Throws InvalidArgument unless `batches` holds `expected` batches.
void expect_batches(std::size_t got, int expected, const char* engine);

// A host batch copied to one device, into grow-only buffers (evaluation, DDP's forward_backward).
class StagedBatch {
 public:
  // Enqueues on `stream` the copies of batch.size samples of `floats_per_sample` inputs, and of the
  // targets when batch.targets is set. Throws InvalidArgument for an empty batch or null inputs.
  void stage(Device& device, const Stream& stream, const Batch& batch, std::size_t floats_per_sample);
  const float* inputs() const { return static_cast<const float*>(inputs_.data()); }
  const std::int64_t* targets() const { return static_cast<const std::int64_t*>(targets_.data()); }

 private:
  Scratch inputs_, targets_;
};

}  // namespace dp::engines
