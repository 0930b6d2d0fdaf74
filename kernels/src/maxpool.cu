// maxpool.cu — launchers for dp/kernels/maxpool.h: one thread per output forward, one thread per
// input backward (a gather over the windows covering it, which also writes the zeros).
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/maxpool.h"

namespace dp::kernels {

void maxpool_forward(const Stream& stream, const MaxPoolShape& shape, const float* x, float* y, std::int32_t* argmax) {
  checks::maxpool("maxpool_forward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  launch_2d(stream, "maxpool_forward", planes * shape.h_out(), shape.w_out(), MaxPoolForward{shape, x, y, argmax},
            {operand(x, in), operand(y, out), operand(argmax, out)});
}

void maxpool_backward(const Stream& stream, const MaxPoolShape& shape, const std::int32_t* argmax, const float* dy,
                      float* dx) {
  checks::maxpool("maxpool_backward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  // One gather per input, whatever the windows: no zero fill first. Without overlap (stride >=
  // kernel) each input has at most one covering window, so the gather reads one argmax.
  launch(stream, "maxpool_backward", in, MaxPoolBackward{shape, argmax, dy, dx},
         {operand(argmax, out), operand(dy, out), operand(dx, in)});
}

}  // namespace dp::kernels
