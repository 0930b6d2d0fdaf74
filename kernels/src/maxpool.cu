// maxpool.cu — launchers for dp/kernels/maxpool.h: one thread per output forward, one thread per
// input backward (a gather over the windows covering it, which also writes the zeros).
#include <limits>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/maxpool.h"

namespace dp::kernels {
namespace {
// pool2d, and a plane small enough for int32 argmax.
void check_maxpool(const char* op, const Pool2dShape& s) {
  checks::pool2d(op, s);
  if (static_cast<std::int64_t>(s.h) * s.w > std::numeric_limits<std::int32_t>::max())
    checks::fail({op, ": plane too large for argmax in shape ", checks::describe(s)});
}
}  // namespace

void maxpool_forward(const Stream& stream, const MaxPoolShape& shape, In x, Out y, std::int32_t* argmax) {
  check_maxpool("maxpool_forward", shape);
  checks::same_storage("maxpool_forward", {x.bf16, y.bf16});
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch_2d(stream, "maxpool_forward", planes * shape.h_out(), shape.w_out(),
              MaxPoolForward<T>{shape, x.as<T>(), y.as<T>(), argmax},
              {operand(x.as<T>(), in), operand(y.as<T>(), out), operand(argmax, out)});
  });
}

void maxpool_backward(const Stream& stream, const MaxPoolShape& shape, const std::int32_t* argmax, In dy, Out dx) {
  check_maxpool("maxpool_backward", shape);
  checks::same_storage("maxpool_backward", {dy.bf16, dx.bf16});
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  // One gather per input, whatever the windows: no zero fill first. Without overlap (stride >=
  // kernel) each input has at most one covering window, so the gather reads one argmax.
  with_storage(dy.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "maxpool_backward", in, MaxPoolBackward<T>{shape, argmax, dy.as<T>(), dx.as<T>()},
           {operand(argmax, out), operand(dy.as<T>(), out), operand(dx.as<T>(), in)});
  });
}

}  // namespace dp::kernels
