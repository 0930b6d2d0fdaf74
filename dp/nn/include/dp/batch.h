// dp/batch.h — a batch of samples in host memory, as the data loader hands it out and the engines
// take it: `size` inputs (size x the model's input_shape floats) and their int64 class targets.
#pragma once

#include <cstdint>

namespace dp {

struct Batch {
  const float* inputs = nullptr;
  const std::int64_t* targets = nullptr;  // may be null where only a forward runs
  int size = 0;
};

}  // namespace dp
