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

void avgpool_forward(const Stream& stream, const AvgPoolShape& shape, const float* x, float* y) {
  checks::pool2d("avgpool_forward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  launch_2d(stream, "avgpool_forward", planes * shape.h_out(), shape.w_out(), AvgPoolForward{shape, x, y},
            {operand(x, in), operand(y, out)});
}

void avgpool_backward(const Stream& stream, const AvgPoolShape& shape, const float* dy, float* dx) {
  checks::pool2d("avgpool_backward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  launch_2d(stream, "avgpool_backward", planes * shape.h, shape.w, AvgPoolBackward{shape, dy, dx},
            {operand(dy, out), operand(dx, in)});
}

void global_avgpool_forward(const Stream& stream, int n, int c, int hw, const float* x, float* y) {
  check_global_avgpool("global_avgpool_forward", n, c, hw);
  const index_t planes = static_cast<index_t>(n) * c;
  launch(stream, "global_avgpool_forward", planes, GlobalAvgPoolForward{hw, x, y},
         {operand(x, planes * hw), operand(y, planes)});
}

void global_avgpool_backward(const Stream& stream, int n, int c, int hw, const float* dy, float* dx) {
  check_global_avgpool("global_avgpool_backward", n, c, hw);
  const index_t planes = static_cast<index_t>(n) * c;
  launch_2d(stream, "global_avgpool_backward", planes, hw, GlobalAvgPoolBackward{hw, dy, dx},
            {operand(dy, planes), operand(dx, planes * hw)});
}

}  // namespace dp::kernels
