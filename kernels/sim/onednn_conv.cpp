// onednn_conv.cpp — the sim backend's convolution library: oneDNN's direct convolutions, as cuDNN is
// the cuda backend's. PyTorch's CPU convolutions are these same primitives (torch links Debian's
// libdnnl too), chosen the same way: every format left to oneDNN (its blocked layouts), the NCHW
// tensors reordered into them and back. A plain-layout oneDNN convolution falls back to its own
// im2col + GEMM and is slower than the shared path.
//
// Plans (primitives and reorders) are built on the calling thread, once per shape for the
// process, and shared by every device: an executing primitive keeps no state, and its scratch comes
// from the executing thread (scratchpad_mode::user). The work itself runs on the stream's thread, in
// stream order, with oneDNN's OpenMP runtime pinned to that one thread: the simulated devices are the
// parallelism (as for OpenBLAS), and a one-thread reduction gives the same bits on every machine of
// one instruction set.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "dp/runtime/detail/kernel_api.h"
#include "dp/runtime/error.h"
#include "library_calls.h"

// OpenMP's C API (libgomp, the runtime Debian's oneDNN is built on): declared here rather than
// taken from <omp.h>, which clang ships only with its own OpenMP runtime.
extern "C" void omp_set_num_threads(int threads);
extern "C" int omp_get_max_threads();

namespace dp::kernels::library {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
constexpr auto f32 = memory::data_type::f32;

// OpenMP held to the calling thread while oneDNN works on it, and given back as it was (the thread
// may be the embedding application's). Both building a plan and running it need it: a primitive
// splits its work for the thread count of the thread that creates it and runs that many threads.
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_;
};

const dnnl::engine& cpu() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A reorder from one layout to another, or nothing where they are the same.
struct Conversion {
  memory::desc from, to;
  std::optional<dnnl::reorder> reorder;

  Conversion() = default;
  Conversion(const memory::desc& source, const memory::desc& target, bool add = false) : from(source), to(target) {
    if (source == target && !add) return;
    dnnl::primitive_attr attr;
    if (add) {  // target += converted source
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      attr.set_post_ops(sum);
    }
    reorder.emplace(dnnl::reorder::primitive_desc(cpu(), source, cpu(), target, attr));
  }
  // Scratch for the converted copy: of a tensor converted in (its `to` layout), or of a result
  // computed in the `from` layout before it is converted out; none where nothing is converted.
  std::size_t in_bytes() const { return reorder ? to.get_size() : 0; }
  std::size_t out_bytes() const { return reorder ? from.get_size() : 0; }
};

struct Plan {
  memory::desc bias;                                     // the caller's (C)
  dnnl::convolution_forward forward, forward_with_bias;  // the same algorithm and formats
  Conversion x_in, w_in, y_out;                          // forward's src and weights in, dst out
  dnnl::convolution_backward_data backward_data;
  Conversion dy_in_data, w_in_data, dx_out;
  dnnl::convolution_backward_weights backward_weights;
  Conversion x_in_weights, dy_in_weights, dw_out, dw_add;
  std::size_t forward_scratchpad = 0, data_scratchpad = 0, weights_scratchpad = 0;
};

memory::dims dims(std::initializer_list<int> extents) { return memory::dims(extents.begin(), extents.end()); }

// bf16: the caller's x, weight, y, dy and dx are bf16 (autocast's storage), reordered into the fp32
// blocked layouts (exact) and out of them (rounded once, to nearest even); the convolutions run in
// fp32 on those values, the weight gradient stays fp32.
std::shared_ptr<const Plan> build(const Conv2dShape& s, bool bf16) {
  auto plan = std::make_shared<Plan>();
  const memory::dims x = dims({s.n, s.c_in, s.h, s.w}), w = dims({s.c_out, s.c_in, s.kh, s.kw}),
                     y = dims({s.n, s.c_out, s.h_out(), s.w_out()}), b = dims({s.c_out});
  const memory::dims strides = dims({s.stride, s.stride}), pad = dims({s.pad, s.pad});
  // The caller's plain layouts.
  const auto act = bf16 ? memory::data_type::bf16 : f32;
  const memory::desc plain_x(x, act, Tag::nchw), plain_w(w, act, Tag::oihw), plain_y(y, act, Tag::nchw);
  const memory::desc plain_dw(w, f32, Tag::oihw);
  plan->bias = memory::desc(b, f32, Tag::x);
  const memory::desc any_x(x, f32, Tag::any), any_w(w, f32, Tag::any), any_y(y, f32, Tag::any);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto direct = dnnl::algorithm::convolution_direct;

  // Training forward always (never forward_inference): evaluation then gives the bits training does.
  const auto training = dnnl::prop_kind::forward_training;
  const dnnl::convolution_forward::primitive_desc fwd(
      dnnl::convolution_forward::desc(training, direct, any_x, any_w, any_y, strides, pad, pad), attr, cpu());
  const dnnl::convolution_forward::primitive_desc fwd_bias(
      dnnl::convolution_forward::desc(training, direct, fwd.src_desc(), fwd.weights_desc(), plan->bias, fwd.dst_desc(),
                                      strides, pad, pad),
      attr, cpu());
  plan->forward = dnnl::convolution_forward(fwd);
  plan->forward_with_bias = dnnl::convolution_forward(fwd_bias);
  plan->x_in = Conversion(plain_x, fwd.src_desc());
  plan->w_in = Conversion(plain_w, fwd.weights_desc());
  plan->y_out = Conversion(fwd.dst_desc(), plain_y);
  plan->forward_scratchpad = std::max(fwd.scratchpad_desc().get_size(), fwd_bias.scratchpad_desc().get_size());

  const dnnl::convolution_backward_data::primitive_desc data(
      dnnl::convolution_backward_data::desc(direct, any_x, any_w, any_y, strides, pad, pad), attr, cpu(), fwd);
  plan->backward_data = dnnl::convolution_backward_data(data);
  plan->dy_in_data = Conversion(plain_y, data.diff_dst_desc());
  plan->w_in_data = Conversion(plain_w, data.weights_desc());
  plan->dx_out = Conversion(data.diff_src_desc(), plain_x);
  plan->data_scratchpad = data.scratchpad_desc().get_size();

  // No bias gradient here: the launchers' own reduction gives it the same bits on every backend.
  const dnnl::convolution_backward_weights::primitive_desc weights(
      dnnl::convolution_backward_weights::desc(direct, any_x, any_w, any_y, strides, pad, pad), attr, cpu(), fwd);
  plan->backward_weights = dnnl::convolution_backward_weights(weights);
  plan->x_in_weights = Conversion(plain_x, weights.src_desc());
  plan->dy_in_weights = Conversion(plain_y, weights.diff_dst_desc());
  plan->dw_out = Conversion(weights.diff_weights_desc(), plain_dw);
  plan->dw_add = Conversion(weights.diff_weights_desc(), plain_dw, true);
  plan->weights_scratchpad = weights.scratchpad_desc().get_size();
  return plan;
}

using Key = std::tuple<int, int, int, int, int, int, int, int, int, bool>;

// The plan of a shape, built on first use; null where oneDNN has no implementation for it.
std::shared_ptr<const Plan> plan_for(const Conv2dShape& s, bool bf16) {
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<const Plan>> plans;
  const Key key{s.n, s.c_in, s.h, s.w, s.c_out, s.kh, s.kw, s.stride, s.pad, bf16};
  const std::lock_guard lock(mutex);
  if (const auto found = plans.find(key); found != plans.end()) return found->second;
  std::shared_ptr<const Plan> plan;
  try {
    const OneThread one;
    plan = build(s, bf16);
  } catch (const dnnl::error& e) {
    if (e.status != dnnl_unimplemented) throw Error(std::string("oneDNN convolution plan: ") + e.what());
  }
  plans.emplace(key, plan);
  return plan;
}

// The executing thread's scratch: the blocked copies and oneDNN's scratchpad, grown to the largest
// call this thread has run and then reused (no allocation per call).
class Scratch {
 public:
  // Pointers to `sizes` bytes each, 64-byte aligned (oneDNN's preference), valid until the next call.
  template <std::size_t N>
  std::array<void*, N> take(const std::array<std::size_t, N>& sizes) {
    std::size_t total = 0;
    for (std::size_t b : sizes) total += round_up(b);
    if (total > capacity_) {
      data_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlign, total)));
      if (!data_) throw std::bad_alloc();
      capacity_ = total;
    }
    std::array<void*, N> out{};
    std::size_t offset = 0;
    for (std::size_t i = 0; i < N; ++i) {
      out[i] = sizes[i] ? data_.get() + offset : nullptr;
      offset += round_up(sizes[i]);
    }
    return out;
  }

 private:
  static constexpr std::size_t kAlign = 64;
  static std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t capacity_ = 0;
};

// What a stream's thread needs to run oneDNN: a stream of the CPU engine and its scratch.
struct Executor {
  dnnl::stream stream{cpu()};
  Scratch scratch;
  OneThread one;  // the stream's own thread: held for good
};
Executor& executor() {
  thread_local Executor e;
  return e;
}

memory wrap(const memory::desc& desc, const void* p) {
  return memory(desc, cpu(), const_cast<void*>(p));  // oneDNN takes mutable handles, inputs included
}

// `data` in the layout `c` converts to: `data` itself where no reorder is needed, else its
// conversion written to `buffer`.
memory converted(dnnl::stream& stream, const Conversion& c, const void* data, void* buffer) {
  if (!c.reorder) return wrap(c.to, data);
  memory from = wrap(c.from, data), to = wrap(c.to, buffer);
  c.reorder->execute(stream, from, to);
  return to;
}

// A result computed in the layout `c` converts from, then written to `out` through it.
memory result(const Conversion& c, void* out, void* buffer) { return wrap(c.from, c.reorder ? buffer : out); }
void deliver(dnnl::stream& stream, const Conversion& c, memory computed, void* out) {
  if (c.reorder) {
    memory to = wrap(c.to, out);
    c.reorder->execute(stream, computed, to);
  }
}

memory scratchpad(const void* p, std::size_t bytes) {
  return wrap(memory::desc({static_cast<memory::dim>(bytes)}, memory::data_type::u8, Tag::x), p);
}

void run_forward(const Plan& p, const void* x, const void* weight, const float* bias, void* y) {
  Executor& e = executor();
  const auto [xb, wb, yb, pad] =
      e.scratch.take<4>({p.x_in.in_bytes(), p.w_in.in_bytes(), p.y_out.out_bytes(), p.forward_scratchpad});
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, converted(e.stream, p.x_in, x, xb)},
                                       {DNNL_ARG_WEIGHTS, converted(e.stream, p.w_in, weight, wb)}};
  memory out = result(p.y_out, y, yb);
  args.emplace(DNNL_ARG_DST, out);
  if (bias) args.emplace(DNNL_ARG_BIAS, wrap(p.bias, bias));
  if (pad) args.emplace(DNNL_ARG_SCRATCHPAD, scratchpad(pad, p.forward_scratchpad));
  (bias ? p.forward_with_bias : p.forward).execute(e.stream, args);
  deliver(e.stream, p.y_out, out, y);
  e.stream.wait();
}

// dx (when not null) and dweight (when not null: = or, with accumulate, += the weight gradient), in
// one task so that dy is reordered once where both passes read it in the same layout. dweight is
// computed in place where no conversion is needed, else in a blocked buffer and converted out, the
// reorder's sum post-op adding it.
void run_backward(const Plan& p, const void* x, const void* weight, const void* dy, void* dx, float* dweight,
                  bool accumulate) {
  Executor& e = executor();
  const Conversion& dw_out = accumulate ? p.dw_add : p.dw_out;
  const bool shared_dy = dweight && p.dy_in_weights.to == p.dy_in_data.to;
  const auto [dyw, dyd, xb, wb, dxb, dwb, pad] = e.scratch.take<7>(
      {dweight ? p.dy_in_weights.in_bytes() : 0, dx && !shared_dy ? p.dy_in_data.in_bytes() : 0,
       dweight ? p.x_in_weights.in_bytes() : 0, dx ? p.w_in_data.in_bytes() : 0, dx ? p.dx_out.out_bytes() : 0,
       dweight ? dw_out.out_bytes() : 0, std::max(p.data_scratchpad, p.weights_scratchpad)});
  std::optional<memory> dy_weights;
  if (dweight) {
    dy_weights = converted(e.stream, p.dy_in_weights, dy, dyw);
    memory computed = result(dw_out, dweight, dwb);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, converted(e.stream, p.x_in_weights, x, xb)},
                                         {DNNL_ARG_DIFF_DST, *dy_weights},
                                         {DNNL_ARG_DIFF_WEIGHTS, computed}};
    if (pad) args.emplace(DNNL_ARG_SCRATCHPAD, scratchpad(pad, p.weights_scratchpad));
    p.backward_weights.execute(e.stream, args);
    deliver(e.stream, dw_out, computed, dweight);
  }
  if (dx) {
    memory out = result(p.dx_out, dx, dxb);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_DIFF_DST, shared_dy ? *dy_weights : converted(e.stream, p.dy_in_data, dy, dyd)},
        {DNNL_ARG_WEIGHTS, converted(e.stream, p.w_in_data, weight, wb)},
        {DNNL_ARG_DIFF_SRC, out}};
    if (pad) args.emplace(DNNL_ARG_SCRATCHPAD, scratchpad(pad, p.data_scratchpad));
    p.backward_data.execute(e.stream, args);
    deliver(e.stream, p.dx_out, out, dx);
  }
  e.stream.wait();
}

}  // namespace

bool onednn_supports(const Conv2dShape& shape, bool bf16) { return plan_for(shape, bf16) != nullptr; }

bool onednn_conv2d_forward(const Stream& stream, const Conv2dShape& shape, bool bf16, const void* x, const void* weight,
                           const float* bias, void* y) {
  const std::shared_ptr<const Plan> plan = plan_for(shape, bf16);
  if (!plan) return false;
  kernel_api::enqueue_host(stream, "onednn_conv2d_forward",
                           [plan, x, weight, bias, y] { run_forward(*plan, x, weight, bias, y); });
  return true;
}

bool onednn_conv2d_backward(const Stream& stream, const Conv2dShape& shape, bool bf16, const void* x,
                            const void* weight, const void* dy, void* dx, float* dweight, bool accumulate) {
  const std::shared_ptr<const Plan> plan = plan_for(shape, bf16);
  if (!plan) return false;
  if (dx || dweight)
    kernel_api::enqueue_host(stream, "onednn_conv2d_backward", [plan, x, weight, dy, dx, dweight, accumulate] {
      run_backward(*plan, x, weight, dy, dx, dweight, accumulate);
    });
  return true;
}

}  // namespace dp::kernels::library
