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
    std::vector<Optimizer::ParamRange> tensors;
    for (const TensorRef& p : model.parameters()) tensors.push_back({p.offset, p.numel()});
    set_tensors(tensors, trainable);
  }
  sum_squares(stream, 0, model.param_count(), grads);
  coefficient(stream);
  float* coefficient = norm_coef_.as<float>() + 1;
  for (const Optimizer::ParamRange& tensor : tensors_)
    kernels::scale_by(stream, static_cast<kernels::index_t>(tensor.count), coefficient, grads + tensor.offset);
}

void GradNormClipper::set_tensors(const std::vector<Optimizer::ParamRange>& tensors,
                                  const std::vector<Optimizer::ParamRange>& trainable) {
  tensors_.clear();
  for (const Optimizer::ParamRange& tensor : tensors)
    for (const Optimizer::ParamRange& range : trainable)
      if (tensor.offset >= range.offset && tensor.offset + tensor.count <= range.offset + range.count)
        tensors_.push_back(tensor);
  if (tensors_.empty()) throw InvalidArgument("clip_grad_norm: every parameter is frozen");
  squares_ = device_.allocate(tensors_.size() * sizeof(float));
}

void GradNormClipper::sum_squares(const Stream& stream, std::size_t offset, std::size_t count, const float* grads) {
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    if (tensors_[t].offset >= offset && tensors_[t].offset + tensors_[t].count <= offset + count)
      kernels::sum_of_squares(stream, static_cast<kernels::index_t>(tensors_[t].count),
                              grads + (tensors_[t].offset - offset), squares_.as<float>() + t);
}

void GradNormClipper::coefficient(const Stream& stream) {
  kernels::clip_coefficient(stream, static_cast<kernels::index_t>(tensors_.size()), squares_.as<float>(),
                            static_cast<float>(max_norm_), norm_coef_.as<float>());
}

void GradNormClipper::scale(const Stream& stream, float* grads, std::size_t count) {
  kernels::scale_by(stream, static_cast<kernels::index_t>(count), norm_coef_.as<float>() + 1, grads);
}

float GradNormClipper::last_norm() const {
  float norm = 0.0f;
  reader_.copy(&norm, norm_coef_.as<float>(), sizeof(float));  // pageable: returns once written
  return norm;
}

}  // namespace dp
