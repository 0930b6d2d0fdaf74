// fuzz_state_dict.cpp — a checkpoint loaded into a model (dp::load_state_dict, as --init does):
// either every tensor matches the model's names, dtypes and shapes and holds finite values, or
// dp::Error and the model is untouched.
#include <cstdint>
#include <memory>

#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/models/mlp.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // One runtime and model for the whole run: fuzzing the loader, not the runtime's start-up.
  static auto runtime = dp::Runtime::create({.backend = "sim", .sim_devices = 1});
  static auto model = dp::models::make_mlp(runtime->device(0), {4}, 0);
  static const dp::Stream stream = runtime->device(0).create_stream();
  const std::string path = dp::fuzz::write("input.safetensors", data, size);
  try {
    dp::load_state_dict(*model, stream, dp::safetensors::read(path));
  } catch (const dp::Error&) {
  }
  return 0;
}
