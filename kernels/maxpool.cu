// maxpool.cu — launchers for kernels/maxpool.h: one thread per output forward, one thread per
// input backward (a gather over the windows covering it).
#include <limits>
#include <string>

#include "dp/error.h"
#include "kernels/launch.h"
#include "kernels/elementwise.h"
#include "kernels/maxpool.h"

namespace dp::kernels {
namespace {

std::string describe(const MaxPoolShape& s) {
  return "(N=" + std::to_string(s.n) + ", C=" + std::to_string(s.c) + ", H=" + std::to_string(s.h) +
         ", W=" + std::to_string(s.w) + ", kernel=" + std::to_string(s.kernel) +
         ", stride=" + std::to_string(s.stride) + ", pad=" + std::to_string(s.pad) + ")";
}

// PyTorch's own checks (max_pool2d_with_indices): beyond them a window could hold only padding,
// and h_out() would round a negative extent toward zero instead of rejecting it.
void check_shape(const char* name, const MaxPoolShape& s) {
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(std::string(name) + ": " + why + " in shape " + describe(s));
  };
  if (s.n < 0 || s.c < 0 || s.h < 0 || s.w < 0) fail("negative extent");
  if (s.kernel < 1 || s.stride < 1) fail("kernel and stride must be positive");
  if (s.pad < 0 || s.pad > s.kernel / 2) fail("pad must be in [0, kernel/2]");
  if (s.h + 2 * s.pad < s.kernel || s.w + 2 * s.pad < s.kernel) fail("output size is too small");
  // argmax is int32 per plane.
  if (static_cast<index_t>(s.h) * s.w > std::numeric_limits<std::int32_t>::max()) fail("plane too large for argmax");
}

}  // namespace

void maxpool_forward(const Stream& stream, const MaxPoolShape& shape, const float* x, float* y, std::int32_t* argmax) {
  check_shape("maxpool_forward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  launch_2d(stream, "maxpool_forward", planes * shape.h_out(), shape.w_out(), MaxPoolForward{shape, x, y, argmax},
         {operand(x, in), operand(y, out), operand(argmax, out)});
}

void maxpool_backward(const Stream& stream, const MaxPoolShape& shape, const std::int32_t* argmax, const float* dy,
                      float* dx) {
  check_shape("maxpool_backward", shape);
  const index_t planes = static_cast<index_t>(shape.n) * shape.c;
  const index_t in = planes * shape.h * shape.w, out = planes * shape.h_out() * shape.w_out();
  if (shape.stride >= shape.kernel) {
    // Windows do not overlap: every input is chosen by at most one output, so zeroing dx and
    // scattering one value per output is race-free, and 4x less work than the general gather.
    launch(stream, "maxpool_backward_zero", in, Fill{dx, 0.0f}, {operand(dx, in)});
    launch(stream, "maxpool_backward", out, MaxPoolScatterBackward{shape, argmax, dy, dx},
           {operand(argmax, out), operand(dy, out), operand(dx, in)});
    return;
  }
  launch(stream, "maxpool_backward", in, MaxPoolBackward{shape, argmax, dy, dx},
         {operand(argmax, out), operand(dy, out), operand(dx, in)});
}

}  // namespace dp::kernels
