// ddp_data.h — synthetic MNIST-shaped samples for the DDP tests, and their split into rank shards.
#pragma once

#include <cstdint>
#include <vector>

#include "dp/nn/batch.h"
#include "test_util.h"

namespace dp::test {

struct Data {
  std::vector<float> x;  // samples x 784, in [0, 1)
  std::vector<std::int64_t> y;
};
inline Data make_data(int samples, unsigned seed) {
  Data d{random_vector(static_cast<std::size_t>(samples) * 784, seed, 0.0f, 1.0f), {}};
  for (int i = 0; i < samples; ++i) d.y.push_back((i * 7 + static_cast<int>(seed)) % 10);
  return d;
}

// Global rank g's share of a step whose global batch starts at row `first_row`: rows
// [first_row + g*b, first_row + (g+1)*b), for the `ranks` ranks from `first_rank` on (this
// process's ranks; by default all `ranks` of one process).
inline std::vector<Batch> shards(const Data& d, int first_row, int ranks, int per_rank, int first_rank = 0) {
  std::vector<Batch> out;
  for (int r = 0; r < ranks; ++r) {
    const int row = first_row + (first_rank + r) * per_rank;
    out.push_back(Batch{d.x.data() + static_cast<std::size_t>(row) * 784, d.y.data() + row, per_rank});
  }
  return out;
}

}  // namespace dp::test
