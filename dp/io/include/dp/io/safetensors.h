// dp/io/safetensors.h — reading and writing safetensors files (8-byte little-endian header length,
// JSON header, raw little-endian data), validated on read, written atomically (temp + rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dp::safetensors {

struct Tensor {
  std::string dtype;  // "F32", "I64", "U8", "F64", "I32", ...
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;

  std::size_t numel() const;
  // Copies out as T after checking the dtype matches T (throws dp::Error otherwise).
  std::vector<float> to_f32() const;
  // The index of the first NaN or infinity of an F32 tensor; npos when every value is finite (and
  // for other dtypes, whose values cannot be).
  std::size_t first_non_finite() const;
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  std::vector<std::int64_t> to_i64() const;
};

struct File {
  std::map<std::string, std::string> metadata;
  std::map<std::string, Tensor> tensors;
  std::vector<std::string> order;  // tensor names in file (data offset) order

  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  // Throws dp::Error naming the file's tensor when absent.
  const Tensor& at(const std::string& name) const;
  void add(const std::string& name, Tensor tensor);
};

// Throws dp::Error naming `path` and the problem: missing, not a regular file, truncated, bad
// header (non-integer shapes or offsets included), overlapping or out-of-range offsets, holes or
// trailing bytes in the data section, size not matching dtype x shape. Reads the header first and
// then exactly the tensors it declares.
File read(const std::string& path);

// Writes `path` with dp::write_atomically (dp/atomic_file.h): an existing file is either fully
// replaced or left untouched; a target that is not a regular file is refused.
void write(const std::string& path, const File& file);

Tensor make_f32(const std::vector<std::int64_t>& shape, const float* values);
Tensor make_i64(const std::vector<std::int64_t>& shape, const std::int64_t* values);

}  // namespace dp::safetensors
