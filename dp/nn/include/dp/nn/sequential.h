// dp/nn/sequential.h — a Model made of a chain of layers, with the flat parameter / gradient /
// buffer layout the engines rely on. The reference MLP and ConvNet are SequentialModels.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dp/model.h"
#include "dp/nn/layers.h"
#include "dp/scratch.h"

namespace dp::nn {

class SequentialModel final : public Model {
 public:
  // Allocates the flat buffers on `device`; values are set by initialize() or by the engine.
  SequentialModel(std::string name, Device& device, std::vector<std::unique_ptr<Layer>> layers,
                  std::vector<std::int64_t> input_shape);

  // PyTorch's default initialisation (kaiming-uniform a=sqrt(5) weights, bias ~ U(+-1/sqrt(fan_in)),
  // BatchNorm weight 1 / bias 0 / running stats 0 and 1), from dp's own RNG seeded with `seed`.
  void initialize(std::uint64_t seed);

  std::string name() const override { return name_; }
  Device& device() const override { return device_; }
  float* params_flat() const override { return params_.as<float>(); }
  float* grads_flat() const override { return grads_.as<float>(); }
  std::size_t param_count() const override { return param_count_; }
  void* buffers_flat() const override { return buffers_.data(); }
  std::size_t buffers_bytes() const override { return buffers_bytes_; }
  std::vector<TensorRef> parameters() const override { return views(false); }
  std::vector<TensorRef> gradients() const override { return views(true); }
  std::vector<TensorRef> buffers() const override;
  std::vector<std::int64_t> input_shape() const override { return input_shape_; }
  int output_features() const override { return output_features_; }

  const float* forward(const Stream& stream, const float* input, int batch, Mode mode) override;
  void backward(const Stream& stream, const float* grad_output, const GradientsReady& on_ready) override;
  void zero_grad(const Stream& stream) override;
  std::unique_ptr<Model> replicate(Device& device) const override;

 private:
  std::vector<TensorRef> views(bool gradients) const;
  ActShape input_act_shape(int batch) const;  // (batch, C, H, W) from input_shape

  std::string name_;
  Device& device_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::int64_t> input_shape_;
  int output_features_ = 0;
  std::size_t param_count_ = 0;
  std::size_t buffers_bytes_ = 0;
  DeviceBuffer params_, grads_, buffers_;

  // Per forward: shapes and pointers at each layer boundary (index 0 = the input).
  std::vector<ActShape> shapes_;
  std::vector<const float*> outputs_;
  std::vector<Scratch> activations_, activation_grads_;
  bool train_forward_done_ = false;
};

}  // namespace dp::nn
