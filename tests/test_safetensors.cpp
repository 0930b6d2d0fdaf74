// test_safetensors.cpp — the checkpoint file format: round trip, and every malformed file refused
// with a message naming it (truncated, forged sizes, overlapping data, not a file).
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <unistd.h>

#include "dp/error.h"
#include "dp/safetensors.h"

namespace dp {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dp_safetensors_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // A file made of a raw JSON header and `data_bytes` zero bytes.
  std::string raw(const std::string& name, const std::string& header, std::size_t data_bytes) {
    std::ofstream out(path(name), std::ios::binary);
    const std::uint64_t len = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
    out << header << std::string(data_bytes, '\0');
    return path(name);
  }
  void expect_refused(const std::string& file, const std::string& message) {
    try {
      safetensors::read(file);
      ADD_FAILURE() << "accepted: " << file;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << "names the file: " << e.what();
    }
  }
  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripKeepsOrderDtypesAndMetadata) {
  safetensors::File file;
  const float w[6] = {1, 2, 3, 4, 5, -6.5f};
  const std::int64_t n = 42;
  file.add("fc.weight", safetensors::make_f32({2, 3}, w));
  file.add("bn.num_batches_tracked", safetensors::make_i64({}, &n));
  file.metadata["dp.step"] = "7";
  safetensors::write(path("a.safetensors"), file);
  const auto back = safetensors::read(path("a.safetensors"));
  EXPECT_EQ(back.order, file.order);
  EXPECT_EQ(back.at("fc.weight").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(back.at("fc.weight").to_f32(), std::vector<float>(w, w + 6));
  EXPECT_EQ(back.at("bn.num_batches_tracked").to_i64(), std::vector<std::int64_t>{42});
  EXPECT_EQ(back.metadata.at("dp.step"), "7");
  EXPECT_THROW(back.at("fc.weight").to_i64(), Error) << "dtype checked";
  EXPECT_THROW(back.at("missing"), Error);
}

TEST_F(SafetensorsTest, MalformedFilesAreRefused) {
  expect_refused(path("absent.safetensors"), "no such file");
  expect_refused(dir_.string(), "not a regular file");
  { std::ofstream(path("short")) << "abc"; }
  expect_refused(path("short"), "truncated");
  EXPECT_TRUE(safetensors::read(raw("empty", "{}", 0)).order.empty()) << "an empty header is a valid, empty file";
  expect_refused(raw("cut", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                 "shape needs more than the 8-byte data section");
  expect_refused(raw("offsets", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
                 "out of the 8-byte data");
  expect_refused(raw("size", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", 8), "8 bytes for dtype F32");
  // A forged shape whose element count overflows 64 bits must not wrap around to match the bytes.
  expect_refused(raw("forged", R"({"w":{"dtype":"F32","shape":[3,6148914691236517206],"data_offsets":[0,8]}})", 8),
                 "shape needs more than");
  expect_refused(raw("overlap",
                     R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                     12),
                 "overlap");
  expect_refused(raw("dtype", R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1), "unknown dtype");
  expect_refused(raw("json", "{not json", 0), "not valid JSON");
}

TEST_F(SafetensorsTest, AFailedWriteLeavesTheOldFile) {
  safetensors::File file;
  const float v = 1.0f;
  file.add("x", safetensors::make_f32({1}, &v));
  safetensors::write(path("keep.safetensors"), file);
  EXPECT_THROW(safetensors::write(path("no/such/dir/keep.safetensors"), file), Error);
  EXPECT_EQ(safetensors::read(path("keep.safetensors")).at("x").to_f32(), std::vector<float>{1.0f});
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_NE(entry.path().filename().string().front(), '.') << "temporary left behind";
}

}  // namespace
}  // namespace dp
