// device_update.h — the optimizer side of one device's training step, written once for every engine:
// the gradients clipped by their global norm (StepOptions::clip_grad_norm: torch's clip_grad_norm_
// between backward and step), then the optimizer's update of the model's flat parameters.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "dp/nn/clip.h"
#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device.h"

namespace dp::engines {

class DeviceUpdate {
 public:
  // An optimizer over `params` floats; clip_grad_norm 0: no clipping.
  DeviceUpdate(Device& device, std::size_t params, const OptimizerOptions& optimizer, double clip_grad_norm);

  // Enqueues the clipping (over the optimizer's trainable parameters) and the update on `stream`.
  void run(const Stream& stream, Model& model);
  // Only the clipping, over `trainable` (of the model's whole flat buffer): for an optimizer that
  // updates a part of it.
  void clip(const Stream& stream, Model& model, const std::vector<Optimizer::ParamRange>& trainable);

  Optimizer& optimizer() const { return *optimizer_; }
  bool clips() const { return clipper_ != nullptr; }
  GradNormClipper* clipper() const { return clipper_.get(); }  // null unclipped
  // The total norm before clipping of the last run, once its stream has run it; none unclipped.
  std::optional<float> last_grad_norm() const;

 private:
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradNormClipper> clipper_;
};

}  // namespace dp::engines
