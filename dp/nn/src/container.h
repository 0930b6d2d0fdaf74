// container.h — a layer made of chains of layers: what Sequential, Residual and the transformer's
// language model share (their declarations, names, binding, and the questions asked of their chains).
#pragma once

#include <string>
#include <vector>

#include "chain.h"
#include "dp/nn/layers.h"

namespace dp::nn::detail {

// A layer made of chains of layers: its declarations are its children's (in chain order, named
// "<child>.<name>"), its name prefixes theirs, and binding passes their offsets on to them.
class Container : public Layer {
 public:
  void bind(float* params_flat, const GradientPlace* grads, std::byte* buffers_flat) override {
    Layer::bind(params_flat, grads, buffers_flat);
    std::size_t p = 0, b = 0;
    for (Chain* chain : chains()) chain->bind(params_, p, buffers_, b, params_flat, grads, buffers_flat);
  }
  // An unnamed container stays unnamed: its children take the prefix as they are.
  void add_prefix(const std::string& prefix) override {
    if (!name().empty()) Layer::add_prefix(prefix);
    for (Chain* chain : chains()) chain->add_prefix(prefix);
  }
  void backward(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx) override {
    backward_reporting(ctx, x, y, dy, dx, {});
  }
  bool is_container() const override { return true; }
  // Every chain of a container (Sequential's one, Residual's body and shortcut) reads its input.
  std::int64_t multiply_adds(const ActShape& in) const override {
    std::int64_t sum = 0;
    for (const Chain* chain : const_cast<Container*>(this)->chains()) sum += chain->multiply_adds(in);
    return sum;
  }
  std::size_t saved_bytes() const override {
    std::size_t bytes = 0;
    for (const Chain* chain : const_cast<Container*>(this)->chains()) bytes += chain->saved_bytes();
    return bytes;
  }
  bool stochastic() const override {
    // chains() hands out the derived class's members mutably; asking them changes nothing.
    for (const Chain* chain : const_cast<Container*>(this)->chains())
      if (chain->stochastic()) return true;
    return false;
  }

 protected:
  using Layer::Layer;
  // The chains, in parameter order; they are members of the derived class.
  virtual std::vector<Chain*> chains() = 0;
  // Called by the derived constructor once its chains exist.
  void adopt_children() {
    for (Chain* chain : chains()) chain->collect(params_, buffers_);
    if (!name().empty())
      for (Chain* chain : chains()) chain->add_prefix(name());
  }
};

}  // namespace dp::nn::detail
