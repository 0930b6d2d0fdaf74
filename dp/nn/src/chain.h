// chain.h — layers run one after the other, with the activations between them kept for backward:
// the one implementation behind SequentialModel and the Sequential and Residual containers.
#pragma once

#include <functional>
#include <vector>

#include "dp/nn/layers.h"
#include "dp/runtime/scratch.h"

namespace dp::nn::detail {

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
  // True when no child computes anything (empty, or views only): the output is the input.
  bool is_identity() const { return first_compute() == layers_.size(); }
  ActShape output_shape(ActShape in) const;

  // The children's declarations, named "<child>.<name>", appended in order (a container's own).
  void collect(std::vector<TensorDecl>& params, std::vector<TensorDecl>& buffers) const;
  // Takes the offsets the model set on those declarations back to the children (from index
  // `param`/`buffer` on, advancing them) and binds the children.
  void bind(const std::vector<TensorDecl>& params, std::size_t& param, const std::vector<TensorDecl>& buffers,
            std::size_t& buffer, float* params_flat, float* grads_flat, std::byte* buffers_flat);
  void add_prefix(const std::string& prefix);

  // Runs the children on x (shape ctx.in). The last child that computes writes into `y` when it is
  // given (a container's output), else into the chain's own activation memory. Returns the output:
  // x itself for an identity chain.
  const float* forward(const LayerContext& ctx, const float* x, float* y);
  // Backward of the last forward given dL/d(output): dx (overwritten) unless null, parameter
  // gradients accumulated or written (ctx.accumulate_grads, passed on to every child). `after` is
  // called with each layer right after its backward is enqueued, last child first, and inside
  // containers with their children (Layer::backward_reporting). An identity chain copies dy to dx.
  void backward(const LayerContext& ctx, const float* dy, float* dx, const std::function<void(Layer&)>& after = {});

 private:
  std::size_t first_compute() const;

  Layers layers_;
  // Of the last forward: the shape and data at each boundary (index 0 = the input).
  std::vector<ActShape> shapes_;
  std::vector<const float*> outputs_;
  std::vector<Scratch> activations_, activation_grads_;
  // relu_fused_[i]: child i ran forward_relu for itself and child i + 1 (a ReLU) in the last forward.
  std::vector<bool> relu_fused_;
  bool train_forward_done_ = false;
};

}  // namespace dp::nn::detail
