// cudnn_conv.cpp — the cuDNN convolution path of cuda streams (cuDNN v9 legacy API), host code only.
// Each stream's cuDNN handle and workspace are the runtime's; the plans per (shape, precision) are
// cached per GPU for the process (See Note [shared plans], cuda_backend.cpp): in strict chosen by a
// fixed order, in fast and tf32 by timing, once, during warm-up.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cudnn.h>
#include <fmt/format.h>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>

#include "dp/kernels/ops.h"
#include "dp/runtime/detail/cuda_status.h"
#include "dp/runtime/detail/kernel_api.h"
#include "library_calls.h"

namespace dp::kernels::library {
namespace {

// Scratch beyond this is not worth taking from the activations; such algorithms are skipped.
constexpr std::size_t kMaxWorkspaceBytes = std::size_t{256} << 20;

// Precision::strict: the results must match the fp32 host path within rounding, so only algorithms
// that compute plain fp32 dot products qualify: no TF32 / tensor-op math, no FFT or Winograd
// transforms (whose error is not bounded by the dot-product length). Backward ones must also be
// deterministic: replicas of a data-parallel model must see bit-identical gradients for identical
// inputs. Precision::fast takes any algorithm, as PyTorch's cudnn.benchmark does.
// bf16 storage (autocast): tensor-op math on bf16 operands is exact products summed in fp32 (no
// conversion of fp32 data: that is CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION, never asked for).
bool exact_math(cudnnMathType_t math) {
  return math == CUDNN_DEFAULT_MATH || math == CUDNN_FMA_MATH || math == CUDNN_TENSOR_OP_MATH;
}
bool dot_product(cudnnConvolutionFwdAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM || algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         algo == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || algo == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
bool dot_product(cudnnConvolutionBwdDataAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
}
bool dot_product(cudnnConvolutionBwdFilterAlgo_t algo) {
  return algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
         algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

template <class Perf>
bool qualifies(const Perf& p, Precision precision, bool need_deterministic) {
  if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxWorkspaceBytes) return false;
  if (precision == Precision::fast || precision == Precision::tf32) return true;
  return exact_math(p.mathType) && dot_product(p.algo) && (!need_deterministic || p.determinism == CUDNN_DETERMINISTIC);
}

// The algorithm chosen for one direction and the math type to run it with.
template <class Algo>
struct Choice {
  Algo algo;
  cudnnMathType_t math;
};

// Precision::strict chooses without timing, so every runtime, process and virtual device picks the
// same algorithms for a shape on a GPU, and their bits agree: the first algorithm of each list that
// cuDNN supports for the shape within kMaxWorkspaceBytes, with FMA math. Only plain fp32 dot products
// qualify (no TF32, FFT or Winograd), and backward ones must be deterministic: cuDNN's BWD_DATA_ALGO_0
// and BWD_FILTER_ALGO_0 and _3 accumulate with atomics, so data and weight gradients have one each.
// Forward: IMPLICIT_GEMM first, measured faster than PRECOMP_GEMM on an H100 (../shared/perf/H100.md).
constexpr cudnnConvolutionFwdAlgo_t kStrictForward[] = {
    CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
    CUDNN_CONVOLUTION_FWD_ALGO_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_DIRECT};
// bf16 storage: IMPLICIT_PRECOMP_GEMM first, the forward algorithm cuDNN runs on tensor cores for
// half-precision data (its legacy API's tensor-op list: IMPLICIT_PRECOMP_GEMM forward, BWD_DATA_ALGO_1,
// BWD_FILTER_ALGO_1); IMPLICIT_GEMM, first for fp32, would keep the convolution off them.
constexpr cudnnConvolutionFwdAlgo_t kStrictForwardBf16[] = {
    CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
    CUDNN_CONVOLUTION_FWD_ALGO_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_DIRECT};
constexpr cudnnConvolutionBwdDataAlgo_t kStrictData[] = {CUDNN_CONVOLUTION_BWD_DATA_ALGO_1};
constexpr cudnnConvolutionBwdFilterAlgo_t kStrictFilter[] = {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1};

// The first candidate that qualifies (cudnnFind*Ex lists them fastest first), else `fallback` with
// the plan's exact math (supported for every 2-D shape).
template <class Perf, class Algo>
Choice<Algo> pick(const Perf* perf, int count, Precision precision, bool need_deterministic, Algo fallback,
                  cudnnMathType_t fallback_math) {
  for (int i = 0; i < count; ++i)
    if (qualifies(perf[i], precision, need_deterministic)) return {perf[i].algo, perf[i].mathType};
  return {fallback, fallback_math};
}

// The largest workspace among the heuristics' candidates that could qualify: what cudnnFind*Ex is
// given, so it can time each of them.
template <class Perf>
std::size_t find_workspace_bytes(const Perf* perf, int count, Precision precision, bool need_deterministic) {
  std::size_t bytes = 0;
  for (int i = 0; i < count; ++i)
    if (qualifies(perf[i], precision, need_deterministic)) bytes = std::max(bytes, perf[i].memory);
  return bytes;
}

// Device memory for the duration of a plan's algorithm search (cudnnFind*Ex needs real operands):
// the call's stream-ordered temporary (kernel_api::LibraryCall::temporary), counted in the
// device's MemoryStats. Stream-ordered because a plan is built in a forward that may run while
// other workers launch collectives (DDP's buffer broadcast, SyncBatchNorm), and a cudaFree waits
// for the whole device: the known way to hang NCCL.
class FindBuffer {
 public:
  FindBuffer(kernel_api::LibraryCall& call, std::size_t bytes, cudaStream_t stream) : memory_(call.temporary(bytes)) {
    // Finite inputs: no NaN slow paths in the timings. On the search's stream: a cudaMemset would
    // go to the legacy stream, which the runtime's non-blocking streams do not wait for.
    if (memory_) DP_CUDA_CHECK(cudaMemsetAsync(memory_.get(), 0, bytes, stream));
  }
  void* data() const { return memory_.get(); }

 private:
  std::shared_ptr<void> memory_;  // freed behind the search's work on the stream
};

// Descriptors and algorithms for one (shape, precision); immutable once built, shared by the
// device's streams (cuDNN only reads descriptors). One convolution descriptor per direction: each
// carries the math type of the algorithm found for it (TF32 may win one direction and not another).
struct Plan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv_fwd = nullptr, conv_bwd_data = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;  // the weight gradient's
  cudnnConvolutionFwdAlgo_t fwd = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  cudnnConvolutionBwdDataAlgo_t bwd_data = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
  std::size_t fwd_bytes = 0, bwd_data_bytes = 0, bwd_filter_bytes = 0;
  // Whether ConvWeightGrad::timed leaves the weight gradient to the shared im2col + cuBLAS path.
  bool weight_grad_by_gemm = false;
  // x, w and y are bf16 (autocast's storage): computed in fp32 on tensor cores.
  bool bf16 = false;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // never throws: a failed destroy leaks a descriptor at worst
    for (cudnnConvolutionDescriptor_t c : {conv, conv_bwd_data, conv_fwd})
      if (c) cudnnDestroyConvolutionDescriptor(c);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (bias) cudnnDestroyTensorDescriptor(bias);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
  std::size_t workspace_bytes() const { return std::max({fwd_bytes, bwd_data_bytes, bwd_filter_bytes}); }
};

void make_conv_descriptor(cudnnConvolutionDescriptor_t& conv, const Conv2dShape& s, cudnnMathType_t math) {
  DP_CUDA_CHECK(cudnnCreateConvolutionDescriptor(&conv));
  // PyTorch's Conv2d is a cross-correlation (the kernel is not flipped).
  DP_CUDA_CHECK(cudnnSetConvolution2dDescriptor(conv, s.pad, s.pad, s.stride, s.stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
  DP_CUDA_CHECK(cudnnSetConvolutionMathType(conv, math));
}

// A CUDA event for timing, destroyed with its scope.
class TimingEvent {
 public:
  TimingEvent() { DP_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~TimingEvent() { cudaEventDestroy(event_); }  // never throws from a destructor
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Whether `challenger` is clearly faster than `incumbent`, both enqueued on `stream`: each runs once
// untimed (first-call costs: cuBLAS's heuristics, module loading), then they alternate, timed one
// run at a time, and the best of each counts (noise only ever adds time). "Clearly": by 10 %, so
// that near-ties keep the incumbent rather than flip between runs and devices. Waits for the stream.
template <class Challenger, class Incumbent>
bool clearly_faster(cudaStream_t stream, const Challenger& challenger, const Incumbent& incumbent) {
  constexpr int kRounds = 3;
  const TimingEvent start, stop;
  const auto time_ms = [&](const auto& work) {
    DP_CUDA_CHECK(cudaEventRecord(start.get(), stream));
    work();
    DP_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
    DP_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0.0f;
    DP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms;
  };
  incumbent();
  challenger();
  float best_incumbent = std::numeric_limits<float>::infinity(), best_challenger = best_incumbent;
  for (int round = 0; round < kRounds; ++round) {
    best_incumbent = std::min(best_incumbent, time_ms(incumbent));
    best_challenger = std::min(best_challenger, time_ms(challenger));
  }
  return best_challenger < 0.9f * best_incumbent;
}

// The exact math of a plan: FMA for fp32 (it rules out TF32, which CUDNN_DEFAULT_MATH would allow on
// Ampere and later), tensor ops for bf16 storage (as PyTorch sets it for bf16 convolutions).
cudnnMathType_t exact_math_of(bool bf16) { return bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH; }

// The plan's descriptors for `s`: tensors, filter, and a convolution per direction with the math
// type the search may use. bf16: the tensors and filter bf16, the convolution's compute type fp32.
void make_descriptors(Plan& p, const Conv2dShape& s, Precision precision, bool bf16) {
  // strict: the exact math. fast: the search may pick tensor-op (TF32) algorithms; each direction
  // then runs with the math type its winner was timed with (PyTorch sets it from the find result
  // the same way).
  const cudnnMathType_t search_math = precision != Precision::strict ? CUDNN_DEFAULT_MATH : exact_math_of(bf16);
  const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  p.bf16 = bf16;
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.x));
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.y));
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.bias));
  DP_CUDA_CHECK(cudnnCreateFilterDescriptor(&p.w));
  make_conv_descriptor(p.conv_fwd, s, search_math);
  make_conv_descriptor(p.conv_bwd_data, s, search_math);
  make_conv_descriptor(p.conv, s, search_math);
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.x, CUDNN_TENSOR_NCHW, type, s.n, s.c_in, s.h, s.w));
  DP_CUDA_CHECK(cudnnSetFilter4dDescriptor(p.w, type, CUDNN_TENSOR_NCHW, s.c_out, s.c_in, s.kh, s.kw));
  int n = 0, c = 0, h = 0, w = 0;
  DP_CUDA_CHECK(cudnnGetConvolution2dForwardOutputDim(p.conv_fwd, p.x, p.w, &n, &c, &h, &w));
  if (n != s.n || c != s.c_out || h != s.h_out() || w != s.w_out())
    throw Error(fmt::format("cuDNN convolution: output ({}, {}, {}, {}) differs from the expected ({}, {}, {}, {})", n,
                            c, h, w, s.n, s.c_out, s.h_out(), s.w_out()));
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.y, CUDNN_TENSOR_NCHW, type, n, c, h, w));
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.bias, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, s.c_out, 1, 1));
}

// Whether the shared weight gradient `gemm` beats cuDNN's chosen backward-filter algorithm on the
// search's operands (y stands in for dy), timed the same way on the handle's stream.
bool gemm_is_faster(kernel_api::LibraryCall& call, cudnnHandle_t handle, const Plan& p, const GemmWeightGrad& gemm,
                    const FindBuffer& x, const FindBuffer& y, const FindBuffer& dweight, const FindBuffer& search,
                    std::size_t search_bytes) {
  cudaStream_t stream = nullptr;
  DP_CUDA_CHECK(cudnnGetStream(handle, &stream));
  const FindBuffer filter_workspace(call, p.bwd_filter_bytes > search_bytes ? p.bwd_filter_bytes : 0, stream);
  void* const workspace = filter_workspace.data() ? filter_workspace.data() : search.data();
  const auto* x_in = static_cast<const float*>(x.data());
  const auto* dy_in = static_cast<const float*>(y.data());
  auto* into = static_cast<float*>(dweight.data());
  const float one = 1.0f, zero = 0.0f;
  return clearly_faster(
      stream, [&] { gemm(x_in, dy_in, into); },
      [&] {
        DP_CUDA_CHECK(cudnnConvolutionBackwardFilter(handle, &one, p.x, x_in, p.y, dy_in, p.conv, p.bwd_filter,
                                                     workspace, p.bwd_filter_bytes, &zero, p.w, into));
      });
}

// The first of `order` whose workspace size cuDNN reports (it refuses unsupported ones) within
// kMaxWorkspaceBytes, and that size; none when cuDNN supports no algorithm of `order` for the shape.
template <class Algo, class Size>
std::optional<std::pair<Algo, std::size_t>> first_supported(std::span<const Algo> order, const Size& workspace_size) {
  for (Algo algo : order) {
    std::size_t bytes = 0;
    if (workspace_size(algo, &bytes) == CUDNN_STATUS_SUCCESS && bytes <= kMaxWorkspaceBytes)
      return std::pair{algo, bytes};
  }
  return std::nullopt;
}

// The strict plan for `s`: the fixed orders above, no search, nothing run on the GPU; null where one
// direction has no algorithm of its order for the shape (cuDNN refuses it in that storage). The
// weight gradient goes to the shared im2col + cuBLAS path where it fits (`gemm` given): cuDNN's one
// deterministic dot-product algorithm took ~3.5x its time for the ConvNet on an H100.
std::unique_ptr<Plan> make_strict_plan(cudnnHandle_t handle, const Conv2dShape& s, bool bf16,
                                       const GemmWeightGrad& gemm) {
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  make_descriptors(p, s, Precision::strict, bf16);
  const auto fwd = first_supported<cudnnConvolutionFwdAlgo_t>(
      bf16 ? std::span(kStrictForwardBf16) : std::span(kStrictForward),
      [&](cudnnConvolutionFwdAlgo_t algo, std::size_t* b) {
        return cudnnGetConvolutionForwardWorkspaceSize(handle, p.x, p.w, p.conv_fwd, p.y, algo, b);
      });
  const auto data = first_supported<cudnnConvolutionBwdDataAlgo_t>(
      kStrictData, [&](cudnnConvolutionBwdDataAlgo_t algo, std::size_t* b) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, p.w, p.y, p.conv_bwd_data, p.x, algo, b);
      });
  const auto filter = first_supported<cudnnConvolutionBwdFilterAlgo_t>(
      kStrictFilter, [&](cudnnConvolutionBwdFilterAlgo_t algo, std::size_t* b) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, p.x, p.y, p.conv, p.w, algo, b);
      });
  if (!fwd || !data || !filter) return nullptr;
  std::tie(p.fwd, p.fwd_bytes) = *fwd;
  std::tie(p.bwd_data, p.bwd_data_bytes) = *data;
  std::tie(p.bwd_filter, p.bwd_filter_bytes) = *filter;
  p.weight_grad_by_gemm = static_cast<bool>(gemm);
  return plan;
}

// Builds the plan for `s`, choosing each direction's algorithm by timing the candidates on the
// handle's stream (cudnnFind*Ex, once per shape and policy, during warm-up), and then the weight
// gradient's path by timing cuDNN's choice against `gemm` (when given): with scratch operands and a
// scratch workspace that are freed, in stream order, when it returns.
std::unique_ptr<Plan> make_plan(kernel_api::LibraryCall& call, cudnnHandle_t handle, const Conv2dShape& s,
                                Precision precision, bool bf16, const GemmWeightGrad& gemm) {
  cudaStream_t stream = nullptr;
  DP_CUDA_CHECK(cudnnGetStream(handle, &stream));
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  make_descriptors(p, s, precision, bf16);
  const cudnnMathType_t fallback_math = exact_math_of(bf16);

  // The heuristics bound the search's workspace; the search itself runs every algorithm that fits.
  int count = 0;
  cudnnConvolutionFwdAlgoPerf_t fwd[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  cudnnConvolutionBwdDataAlgoPerf_t data[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
  cudnnConvolutionBwdFilterAlgoPerf_t filter[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
  std::size_t search_bytes = 0;
  DP_CUDA_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, p.x, p.w, p.conv_fwd, p.y,
                                                       CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &count, fwd));
  search_bytes = std::max(search_bytes, find_workspace_bytes(fwd, count, precision, false));
  DP_CUDA_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, p.w, p.y, p.conv_bwd_data, p.x,
                                                            CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &count, data));
  search_bytes = std::max(search_bytes, find_workspace_bytes(data, count, precision, true));
  DP_CUDA_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, p.x, p.y, p.conv, p.w,
                                                              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &count, filter));
  search_bytes = std::max(search_bytes, find_workspace_bytes(filter, count, precision, true));

  const std::size_t element = bf16 ? 2 : sizeof(float);
  const auto floats = [element](std::int64_t count) { return static_cast<std::size_t>(count) * element; };
  const FindBuffer x(call, floats(std::int64_t{s.n} * s.c_in * s.h * s.w), stream),
      dx(call, floats(std::int64_t{s.n} * s.c_in * s.h * s.w), stream);
  const FindBuffer weight(call, floats(std::int64_t{s.c_out} * s.c_in * s.kh * s.kw), stream);
  const FindBuffer dweight(call, floats(std::int64_t{s.c_out} * s.c_in * s.kh * s.kw), stream);
  const FindBuffer y(call, floats(std::int64_t{s.n} * s.c_out * s.h_out() * s.w_out()), stream);
  const FindBuffer search(call, search_bytes, stream);

  DP_CUDA_CHECK(cudnnFindConvolutionForwardAlgorithmEx(handle, p.x, x.data(), p.w, weight.data(), p.conv_fwd, p.y,
                                                       y.data(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &count, fwd,
                                                       search.data(), search_bytes));
  const auto fwd_choice = pick(fwd, count, precision, false, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, fallback_math);
  p.fwd = fwd_choice.algo;
  DP_CUDA_CHECK(cudnnSetConvolutionMathType(p.conv_fwd, fwd_choice.math));
  DP_CUDA_CHECK(cudnnGetConvolutionForwardWorkspaceSize(handle, p.x, p.w, p.conv_fwd, p.y, p.fwd, &p.fwd_bytes));

  DP_CUDA_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(handle, p.w, weight.data(), p.y, y.data(), p.conv_bwd_data,
                                                            p.x, dx.data(), CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                                            &count, data, search.data(), search_bytes));
  const auto data_choice = pick(data, count, precision, true, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, fallback_math);
  p.bwd_data = data_choice.algo;
  DP_CUDA_CHECK(cudnnSetConvolutionMathType(p.conv_bwd_data, data_choice.math));
  DP_CUDA_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, p.w, p.y, p.conv_bwd_data, p.x, p.bwd_data,
                                                             &p.bwd_data_bytes));

  DP_CUDA_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, p.x, x.data(), p.y, y.data(), p.conv, p.w,
                                                              dweight.data(), CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                                                              &count, filter, search.data(), search_bytes));
  const auto filter_choice = pick(filter, count, precision, true, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, fallback_math);
  p.bwd_filter = filter_choice.algo;
  DP_CUDA_CHECK(cudnnSetConvolutionMathType(p.conv, filter_choice.math));
  DP_CUDA_CHECK(
      cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, p.x, p.y, p.conv, p.w, p.bwd_filter, &p.bwd_filter_bytes));

  // In strict, cuDNN may only use its deterministic dot-product backward-filter algorithms, and on
  // an H100 the one it had (wgrad_alg1) took 1.81 ms of a ConvNet batch-1024 step where im2col +
  // cuBLAS took ~0.5 ms (../shared/perf/H100.md, profiled by hand). So the shared path competes,
  // timed the same way on the same operands (y stands in for dy). Nested library calls: gemm takes
  // the stream's cuBLAS handle while this holds its cuDNN one, the one nesting of the two (no
  // cuBLAS call takes cuDNN), so the locks cannot deadlock.
  if (gemm) p.weight_grad_by_gemm = gemm_is_faster(call, handle, p, gemm, x, y, dweight, search, search_bytes);
  // The search ran on the handle's stream: its scratch is freed behind it when this returns.
  return plan;
}

using PlanKey = std::tuple<std::array<int, 9>, Precision, bool>;
PlanKey key_of(const Conv2dShape& s, Precision precision, bool bf16) {
  return {{s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad}, precision, bf16};
}
// A GPU's plans, and which bf16 shapes cuDNN has a strict plan for (cudnn_supports_bf16).
struct Plans {
  std::map<PlanKey, std::unique_ptr<Plan>> built;
  std::map<std::array<int, 9>, bool> bf16_supported;
};

std::string describe(const Conv2dShape& s) {
  return fmt::format("x ({}, {}, {}, {}), weight ({}, {}, {}, {}), stride {}, pad {}", s.n, s.c_in, s.h, s.w, s.c_out,
                     s.c_in, s.kh, s.kw, s.stride, s.pad);
}

// The stream's cuDNN workspace for one call: the runtime's grow-only scratch of (stream, cuDNN),
// grown to the plan's largest need when a plan is first used on the stream, reused by every
// later call (stream order keeps the calls of one stream from overlapping in it).
struct Workspace {
  void* ptr;
  std::size_t size;
  void* data() const { return ptr; }
  std::size_t bytes() const { return size; }
};

// Runs f(handle, plan, workspace) with the device current and the stream's own cuDNN handle; the
// plan for (shape, the runtime's precision, the storage) is built on first use (with `gemm` as the
// weight gradient's other candidate: fp32 only) and cached for the GPU. `extra` bytes of the
// stream's workspace follow the plan's own, at an aligned offset (f gets them as `extra`).
template <class F>
void with_cudnn(const Stream& stream, const Conv2dShape& shape, bool bf16, const GemmWeightGrad& gemm, F&& f,
                std::size_t extra = 0) {
  const Precision precision = kernel_api::precision(stream);
  kernel_api::with_library(stream, kernel_api::Library::cudnn, [&](kernel_api::LibraryCall& call) {
    if (!call.cache) call.cache = std::make_shared<Plans>();
    auto handle = static_cast<cudnnHandle_t>(call.handle);
    std::unique_ptr<Plan>& plan = static_cast<Plans*>(call.cache.get())->built[key_of(shape, precision, bf16)];
    const GemmWeightGrad shared = bf16 ? GemmWeightGrad() : gemm;
    if (!plan)
      plan = precision == Precision::strict ? make_strict_plan(handle, shape, bf16, shared)
                                            : make_plan(call, handle, shape, precision, bf16, shared);
    if (!plan)
      throw InvalidArgument(fmt::format("cuDNN has no {} convolution algorithm of dp's strict order for {}",
                                        bf16 ? "bf16" : "fp32", describe(shape)));
    const std::size_t bytes = (plan->workspace_bytes() + 255) / 256 * 256;
    void* base = call.workspace(bytes + extra);
    f(handle, *plan, Workspace{base, plan->workspace_bytes()}, extra ? static_cast<std::byte*>(base) + bytes : nullptr);
  });
}

}  // namespace

bool cudnn_supports_bf16(const Stream& stream, const Conv2dShape& shape) {
  bool supported = false;
  kernel_api::with_library(stream, kernel_api::Library::cudnn, [&](kernel_api::LibraryCall& call) {
    if (!call.cache) call.cache = std::make_shared<Plans>();
    auto& known = static_cast<Plans*>(call.cache.get())->bf16_supported;
    const auto key = std::get<0>(key_of(shape, Precision::strict, true));
    const auto it = known.find(key);
    if (it != known.end()) {
      supported = it->second;
      return;
    }
    // The strict orders' algorithms are what the plans of every precision fall back on.
    supported = known[key] = make_strict_plan(static_cast<cudnnHandle_t>(call.handle), shape, true, {}) != nullptr;
  });
  return supported;
}

bool cudnn_available() {
  // The library loaded is the one linked against; its major version must match the headers.
  return cudnnGetVersion() / 10000 == CUDNN_MAJOR;
}

void cudnn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                          const float* bias, float* y, const GemmWeightGrad& gemm) {
  with_cudnn(stream, shape, false, gemm, [&](cudnnHandle_t handle, const Plan& p, const Workspace& scratch, void*) {
    const float one = 1.0f, zero = 0.0f;
    DP_CUDA_CHECK(cudnnConvolutionForward(handle, &one, p.x, x, p.w, weight, p.conv_fwd, p.fwd, scratch.data(),
                                          scratch.bytes(), &zero, p.y, y));
    if (bias) DP_CUDA_CHECK(cudnnAddTensor(handle, &one, p.bias, bias, &one, p.y, y));
  });
}

bool cudnn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                           const float* dy, float* dx, float* dweight, bool accumulate, ConvWeightGrad how,
                           const GemmWeightGrad& gemm) {
  bool by_gemm = false;
  with_cudnn(stream, shape, false, gemm, [&](cudnnHandle_t handle, const Plan& p, const Workspace& scratch, void*) {
    by_gemm = gemm && (how == ConvWeightGrad::gemm || (how == ConvWeightGrad::timed && p.weight_grad_by_gemm));
    const float one = 1.0f, zero = 0.0f;
    if (dx)  // overwritten
      DP_CUDA_CHECK(cudnnConvolutionBackwardData(handle, &one, p.w, weight, p.y, dy, p.conv_bwd_data, p.bwd_data,
                                                 scratch.data(), scratch.bytes(), &zero, p.x, dx));
    // beta = 1: gradients accumulate, as PyTorch's .grad does; beta = 0 writes them (the first
    // backward after zero_grad), and cuDNN then never reads what dweight held.
    if (!by_gemm)
      DP_CUDA_CHECK(cudnnConvolutionBackwardFilter(handle, &one, p.x, x, p.y, dy, p.conv, p.bwd_filter, scratch.data(),
                                                   scratch.bytes(), accumulate ? &one : &zero, p.w, dweight));
  });
  return by_gemm;
}

// bf16 storage: y = conv(x, weight) rounded once (no bias: the caller adds it), in the stream order.
void cudnn_conv2d_forward_bf16(const Stream& stream, const Conv2dShape& shape, const void* x, const void* weight,
                               void* y) {
  with_cudnn(stream, shape, true, GemmWeightGrad(),
             [&](cudnnHandle_t handle, const Plan& p, const Workspace& scratch, void*) {
               const float one = 1.0f, zero = 0.0f;
               DP_CUDA_CHECK(cudnnConvolutionForward(handle, &one, p.x, x, p.w, weight, p.conv_fwd, p.fwd,
                                                     scratch.data(), scratch.bytes(), &zero, p.y, y));
             });
}

// bf16 storage: dx (bf16, when not null) and the weight gradient, which cuDNN writes as bf16 (the
// filter's type) into the workspace's tail: it is widened (exactly) into the fp32 dweight, or added
// to it with `accumulate`, by dp's own kernels behind it on the stream.
void cudnn_conv2d_backward_bf16(const Stream& stream, const Conv2dShape& shape, const void* x, const void* weight,
                                const void* dy, void* dx, float* dweight, bool accumulate) {
  const auto weights = static_cast<index_t>(shape.c_out) * shape.c_in * shape.kh * shape.kw;
  std::uint16_t* dweight16 = nullptr;
  with_cudnn(
      stream, shape, true, GemmWeightGrad(),
      [&](cudnnHandle_t handle, const Plan& p, const Workspace& scratch, void* extra) {
        const float one = 1.0f, zero = 0.0f;
        if (dx)
          DP_CUDA_CHECK(cudnnConvolutionBackwardData(handle, &one, p.w, weight, p.y, dy, p.conv_bwd_data, p.bwd_data,
                                                     scratch.data(), scratch.bytes(), &zero, p.x, dx));
        dweight16 = static_cast<std::uint16_t*>(extra);
        DP_CUDA_CHECK(cudnnConvolutionBackwardFilter(handle, &one, p.x, x, p.y, dy, p.conv, p.bwd_filter,
                                                     scratch.data(), scratch.bytes(), &zero, p.w, dweight16));
      },
      static_cast<std::size_t>(weights) * sizeof(std::uint16_t));
  // Outside the cuDNN handle's hold; the workspace is the stream's, so stream order keeps the next
  // cuDNN call from overwriting the bf16 gradient before these read it.
  if (accumulate)
    add(stream, weights, dweight, dweight16, dweight);
  else
    from_bf16(stream, weights, dweight16, dweight);
}

}  // namespace dp::kernels::library
