// dropout.cu — launchers for dp/kernels/dropout.h: one thread per block of four elements (one
// Philox call each); the backward is the forward applied to the gradient.
#include <cmath>

#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/dropout.h"
#include "dp/kernels/elementwise.h"

namespace dp::kernels {
namespace {
// p in [0, 1] (torch's check; `!(p >= 0 && p <= 1)` also rejects NaN), n >= 0, element_offset >= 0.
void check_dropout(const char* op, std::int64_t n, double p, std::int64_t element_offset) {
  if (!(p >= 0.0 && p <= 1.0)) checks::fail({op, ": dropout probability has to be between 0 and 1, but got ", p});
  if (n < 0 || element_offset < 0)
    checks::fail({op, ": need n >= 0 and element_offset >= 0, got n=", n, " element_offset=", element_offset});
}
}  // namespace

namespace {

void apply(const Stream& stream, const char* op, index_t n, double p, const DropoutKey& key, index_t element_offset,
           In x, Out y) {
  check_dropout(op, n, p, element_offset);
  checks::same_storage(op, {x.bf16, y.bf16});
  if (p == 0.0) {  // torch returns the input itself: no draw, no rounding
    with_storage(x.bf16, [&](auto t) {
      using T = decltype(t);
      launch(stream, op, n, Copy<T>{x.as<T>(), y.as<T>()}, {operand(x.as<T>(), n), operand(y.as<T>(), n)});
    });
    return;
  }
  const std::uint32_t threshold = dropout_threshold(p);
  const float noise_kept = dropout_noise_kept(p);
  const auto first_block = static_cast<std::uint64_t>(element_offset / 4);
  const index_t blocks = n == 0 ? 0 : (element_offset + n - 1) / 4 - element_offset / 4 + 1;
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, op, blocks,
           DropoutApply<T>{key, threshold, noise_kept, element_offset, n, first_block, x.as<T>(), y.as<T>()},
           {operand(x.as<T>(), n), operand(y.as<T>(), n), operand(key.step_on_device, key.step_on_device ? 1 : 0)});
  });
}

}  // namespace

void dropout_forward(const Stream& stream, index_t n, double p, const DropoutKey& key, index_t element_offset, In x,
                     Out y) {
  apply(stream, "dropout_forward", n, p, key, element_offset, x, y);
}

void dropout_backward(const Stream& stream, index_t n, double p, const DropoutKey& key, index_t element_offset, In dy,
                      Out dx) {
  apply(stream, "dropout_backward", n, p, key, element_offset, dy, dx);
}

}  // namespace dp::kernels
