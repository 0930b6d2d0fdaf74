// dp/io/transforms.h — torchvision 0.14's image transforms on float CHW images (ToTensor first):
// RandomResizedCrop, RandomHorizontalFlip, Resize, CenterCrop and Normalize, with the random draws
// taken from a keyed Philox generator instead of torch's global one.
//
// Where this differs from a torchvision pipeline on PIL images (the usual ImageNet recipe
// `RandomResizedCrop(224)`, `ToTensor()`, ... applied to what pil_loader returns): dp follows
// torchvision's *tensor* path, F.resized_crop / F.resize with antialias=False, i.e.
// torch.nn.functional.interpolate(mode="bilinear", align_corners=False) on float32. PIL's resize
// instead (1) antialiases when downscaling, its bilinear filter widened by the scale factor so
// every source pixel contributes, where interpolate reads only the 2x2 nearest pixels, and (2)
// works on uint8 and rounds each result to a whole 1/255. Upscaling agrees up to that rounding;
// downscaling by more than 2x differs visibly (aliasing here). torchvision documents the same
// difference ("the interpolation of PIL images and tensors is slightly different").
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "dp/io/image.h"
#include "dp/io/sample_source.h"

namespace dp::transforms {

// A float image, (channels, height, width) row-major: ToTensor's layout.
struct FloatImage {
  int channels = 0, height = 0, width = 0;
  std::vector<float> values;  // (channels, height, width)
};

// A rectangle in image coordinates, as torchvision's (top, left, height, width). It may reach
// outside the image (CenterCrop of a smaller image): what lies outside reads as 0.
struct CropBox {
  int top = 0, left = 0, height = 0, width = 0;
  bool operator==(const CropBox&) const = default;
};

struct Size {
  int height = 0, width = 0;
  bool operator==(const Size&) const = default;
};

// The random numbers a transform draws, in the order torchvision draws them. An interface so that
// tests can replay the values torch drew.
class Draws {
 public:
  virtual ~Draws() = default;
  // torch.empty(1).uniform_(low, high).item(): a float32 in [float(low), float(high)).
  virtual float uniform(double low, double high) = 0;
  // torch.randint(low, high, (1,)).item(): an integer in [low, high).
  virtual std::int64_t randint(std::int64_t low, std::int64_t high) = 0;
};

// Draws of one sample: 32-bit words of Philox4x32-10 (Random123) at counter {n / 4, sample index,
// epoch, rank} under key {seed, tagged}, word n % 4 for the n-th draw. A pure function of
// (seed, rank, epoch, sample index), the same on every thread and every machine, and different for
// each rank, epoch and sample. The key's high word is tagged so that these words are not those of
// dropout's masks (dp/kernels/dropout.h) under the same seed. torch draws its words otherwise (a
// Mersenne twister): the algorithm is torchvision's, the numbers are not torch's.
// uniform: (word & 0xffffff) * 2^-24 scaled to [low, high) in float32, as torch scales its words;
// randint: low + word % (high - low), as torch (ranges < 2^32). Sample index, epoch and rank must
// lie in [0, 2^32): InvalidArgument otherwise.
class PhiloxDraws final : public Draws {
 public:
  PhiloxDraws(const SampleKey& key, std::uint64_t sample_index);
  float uniform(double low, double high) override;
  std::int64_t randint(std::int64_t low, std::int64_t high) override;

 private:
  std::uint32_t next_word();
  std::array<std::uint32_t, 2> key_{};
  std::array<std::uint32_t, 3> counter_{};  // sample index, epoch, rank
  std::array<std::uint32_t, 4> words_{};
  std::uint32_t block_ = 0;
  int used_ = 4;  // words of the current block already drawn
};

// RandomResizedCrop's scale and ratio (torchvision's defaults); each pair is (min, max).
struct RandomResizedCropOptions {
  double scale_min = 0.08, scale_max = 1.0;
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;
};

// torchvision 0.14's RandomResizedCrop.get_params on an image of `height` x `width`: up to 10
// attempts, each drawing target_area = H*W * uniform(scale) and aspect = exp(uniform(log ratio))
// (the log of float32 ratios, in float32, as torch.log(torch.tensor(ratio))), w = round(sqrt(
// area * aspect)), h = round(sqrt(area / aspect)) with Python's round (half to even); the first that
// fits draws top = randint(0, H - h + 1), left = randint(0, W - w + 1). When none fits, the central
// crop of the whole image clamped to the ratio range. InvalidArgument for an empty image, a scale
// or ratio pair out of order, or a ratio <= 0.
CropBox random_resized_crop_box(int height, int width, Draws& draws, const RandomResizedCropOptions& options = {});

// RandomHorizontalFlip(p): whether to flip, torch.rand(1) < p (one uniform draw).
bool random_horizontal_flip(Draws& draws, double p = 0.5);

// ToTensor: value / 255 in float32, HWC uint8 -> CHW float; `box` (inside the image) converts only
// that part, the same values as converting everything and cropping after.
FloatImage to_tensor(const Image& image);
FloatImage to_tensor(const Image& image, const CropBox& box);

// F.resized_crop(image, top, left, height, width, [out_height, out_width], BILINEAR,
// antialias=False): the box (inside the image) resized as interpolate(mode="bilinear",
// align_corners=False) does on float32 CPU tensors in torch 1.13: per output row and column,
// scale = float32(in / out), src = max(scale * (dst + 0.5) - 0.5, 0) in double, i0 = int(src),
// i1 = min(i0 + 1, in - 1), l1 = float32(src - i0), l0 = 1 - l1 (1 and 0 when in == out), and
// row(i) = fma(x[i][i0x], l0x, x[i][i1x] * l1x), out = fma(row(i0y), l0y, row(i1y) * l1y): the
// fused multiply-adds of torch's AVX2 kernels, which every x86-64 machine of the last decade runs.
// Bit for bit torch's values (tests/io/test_images.cpp); torch's kernel without AVX2 rounds without
// fusing and differs from these by a few ulp.
FloatImage resized_crop(const FloatImage& image, const CropBox& box, int out_height, int out_width);
// F.resize to (out_height, out_width), antialias=False: resized_crop of the whole image.
FloatImage resize(const FloatImage& image, int out_height, int out_width);

// Resize(size) with one int: the size torchvision's _compute_resized_output_size gives, the shorter
// side to `size` and the longer to int(size * long / short) (truncated; a square stays square).
Size resized_output_size(int height, int width, int size);

// CenterCrop((crop_height, crop_width)) of a height x width image: top = int(round((H - h) / 2.0))
// (half to even), left likewise; a crop larger than the image is first padded with zeros, (d // 2)
// before and the rest after, so its box starts at -(d // 2). `crop` copies any box, 0 outside.
CropBox center_crop_box(int height, int width, int crop_height, int crop_width);
FloatImage crop(const FloatImage& image, const CropBox& box);

// F.hflip: columns reversed.
void horizontal_flip(FloatImage& image);

// Normalize(mean, std): (x - mean[c]) / std[c] in float32, one value per channel.
void normalize(FloatImage& image, std::span<const float> mean, std::span<const float> std);

// Per-channel statistics of Normalize (ImageNet's, as torchvision's reference scripts use them).
struct Normalization {
  std::array<float, 3> mean = {0.485f, 0.456f, 0.406f};
  std::array<float, 3> std = {0.229f, 0.224f, 0.225f};
};

// The training pipeline of torchvision's ImageNet recipe, on tensors: ToTensor,
// RandomResizedCrop(size, crop), RandomHorizontalFlip(flip_probability), Normalize — the crop's
// draws first, then the flip's. Writes 3 x size x size floats to `out`.
void train_transform(const Image& image, int size, const RandomResizedCropOptions& crop, double flip_probability,
                     const Normalization& normalization, Draws& draws, float* out);

// The evaluation pipeline, on tensors: ToTensor, Resize(resize_size, antialias=False),
// CenterCrop(size), Normalize. Only the centre size x size window of the resized image is computed (its values
// are those of resizing everything). Writes 3 x size x size floats to `out`.
void eval_transform(const Image& image, int resize_size, int size, const Normalization& normalization, float* out);

}  // namespace dp::transforms
