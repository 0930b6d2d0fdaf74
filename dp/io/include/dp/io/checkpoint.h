// dp/io/checkpoint.h — a model's state dict (parameters + buffers, PyTorch names, no "module." prefix)
// to and from safetensors. Loading accepts "module."-prefixed names and checks every tensor.
#pragma once

#include <string>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/nn/model.h"

namespace dp {

// Copies parameters and buffers to the host (waits for `stream`) as safetensors tensors.
safetensors::File state_dict(const Model& model, const Stream& stream);

// What a load found, as torch's load_state_dict returns it (missing_keys, unexpected_keys).
struct StateDictKeys {
  std::vector<std::string> missing;     // the model's tensors the file lacks (left as they were)
  std::vector<std::string> unexpected;  // the file's tensors (under the prefix) the model has no place for
  bool module_prefix = false;           // names carried DataParallel's "module." prefix
};

// Loads the parameters and buffers of `model` from `file` (names optionally prefixed with
// `prefix`, e.g. "init."; "module." prefixes are accepted too). strict (torch's strict=True):
// every model tensor must be there and every tensor under the prefix must be the model's, a
// training checkpoint's optimizer state ("optimizer.*") aside. Not strict: what matches is loaded,
// the rest reported. Either way a tensor with the wrong dtype or shape, a non-finite value or an
// invalid buffer throws dp::Error naming it, and nothing is written to the model then.
StateDictKeys load_state_dict(Model& model, const Stream& stream, const safetensors::File& file,
                              const std::string& prefix = "", bool strict = true);

}  // namespace dp
