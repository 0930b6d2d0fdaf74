// store_protocol.h — the wire format of the env:// store (tcp_store.cpp), apart from the sockets so
// that its reader of untrusted bytes is fuzzed alone (tests/fuzz/fuzz_store.cpp). Private to the
// runtime.
//
// A request is an op byte, a key (u32 length + bytes) and, for 'H' and 'S', a value (u32 length +
// bytes); lengths in the host's byte order (the job's machines share one):
//   'H' hello, the first request of every connection: key hello_key(rank, world size), value the
//       job token (DP_JOB_TOKEN; empty without one). Reply 'h' + blob kMagic, or 'r' + blob(reason)
//       and the connection closes.
//   'S' set, 'D' delete, 'B' goodbye: reply 'k'. 'G' get: reply 'f' + blob(value), or 'n'.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dp::detail::store {

inline constexpr const char* kMagic = "dp-store 1";
// What the job stores is small (hashes, host names, an NCCL id): anything larger is not the job's.
inline constexpr std::size_t kMaxKeyBytes = 1024;
inline constexpr std::size_t kMaxValueBytes = std::size_t{1} << 20;
inline constexpr std::size_t kMaxTokenBytes = 256;
inline constexpr std::size_t kMaxReasonBytes = 1024;

struct Request {
  char op = 0;
  std::string key;
  std::vector<char> value;
};

// Reads exactly `bytes` into `data`; false when the connection ends, fails or times out.
using ReadExact = std::function<bool(void* data, std::size_t bytes)>;

// Reads one blob (u32 length + bytes) of at most `limit` bytes; false, having allocated nothing
// beyond `limit`, for a longer one or a short read.
bool read_blob(const ReadExact& read, std::size_t limit, std::vector<char>& out);

// Reads one request within the limits above; `hello_only`: the connection has not said hello, and
// only 'H' is a request then. False for anything else (an unknown op, a length over its limit, a
// short read): the server then drops the connection.
bool read_request(const ReadExact& read, bool hello_only, Request& out);

struct Hello {
  int rank = -1;
  int world_size = 0;
};
std::string hello_key(int rank, int world_size);
// False unless `key` is exactly what hello_key writes, with 0 <= rank and 1 <= world_size.
bool parse_hello_key(const std::string& key, Hello& out);

// Equal tokens, compared in a time that does not depend on where they differ.
bool same_token(const std::vector<char>& given, const std::string& expected);

}  // namespace dp::detail::store
