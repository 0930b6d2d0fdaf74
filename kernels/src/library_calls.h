// library_calls.h — what the launchers call in the kernels' backend folders: cuBLAS GEMM and the
// cuDNN convolutions (cuda/), the oneDNN convolutions (sim/). No CUDA or oneDNN types here, so every
// launcher compiles with any compiler; builds without the cuda backend link cuda/stub.cpp instead,
// where cudnn_available() is false.
#pragma once

#include <cstdint>

#include "dp/kernels/conv2d.h"
#include "dp/runtime/device.h"

namespace dp::kernels::library {

// Row-major C(m,n) = alpha * op(A)(m,k) * op(B)(k,n) + beta * C, validated by kernels::gemm.
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const void* a = nullptr;  // fp32, or bf16 bits with bf16_storage
  int lda = 0;
  const void* b = nullptr;
  int ldb = 0;
  float beta = 0.0f;
  void* c = nullptr;  // fp32, or bf16 bits with c_bf16 (only with bf16_storage operands)
  int ldc = 0;
  bool bf16_operands = false;  // A and B are fp32 words holding bf16 values (kernels::Bf16Operands)
  bool bf16_storage = false;   // A and B are bf16 bits (autocast's storage)
  bool c_bf16 = false;         // C is bf16 bits
  // `batch` such products, operand i of each `stride_*` elements after operand i - 1 (strided batched).
  int batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

void cublas_gemm(const Stream& stream, const GemmArgs& args);

bool cudnn_available();
// Whether cuDNN has a plan for `shape` on bf16 storage on the stream's GPU: an algorithm of dp's
// strict order in each direction (asked once per shape and GPU, then remembered). Where it has none,
// autocast widens the convolution to fp32 (conv2d_supports_bf16).
bool cudnn_supports_bf16(const Stream& stream, const Conv2dShape& shape);

// The shared path's weight gradient, enqueued on the stream the caller bound: dweight = the gradient
// for input x and output gradient dy (beta 0). Given to the cuDNN calls so that a plan, when it is
// built, can time it against cuDNN's backward-filter algorithm; empty where the shape is beyond the
// shared path's int range (cuDNN then always computes the weight gradient). It borrows the callable
// it is made from, which must outlive the call it is given to.
class GemmWeightGrad {
 public:
  GemmWeightGrad() = default;
  template <class F>
  explicit GemmWeightGrad(const F& f)
      : target_(&f), call_([](const void* target, const float* x, const float* dy, float* dweight) {
          (*static_cast<const F*>(target))(x, dy, dweight);
        }) {}
  explicit operator bool() const { return call_ != nullptr; }
  void operator()(const float* x, const float* dy, float* dweight) const { call_(target_, x, dy, dweight); }

 private:
  const void* target_ = nullptr;
  void (*call_)(const void*, const float*, const float*, float*) = nullptr;
};

void cudnn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                          const float* bias, float* y, const GemmWeightGrad& gemm);
// dx (when not null) and, unless the weight gradient goes to `gemm` (returns true: forced by `how`,
// or `timed` and gemm was clearly faster when the plan was built), dweight (added to with
// `accumulate`, else overwritten); the caller then runs the shared path for dweight itself, outside
// this call's hold on the cuDNN handle. The bias gradient is the launchers' own reduction.
bool cudnn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                           const float* dy, float* dx, float* dweight, bool accumulate, ConvWeightGrad how,
                           const GemmWeightGrad& gemm);

// bf16 storage on cuda (cuDNN's bf16 convolutions, fp32 compute on tensor cores): y = conv(x,
// weight) rounded once, no bias; dx (when not null) bf16, and dweight fp32 (the bf16 gradient cuDNN
// writes, widened: overwritten, or added to with `accumulate`). The plans' algorithms follow the
// fp32 rules (strict: the fixed orders, deterministic backward; fast: timed); the weight gradient
// never goes to the shared path.
void cudnn_conv2d_forward_bf16(const Stream& stream, const Conv2dShape& shape, const void* x, const void* weight,
                               void* y);
void cudnn_conv2d_backward_bf16(const Stream& stream, const Conv2dShape& shape, const void* x, const void* weight,
                                const void* dy, void* dx, float* dweight, bool accumulate);

// The sim's convolution library (sim/onednn_conv.cpp), enqueued on the sim stream: y = conv(x, weight)
// + bias (bias may be null); dx (when not null) and dweight (when not null; added to with
// `accumulate`, else overwritten). The bias gradient is the launchers' own reduction. With `bf16`,
// x, weight, y, dy and dx are bf16 bits (autocast's storage): computed in fp32 on their values, y
// and dx rounded once; dweight is fp32 either way. Return false, having enqueued nothing, where
// oneDNN has no implementation for the shape: the caller then runs the shared path.
// Whether oneDNN has a convolution for `shape` (its plan, built and cached on first ask).
bool onednn_supports(const Conv2dShape& shape, bool bf16 = false);
bool onednn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, bool bf16, const void* x, const void* weight,
                           const float* bias, void* y);
bool onednn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, bool bf16, const void* x,
                            const void* weight, const void* dy, void* dx, float* dweight, bool accumulate);

}  // namespace dp::kernels::library
