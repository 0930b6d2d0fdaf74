// sequential.cpp — flat-buffer packing, PyTorch-default init, the layer-chain forward/backward.
#include "dp/nn/sequential.h"

#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <random>
#include <set>

#include "chain.h"
#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/shape.h"

namespace dp {

void Model::set_autocast(Autocast autocast) {
  if (autocast != Autocast::off)
    throw InvalidArgument(fmt::format("{}: this model does not support autocast {}", name(), to_string(autocast)));
}

void Model::backward_from_loss(const Stream& stream, const void* grad_output, bool bf16,
                               const GradientsReady& on_ready) {
  if (bf16) throw InvalidArgument(fmt::format("{}: gives fp32 outputs, not bf16 gradients", name()));
  backward(stream, static_cast<const float*>(grad_output), on_ready);
}

}  // namespace dp

namespace dp::nn {
namespace {

constexpr std::size_t kBufferAlignment = 8;  // int64 buffers sit beside float ones

// U[lo, hi) from the top 24 bits: the same floats on every platform and standard library.
float uniform(std::mt19937_64& rng, float lo, float hi) {
  const float u = static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);
  return lo + (hi - lo) * u;
}

}  // namespace

SequentialModel::SequentialModel(std::string name, Device& device, Layers layers, std::vector<std::int64_t> input_shape)
    : name_(std::move(name)),
      device_(device),
      chain_(std::make_unique<detail::Chain>(std::move(layers))),
      input_shape_(std::move(input_shape)) {
  if (input_shape_.empty() || input_shape_.size() > 3)
    throw InvalidArgument(
        fmt::format("{}: input shape {} is not (C), (C, H) or (C, H, W)", name_, format_shape(input_shape_)));
  std::set<std::string> names;
  for (const auto& layer : chain_->layers()) {
    for (auto& p : layer->params()) {
      if (!names.insert(qualified_name(*layer, p.name)).second)
        throw InvalidArgument(fmt::format("{}: two parameters are named '{}'", name_, qualified_name(*layer, p.name)));
      p.offset = param_count_;
      param_count_ += numel(p.shape);
    }
    for (auto& b : layer->buffers()) {
      buffers_bytes_ = (buffers_bytes_ + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
      b.offset = buffers_bytes_;
      buffers_bytes_ += numel(b.shape) * dtype_size(b.dtype);
    }
  }
  // Output rows and features from a one-sample shape walk (also validates the chain).
  const ActShape out = chain_->output_shape(input_act_shape(1));
  targets_per_sample_ = out.rows();
  output_features_ = static_cast<int>(out.row_features());
  params_ = device_.allocate(param_count_ * sizeof(float));
  grads_ = device_.allocate(param_count_ * sizeof(float));
  buffers_ = device_.allocate(buffers_bytes_);
  if (chain_->stochastic()) {
    random_step_ = std::make_unique<StagedValues>(device_, sizeof(std::uint32_t));
    random_.step_on_device = random_step_on_device();
  }
  place_.flat = grads_.as<float>();
  for (const auto& layer : chain_->layers())
    layer->bind(params_.as<float>(), &place_, static_cast<std::byte*>(buffers_.data()));
}

SequentialModel::~SequentialModel() = default;

ActShape SequentialModel::input_act_shape(int batch) const {
  return ActShape{batch, static_cast<int>(input_shape_.at(0)),
                  input_shape_.size() > 1 ? static_cast<int>(input_shape_[1]) : 1,
                  input_shape_.size() > 2 ? static_cast<int>(input_shape_[2]) : 1};
}

void SequentialModel::initialize(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> params(param_count_);
  std::vector<std::byte> buffers(buffers_bytes_);
  for (const auto& layer : chain_->layers()) {
    for (const auto& p : layer->params()) {
      const std::size_t n = numel(p.shape);
      float* out = params.data() + p.offset;
      // kaiming_uniform_(a=sqrt(5)): gain sqrt(2/(1+5)), bound gain*sqrt(3/fan_in) = 1/sqrt(fan_in);
      // the bias bound is the same 1/sqrt(fan_in).
      const float bound = p.fan_in > 0 ? 1.0f / std::sqrt(static_cast<float>(p.fan_in)) : 0.0f;
      for (std::size_t i = 0; i < n; ++i) {
        switch (p.init) {
          case Init::kaiming_uniform:
          case Init::fan_in_uniform: out[i] = uniform(rng, -bound, bound); break;
          case Init::ones: out[i] = 1.0f; break;
          case Init::zeros: out[i] = 0.0f; break;
          case Init::normal: out[i] = normal(rng); break;
        }
      }
    }
    for (const auto& b : layer->buffers()) {
      const std::size_t n = numel(b.shape);
      if (b.dtype == DType::i64) {
        std::memset(buffers.data() + b.offset, 0, n * sizeof(std::int64_t));  // num_batches_tracked
      } else {
        const float value = b.init == Init::ones ? 1.0f : 0.0f;
        for (std::size_t i = 0; i < n; ++i)
          std::memcpy(buffers.data() + b.offset + i * sizeof(float), &value, sizeof(float));
      }
    }
  }
  Stream stream = device_.create_stream();
  stream.copy(params_.data(), params.data(), params_.size());
  if (buffers_bytes_) stream.copy(buffers_.data(), buffers.data(), buffers_bytes_);
  if (place_.flat) kernels::fill(stream, place_.flat, static_cast<kernels::index_t>(param_count_), 0.0f);
  stream.synchronize();
}

std::vector<TensorRef> SequentialModel::views(bool gradients) const {
  std::vector<TensorRef> out;
  float* base = gradients ? grads_.as<float>() : params_.as<float>();
  for (const auto& layer : chain_->layers())
    for (const auto& p : layer->params())
      out.push_back(
          TensorRef{qualified_name(*layer, p.name), DType::f32, p.shape, base + p.offset, device_.index(), p.offset});
  return out;
}

std::vector<std::pair<std::string, std::string>> SequentialModel::aliases() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& layer : chain_->layers())
    for (const auto& [alias, name] : layer->aliases())
      out.emplace_back(qualified_name(*layer, alias), qualified_name(*layer, name));
  return out;
}

std::vector<TensorRef> SequentialModel::buffers() const {
  std::vector<TensorRef> out;
  auto* base = static_cast<std::byte*>(buffers_.data());
  for (const auto& layer : chain_->layers())
    for (const auto& b : layer->buffers())
      out.push_back(
          TensorRef{qualified_name(*layer, b.name), b.dtype, b.shape, base + b.offset, device_.index(), b.offset});
  return out;
}

DType SequentialModel::input_dtype() const { return chain_->input_dtype(); }

Model::Output SequentialModel::forward_for_loss(const Stream& stream, Inputs input, int batch) {
  const void* out = forward_storage(stream, input, batch, Mode::train);
  return {out, amp_ && chain_->output_bf16(false)};
}

const float* SequentialModel::forward(const Stream& stream, Inputs input, int batch, Mode mode) {
  const void* out = forward_storage(stream, input, batch, mode);
  if (!amp_ || !chain_->output_bf16(false)) return static_cast<const float*>(out);
  // The loss is fp32: the bf16 logits widened, as `logits.float()`.
  const auto n = static_cast<kernels::index_t>(batch) * targets_per_sample_ * output_features_;
  float* logits = logits_.get<float>(device_, static_cast<std::size_t>(n), &amp_->retired);
  kernels::from_bf16(stream, n, static_cast<const std::uint16_t*>(out), logits);
  return logits;
}

const void* SequentialModel::forward_storage(const Stream& stream, Inputs input, int batch, Mode mode) {
  if (batch < 1) throw InvalidArgument(fmt::format("{}: batch size must be at least 1, got {}", name_, batch));
  if (input.dtype() != input_dtype())
    throw InvalidArgument(
        fmt::format("{} reads {}, got {}", name_, input_kind(input_dtype()), input_kind(input.dtype())));
  if (stream.device() != device_.index())
    throw DeviceMismatch(fmt::format("{} lives on device {} but forward was issued on a stream of device {}", name_,
                                     device_.index(), stream.device()));
  release_outgrown(stream);  // what an eval forward outgrew (a training step frees it in its backward)
  // Nothing while capturing: the engine replaying the step uploads it.
  if (mode == Mode::train) upload_random_step(stream, random_.step);
  return chain_->forward(
      LayerContext{stream, device_, input_act_shape(batch), mode, &random_, sync_, true, amp_.get(), false},
      input.data(), nullptr);
}

void SequentialModel::backward(const Stream& stream, const float* grad_output, const GradientsReady& on_ready) {
  backward_from_loss(stream, grad_output, false, on_ready);
}

void SequentialModel::backward_from_loss(const Stream& stream, const void* grad_output, bool bf16,
                                         const GradientsReady& on_ready) {
  const bool out16 = amp_ && chain_->output_bf16(false);
  if (bf16 && !out16) throw InvalidArgument(fmt::format("{}: a bf16 gradient of an output that is not bf16", name_));
  // After zero_grad every layer writes its parameter gradients (each one, so nothing the buffer
  // held survives); otherwise they add to what it holds. Slots hold nothing to add to.
  const bool accumulate = !zero_grad_pending_ && !place_.slots;
  try {
    const void* dy = grad_output;
    if (out16 && !bf16) {
      // The backward of `logits.float()`: the fp32 gradient rounded to bf16.
      const auto n = static_cast<kernels::index_t>(chain_->batch()) * targets_per_sample_ * output_features_;
      auto* bits = grad_output_.get<std::uint16_t>(device_, static_cast<std::size_t>(n), &amp_->retired);
      kernels::to_bf16(stream, n, static_cast<const float*>(grad_output), bits);
      dy = bits;
    }
    // The model's input needs no gradient (dx null): nothing upstream uses it.
    chain_->backward(LayerContext{stream, device_, {}, Mode::train, &random_, sync_, accumulate, amp_.get(), false}, dy,
                     nullptr, [&](Layer& layer) {
                       if (!on_ready || layer.params().empty()) return;
                       const auto& params = layer.params();
                       const std::size_t begin = params.front().offset;
                       const auto& last = params.back();
                       on_ready(begin, last.offset + numel(last.shape) - begin);
                     });
  } catch (const InvalidArgument& e) {
    // Still pending: a later backward writes, a reader gets the fill.
    throw InvalidArgument(fmt::format("{}: {}", name_, e.what()));
  }
  zero_grad_pending_ = false;
  zero_grad_stream_ = Stream{};
  release_outgrown(stream);
}

// Autocast's scratch outgrown during a step (its first one: later ones reuse the sizes reached),
// freed once the stream's work is done with it; a capture frees nothing, and outgrows nothing.
void SequentialModel::release_outgrown(const Stream& stream) {
  if (!amp_ || amp_->retired.empty() || stream.capturing()) return;
  stream.synchronize();
  amp_->retired.clear();
}

void SequentialModel::set_autocast(Autocast autocast) {
  if (autocast == Autocast::off)
    amp_.reset();
  else if (!amp_)
    amp_ = std::make_unique<AutocastScratch>();
}

std::size_t SequentialModel::saved_activation_bytes() const { return chain_->saved_bytes(); }

void SequentialModel::replayed_backward() {
  zero_grad_pending_ = false;
  zero_grad_stream_ = Stream{};
}

// No fill: the next backward writes the gradients (torch's zero_grad(set_to_none=True)), one launch
// fewer per step. Only a reader that comes first (materialize_zero_grad) needs the zeros in memory.
void SequentialModel::zero_grad(const Stream& stream) {
  if (stream.device() != device_.index())
    throw DeviceMismatch(fmt::format("{} lives on device {} but zero_grad was issued on a stream of device {}", name_,
                                     device_.index(), stream.device()));
  zero_grad_pending_ = true;
  zero_grad_stream_ = stream;
}

bool SequentialModel::materialize_zero_grad() const {
  if (!zero_grad_pending_ || !place_.flat) return false;
  // On zero_grad's stream, where an eager zero_grad would have enqueued the fill: before whatever
  // the caller enqueues there with the address it is given. See Note [pending zero_grad].
  kernels::fill(zero_grad_stream_, grads_.as<float>(), static_cast<kernels::index_t>(param_count_), 0.0f);
  zero_grad_pending_ = false;
  zero_grad_stream_ = Stream{};
  return true;
}

void SequentialModel::check_whole_gradients(const char* what) const {
  if (place_.slots)
    throw Error(
        fmt::format("{}: {} asked for, but the gradients are in an engine's bucket slots (ZeRO-2): there is no "
                    "whole gradient buffer",
                    name_, what));
}

float* SequentialModel::grads_flat() const {
  check_whole_gradients("grads_flat()");
  materialize_zero_grad();
  return grads_.as<float>();
}

// Freed while no stream of the device still works on them: the caller is between steps, and the
// device is synchronised first (a zero fill may still be queued).
bool SequentialModel::place_gradients(GradientSlots* slots) {
  if (slots == place_.slots) return true;
  device_.synchronize();
  zero_grad_pending_ = false;
  zero_grad_stream_ = Stream{};
  if (slots) {
    grads_ = DeviceBuffer{};
    place_ = {nullptr, slots};
    return true;
  }
  grads_ = device_.allocate(param_count_ * sizeof(float));
  place_ = {grads_.as<float>(), nullptr};
  Stream stream = device_.create_stream();
  kernels::fill(stream, place_.flat, static_cast<kernels::index_t>(param_count_), 0.0f);
  stream.synchronize();
  return true;
}

std::vector<TensorRef> SequentialModel::gradients() const {
  check_whole_gradients("gradients()");
  const Stream stream = zero_grad_stream_;
  // Views are read on any stream or on the host after the engine's synchronize(), which may
  // already have happened: the zeros must be in memory when they return (unless a capture on
  // that stream is recording them, where waiting is not allowed and the replay orders them).
  if (materialize_zero_grad() && !stream.capturing()) stream.synchronize();
  return views(true);
}

std::unique_ptr<Model> SequentialModel::replicate(Device& device) const {
  Layers layers;
  for (const auto& layer : chain_->layers()) layers.push_back(layer->clone());
  auto copy = std::make_unique<SequentialModel>(name_, device, std::move(layers), input_shape_);
  copy->set_autocast(autocast());
  return copy;
}

void SequentialModel::set_random_context(const RandomContext& random) {
  random_ = random;
  random_.step_on_device = random_step_on_device();  // the engine's step reaches the kernels through it
}

std::uint32_t* SequentialModel::random_step_on_device() const {
  return random_step_ ? static_cast<std::uint32_t*>(random_step_->device()) : nullptr;
}

void SequentialModel::upload_random_step(const Stream& stream, std::uint64_t step) {
  if (!random_step_) return;
  // DropoutKey's step is 32 bits: the masks repeat after 2^32 steps, as they did with the step baked in.
  const auto value = static_cast<std::uint32_t>(step);
  random_step_->upload(stream, &value, sizeof value);
}

}  // namespace dp::nn
