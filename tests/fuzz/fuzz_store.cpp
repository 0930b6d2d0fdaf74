// fuzz_store.cpp — the env:// store's reader of requests (dp/runtime/env/store_protocol.h), which
// reads whatever a stranger sends to MASTER_PORT: the fuzzer's bytes are one connection's stream,
// read request after request (the first as a connection that has not said hello). Whatever they
// hold, the reader takes at most its limits, never crashes and never reads past the stream.
#include <cstdint>
#include <cstring>

#include "store_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::size_t at = 0;
  const dp::detail::store::ReadExact read = [&](void* out, std::size_t bytes) {
    if (bytes > size - at) return false;
    std::memcpy(out, data + at, bytes);
    at += bytes;
    return true;
  };
  dp::detail::store::Request request;
  bool said_hello = false;
  while (dp::detail::store::read_request(read, !said_hello, request)) {
    if (request.key.size() > dp::detail::store::kMaxKeyBytes) __builtin_trap();
    if (request.value.size() > dp::detail::store::kMaxValueBytes) __builtin_trap();
    if (!said_hello) {
      dp::detail::store::Hello hello;
      if (dp::detail::store::parse_hello_key(request.key, hello) &&
          request.key != dp::detail::store::hello_key(hello.rank, hello.world_size))
        __builtin_trap();
      (void)dp::detail::store::same_token(request.value, "token");
      said_hello = true;
    }
  }
  return 0;
}
