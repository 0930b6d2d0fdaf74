// avgpool.cu — launchers for dp/kernels/avgpool.h: one thread per output forward, one per input
// backward (a gather over the windows covering it); the global pool one thread per plane forward.
#include "checks.h"
#include "dp/kernels/avgpool.h"
#include "dp/kernels/detail/launch.h"

namespace dp::kernels {
namespace {
// n, c >= 0 and a non-empty plane.
void check_global_avgpool(const char* op, int n, int c, int hw) {
  if (n < 0 || c < 0 || hw < 1)
    checks::fail({op, ": need n, c >= 0 and a non-empty plane, got n=", n, " c=", c, " hw=", hw});
}
}  // namespace

void avgpool_forward(const Stream& stream, const AvgPoolShape& shape, In x, Out y) {
  checks::pool2d("avgpool_forward", shape);
  checks::same_storage("avgpool_forward", {x.bf16, y.bf16});
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "avgpool_forward", planes * shape.h_out(), shape.w_out(),
              AvgPoolForward<T>{shape, x.as<T>(), y.as<T>()}, {operand(x.as<T>(), in), operand(y.as<T>(), out)});
  });
}

void avgpool_backward(const Stream& stream, const AvgPoolShape& shape, In dy, Out dx) {
  checks::pool2d("avgpool_backward", shape);
  checks::same_storage("avgpool_backward", {dy.bf16, dx.bf16});
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  with_storage(dy.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "avgpool_backward", planes * shape.h, shape.w, AvgPoolBackward<T>{shape, dy.as<T>(), dx.as<T>()},
              {operand(dy.as<T>(), out), operand(dx.as<T>(), in)});
  });
}

void global_avgpool_forward(const Stream& stream, int n, int c, int hw, In x, Out y) {
  check_global_avgpool("global_avgpool_forward", n, c, hw);
  checks::same_storage("global_avgpool_forward", {x.bf16, y.bf16});
  const index_t planes = static_cast<index_t>(n) * c;
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "global_avgpool_forward", planes, GlobalAvgPoolForward<T>{hw, x.as<T>(), y.as<T>()},
           {operand(x.as<T>(), planes * hw), operand(y.as<T>(), planes)});
  });
}

void global_avgpool_backward(const Stream& stream, int n, int c, int hw, In dy, Out dx) {
  check_global_avgpool("global_avgpool_backward", n, c, hw);
  checks::same_storage("global_avgpool_backward", {dy.bf16, dx.bf16});
  const index_t planes = static_cast<index_t>(n) * c;
  with_storage(dy.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "global_avgpool_backward", planes, hw, GlobalAvgPoolBackward<T>{hw, dy.as<T>(), dx.as<T>()},
              {operand(dy.as<T>(), planes), operand(dx.as<T>(), planes * hw)});
  });
}

}  // namespace dp::kernels
