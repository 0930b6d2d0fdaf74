// cudnn_conv.cpp — the cuDNN convolution path of cuda streams (cuDNN v9 legacy API), host code only.
// The device's cuDNN handle is the runtime's (lent under its lock); the plans per shape are cached
// beside it and destroyed with the device.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cudnn.h>
#include <fmt/format.h>
#include <map>
#include <memory>

#include "dp/runtime/cuda_status.h"
#include "dp/runtime/kernel_api.h"
#include "library_calls.h"

namespace dp::kernels::library {
namespace {

// Scratch beyond this is not worth taking from the activations; such algorithms are skipped.
constexpr std::size_t kMaxWorkspaceBytes = std::size_t{256} << 20;

// The results must match the fp32 host path within rounding, so only algorithms that compute
// plain fp32 dot products qualify: no TF32 / tensor-op math, no FFT or Winograd transforms (whose
// error is not bounded by the dot-product length). Backward ones must also be deterministic:
// replicas of a data-parallel model must see bit-identical gradients for identical inputs.
bool exact_math(cudnnMathType_t math) { return math == CUDNN_DEFAULT_MATH || math == CUDNN_FMA_MATH; }
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

// The first heuristic candidate that qualifies, else `fallback` (supported for every 2-D shape).
template <class Perf, class Algo>
Algo pick(const Perf* perf, int count, bool need_deterministic, Algo fallback) {
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status == CUDNN_STATUS_SUCCESS && exact_math(p.mathType) && dot_product(p.algo) &&
        (!need_deterministic || p.determinism == CUDNN_DETERMINISTIC) && p.memory <= kMaxWorkspaceBytes)
      return p.algo;
  }
  return fallback;
}

// Descriptors and algorithms for one shape; immutable once built, used under the device mutex.
struct Plan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t fwd = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  cudnnConvolutionBwdDataAlgo_t bwd_data = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
  std::size_t fwd_bytes = 0, bwd_data_bytes = 0, bwd_filter_bytes = 0;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {  // never throws: a failed destroy leaks a descriptor at worst
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (bias) cudnnDestroyTensorDescriptor(bias);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
};

std::unique_ptr<Plan> make_plan(cudnnHandle_t handle, const Conv2dShape& s) {
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.x));
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.y));
  DP_CUDA_CHECK(cudnnCreateTensorDescriptor(&p.bias));
  DP_CUDA_CHECK(cudnnCreateFilterDescriptor(&p.w));
  DP_CUDA_CHECK(cudnnCreateConvolutionDescriptor(&p.conv));
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, s.n, s.c_in, s.h, s.w));
  DP_CUDA_CHECK(cudnnSetFilter4dDescriptor(p.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, s.c_out, s.c_in, s.kh, s.kw));
  // PyTorch's Conv2d is a cross-correlation (the kernel is not flipped).
  DP_CUDA_CHECK(cudnnSetConvolution2dDescriptor(p.conv, s.pad, s.pad, s.stride, s.stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
  // FMA math rules out TF32, which CUDNN_DEFAULT_MATH would allow on Ampere and later.
  DP_CUDA_CHECK(cudnnSetConvolutionMathType(p.conv, CUDNN_FMA_MATH));
  int n = 0, c = 0, h = 0, w = 0;
  DP_CUDA_CHECK(cudnnGetConvolution2dForwardOutputDim(p.conv, p.x, p.w, &n, &c, &h, &w));
  if (n != s.n || c != s.c_out || h != s.h_out() || w != s.w_out())
    throw Error(fmt::format("cuDNN convolution: output ({}, {}, {}, {}) differs from the expected ({}, {}, {}, {})", n,
                            c, h, w, s.n, s.c_out, s.h_out(), s.w_out()));
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w));
  DP_CUDA_CHECK(cudnnSetTensor4dDescriptor(p.bias, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, s.c_out, 1, 1));

  // Heuristics, not cudnnFind*: finding times every algorithm on the stream, allocating as it goes.
  int count = 0;
  cudnnConvolutionFwdAlgoPerf_t fwd[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  DP_CUDA_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, p.x, p.w, p.conv, p.y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                                       &count, fwd));
  p.fwd = pick(fwd, count, false, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
  DP_CUDA_CHECK(cudnnGetConvolutionForwardWorkspaceSize(handle, p.x, p.w, p.conv, p.y, p.fwd, &p.fwd_bytes));

  cudnnConvolutionBwdDataAlgoPerf_t data[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
  DP_CUDA_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, p.w, p.y, p.conv, p.x,
                                                            CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &count, data));
  p.bwd_data = pick(data, count, true, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
  DP_CUDA_CHECK(
      cudnnGetConvolutionBackwardDataWorkspaceSize(handle, p.w, p.y, p.conv, p.x, p.bwd_data, &p.bwd_data_bytes));

  cudnnConvolutionBwdFilterAlgoPerf_t filter[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
  DP_CUDA_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, p.x, p.y, p.conv, p.w,
                                                              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &count, filter));
  p.bwd_filter = pick(filter, count, true, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
  DP_CUDA_CHECK(
      cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, p.x, p.y, p.conv, p.w, p.bwd_filter, &p.bwd_filter_bytes));
  return plan;
}

using ShapeKey = std::array<int, 9>;
ShapeKey key_of(const Conv2dShape& s) { return {s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad}; }
using Plans = std::map<ShapeKey, std::unique_ptr<Plan>>;

// Scratch for one call, stream-ordered: freed on the stream after the call's kernels, so another
// stream can reuse the memory only once they are done (a cached buffer shared by streams could not).
class Workspace {
 public:
  Workspace(std::size_t bytes, cudaStream_t stream) : stream_(stream), bytes_(bytes) {
    if (bytes_ != 0) DP_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes_, stream_));
  }
  ~Workspace() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);  // never throws from a destructor
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  cudaStream_t stream_;
  std::size_t bytes_;
  void* ptr_ = nullptr;
};

// Runs f(handle, plan, stream) with the device current and its cuDNN handle on `stream`, held
// exclusively; the plan for `shape` is built on first use and cached with the handle.
template <class F>
void with_cudnn(const Stream& stream, const Conv2dShape& shape, F&& f) {
  kernel_api::with_library(stream, kernel_api::Library::cudnn, [&](kernel_api::LibraryCall& call) {
    if (!call.cache) call.cache = std::make_shared<Plans>();
    auto handle = static_cast<cudnnHandle_t>(call.handle);
    std::unique_ptr<Plan>& plan = (*static_cast<Plans*>(call.cache.get()))[key_of(shape)];
    if (!plan) plan = make_plan(handle, shape);
    f(handle, *plan, static_cast<cudaStream_t>(kernel_api::native_handle(stream)));
  });
}

}  // namespace

bool cudnn_available() {
  // The library loaded is the one linked against; its major version must match the headers.
  return cudnnGetVersion() / 10000 == CUDNN_MAJOR;
}

void cudnn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                          const float* bias, float* y) {
  with_cudnn(stream, shape, [&](cudnnHandle_t handle, const Plan& p, cudaStream_t cuda_stream) {
    const float one = 1.0f, zero = 0.0f;
    const Workspace scratch(p.fwd_bytes, cuda_stream);
    DP_CUDA_CHECK(cudnnConvolutionForward(handle, &one, p.x, x, p.w, weight, p.conv, p.fwd, scratch.data(),
                                          scratch.bytes(), &zero, p.y, y));
    if (bias) DP_CUDA_CHECK(cudnnAddTensor(handle, &one, p.bias, bias, &one, p.y, y));
  });
}

void cudnn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, const float* x, const float* weight,
                           const float* dy, float* dx, float* dweight) {
  with_cudnn(stream, shape, [&](cudnnHandle_t handle, const Plan& p, cudaStream_t cuda_stream) {
    const float one = 1.0f, zero = 0.0f;
    const Workspace scratch(std::max(dx ? p.bwd_data_bytes : 0, p.bwd_filter_bytes), cuda_stream);
    if (dx)  // overwritten
      DP_CUDA_CHECK(cudnnConvolutionBackwardData(handle, &one, p.w, weight, p.y, dy, p.conv, p.bwd_data, scratch.data(),
                                                 scratch.bytes(), &zero, p.x, dx));
    // beta = 1: gradients accumulate, as PyTorch's .grad does.
    DP_CUDA_CHECK(cudnnConvolutionBackwardFilter(handle, &one, p.x, x, p.y, dy, p.conv, p.bwd_filter, scratch.data(),
                                                 scratch.bytes(), &one, p.w, dweight));
  });
}

}  // namespace dp::kernels::library
