// dp/nn/batch.h — a batch of samples in host memory, as the data loader hands it out and the engines
// take it: `size` inputs (size x the model's input_shape elements: f32 features, or i32 token ids)
// and their int64 class targets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "dp/nn/tensor.h"
#include "dp/runtime/error.h"

namespace dp {

// What inputs of `dtype` are, for messages: "f32 features", "i32 token ids".
inline const char* input_kind(DType dtype) {
  return dtype == DType::f32 ? "f32 features" : dtype == DType::i32 ? "i32 token ids" : "i64 values";
}

// Where a batch's inputs are, and what they are: f32 features (an image, a vector) or i32 token ids
// (a language model's sequence), as Model::input_dtype() says. Host or device memory alike: it
// only carries the type along with the address, so that ids stay integers from the data source to
// the embedding. Both are four bytes an element, so the engines stage either as bytes.
// Const for what is read (Inputs), writable for what a data source fills (InputsOut).
template <class Void>
class TypedInputs {
 public:
  using Float = std::conditional_t<std::is_const_v<Void>, const float, float>;
  using Id = std::conditional_t<std::is_const_v<Void>, const std::int32_t, std::int32_t>;

  TypedInputs() = default;
  TypedInputs(std::nullptr_t) {}
  TypedInputs(Float* features) : data_(features), dtype_(DType::f32) {}
  TypedInputs(Id* ids) : data_(ids), dtype_(DType::i32) {}
  TypedInputs(Void* data, DType dtype) : data_(data), dtype_(dtype) {}
  // A writable view read as it is.
  template <class Other>
  requires(std::is_const_v<Void> && !std::is_const_v<Other>) TypedInputs(const TypedInputs<Other>& other)
      : data_(other.data()), dtype_(other.dtype()) {}

  Void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  explicit operator bool() const { return data_ != nullptr; }
  // The typed pointer, for code that takes only one type: throws InvalidArgument for the other.
  Float* features() const { return static_cast<Float*>(as(DType::f32)); }
  Id* ids() const { return static_cast<Id*>(as(DType::i32)); }
  // The inputs `elements` further on (a later sample's).
  TypedInputs advanced(std::size_t elements) const {
    using Byte = std::conditional_t<std::is_const_v<Void>, const std::byte, std::byte>;
    return {data_ ? static_cast<Byte*>(data_) + elements * dtype_size(dtype_) : nullptr, dtype_};
  }

 private:
  Void* as(DType dtype) const {
    if (dtype != dtype_)
      throw InvalidArgument(std::string("inputs of ") + input_kind(dtype_) + " where " + input_kind(dtype) +
                            " were expected");
    return data_;
  }
  Void* data_ = nullptr;
  DType dtype_ = DType::f32;
};
using Inputs = TypedInputs<const void>;
using InputsOut = TypedInputs<void>;

struct Batch {
  Batch() = default;
  Batch(Inputs inputs, const std::int64_t* targets, int size, std::shared_ptr<const void> lease = {})
      : inputs(inputs), targets(targets), size(size), lease(std::move(lease)) {}

  Inputs inputs;
  const std::int64_t* targets = nullptr;  // may be null where only a forward runs
  int size = 0;
  // Lends the memory beyond the call, as a pinned tensor copied with non_blocking=True (and
  // record_stream) does in PyTorch. Empty: a training step reads `inputs` and `targets` before it
  // returns (it copies them into its own pinned staging on the host). Set, with both in pinned
  // memory of the engine's runtime (Runtime::is_pinned): the step copies straight from them to its
  // devices on a copy stream, with no host copy, and keeps a copy of `lease` until those copies have
  // run (it lets go at a later submission, at synchronize(), or when it goes away). The memory must
  // stay allocated and unchanged while any copy of the lease lives: its deleter is where the owner
  // learns that it may be reused (BatchLoader's batches come with one).
  std::shared_ptr<const void> lease;
};

}  // namespace dp
