// safetensors.cpp — the safetensors format with strict validation and atomic writes.
#include "dp/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include "dp/error.h"
#include "dp/shape.h"

namespace dp::safetensors {
namespace {

std::size_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                           {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1},
                                                           {"U16", 2}, {"U32", 4}, {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

constexpr std::uint64_t kMaxHeader = 100u << 20;  // the format's own limit is 100 MB

}  // namespace

std::size_t Tensor::numel() const { return dp::numel(shape); }

std::vector<float> Tensor::to_f32() const {
  if (dtype != "F32") throw Error(fmt::format("tensor has dtype {}, expected F32", dtype));
  std::vector<float> out(numel());
  std::memcpy(out.data(), data.data(), out.size() * sizeof(float));
  return out;
}

std::vector<std::int64_t> Tensor::to_i64() const {
  if (dtype != "I64") throw Error(fmt::format("tensor has dtype {}, expected I64", dtype));
  std::vector<std::int64_t> out(numel());
  std::memcpy(out.data(), data.data(), out.size() * sizeof(std::int64_t));
  return out;
}

const Tensor& File::at(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) throw Error(fmt::format("tensor '{}' is missing", name));
  return it->second;
}

void File::add(const std::string& name, Tensor tensor) {
  if (!tensors.count(name)) order.push_back(name);
  tensors[name] = std::move(tensor);
}

File read(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(fmt::format("{}: {}", path, std::filesystem::exists(path, ec) ? "not a regular file" : "no such file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open ({})", path, std::strerror(errno)));
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) throw Error(fmt::format("{}: truncated: {} bytes, no safetensors header", path, file_size));
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  if (!in) throw Error(fmt::format("{}: cannot read the header length", path));
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > kMaxHeader || header_len > file_size - 8)
    throw Error(fmt::format("{}: truncated or not safetensors: header of {} bytes in a {}-byte file", path, header_len,
                            file_size));
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}: header is not valid JSON: {}", path, e.what()));
  }
  if (!json.is_object()) throw Error(fmt::format("{}: header is not a JSON object", path));
  const std::uint64_t data_size = file_size - 8 - header_len;
  std::vector<std::byte> data(data_size);
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(data_size));
  if (!in) throw Error(fmt::format("{}: read failed", path));

  File file;
  std::vector<std::pair<std::uint64_t, std::string>> by_offset;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw Error(fmt::format("{}: __metadata__ is not an object", path));
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw Error(fmt::format("{}: metadata '{}' is not a string", path, k));
        file.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    try {
      Tensor t;
      t.dtype = entry.at("dtype").get<std::string>();
      t.shape = entry.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      const std::size_t elem = dtype_bytes(t.dtype);
      if (elem == 0) throw Error(fmt::format("unknown dtype '{}'", t.dtype));
      std::uint64_t elements = 1;
      for (auto d : t.shape) {
        if (d < 0) throw Error("negative dimension");
        // Overflow-checked: a forged shape must not wrap around to match the byte count.
        if (d != 0 && elements > data_size / static_cast<std::uint64_t>(d)) {
          elements = data_size + 1;
          break;
        }
        elements *= static_cast<std::uint64_t>(d);
      }
      if (elements * elem > data_size)
        throw Error(fmt::format("shape needs more than the {}-byte data section", data_size));
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
        throw Error(fmt::format("data_offsets out of the {}-byte data section (file truncated?)", data_size));
      if (offsets[1] - offsets[0] != t.numel() * elem)
        throw Error(
            fmt::format("{} bytes for dtype {} and shape of {} elements", offsets[1] - offsets[0], t.dtype, t.numel()));
      t.data.assign(data.begin() + static_cast<std::ptrdiff_t>(offsets[0]),
                    data.begin() + static_cast<std::ptrdiff_t>(offsets[1]));
      file.tensors[name] = std::move(t);
      by_offset.emplace_back(offsets[0], name);
      ranges.emplace_back(offsets[0], offsets[1]);
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("{}: tensor '{}': malformed entry: {}", path, name, e.what()));
    } catch (const Error& e) {
      throw Error(fmt::format("{}: tensor '{}': {}", path, name, e.what()));
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      throw Error(fmt::format("{}: tensors overlap in the data section", path));
  std::sort(by_offset.begin(), by_offset.end());
  for (auto& [offset, name] : by_offset) file.order.push_back(name);
  return file;
}

void write(const std::string& path, const File& file) {
  nlohmann::ordered_json header;
  if (!file.metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (auto& [k, v] : file.metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  std::uint64_t offset = 0;
  for (const auto& name : file.order) {
    const Tensor& t = file.at(name);
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned

  // A fresh temporary file beside the target (mkstemp: never an existing file or a symlink),
  // flushed to disk, then renamed over the target, and the directory flushed: after a crash the
  // target is the old file or the new one, never a torn or empty one.
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string temp = (dir / fmt::format(".{}.XXXXXX", target.filename().string())).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0)
    throw Error(fmt::format("{}: cannot create a temporary file in {} ({})", path, dir.string(), std::strerror(errno)));
  auto fail = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    throw Error(fmt::format("{}: {} failed ({})", path, what, std::strerror(error)));
  };
  auto write_all = [&](const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write");
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  };
  unsigned char len_bytes[8];
  const std::uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
  write_all(len_bytes, 8);
  write_all(text.data(), text.size());
  for (const auto& name : file.order) write_all(file.at(name).data.data(), file.at(name).data.size());
  if (::fchmod(fd, 0644) != 0) fail("chmod");
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    throw Error(fmt::format("{}: close failed ({})", path, std::strerror(error)));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    throw Error(fmt::format("{}: cannot replace ({})", path, std::strerror(error)));
  }
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);  // best effort: some file systems refuse fsync on directories
    ::close(dir_fd);
  }
}

Tensor make_f32(const std::vector<std::int64_t>& shape, const float* values) {
  Tensor t{"F32", shape, {}};
  t.data.resize(t.numel() * sizeof(float));
  std::memcpy(t.data.data(), values, t.data.size());
  return t;
}

Tensor make_i64(const std::vector<std::int64_t>& shape, const std::int64_t* values) {
  Tensor t{"I64", shape, {}};
  t.data.resize(t.numel() * sizeof(std::int64_t));
  std::memcpy(t.data.data(), values, t.data.size());
  return t;
}

}  // namespace dp::safetensors
