// safetensors.cpp — the safetensors format with strict validation; writes go through dp::write_atomically.
#include "dp/io/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "dp/io/atomic_file.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

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
  if (!out.empty()) std::memcpy(out.data(), data.data(), out.size() * sizeof(float));  // never from null
  return out;
}

std::size_t Tensor::first_non_finite() const {
  if (dtype != "F32") return npos;
  for (std::size_t i = 0; i < data.size() / sizeof(float); ++i) {
    float v;
    std::memcpy(&v, data.data() + i * sizeof(float), sizeof(float));
    if (!std::isfinite(v)) return i;
  }
  return npos;
}

std::vector<std::int64_t> Tensor::to_i64() const {
  if (dtype != "I64") throw Error(fmt::format("tensor has dtype {}, expected I64", dtype));
  std::vector<std::int64_t> out(numel());
  if (!out.empty()) std::memcpy(out.data(), data.data(), out.size() * sizeof(std::int64_t));
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

namespace {

// A JSON array of non-negative integers (shapes, offsets): 10.0 or "10" is a malformed header, not
// a 10 that a lenient conversion would make of it.
std::vector<std::uint64_t> integers(const nlohmann::json& value, const char* what) {
  if (!value.is_array()) throw Error(fmt::format("{} is not an array", what));
  std::vector<std::uint64_t> out;
  for (const auto& item : value) {
    if (!item.is_number_integer()) throw Error(fmt::format("{} holds {}, not an integer", what, item.dump()));
    if (!item.is_number_unsigned() && item.get<std::int64_t>() < 0)
      throw Error(fmt::format("{} holds the negative {}", what, item.dump()));
    out.push_back(item.get<std::uint64_t>());
  }
  return out;
}

// A tensor's bytes in the data section, [begin, end).
struct Range {
  std::uint64_t begin, end;
  std::string name;
};

// One tensor's header entry: its dtype and shape, and where its bytes lie in the data section
// (into `range`), checked against the section's size before anything is read.
Tensor parse_entry(const nlohmann::json& entry, std::uint64_t data_size, Range& range) {
  Tensor t;
  t.dtype = entry.at("dtype").get<std::string>();
  const std::size_t elem = dtype_bytes(t.dtype);
  if (elem == 0) throw Error(fmt::format("unknown dtype '{}'", t.dtype));
  std::uint64_t elements = 1;
  for (const std::uint64_t d : integers(entry.at("shape"), "shape")) {
    // Overflow-checked: a forged shape must not wrap around to match the byte count.
    if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw Error(fmt::format("dimension {} is out of range", d));
    t.shape.push_back(static_cast<std::int64_t>(d));
    if (d != 0 && elements > data_size / d)
      elements = data_size + 1;
    else
      elements *= d;
  }
  if (elements != 0 && elements * elem > data_size)
    throw Error(fmt::format("shape needs more than the {}-byte data section", data_size));
  const auto offsets = integers(entry.at("data_offsets"), "data_offsets");
  if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
    throw Error(fmt::format("data_offsets out of the {}-byte data section (file truncated?)", data_size));
  if (offsets[1] - offsets[0] != t.numel() * elem)
    throw Error(
        fmt::format("{} bytes for dtype {} and shape of {} elements", offsets[1] - offsets[0], t.dtype, t.numel()));
  range.begin = offsets[0];
  range.end = offsets[1];
  return t;
}

// The format's rule: the data section is indexed entirely, without holes or overlaps, so bytes
// beyond the last tensor (a file padded or glued to another) are refused, not read. Sorts `ranges`.
void check_coverage(const std::string& path, std::vector<Range>& ranges, std::uint64_t data_size) {
  // An empty tensor (a 0 in its shape) takes [x, x): ordered before a tensor starting at x, it
  // covers nothing and overlaps nothing.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::uint64_t covered = 0;
  for (const Range& r : ranges) {
    if (r.begin < covered) throw Error(fmt::format("{}: tensors overlap in the data section", path));
    if (r.begin > covered)
      throw Error(fmt::format("{}: a hole of {} bytes before tensor '{}' in the data section", path, r.begin - covered,
                              r.name));
    covered = r.end;
  }
  if (covered != data_size)
    throw Error(
        fmt::format("{}: {} bytes of trailing data after the tensors ({} bytes)", path, data_size - covered, covered));
}

// A SAX pass over the header that finds a key named twice in one object (each object's keys in a
// set: linear in the header). A parser callback could refuse it during the DOM parse, but with a
// callback nlohmann's parser scans the enclosing object at every object's end, quadratic in the
// tensors a header lists.
class DuplicateKeys final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit DuplicateKeys(const std::string& path) : path_(path) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& name) override {
    if (!keys_.back().insert(name).second)
      throw Error(fmt::format("{}: header names '{}' twice in one object", path_, name));
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    throw Error(fmt::format("{}: header is not valid JSON: {}", path_, e.what()));
  }

 private:
  const std::string& path_;
  std::vector<std::set<std::string>> keys_;  // per open object, the keys seen so far
};

// The header as JSON, refused when it is not an object or when an object names a key twice: JSON
// parsers keep one of the two (nlohmann::json the last, others the first), so two readers of one
// file would load different tensors.
nlohmann::json parse_header(const std::string& path, const std::string& header) {
  DuplicateKeys duplicates(path);
  nlohmann::json::sax_parse(header, &duplicates);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}: header is not valid JSON: {}", path, e.what()));
  }
  if (!json.is_object()) throw Error(fmt::format("{}: header is not a JSON object", path));
  return json;
}

}  // namespace

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
  const nlohmann::json json = parse_header(path, header);
  const std::uint64_t data_size = file_size - 8 - header_len;

  // The header first, checked against the file's size; only then the data, each tensor read
  // straight into its own buffer.
  File file;
  std::vector<Range> ranges;
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
      ranges.push_back(Range{0, 0, name});
      file.tensors[name] = parse_entry(entry, data_size, ranges.back());
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("{}: tensor '{}': malformed entry: {}", path, name, e.what()));
    } catch (const Error& e) {
      throw Error(fmt::format("{}: tensor '{}': {}", path, name, e.what()));
    }
  }
  check_coverage(path, ranges, data_size);
  for (const Range& r : ranges) {
    Tensor& t = file.tensors[r.name];
    t.data.resize(r.end - r.begin);
    in.seekg(static_cast<std::streamoff>(8 + header_len + r.begin));
    in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
    if (!in) throw Error(fmt::format("{}: read failed", path));
    file.order.push_back(r.name);
  }
  return file;
}

void write(const std::string& path, const File& file) {
  // The header is written member by member: an ordered_json object finds each new key by a linear
  // search, which made a file of 40,000 tensors take seconds. File::add keeps the names unique.
  std::string text = "{";
  auto member = [&text](const std::string& key, const nlohmann::ordered_json& value) {
    if (text.size() > 1) text += ',';
    text += nlohmann::json(key).dump();
    text += ':';
    text += value.dump();
  };
  if (!file.metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (auto& [k, v] : file.metadata) meta[k] = v;
    member("__metadata__", meta);
  }
  std::uint64_t offset = 0;
  for (const auto& name : file.order) {
    if (name == "__metadata__") throw Error(fmt::format("{}: a tensor may not be named __metadata__", path));
    const Tensor& t = file.at(name);
    member(name, {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}});
    offset += t.data.size();
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned

  unsigned char len_bytes[8];
  const std::uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
  std::vector<std::span<const std::byte>> pieces = {std::as_bytes(std::span(len_bytes)),
                                                    std::as_bytes(std::span(text.data(), text.size()))};
  for (const auto& name : file.order) pieces.push_back(std::span(file.at(name).data));
  write_atomically(path, pieces);
}

Tensor make_f32(const std::vector<std::int64_t>& shape, const float* values) {
  Tensor t{"F32", shape, {}};
  t.data.resize(t.numel() * sizeof(float));
  if (!t.data.empty()) std::memcpy(t.data.data(), values, t.data.size());  // an empty tensor may have no data
  return t;
}

Tensor make_i64(const std::vector<std::int64_t>& shape, const std::int64_t* values) {
  Tensor t{"I64", shape, {}};
  t.data.resize(t.numel() * sizeof(std::int64_t));
  if (!t.data.empty()) std::memcpy(t.data.data(), values, t.data.size());
  return t;
}

}  // namespace dp::safetensors
