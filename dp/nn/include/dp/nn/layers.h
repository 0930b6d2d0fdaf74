// dp/nn/layers.h — the layers models are made of, with PyTorch's semantics and state-dict names:
// Linear, Conv2d (optional bias), BatchNorm2d, ReLU, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d(1),
// Flatten, Dropout, and the containers Sequential and Residual (two branches joined by an
// element-wise Add, as a ResNet block's `out += identity`). A layer declares its parameters and
// buffers; the model packs them into its flat buffers and binds pointers back; forward/backward
// enqueue kernels on the stream they are given. Compose them and hand the list to
// dp::nn::SequentialModel (dp/nn/sequential.h): the result is a dp::Model any engine trains.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/nn/model.h"
#include "dp/nn/tensor.h"
#include "dp/runtime/device.h"
#include "dp/runtime/memory.h"
#include "dp/runtime/scratch.h"

namespace dp::nn {

// Activation shape (N, C, H, W); a (N, F) matrix is (N, F, 1, 1).
struct ActShape {
  int n = 0, c = 0, h = 1, w = 1;
  // A sequence: each sample T positions (tokens) of C features, laid out (T, 1, C); a language
  // model's input is T token ids, (T, 1, 1). Named so that the transformer layers say T and C.
  static ActShape sequence(int n, int positions, int features) { return {n, positions, 1, features}; }
  int positions() const { return c; }  // T
  int features() const { return w; }   // C, per position
  std::int64_t per_sample() const { return static_cast<std::int64_t>(c) * h * w; }
  std::int64_t numel() const { return per_sample() * n; }
  // A model's output per sample as rows of logits, each with its own class target: (T, 1, F) with
  // F > 1 is T rows of F (a Linear or a language model on each token of a sequence); any other
  // shape one row of C*H*W (a classifier's (K, 1, 1)).
  int rows() const { return h == 1 && w > 1 ? positions() : 1; }
  std::int64_t row_features() const { return per_sample() / rows(); }
};

// How a parameter or buffer starts (PyTorch's defaults; normal: N(0, 1), nn.Embedding's).
enum class Init { kaiming_uniform, fan_in_uniform, ones, zeros, normal };

struct TensorDecl {
  std::string name;  // relative to the layer, e.g. "weight"
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  Init init = Init::zeros;
  std::int64_t fan_in = 0;  // for the uniform inits: bound = 1/sqrt(fan_in)
  std::size_t offset = 0;   // filled by the model: elements (params) or bytes (buffers) into the flat buffer
};

// Autocast's device scratch, one per model (Model::set_autocast(Autocast::bf16)), which its layers
// use one after another on the model's stream. Between layers, every tensor after the first Linear
// or Conv2d is bf16 (16-bit storage: half the activation memory and traffic). The built-in layers
// read and write it as it is (native_bf16: their kernels load bf16, compute in fp32, round once);
// for any other leaf a chain widens the bf16 inputs into `x`/`y`/`dy`, runs the layer's fp32
// arithmetic into `out`/`dx` and rounds that back. Linear and Conv2d take their weights as bf16
// (as bf16 storage, their own; `weight`: fp32 words holding bf16 values) and multiply them with their bf16
// inputs in fp32, which is exact (two 8-bit mantissas fit a 24-bit one), so only the accumulation
// order can differ from torch's; their gradients go through `grad` (the weight's: fp32, or `grad16`
// where its GEMM writes it bf16) and `grad_bias` to be rounded to bf16 before they reach the fp32
// buffer. `workspace` is the shared path's convolution scratch, only where no library
// convolves bf16 storage (conv2d_supports_bf16).
struct AutocastScratch {
  Scratch x, y, dy, out, dx, weight, grad, grad_bias, grad16, workspace;
  // Buffers outgrown during a step: kept until the next forward, since work queued before the
  // growth (maybe waiting on a SyncBatchNorm collective) still reads them.
  std::vector<DeviceBuffer> retired;
  template <class T>
  T* get(Scratch& scratch, Device& device, std::int64_t count) {
    return scratch.get<T>(device, static_cast<std::size_t>(count), &retired);
  }
};

struct LayerContext {
  const Stream& stream;
  Device& device;
  ActShape in;
  Mode mode;
  const RandomContext* random = nullptr;  // train mode: what Dropout draws from
  const BatchNormSync* sync = nullptr;    // train mode: SyncBatchNorm's replicas, when synchronised
  // Backward: add the parameter gradients to what the flat gradient buffer holds (gradient
  // accumulation, DDP's no_sync), or write them (the first backward after the model's zero_grad,
  // which enqueues no fill: torch's set_to_none). Writing, a layer stores EVERY one of its
  // parameter gradients in every backward, whatever its batch, since the buffer may hold anything.
  bool accumulate_grads = true;
  // Autocast bf16: the model's scratch (null: fp32 throughout). A leaf layer is handed fp32
  // tensors (the chain widens and rounds around it) unless it is native_bf16(), and uses `amp`
  // itself only when it autocasts (Linear, Conv2d: bf16 weights and gradients); a container and a
  // native leaf are handed the chain's storage, bf16 when `bf16` is set (the uint16 bits behind
  // their float pointers), and a container passes it to its chains.
  AutocastScratch* amp = nullptr;
  bool bf16 = false;
  // Autocast: the output's storage, bf16 where set: output_bf16(bf16), or bf16 for a layer that
  // may_round_output() whose reader rounds its input (its gradient dy has the same storage).
  bool out_bf16 = false;
  // Backward: a gradient of dx's storage that a layer which adds_to_dx() adds to what it writes into
  // dx, in the same pass (a residual's shortcut gradient, into its body's first layer's); null: none.
  const void* dx_add = nullptr;
  // Backward under autocast: where a layer that copies_dx_bf16() also writes its fp32 dx rounded to
  // bf16, in the same pass (the cast the layer before it would make of its dy); null: none.
  std::uint16_t* dx_bf16 = nullptr;
  // Backward under autocast: the fp32 dy rounded to bf16 by the layer that wrote dy, for a layer
  // that rounds_dy() to use instead of rounding it again; null: it rounds dy itself.
  const std::uint16_t* dy_bf16 = nullptr;
};

// Where a model's layers find their parameters' gradients: its flat buffer, or the slots an engine
// placed them in (Model::place_gradients).
struct GradientPlace {
  float* flat = nullptr;
  GradientSlots* slots = nullptr;
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  const std::string& name() const { return name_; }

  // Declarations relative to the layer ("weight"; a container's "conv1.weight"), in PyTorch's
  // parameters() order. The model fills in their offsets, then binds.
  std::vector<TensorDecl>& params() { return params_; }
  std::vector<TensorDecl>& buffers() { return buffers_; }
  // Called once the model has allocated its flat buffers and set the offsets of params() and
  // buffers(); a container passes the offsets on to its children.
  // `grads` is the model's, read at every backward.
  virtual void bind(float* params_flat, const GradientPlace* grads, std::byte* buffers_flat) {
    params_flat_ = params_flat;
    grads_ = grads;
    buffers_flat_ = buffers_flat;
  }
  // A container puts its own name in front of its children's ("layer1.0" + "conv1"), so that
  // messages and Dropout's stream of random numbers name the layer as the state dict does.
  virtual void add_prefix(const std::string& prefix) { name_ = prefix + "." + name_; }

  virtual ActShape output_shape(const ActShape& in) const = 0;
  // Multiply-adds per sample of the forward's GEMMs and convolutions on input `in` (a container:
  // its children's): what a model's FLOP count is made of. Elementwise layers count none.
  virtual std::int64_t multiply_adds(const ActShape&) const { return 0; }
  // Of those, the multiply-adds whose input-gradient GEMMs a model skips when this is its first layer
  // that computes (the model's input needs no gradient): a Linear's or Conv2d's all of them; a
  // language model's none (its first layer, the embedding, computes no input gradient anyway).
  virtual std::int64_t first_layer_skipped_multiply_adds(const ActShape& in) const { return multiply_adds(in); }
  // Output aliases the input (Flatten): no buffer, no kernel.
  virtual bool is_view() const { return false; }
  // y = layer(x). In train mode keeps what backward needs (it may also read x and y there).
  virtual void forward(const LayerContext& ctx, const float* x, float* y) = 0;
  // What the layer reads: f32 activations (forward), or i32 token ids (forward_ids: an embedding,
  // which only a model's first layer can be; its backward is handed no x and writes no dx).
  virtual DType input_dtype() const { return DType::f32; }
  virtual void forward_ids(const LayerContext& ctx, const std::int32_t* ids, float* y);
  // dx = dL/dx (skipped when null), parameter gradients accumulated or written (ctx.accumulate_grads).
  virtual void backward(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx) = 0;
  // backward, then `done(layer)` for every layer whose parameter gradients are then enqueued: this
  // layer itself, or a container's children one by one as its backward reaches them (so DDP can
  // start a bucket's all-reduce inside a residual block, not after it).
  virtual void backward_reporting(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx,
                                  const std::function<void(Layer&)>& done) {
    backward(ctx, x, y, dy, dx);
    if (done) done(*this);
  }
  virtual std::unique_ptr<Layer> clone() const = 0;

  // Autocast. autocasts(): the layer is one torch runs in bf16 (Linear, Conv2d): its output is
  // bf16 whatever its input. Any other layer keeps its input's dtype. A container handles its
  // chains' storage itself (is_container) and says what dtype its output has.
  virtual bool autocasts() const { return false; }
  virtual bool is_container() const { return false; }
  virtual bool output_bf16(bool input_bf16) const { return input_bf16 || autocasts(); }
  // A leaf that takes the chain's storage as it is, bf16 bits behind its float pointers where
  // ctx.bf16 (its output's: ctx.out_bf16): its kernels read bf16, compute in fp32 and round once,
  // the values of the chain's widening and rounding around it, without the fp32 copies.
  virtual bool native_bf16() const { return false; }
  // Whether the layer reads its input only as bf16 values under autocast (autocast's cast before a
  // Linear or Conv2d; a container: every reader of its input does).
  virtual bool rounds_input() const { return autocasts(); }
  // A native leaf whose output is fp32 under autocast (torch's rule: LayerNorm), which a chain may
  // hand bf16 storage for it (ctx.out_bf16) where the next layer rounds_input(): it then writes the
  // values that rounding would give, and takes its gradient in bf16, as the cast's backward widens
  // it (the same values, without the fp32 tensor and the cast's passes, forward and backward).
  virtual bool may_round_output() const { return false; }
  // Whether the backward adds ctx.dx_add to the dx it writes (bits of a separate add after it); a
  // container: its first computing child does. A chain hands dx_add to its first child only.
  virtual bool adds_to_dx() const { return false; }
  // Under autocast, whether the backward can also write its fp32 dx rounded to bf16 into
  // ctx.dx_bf16 in the pass that writes dx (LayerNorm); a container: the child that writes its dx can.
  virtual bool copies_dx_bf16() const { return false; }
  // Under autocast, whether the backward (of an input with the given storage) rounds its fp32 dy to
  // bf16 before using it, and so takes ctx.dy_bf16 where the layer after it made that copy (a
  // residual whose bf16 branch joins the fp32 stream); a container: its last computing child does.
  virtual bool rounds_dy(bool /*input_bf16*/) const { return false; }
  // What a leaf's backward reads besides dy, so that a chain under autocast widens only those.
  virtual bool backward_reads_input() const { return true; }
  virtual bool backward_reads_output() const { return false; }
  // Bytes the last train forward kept for the backward beyond the activations a chain holds
  // (max-pool indices, BatchNorm statistics; a container: its chains').
  virtual std::size_t saved_bytes() const { return 0; }
  // Parameters torch's state dict also lists under another name, relative to the layer: {alias,
  // parameter} (a tied head: {"lm_head.weight", "transformer.wte.weight"}).
  virtual std::vector<std::pair<std::string, std::string>> aliases() const { return {}; }

  // Fusion with a following ReLU, which a list of layers (Chain) applies by itself: when a layer
  // that fuses_relu() is followed by one that is_relu(), the chain runs forward_relu (y = relu of
  // the layer's output, one pass) in place of both forwards, and backward_relu (dy = dL/dy of that
  // y) in place of both backwards. Both give the two layers' bits; the layers, their names and
  // their parameters stay as they are.
  virtual bool fuses_relu() const { return false; }
  virtual bool is_relu() const { return false; }
  virtual void forward_relu(const LayerContext& ctx, const float* x, float* y);
  virtual void backward_relu(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx);

  // Whether train-mode forwards draw random numbers (ctx.random): the model then keeps the step in
  // device memory (RandomContext::step_on_device), which the layer's kernels must read instead of a
  // step baked into their launches, so that a captured step replays with each step's masks. A layer
  // that reads ctx.random must say so.
  virtual bool stochastic() const { return false; }

 protected:
  float* param(std::size_t i) const { return params_flat_ + params_[i].offset; }
  // Ask for it in the backward, for each parameter apart: slots need not keep two parameters side
  // by side.
  float* grad(std::size_t i) const {
    const TensorDecl& p = params_[i];
    return grads_->slots ? grads_->slots->gradient(p.offset, numel(p.shape)) : grads_->flat + p.offset;
  }
  template <class T>
  T* buffer(std::size_t i) const {
    return reinterpret_cast<T*>(buffers_flat_ + buffers_[i].offset);
  }

  std::vector<TensorDecl> params_;
  std::vector<TensorDecl> buffers_;

 private:
  std::string name_;
  float* params_flat_ = nullptr;
  const GradientPlace* grads_ = nullptr;
  std::byte* buffers_flat_ = nullptr;
};

using Layers = std::vector<std::unique_ptr<Layer>>;

// A layer's tensor `tensor` ("weight") as the state dict names it: "<layer>.weight", or the tensor's
// own name for an unnamed container (whose declarations already carry its children's names).
std::string qualified_name(const Layer& layer, const std::string& tensor);

// torch.nn.Linear(in_features, out_features).
// On (N, F, 1, 1) (or any input of in_features per sample: flattened), or on the last dimension of
// (N, T, 1, in_features), one token at a time (torch's Linear on a (N, T, C) tensor).
std::unique_ptr<Layer> make_linear(std::string name, int in_features, int out_features);
// torch.nn.Conv2d(in, out, kernel, stride, pad, bias): square kernel, dilation 1, groups 1.
std::unique_ptr<Layer> make_conv2d(std::string name, int in_channels, int out_channels, int kernel, int stride, int pad,
                                   bool bias = true);
// torch.nn.BatchNorm2d(channels) (eps 1e-5, momentum 0.1, affine, running statistics).
std::unique_ptr<Layer> make_batchnorm2d(std::string name, int channels);
std::unique_ptr<Layer> make_relu(std::string name);
// torch.nn.MaxPool2d(kernel, stride, pad) (floor mode, dilation 1; padding never wins a window).
std::unique_ptr<Layer> make_maxpool2d(std::string name, int kernel, int stride, int pad = 0);
// torch.nn.AvgPool2d(kernel, stride, pad) (ceil_mode False, count_include_pad True).
std::unique_ptr<Layer> make_avgpool2d(std::string name, int kernel, int stride, int pad = 0);
// torch.nn.AdaptiveAvgPool2d(1): the mean of every (sample, channel) plane, output (N, C, 1, 1).
std::unique_ptr<Layer> make_global_avgpool2d(std::string name);
// torch.nn.Flatten(): (N, C, H, W) -> (N, C*H*W), a view (no copy).
std::unique_ptr<Layer> make_flatten(std::string name);
// A transformer's layers on sequences, (N, T, 1, C) per batch (T tokens of C features), each token
// on its own: torch.nn.LayerNorm(width) (eps 1e-5, fp32 under autocast, as torch's), torch.nn.GELU
// (approximate 'none', or 'tanh' as GPT-2's), and nanoGPT's CausalSelfAttention (c_attn and c_proj
// Linears named as its state dict names them, `heads` heads of width/heads, its attn_dropout on the
// attention probabilities in training; resid_dropout is a make_dropout after it).
std::unique_ptr<Layer> make_layernorm(std::string name, int width);
std::unique_ptr<Layer> make_gelu(std::string name, bool tanh_approximation = false);
// `fused`: the attention without a (T, T) matrix in memory (attention_fused_*, head dims up to
// kernels::kAttentionMaxHeadDim); false: the products and softmax apart, the reference.
std::unique_ptr<Layer> make_causal_self_attention(std::string name, int width, int heads, double dropout = 0.0,
                                                  bool fused = true);
// nanoGPT's GPT around `body` (its blocks, named transformer.h.0, ..., then transformer.ln_f): token
// ids per sample (T int32 ids in [0, vocab), T <= context) through the token and
// position embeddings transformer.wte (vocab, width) and transformer.wpe (context, width), the body,
// and lm_head tied to wte (no bias): logits (T, 1, vocab) per sample. The tied lm_head is wte itself,
// one tensor (torch's state dict names it twice). `classes` (0: vocab) < vocab gives logits for the
// first `classes` rows only, as llm.c pads its table: the rows past them get no gradient.
std::unique_ptr<Layer> make_language_model(int vocab, int context, int width, Layers body, int classes = 0);
// torch.nn.Dropout(p): in train mode zeroes each element with probability p and scales the rest by
// 1/(1-p); identity in eval mode. The mask comes from Philox4x32-10 (Random123) keyed by the
// model's RandomContext (seed, step), this layer's name and the element's index in the step's
// batch: no mask is stored, backward draws it again.
std::unique_ptr<Layer> make_dropout(std::string name, double p = 0.5);

// torch.nn.Sequential: the children run in order; their names are relative ("0", "conv1"), the
// state dict says "<name>.<child>.<parameter>".
std::unique_ptr<Layer> make_sequential(std::string name, Layers children);
// A residual block: out = body(x) + shortcut(x) (element-wise Add), then ReLU when `relu_after`,
// as torchvision's BasicBlock. An empty shortcut is the identity. Parameters: the body's, then the
// shortcut's, as torchvision registers conv1, bn1, conv2, bn2, then downsample. An empty name adds
// no level to its children's names: nanoGPT's Block h.0 is a Sequential "h.0" of two unnamed
// residuals (x + attn(ln_1(x)), x + mlp(ln_2(x))) whose children are h.0.ln_1, h.0.attn, ....
// `add` says which of torch's adds it is, which matters under autocast where the two sides' dtypes
// differ: in_place is torchvision's `out += identity` (the sum in the body's dtype, bf16 after a
// convolution); promote is `x + f(x)` (torch's type promotion: fp32 if either side is, so nanoGPT's
// residual stream stays fp32 while its branches compute in bf16).
enum class ResidualAdd { in_place, promote };
std::unique_ptr<Layer> make_residual(std::string name, Layers body, Layers shortcut = {}, bool relu_after = true,
                                     ResidualAdd add = ResidualAdd::in_place);

}  // namespace dp::nn
