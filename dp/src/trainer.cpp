// trainer.cpp — SingleDeviceTrainer: the whole step enqueued on one stream, one sync for the loss.
#include "dp/trainer.h"

#include <fmt/format.h>

#include "dp/error.h"

namespace dp {

SingleDeviceTrainer::SingleDeviceTrainer(Model& model, const SgdOptions& options)
    : model_(model),
      optimizer_(model.device(), model.param_count(), options),
      loss_(model.device()),
      stream_(model.device().create_stream()) {}

void SingleDeviceTrainer::stage_inputs(const float* inputs, const std::int64_t* targets, int batch) {
  if (batch < 1) throw InvalidArgument(fmt::format("batch size must be at least 1, got {}", batch));
  std::size_t per_sample = 1;
  for (auto d : model_.input_shape()) per_sample *= static_cast<std::size_t>(d);
  const std::size_t input_bytes = per_sample * static_cast<std::size_t>(batch) * sizeof(float);
  Device& device = model_.device();
  if (inputs_.size() < input_bytes) inputs_ = device.allocate(input_bytes);
  stream_.copy(inputs_.data(), inputs, input_bytes);
  if (targets) {
    const std::size_t target_bytes = static_cast<std::size_t>(batch) * sizeof(std::int64_t);
    if (targets_.size() < target_bytes) targets_ = device.allocate(target_bytes);
    stream_.copy(targets_.data(), targets, target_bytes);
  }
}

float SingleDeviceTrainer::step(const float* inputs, const std::int64_t* targets, int batch) {
  stage_inputs(inputs, targets, batch);
  const int classes = model_.output_features();
  const std::size_t grad_bytes = static_cast<std::size_t>(batch) * classes * sizeof(float);
  if (grad_output_.size() < grad_bytes) grad_output_ = model_.device().allocate(grad_bytes);
  const float* logits = model_.forward(stream_, inputs_.as<float>(), batch, Mode::train);
  const float* loss = loss_.forward(stream_, logits, targets_.as<std::int64_t>(), batch, classes);
  loss_.backward(stream_, logits, targets_.as<std::int64_t>(), batch, classes, grad_output_.as<float>(), batch);
  model_.zero_grad(stream_);
  model_.backward(stream_, grad_output_.as<float>());
  optimizer_.step(stream_, model_.params_flat(), model_.grads_flat());
  float host_loss = 0.0f;
  stream_.copy(&host_loss, loss, sizeof(float));  // pageable destination: waits for the step
  return host_loss;
}

std::vector<float> SingleDeviceTrainer::predict(const float* inputs, int batch) {
  stage_inputs(inputs, nullptr, batch);
  const float* logits = model_.forward(stream_, inputs_.as<float>(), batch, Mode::eval);
  std::vector<float> out(static_cast<std::size_t>(batch) * model_.output_features());
  stream_.copy(out.data(), logits, out.size() * sizeof(float));
  return out;
}

}  // namespace dp
