// kernel_api.cpp — dp/runtime/kernel_api.h over the backends' stream interface.
#include "dp/runtime/detail/kernel_api.h"

#include <fmt/format.h>
#include <string>
#include <string_view>
#include <utility>

#include "backend.h"

namespace dp::kernel_api {

using detail::Access;

void check_operands(const Stream& stream, const char* op, std::initializer_list<Operand> operands) {
  detail::StreamImpl& s = Access::stream(stream);
  for (const Operand& o : operands)
    if (o.bytes != 0) s.check_access(o.ptr, o.bytes, op);
}

void count_traffic(const Stream& stream, const char* kernel, std::initializer_list<Operand> operands) {
  std::uint64_t bytes = 0;
  for (const Operand& o : operands) bytes += o.bytes;
  detail::StreamImpl& s = Access::stream(stream);
  s.runtime().count_traffic(s.device(), kernel, bytes);
}

void check_extents(const char* op, std::int64_t rows, std::int64_t cols) {
  if (rows < 0 || cols < 0) throw InvalidArgument(fmt::format("{}: negative extent {}x{}", op, rows, cols));
}

void enqueue_host(const Stream& stream, const char* name, std::function<void()> body, SpanKind kind) {
  Access::stream(stream).enqueue_kernel(name, std::move(body), kind);
}

void* native_handle(const Stream& stream) { return Access::stream(stream).native_handle(); }
int multiprocessor_count(const Stream& stream) { return Access::stream(stream).multiprocessor_count(); }
namespace {
// The device that was current on this thread before begin_launch made the stream's current (-1:
// it already was), put back by end_launch: a launch from a thread that drives several devices
// (a caller's thread, a test) leaves its current device as it found it.
thread_local int t_device_before_launch = -1;
}  // namespace

void begin_launch(const Stream& stream, const char* name) {
  detail::StreamImpl& s = Access::stream(stream);
  s.restore_current(std::exchange(t_device_before_launch, -1));  // a launch that failed left it set
  t_device_before_launch = s.make_current();
  s.count(detail::Counter::launches);
  s.begin_span(name, SpanKind::kernel);
}
void end_launch(const Stream& stream) {
  detail::StreamImpl& s = Access::stream(stream);
  struct Restore {
    detail::StreamImpl& s;
    ~Restore() { s.restore_current(std::exchange(t_device_before_launch, -1)); }
  } restore{s};
  s.end_span();
}

Precision precision(const Stream& stream) { return Access::stream(stream).runtime().precision(); }

void* kernel_scratch(const Stream& stream, std::size_t bytes) { return Access::stream(stream).kernel_scratch(bytes); }

void with_library(const Stream& stream, Library library, const std::function<void(LibraryCall&)>& fn) {
  detail::StreamImpl& s = Access::stream(stream);
  s.count(detail::Counter::launches);  // one library call: a GEMM, a convolution
  s.with_library(library, fn);
}

}  // namespace dp::kernel_api

namespace dp::cuda {

// The stream-capture errors of the CUDA runtime (cudaError_t 900-908), by what they mean to the
// engine: the capture asked for something a graph cannot hold (it falls back to eager work), or the
// caller ended or used a capture the wrong way (a bug, as on the simulator). docs/cuda-rules.md.
namespace {
enum class CaptureErrorKind { none, capture, misuse, fatal };
CaptureErrorKind classify_cuda_error(int code) {
  switch (code) {
    // The errors after which, the CUDA documentation says, "any further CUDA work will return the
    // same error": the device is lost to this process (DeviceLost).
    case 214:  // cudaErrorECCUncorrectable
    case 700:  // cudaErrorIllegalAddress
    case 710:  // cudaErrorAssert
    case 714:  // cudaErrorHardwareStackError
    case 715:  // cudaErrorIllegalInstruction
    case 716:  // cudaErrorMisalignedAddress
    case 717:  // cudaErrorInvalidAddressSpace
    case 718:  // cudaErrorInvalidPc
    case 719:  // cudaErrorLaunchFailure
      return CaptureErrorKind::fatal;
    case 900:  // cudaErrorStreamCaptureUnsupported: not permitted while the stream captures
    case 901:  // cudaErrorStreamCaptureInvalidated: an earlier error invalidated the capture
    case 902:  // cudaErrorStreamCaptureMerge: two independent captures would merge
    case 904:  // cudaErrorStreamCaptureUnjoined: a fork never joined the origin stream
    case 905:  // cudaErrorStreamCaptureIsolation: a dependency across the capture's boundary
    case 906:  // cudaErrorStreamCaptureImplicit: an implicit dependency from the legacy stream
    case 907:  // cudaErrorCapturedEvent: an event last recorded inside a capture
      return CaptureErrorKind::capture;
    case 903:  // cudaErrorStreamCaptureUnmatched: the capture was not begun on this stream
    case 908:  // cudaErrorStreamCaptureWrongThread: ended on another thread than it began on
      return CaptureErrorKind::misuse;
    default: return CaptureErrorKind::none;
  }
}
}  // namespace

void throw_call_error(const char* library, int code, const char* message, const char* call, const char* file,
                      int line) {
  const std::string what = fmt::format("{}:{}: {} error {} ({}) in {}", file, line, library, code, message, call);
  const auto kind = std::string_view(library) == "CUDA" ? classify_cuda_error(code) : CaptureErrorKind::none;
  if (kind == CaptureErrorKind::capture) throw CaptureError(what);
  if (kind == CaptureErrorKind::misuse) throw InvalidArgument(what);
  if (kind == CaptureErrorKind::fatal) throw DeviceLost(-1, what + ": the GPU is lost to this process");
  throw Error(what);
}

}  // namespace dp::cuda
