// transformer.cpp — a transformer's layers on sequences of tokens: LayerNorm, GELU and causal
// multi-head self-attention, with torch's semantics and nanoGPT's parameter names. A sequence of T
// tokens of C features is the activation shape (N, T, 1, C); these layers, and Linear, act on its
// last dimension, one token (row) at a time, as torch's do.
#include <fmt/format.h>

#include "dp/kernels/attention.h"
#include "dp/kernels/gelu.h"
#include "dp/kernels/layernorm.h"
#include "dp/kernels/linear.h"
#include "dp/nn/layers.h"
#include "dp/runtime/error.h"

namespace dp::nn {
namespace {

// The rows of a (N, T, 1, C) activation: N * T tokens of C features.
kernels::index_t token_rows(const ActShape& in) { return static_cast<kernels::index_t>(in.n) * in.c * in.h; }

void check_tokens(const std::string& name, const ActShape& in, int width) {
  if (in.w != width)
    throw InvalidArgument(fmt::format("{}: expects {} features per token (the last dimension), got {} in ({}, {}, {})",
                                      name, width, in.w, in.c, in.h, in.w));
}

// torch.nn.LayerNorm(width) (eps 1e-5) over each token's features. torch's autocast runs layer_norm
// in fp32: its output is fp32 whatever its input (a chain widens a bf16 input for it).
class LayerNorm final : public Layer {
 public:
  LayerNorm(std::string name, int width) : Layer(std::move(name)), width_(width) {
    if (width < 1) throw InvalidArgument(fmt::format("{}: LayerNorm over {} features", this->name(), width));
    params_.push_back({"weight", DType::f32, {width}, Init::ones, 0});
    params_.push_back({"bias", DType::f32, {width}, Init::zeros, 0});
  }
  ActShape output_shape(const ActShape& in) const override {
    check_tokens(name(), in, width_);
    return in;
  }
  bool output_bf16(bool) const override { return false; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto rows = token_rows(ctx.in);
    float* stats = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(rows));
    kernels::layernorm_forward(ctx.stream, rows, width_, x, param(0), param(1), y, stats, stats + rows);
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const auto rows = token_rows(ctx.in);
    float* stats = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(rows));
    kernels::layernorm_backward(ctx.stream, rows, width_, x, param(0), stats, stats + rows, dy, dx, grad(0), grad(1),
                                stats + 2 * rows, ctx.accumulate_grads);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<LayerNorm>(*this); }
  std::size_t saved_bytes() const override { return saved_.size() / 2; }  // mean and rstd

 private:
  int width_;
  Scratch saved_;  // mean, rstd (rows each), then the backward's row sums (2 * rows)
};

// torch.nn.GELU(approximate='none' | 'tanh'): elementwise, in the input's dtype (bf16 storage read
// and written as it is).
class Gelu final : public Layer {
 public:
  Gelu(std::string name, kernels::GeluForm form) : Layer(std::move(name)), form_(form) {}
  ActShape output_shape(const ActShape& in) const override { return in; }
  bool native_bf16() const override { return true; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::gelu_forward(ctx.stream, ctx.in.numel(), form_, {x, ctx.bf16}, {y, ctx.bf16});
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    if (dx) kernels::gelu_backward(ctx.stream, ctx.in.numel(), form_, {x, ctx.bf16}, {dy, ctx.bf16}, {dx, ctx.bf16});
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Gelu>(*this); }

 private:
  kernels::GeluForm form_;
};

// nanoGPT's CausalSelfAttention without dropout: c_attn (C -> 3C), the causal attention of `heads`
// heads (dp/kernels/attention.h), c_proj (C -> C), its parameters named as nanoGPT's state dict
// names them. fp32 inside (under autocast the chain widens its input and rounds its output).
class CausalSelfAttention final : public Layer {
 public:
  CausalSelfAttention(std::string name, int width, int heads) : Layer(std::move(name)), width_(width), heads_(heads) {
    if (width < 1 || heads < 1 || width % heads != 0)
      throw InvalidArgument(fmt::format("{}: {} features do not split into {} heads", this->name(), width, heads));
    params_.push_back({"c_attn.weight", DType::f32, {3 * width, width}, Init::kaiming_uniform, width});
    params_.push_back({"c_attn.bias", DType::f32, {3 * width}, Init::fan_in_uniform, width});
    params_.push_back({"c_proj.weight", DType::f32, {width, width}, Init::kaiming_uniform, width});
    params_.push_back({"c_proj.bias", DType::f32, {width}, Init::fan_in_uniform, width});
  }
  ActShape output_shape(const ActShape& in) const override {
    check_tokens(name(), in, width_);
    if (in.h != 1)
      throw InvalidArgument(
          fmt::format("{}: expects (tokens, 1, features) per sample, got ({}, {}, {})", name(), in.c, in.h, in.w));
    return in;
  }
  // Per sample: the two projections' T * (3C + C) * C, and the scores' and values' 2 * T * T * C.
  std::int64_t multiply_adds(const ActShape& in) const override {
    const std::int64_t t = in.c, c = width_;
    return t * 4 * c * c + 2 * t * t * c;
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const Buffers b = buffers(ctx);
    const auto rows = static_cast<int>(token_rows(ctx.in));
    kernels::linear_forward(ctx.stream, rows, width_, 3 * width_, x, param(0), param(1), b.qkv);
    kernels::attention_forward(ctx.stream, shape(ctx.in), b.qkv, b.probs, b.heads);
    kernels::linear_forward(ctx.stream, rows, width_, width_, b.heads, param(2), param(3), y);
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const Buffers b = buffers(ctx);
    const auto rows = static_cast<int>(token_rows(ctx.in));
    kernels::linear_backward(ctx.stream, rows, width_, width_, b.heads, param(2), dy, b.dheads, grad(2), grad(3),
                             ctx.accumulate_grads);
    kernels::attention_backward(ctx.stream, shape(ctx.in), b.qkv, b.probs, b.dheads, b.dqkv, b.dprobs);
    kernels::linear_backward(ctx.stream, rows, width_, 3 * width_, x, param(0), b.dqkv, dx, grad(0), grad(1),
                             ctx.accumulate_grads);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<CausalSelfAttention>(*this); }
  std::size_t saved_bytes() const override { return kept_; }

 private:
  kernels::AttentionShape shape(const ActShape& in) const { return {in.n, in.c, heads_, width_ / heads_}; }
  // What the forward keeps for the backward (qkv, the attention probabilities, the heads' output)
  // and the backward's own scratch.
  struct Buffers {
    float* qkv;
    float* probs;
    float* heads;
    float* dqkv;
    float* dprobs;
    float* dheads;
  };
  Buffers buffers(const LayerContext& ctx) {
    const auto rows = static_cast<std::size_t>(token_rows(ctx.in)), c = static_cast<std::size_t>(width_);
    const auto probs = static_cast<std::size_t>(shape(ctx.in).probs());
    kept_ = (rows * 4 * c + probs) * sizeof(float);
    return {qkv_.get<float>(ctx.device, rows * 3 * c),   probs_.get<float>(ctx.device, probs),
            heads_out_.get<float>(ctx.device, rows * c), dqkv_.get<float>(ctx.device, rows * 3 * c),
            dprobs_.get<float>(ctx.device, probs),       dheads_.get<float>(ctx.device, rows * c)};
  }

  int width_, heads_;
  Scratch qkv_, probs_, heads_out_, dqkv_, dprobs_, dheads_;
  std::size_t kept_ = 0;
};

}  // namespace

std::unique_ptr<Layer> make_layernorm(std::string name, int width) {
  return std::make_unique<LayerNorm>(std::move(name), width);
}
std::unique_ptr<Layer> make_gelu(std::string name, bool tanh_approximation) {
  return std::make_unique<Gelu>(std::move(name),
                                tanh_approximation ? kernels::GeluForm::tanh : kernels::GeluForm::exact);
}
std::unique_ptr<Layer> make_causal_self_attention(std::string name, int width, int heads) {
  return std::make_unique<CausalSelfAttention>(std::move(name), width, heads);
}

}  // namespace dp::nn
