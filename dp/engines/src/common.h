// common.h — what the engines share (private to dp/engines): the model on each device of a group,
// and host batches staged into device memory.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "dp/batch.h"
#include "dp/device.h"
#include "dp/device_group.h"
#include "dp/model.h"
#include "dp/scratch.h"

namespace dp::engines {

// Floats per sample of the model's input.
std::size_t sample_floats(const Model& model);

// The model on each device of `group`: rank 0 is `module` itself (it must live on device_ids[0],
// else InvalidArgument), the others are replicas whose values the engine broadcasts.
class Replicas {
 public:
  Replicas(Model& module, const DeviceGroup& group);
  Model& operator[](int rank) const { return rank == 0 ? module_ : *owned_[static_cast<std::size_t>(rank)]; }

 private:
  Model& module_;
  std::vector<std::unique_ptr<Model>> owned_;  // [0] stays empty
};

// A host batch copied to one device, into grow-only buffers.
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

// Throws InvalidArgument unless `batches` holds `expected` batches.
void expect_batches(std::size_t got, int expected, const char* engine);

}  // namespace dp::engines
