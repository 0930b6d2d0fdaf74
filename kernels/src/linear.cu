// linear.cu — launchers for dp/kernels/linear.h: three GEMMs, a bias broadcast and a column sum.
// Row-major throughout; gemm's trans flags express the transposes without copying.
#include <algorithm>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/ops.h"

namespace dp::kernels {
namespace {
// Negative extents of a (n, in) -> (n, out) linear layer.
void check_linear(const char* op, int n, int in, int out) {
  if (n < 0 || in < 0 || out < 0) checks::fail({op, ": negative extent n=", n, " in=", in, " out=", out});
}
}  // namespace

void linear_forward(const Stream& stream, int n, int in, int out, In x, In weight, const float* bias, Out y) {
  check_linear("linear_forward", n, in, out);
  const index_t y_elements = static_cast<index_t>(n) * out;
  float beta = 0.0f;
  if (bias != nullptr) {
    with_storage(y.bf16, [&](auto t) {
      using T = decltype(t);
      launch(stream, "linear_bias", y_elements, BroadcastBias<T>{bias, out, y.as<T>()},
             {operand(bias, out), operand(y.as<T>(), y_elements)});
    });
    beta = 1.0f;
  }
  // y (n, out) = x (n, in) · W^T: W is stored (out, in), so op(B) = transpose with ldb = in.
  // Leading dimensions are at least 1 even for an empty extent, as BLAS requires.
  gemm(stream, false, true, n, out, in, 1.0f, x, std::max(in, 1), weight, std::max(in, 1), beta, y, std::max(out, 1));
}

void linear_backward(const Stream& stream, int n, int in, int out, In x, In weight, In dy, Out dx, Out dweight,
                     float* dbias, bool accumulate) {
  check_linear("linear_backward", n, in, out);
  checks::same_storage("linear_backward", {x.bf16, weight.bf16, dy.bf16});
  checks::present("linear_backward", {{"dweight", dweight.data}});
  if (dweight.bf16 && accumulate) checks::fail({"linear_backward: a bf16 dweight is written, not accumulated"});
  const int ld_in = std::max(in, 1), ld_out = std::max(out, 1);
  // beta 0 stores the product and the sums as they are; beta 1 adds them to what the gradients
  // hold. Either way the same terms are summed in the same order: 0 + g is g.
  const float beta = accumulate ? 1.0f : 0.0f;
  // dW (out, in) (+)= dy^T (out, n) · x (n, in)
  gemm(stream, true, false, out, in, n, 1.0f, dy, ld_out, x, ld_in, beta, dweight, ld_in);
  // db (out) (+)= column sums of dy (n, out)
  if (dbias != nullptr) column_sum(stream, n, out, dy, dbias, beta);
  // dx (n, in) = dy (n, out) · W (out, in)
  if (dx) gemm(stream, false, false, n, in, out, 1.0f, dy, ld_out, weight, ld_in, 0.0f, dx, ld_in);
}

}  // namespace dp::kernels
