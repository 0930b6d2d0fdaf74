// layers.cpp — the layers and containers of dp/nn/layers.h on top of the kernels.
#include "dp/nn/layers.h"

#include <cmath>
#include <fmt/format.h>
#include <optional>

#include "chain.h"
#include "container.h"
#include "dp/kernels/avgpool.h"
#include "dp/kernels/batchnorm.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/dropout.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/maxpool.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/collectives.h"
#include "dp/runtime/error.h"
#include "dp/runtime/flight_record.h"
#include "dp/runtime/scratch.h"
#include "dropout_draw.h"

namespace dp::nn {

void Layer::forward_ids(const LayerContext&, const std::int32_t*, float*) {
  throw InvalidArgument(fmt::format("{}: reads activations, not token ids", name()));
}
void Layer::forward_relu(const LayerContext&, const float*, float*) {
  throw InvalidArgument(fmt::format("{}: cannot fuse a following ReLU", name()));
}
void Layer::backward_relu(const LayerContext&, const float*, const float*, const float*, float*) {
  throw InvalidArgument(fmt::format("{}: cannot fuse a following ReLU", name()));
}

namespace {

// A tensor of a layer that keeps its input's dtype (native_bf16): bf16 bits behind the float
// pointer when the input is bf16.
kernels::In in(const LayerContext& ctx, const float* p) { return {p, ctx.bf16}; }
kernels::Out out(const LayerContext& ctx, float* p) { return {p, ctx.bf16}; }

// A Linear's or Conv2d's parameters as its arithmetic sees them, for one forward or backward. Its
// parameters are contiguous, weight then bias (the model lays each layer's out in order).
// Without autocast: the parameters and gradient buffers themselves, gradients accumulated as
// ctx says. Under autocast: the parameters cast to bf16, as bf16 storage (bits(): the layer's own
// copy, made by each forward and read again by the backward that follows it, as torch's autocast
// keeps its cast weights for the backward) or, for the bias and for a path that takes fp32 words,
// as fp32 values rounded to bf16; the backward writes the gradients apart (a Linear's weight
// gradient as bf16, from its GEMM) and finish() rounds them to bf16 into the fp32 buffer (torch: the bf16 gradient of
// the bf16 weight, widened by the cast's backward); the GEMMs enqueued meanwhile are marked as taking bf16 values
// (kernels::Bf16Operands: tensor cores on cuda).
class LayerParams {
 public:
  // `grads`: null for a forward; `bias_grads`: where the gradients of elements [weights, count)
  // (the bias) go, not necessarily right after the weight's (Model::place_gradients). `cast`: the
  // layer's scratch for its bf16 copy.
  LayerParams(const LayerContext& ctx, float* params, float* grads, std::int64_t count, Scratch& cast,
              float* bias_grads = nullptr, std::int64_t weights = 0)
      : ctx_(ctx),
        params_(params),
        grads_(grads),
        bias_grads_(bias_grads),
        count_(count),
        weights_(bias_grads ? weights : count),
        cast_(cast) {
    if (ctx.amp) tensor_cores_.emplace();
  }
  // fp32 words: the parameters, or under autocast their bf16 values (rounded on first ask).
  const float* params() const { return rounded(0); }
  // The same from element `offset` on (the bias): under autocast only those are rounded.
  const float* params_from(std::int64_t offset) const { return rounded(offset) + offset; }
  // Autocast: the parameters as bf16 storage.
  const std::uint16_t* bits() const {
    auto* bits = cast_.get<std::uint16_t>(ctx_.device, static_cast<std::size_t>(count_));
    if (!grads_) kernels::to_bf16(ctx_.stream, count_, params_, bits);  // a forward casts; its backward reads
    return bits;
  }
  // Where the backward kernel writes the weight's gradient (bias_grads(): the bias's); under
  // autocast the model's fp32 scratch, asked for only by a layer whose kernel writes it fp32.
  float* grads() const {
    if (!widens()) return grads_;
    if (!computed_) computed_ = ctx_.amp->get<float>(ctx_.amp->grad, ctx_.device, weights_);
    return computed_;
  }
  // Under autocast, where a GEMM writes the weight's gradient as bf16 (its fp32 result rounded once,
  // which finish() widens into the buffer: half the bytes of an fp32 gradient rounded after).
  kernels::Out weight_grads() const {
    if (!widens()) return grads();
    weight_bits_ = ctx_.amp->get<std::uint16_t>(ctx_.amp->grad16, ctx_.device, weights_);
    return kernels::Out(weight_bits_);
  }
  float* bias_grads() const {
    if (!widens()) return bias_grads_;
    if (!computed_bias_) computed_bias_ = ctx_.amp->get<float>(ctx_.amp->grad_bias, ctx_.device, count_ - weights_);
    return computed_bias_;
  }
  // The backward kernel's `accumulate`: under autocast it writes, finish() adds.
  bool accumulate() const { return !ctx_.amp && ctx_.accumulate_grads; }
  void finish() const {
    if (!widens()) return;
    // Elementwise: the weight's and the bias's parts apart give the bits of one pass over both.
    if (weight_bits_)
      kernels::add_bf16_rounded(ctx_.stream, weights_, weight_bits_, grads_, ctx_.accumulate_grads);
    else if (computed_)
      kernels::add_bf16_rounded(ctx_.stream, weights_, computed_, grads_, ctx_.accumulate_grads);
    if (computed_bias_)
      kernels::add_bf16_rounded(ctx_.stream, count_ - weights_, computed_bias_, bias_grads_, ctx_.accumulate_grads);
  }

 private:
  // Elements [offset, count) rounded into the model's scratch (its start: the whole, or a tail).
  const float* rounded(std::int64_t offset) const {
    if (!ctx_.amp) return params_;
    if (rounded_ && rounded_from_ <= offset) return rounded_;
    float* out = ctx_.amp->get<float>(ctx_.amp->weight, ctx_.device, count_);
    kernels::round_to_bf16(ctx_.stream, count_ - offset, params_ + offset, out + offset);
    rounded_ = out;
    rounded_from_ = offset;
    return out;
  }

  // A backward under autocast: the kernels' gradients go through scratch, rounded to bf16 on their
  // way into the buffer.
  bool widens() const { return ctx_.amp && grads_; }

  const LayerContext& ctx_;
  const float* params_;
  float* grads_;
  float* bias_grads_;
  mutable float* computed_ = nullptr;       // autocast: the weight's gradient, fp32
  mutable float* computed_bias_ = nullptr;  // autocast: the bias's
  std::int64_t count_;
  std::int64_t weights_;  // elements whose gradients go to grads_ (the rest: bias_grads_)
  Scratch& cast_;
  mutable float* rounded_ = nullptr;
  mutable std::int64_t rounded_from_ = 0;
  mutable std::uint16_t* weight_bits_ = nullptr;
  std::optional<kernels::Bf16Operands> tensor_cores_;
};

// Autocast: a tensor as bf16 storage, fp32 rounded (the cast) where it is not already.
const std::uint16_t* bf16_input(const LayerContext& ctx, Scratch& into, const void* x, std::int64_t n) {
  if (ctx.bf16) return static_cast<const std::uint16_t*>(x);
  std::uint16_t* out = ctx.amp->get<std::uint16_t>(into, ctx.device, n);
  kernels::to_bf16(ctx.stream, n, static_cast<const float*>(x), out);
  return out;
}

class Linear final : public Layer {
 public:
  Linear(std::string name, int in, int out) : Layer(std::move(name)), in_(in), out_(out) {
    params_.push_back({"weight", DType::f32, {out, in}, Init::kaiming_uniform, in});
    params_.push_back({"bias", DType::f32, {out}, Init::fan_in_uniform, in});
  }
  ActShape output_shape(const ActShape& in) const override {
    // Each token of a sequence, one token long included ((1, 1, C), where a flat vector is (C, 1, 1)).
    if (in.w == in_ && (in_ > 1 || in.per_sample() != in_)) return ActShape{in.n, in.c, in.h, out_};
    if (in.per_sample() == in_) return ActShape{in.n, out_, 1, 1};
    throw InvalidArgument(fmt::format("{}: expects {} input features, got {}", name(), in_, in.per_sample()));
  }
  std::int64_t multiply_adds(const ActShape& in) const override { return weights() * (in.per_sample() / in_); }
  bool autocasts() const override { return true; }
  // Under autocast it takes the chain's storage: its GEMMs read bf16 operands (x, the weight, dy)
  // and write the bf16 output (and a bf16 dx where the input is bf16) directly, each element
  // computed in fp32 and rounded once (an fp32 input's dx is written fp32).
  bool native_bf16() const override { return true; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const LayerParams p(ctx, param(0), nullptr, count(), cast_);
    const float* bias = p.params_from(weights());
    if (!ctx.amp) {
      kernels::linear_forward(ctx.stream, rows(ctx.in, in_), in_, out_, x, p.params(), bias, y);
      return;
    }
    kernels::linear_forward(ctx.stream, rows(ctx.in, in_), in_, out_, bf16_input(ctx, ctx.amp->x, x, ctx.in.numel()),
                            p.bits(), bias, kernels::Out(y, true));
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const LayerParams p(ctx, param(0), grad(0), count(), cast_, grad(1), weights());
    if (!ctx.amp) {
      kernels::linear_backward(ctx.stream, rows(ctx.in, in_), in_, out_, x, p.params(), dy, dx, p.grads(),
                               p.bias_grads(), p.accumulate());
      p.finish();
      return;
    }
    const std::int64_t n_in = ctx.in.numel();
    kernels::linear_backward(ctx.stream, rows(ctx.in, in_), in_, out_, bf16_input(ctx, ctx.amp->x, x, n_in), p.bits(),
                             reinterpret_cast<const std::uint16_t*>(dy), kernels::Out(dx, ctx.bf16 && dx),
                             p.weight_grads(), p.bias_grads(), p.accumulate());
    p.finish();
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(*this); }

 private:
  std::int64_t weights() const { return static_cast<std::int64_t>(in_) * out_; }
  std::int64_t count() const { return weights() + out_; }
  // The rows it multiplies: one per sample, or one per token of a sequence.
  static int rows(const ActShape& in, int features) { return static_cast<int>(in.numel() / features); }

  int in_, out_;
  Scratch cast_;  // autocast: the parameters as bf16, from the forward to its backward
};

class Conv2d final : public Layer {
 public:
  Conv2d(std::string name, int in, int out, int kernel, int stride, int pad, bool bias)
      : Layer(std::move(name)), in_(in), out_(out), kernel_(kernel), stride_(stride), pad_(pad) {
    if (in < 1 || out < 1 || kernel < 1 || stride < 1 || pad < 0)
      throw InvalidArgument(fmt::format("{}: Conv2d({}, {}, kernel {}, stride {}, padding {}) is not a convolution",
                                        this->name(), in, out, kernel, stride, pad));
    const std::int64_t fan_in = static_cast<std::int64_t>(in) * kernel * kernel;
    params_.push_back({"weight", DType::f32, {out, in, kernel, kernel}, Init::kaiming_uniform, fan_in});
    if (bias) params_.push_back({"bias", DType::f32, {out}, Init::fan_in_uniform, fan_in});
  }
  kernels::Conv2dShape shape(const ActShape& in) const {
    if (in.c != in_) throw InvalidArgument(fmt::format("{}: expects {} channels, got {}", name(), in_, in.c));
    return kernels::Conv2dShape{in.n, in.c, in.h, in.w, out_, kernel_, kernel_, stride_, pad_};
  }
  ActShape output_shape(const ActShape& in) const override {
    const auto s = shape(in);
    if (s.h_out() < 1 || s.w_out() < 1)
      throw InvalidArgument(fmt::format("{}: input {}x{} is smaller than the kernel", name(), in.h, in.w));
    return ActShape{in.n, out_, s.h_out(), s.w_out()};
  }
  // Each output element is a dot product over c_in x k x k inputs.
  std::int64_t multiply_adds(const ActShape& in) const override {
    const ActShape out = output_shape(in);
    return weights() * out.h * out.w;
  }
  bool autocasts() const override { return true; }
  // Under autocast it takes the chain's storage: bf16 in and out where a library convolves bf16.
  bool native_bf16() const override { return true; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto s = shape(ctx.in);
    if (ctx.amp) {
      forward_autocast(ctx, s, x, y);
      return;
    }
    float* workspace = this->workspace(ctx, s);
    const LayerParams p(ctx, param(0), nullptr, count(), cast_);
    const float* bias = has_bias() ? p.params_from(weights()) : nullptr;
    const bool lowered = kernels::conv2d_forward(ctx.stream, s, x, p.params(), bias, y, workspace);
    lowered_ = lowered ? Lowered{x, workspace, s} : Lowered{};
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const auto s = shape(ctx.in);
    if (ctx.amp) {
      backward_autocast(ctx, s, x, dy, dx);
      return;
    }
    float* workspace = this->workspace(ctx, s);
    // The forward's lowered x is reused when it lowered this x into this workspace: the GEMMs of a
    // step then lower each input once.
    const bool x_lowered = lowered_.matches(x, workspace, s);
    lowered_ = Lowered{};
    const LayerParams p = backward_params(ctx);
    float* bias_grad = has_bias() ? p.bias_grads() : nullptr;
    kernels::conv2d_backward(ctx.stream, s, x, p.params(), dy, dx, p.grads(), bias_grad, workspace, p.accumulate(),
                             x_lowered);
    p.finish();
  }
  // Autocast: x is the chain's storage (bf16, or the model's fp32 input), y and dy bf16, dx in x's
  // dtype. Where the library convolves bf16 storage (conv2d_supports_bf16) it reads and writes it
  // as it is; elsewhere the layer widens into the model's fp32 scratch and runs the fp32 path on
  // bf16 values (Bf16Operands), rounding y and dx back.
  void forward_autocast(const LayerContext& ctx, const kernels::Conv2dShape& s, const float* x, float* y) {
    lowered_ = Lowered{};
    const LayerParams p(ctx, param(0), nullptr, count(), cast_);
    const float* bias = has_bias() ? p.params_from(weights()) : nullptr;
    const std::int64_t n_in = ctx.in.numel(), n_out = output_shape(ctx.in).numel();
    auto* y16 = reinterpret_cast<std::uint16_t*>(y);
    if (kernels::conv2d_supports_bf16(ctx.stream, s)) {
      kernels::conv2d_forward(ctx.stream, s, bf16_input(ctx, ctx.amp->x, x, n_in), p.bits(), bias, y16, nullptr);
      return;
    }
    float* y32 = ctx.amp->get<float>(ctx.amp->out, ctx.device, n_out);
    kernels::conv2d_forward(ctx.stream, s, detail::widened(ctx, x, ctx.bf16, true, n_in, ctx.amp->x), p.params(), bias,
                            y32, workspace(ctx, s));
    kernels::to_bf16(ctx.stream, n_out, y32, y16);
  }
  void backward_autocast(const LayerContext& ctx, const kernels::Conv2dShape& s, const float* x, const float* dy,
                         float* dx) {
    const LayerParams p = backward_params(ctx);
    float* bias_grad = has_bias() ? p.bias_grads() : nullptr;
    const std::int64_t n_in = ctx.in.numel(), n_out = output_shape(ctx.in).numel();
    AutocastScratch& amp = *ctx.amp;
    if (kernels::conv2d_supports_bf16(ctx.stream, s)) {
      // An fp32 input's gradient: the bf16 one widened (the backward of autocast's cast).
      std::uint16_t* dx16 = !dx        ? nullptr
                            : ctx.bf16 ? reinterpret_cast<std::uint16_t*>(dx)
                                       : amp.get<std::uint16_t>(amp.dx, ctx.device, n_in);
      kernels::conv2d_backward(ctx.stream, s, bf16_input(ctx, amp.x, x, n_in), p.bits(),
                               reinterpret_cast<const std::uint16_t*>(dy), dx16, p.grads(), bias_grad, nullptr,
                               p.accumulate());
      if (dx && !ctx.bf16) kernels::from_bf16(ctx.stream, n_in, dx16, dx);
    } else {
      float* dx32 = dx && ctx.bf16 ? amp.get<float>(amp.dx, ctx.device, n_in) : dx;
      kernels::conv2d_backward(ctx.stream, s, detail::widened(ctx, x, ctx.bf16, true, n_in, amp.x), p.params(),
                               detail::widen(ctx, amp.dy, dy, n_out), dx32, p.grads(), bias_grad, workspace(ctx, s),
                               p.accumulate());
      if (dx32 != dx) kernels::to_bf16(ctx.stream, n_in, dx32, reinterpret_cast<std::uint16_t*>(dx));
    }
    p.finish();
  }
  std::unique_ptr<Layer> clone() const override {
    auto copy = std::make_unique<Conv2d>(*this);
    copy->lowered_ = Lowered{};  // the copy's workspace is its own
    return copy;
  }

 private:
  bool has_bias() const { return params_.size() > 1; }
  LayerParams backward_params(const LayerContext& ctx) {
    return LayerParams(ctx, param(0), grad(0), count(), cast_, has_bias() ? grad(1) : nullptr, weights());
  }
  std::int64_t weights() const { return static_cast<std::int64_t>(numel(params_[0].shape)); }
  std::int64_t count() const { return weights() + (has_bias() ? out_ : 0); }
  // Its own (it may keep x lowered for the backward), or under autocast the model's shared one
  // (its x is scratch that later layers overwrite: nothing is kept lowered).
  float* workspace(const LayerContext& ctx, const kernels::Conv2dShape& s) {
    // Autocast without a library that takes bf16: the shared path (im2col + bf16 GEMMs), all of it.
    if (ctx.amp)
      return ctx.amp->get<float>(ctx.amp->workspace, ctx.device,
                                 static_cast<std::int64_t>(kernels::conv2d_workspace_floats(s)));
    // None where the library does all of it: a layer keeps no scratch it does not use.
    return workspace_.get<float>(ctx.device, kernels::conv2d_workspace_floats(ctx.stream, s));
  }

  // What the workspace holds after the last forward: x lowered for this shape, or nothing.
  struct Lowered {
    const float* x = nullptr;
    const float* workspace = nullptr;
    kernels::Conv2dShape shape{};
    bool matches(const float* x_, const float* workspace_, const kernels::Conv2dShape& s) const {
      return x != nullptr && x == x_ && workspace == workspace_ && shape.n == s.n && shape.c_in == s.c_in &&
             shape.h == s.h && shape.w == s.w && shape.c_out == s.c_out && shape.kh == s.kh && shape.kw == s.kw &&
             shape.stride == s.stride && shape.pad == s.pad;
    }
  };
  Lowered lowered_;

  int in_, out_, kernel_, stride_, pad_;
  Scratch workspace_;
  Scratch cast_;  // autocast: the parameters as bf16, from the forward to its backward
};

class BatchNorm2d final : public Layer {
 public:
  BatchNorm2d(std::string name, int channels) : Layer(std::move(name)), channels_(channels) {
    params_.push_back({"weight", DType::f32, {channels}, Init::ones, 0});
    params_.push_back({"bias", DType::f32, {channels}, Init::zeros, 0});
    buffers_.push_back({"running_mean", DType::f32, {channels}, Init::zeros, 0});
    buffers_.push_back({"running_var", DType::f32, {channels}, Init::ones, 0});
    buffers_.push_back({"num_batches_tracked", DType::i64, {}, Init::zeros, 0});
  }
  kernels::BatchNormShape shape(const ActShape& in) const {
    if (in.c != channels_)
      throw InvalidArgument(fmt::format("{}: expects {} channels, got {}", name(), channels_, in.c));
    return kernels::BatchNormShape{in.n, in.c, in.h, in.w};
  }
  ActShape output_shape(const ActShape& in) const override {
    shape(in);
    return in;
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override { forward(ctx, x, y, false); }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    backward(ctx, x, dy, dx, nullptr);
  }
  bool fuses_relu() const override { return true; }
  void forward_relu(const LayerContext& ctx, const float* x, float* y) override { forward(ctx, x, y, true); }
  // y: the fused output, whose sign is ReLU's mask.
  void backward_relu(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx) override {
    backward(ctx, x, dy, dx, y);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<BatchNorm2d>(*this); }
  std::size_t saved_bytes() const override { return saved_.size(); }
  bool native_bf16() const override { return true; }

 private:
  void forward(const LayerContext& ctx, const float* x, float* y, bool relu) {
    const auto s = shape(ctx.in);
    if (ctx.mode == Mode::eval) {
      kernels::batchnorm_forward_eval(ctx.stream, s, in(ctx, x), param(0), param(1), buffer<float>(0), buffer<float>(1),
                                      out(ctx, y), relu);
      return;
    }
    float* saved = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(channels_));
    if (ctx.sync) {
      // torch.nn.SyncBatchNorm: statistics kernel, their sum over the replicas, normalisation kernel.
      const kernels::index_t count = global_count(ctx);
      float* mean = saved;
      float* moments = saved + 2 * channels_;
      kernels::sync_batchnorm_sums(ctx.stream, s, in(ctx, x), mean, count);
      all_reduce(ctx, mean, 1);
      kernels::sync_batchnorm_moments(ctx.stream, s, in(ctx, x), mean, moments, count);
      all_reduce(ctx, moments, 2);
      kernels::sync_batchnorm_normalize(ctx.stream, s, in(ctx, x), param(0), param(1), out(ctx, y), mean,
                                        saved + channels_, buffer<float>(0), buffer<float>(1), buffer<std::int64_t>(2),
                                        moments, count, relu);
      return;
    }
    kernels::batchnorm_forward_train(ctx.stream, s, in(ctx, x), param(0), param(1), out(ctx, y), saved,
                                     saved + channels_, buffer<float>(0), buffer<float>(1), buffer<std::int64_t>(2),
                                     relu);
  }
  void backward(const LayerContext& ctx, const float* x, const float* dy, float* dx, const float* relu_y) {
    const auto s = shape(ctx.in);
    float* saved = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(channels_));
    if (ctx.sync) {
      const kernels::index_t count = global_count(ctx);
      float* grad_sums = saved + 2 * channels_;
      kernels::sync_batchnorm_backward_sums(ctx.stream, s, in(ctx, x), param(0), saved, saved + channels_, in(ctx, dy),
                                            grad(0), grad(1), grad_sums, count, relu(ctx, relu_y),
                                            ctx.accumulate_grads);
      all_reduce(ctx, grad_sums, 2);  // every replica's, needed or not: the others wait for it
      kernels::sync_batchnorm_backward_dx(ctx.stream, s, in(ctx, x), param(0), saved, saved + channels_, in(ctx, dy),
                                          out(ctx, dx), grad_sums, count, relu(ctx, relu_y));
      return;
    }
    kernels::batchnorm_backward(ctx.stream, s, in(ctx, x), param(0), saved, saved + channels_, in(ctx, dy),
                                out(ctx, dx), grad(0), grad(1), saved + 2 * channels_, relu(ctx, relu_y),
                                ctx.accumulate_grads);
  }
  static kernels::In relu(const LayerContext& ctx, const float* relu_y) {
    return relu_y ? in(ctx, relu_y) : kernels::In{};
  }
  // SyncBatchNorm: the values per channel over all replicas, and their all-reduce on this stream.
  static kernels::index_t global_count(const LayerContext& ctx) {
    return static_cast<kernels::index_t>(ctx.sync->global_samples) * ctx.in.h * ctx.in.w;
  }
  // `per_channel` floats per channel summed in place over the replicas, on this layer's stream.
  void all_reduce(const LayerContext& ctx, float* data, std::size_t per_channel) {
    const std::size_t count = per_channel * static_cast<std::size_t>(channels_);
    Communicator& comm = *ctx.sync->comm;
    const CollectivePurpose purpose(fmt::format("SyncBatchNorm {}", name()));
    if (!ctx.sync->ordered) {
      comm.all_reduce(ctx.sync->rank, ctx.stream, data, count, ReduceOp::sum);
      return;
    }
    float* all = gathered_.get<float>(ctx.device, count * static_cast<std::size_t>(comm.size()));
    comm.all_gather(ctx.sync->rank, ctx.stream, data, all, count);
    const auto n = static_cast<kernels::index_t>(count);
    if (comm.size() == 1) {
      ctx.stream.copy(data, all, count * sizeof(float));
      return;
    }
    kernels::add(ctx.stream, n, all, all + count, data);
    for (int r = 2; r < comm.size(); ++r)
      kernels::add(ctx.stream, n, data, all + static_cast<std::size_t>(r) * count, data);
  }

  int channels_;
  Scratch saved_;     // batch mean, invstd, then two sums per channel (the forward's moments, the backward's)
  Scratch gathered_;  // BatchNormSync::ordered: every replica's sums
};

class Relu final : public Layer {
 public:
  using Layer::Layer;
  ActShape output_shape(const ActShape& in) const override { return in; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::relu_forward(ctx.stream, ctx.in.numel(), in(ctx, x), out(ctx, y));
  }
  void backward(const LayerContext& ctx, const float*, const float* y, const float* dy, float* dx) override {
    if (dx) kernels::relu_backward(ctx.stream, ctx.in.numel(), in(ctx, y), in(ctx, dy), out(ctx, dx));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Relu>(name()); }
  bool is_relu() const override { return true; }
  bool native_bf16() const override { return true; }
  bool backward_reads_input() const override { return false; }
  bool backward_reads_output() const override { return true; }
};

// torch's rules for a pooling window (kernel, stride >= 1, 0 <= pad <= kernel/2), checked when the
// layer is made rather than at its first forward.
void check_window(const std::string& name, int kernel, int stride, int pad) {
  if (kernel < 1 || stride < 1 || pad < 0 || pad > kernel / 2)
    throw InvalidArgument(
        fmt::format("{}: pooling window {} with stride {} and padding {}: need kernel and stride "
                    ">= 1 and 0 <= padding <= kernel/2",
                    name, kernel, stride, pad));
}

// The window has to fit the padded input (H + 2*pad >= kernel), else torch refuses the shape.
void check_fits(const std::string& name, const ActShape& in, int kernel, int pad) {
  if (in.h + 2 * pad < kernel || in.w + 2 * pad < kernel)
    throw InvalidArgument(fmt::format("{}: input {}x{} (padding {}) is smaller than the {}x{} window", name, in.h, in.w,
                                      pad, kernel, kernel));
}

class MaxPool2d final : public Layer {
 public:
  MaxPool2d(std::string name, int kernel, int stride, int pad)
      : Layer(std::move(name)), kernel_(kernel), stride_(stride), pad_(pad) {
    check_window(this->name(), kernel, stride, pad);
  }
  kernels::MaxPoolShape shape(const ActShape& in) const {
    return kernels::MaxPoolShape{in.n, in.c, in.h, in.w, kernel_, stride_, pad_};
  }
  ActShape output_shape(const ActShape& in) const override {
    check_fits(name(), in, kernel_, pad_);
    const auto s = shape(in);
    return ActShape{in.n, in.c, s.h_out(), s.w_out()};
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto s = shape(ctx.in);
    kernels::maxpool_forward(ctx.stream, s, in(ctx, x), out(ctx, y), indices(ctx, s));
    kept_ = static_cast<std::size_t>(outputs(s)) * sizeof(std::int32_t);
  }
  bool native_bf16() const override { return true; }
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx) override {
    if (!dx) return;
    const auto s = shape(ctx.in);
    kernels::maxpool_backward(ctx.stream, s, indices(ctx, s), in(ctx, dy), out(ctx, dx));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<MaxPool2d>(*this); }
  std::size_t saved_bytes() const override { return kept_; }

 private:
  static std::int64_t outputs(const kernels::MaxPoolShape& s) {
    return static_cast<std::int64_t>(s.n) * s.c * s.h_out() * s.w_out();
  }
  // Kept from the forward to the backward (under autocast too: finding them again in the backward
  // would read the input and write the output a second time).
  std::int32_t* indices(const LayerContext& ctx, const kernels::MaxPoolShape& s) {
    return argmax_.get<std::int32_t>(ctx.device, static_cast<std::size_t>(outputs(s)));
  }

  int kernel_, stride_, pad_;
  Scratch argmax_;
  std::size_t kept_ = 0;  // bytes of indices the last forward kept for the backward
};

class AvgPool2d final : public Layer {
 public:
  AvgPool2d(std::string name, int kernel, int stride, int pad)
      : Layer(std::move(name)), kernel_(kernel), stride_(stride), pad_(pad) {
    check_window(this->name(), kernel, stride, pad);
  }
  kernels::AvgPoolShape shape(const ActShape& in) const {
    return kernels::AvgPoolShape{in.n, in.c, in.h, in.w, kernel_, stride_, pad_};
  }
  ActShape output_shape(const ActShape& in) const override {
    check_fits(name(), in, kernel_, pad_);
    const auto s = shape(in);
    return ActShape{in.n, in.c, s.h_out(), s.w_out()};
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::avgpool_forward(ctx.stream, shape(ctx.in), in(ctx, x), out(ctx, y));
  }
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx) override {
    if (dx) kernels::avgpool_backward(ctx.stream, shape(ctx.in), in(ctx, dy), out(ctx, dx));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<AvgPool2d>(*this); }
  bool backward_reads_input() const override { return false; }
  bool native_bf16() const override { return true; }

 private:
  int kernel_, stride_, pad_;
};

class GlobalAvgPool2d final : public Layer {
 public:
  using Layer::Layer;
  ActShape output_shape(const ActShape& in) const override { return ActShape{in.n, in.c, 1, 1}; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::global_avgpool_forward(ctx.stream, ctx.in.n, ctx.in.c, ctx.in.h * ctx.in.w, in(ctx, x), out(ctx, y));
  }
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx) override {
    if (dx)
      kernels::global_avgpool_backward(ctx.stream, ctx.in.n, ctx.in.c, ctx.in.h * ctx.in.w, in(ctx, dy), out(ctx, dx));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<GlobalAvgPool2d>(name()); }
  bool backward_reads_input() const override { return false; }
  bool native_bf16() const override { return true; }
};

class Dropout final : public Layer {
 public:
  Dropout(std::string name, double p) : Layer(std::move(name)), p_(p) {
    if (!(p >= 0.0 && p <= 1.0))
      throw InvalidArgument(
          fmt::format("{}: dropout probability has to be between 0 and 1, but got {}", this->name(), p));
  }
  ActShape output_shape(const ActShape& in) const override { return in; }
  bool stochastic() const override { return p_ > 0.0; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    if (ctx.mode == Mode::eval) {  // identity, as torch's eval mode
      ctx.stream.copy(y, x, static_cast<std::size_t>(ctx.in.numel()) * in(ctx, x).element_size());
      return;
    }
    const auto [key, offset] = detail::dropout_draw(ctx, name(), ctx.in.per_sample());
    kernels::dropout_forward(ctx.stream, ctx.in.numel(), p_, key, offset, in(ctx, x), out(ctx, y));
  }
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx) override {
    if (!dx) return;
    const auto [key, offset] = detail::dropout_draw(ctx, name(), ctx.in.per_sample());
    kernels::dropout_backward(ctx.stream, ctx.in.numel(), p_, key, offset, in(ctx, dy), out(ctx, dx));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Dropout>(*this); }
  bool backward_reads_input() const override { return false; }
  bool native_bf16() const override { return true; }

 private:
  double p_;
};

// torch.nn.Sequential as a layer (nested containers: torchvision's layer1 = Sequential(BasicBlock)).
class SequentialLayer final : public detail::Container {
 public:
  SequentialLayer(std::string name, Layers children) : Container(std::move(name)), chain_(std::move(children)) {
    adopt_children();
  }
  SequentialLayer(const SequentialLayer&) = default;
  ActShape output_shape(const ActShape& in) const override { return chain_.output_shape(in); }
  bool is_view() const override { return chain_.is_identity(); }
  bool output_bf16(bool input_bf16) const override { return chain_.output_bf16(input_bf16); }
  bool rounds_input() const override { return chain_.rounds_input(); }
  bool adds_to_dx() const override { return chain_.adds_to_dx(); }
  bool copies_dx_bf16() const override { return chain_.copies_dx_bf16(); }
  bool rounds_dy(bool) const override { return chain_.rounds_dy(); }
  void forward(const LayerContext& ctx, const float* x, float* y) override { chain_.forward(ctx, x, y); }
  DType input_dtype() const override { return chain_.input_dtype(); }
  void forward_ids(const LayerContext& ctx, const std::int32_t* ids, float* y) override { chain_.forward(ctx, ids, y); }
  void backward_reporting(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx,
                          const std::function<void(Layer&)>& done) override {
    chain_.backward(ctx, dy, dx, done);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<SequentialLayer>(*this); }

 private:
  std::vector<detail::Chain*> chains() override { return {&chain_}; }

  detail::Chain chain_;
};

// out = body(x) + shortcut(x), then ReLU, in one pass into `y`; backward recomputes nothing: ReLU's
// gradient needs only y.
class Residual final : public detail::Container {
 public:
  Residual(std::string name, Layers body, Layers shortcut, bool relu_after, ResidualAdd add)
      : Container(std::move(name)),
        body_(std::move(body)),
        shortcut_(std::move(shortcut)),
        relu_after_(relu_after),
        add_(add) {
    adopt_children();
  }
  Residual(const Residual&) = default;
  ActShape output_shape(const ActShape& in) const override {
    const ActShape a = body_.output_shape(in), b = shortcut_.output_shape(in);
    if (a.c != b.c || a.h != b.h || a.w != b.w)
      throw InvalidArgument(fmt::format("{}: the body gives ({}, {}, {}) per sample but the shortcut ({}, {}, {})",
                                        name(), a.c, a.h, a.w, b.c, b.h, b.w));
    return a;
  }
  // In place the sum keeps the body's dtype; promoted it is bf16 only when both sides are.
  bool output_bf16(bool input_bf16) const override {
    const bool body = body_.output_bf16(input_bf16);
    return add_ == ResidualAdd::in_place ? body : body && shortcut_.output_bf16(input_bf16);
  }
  // Both branches read the input (an identity shortcut hands it to the add as it is).
  bool rounds_input() const override { return body_.rounds_input() && shortcut_.rounds_input(); }
  // The stream's gradient rounded for the body by its first layer (a transformer block's LayerNorm),
  // which writes the residual's whole dx (dx_add).
  bool copies_dx_bf16() const override {
    return shortcut_.is_identity() && body_.adds_to_dx() && body_.copies_dx_bf16();
  }
  // An fp32 sum's gradient rounded for a bf16 branch.
  bool rounds_dy(bool input_bf16) const override {
    return !relu_after_ && !output_bf16(input_bf16) &&
           (body_.output_bf16(input_bf16) || shortcut_.output_bf16(input_bf16));
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const ActShape out = output_shape(ctx.in);
    const auto n = static_cast<kernels::index_t>(out.numel());
    const void* body = body_.forward(ctx, x, nullptr);
    const void* shortcut = shortcut_.forward(ctx, x, nullptr);
    // Autocast: torch adds in fp32 (bf16 values widened) and rounds to the output's dtype (then
    // ReLU, exact).
    const bool bf16 = ctx.amp && body_.output_bf16(ctx.bf16), shortcut16 = ctx.amp && shortcut_.output_bf16(ctx.bf16);
    add(ctx, n, {body, bf16}, {shortcut, shortcut16}, {y, ctx.amp && output_bf16(ctx.bf16)});
  }
  void backward_reporting(const LayerContext& ctx, const float*, const float* y, const float* dy, float* dx,
                          const std::function<void(Layer&)>& done) override {
    const ActShape out = output_shape(ctx.in);
    const auto n = static_cast<kernels::index_t>(out.numel());
    const auto n_in = static_cast<kernels::index_t>(ctx.in.numel());
    // Autocast: the gradients of bf16 tensors are bf16 (the sum's and the input's).
    const bool out16 = ctx.amp && output_bf16(ctx.bf16), in16 = ctx.amp && ctx.bf16;
    const void* dsum = dy;
    if (relu_after_) {
      void* g = out16 ? static_cast<void*>(dsum_.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(n)))
                      : dsum_.get<float>(ctx.device, static_cast<std::size_t>(n));
      kernels::relu_backward(ctx.stream, n, {y, out16}, {dy, out16}, {g, out16});
      dsum = g;
    }
    // The Add passes dsum to both branches, each in its own dtype where autocast made them differ
    // from the sum's (widened, or rounded as the cast's backward rounds); the input gradient is the
    // sum of theirs. An identity shortcut's part is added by the body's first layer where it can
    // (a transformer block's LayerNorm: one pass over the stream's gradient fewer).
    const bool body16 = ctx.amp && body_.output_bf16(ctx.bf16);
    const bool shortcut16 = ctx.amp && shortcut_.output_bf16(ctx.bf16);
    // dsum in a branch's dtype; an fp32 one's rounding made by the layer that wrote it (dy_bf16).
    const std::uint16_t* dsum16 = relu_after_ || out16 ? nullptr : ctx.dy_bf16;
    const auto branch_dy = [&](bool want16, Scratch& scratch) -> const void* {
      return want16 && dsum16 ? dsum16 : in_dtype(ctx, n, dsum, out16, want16, scratch);
    };
    LayerContext inner = ctx;  // the branches' own: their chains ask for copies themselves
    inner.dx_bf16 = nullptr;
    inner.dy_bf16 = nullptr;
    if (shortcut_.is_identity() && dx && body_.adds_to_dx()) {
      LayerContext body = inner;
      body.dx_add = branch_dy(shortcut16, shortcut_dsum_);
      body.dx_bf16 = ctx.dx_bf16;  // the body's first layer writes the whole dx (copies_dx_bf16)
      body_.backward(body, branch_dy(body16, body_dsum_), dx, done);
      return;
    }
    if (ctx.dx_bf16) throw InvalidArgument(fmt::format("{}: asked for a bf16 copy of a dx it adds up", name()));
    body_.backward(inner, branch_dy(body16, body_dsum_), dx, done);
    dsum = branch_dy(shortcut16, shortcut_dsum_);
    if (shortcut_.is_identity()) {
      if (dx) accumulate(ctx, n_in, in16, dsum, dx);
      return;
    }
    void* shortcut_dx = nullptr;
    if (dx)
      shortcut_dx =
          in16 ? static_cast<void*>(shortcut_dx_.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(n_in)))
               : shortcut_dx_.get<float>(ctx.device, static_cast<std::size_t>(n_in));
    shortcut_.backward(inner, dsum, shortcut_dx, done);
    if (dx) accumulate(ctx, n_in, in16, shortcut_dx, dx);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Residual>(*this); }

 private:
  std::vector<detail::Chain*> chains() override { return {&body_, &shortcut_}; }

  // out = body + shortcut, ReLU'd when relu_after_.
  void add(const LayerContext& ctx, kernels::index_t n, kernels::In body, kernels::In shortcut,
           kernels::Out out) const {
    if (relu_after_)
      kernels::add_relu(ctx.stream, n, body, shortcut, out);
    else
      kernels::add(ctx.stream, n, body, shortcut, out);
  }
  // The sum's gradient g in a branch's dtype: itself, widened, or rounded into `scratch`.
  static const void* in_dtype(const LayerContext& ctx, kernels::index_t n, const void* g, bool g16, bool want16,
                              Scratch& scratch) {
    if (g16 == want16) return g;
    if (g16) {
      float* wide = scratch.get<float>(ctx.device, static_cast<std::size_t>(n));
      kernels::from_bf16(ctx.stream, n, static_cast<const std::uint16_t*>(g), wide);
      return wide;
    }
    auto* bits = scratch.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(n));
    kernels::to_bf16(ctx.stream, n, static_cast<const float*>(g), bits);
    return bits;
  }
  // dx += g, in bf16 (rounded sum) when the input is.
  static void accumulate(const LayerContext& ctx, kernels::index_t n, bool bf16, const void* g, float* dx) {
    kernels::add(ctx.stream, n, {dx, bf16}, {g, bf16}, {dx, bf16});
  }

  detail::Chain body_, shortcut_;
  bool relu_after_;
  ResidualAdd add_;
  Scratch dsum_, body_dsum_, shortcut_dsum_, shortcut_dx_;
};

class Flatten final : public Layer {
 public:
  using Layer::Layer;
  ActShape output_shape(const ActShape& in) const override {
    return ActShape{in.n, static_cast<int>(in.per_sample()), 1, 1};
  }
  bool is_view() const override { return true; }
  void forward(const LayerContext&, const float*, float*) override {}
  void backward(const LayerContext&, const float*, const float*, const float*, float*) override {}
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Flatten>(name()); }
};

}  // namespace

std::string qualified_name(const Layer& layer, const std::string& tensor) {
  return layer.name().empty() ? tensor : layer.name() + "." + tensor;
}

std::unique_ptr<Layer> make_linear(std::string name, int in_features, int out_features) {
  return std::make_unique<Linear>(std::move(name), in_features, out_features);
}
std::unique_ptr<Layer> make_conv2d(std::string name, int in_channels, int out_channels, int kernel, int stride, int pad,
                                   bool bias) {
  return std::make_unique<Conv2d>(std::move(name), in_channels, out_channels, kernel, stride, pad, bias);
}
std::unique_ptr<Layer> make_batchnorm2d(std::string name, int channels) {
  return std::make_unique<BatchNorm2d>(std::move(name), channels);
}
std::unique_ptr<Layer> make_relu(std::string name) { return std::make_unique<Relu>(std::move(name)); }
std::unique_ptr<Layer> make_maxpool2d(std::string name, int kernel, int stride, int pad) {
  return std::make_unique<MaxPool2d>(std::move(name), kernel, stride, pad);
}
std::unique_ptr<Layer> make_flatten(std::string name) { return std::make_unique<Flatten>(std::move(name)); }
std::unique_ptr<Layer> make_avgpool2d(std::string name, int kernel, int stride, int pad) {
  return std::make_unique<AvgPool2d>(std::move(name), kernel, stride, pad);
}
std::unique_ptr<Layer> make_global_avgpool2d(std::string name) {
  return std::make_unique<GlobalAvgPool2d>(std::move(name));
}
std::unique_ptr<Layer> make_dropout(std::string name, double p) {
  return std::make_unique<Dropout>(std::move(name), p);
}
std::unique_ptr<Layer> make_sequential(std::string name, Layers children) {
  return std::make_unique<SequentialLayer>(std::move(name), std::move(children));
}
std::unique_ptr<Layer> make_residual(std::string name, Layers body, Layers shortcut, bool relu_after, ResidualAdd add) {
  return std::make_unique<Residual>(std::move(name), std::move(body), std::move(shortcut), relu_after, add);
}

namespace detail {

// 32-bit FNV-1a of the layer's full name: a stochastic layer's stream of random numbers, the same in
// every replica and on every run, different for every layer of a model.
static std::uint32_t name_hash(const std::string& name) {
  std::uint32_t h = 2166136261u;
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  return h;
}

std::pair<kernels::DropoutKey, std::uint64_t> dropout_draw(const LayerContext& ctx, const std::string& name,
                                                           std::int64_t per_sample) {
  const RandomContext random = ctx.random ? *ctx.random : RandomContext{};
  const kernels::DropoutKey key{random.seed, name_hash(name), static_cast<std::uint32_t>(random.step),
                                random.step_on_device};
  return {key, random.sample_offset * static_cast<std::uint64_t>(per_sample)};
}

}  // namespace detail

}  // namespace dp::nn
