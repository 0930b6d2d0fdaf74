// optim.cpp — Sgd and AdamW: option checks, their state buffers, and the one-launch updates.
#include "dp/nn/optim.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <fmt/format.h>

#include "dp/kernels/ops.h"
#include "dp/kernels/optimizer.h"
#include "dp/runtime/error.h"

namespace dp {
namespace {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;  // clang 14 (the fuzz build) has no aggregate deduction yet

kernels::AdamWConstants constants_of(const AdamWOptions& o) { return {o.beta1, o.beta2, o.eps}; }
// The step's values with the weight decay, then without (the excluded parameters').
std::array<kernels::AdamWScalars, 2> adamw_values(const AdamWOptions& o, std::int64_t step) {
  return {kernels::adamw_scalars(constants_of(o), o.lr, o.weight_decay, step),
          kernels::adamw_scalars(constants_of(o), o.lr, 0.0, step)};
}
}  // namespace

Optimizer::Optimizer(Device& device, std::size_t param_count)
    : device_(device),
      param_count_(param_count),
      trainable_{{0, param_count}},
      segments_{{{0, param_count}, true}},
      scalars_(device, kMaxScalarBytes) {}

std::vector<Optimizer::ParamRange> trainable_ranges(std::size_t param_count,
                                                    std::vector<Optimizer::ParamRange> frozen) {
  using ParamRange = Optimizer::ParamRange;
  std::sort(frozen.begin(), frozen.end(), [](const ParamRange& a, const ParamRange& b) { return a.offset < b.offset; });
  std::vector<ParamRange> trainable;
  std::size_t at = 0;
  for (const ParamRange& r : frozen) {
    if (r.offset > param_count || r.count > param_count - r.offset)
      throw InvalidArgument(fmt::format("frozen parameters [{}, {}) lie past the {} parameters", r.offset,
                                        r.offset + r.count, param_count));
    if (r.offset > at) trainable.push_back({at, r.offset - at});
    at = std::max(at, r.offset + r.count);
  }
  if (at < param_count) trainable.push_back({at, param_count - at});
  return trainable;
}

void Optimizer::freeze(std::vector<ParamRange> frozen) {
  trainable_ = trainable_ranges(param_count_, std::move(frozen));
  cut_segments();
}

void Optimizer::exclude_from_weight_decay(std::vector<ParamRange> ranges) {
  (void)trainable_ranges(param_count_, ranges);  // the same bounds check as freeze's
  std::sort(ranges.begin(), ranges.end(), [](const ParamRange& a, const ParamRange& b) { return a.offset < b.offset; });
  no_decay_ = std::move(ranges);
  cut_segments();
}

void Optimizer::cut_segments() {
  // Decay applies where no excluded range does: the trainable stretches cut at their edges.
  const std::vector<ParamRange> decayed = trainable_ranges(param_count_, no_decay_);
  segments_.clear();
  for (const ParamRange& t : trainable_) {
    std::size_t at = t.offset;
    const std::size_t end = t.offset + t.count;
    while (at < end) {
      bool decay = false;
      std::size_t next = end;
      for (const ParamRange& d : decayed) {
        if (d.offset + d.count <= at) continue;
        if (d.offset <= at) {
          decay = true;
          next = std::min(end, d.offset + d.count);
        } else {
          next = std::min(end, d.offset);
        }
        break;
      }
      segments_.push_back({{at, next - at}, decay});
      at = next;
    }
  }
}

DeviceBuffer Optimizer::zeroed_buffer() const {
  DeviceBuffer buffer = device_.allocate(param_count_ * sizeof(float));
  const Stream stream = device_.create_stream();
  kernels::fill(stream, buffer.as<float>(), static_cast<kernels::index_t>(param_count_), 0.0f);
  stream.synchronize();
  return buffer;
}

void validate(const SgdOptions& o) {
  // torch.optim.SGD's constructor checks, with the same meaning; `!(x >= 0)` also rejects NaN, and
  // the learning rate must be finite.
  if (!(o.lr >= 0.0f) || !std::isfinite(o.lr))
    throw InvalidArgument(fmt::format("SGD: invalid learning rate {}", o.lr));
  if (!(o.momentum >= 0.0f)) throw InvalidArgument(fmt::format("SGD: invalid momentum {}", o.momentum));
  if (!(o.weight_decay >= 0.0f)) throw InvalidArgument(fmt::format("SGD: invalid weight_decay {}", o.weight_decay));
  if (o.nesterov && o.momentum == 0.0f)
    throw InvalidArgument("SGD: nesterov momentum requires a momentum > 0 (and zero dampening)");
}

void validate(const AdamWOptions& o) {
  // torch.optim.AdamW's constructor checks, NaN and infinity refused too.
  const auto finite_at_least_0 = [](double v) { return std::isfinite(v) && v >= 0.0; };
  if (!finite_at_least_0(o.lr)) throw InvalidArgument(fmt::format("AdamW: invalid learning rate {}", o.lr));
  if (!finite_at_least_0(o.eps)) throw InvalidArgument(fmt::format("AdamW: invalid epsilon value {}", o.eps));
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0))
    throw InvalidArgument(fmt::format("AdamW: invalid beta parameter at index 0: {}", o.beta1));
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0))
    throw InvalidArgument(fmt::format("AdamW: invalid beta parameter at index 1: {}", o.beta2));
  if (!finite_at_least_0(o.weight_decay))
    throw InvalidArgument(fmt::format("AdamW: invalid weight_decay value {}", o.weight_decay));
}

Sgd::Sgd(Device& device, std::size_t param_count, const SgdOptions& options)
    : Optimizer(device, param_count), options_(options) {
  validate(options);
  if (options.momentum > 0.0f) momentum_ = zeroed_buffer();
}

void Sgd::set_lr(double lr) {
  SgdOptions options = options_;
  options.lr = static_cast<float>(lr);  // torch hands its Python float to the fp32 kernel the same way
  validate(options);
  options_ = options;
}

std::vector<Optimizer::StateBuffer> Sgd::state() const {
  if (!momentum_flat()) return {};
  return {{"momentum", momentum_flat()}};
}

void Sgd::step(const Stream& stream, float* params, const float* grads) {
  const kernels::SgdScalars values = kernels::sgd_scalars(options_.lr, steps_ == 0);
  const auto* scalars = static_cast<const kernels::SgdScalars*>(upload_scalars(stream, &values, sizeof values));
  float* momentum = momentum_.as<float>();
  for (const auto& [r, decay] : segments()) {
    const kernels::SgdConstants constants{options_.momentum, decay ? options_.weight_decay : 0.0f, options_.nesterov};
    kernels::sgd_step_capturable(stream, static_cast<kernels::index_t>(r.count), constants, scalars, params + r.offset,
                                 grads + r.offset, momentum ? momentum + r.offset : nullptr);
  }
  ++steps_;
}

void Sgd::replayed_step(const Stream& stream) {
  const kernels::SgdScalars values = kernels::sgd_scalars(options_.lr, steps_ == 0);
  (void)upload_scalars(stream, &values, sizeof values);
  ++steps_;
}

AdamW::AdamW(Device& device, std::size_t param_count, const AdamWOptions& options)
    : Optimizer(device, param_count), options_(options) {
  validate(options);
  exp_avg_ = zeroed_buffer();
  exp_avg_sq_ = zeroed_buffer();
}

void AdamW::set_lr(double lr) {
  AdamWOptions options = options_;
  options.lr = lr;
  validate(options);
  options_ = options;
}

std::vector<Optimizer::StateBuffer> AdamW::state() const {
  return {{"exp_avg", exp_avg_.as<float>()}, {"exp_avg_sq", exp_avg_sq_.as<float>()}};
}

void AdamW::step(const Stream& stream, float* params, const float* grads) {
  // torch increments state['step'] before the update: the first step's bias correction uses 1.
  const auto values = adamw_values(options_, steps_ + 1);
  const auto* scalars = static_cast<const kernels::AdamWScalars*>(upload_scalars(stream, values.data(), sizeof values));
  for (const auto& [r, decay] : segments())
    kernels::adamw_step_capturable(stream, static_cast<kernels::index_t>(r.count), constants_of(options_),
                                   decay ? scalars : scalars + 1, params + r.offset, grads + r.offset,
                                   exp_avg_.as<float>() + r.offset, exp_avg_sq_.as<float>() + r.offset);
  ++steps_;
}

void AdamW::replayed_step(const Stream& stream) {
  const auto values = adamw_values(options_, steps_ + 1);
  (void)upload_scalars(stream, values.data(), sizeof values);
  ++steps_;
}

std::unique_ptr<Optimizer> make_optimizer(Device& device, std::size_t param_count, const OptimizerOptions& options) {
  return std::visit(Overloaded{[&](const SgdOptions& o) -> std::unique_ptr<Optimizer> {
                                 return std::make_unique<Sgd>(device, param_count, o);
                               },
                               [&](const AdamWOptions& o) -> std::unique_ptr<Optimizer> {
                                 return std::make_unique<AdamW>(device, param_count, o);
                               }},
                    options);
}

std::string_view optimizer_kind(const OptimizerOptions& options) {
  return std::visit(Overloaded{[](const SgdOptions&) { return std::string_view("sgd"); },
                               [](const AdamWOptions&) { return std::string_view("adamw"); }},
                    options);
}

double base_lr(const OptimizerOptions& options) {
  return std::visit([](const auto& o) { return static_cast<double>(o.lr); }, options);
}

}  // namespace dp
