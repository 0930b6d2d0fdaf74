// dp/nn/sequential.h — a Model made of a chain of layers (containers included: Sequential,
// Residual), with the flat parameter / gradient / buffer layout the engines rely on. The reference
// MLP, ConvNet and ResNet-8 are SequentialModels, and so is a user's own network:
//   dp::nn::Layers layers;
//   layers.push_back(dp::nn::make_conv2d("conv", 1, 8, 3, 1, 1));
//   ...
//   dp::nn::SequentialModel model("mine", device, std::move(layers), {1, 28, 28});
//   model.initialize(seed);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dp/nn/layers.h"
#include "dp/nn/model.h"
#include "dp/runtime/staged_values.h"

namespace dp::nn {

namespace detail {
class Chain;
}

class SequentialModel final : public Model {
 public:
  // Allocates the flat buffers on `device`; values are set by initialize() or by the engine.
  // input_shape: per sample, (C), (C, H) or (C, H, W). Throws InvalidArgument when the layers do
  // not fit it (a channel count, a window larger than its input) or two parameters share a name.
  SequentialModel(std::string name, Device& device, Layers layers, std::vector<std::int64_t> input_shape);
  ~SequentialModel() override;

  // PyTorch's default initialisation (kaiming-uniform a=sqrt(5) weights, bias ~ U(+-1/sqrt(fan_in)),
  // BatchNorm weight 1 / bias 0 / running stats 0 and 1), from dp's own RNG seeded with `seed`.
  void initialize(std::uint64_t seed);

  std::string name() const override { return name_; }
  Device& device() const override { return device_; }
  float* params_flat() const override { return params_.as<float>(); }
  // Both materialise a pending zero_grad (see Model::zero_grad); gradients() also waits for it.
  float* grads_flat() const override;
  float* grads_address() const override { return place_.flat; }  // every backward writes every gradient
  bool place_gradients(GradientSlots* slots) override;
  std::size_t param_count() const override { return param_count_; }
  void* buffers_flat() const override { return buffers_.data(); }
  std::size_t buffers_bytes() const override { return buffers_bytes_; }
  std::vector<TensorRef> parameters() const override { return views(false); }
  std::vector<TensorRef> gradients() const override;
  std::vector<TensorRef> buffers() const override;
  std::vector<std::pair<std::string, std::string>> aliases() const override;
  std::vector<std::int64_t> input_shape() const override { return input_shape_; }
  // The last layer's output per sample as ActShape::rows() rows of row_features() logits.
  int output_features() const override { return output_features_; }
  int targets_per_sample() const override { return targets_per_sample_; }

  DType input_dtype() const override;
  const float* forward(const Stream& stream, Inputs input, int batch, Mode mode) override;
  void backward(const Stream& stream, const float* grad_output, const GradientsReady& on_ready) override;
  Output forward_for_loss(const Stream& stream, Inputs input, int batch) override;
  void backward_from_loss(const Stream& stream, const void* grad_output, bool bf16,
                          const GradientsReady& on_ready = {}) override;
  void zero_grad(const Stream& stream) override;
  void set_random_context(const RandomContext& random) override;
  void set_batchnorm_sync(const BatchNormSync* sync) override { sync_ = sync; }
  void replayed_backward() override;
  void set_autocast(Autocast autocast) override;
  Autocast autocast() const override { return amp_ ? Autocast::bf16 : Autocast::off; }
  std::size_t saved_activation_bytes() const override;
  // Its layers enqueue fixed work per batch size into grow-only scratch; Dropout reads the step from
  // device memory (random_step_on_device).
  bool capturable() const override { return true; }
  std::uint32_t* random_step_on_device() const override;
  void upload_random_step(const Stream& stream, std::uint64_t step) override;
  std::unique_ptr<Model> replicate(Device& device) const override;

 private:
  // forward()'s chain run: the last layer's output in its storage (bf16 under autocast after a Linear).
  const void* forward_storage(const Stream& stream, Inputs input, int batch, Mode mode);
  std::vector<TensorRef> views(bool gradients) const;
  ActShape input_act_shape(int batch) const;  // (batch, C, H, W) from input_shape
  // Enqueues the fill a pending zero_grad skipped, on its stream; false when none was pending.
  bool materialize_zero_grad() const;
  void check_whole_gradients(const char* what) const;
  void release_outgrown(const Stream& stream);

  std::string name_;
  Device& device_;
  std::unique_ptr<detail::Chain> chain_;
  std::vector<std::int64_t> input_shape_;
  int output_features_ = 0;
  int targets_per_sample_ = 1;
  std::size_t param_count_ = 0;
  std::size_t buffers_bytes_ = 0;
  DeviceBuffer params_, grads_, buffers_;
  GradientPlace place_;  // what the layers are bound to: grads_, or the slots that replaced it
  RandomContext random_;
  std::unique_ptr<StagedValues> random_step_;  // models with Dropout: the step their kernels read
  const BatchNormSync* sync_ = nullptr;
  std::unique_ptr<AutocastScratch> amp_;  // under autocast (Autocast::bf16) only
  Scratch logits_, grad_output_;          // autocast: the fp32 output, the bf16 gradient of it
  // zero_grad was called and no backward has written the gradients since: the buffer reads as
  // zeros without holding them. Mutable: taking the gradients' address (a const accessor) is what
  // turns the pending zeros into a fill, on the stream zero_grad was given.
  mutable bool zero_grad_pending_ = false;
  mutable Stream zero_grad_stream_;
};

}  // namespace dp::nn
