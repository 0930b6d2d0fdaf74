// chain.cpp — forward and backward through a list of layers (dp/nn/src/chain.h).
#include "chain.h"

#include <fmt/format.h>
#include <set>

#include "dp/runtime/error.h"

namespace dp::nn::detail {

Chain::Chain(Layers layers) : layers_(std::move(layers)) {
  // Names are state-dict keys and Dropout's stream of random numbers: two equal ones would merge
  // two layers' parameters in a checkpoint or draw one mask twice.
  std::set<std::string> names;
  for (const auto& layer : layers_) {
    if (!layer) throw InvalidArgument("a layer list holds a null layer");
    if (!names.insert(layer->name()).second)
      throw InvalidArgument(fmt::format("two layers of one list are named '{}'", layer->name()));
  }
}

Chain::Chain(const Chain& other) {
  for (const auto& layer : other.layers_) layers_.push_back(layer->clone());
}

std::size_t Chain::first_compute() const {
  std::size_t i = 0;
  while (i < layers_.size() && layers_[i]->is_view()) ++i;
  return i;
}

ActShape Chain::output_shape(ActShape in) const {
  for (const auto& layer : layers_) in = layer->output_shape(in);
  return in;
}

void Chain::collect(std::vector<TensorDecl>& params, std::vector<TensorDecl>& buffers) const {
  for (const auto& layer : layers_) {
    for (TensorDecl p : layer->params()) {
      p.name = layer->name() + "." + p.name;
      params.push_back(std::move(p));
    }
    for (TensorDecl b : layer->buffers()) {
      b.name = layer->name() + "." + b.name;
      buffers.push_back(std::move(b));
    }
  }
}

void Chain::bind(const std::vector<TensorDecl>& params, std::size_t& param, const std::vector<TensorDecl>& buffers,
                 std::size_t& buffer, float* params_flat, float* grads_flat, std::byte* buffers_flat) {
  for (auto& layer : layers_) {
    for (auto& p : layer->params()) p.offset = params.at(param++).offset;
    for (auto& b : layer->buffers()) b.offset = buffers.at(buffer++).offset;
    layer->bind(params_flat, grads_flat, buffers_flat);
  }
}

void Chain::add_prefix(const std::string& prefix) {
  for (auto& layer : layers_) layer->add_prefix(prefix);
}

const float* Chain::forward(const LayerContext& ctx, const float* x, float* y) {
  const std::size_t count = layers_.size();
  // The last computing child, which writes into y when the caller provides it.
  std::size_t last_compute = count;
  for (std::size_t i = count; i-- > 0;)
    if (!layers_[i]->is_view()) {
      last_compute = i;
      break;
    }
  shapes_.assign(count + 1, {});
  outputs_.assign(count + 1, nullptr);
  relu_fused_.assign(count, false);
  activations_.resize(count + 1);
  activation_grads_.resize(count + 1);
  shapes_[0] = ctx.in;
  outputs_[0] = x;
  for (std::size_t i = 0; i < count; ++i) {
    shapes_[i + 1] = layers_[i]->output_shape(shapes_[i]);
    if (layers_[i]->is_view()) {
      outputs_[i + 1] = outputs_[i];
      continue;
    }
    const LayerContext child{ctx.stream, ctx.device, shapes_[i], ctx.mode, ctx.random, ctx.sync, ctx.accumulate_grads};
    if (i + 1 < count && layers_[i]->fuses_relu() && layers_[i + 1]->is_relu()) {
      // Layer i and the ReLU after it in one pass, into the ReLU's output; the boundary between
      // them is never written (nothing reads it: see backward).
      shapes_[i + 2] = layers_[i + 1]->output_shape(shapes_[i + 1]);
      float* out = i + 1 == last_compute && y
                       ? y
                       : activations_[i + 2].get<float>(ctx.device, static_cast<std::size_t>(shapes_[i + 2].numel()));
      layers_[i]->forward_relu(child, outputs_[i], out);
      relu_fused_[i] = true;
      outputs_[i + 2] = out;
      ++i;
      continue;
    }
    float* out = i == last_compute && y
                     ? y
                     : activations_[i + 1].get<float>(ctx.device, static_cast<std::size_t>(shapes_[i + 1].numel()));
    layers_[i]->forward(child, outputs_[i], out);
    outputs_[i + 1] = out;
  }
  train_forward_done_ = ctx.mode == Mode::train;
  return outputs_[count];
}

void Chain::backward(const LayerContext& ctx, const float* dy, float* dx, const std::function<void(Layer&)>& after) {
  if (!train_forward_done_) throw InvalidArgument("backward without a train-mode forward");
  const std::size_t first = first_compute();
  if (first == layers_.size()) {  // identity: dL/dx = dL/dy
    if (dx && dx != dy) ctx.stream.copy(dx, dy, static_cast<std::size_t>(shapes_.back().numel()) * sizeof(float));
    return;
  }
  for (std::size_t i = layers_.size(); i-- > 0;) {
    Layer& layer = *layers_[i];
    if (layer.is_view()) continue;  // same memory, same gradient
    if (i > 0 && relu_fused_[i - 1]) {
      // The ReLU of a fused pair: its mask is applied by the layer before it, reading dy as it is.
      if (after) after(layer);
      continue;
    }
    if (relu_fused_[i]) {
      // dy is dL/d(ReLU's output), outputs_[i + 2] that output.
      float* child_dx =
          i == first ? dx : activation_grads_[i].get<float>(ctx.device, static_cast<std::size_t>(shapes_[i].numel()));
      layer.backward_relu(
          LayerContext{ctx.stream, ctx.device, shapes_[i], Mode::train, ctx.random, ctx.sync, ctx.accumulate_grads},
          outputs_[i], outputs_[i + 2], dy, child_dx);
      if (after) after(layer);
      dy = child_dx;
      continue;
    }
    // The first computing child writes the chain's input gradient (the caller's dx, maybe null:
    // nothing upstream needs it); the others write activation_grads_[i] = dL/d(input of child i).
    float* child_dx =
        i == first ? dx : activation_grads_[i].get<float>(ctx.device, static_cast<std::size_t>(shapes_[i].numel()));
    layer.backward_reporting(
        LayerContext{ctx.stream, ctx.device, shapes_[i], Mode::train, ctx.random, ctx.sync, ctx.accumulate_grads},
        outputs_[i], outputs_[i + 1], dy, child_dx, after);
    dy = child_dx;
  }
}

}  // namespace dp::nn::detail
