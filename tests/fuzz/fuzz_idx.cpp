// fuzz_idx.cpp — the IDX reader (dp::load_mnist), plain and gzip: the fuzzer's bytes are split into
// an images file and a labels file (the first two bytes say where). Whatever they hold, the reader
// returns a valid data set or throws dp::Error — never crashes, hangs or reads out of bounds.
#include <cstdint>
#include <cstring>

#include "dp/io/data.h"
#include "dp/runtime/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t split = std::min<std::size_t>(size - 2, (std::size_t{data[0]} << 8) | data[1]);
  dp::fuzz::write("train-images-idx3-ubyte", data + 2, split);
  dp::fuzz::write("train-labels-idx1-ubyte", data + 2 + split, size - 2 - split);
  try {
    const dp::Dataset set = dp::load_mnist(dp::fuzz::scratch().string());
    // What it accepted is consistent: one label in [0, 10) per 28x28 image.
    if (set.pixels.size() != set.size() * 784) __builtin_trap();
    for (auto label : set.labels)
      if (label < 0 || label >= 10) __builtin_trap();
  } catch (const dp::Error&) {
  }
  return 0;
}
