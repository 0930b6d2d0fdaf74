// dp/nn/layers.h — the layers models are made of, with PyTorch's semantics (Linear, Conv2d,
// BatchNorm2d, ReLU, MaxPool2d, Flatten). A layer declares its parameters and buffers; the model
// packs them into its flat buffers and binds pointers back; forward/backward enqueue kernels on
// the stream they are given.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dp/device.h"
#include "dp/model.h"
#include "dp/tensor.h"

namespace dp::nn {

// Activation shape (N, C, H, W); a (N, F) matrix is (N, F, 1, 1).
struct ActShape {
  int n = 0, c = 0, h = 1, w = 1;
  std::int64_t per_sample() const { return static_cast<std::int64_t>(c) * h * w; }
  std::int64_t numel() const { return per_sample() * n; }
};

// How a parameter or buffer starts (PyTorch's defaults).
enum class Init { kaiming_uniform, fan_in_uniform, ones, zeros };

struct TensorDecl {
  std::string name;  // relative to the layer, e.g. "weight"
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  Init init = Init::zeros;
  std::int64_t fan_in = 0;  // for the uniform inits: bound = 1/sqrt(fan_in)
  std::size_t offset = 0;   // filled by the model: elements (params) or bytes (buffers) into the flat buffer
};

struct LayerContext {
  const Stream& stream;
  Device& device;
  ActShape in;
  Mode mode;
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  const std::string& name() const { return name_; }

  std::vector<TensorDecl>& params() { return params_; }
  std::vector<TensorDecl>& buffers() { return buffers_; }
  // Called once the model has allocated its flat buffers.
  void bind(float* params_flat, float* grads_flat, std::byte* buffers_flat) {
    params_flat_ = params_flat;
    grads_flat_ = grads_flat;
    buffers_flat_ = buffers_flat;
  }

  virtual ActShape output_shape(const ActShape& in) const = 0;
  // Output aliases the input (Flatten): no buffer, no kernel.
  virtual bool is_view() const { return false; }
  // y = layer(x). In train mode keeps what backward needs (it may also read x and y there).
  virtual void forward(const LayerContext& ctx, const float* x, float* y) = 0;
  // dx = dL/dx (skipped when null), parameter gradients accumulated.
  virtual void backward(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx) = 0;
  virtual std::unique_ptr<Layer> clone() const = 0;

 protected:
  float* param(std::size_t i) const { return params_flat_ + params_[i].offset; }
  float* grad(std::size_t i) const { return grads_flat_ + params_[i].offset; }
  template <class T>
  T* buffer(std::size_t i) const {
    return reinterpret_cast<T*>(buffers_flat_ + buffers_[i].offset);
  }

  std::vector<TensorDecl> params_;
  std::vector<TensorDecl> buffers_;

 private:
  std::string name_;
  float* params_flat_ = nullptr;
  float* grads_flat_ = nullptr;
  std::byte* buffers_flat_ = nullptr;
};

std::unique_ptr<Layer> make_linear(std::string name, int in_features, int out_features);
std::unique_ptr<Layer> make_conv2d(std::string name, int in_channels, int out_channels, int kernel, int stride,
                                   int pad);
std::unique_ptr<Layer> make_batchnorm2d(std::string name, int channels);
std::unique_ptr<Layer> make_relu(std::string name);
std::unique_ptr<Layer> make_maxpool2d(std::string name, int kernel, int stride);
std::unique_ptr<Layer> make_flatten(std::string name);

}  // namespace dp::nn
