// layernorm.cu — launchers for dp/kernels/layernorm.h: two row reductions for the statistics (mean,
// then centred moments), one for the backward's row sums, one column reduction for the parameter
// gradients, and elementwise passes for y and dx.
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/layernorm.h"

namespace dp::kernels {
namespace {

void check_layernorm(const char* op, index_t rows, index_t cols) {
  if (rows < 0 || cols < 1)
    checks::fail({op, ": need rows >= 0 and at least one value per row, got rows=", static_cast<long long>(rows),
                  " cols=", static_cast<long long>(cols)});
}

}  // namespace

void layernorm_forward(const Stream& stream, index_t rows, index_t cols, In x, const float* gamma, const float* beta,
                       Out y, float* mean, float* rstd, float eps) {
  const char* op = "layernorm_forward";
  check_layernorm(op, rows, cols);
  if (!(eps >= 0.0f)) checks::fail({op, ": eps must be >= 0, got ", eps});
  checks::present(op, {{"x", x.data}, {"gamma", gamma}, {"beta", beta}, {"y", y.data}, {"mean", mean}, {"rstd", rstd}});
  const index_t total = rows * cols;
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    const T* xs = x.as<T>();
    launch_row_reduce<float>(stream, "layernorm_mean", rows, cols, RowElement<T>{xs, cols},
                             BnStoreMean{mean, 1.0f / static_cast<float>(cols)},
                             {operand(xs, total), operand(mean, rows)});
    launch_row_reduce<SumPair>(stream, "layernorm_variance", rows, cols, LnRowMoments<T>{xs, cols, mean},
                               LnStoreRstd{rstd, static_cast<float>(cols), eps},
                               {operand(xs, total), operand(mean, rows), operand(rstd, rows)});
    with_storage(y.bf16, [&](auto u) {
      using U = decltype(u);
      launch_2d(stream, "layernorm_normalize", rows, cols,
                LnNormalize<T, U>{cols, xs, mean, rstd, gamma, beta, y.as<U>()},
                {operand(xs, total), operand(mean, rows), operand(rstd, rows), operand(gamma, cols),
                 operand(beta, cols), operand(y.as<U>(), total)});
    });
  });
}

void layernorm_backward(const Stream& stream, index_t rows, index_t cols, In x, const float* gamma, const float* mean,
                        const float* rstd, In dy, Out dx, float* dgamma, float* dbeta, float* row_sums,
                        bool accumulate) {
  const char* op = "layernorm_backward";
  check_layernorm(op, rows, cols);
  checks::same_storage(op, {x.bf16, dx ? dx.bf16 : x.bf16});
  checks::present(op, {{"x", x.data},
                       {"gamma", gamma},
                       {"mean", mean},
                       {"rstd", rstd},
                       {"dy", dy.data},
                       {"dgamma", dgamma},
                       {"dbeta", dbeta},
                       {"row_sums", row_sums}});
  const index_t total = rows * cols;
  with_storage(x.bf16, [&](auto t) {
    with_storage(dy.bf16, [&](auto d) {
      using T = decltype(t);
      using D = decltype(d);
      const T* xs = x.as<T>();
      const D* dys = dy.as<D>();
      launch_row_reduce<SumPair>(stream, "layernorm_backward_params", cols, rows,
                                 LnParamTerms<T, D>{xs, dys, mean, rstd, cols},
                                 LnStoreParamGrads{dgamma, dbeta, accumulate},
                                 {operand(xs, total), operand(dys, total), operand(mean, rows), operand(rstd, rows),
                                  operand(dgamma, cols), operand(dbeta, cols)});
      if (!dx) return;
      launch_row_reduce<SumPair>(stream, "layernorm_backward_sums", rows, cols,
                                 LnGradTerms<T, D>{xs, dys, gamma, mean, rstd, cols}, LnStoreRowSums{rows, row_sums},
                                 {operand(xs, total), operand(dys, total), operand(gamma, cols), operand(mean, rows),
                                  operand(rstd, rows), operand(row_sums, 2 * rows)});
      launch_2d(stream, "layernorm_backward_dx", rows, cols,
                LnInputGrad<T, D>{rows, cols, xs, dys, gamma, mean, rstd, row_sums, 1.0f / static_cast<float>(cols),
                                  dx.as<T>()},
                {operand(xs, total), operand(dys, total), operand(gamma, cols), operand(mean, rows),
                 operand(rstd, rows), operand(row_sums, 2 * rows), operand(dx.as<T>(), total)});
    });
  });
}

}  // namespace dp::kernels
