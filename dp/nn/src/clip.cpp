// clip.cpp — GradNormClipper: per-tensor sums of squares, the coefficient, the scaling, all on the device.
#include "dp/nn/clip.h"

#include <cmath>
#include <fmt/format.h>

#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"

namespace dp {

GradNormClipper::GradNormClipper(Device& device, double max_norm)
    : device_(device),
      max_norm_(max_norm),
      norm_coef_(device.allocate(2 * sizeof(float))),
      reader_(device.create_stream()) {
  if (!(max_norm > 0.0) || !std::isfinite(max_norm))
    throw InvalidArgument(fmt::format("clip_grad_norm: max_norm must be positive and finite, not {}", max_norm));
}

void GradNormClipper::clip(const Stream& stream, const Model& model,
                           const std::vector<Optimizer::ParamRange>& trainable, float* grads) {
  if (tensors_.empty()) {
    for (const TensorRef& p : model.parameters())
      for (const Optimizer::ParamRange& range : trainable)
        if (p.offset >= range.offset && p.offset + p.numel() <= range.offset + range.count)
          tensors_.push_back({p.offset, p.numel()});
    if (tensors_.empty()) throw InvalidArgument("clip_grad_norm: every parameter is frozen");
    squares_ = device_.allocate(tensors_.size() * sizeof(float));
  }
  float* squares = squares_.as<float>();
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    kernels::sum_of_squares(stream, static_cast<kernels::index_t>(tensors_[t].count), grads + tensors_[t].offset,
                            squares + t);
  float* norm_coef = norm_coef_.as<float>();
  kernels::clip_coefficient(stream, static_cast<kernels::index_t>(tensors_.size()), squares,
                            static_cast<float>(max_norm_), norm_coef);
  for (const Optimizer::ParamRange& tensor : tensors_)
    kernels::scale_by(stream, static_cast<kernels::index_t>(tensor.count), norm_coef + 1, grads + tensor.offset);
}

float GradNormClipper::last_norm() const {
  float norm = 0.0f;
  reader_.copy(&norm, norm_coef_.as<float>(), sizeof(float));  // pageable: returns once written
  return norm;
}

}  // namespace dp
