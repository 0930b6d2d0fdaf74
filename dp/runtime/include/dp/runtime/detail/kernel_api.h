// dp/runtime/detail/kernel_api.h — everything kernel code needs from the runtime, and nothing more: operand
// checks, host-side execution on a simulated stream, the native stream and the device's library
// handles on cuda, and the one check macro for CUDA library calls. Kernels reach streams only
// through these functions; the backends' internals stay private to the runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>

#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "dp/runtime/precision.h"
#include "dp/runtime/trace.h"

// Kernel arithmetic is written once and compiled by nvcc for the GPU and by the host compiler
// for the simulator.
#if defined(__CUDACC__)
#define DP_HD __host__ __device__
#else
#define DP_HD
#endif

namespace dp::kernel_api {

// A memory range a kernel reads or writes.
struct Operand {
  const void* ptr;
  std::size_t bytes;
};
template <class T>
Operand operand(const T* ptr, std::int64_t count) {
  return Operand{ptr, static_cast<std::size_t>(count) * sizeof(T)};
}

// Throws DeviceMismatch naming `op` unless every non-empty operand lies inside one allocation of the
// stream's device. The sim checks every operand (a GPU would fault or read garbage); cuda trusts
// the hardware.
void check_operands(const Stream& stream, const char* op, std::initializer_list<Operand> operands);

// Counts a launch's memory traffic on the stream's device (Runtime::memory_traffic): every operand's
// bytes once, under `kernel` (a string literal). Every launcher calls it once per launch it enqueues.
void count_traffic(const Stream& stream, const char* kernel, std::initializer_list<Operand> operands);

// Throws InvalidArgument naming `op` for a negative extent.
void check_extents(const char* op, std::int64_t rows, std::int64_t cols = 0);

// sim: runs `body` on the stream's thread in stream order, traced as `kind`; an exception it throws
// fails the stream, as a faulting kernel poisons a CUDA context. cuda: throws (kernels launch
// natively there; reaching this means the launch site was not compiled by nvcc).
void enqueue_host(const Stream& stream, const char* name, std::function<void()> body, SpanKind kind = SpanKind::kernel);

// cuda: the cudaStream_t of `stream`; sim: nullptr.
void* native_handle(const Stream& stream);
// cuda: multiprocessors of the stream's device (launch grid sizing); sim: 1.
int multiprocessor_count(const Stream& stream);
// cuda, right before a native kernel launch into `stream`: makes its device current on the
// calling thread (a launch into a stream of another device fails), counts the launch
// (Runtime::counters) and, while profiling, opens the kernel's span named `name` (a string
// literal). sim counts and traces in enqueue_host.
void begin_launch(const Stream& stream, const char* name = "kernel");
// cuda, right after the launch: closes the span begin_launch opened (nothing when not profiling).
void end_launch(const Stream& stream);

// The precision policy of the stream's runtime (RuntimeOptions::precision): what the cuDNN
// convolutions may trade for speed. The sim computes the same for both.
Precision precision(const Stream& stream);

// The CUDA libraries whose handles the runtime owns: one handle of each per stream, created on the
// stream's first call into that library and bound to it once (cublasSetStream / cudnnSetStream),
// so calls on different streams never share a handle or its workspace.
enum class Library { cublas, cudnn };

// A library handle lent to one call on a stream, held exclusively for the call (a handle is not
// safe for concurrent use). `cache` is the caller's per-device state for that library (cuDNN
// plans), shared by the device's streams and held exclusively with the handle: empty at first,
// destroyed with the device. `workspace(bytes)` is the stream's grow-only device scratch for that
// library: at least `bytes` (nullptr for 0), reallocated only when a call needs more than ever
// before (a new shape: plan time, not per call); stream order keeps its users from overlapping.
// `temporary(bytes)` is device memory for this call only (an algorithm search's operands): stream
// ordered from the device's pool (a cudaFree would wait for the whole device, maybe for another
// worker's collective), freed behind the call's work on the stream when the last owner goes, and
// counted in the device's MemoryStats meanwhile. Null for 0 bytes.
struct LibraryCall {
  void* handle;
  std::shared_ptr<void>& cache;
  std::function<void*(std::size_t)> workspace;
  std::function<std::shared_ptr<void>(std::size_t)> temporary;
};
// cuda only: runs fn with the stream's device current and its `library` handle; sim: throws.
void with_library(const Stream& stream, Library library, const std::function<void(LibraryCall&)>& fn);

// cuda only: the stream's grow-only device scratch for kernel temporaries (a two-stage reduction's
// partial sums): at least `bytes`, reallocated only when a launch needs more than ever before (a
// new shape, in warm-up; never inside a capture once warm), so no launch allocates. Stream order
// keeps consecutive users from overlapping; one launcher holds one such buffer at a time. sim: throws
// (its kernels keep temporaries in their host bodies).
void* kernel_scratch(const Stream& stream, std::size_t bytes);

}  // namespace dp::kernel_api

namespace dp::cuda {

// Throws dp::Error carrying file:line, the call as written and the library's error string.
[[noreturn]] void throw_call_error(const char* library, int code, const char* message, const char* call,
                                   const char* file, int line);

// Specialised for each CUDA library's status type in dp/runtime/cuda_status.h (cudart, cuBLAS,
// cuDNN, NCCL), which only code built against the CUDA toolkit includes.
template <class Status>
struct StatusTraits;

template <class Status>
void check(Status status, const char* call, const char* file, int line) {
  using Traits = StatusTraits<Status>;
  if (status == Traits::success) return;
  if constexpr (requires { Traits::reported(); }) Traits::reported();
  throw_call_error(Traits::library, static_cast<int>(status), Traits::message(status), call, file, line);
}

}  // namespace dp::cuda

// The one macro every CUDA / cuBLAS / cuDNN / NCCL call goes through.
#define DP_CUDA_CHECK(call) ::dp::cuda::check((call), #call, __FILE__, __LINE__)
