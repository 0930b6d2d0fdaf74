// dp/kernels/ops.h — the kernel entry points the engine and models call. Non-template, so callers compile
// with the host compiler; the launches inside are compiled by nvcc when the cuda backend exists.
// Every pointer must be memory of the stream's device (checked on sim). Sizes are element counts.
#pragma once

#include "dp/kernels/platform.h"
#include "dp/kernels/storage.h"
#include "dp/runtime/device.h"

namespace dp::kernels {

void fill(const Stream& stream, float* x, index_t n, float value);
void axpy(const Stream& stream, index_t n, float alpha, const float* x, float* y);  // y += alpha*x
void scale(const Stream& stream, index_t n, float alpha, float* x);                 // x *= alpha
// DDP's bf16 gradient compression (dp/kernels/elementwise.h: ToBf16Scaled, FromBf16):
// y = bf16(bf16(x) * scale), as bits; and back, x = float(y).
void to_bf16_scaled(const Stream& stream, index_t n, const float* x, float scale, std::uint16_t* y);
void from_bf16(const Stream& stream, index_t n, const std::uint16_t* x, float* y);
// Autocast (dp/kernels/elementwise.h: ToBf16, RoundToBf16, AddBf16Rounded): y = bf16(x) as bits;
// y = float(bf16(x)); y = float(bf16(x)), added to y when `accumulate`.
void to_bf16(const Stream& stream, index_t n, const float* x, std::uint16_t* y);
void round_to_bf16(const Stream& stream, index_t n, const float* x, float* y);
void add_bf16_rounded(const Stream& stream, index_t n, In x, float* y, bool accumulate);
// Activations (storage.h): add's and add_relu's operands each fp32 or bf16; relu's all of one type.
void add(const Stream& stream, index_t n, In a, In b, Out out);
void relu_forward(const Stream& stream, index_t n, In x, Out y);
void relu_backward(const Stream& stream, index_t n, In y, In dy, Out dx);
// out = relu(a + b) in one pass: add then relu_forward's bits (a residual block's sum and ReLU).
void add_relu(const Stream& stream, index_t n, In a, In b, Out out);

// out[r] = beta*out[r] + sum_c x[r, c] for a (rows, cols) row-major x.
void row_sum(const Stream& stream, index_t rows, index_t cols, const float* x, float* out, float beta = 0.0f);
// out[c] = beta*out[c] + sum_r x[r, c]   (bias gradients: sum over the batch)
void column_sum(const Stream& stream, index_t rows, index_t cols, In x, float* out, float beta = 0.0f);
// out[c] = beta*out[c] + sum_{n,j} x[n, c, j] for an (n, channels, plane) NCHW x (convolution bias
// gradients). The same terms in the same order as row_sum over x permuted to (channels, n*plane).
void channel_sum(const Stream& stream, index_t n, index_t channels, index_t plane, In x, float* out, float beta = 0.0f);

// torch.nn.utils.clip_grad_norm_ on the device (dp/nn/clip.h): out[0] = sum of x^2 over n (the
// row_sum plan: the same bits on both backends); from `count` such sums (one per tensor), norm_coef
// = {the total norm, min(1, max_norm / (norm + 1e-6))} (ClipCoefficient); x *= *factor.
void sum_of_squares(const Stream& stream, index_t n, const float* x, float* out);
void clip_coefficient(const Stream& stream, index_t count, const float* squares, float max_norm, float* norm_coef);
void scale_by(const Stream& stream, index_t n, const float* factor, float* x);

// x with 10 explicit mantissa bits (TF32), rounded to nearest with ties away from zero, as PTX's
// cvt.rna.tf32.f32 and CUTLASS's float -> tfloat32_t convert; infinities and NaNs unchanged.
// What Precision::tf32 does to both GEMM operands on the sim (cuBLAS's TF32 tensor cores on cuda).
float round_to_tf32(float x);

// While one is alive on a thread, the GEMMs and convolutions that thread enqueues take operands that
// are bf16 values held in fp32 (autocast's: Linear and Conv2d round their inputs and weights first).
// The cuda backend then runs every GEMM on bf16 tensor cores (cublasGemmEx with
// CUBLAS_COMPUTE_32F_FAST_16BF: the down-conversion of a bf16 value is exact, the products are exact
// and accumulate in fp32) and the convolutions as im2col + such GEMMs instead of cuDNN's fp32 ones:
// the same arithmetic as the sim's fp32 GEMM of those values, up to the summation order. No effect
// on sim.
class Bf16Operands {
 public:
  Bf16Operands();
  ~Bf16Operands();
  Bf16Operands(const Bf16Operands&) = delete;
  Bf16Operands& operator=(const Bf16Operands&) = delete;
  static bool active();

 private:
  bool previous_;
};

// Row-major C(m,n) = alpha * op(A) * op(B) + beta * C, op = transpose when trans_*.
// lda/ldb/ldc are row strides of A, B, C as stored. cuBLAS on cuda, OpenBLAS on sim. A and B are
// both fp32 or both bf16 storage (autocast: bf16 tensor cores on cuda, fp32 accumulation; the sim
// widens them, exactly, for OpenBLAS's sgemm); C is fp32, or with bf16 operands also bf16 storage:
// alpha * A B + beta * C computed in fp32 and rounded once to bf16, as cuBLAS's bf16 output (and
// torch's autocast addmm) gives it, without an fp32 copy of C in memory.
void gemm(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, In a, int lda, In b,
          int ldb, float beta, Out c, int ldc);
// `batch` GEMMs of one shape in one call, the i-th on A + i * stride_a, B + i * stride_b and
// C + i * stride_c (strides in elements): cuBLAS's strided batched GEMM on cuda (one launch), the
// same sgemm per product on the sim. gemm is the batch of one.
void gemm_batched(const Stream& stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha, In a, int lda,
                  std::int64_t stride_a, In b, int ldb, std::int64_t stride_b, float beta, Out c, int ldc,
                  std::int64_t stride_c, int batch);

}  // namespace dp::kernels
