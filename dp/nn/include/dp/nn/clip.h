// dp/nn/clip.h — torch.nn.utils.clip_grad_norm_(parameters, max_norm) on the device, as the engines
// run it between the gradients' reduction and the optimizer step (EngineOptions::step.clip_grad_norm).
#pragma once

#include <cstddef>
#include <vector>

#include "dp/nn/model.h"
#include "dp/nn/optim.h"
#include "dp/runtime/device.h"
#include "dp/runtime/memory.h"

namespace dp {

// clip_grad_norm_(params, max_norm, error_if_nonfinite=False, foreach=True): each trainable
// tensor's L2 norm (a sum of squares in a fixed order: the same bits on cuda and sim), the total
// norm (the norm of those norms), and every trainable gradient multiplied in place by
// clamp(max_norm / (total + 1e-6), max=1). Enqueued without a host sync: a captured step replays it.
// A non-finite norm multiplies the gradients by NaN, as torch's does; the step's update is then
// NaN, which the run's non-finite checks report.
class GradNormClipper {
 public:
  // max_norm: positive and finite (InvalidArgument otherwise).
  GradNormClipper(Device& device, double max_norm);
  // Enqueues the clipping of `grads` (`model`'s flat gradients on `stream`'s device) over the
  // parameters inside `trainable` (an optimizer's trainable(); the frozen ones are left out, as
  // torch leaves out parameters without a gradient).
  void clip(const Stream& stream, const Model& model, const std::vector<Optimizer::ParamRange>& trainable,
            float* grads);
  // The same in pieces, for gradients never whole in one buffer (ZeRO-2's bucket slots), over the
  // `tensors` (ranges of the flat layout, in parameter order) inside `trainable`, given once:
  // sum_squares() for each tensor inside [offset, offset + count) of the flat layout, whose gradients
  // are at `grads` (every tensor once a step, on streams the coefficient() stream waits for), then
  // coefficient(), then scale() of any gradients of those tensors, which clip() would have scaled.
  // The same bits as clip(): each tensor's sum and the scaling are elementwise alike.
  void set_tensors(const std::vector<Optimizer::ParamRange>& tensors,
                   const std::vector<Optimizer::ParamRange>& trainable);
  void sum_squares(const Stream& stream, std::size_t offset, std::size_t count, const float* grads);
  void coefficient(const Stream& stream);
  void scale(const Stream& stream, float* grads, std::size_t count);
  // The total norm, before clipping, of the last clip(): call once the stream it ran on has.
  float last_norm() const;
  double max_norm() const { return max_norm_; }

 private:
  Device& device_;
  double max_norm_;
  std::vector<Optimizer::ParamRange> tensors_;  // the trainable tensors, found at the first clip()
  DeviceBuffer squares_, norm_coef_;
  Stream reader_;
};

}  // namespace dp
