// device_update.cpp — clipping, then the optimizer's update.
#include "device_update.h"

namespace dp::engines {

DeviceUpdate::DeviceUpdate(Device& device, std::size_t params, const OptimizerOptions& optimizer, double clip_grad_norm)
    : optimizer_(make_optimizer(device, params, optimizer)) {
  if (clip_grad_norm > 0.0) clipper_ = std::make_unique<GradNormClipper>(device, clip_grad_norm);
}

void DeviceUpdate::run(const Stream& stream, Model& model) {
  clip(stream, model, optimizer_->trainable());
  optimizer_->step(stream, model.params_flat(), model.grads_flat());
}

void DeviceUpdate::clip(const Stream& stream, Model& model, const std::vector<Optimizer::ParamRange>& trainable) {
  if (clipper_) clipper_->clip(stream, model, trainable, model.grads_flat());
}

std::optional<float> DeviceUpdate::last_grad_norm() const {
  if (!clipper_) return std::nullopt;
  return clipper_->last_norm();
}

}  // namespace dp::engines
