// test_safetensors.cpp — the checkpoint file format: round trip, and every malformed file refused
// with a message naming it (truncated, forged sizes, overlapping data, not a file).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <sys/stat.h>
#include <unistd.h>

#include "dp/io/atomic_file.h"
#include "dp/io/safetensors.h"
#include "dp/runtime/error.h"

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
  // The header as safetensors' own writer lays it out: compact JSON in the file's order, metadata
  // first, padded with spaces to 8 bytes.
  std::ifstream in(path("a.safetensors"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string header =
      R"({"__metadata__":{"dp.step":"7"},"fc.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("bn.num_batches_tracked":{"dtype":"I64","shape":[],"data_offsets":[24,32]}})";
  ASSERT_EQ(bytes.size(), 8 + (header.size() + 7) / 8 * 8 + 32);
  EXPECT_EQ(bytes.substr(8, header.size()), header);
  EXPECT_EQ(bytes.substr(8 + header.size(), (8 - header.size() % 8) % 8),
            std::string((8 - header.size() % 8) % 8, ' '));
  // A tensor may not take the metadata's key; nothing is written.
  safetensors::File clash;
  clash.add("__metadata__", safetensors::make_f32({1}, w));
  EXPECT_THROW(safetensors::write(path("clash.safetensors"), clash), Error);
  EXPECT_FALSE(fs::exists(path("clash.safetensors")));
  // Empty tensors (torch writes them: a zero in the shape), wherever they fall among the others.
  safetensors::File empty;
  empty.add("a", safetensors::make_f32({2}, w));
  empty.add("none", safetensors::make_f32({0, 3}, w));
  empty.add("b", safetensors::make_f32({1}, w + 2));
  empty.add("last", safetensors::make_i64({0}, &n));
  safetensors::write(path("empty.safetensors"), empty);
  const auto read_back = safetensors::read(path("empty.safetensors"));
  EXPECT_EQ(read_back.order, empty.order);
  EXPECT_EQ(read_back.at("none").shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(read_back.at("none").to_f32().empty());
  EXPECT_EQ(read_back.at("b").to_f32(), std::vector<float>{3});
  EXPECT_THROW(back.at("missing"), Error);
}

// A header of 40,000 tensors, each checked (the duplicate-key check is linear in the header: a
// quadratic one took 21 s here), and a key named twice among them still found.
TEST_F(SafetensorsTest, AHeaderOfManyTensorsIsReadWhole) {
  constexpr int kTensors = 40000;
  safetensors::File many;
  const float value = 1.5f;
  for (int i = 0; i < kTensors; ++i) many.add(fmt::format("t{:05}", i), safetensors::make_f32({1}, &value));
  safetensors::write(path("many.safetensors"), many);
  const auto back = safetensors::read(path("many.safetensors"));
  ASSERT_EQ(back.order.size(), static_cast<std::size_t>(kTensors));
  EXPECT_EQ(back.at("t39999").to_f32(), std::vector<float>{1.5f});
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i)
    header += fmt::format(R"("t{:05}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}},)",
                          i == kTensors - 1 ? 0 : i, 4 * i, 4 * i + 4);
  header.back() = '}';
  expect_refused(raw("many_twice", header, 4 * kTensors), "header names 't00000' twice in one object");
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
  // A key named twice in one object: parsers keep different ones, so two readers would differ.
  expect_refused(raw("twice",
                     R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                     R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                     8),
                 "header names 'w' twice in one object");
  expect_refused(raw("dtype_twice", R"({"w":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})", 4),
                 "header names 'dtype' twice");
  expect_refused(raw("metadata_twice", R"({"__metadata__":{"a":"1","a":"2"}})", 0), "header names 'a' twice");
  EXPECT_EQ(safetensors::read(raw("same_key_elsewhere",
                                  R"({"__metadata__":{"w":"1"},)"
                                  R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                  4))
                .metadata.at("w"),
            "1")
      << "one key in two objects is no duplicate";
  // The data section is indexed entirely: trailing bytes (a file glued to another, 3 GiB of
  // padding) and holes are refused, not read.
  expect_refused(raw("trailing", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4 + 100),
                 "100 bytes of trailing data");
  expect_refused(raw("hole", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "a hole of 4 bytes");
  // Shapes and offsets are integers: 10.0 is not a shape a lenient conversion may round.
  expect_refused(raw("float_shape", R"({"w":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", 4),
                 "shape holds 1.0, not an integer");
  expect_refused(raw("fraction", R"({"w":{"dtype":"F32","shape":[10.7],"data_offsets":[0,40]}})", 40),
                 "not an integer");
  expect_refused(raw("float_offset", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", 4),
                 "data_offsets holds 4.0");
  expect_refused(raw("negative", R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "negative");
}

TEST_F(SafetensorsTest, WritesOnlyRegularFilesWithShortTemporaryNames) {
  safetensors::File file;
  const float v[2] = {1.0f, std::nanf("")};
  file.add("x", safetensors::make_f32({2}, v));
  EXPECT_EQ(file.at("x").first_non_finite(), 1u);
  // A FIFO, a symbolic link or a directory is refused, and stays what it was.
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0644), 0);
  EXPECT_THROW(safetensors::write(path("fifo"), file), Error);
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  { std::ofstream(path("real")) << "precious"; }
  fs::create_symlink(path("real"), path("link"));
  EXPECT_THROW(safetensors::write(path("link"), file), Error);
  EXPECT_TRUE(fs::is_symlink(path("link")));
  std::ifstream real(path("real"));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(real), {}), "precious");
  fs::create_directory(path("dir.safetensors"));
  EXPECT_THROW(safetensors::write(path("dir.safetensors"), file), Error);
  EXPECT_THROW(check_writable(""), Error);
  // Root passes access(W_OK) for /proc, but no file can be created there.
  EXPECT_THROW(check_writable("/proc/x.safetensors"), Error);
  // A name of 250 characters, the longest most file systems take minus a little, still saves.
  const std::string long_name = path(std::string(245, 'n') + ".st");
  safetensors::write(long_name, file);
  EXPECT_EQ(safetensors::read(long_name).at("x").to_f32().size(), 2u);
  // Temporaries a killed earlier save left (their process gone: no process has pid 999999999) are
  // removed by the next save of the same target only; a running writer's is its own and stays.
  const std::string target = path("model.safetensors");
  const std::string stale = (dir_ / (atomic_temp_prefix(target) + "999999999-AbC123")).string();
  const std::string live = (dir_ / fmt::format("{}{}-AbC123", atomic_temp_prefix(target), ::getpid())).string();
  const std::string other = (dir_ / (atomic_temp_prefix(path("other.safetensors")) + "999999999-AbC123")).string();
  { std::ofstream(stale) << "half a checkpoint"; }
  { std::ofstream(live) << "a checkpoint being written"; }
  { std::ofstream(other) << "another target's"; }
  safetensors::write(target, file);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
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
