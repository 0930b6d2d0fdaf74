// chain.h — layers run one after the other, with the activations between them kept for backward:
// the one implementation behind SequentialModel and the Sequential and Residual containers.
#pragma once

#include <functional>
#include <vector>

#include "dp/nn/layers.h"
#include "dp/runtime/scratch.h"

namespace dp::nn::detail {

// Autocast: `n` bf16 values (their bits at `bits`) widened, exactly, into the model's scratch `into`.
float* widen(const LayerContext& ctx, Scratch& into, const void* bits, std::int64_t n);
// An fp32 view of `n` values for arithmetic under autocast: bf16 storage widened (exact), or with
// `round`, fp32 rounded to bf16 values into `into` (autocast's cast of a Linear's or Conv2d's
// input); else the data itself.
const float* widened(const LayerContext& ctx, const void* data, bool bf16, bool round, std::int64_t n, Scratch& into);

class Chain {
 public:
  Chain() = default;
  explicit Chain(Layers layers);
  // A deep copy: the children cloned, no activations (a replica on another device keeps its own).
  Chain(const Chain& other);
  Chain& operator=(const Chain&) = delete;
  Chain(Chain&&) noexcept = default;

  const Layers& layers() const { return layers_; }
  bool stochastic() const {
    for (const auto& layer : layers_)
      if (layer->stochastic()) return true;
    return false;
  }
  // What the chain reads: its first child's input (token ids for an embedding, else activations).
  DType input_dtype() const { return layers_.empty() ? DType::f32 : layers_.front()->input_dtype(); }
  // True when no child computes anything (empty, or views only): the output is the input.
  bool is_identity() const { return first_compute() == layers_.size(); }
  ActShape output_shape(ActShape in) const;
  // The children's multiply-adds per sample (Layer::multiply_adds), each on its own input.
  std::int64_t multiply_adds(ActShape in) const;

  // The children's declarations, named "<child>.<name>", appended in order (a container's own).
  void collect(std::vector<TensorDecl>& params, std::vector<TensorDecl>& buffers) const;
  // Takes the offsets the model set on those declarations back to the children (from index
  // `param`/`buffer` on, advancing them) and binds the children.
  void bind(const std::vector<TensorDecl>& params, std::size_t& param, const std::vector<TensorDecl>& buffers,
            std::size_t& buffer, float* params_flat, const GradientPlace* grads, std::byte* buffers_flat);
  void add_prefix(const std::string& prefix);

  // Whether the output of a chain whose input has the given dtype is bf16 (autocast: after a Linear
  // or Conv2d, or a last child that may_round_output for a reader that rounds).
  bool output_bf16(bool input_bf16) const;
  // Whether the chain reads its input only as bf16 values (its first computing child does; an
  // identity chain hands its input to its reader: false).
  bool rounds_input() const;
  // The chain's reader rounds its output to bf16 under autocast (a tied head that autocasts).
  void set_reader_rounds(bool rounds) { reader_rounds_ = rounds; }
  // Whether backward adds ctx.dx_add to the dx it writes (its first computing child adds_to_dx).
  bool adds_to_dx() const;
  // Under autocast, after a train forward: whether backward can also write its fp32 dx rounded to
  // bf16 into ctx.dx_bf16 (the child that writes dx can: Layer::copies_dx_bf16), and whether it
  // rounds its fp32 dy first and so takes ctx.dy_bf16 (its last computing child does: rounds_dy).
  bool copies_dx_bf16() const;
  bool rounds_dy() const;

  // Runs the children on x (shape ctx.in; bf16 storage when ctx.bf16; input_dtype()'s elements). The last child that
  // computes writes into `y` when it is given (a container's output), else into the chain's own activation memory.
  // Returns the output (bf16 storage when output_bf16(ctx.bf16)): x itself for an identity chain.
  const void* forward(const LayerContext& ctx, const void* x, void* y);
  // Backward of the last forward given dL/d(output) (in the output's dtype): dx (overwritten, in
  // the input's dtype; plus ctx.dx_add where adds_to_dx()) unless null, parameter gradients accumulated or written
  // (ctx.accumulate_grads, passed on to every child). `after` is called with each layer right after
  // its backward is enqueued, last child first, and inside containers with their children
  // (Layer::backward_reporting). An identity chain copies dy to dx.
  void backward(const LayerContext& ctx, const void* dy, void* dx, const std::function<void(Layer&)>& after = {});
  // The batch of the last forward.
  int batch() const { return shapes_.empty() ? 0 : shapes_[0].n; }
  // Bytes of the activations the last train forward keeps (its boundaries, the input excluded).
  std::size_t saved_bytes() const;

 private:
  std::size_t first_compute() const;
  // Whether the output of child i, given its input's dtype, is bf16 under autocast.
  bool child_output_bf16(std::size_t i, bool input_bf16) const;
  // One child's forward and backward (index i; `fused`: it and the ReLU after it), from and into
  // the chain's storage: under autocast a leaf gets fp32 tensors widened from bf16 ones.
  void forward_child(const LayerContext& ctx, std::size_t i, bool fused, void* out);
  // `dy16`: dy rounded to bf16 by the layer after it, where child i rounds_dy (else null); `dx16`:
  // where child i also writes its dx rounded, for the child before it (else null).
  void backward_child(const LayerContext& ctx, std::size_t i, bool fused, const void* dy, void* dx,
                      const std::uint16_t* dy16, std::uint16_t* dx16, const std::function<void(Layer&)>& after);
  // Whether the child that runs backward after child i (the computing one before it) rounds its
  // fp32 dy to bf16: then child i, where it copies_dx_bf16, writes that rounding with its dx (i =
  // the child count: whether the last computing child does).
  bool next_rounds_dy(std::size_t i) const;
  // The boundary's bytes per element.
  std::size_t element_size(std::size_t boundary) const { return bf16_[boundary] ? 2 : 4; }
  void* activation(const LayerContext& ctx, std::vector<Scratch>& memory, std::size_t boundary);

  Layers layers_;
  // Of the last forward: the shape, data and dtype at each boundary (index 0 = the input).
  std::vector<ActShape> shapes_;
  std::vector<const void*> outputs_;
  std::vector<bool> bf16_;
  std::vector<Scratch> activations_, activation_grads_;
  Scratch grad_copies_[2];  // autocast: the bf16 copies of dx its children write for each other
  // relu_fused_[i]: child i ran forward_relu for itself and child i + 1 (a ReLU) in the last forward.
  std::vector<bool> relu_fused_;
  static constexpr std::size_t kNone = ~std::size_t{0};
  std::size_t caller_boundary_ = kNone;  // the boundary the last forward wrote into the caller's y
  bool reader_rounds_ = false;
  bool train_forward_done_ = false;
};

}  // namespace dp::nn::detail
