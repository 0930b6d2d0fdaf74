// forwarding_model.h — a test model that wraps another and forwards every dp::Model call to it, so
// a test model overrides only what it changes (a slow backward, a failing forward, a sync) and new
// Model methods reach the wrapped model without every test model learning them. forward_for_loss
// and backward_from_loss keep Model's defaults, which call forward and backward, so that a test
// model's forward and backward see every training step (its logits reach the loss as fp32).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/nn/model.h"

namespace dp::test {

class ForwardingModel : public Model {
 public:
  explicit ForwardingModel(std::unique_ptr<Model> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  Device& device() const override { return inner_->device(); }
  float* params_flat() const override { return inner_->params_flat(); }
  float* grads_flat() const override { return inner_->grads_flat(); }
  float* grads_address() const override { return inner_->grads_address(); }
  bool place_gradients(GradientSlots* slots) override { return inner_->place_gradients(slots); }
  std::size_t param_count() const override { return inner_->param_count(); }
  void* buffers_flat() const override { return inner_->buffers_flat(); }
  std::size_t buffers_bytes() const override { return inner_->buffers_bytes(); }
  std::vector<TensorRef> parameters() const override { return inner_->parameters(); }
  std::vector<TensorRef> gradients() const override { return inner_->gradients(); }
  std::vector<TensorRef> buffers() const override { return inner_->buffers(); }
  std::vector<std::int64_t> input_shape() const override { return inner_->input_shape(); }
  DType input_dtype() const override { return inner_->input_dtype(); }
  int output_features() const override { return inner_->output_features(); }
  int targets_per_sample() const override { return inner_->targets_per_sample(); }
  std::vector<std::pair<std::string, std::string>> aliases() const override { return inner_->aliases(); }
  const float* forward(const Stream& stream, Inputs input, int batch, Mode mode) override {
    return inner_->forward(stream, input, batch, mode);
  }
  void backward(const Stream& stream, const float* grad_output, const GradientsReady& on_ready) override {
    inner_->backward(stream, grad_output, on_ready);
  }
  void zero_grad(const Stream& stream) override { inner_->zero_grad(stream); }
  void set_random_context(const RandomContext& context) override { inner_->set_random_context(context); }
  void set_batchnorm_sync(const BatchNormSync* sync) override { inner_->set_batchnorm_sync(sync); }
  void replayed_backward() override { inner_->replayed_backward(); }
  void set_autocast(Autocast autocast) override { inner_->set_autocast(autocast); }
  Autocast autocast() const override { return inner_->autocast(); }
  std::size_t saved_activation_bytes() const override { return inner_->saved_activation_bytes(); }
  bool capturable() const override { return inner_->capturable(); }
  std::uint32_t* random_step_on_device() const override { return inner_->random_step_on_device(); }
  void upload_random_step(const Stream& stream, std::uint64_t step) override {
    inner_->upload_random_step(stream, step);
  }

 protected:
  Model& inner() const { return *inner_; }

 private:
  std::unique_ptr<Model> inner_;
};

}  // namespace dp::test
