// test_images.cpp — PNG/JPEG decoding against PIL's convert("RGB") (tests/data/images, written by
// make_images.py), refusals of bad files, torchvision's transforms against its own outputs
// (tests/golden/transforms.safetensors, written by make_transform_goldens.py), the keyed draws, and
// ImageFolder's listing (against torchvision's where Debian's python3-torchvision is installed).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>
#include <vector>

#include "dp/io/image.h"
#include "dp/io/image_folder.h"
#include "dp/io/safetensors.h"
#include "dp/io/transforms.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
namespace tf = transforms;

std::string fixture(const std::string& name) { return std::string(DP_TEST_IMAGES_DIR) + "/" + name; }

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const void* data, std::size_t size) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}

using dp::test::TempDir;

// The message of the dp::Error `f` throws ("" and a failure when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no dp::Error thrown";
  return "";
}

// ------------------------------------------------------------------------------------------------
// decoding

TEST(ImageDecode, EveryFixtureMatchesPilConvertRgb) {
  const auto expected = safetensors::read(fixture("expected.safetensors"));
  ASSERT_GE(expected.order.size(), 18u);
  for (const std::string& name : expected.order) {
    const auto& want = expected.at(name);
    ASSERT_EQ(want.shape.size(), 3u);
    const Image image = read_image(fixture(name));
    EXPECT_EQ(image.height, want.shape[0]) << name;
    EXPECT_EQ(image.width, want.shape[1]) << name;
    ASSERT_EQ(image.rgb.size(), want.data.size()) << name;
    const auto* want_bytes = reinterpret_cast<const std::uint8_t*>(want.data.data());
    const auto mismatch = std::mismatch(image.rgb.begin(), image.rgb.end(), want_bytes);
    EXPECT_TRUE(mismatch.first == image.rgb.end())
        << name << ": first differing byte " << (mismatch.first - image.rgb.begin()) << ": dp " << int(*mismatch.first)
        << ", PIL " << int(*mismatch.second);
    // The in-memory entry point decodes the same bytes to the same pixels.
    const auto bytes = read_bytes(fixture(name));
    EXPECT_EQ(decode_image(bytes.data(), bytes.size(), name).rgb, image.rgb) << name;
  }
}

TEST(ImageDecode, ConversionsPilMakes) {
  // make_images.py puts 0 and the top value at pixels (0, 0) and (0, 1) of every pattern.
  for (const char* name : {"rgb.png", "grey.png", "grey_4bit.png", "grey_2bit.png", "rgba.png", "grey_alpha.png",
                           "rgb16.png", "rgba16.png", "grey_alpha16.png"}) {
    const Image image = read_image(fixture(name));
    EXPECT_EQ(std::vector<std::uint8_t>(image.rgb.begin(), image.rgb.begin() + 6),
              (std::vector<std::uint8_t>{0, 0, 0, 255, 255, 255}))
        << name;
  }
  // Grey: one value in all three channels.
  const Image grey = read_image(fixture("grey.png"));
  for (std::size_t p = 0; p < grey.rgb.size(); p += 3) {
    EXPECT_EQ(grey.rgb[p], grey.rgb[p + 1]);
    EXPECT_EQ(grey.rgb[p], grey.rgb[p + 2]);
  }
  // 16-bit grey is clamped (PIL's mode "I"), not cut to its high byte: 0x0080 0x00ff 0x0100 0x7f00.
  const Image grey16 = read_image(fixture("grey16.png"));
  const std::size_t row1 = 3 * static_cast<std::size_t>(grey16.width);
  EXPECT_EQ(grey16.rgb[row1 + 0], 128);
  EXPECT_EQ(grey16.rgb[row1 + 3], 255);
  EXPECT_EQ(grey16.rgb[row1 + 6], 255);
  EXPECT_EQ(grey16.rgb[row1 + 9], 255);
  // A palette is looked up, its transparency dropped: every pixel one of the four colours.
  const std::vector<std::array<std::uint8_t, 3>> colours = {
      {10, 20, 30}, {200, 100, 0}, {0, 255, 128}, {255, 255, 255}};
  for (const char* name : {"palette.png", "palette_trns.png"}) {
    const Image image = read_image(fixture(name));
    for (std::size_t p = 0; p < image.rgb.size(); p += 3)
      EXPECT_NE(std::find(colours.begin(), colours.end(),
                          std::array<std::uint8_t, 3>{image.rgb[p], image.rgb[p + 1], image.rgb[p + 2]}),
                colours.end())
          << name << " pixel " << p / 3;
  }
  // Interlaced (Adam7) decodes to the same layout as any PNG.
  const Image interlaced = read_image(fixture("interlaced.png"));
  EXPECT_EQ(interlaced.width, 7);
  EXPECT_EQ(interlaced.height, 6);
}

TEST(ImageDecode, BadFilesThrowNamingTheFile) {
  TempDir dir("bad");
  const auto png = read_bytes(fixture("rgb.png"));
  const auto jpeg = read_bytes(fixture("rgb.jpg"));
  const auto write = [&](const std::string& name, const void* data, std::size_t size) {
    write_bytes(dir / name, data, size);
    return (dir / name).string();
  };
  auto corrupt_png = png;
  corrupt_png[29] ^= 0xff;  // IHDR's CRC
  const std::string text = "this is not a picture\n";
  const std::string gif = "GIF89a\x01\x00\x01\x00";
  const struct {
    std::string path;
    const char* says;
  } cases[] = {
      {write("truncated.png", png.data(), png.size() / 2), "truncated PNG"},
      {write("truncated.jpg", jpeg.data(), jpeg.size() / 2), "truncated JPEG"},
      {write("header_only.jpg", jpeg.data(), 200), "truncated JPEG"},
      {write("signature_only.png", png.data(), 8), "truncated PNG"},
      {write("text.png", text.data(), text.size()), "not an image"},
      {write("zero.jpg", "", 0), "empty"},
      {write("animation.png", gif.data(), gif.size()), "a GIF image"},
      {write("crc.png", corrupt_png.data(), corrupt_png.size()), "corrupt PNG"},
      {(dir / "missing.png").string(), "no such file"},
      {dir.path().string(), "not a regular file"},
      {fixture("bomb.png"), "100000 x 100000 = 10000000000 pixels, over the limit of 178956970"},
      {fixture("bomb.jpg"), "65000 x 65000 = 4225000000 pixels, over the limit of 178956970"},
  };
  for (const auto& c : cases) {
    const std::string message = error_of([&] { read_image(c.path); });
    EXPECT_NE(message.find(c.path), std::string::npos) << "names the file: " << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << message;
  }
}

TEST(ImageDecode, PixelLimitIsCheckedFromTheHeader) {
  // rgb.png is 7 x 6 = 42 pixels: 42 is allowed, 41 is not (PIL refuses "more than").
  EXPECT_EQ(read_image(fixture("rgb.png"), 42).width, 7);
  EXPECT_NE(error_of([] { read_image(fixture("rgb.png"), 41); }).find("over the limit of 41"), std::string::npos);
  EXPECT_NE(error_of([] { read_image(fixture("rgb.jpg"), 383); }).find("24 x 16 = 384 pixels"), std::string::npos);
}

// ------------------------------------------------------------------------------------------------
// transforms against torchvision

const safetensors::File& transform_golden() {
  static const safetensors::File golden = safetensors::read(test::golden_path("transforms"));
  return golden;
}

tf::FloatImage golden_image(const std::string& name) {
  const auto& tensor = transform_golden().at(name + ".float");
  return {static_cast<int>(tensor.shape[0]), static_cast<int>(tensor.shape[1]), static_cast<int>(tensor.shape[2]),
          tensor.to_f32()};
}

Image golden_pixels(const std::string& name) {
  const auto& tensor = transform_golden().at(name + ".u8");
  Image image;
  image.height = static_cast<int>(tensor.shape[0]);
  image.width = static_cast<int>(tensor.shape[1]);
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(tensor.data.data());
  image.rgb.assign(bytes, bytes + tensor.data.size());
  return image;
}

// Bilinear interpolation: dp computes torch's weights (double source positions rounded to float32)
// and torch's fused multiply-adds in torch's order, so every value is torch's to the bit. The
// tolerance is 0 on purpose: the first version, unfused float32 weights and sums, was off by up to
// 6e-7 (10 ulp) in a quarter of the values, which only an exact comparison shows.
constexpr float kBilinearTolerance = 0.0f;

void expect_close(const std::vector<float>& got, const std::vector<float>& want, float tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::size_t wrong = 0, first = 0;
  float worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float diff = std::fabs(got[i] - want[i]);
    if (!(diff <= tolerance) && wrong++ == 0) first = i;
    worst = std::max(worst, diff);
  }
  EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " of " << got.size() << " values differ by more than " << tolerance
                       << " (worst " << worst << "); first at " << first << ": dp " << got[first] << ", torch "
                       << want[first];
}

// Hands out the values torch drew, in order, checking each lies in the range asked for.
class ReplayDraws final : public tf::Draws {
 public:
  ReplayDraws(std::vector<float> uniforms, std::vector<std::int64_t> randints)
      : uniforms_(std::move(uniforms)), randints_(std::move(randints)) {}
  float uniform(double low, double high) override {
    if (next_uniform_ >= uniforms_.size()) throw std::runtime_error("more uniform draws than torch made");
    const float value = uniforms_[next_uniform_++];
    EXPECT_TRUE(value >= static_cast<float>(low) && value <= static_cast<float>(high)) << value;
    return value;
  }
  std::int64_t randint(std::int64_t low, std::int64_t high) override {
    if (next_randint_ >= randints_.size()) throw std::runtime_error("more randint draws than torch made");
    const std::int64_t value = randints_[next_randint_++];
    EXPECT_TRUE(value >= low && value < high) << value << " not in [" << low << ", " << high << ")";
    return value;
  }
  bool all_used() const { return next_uniform_ == uniforms_.size() && next_randint_ == randints_.size(); }

 private:
  std::vector<float> uniforms_;
  std::vector<std::int64_t> randints_;
  std::size_t next_uniform_ = 0, next_randint_ = 0;
};

TEST(Transforms, ToTensorIsTorchvisions) {
  for (const char* name : {"image", "tall"})
    EXPECT_EQ(tf::to_tensor(golden_pixels(name)).values, golden_image(name).values) << name;
  // A part converts to the same values as the whole cropped.
  const Image pixels = golden_pixels("image");
  const tf::CropBox box{3, 5, 10, 20};
  EXPECT_EQ(tf::to_tensor(pixels, box).values, tf::crop(tf::to_tensor(pixels), box).values);
}

TEST(Transforms, LogRatioIsTorchsFloat32Log) {
  const auto want = transform_golden().at("log_ratio").to_f32();
  EXPECT_EQ(std::log(static_cast<float>(3.0 / 4.0)), want[0]);
  EXPECT_EQ(std::log(static_cast<float>(4.0 / 3.0)), want[1]);
}

TEST(Transforms, RandomResizedCropBoxesAreTorchvisions) {
  const auto& golden = transform_golden();
  int cases = 0, fallbacks = 0;
  for (int k = 0; golden.has(fmt::format("crop{}.box", k)); ++k, ++cases) {
    const std::string name = fmt::format("crop{}", k);
    const json params = json::parse(golden.metadata.at(name));
    tf::RandomResizedCropOptions options;
    options.scale_min = params["scale"][0];
    options.scale_max = params["scale"][1];
    options.ratio_min = params["ratio"][0];
    options.ratio_max = params["ratio"][1];
    // No randints: no attempt fitted, the box is the fallback's.
    const bool fallback = !golden.has(name + ".randints");
    ReplayDraws draws(golden.at(name + ".uniforms").to_f32(),
                      fallback ? std::vector<std::int64_t>{} : golden.at(name + ".randints").to_i64());
    fallbacks += fallback;
    const tf::CropBox box = tf::random_resized_crop_box(params["height"], params["width"], draws, options);
    const auto want = golden.at(name + ".box").to_i64();
    EXPECT_EQ((std::vector<std::int64_t>{box.top, box.left, box.height, box.width}), want) << name << " " << params;
    EXPECT_TRUE(draws.all_used()) << name << ": dp drew fewer values than torch";
  }
  EXPECT_GE(cases, 80);
  EXPECT_GE(fallbacks, 8) << "the fallback's branches are covered";
}

TEST(Transforms, ResizedCropIsInterpolateBilinear) {
  const auto& golden = transform_golden();
  int cases = 0;
  for (int k = 0; golden.has(fmt::format("resized{}.out", k)); ++k, ++cases) {
    const std::string name = fmt::format("resized{}", k);
    const json params = json::parse(golden.metadata.at(name));
    const tf::CropBox box{params["box"][0], params["box"][1], params["box"][2], params["box"][3]};
    const tf::FloatImage out =
        tf::resized_crop(golden_image(params["image"]), box, params["size"][0], params["size"][1]);
    EXPECT_EQ(out.channels, 3);
    EXPECT_EQ(out.height, params["size"][0].get<int>());
    EXPECT_EQ(out.width, params["size"][1].get<int>());
    expect_close(out.values, golden.at(name + ".out").to_f32(), kBilinearTolerance, name + " " + params.dump());
  }
  EXPECT_GE(cases, 8);
}

TEST(Transforms, HorizontalFlipAndNormalizeAreExact) {
  tf::FloatImage image = golden_image("image");
  tf::horizontal_flip(image);
  EXPECT_EQ(image.values, transform_golden().at("hflip").to_f32());

  image = golden_image("image");
  const json params = json::parse(transform_golden().metadata.at("normalize"));
  const std::vector<float> mean = params["mean"].get<std::vector<float>>(),
                           std = params["std"].get<std::vector<float>>();
  tf::normalize(image, mean, std);
  EXPECT_EQ(image.values, transform_golden().at("normalize").to_f32());
  // The defaults are the same ImageNet statistics.
  const tf::Normalization imagenet;
  EXPECT_EQ(std::vector<float>(imagenet.mean.begin(), imagenet.mean.end()), mean);
  EXPECT_EQ(std::vector<float>(imagenet.std.begin(), imagenet.std.end()), std);
}

TEST(Transforms, ResizeThenCenterCropIsTorchvisions) {
  const auto& golden = transform_golden();
  int cases = 0;
  for (int k = 0; golden.has(fmt::format("eval{}.out", k)); ++k, ++cases) {
    const std::string name = fmt::format("eval{}", k);
    const json params = json::parse(golden.metadata.at(name));
    const int resize = params["resize"], crop = params["crop"];
    const tf::FloatImage image = golden_image(params["image"]);
    const tf::Size size = tf::resized_output_size(image.height, image.width, resize);
    EXPECT_EQ((std::vector<std::int64_t>{size.height, size.width}), golden.at(name + ".resized").to_i64()) << name;
    const auto want = golden.at(name + ".out").to_f32();
    // Step by step, as torchvision runs it...
    const tf::FloatImage resized = tf::resize(image, size.height, size.width);
    const tf::FloatImage cropped = tf::crop(resized, tf::center_crop_box(size.height, size.width, crop, crop));
    expect_close(cropped.values, want, kBilinearTolerance, name + " " + params.dump());
    // ...and fused (only the window is resized); Normalize with mean 0 and std 1 keeps every value.
    std::vector<float> fused(want.size());
    tf::Normalization identity;
    identity.mean = {0, 0, 0};
    identity.std = {1, 1, 1};
    tf::eval_transform(golden_pixels(params["image"]), resize, crop, identity, fused.data());
    EXPECT_EQ(fused, cropped.values) << name;
  }
  EXPECT_GE(cases, 8);
}

TEST(Transforms, TrainPipelineIsTorchvisionsCompose) {
  // Compose([ToTensor(), RandomResizedCrop(size), RandomHorizontalFlip(), Normalize()]) with
  // torch's draws: the crop's first, then the flip's.
  const auto& golden = transform_golden();
  int cases = 0, flips = 0;
  for (int k = 0; golden.has(fmt::format("train{}.out", k)); ++k, ++cases) {
    const std::string name = fmt::format("train{}", k);
    const json params = json::parse(golden.metadata.at(name));
    const auto drawn = golden.at(name + ".uniforms").to_f32();
    flips += drawn.back() < 0.5f;
    ReplayDraws draws(drawn, golden.at(name + ".randints").to_i64());
    tf::Normalization normalization;
    for (int c = 0; c < 3; ++c) {
      normalization.mean[c] = params["mean"][c];
      normalization.std[c] = params["std"][c];
    }
    const int size = params["size"];
    std::vector<float> out(3u * size * size);
    tf::train_transform(golden_pixels(params["image"]), size, {}, 0.5, normalization, draws, out.data());
    EXPECT_TRUE(draws.all_used()) << name;
    expect_close(out, golden.at(name + ".out").to_f32(), kBilinearTolerance, name + " " + params.dump());
  }
  EXPECT_GE(cases, 10);
  EXPECT_GT(flips, 0);
  EXPECT_LT(flips, cases);
}

TEST(Transforms, OutputSizeAndCentreCropArithmetic) {
  // int(size * long / short) truncates; a square stays square.
  EXPECT_EQ(tf::resized_output_size(375, 500, 256), (tf::Size{256, 341}));  // 341.33
  EXPECT_EQ(tf::resized_output_size(500, 375, 256), (tf::Size{341, 256}));
  EXPECT_EQ(tf::resized_output_size(100, 100, 7), (tf::Size{7, 7}));
  EXPECT_EQ(tf::resized_output_size(3, 1000, 256), (tf::Size{256, 85333}));
  // round((H - S) / 2.0) is half to even: 1.5 -> 2, 2.5 -> 2.
  EXPECT_EQ(tf::center_crop_box(27, 27, 24, 24), (tf::CropBox{2, 2, 24, 24}));
  EXPECT_EQ(tf::center_crop_box(29, 30, 24, 24), (tf::CropBox{2, 3, 24, 24}));
  // Larger than the image: padded, (d // 2) before.
  EXPECT_EQ(tf::center_crop_box(20, 30, 25, 24), (tf::CropBox{-2, 3, 25, 24}));
}

TEST(Transforms, FlipDrawIsRandLessThanP) {
  ReplayDraws draws({0.3f, 0.7f, 0.5f}, {});
  EXPECT_TRUE(tf::random_horizontal_flip(draws));
  EXPECT_FALSE(tf::random_horizontal_flip(draws));
  EXPECT_FALSE(tf::random_horizontal_flip(draws)) << "0.5 < 0.5 is false";
}

TEST(Transforms, BadArgumentsAreRefused) {
  ReplayDraws draws({}, {});
  tf::RandomResizedCropOptions reversed;
  reversed.scale_min = 1.0;
  reversed.scale_max = 0.5;
  EXPECT_THROW(tf::random_resized_crop_box(10, 10, draws, reversed), InvalidArgument);
  EXPECT_THROW(tf::random_resized_crop_box(0, 10, draws), InvalidArgument);
  EXPECT_THROW(tf::resized_output_size(10, 10, 0), InvalidArgument);
  tf::FloatImage image = golden_image("image");
  EXPECT_THROW(tf::resized_crop(image, tf::CropBox{30, 0, 10, 10}, 4, 4), InvalidArgument);
  const std::vector<float> two = {0.5f, 0.5f};
  EXPECT_THROW(tf::normalize(image, two, two), InvalidArgument);
}

// ------------------------------------------------------------------------------------------------
// keyed draws

std::vector<float> uniforms(tf::Draws& draws, int n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& u : out) u = draws.uniform(0.0, 1.0);
  return out;
}

TEST(PhiloxDraws, APureFunctionOfSeedRankEpochAndSample) {
  const SampleKey key{7, 1, 3};
  tf::PhiloxDraws a(key, 42), b(key, 42);
  EXPECT_EQ(uniforms(a, 11), uniforms(b, 11)) << "same key and sample: same draws";
  for (const auto& [other, index] : {std::pair{SampleKey{8, 1, 3}, 42}, std::pair{SampleKey{7, 2, 3}, 42},
                                     std::pair{SampleKey{7, 1, 4}, 42}, std::pair{key, 43}}) {
    tf::PhiloxDraws c(key, 42), d(other, static_cast<std::uint64_t>(index));
    EXPECT_NE(uniforms(c, 4), uniforms(d, 4))
        << "seed " << other.seed << " rank " << other.rank << " epoch " << other.epoch << " sample " << index;
  }
  EXPECT_THROW(tf::PhiloxDraws(SampleKey{0, -1, 0}, 0), InvalidArgument);
  EXPECT_THROW(tf::PhiloxDraws(SampleKey{0, 0, 0}, std::uint64_t{1} << 32), InvalidArgument);
}

TEST(PhiloxDraws, UniformAndRandintStayInRange) {
  tf::PhiloxDraws draws(SampleKey{1, 0, 0}, 0);
  double sum = 0;
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    const float u = draws.uniform(-0.25, 0.75);
    ASSERT_TRUE(u >= -0.25f && u < 0.75f) << u;
    sum += u;
    const std::int64_t r = draws.randint(3, 10);
    ASSERT_TRUE(r >= 3 && r < 10) << r;
  }
  EXPECT_NEAR(sum / kDraws, 0.25, 0.01);
}

TEST(PhiloxDraws, CropsDifferAcrossRanksAndRepeatForTheSameKey) {
  int differing = 0;
  for (std::uint64_t sample = 0; sample < 16; ++sample) {
    tf::PhiloxDraws rank0(SampleKey{5, 0, 0}, sample), again(SampleKey{5, 0, 0}, sample),
        rank1(SampleKey{5, 1, 0}, sample);
    const tf::CropBox box = tf::random_resized_crop_box(375, 500, rank0);
    EXPECT_EQ(box, tf::random_resized_crop_box(375, 500, again));
    differing += !(box == tf::random_resized_crop_box(375, 500, rank1));
  }
  EXPECT_EQ(differing, 16);
}

// ------------------------------------------------------------------------------------------------
// ImageFolder

void copy_fixture(const std::string& name, const fs::path& to) {
  fs::create_directories(to.parent_path());
  fs::copy_file(fixture(name), to, fs::copy_options::overwrite_existing);
}

// A folder whose order tells a walk sorted by path from a plain depth-first one: in class "a",
// torchvision visits a/sub, then "a/sub dir" (' ' sorts before '/'), then a/sub/deeper.
void make_tree(const fs::path& root) {
  copy_fixture("rgb.png", root / "b" / "2.png");
  copy_fixture("rgb.jpg", root / "b" / "10.JPG");
  copy_fixture("rgb.png", root / "a" / "z.png");
  copy_fixture("rgb.png", root / "a" / "sub" / "y.png");
  copy_fixture("rgb.jpg", root / "a" / "sub" / "deeper" / "x.jpeg");
  copy_fixture("grey.png", root / "a" / "sub dir" / "w.Png");
  copy_fixture("rgb.png", root / "C" / "only.png");
  write_bytes(root / "a" / "notes.txt", "x", 1);
  write_bytes(root / "README", "x", 1);  // a file at the top is not a class
}

TEST(ImageFolder, ListsAsTorchvisionDoes) {
  TempDir dir("order");
  make_tree(dir.path());
  ImageFolderOptions options;
  options.image_size = 8;
  const ImageFolder folder(dir.path().string(), options);
  EXPECT_EQ(folder.classes(), (std::vector<std::string>{"C", "a", "b"})) << "sorted by code point";
  EXPECT_EQ(folder.num_classes(), 3);
  EXPECT_EQ(folder.sample_shape(), (std::vector<std::int64_t>{3, 8, 8}));
  const std::vector<std::string> want = {"C/only.png",          "a/z.png",  "a/sub/y.png", "a/sub dir/w.Png",
                                         "a/sub/deeper/x.jpeg", "b/10.JPG", "b/2.png"};
  const std::vector<std::int64_t> labels = {0, 1, 1, 1, 1, 2, 2};
  ASSERT_EQ(folder.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(folder.path(i), (dir.path() / want[i]).string()) << i;
    EXPECT_EQ(folder.label(i), labels[i]) << i;
  }
}

TEST(ImageFolder, SameListAsTorchvisionImageFolder) {
  if (test::run_command("/usr/bin/python3 -c 'import torchvision'").code != 0)
    GTEST_SKIP() << "no /usr/bin/python3 with torchvision (Debian's python3-torchvision)";
  TempDir dir("torchvision");
  make_tree(dir / "data");
  const std::string script = R"(import json, sys
from torchvision.datasets import ImageFolder
root = sys.argv[1]
d = ImageFolder(root, loader=lambda path: path)
print(json.dumps({"classes": d.classes, "samples": [[p, t] for p, t in d.samples]}))
)";
  write_bytes(dir / "list.py", script.data(), script.size());
  const auto result =
      test::run_command(fmt::format("/usr/bin/python3 {} {}", (dir / "list.py").string(), (dir / "data").string()));
  ASSERT_EQ(result.code, 0) << result.output;
  const json torchvision = json::parse(result.output.substr(result.output.find('{')));
  const ImageFolder folder((dir / "data").string());
  EXPECT_EQ(folder.classes(), torchvision["classes"].get<std::vector<std::string>>());
  ASSERT_EQ(folder.size(), torchvision["samples"].size());
  for (std::size_t i = 0; i < folder.size(); ++i) {
    EXPECT_EQ(folder.path(i), torchvision["samples"][i][0].get<std::string>()) << i;
    EXPECT_EQ(folder.label(i), torchvision["samples"][i][1].get<std::int64_t>()) << i;
  }
}

TEST(ImageFolder, ConstructionErrorsNameTheProblem) {
  TempDir dir("errors");
  const std::string missing = (dir / "missing").string();
  EXPECT_NE(error_of([&] { ImageFolder folder(missing); }).find(missing + ": no such directory"), std::string::npos);

  write_bytes(dir / "flat" / "a.png", "x", 1);
  EXPECT_NE(error_of([&] { ImageFolder folder((dir / "flat").string()); }).find("no class folders"), std::string::npos);

  copy_fixture("rgb.png", dir / "empty" / "cat" / "1.png");
  copy_fixture("rgb.png", dir / "empty" / "dog" / "1.bmp");  // torchvision's, not dp's
  fs::create_directories(dir / "empty" / "eel");
  const std::string empty = error_of([&] { ImageFolder folder((dir / "empty").string()); });
  EXPECT_NE(empty.find("found no valid file for the classes dog, eel"), std::string::npos) << empty;
  EXPECT_NE(empty.find("1 files of other image formats were skipped"), std::string::npos) << empty;

  // A validation split must hold the training split's classes, no more, no fewer.
  make_tree(dir / "train");
  copy_fixture("rgb.png", dir / "val" / "C" / "1.png");
  copy_fixture("rgb.png", dir / "val" / "a" / "1.png");
  copy_fixture("rgb.png", dir / "val" / "d" / "1.png");
  const ImageFolder train((dir / "train").string());
  ImageFolderOptions val;
  val.transform = ImageTransform::eval;
  val.expected_classes = train.classes();
  const std::string mismatch = error_of([&] { ImageFolder folder((dir / "val").string(), val); });
  EXPECT_NE(mismatch.find("missing b; not expected d"), std::string::npos) << mismatch;
  fs::remove_all(dir / "val" / "d");
  copy_fixture("rgb.png", dir / "val" / "b" / "1.png");
  EXPECT_EQ(ImageFolder((dir / "val").string(), val).classes(), train.classes());

  ImageFolderOptions bad;
  bad.image_size = 0;
  EXPECT_THROW(ImageFolder((dir / "train").string(), bad), InvalidArgument);
}

TEST(ImageFolder, FillDecodesAndTransforms) {
  TempDir dir("fill");
  make_tree(dir.path());
  ImageFolderOptions options;
  options.image_size = 12;
  const ImageFolder train(dir.path().string(), options);
  const std::size_t n = train.sample_elements();
  ASSERT_EQ(n, 3u * 12 * 12);
  // Train: the pipeline with the sample's keyed draws; the same key twice gives the same sample.
  std::vector<float> a(n), b(n), c(n), want(n);
  train.fill(4, SampleKey{3, 0, 1}, a.data());
  train.fill(4, SampleKey{3, 0, 1}, b.data());
  train.fill(4, SampleKey{3, 1, 1}, c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c) << "another rank crops elsewhere";
  tf::PhiloxDraws draws(SampleKey{3, 0, 1}, 4);
  tf::train_transform(read_image(train.path(4)), 12, options.crop, 0.5, options.normalization, draws, want.data());
  EXPECT_EQ(a, want);
  // Eval: no draws, the key does not matter.
  options.transform = ImageTransform::eval;
  options.resize_size = 14;
  const ImageFolder eval(dir.path().string(), options);
  eval.fill(5, SampleKey{1, 0, 0}, a.data());
  eval.fill(5, SampleKey{2, 3, 4}, b.data());
  EXPECT_EQ(a, b);
  tf::eval_transform(read_image(eval.path(5)), 14, 12, options.normalization, want.data());
  EXPECT_EQ(a, want);
  // A file that stopped being an image is named when its sample is made.
  write_bytes(dir / "b" / "2.png", "oops", 4);
  const std::string message = error_of([&] { eval.fill(6, SampleKey{}, a.data()); });
  EXPECT_NE(message.find((dir / "b" / "2.png").string() + ": not an image"), std::string::npos) << message;
}

}  // namespace
}  // namespace dp
