// tool_test.h — tests that drive the tools (dp_train, dp_bench under mpirun): a fresh directory
// per test, removed afterwards, and small MNIST-format data sets written into it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <string>
#include <unistd.h>

namespace dp::test {

class ToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() /
        fmt::format("dp_tool_test_{}_{}", ::getpid(), ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // A file's bytes (empty when it cannot be read).
  static std::string read_file(const std::string& name) {
    std::ifstream in(name, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }

  // A small MNIST-format data set: `count` images of rows x cols, labels i % 10.
  void write_idx(const std::string& subdir, std::uint32_t count, std::uint32_t rows = 28, std::uint32_t cols = 28,
                 std::uint32_t image_magic = 0x803, int bad_label_at = -1, std::size_t truncate_images = 0,
                 const std::string& prefix = "train") {
    std::filesystem::create_directories(dir_ / subdir);
    auto be = [](std::ofstream& out, std::uint32_t v) {
      const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                  static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
      out.write(reinterpret_cast<const char*>(b), 4);
    };
    {
      std::ofstream images(dir_ / subdir / (prefix + "-images-idx3-ubyte"), std::ios::binary);
      be(images, image_magic);
      be(images, count);
      be(images, rows);
      be(images, cols);
      std::string pixels(static_cast<std::size_t>(count) * rows * cols, '\0');
      for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<char>((i * 37 + i / 784 * 11) % 256);
      pixels.resize(pixels.size() - truncate_images);
      images.write(pixels.data(), static_cast<std::streamsize>(pixels.size()));
    }
    std::ofstream labels(dir_ / subdir / (prefix + "-labels-idx1-ubyte"), std::ios::binary);
    be(labels, 0x801);
    be(labels, count);
    for (std::uint32_t i = 0; i < count; ++i) {
      const char label = static_cast<char>(static_cast<int>(i) == bad_label_at ? 10 : i % 10);
      labels.write(&label, 1);
    }
  }

  std::filesystem::path dir_;
};

}  // namespace dp::test
