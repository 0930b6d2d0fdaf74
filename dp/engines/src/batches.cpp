// batches.cpp — the engines' batch checks and staged batches.
#include "batches.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp::engines {

SampleSize sample_size(const Model& model) {
  const int classes = model.output_features();
  const auto targets = static_cast<std::size_t>(model.targets_per_sample());
  return {numel(model.input_shape()), targets, targets * static_cast<std::size_t>(classes), classes,
          model.input_dtype()};
}

void check_batch(const Batch& batch, const SampleSize& sample) {
  if (batch.size < 1) throw InvalidArgument(fmt::format("batch size must be at least 1, got {}", batch.size));
  if (!batch.inputs) throw InvalidArgument("batch has no inputs (null pointer)");
  check_input_dtype(batch, sample.input);
}

void check_input_dtype(const Batch& batch, DType model, std::string_view where) {
  if (batch.inputs.dtype() != model)
    throw InvalidArgument(fmt::format("{}the batch holds {} but the model reads {}", where,
                                      input_kind(batch.inputs.dtype()), input_kind(model)));
}

void expect_batches(std::size_t got, int expected, const char* engine) {
  if (got != static_cast<std::size_t>(expected))
    throw InvalidArgument(fmt::format("{} step needs {} batch(es), got {}", engine, expected, got));
}

void StagedBatch::stage(Device& device, const Stream& stream, const Batch& batch, const SampleSize& sample) {
  check_batch(batch, sample);
  const auto samples = static_cast<std::size_t>(batch.size);
  stream.copy(inputs_.get<std::byte>(device, samples * sample.input_bytes()), batch.inputs.data(),
              samples * sample.input_bytes());
  dtype_ = sample.input;
  if (batch.targets) {
    const std::size_t targets = samples * sample.targets;
    stream.copy(targets_.get<std::int64_t>(device, targets), batch.targets, targets * sizeof(std::int64_t));
  }
}

}  // namespace dp::engines
