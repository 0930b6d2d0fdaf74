// elementwise.cu — launchers for the elementwise and row-reduction kernels.
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/elementwise.h"
#include "dp/kernels/ops.h"

namespace dp::kernels {

void fill(const Stream& stream, float* x, index_t n, float value) {
  launch(stream, "fill", n, Fill{x, value}, {operand(x, n)});
}

void axpy(const Stream& stream, index_t n, float alpha, const float* x, float* y) {
  launch(stream, "axpy", n, Axpy{alpha, x, y}, {operand(x, n), operand(y, n)});
}

void scale(const Stream& stream, index_t n, float alpha, float* x) {
  launch(stream, "scale", n, Scale{alpha, x}, {operand(x, n)});
}

void to_bf16_scaled(const Stream& stream, index_t n, const float* x, float scale, std::uint16_t* y) {
  launch(stream, "to_bf16_scaled", n, ToBf16Scaled{x, scale, y}, {operand(x, n), operand(y, n)});
}

void from_bf16(const Stream& stream, index_t n, const std::uint16_t* x, float* y) {
  launch(stream, "from_bf16", n, FromBf16{x, y}, {operand(x, n), operand(y, n)});
}

void to_bf16(const Stream& stream, index_t n, const float* x, std::uint16_t* y) {
  launch(stream, "to_bf16", n, ToBf16{x, y}, {operand(x, n), operand(y, n)});
}

void round_to_bf16(const Stream& stream, index_t n, const float* x, float* y) {
  launch(stream, "round_to_bf16", n, RoundToBf16{x, y}, {operand(x, n), operand(y, n)});
}

void add_bf16_rounded(const Stream& stream, index_t n, In x, float* y, bool accumulate) {
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "add_bf16_rounded", n, AddBf16Rounded<T>{x.as<T>(), y, accumulate},
           {operand(x.as<T>(), n), operand(y, n)});
  });
}

namespace {

// A kernel of three operands, each fp32 or bf16: Op<A, B, O>.
template <template <class, class, class> class Op>
void launch_binary(const Stream& stream, const char* name, index_t n, In a, In b, Out out) {
  with_storage(a.bf16, [&](auto ta) {
    with_storage(b.bf16, [&](auto tb) {
      with_storage(out.bf16, [&](auto to) {
        using A = decltype(ta);
        using B = decltype(tb);
        using O = decltype(to);
        const A* pa = a.as<A>();
        const B* pb = b.as<B>();
        O* po = out.as<O>();
        launch(stream, name, n, Op<A, B, O>{pa, pb, po}, {operand(pa, n), operand(pb, n), operand(po, n)});
      });
    });
  });
}

}  // namespace

void add(const Stream& stream, index_t n, In a, In b, Out out) { launch_binary<Add>(stream, "add", n, a, b, out); }

void add_relu(const Stream& stream, index_t n, In a, In b, Out out) {
  launch_binary<AddRelu>(stream, "add_relu", n, a, b, out);
}

void relu_forward(const Stream& stream, index_t n, In x, Out y) {
  checks::same_storage("relu_forward", {x.bf16, y.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "relu_forward", n, ReluForward<T>{x.as<T>(), y.as<T>()},
           {operand(x.as<T>(), n), operand(y.as<T>(), n)});
  });
}

void relu_backward(const Stream& stream, index_t n, In y, In dy, Out dx) {
  checks::same_storage("relu_backward", {y.bf16, dy.bf16, dx.bf16});
  with_storage(y.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "relu_backward", n, ReluBackward<T>{y.as<T>(), dy.as<T>(), dx.as<T>()},
           {operand(y.as<T>(), n), operand(dy.as<T>(), n), operand(dx.as<T>(), n)});
  });
}

void row_sum(const Stream& stream, index_t rows, index_t cols, const float* x, float* out, float beta) {
  launch_row_reduce<float>(stream, "row_sum", rows, cols, RowElement<float>{x, cols}, StoreSum{out, beta},
                           {operand(x, rows * cols), operand(out, rows)});
}

void column_sum(const Stream& stream, index_t rows, index_t cols, In x, float* out, float beta) {
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_row_reduce<float>(stream, "column_sum", cols, rows, ColumnElement<T>{x.as<T>(), cols}, StoreSum{out, beta},
                             {operand(x.as<T>(), rows * cols), operand(out, cols)});
  });
}

void channel_sum(const Stream& stream, index_t n, index_t channels, index_t plane, In x, float* out, float beta) {
  kernel_api::check_extents("channel_sum", n, plane);
  const index_t count = n * plane;
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_row_reduce<float>(stream, "channel_sum", channels, count,
                             ChannelValue<T>{ChannelElement{channels, plane}, x.as<T>()}, StoreSum{out, beta},
                             {operand(x.as<T>(), count * channels), operand(out, channels)});
  });
}

void sum_of_squares(const Stream& stream, index_t n, const float* x, float* out) {
  launch_row_reduce<float>(stream, "sum_of_squares", 1, n, SquareElement{x}, StoreSum{out, 0.0f},
                           {operand(x, n), operand(out, 1)});
}

void clip_coefficient(const Stream& stream, index_t count, const float* squares, float max_norm, float* norm_coef) {
  launch(stream, "clip_coefficient", 1, ClipCoefficient{squares, count, max_norm, norm_coef},
         {operand(squares, count), operand(norm_coef, 2)});
}

void scale_by(const Stream& stream, index_t n, const float* factor, float* x) {
  launch(stream, "scale_by", n, ScaleBy{factor, x}, {operand(factor, 1), operand(x, n)});
}

}  // namespace dp::kernels
