// dp/kernels/storage.h — how a kernel holds an activation or its gradient: fp32, or bf16 as its 16
// bits (autocast). A kernel reads either as fp32 (a bf16 value widens exactly), computes in fp32 and
// rounds once where it stores bf16 (to nearest even, as CUDA's __float2bfloat16_rn): the values of
// widening into fp32 scratch, computing, and rounding back, without the fp32 copies' traffic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dp/kernels/platform.h"
#include "dp/runtime/bfloat16.h"

namespace dp::kernels {

DP_HD inline float load(const float* p, index_t i) { return p[i]; }
DP_HD inline float load(const std::uint16_t* p, index_t i) { return bf16_to_float(p[i]); }
DP_HD inline void store(float* p, index_t i, float v) { p[i] = v; }
DP_HD inline void store(std::uint16_t* p, index_t i, float v) { p[i] = bf16_from_float(v); }

// A tensor an entry point reads: fp32, or bf16 bits; null for an absent optional one.
struct In {
  const void* data = nullptr;
  bool bf16 = false;
  In() = default;
  In(std::nullptr_t) {}
  In(const float* p) : data(p) {}
  In(const std::uint16_t* p) : data(p), bf16(p != nullptr) {}
  In(const void* p, bool is_bf16) : data(p), bf16(is_bf16) {}
  explicit operator bool() const { return data != nullptr; }
  template <class T>
  const T* as() const {
    return static_cast<const T*>(data);
  }
  std::size_t element_size() const { return bf16 ? 2 : 4; }
};

// A tensor an entry point writes.
struct Out {
  void* data = nullptr;
  bool bf16 = false;
  Out() = default;
  Out(std::nullptr_t) {}
  Out(float* p) : data(p) {}
  Out(std::uint16_t* p) : data(p), bf16(p != nullptr) {}
  Out(void* p, bool is_bf16) : data(p), bf16(is_bf16) {}
  explicit operator bool() const { return data != nullptr; }
  operator In() const { return In(data, bf16); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  std::size_t element_size() const { return bf16 ? 2 : 4; }
};

// f(T{}) with T the storage type the flag names: std::uint16_t (bf16 bits) or float.
template <class F>
decltype(auto) with_storage(bool bf16, F&& f) {
  if (bf16) return f(std::uint16_t{});
  return f(float{});
}

}  // namespace dp::kernels
