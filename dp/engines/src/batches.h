// batches.h — the engines' batch checks and host batches staged into device memory: a batch is
// checked once per submission, before anything waits or is enqueued.
#pragma once

#include <cstddef>
#include <string_view>

#include "dp/nn/batch.h"
#include "dp/nn/model.h"
#include "dp/runtime/device.h"
#include "dp/runtime/scratch.h"

namespace dp::engines {

// One sample of the model in an engine's buffers: its input elements (of `input`: features or token
// ids, four bytes each), its class targets (one per row of logits: Model::targets_per_sample) and
// the logits of its rows.
struct SampleSize {
  std::size_t inputs = 0, targets = 1, logits = 0;
  int classes = 0;  // logits per row
  DType input = DType::f32;
  std::size_t input_bytes() const { return inputs * dtype_size(input); }
};
SampleSize sample_size(const Model& model);

// Throws InvalidArgument for an empty batch, null inputs, or inputs of another dtype than the model's.
void check_batch(const Batch& batch, const SampleSize& sample);
// Throws InvalidArgument, `where` before the message, unless the batch's inputs are of `model`'s dtype.
void check_input_dtype(const Batch& batch, DType model, std::string_view where = {});

// Throws InvalidArgument unless `batches` holds `expected` batches.
void expect_batches(std::size_t got, int expected, const char* engine);

// A host batch copied to one device, into grow-only buffers (evaluation, DDP's forward_backward).
class StagedBatch {
 public:
  // Enqueues on `stream` the copies of batch.size samples' inputs, and of their targets when
  // batch.targets is set. Throws as check_batch.
  void stage(Device& device, const Stream& stream, const Batch& batch, const SampleSize& sample);
  Inputs inputs() const { return {inputs_.data(), dtype_}; }
  const std::int64_t* targets() const { return static_cast<const std::int64_t*>(targets_.data()); }

 private:
  Scratch inputs_, targets_;
  DType dtype_ = DType::f32;
};

}  // namespace dp::engines
