// dp/checkpoint.h — a model's state dict (parameters + buffers, PyTorch names, no "module." prefix)
// to and from safetensors. Loading accepts "module."-prefixed names and checks every tensor.
#pragma once

#include <string>

#include "dp/io/safetensors.h"
#include "dp/nn/model.h"

namespace dp {

// Copies parameters and buffers to the host (waits for `stream`) as safetensors tensors.
safetensors::File state_dict(const Model& model, const Stream& stream);

// Loads every parameter and buffer of `model` from `file` (names optionally prefixed with
// `prefix`, e.g. "init."; "module." prefixes are accepted too). Throws dp::Error naming the tensor
// when one is missing or has the wrong dtype or shape; nothing is written to the model then.
void load_state_dict(Model& model, const Stream& stream, const safetensors::File& file, const std::string& prefix = "");

}  // namespace dp
