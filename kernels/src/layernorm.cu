// layernorm.cu — launchers for dp/kernels/layernorm.h: two row reductions for the statistics (mean,
// then centred moments), one for the backward's row sums, one column reduction for the parameter
// gradients, and elementwise passes for y and dx. Where a row is reduced in one chunk (rows of up to
// kReduceMinChunk values, or many rows) a row's reductions and its elementwise pass run in one
// launch (launch_row_fused: the same sums, the row read once).
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
    with_storage(y.bf16, [&](auto u) {
      using T = decltype(t);
      using U = decltype(u);
      const T* xs = x.as<T>();
      const RowElement<T> sum{xs, cols};
      const BnStoreMean store_mean{mean, 1.0f / static_cast<float>(cols)};
      const LnRowMoments<T> moments{xs, cols, mean};
      const LnStoreRstd store_rstd{rstd, static_cast<float>(cols), eps};
      const LnNormalize<T, U> normalize{cols, xs, mean, rstd, gamma, beta, y.as<U>()};
      if (row_fusable(rows, cols)) {  // a row's statistics and outputs in one pass over it
        launch_row_fused<float, SumPair>(stream, "layernorm_forward", rows, cols, sum, store_mean, moments, store_rstd,
                                         normalize,
                                         {operand(xs, total), operand(mean, rows), operand(rstd, rows),
                                          operand(gamma, cols), operand(beta, cols), operand(y.as<U>(), total)});
        return;
      }
      launch_row_reduce<float>(stream, "layernorm_mean", rows, cols, sum, store_mean,
                               {operand(xs, total), operand(mean, rows)});
      launch_row_reduce<SumPair>(stream, "layernorm_variance", rows, cols, moments, store_rstd,
                                 {operand(xs, total), operand(mean, rows), operand(rstd, rows)});
      launch_2d(stream, "layernorm_normalize", rows, cols, normalize,
                {operand(xs, total), operand(mean, rows), operand(rstd, rows), operand(gamma, cols),
                 operand(beta, cols), operand(y.as<U>(), total)});
    });
  });
}

void layernorm_backward(const Stream& stream, index_t rows, index_t cols, In x, const float* gamma, const float* mean,
                        const float* rstd, In dy, Out dx, float* dgamma, float* dbeta, float* row_sums, bool accumulate,
                        In dx_add, Out dx_rounded) {
  const char* op = "layernorm_backward";
  check_layernorm(op, rows, cols);
  checks::same_storage(op, {x.bf16, dx ? dx.bf16 : x.bf16, dx_add ? dx_add.bf16 : x.bf16});
  if (dx_rounded && (!dx || dx.bf16 || !dx_rounded.bf16))
    checks::fail({op, ": dx_rounded is a bf16 copy of an fp32 dx"});
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
      const LnGradTerms<T, D> terms{xs, dys, gamma, mean, rstd, cols};
      const LnStoreRowSums store_sums{rows, row_sums};
      const T* add = dx_add.as<T>();
      auto* rounded = dx_rounded.as<std::uint16_t>();
      const LnInputGrad<T, D> input_grad{
          rows, cols, xs, dys, gamma, mean, rstd, row_sums, 1.0f / static_cast<float>(cols), dx.as<T>(), add, rounded};
      if (row_fusable(rows, cols)) {  // a row's sums and its gradient in one pass over it
        launch_row_fused<SumPair>(stream, "layernorm_backward_input", rows, cols, terms, store_sums, NoRowReduce{},
                                  NoRowReduce{}, input_grad,
                                  {operand(xs, total), operand(dys, total), operand(gamma, cols), operand(mean, rows),
                                   operand(rstd, rows), operand(row_sums, 2 * rows), operand(dx.as<T>(), total),
                                   operand(add, add ? total : 0), operand(rounded, rounded ? total : 0)});
        return;
      }
      launch_row_reduce<SumPair>(stream, "layernorm_backward_sums", rows, cols, terms, store_sums,
                                 {operand(xs, total), operand(dys, total), operand(gamma, cols), operand(mean, rows),
                                  operand(rstd, rows), operand(row_sums, 2 * rows)});
      launch_2d(stream, "layernorm_backward_dx", rows, cols, input_grad,
                {operand(xs, total), operand(dys, total), operand(gamma, cols), operand(mean, rows),
                 operand(rstd, rows), operand(row_sums, 2 * rows), operand(dx.as<T>(), total),
                 operand(add, add ? total : 0), operand(rounded, rounded ? total : 0)});
    });
  });
}

}  // namespace dp::kernels
