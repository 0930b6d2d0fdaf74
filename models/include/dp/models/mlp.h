// dp/models/mlp.h — the reference MLP: Flatten -> fc1 Linear(784, h1) -> ReLU -> ... -> fcK Linear(h_last, 10),
// with PyTorch's parameter names (fc1.weight, fc1.bias, ...) and default initialisation.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dp/nn/model.h"

namespace dp::models {

// hidden = sizes of the hidden layers ({256, 256} by default); inputs are (N, 1, 28, 28).
// dropout > 0 puts a Dropout(dropout) ("drop1", ...; no parameters) after each hidden ReLU.
std::unique_ptr<Model> make_mlp(Device& device, const std::vector<int>& hidden = {256, 256}, std::uint64_t seed = 0,
                                double dropout = 0.0);

}  // namespace dp::models
