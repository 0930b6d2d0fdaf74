// gelu.cu — launchers for dp/kernels/gelu.h: one thread per element.
#include "checks.h"
#include "dp/kernels/detail/launch.h"
#include "dp/kernels/gelu.h"

namespace dp::kernels {

void gelu_forward(const Stream& stream, index_t n, GeluForm form, In x, Out y) {
  kernel_api::check_extents("gelu_forward", n);
  checks::same_storage("gelu_forward", {x.bf16, y.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "gelu_forward", n, GeluForward<T>{form, x.as<T>(), y.as<T>()},
           {operand(x.as<T>(), n), operand(y.as<T>(), n)});
  });
}

void gelu_backward(const Stream& stream, index_t n, GeluForm form, In x, In dy, Out dx) {
  kernel_api::check_extents("gelu_backward", n);
  checks::same_storage("gelu_backward", {x.bf16, dy.bf16, dx.bf16});
  with_storage(x.bf16, [&](auto t) {
    using T = decltype(t);
    launch(stream, "gelu_backward", n, GeluBackward<T>{form, x.as<T>(), dy.as<T>(), dx.as<T>()},
           {operand(x.as<T>(), n), operand(dy.as<T>(), n), operand(dx.as<T>(), n)});
  });
}

}  // namespace dp::kernels
