// dp/nn/tensor.h — named, typed views of device memory: how a model shows its parameters,
// gradients and buffers to the engine (and to checkpoints) without giving up its flat buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dp/runtime/shape.h"

namespace dp {

// i32: token ids, a language model's input.
enum class DType { f32, i64, i32 };
inline std::size_t dtype_size(DType dtype) { return dtype == DType::i64 ? 8 : 4; }
inline const char* dtype_name(DType dtype) { return dtype == DType::f32 ? "F32" : dtype == DType::i64 ? "I64" : "I32"; }

// A view: it does not own `data`. Shape in PyTorch order (e.g. Linear weight (out, in)).
// Whether `name` is `prefix` or lies under it ("layer1" holds "layer1.0.weight", not
// "layer10.weight"): how parameters are picked by prefix (frozen ones, ...).
inline bool is_under(const std::string& name, const std::string& prefix) {
  return name == prefix ||
         (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 && name[prefix.size()] == '.');
}

struct TensorRef {
  std::string name;  // PyTorch state-dict name, e.g. "layer1.0.weight"
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  void* data = nullptr;  // device memory of `device`
  int device = -1;
  std::size_t offset = 0;  // elements from the start of the flat buffer it lives in

  std::size_t numel() const { return dp::numel(shape); }
  std::size_t bytes() const { return numel() * dtype_size(dtype); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace dp
