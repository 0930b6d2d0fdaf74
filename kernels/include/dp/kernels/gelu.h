// dp/kernels/gelu.h — torch.nn.GELU, forward and backward, in both of torch's forms: the exact one
// (approximate='none', x * Phi(x) with erf) and the tanh approximation GPT-2 uses
// (approximate='tanh'), written as torch's CPU kernels write them (aten/src/ATen/native/cpu/
// Activation.cpp), with erf, tanh and exp from portable_math.h (within 2 ulps), so cuda and sim give
// the same bits and the sim's loops vectorise; torch's CPU kernel uses its own vectorised erf, tanh
// and exp, so torch and dp agree within a few ulps. Activations are fp32 or bf16 storage
// (storage.h), computed in fp32.
#pragma once

#include <cmath>

#include "dp/kernels/platform.h"
#include "dp/kernels/portable_math.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

enum class GeluForm { exact, tanh };

void gelu_forward(const Stream& stream, index_t n, GeluForm form, In x, Out y);
// dx = dy * gelu'(x) (dx may be dy's buffer).
void gelu_backward(const Stream& stream, index_t n, GeluForm form, In x, In dy, Out dx);

// ------------------------------------------------------------------------------------------------
// functors

// sqrt(2 / pi) = M_SQRT2 * M_2_SQRTPI * 0.5 and 1 / sqrt(2 pi) = M_2_SQRTPI * M_SQRT1_2 * 0.5, as
// torch forms them (in float).
constexpr float kGeluTanhBeta = 0.7978845608028654f;
constexpr float kGeluKappa = 0.044715f;
constexpr float kGeluPdfScale = 0.3989422804014327f;
constexpr float kSqrtHalf = 0.7071067811865476f;

DP_HD inline float gelu(float x, GeluForm form) {
  if (form == GeluForm::tanh) {
    const float inner = kGeluTanhBeta * (x + kGeluKappa * x * x * x);
    return 0.5f * x * (1.0f + tanh_portable(inner));
  }
  return x * 0.5f * (1.0f + erf_portable(x * kSqrtHalf));
}

DP_HD inline float gelu_grad(float x, float dy, GeluForm form) {
  if (form == GeluForm::tanh) {
    const float x_sq = x * x;
    const float x_cube = x_sq * x;
    const float inner = kGeluTanhBeta * (x + kGeluKappa * x_cube);
    const float tanh_inner = tanh_portable(inner);
    const float left = 0.5f * x;
    const float right = 1.0f + tanh_inner;
    const float left_derivative = 0.5f * right;
    const float right_derivative =
        left * ((1.0f - tanh_inner * tanh_inner) * (kGeluTanhBeta * (1.0f + 3.0f * kGeluKappa * x_sq)));
    return dy * (left_derivative + right_derivative);
  }
  const float cdf = 0.5f * (1.0f + erf_portable(x * kSqrtHalf));
  const float pdf = exp_portable(-0.5f * x * x) * kGeluPdfScale;
  return dy * (cdf + x * pdf);
}

// The sim chooses the form once per launch (host_run), not per element: a loop whose body holds
// both forms is vectorised by computing both and selecting, which doubled GELU's time on the host.
// Each element is the same call with the same form as operator(), so the bits are the same.
template <class T>
struct GeluForward {
  GeluForm form;
  const T* x;
  T* y;
  DP_HD void operator()(index_t i) const { store(y, i, gelu(load(x, i), form)); }
  void host_run(index_t n) const {
    if (form == GeluForm::tanh)
      for (index_t i = 0; i < n; ++i) store(y, i, gelu(load(x, i), GeluForm::tanh));
    else
      for (index_t i = 0; i < n; ++i) store(y, i, gelu(load(x, i), GeluForm::exact));
  }
};

template <class T>
struct GeluBackward {
  GeluForm form;
  const T* x;
  const T* dy;
  T* dx;
  DP_HD void operator()(index_t i) const { store(dx, i, gelu_grad(load(x, i), load(dy, i), form)); }
  void host_run(index_t n) const {
    if (form == GeluForm::tanh)
      for (index_t i = 0; i < n; ++i) store(dx, i, gelu_grad(load(x, i), load(dy, i), GeluForm::tanh));
    else
      for (index_t i = 0; i < n; ++i) store(dx, i, gelu_grad(load(x, i), load(dy, i), GeluForm::exact));
  }
};

}  // namespace dp::kernels
