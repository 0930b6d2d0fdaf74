// store_protocol.cpp — the env:// store's reader of requests (store_protocol.h).
#include "store_protocol.h"

#include <charconv>
#include <fmt/format.h>
#include <string_view>

namespace dp::detail::store {

bool read_blob(const ReadExact& read, std::size_t limit, std::vector<char>& out) {
  std::uint32_t length = 0;
  if (!read(&length, sizeof length) || length > limit) return false;
  out.resize(length);
  return length == 0 || read(out.data(), length);
}

bool read_request(const ReadExact& read, bool hello_only, Request& out) {
  if (!read(&out.op, 1)) return false;
  const bool known = out.op == 'H' || out.op == 'S' || out.op == 'G' || out.op == 'D' || out.op == 'B';
  if (!known || (hello_only && out.op != 'H')) return false;
  std::vector<char> key;
  if (!read_blob(read, kMaxKeyBytes, key)) return false;
  out.key.assign(key.begin(), key.end());
  out.value.clear();
  if (out.op == 'H') return read_blob(read, kMaxTokenBytes, out.value);
  if (out.op == 'S') return read_blob(read, kMaxValueBytes, out.value);
  return true;
}

std::string hello_key(int rank, int world_size) { return fmt::format("{} {} {}", kMagic, rank, world_size); }

bool parse_hello_key(const std::string& key, Hello& out) {
  const std::string_view prefix = std::string_view(kMagic);
  std::string_view rest(key);
  if (rest.substr(0, prefix.size()) != prefix || rest.size() < prefix.size() + 4) return false;
  rest.remove_prefix(prefix.size());
  if (rest.front() != ' ') return false;
  rest.remove_prefix(1);
  const auto number = [&rest](int& value, char end) {
    const auto [next, error] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
    if (error != std::errc() || next == rest.data()) return false;
    rest.remove_prefix(static_cast<std::size_t>(next - rest.data()));
    if (end == 0) return rest.empty();
    if (rest.empty() || rest.front() != end) return false;
    rest.remove_prefix(1);
    return true;
  };
  Hello hello;
  if (!number(hello.rank, ' ') || !number(hello.world_size, 0)) return false;
  if (hello.rank < 0 || hello.world_size < 1 || key != hello_key(hello.rank, hello.world_size)) return false;
  out = hello;
  return true;
}

bool same_token(const std::vector<char>& given, const std::string& expected) {
  if (given.size() != expected.size()) return false;  // a token's length is not the secret
  unsigned char difference = 0;
  for (std::size_t i = 0; i < given.size(); ++i) difference |= static_cast<unsigned char>(given[i] ^ expected[i]);
  return difference == 0;
}

}  // namespace dp::detail::store
