// dp/runtime/shape.h — element counts and printing of shapes: one of each, for every layer above the runtime
// (kernels' shape structs, tensors, checkpoints, data sets).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace dp {

// Product of the extents (1 for the empty shape of a scalar). Throws InvalidArgument for a negative
// extent or a product that does not fit in size_t, so a forged shape cannot wrap around.
std::size_t numel(std::span<const std::int64_t> shape);

// "[2, 3, 4]", as PyTorch prints a torch.Size.
std::string format_shape(std::span<const std::int64_t> shape);

// "(N=2, C=3, H=4, W=4)": a shape whose extents have names (the kernels' shape structs).
std::string format_dims(std::initializer_list<std::pair<std::string_view, std::int64_t>> dims);

}  // namespace dp
