// transforms.cpp — torchvision's crop, flip, resize and normalize arithmetic on float CHW images,
// in the order of operations torch uses so that the roundings agree.
#include "dp/io/transforms.h"

#include <Random123/philox.h>
#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>

#include "dp/runtime/error.h"

namespace dp::transforms {
namespace {

// Distinguishes these draws' Philox key from dropout's under the same seed.
constexpr std::uint32_t kKeyTag = 0x41554731;  // "AUG1"

std::uint32_t checked_u32(std::uint64_t value, const char* what) {
  if (value > 0xffffffffu) throw InvalidArgument(fmt::format("PhiloxDraws: {} {} is not below 2^32", what, value));
  return static_cast<std::uint32_t>(value);
}

std::uint32_t checked_u32(std::int64_t value, const char* what) {
  if (value < 0) throw InvalidArgument(fmt::format("PhiloxDraws: {} {} is negative", what, value));
  return checked_u32(static_cast<std::uint64_t>(value), what);
}

// Python's round() to an int: half to even, which nearbyint does in the default rounding mode.
double round_half_even(double value) { return std::nearbyint(value); }

// Python's floor division of integers.
int floor_div(int a, int b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }

// One axis of interpolate(mode="bilinear", align_corners=False): for each output index, the two
// source indices and their weights as torch 1.13 computes them (compute_source_index_and_lambda):
// a float32 scale, the source position in double (its `dst + 0.5` is a double), the weight of the
// second tap rounded to float32 and the first 1 minus it in float32. Derived and checked against
// torch's own weights for every in, out < 40 (tests/golden/make_transform_goldens.py's cases).
struct Taps {
  std::vector<int> i0, i1;
  std::vector<float> l0, l1;
};

Taps bilinear_taps(int in, int out, int first, int count) {
  Taps taps;
  taps.i0.resize(count);
  taps.i1.resize(count);
  taps.l0.resize(count);
  taps.l1.resize(count);
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  for (int k = 0; k < count; ++k) {
    const int dst = first + k;
    if (dst < 0 || dst >= out) continue;  // padding: never read
    if (in == out) {
      taps.i0[k] = taps.i1[k] = dst;
      taps.l0[k] = 1.0f;
      taps.l1[k] = 0.0f;
      continue;
    }
    const double src = std::max(static_cast<double>(scale) * (dst + 0.5) - 0.5, 0.0);
    const int i0 = static_cast<int>(src);
    taps.i0[k] = i0;
    taps.i1[k] = i0 + (i0 < in - 1 ? 1 : 0);
    taps.l1[k] = static_cast<float>(std::clamp(src - i0, 0.0, 1.0));
    taps.l0[k] = 1.0f - taps.l1[k];
  }
  return taps;
}

// `source` of `image` (inside it) resized to out_height x out_width, of which only `window` is
// computed (0 where the window leaves the resized image): Resize then CenterCrop without
// resizing what the crop drops. Each output value depends only on its own position and the
// scale, so a window's values are those of the whole.
FloatImage bilinear(const FloatImage& image, const CropBox& source, int out_height, int out_width,
                    const CropBox& window) {
  if (source.top < 0 || source.left < 0 || source.height <= 0 || source.width <= 0 ||
      source.top + source.height > image.height || source.left + source.width > image.width)
    throw InvalidArgument(
        fmt::format("resize: box (top {}, left {}, height {}, width {}) is not inside the {} x {} image", source.top,
                    source.left, source.height, source.width, image.height, image.width));
  if (out_height <= 0 || out_width <= 0 || window.height <= 0 || window.width <= 0)
    throw InvalidArgument(fmt::format("resize: output {} x {} (window {} x {}) is empty", out_height, out_width,
                                      window.height, window.width));
  const Taps rows = bilinear_taps(source.height, out_height, window.top, window.height);
  const Taps cols = bilinear_taps(source.width, out_width, window.left, window.width);
  FloatImage out{image.channels, window.height, window.width, {}};
  out.values.assign(static_cast<std::size_t>(out.channels) * out.height * out.width, 0.0f);
  const std::size_t plane = static_cast<std::size_t>(image.height) * image.width;
  for (int c = 0; c < image.channels; ++c) {
    const float* in =
        image.values.data() + c * plane + static_cast<std::size_t>(source.top) * image.width + source.left;
    float* dst = out.values.data() + static_cast<std::size_t>(c) * out.height * out.width;
    for (int y = 0; y < window.height; ++y) {
      const int oy = window.top + y;
      if (oy < 0 || oy >= out_height) continue;
      const float* row0 = in + static_cast<std::size_t>(rows.i0[y]) * image.width;
      const float* row1 = in + static_cast<std::size_t>(rows.i1[y]) * image.width;
      const float h0 = rows.l0[y], h1 = rows.l1[y];
      for (int x = 0; x < window.width; ++x) {
        const int ox = window.left + x;
        if (ox < 0 || ox >= out_width) continue;
        const int x0 = cols.i0[x], x1 = cols.i1[x];
        const float w0 = cols.l0[x], w1 = cols.l1[x];
        // torch's Interpolate<2> (t0 * w0 + t1 * w1 per axis, height outside), as its AVX2 build
        // runs it: GCC contracts each `a * b + c * d` into fma(a, b, c * d). Written out so that the
        // roundings are torch's whatever this build contracts.
        const float top = std::fma(row0[x0], w0, row0[x1] * w1);
        const float bottom = std::fma(row1[x0], w0, row1[x1] * w1);
        dst[static_cast<std::size_t>(y) * window.width + x] = std::fma(top, h0, bottom * h1);
      }
    }
  }
  return out;
}

void check_size(int size, const char* what) {
  if (size <= 0) throw InvalidArgument(fmt::format("{} must be positive, not {}", what, size));
}

void copy_out(const FloatImage& image, float* out) { std::copy(image.values.begin(), image.values.end(), out); }

}  // namespace

PhiloxDraws::PhiloxDraws(const SampleKey& key, std::uint64_t sample_index)
    : key_{static_cast<std::uint32_t>(key.seed), static_cast<std::uint32_t>(key.seed >> 32) ^ kKeyTag},
      counter_{checked_u32(sample_index, "sample index"), checked_u32(key.epoch, "epoch"),
               checked_u32(key.rank, "rank")} {}

std::uint32_t PhiloxDraws::next_word() {
  if (used_ == 4) {
    const r123::Philox4x32::ctr_type counter = {{block_++, counter_[0], counter_[1], counter_[2]}};
    const r123::Philox4x32::key_type key = {{key_[0], key_[1]}};
    const r123::Philox4x32::ctr_type words = r123::Philox4x32()(counter, key);
    for (int i = 0; i < 4; ++i) words_[i] = words.v[i];
    used_ = 0;
  }
  return words_[used_++];
}

float PhiloxDraws::uniform(double low, double high) {
  // torch's uniform_real for float: 24 random bits, x * (to - from) + from in float32.
  const float from = static_cast<float>(low), to = static_cast<float>(high);
  const float x = static_cast<float>(next_word() & 0xffffffu) * (1.0f / 16777216.0f);
  return x * (to - from) + from;
}

std::int64_t PhiloxDraws::randint(std::int64_t low, std::int64_t high) {
  if (high <= low || high - low > 0xffffffffll)
    throw InvalidArgument(fmt::format("randint: range [{}, {}) is empty or wider than 2^32", low, high));
  return low + static_cast<std::int64_t>(next_word() % static_cast<std::uint32_t>(high - low));
}

CropBox random_resized_crop_box(int height, int width, Draws& draws, const RandomResizedCropOptions& options) {
  if (height <= 0 || width <= 0)
    throw InvalidArgument(fmt::format("RandomResizedCrop: empty image ({} x {})", height, width));
  if (!(options.scale_min <= options.scale_max) || !(options.ratio_min <= options.ratio_max) ||
      !(options.ratio_min > 0))
    throw InvalidArgument(
        fmt::format("RandomResizedCrop: scale ({}, {}) and ratio ({}, {}) must be (min, max) pairs, "
                    "the ratios positive",
                    options.scale_min, options.scale_max, options.ratio_min, options.ratio_max));
  const double area = static_cast<double>(height) * width;
  // torch.log(torch.tensor(ratio)): float32 logs of the float32 ratios.
  const float log_min = std::log(static_cast<float>(options.ratio_min));
  const float log_max = std::log(static_cast<float>(options.ratio_max));
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * draws.uniform(options.scale_min, options.scale_max);
    // torch.exp of a float32 tensor: the float32 nearest to e^u.
    const double aspect = static_cast<float>(std::exp(static_cast<double>(draws.uniform(log_min, log_max))));
    const double w = round_half_even(std::sqrt(target_area * aspect));
    const double h = round_half_even(std::sqrt(target_area / aspect));
    if (0 < w && w <= width && 0 < h && h <= height) {
      CropBox box;
      box.height = static_cast<int>(h);
      box.width = static_cast<int>(w);
      box.top = static_cast<int>(draws.randint(0, height - box.height + 1));
      box.left = static_cast<int>(draws.randint(0, width - box.width + 1));
      return box;
    }
  }
  // No attempt fitted: the central crop, the whole image clamped to the ratio range.
  const double in_ratio = static_cast<double>(width) / static_cast<double>(height);
  CropBox box{0, 0, height, width};
  if (in_ratio < options.ratio_min)
    box.height = static_cast<int>(round_half_even(width / options.ratio_min));
  else if (in_ratio > options.ratio_max)
    box.width = static_cast<int>(round_half_even(height * options.ratio_max));
  box.top = floor_div(height - box.height, 2);
  box.left = floor_div(width - box.width, 2);
  return box;
}

bool random_horizontal_flip(Draws& draws, double p) { return draws.uniform(0.0, 1.0) < p; }

FloatImage to_tensor(const Image& image) { return to_tensor(image, CropBox{0, 0, image.height, image.width}); }

FloatImage to_tensor(const Image& image, const CropBox& box) {
  if (box.top < 0 || box.left < 0 || box.height <= 0 || box.width <= 0 || box.top + box.height > image.height ||
      box.left + box.width > image.width)
    throw InvalidArgument(
        fmt::format("to_tensor: box (top {}, left {}, height {}, width {}) is not inside the {} x {} image", box.top,
                    box.left, box.height, box.width, image.height, image.width));
  FloatImage out{3, box.height, box.width, {}};
  const std::size_t plane = static_cast<std::size_t>(box.height) * box.width;
  out.values.resize(3 * plane);
  for (int y = 0; y < box.height; ++y) {
    const std::uint8_t* in = image.rgb.data() + (static_cast<std::size_t>(box.top + y) * image.width + box.left) * 3;
    for (int x = 0; x < box.width; ++x)
      for (int c = 0; c < 3; ++c)
        out.values[c * plane + static_cast<std::size_t>(y) * box.width + x] =
            static_cast<float>(in[3 * x + c]) / 255.0f;
  }
  return out;
}

FloatImage resized_crop(const FloatImage& image, const CropBox& box, int out_height, int out_width) {
  return bilinear(image, box, out_height, out_width, CropBox{0, 0, out_height, out_width});
}

FloatImage resize(const FloatImage& image, int out_height, int out_width) {
  return resized_crop(image, CropBox{0, 0, image.height, image.width}, out_height, out_width);
}

Size resized_output_size(int height, int width, int size) {
  check_size(size, "Resize: the size");
  check_size(height, "Resize: the image height");
  check_size(width, "Resize: the image width");
  const int shorter = std::min(height, width), longer = std::max(height, width);
  // Python: int(size * long / short), an exact product divided in double, truncated.
  const double new_long = std::trunc(static_cast<double>(std::int64_t{size} * longer) / shorter);
  if (new_long > std::numeric_limits<int>::max())
    throw InvalidArgument(
        fmt::format("Resize({}) of a {} x {} image: the longer side would be {}", size, height, width, new_long));
  const int resized_long = static_cast<int>(new_long);
  return width <= height ? Size{resized_long, size} : Size{size, resized_long};
}

CropBox center_crop_box(int height, int width, int crop_height, int crop_width) {
  check_size(crop_height, "CenterCrop: the crop height");
  check_size(crop_width, "CenterCrop: the crop width");
  const auto start = [](int image, int crop) {
    return crop > image ? -((crop - image) / 2) : static_cast<int>(round_half_even((image - crop) / 2.0));
  };
  return CropBox{start(height, crop_height), start(width, crop_width), crop_height, crop_width};
}

FloatImage crop(const FloatImage& image, const CropBox& box) {
  check_size(box.height, "crop: the height");
  check_size(box.width, "crop: the width");
  FloatImage out{image.channels, box.height, box.width, {}};
  out.values.assign(static_cast<std::size_t>(out.channels) * box.height * box.width, 0.0f);
  for (int c = 0; c < image.channels; ++c)
    for (int y = 0; y < box.height; ++y) {
      const int sy = box.top + y;
      if (sy < 0 || sy >= image.height) continue;
      for (int x = 0; x < box.width; ++x) {
        const int sx = box.left + x;
        if (sx < 0 || sx >= image.width) continue;
        out.values[(static_cast<std::size_t>(c) * box.height + y) * box.width + x] =
            image.values[(static_cast<std::size_t>(c) * image.height + sy) * image.width + sx];
      }
    }
  return out;
}

void horizontal_flip(FloatImage& image) {
  for (int c = 0; c < image.channels; ++c)
    for (int y = 0; y < image.height; ++y) {
      float* row = image.values.data() + (static_cast<std::size_t>(c) * image.height + y) * image.width;
      std::reverse(row, row + image.width);
    }
}

void normalize(FloatImage& image, std::span<const float> mean, std::span<const float> std) {
  if (mean.size() != static_cast<std::size_t>(image.channels) || std.size() != mean.size())
    throw InvalidArgument(
        fmt::format("Normalize: {} means and {} stds for {} channels", mean.size(), std.size(), image.channels));
  const std::size_t plane = static_cast<std::size_t>(image.height) * image.width;
  for (int c = 0; c < image.channels; ++c) {
    if (std[c] == 0.0f) throw InvalidArgument(fmt::format("Normalize: std of channel {} is 0", c));
    float* values = image.values.data() + c * plane;
    // torch: tensor.sub_(mean).div_(std), two float32 roundings.
    for (std::size_t i = 0; i < plane; ++i) values[i] = (values[i] - mean[c]) / std[c];
  }
}

void train_transform(const Image& image, int size, const RandomResizedCropOptions& crop, double flip_probability,
                     const Normalization& normalization, Draws& draws, float* out) {
  check_size(size, "RandomResizedCrop: the size");
  const CropBox box = random_resized_crop_box(image.height, image.width, draws, crop);
  const bool flip = random_horizontal_flip(draws, flip_probability);
  // Only the crop is converted: ToTensor is per pixel, so converting first and cropping after
  // gives the same values.
  const FloatImage part = to_tensor(image, box);
  FloatImage sample = resize(part, size, size);
  if (flip) horizontal_flip(sample);
  normalize(sample, normalization.mean, normalization.std);
  copy_out(sample, out);
}

void eval_transform(const Image& image, int resize_size, int size, const Normalization& normalization, float* out) {
  const Size resized = resized_output_size(image.height, image.width, resize_size);
  const CropBox window = center_crop_box(resized.height, resized.width, size, size);
  FloatImage sample =
      bilinear(to_tensor(image), CropBox{0, 0, image.height, image.width}, resized.height, resized.width, window);
  normalize(sample, normalization.mean, normalization.std);
  copy_out(sample, out);
}

}  // namespace dp::transforms
