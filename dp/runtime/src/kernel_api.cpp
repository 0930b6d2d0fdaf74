// kernel_api.cpp — dp/runtime/kernel_api.h over the backends' stream interface.
#include "dp/runtime/kernel_api.h"

#include <fmt/format.h>

#include "backend.h"

namespace dp::kernel_api {

using detail::Access;

void check_operands(const Stream& stream, const char* op, std::initializer_list<Operand> operands) {
  detail::StreamImpl& s = Access::stream(stream);
  for (const Operand& o : operands)
    if (o.bytes != 0) s.check_access(o.ptr, o.bytes, op);
}

void check_extents(const char* op, std::int64_t rows, std::int64_t cols) {
  if (rows < 0 || cols < 0) throw InvalidArgument(fmt::format("{}: negative extent {}x{}", op, rows, cols));
}

void enqueue_host(const Stream& stream, const char* name, std::function<void()> body, SpanKind kind) {
  Access::stream(stream).enqueue_kernel(name, std::move(body), kind);
}

void* native_handle(const Stream& stream) { return Access::stream(stream).native_handle(); }
int multiprocessor_count(const Stream& stream) { return Access::stream(stream).multiprocessor_count(); }
void begin_launch(const Stream& stream, const char* name) {
  detail::StreamImpl& s = Access::stream(stream);
  s.make_current();
  s.count(detail::Counter::launches);
  s.begin_span(name, SpanKind::kernel);
}
void end_launch(const Stream& stream) { Access::stream(stream).end_span(); }

Precision precision(const Stream& stream) { return Access::stream(stream).runtime().precision(); }

void* kernel_scratch(const Stream& stream, std::size_t bytes) { return Access::stream(stream).kernel_scratch(bytes); }

void with_library(const Stream& stream, Library library, const std::function<void(LibraryCall&)>& fn) {
  detail::StreamImpl& s = Access::stream(stream);
  s.count(detail::Counter::launches);  // one library call: a GEMM, a convolution
  s.with_library(library, fn);
}

}  // namespace dp::kernel_api

namespace dp::cuda {

void throw_call_error(const char* library, int code, const char* message, const char* call, const char* file,
                      int line) {
  throw Error(fmt::format("{}:{}: {} error {} ({}) in {}", file, line, library, code, message, call));
}

}  // namespace dp::cuda
