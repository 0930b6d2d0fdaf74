// fuzz_image.cpp — the PNG and JPEG decoder (dp::decode_image, from memory) and the transforms on
// whatever it returns. Whatever the bytes, the decoder returns a consistent RGB image or throws
// dp::Error — never crashes, hangs, exits (libjpeg's and libpng's default error handlers would
// exit) or reads out of bounds — and the transforms accept any image it returns.
#include <cstdint>
#include <vector>

#include "dp/io/image.h"
#include "dp/io/transforms.h"
#include "dp/runtime/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A header may claim up to PIL's 179 million pixels; here a million, so that one input cannot
  // take the fuzzer's memory or its time (the limit's own check is what the unit tests cover).
  constexpr std::uint64_t kMaxPixels = 1 << 20;
  dp::Image image;
  try {
    image = dp::decode_image(data, size, "<fuzz input>", kMaxPixels);
  } catch (const dp::Error&) {
    return 0;
  }
  if (image.width <= 0 || image.height <= 0) __builtin_trap();
  if (static_cast<std::uint64_t>(image.width) * static_cast<std::uint64_t>(image.height) > kMaxPixels) __builtin_trap();
  if (image.rgb.size() != static_cast<std::size_t>(image.width) * static_cast<std::size_t>(image.height) * 3)
    __builtin_trap();
  // Any shape the decoder accepts (1 x N strips included) goes through both pipelines.
  std::vector<float> out(3 * 8 * 8);
  dp::transforms::PhiloxDraws draws(dp::SampleKey{size, 0, 0}, 0);
  dp::transforms::train_transform(image, 8, {}, 0.5, {}, draws, out.data());
  dp::transforms::eval_transform(image, 10, 8, {}, out.data());
  return 0;
}
