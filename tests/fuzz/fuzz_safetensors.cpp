// fuzz_safetensors.cpp — the safetensors reader: any file gives a File whose every tensor holds
// exactly dtype size x shape bytes, or a dp::Error naming the problem.
#include <cstdint>

#include "dp/io/safetensors.h"
#include "dp/runtime/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = dp::fuzz::write("input.safetensors", data, size);
  try {
    const dp::safetensors::File file = dp::safetensors::read(path);
    if (file.order.size() != file.tensors.size()) __builtin_trap();
    for (const auto& [name, tensor] : file.tensors) {
      if (tensor.dtype == "F32" && tensor.data.size() != tensor.numel() * 4) __builtin_trap();
      if (tensor.dtype == "I64" && tensor.data.size() != tensor.numel() * 8) __builtin_trap();
    }
  } catch (const dp::Error&) {
  }
  return 0;
}
