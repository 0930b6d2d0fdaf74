// chain.cpp — forward and backward through a list of layers (dp/nn/src/chain.h).
#include "chain.h"

#include <fmt/format.h>
#include <set>

#include "dp/kernels/ops.h"
#include "dp/runtime/error.h"
#include "dp/runtime/progress.h"

namespace dp::nn::detail {

Chain::Chain(Layers layers) : layers_(std::move(layers)) {
  // Names are state-dict keys and Dropout's stream of random numbers: two equal ones would merge
  // two layers' parameters in a checkpoint or draw one mask twice.
  std::set<std::string> names;
  for (const auto& layer : layers_) {
    if (!layer) throw InvalidArgument("a layer list holds a null layer");
    if (!layer->name().empty() && !names.insert(layer->name()).second)  // an unnamed residual adds no name
      throw InvalidArgument(fmt::format("two layers of one list are named '{}'", layer->name()));
    // No layer writes ids: only the input can be ids.
    if (layer != layers_.front() && layer->input_dtype() != DType::f32)
      throw InvalidArgument(fmt::format("{} reads token ids: it can only be a list's first layer", layer->name()));
  }
}

Chain::Chain(const Chain& other) : reader_rounds_(other.reader_rounds_) {
  for (const auto& layer : other.layers_) layers_.push_back(layer->clone());
}

std::size_t Chain::first_compute() const {
  std::size_t i = 0;
  while (i < layers_.size() && layers_[i]->is_view()) ++i;
  return i;
}

ActShape Chain::output_shape(ActShape in) const {
  for (const auto& layer : layers_) in = layer->output_shape(in);
  return in;
}

std::int64_t Chain::multiply_adds(ActShape in) const {
  std::int64_t sum = 0;
  for (const auto& layer : layers_) {
    sum += layer->multiply_adds(in);
    in = layer->output_shape(in);
  }
  return sum;
}

void Chain::collect(std::vector<TensorDecl>& params, std::vector<TensorDecl>& buffers) const {
  for (const auto& layer : layers_) {
    for (TensorDecl p : layer->params()) {
      p.name = qualified_name(*layer, p.name);
      params.push_back(std::move(p));
    }
    for (TensorDecl b : layer->buffers()) {
      b.name = qualified_name(*layer, b.name);
      buffers.push_back(std::move(b));
    }
  }
}

void Chain::bind(const std::vector<TensorDecl>& params, std::size_t& param, const std::vector<TensorDecl>& buffers,
                 std::size_t& buffer, float* params_flat, const GradientPlace* grads, std::byte* buffers_flat) {
  for (auto& layer : layers_) {
    for (auto& p : layer->params()) p.offset = params.at(param++).offset;
    for (auto& b : layer->buffers()) b.offset = buffers.at(buffer++).offset;
    layer->bind(params_flat, grads, buffers_flat);
  }
}

void Chain::add_prefix(const std::string& prefix) {
  for (auto& layer : layers_) layer->add_prefix(prefix);
}

bool Chain::child_output_bf16(std::size_t i, bool input_bf16) const {
  if (layers_[i]->output_bf16(input_bf16)) return true;
  if (!layers_[i]->may_round_output()) return false;
  for (std::size_t j = i + 1; j < layers_.size(); ++j)  // views pass the storage on to the reader
    if (!layers_[j]->is_view()) return layers_[j]->rounds_input();
  return reader_rounds_;
}

bool Chain::output_bf16(bool input_bf16) const {
  for (std::size_t i = 0; i < layers_.size(); ++i) input_bf16 = child_output_bf16(i, input_bf16);
  return input_bf16;
}

bool Chain::adds_to_dx() const {
  const std::size_t first = first_compute();
  return first < layers_.size() && layers_[first]->adds_to_dx();
}

bool Chain::copies_dx_bf16() const {
  const std::size_t first = first_compute();
  return first < layers_.size() && !(first < relu_fused_.size() && relu_fused_[first]) &&
         layers_[first]->copies_dx_bf16();
}

bool Chain::rounds_dy() const { return !bf16_.empty() && next_rounds_dy(layers_.size()); }  // after a forward

bool Chain::next_rounds_dy(std::size_t i) const {
  for (std::size_t j = i; j-- > 0;) {
    if (layers_[j]->is_view()) continue;
    if (j > 0 && relu_fused_[j - 1]) return false;  // a ReLU whose gradient its fused layer applies
    return layers_[j]->rounds_dy(bf16_[j]);
  }
  return false;
}

bool Chain::rounds_input() const {
  const std::size_t first = first_compute();
  return first < layers_.size() && layers_[first]->rounds_input();
}

void* Chain::activation(const LayerContext& ctx, std::vector<Scratch>& memory, std::size_t boundary) {
  const auto n = static_cast<std::size_t>(shapes_[boundary].numel());
  if (bf16_[boundary]) return memory[boundary].get<std::uint16_t>(ctx.device, n);
  return memory[boundary].get<float>(ctx.device, n);
}

float* widen(const LayerContext& ctx, Scratch& into, const void* bits, std::int64_t n) {
  float* out = ctx.amp->get<float>(into, ctx.device, n);
  kernels::from_bf16(ctx.stream, n, static_cast<const std::uint16_t*>(bits), out);
  return out;
}

const float* widened(const LayerContext& ctx, const void* data, bool bf16, bool round, std::int64_t n, Scratch& into) {
  if (bf16) return widen(ctx, into, data, n);
  if (!round) return static_cast<const float*>(data);
  float* out = ctx.amp->get<float>(into, ctx.device, n);
  kernels::round_to_bf16(ctx.stream, n, static_cast<const float*>(data), out);
  return out;
}

const void* Chain::forward(const LayerContext& ctx, const void* x, void* y) {
  const std::size_t count = layers_.size();
  // The last computing child, which writes into y when the caller provides it.
  std::size_t last_compute = count;
  for (std::size_t i = count; i-- > 0;)
    if (!layers_[i]->is_view()) {
      last_compute = i;
      break;
    }
  shapes_.assign(count + 1, {});
  outputs_.assign(count + 1, nullptr);
  bf16_.assign(count + 1, false);
  relu_fused_.assign(count, false);
  activations_.resize(count + 1);
  activation_grads_.resize(count + 1);
  shapes_[0] = ctx.in;
  outputs_[0] = x;
  bf16_[0] = ctx.amp && ctx.bf16;
  caller_boundary_ = kNone;
  for (std::size_t i = 0; i < count; ++i) {
    shapes_[i + 1] = layers_[i]->output_shape(shapes_[i]);
    bf16_[i + 1] = ctx.amp && child_output_bf16(i, bf16_[i]);
    if (layers_[i]->is_view()) {
      outputs_[i + 1] = outputs_[i];
      continue;
    }
    progress::set_phase("forward", layers_[i]->name());  // where a thread stuck here stands
    // Layer i and a ReLU after it run in one pass, into the ReLU's output; the boundary between
    // them is never written (nothing reads it: see backward).
    const bool fused = i + 1 < count && layers_[i]->fuses_relu() && layers_[i + 1]->is_relu();
    const std::size_t end = fused ? i + 2 : i + 1;
    if (fused) {
      shapes_[i + 2] = layers_[i + 1]->output_shape(shapes_[i + 1]);
      bf16_[i + 2] = ctx.amp && child_output_bf16(i + 1, bf16_[i + 1]);
    }
    const bool to_caller = end - 1 == last_compute && y;
    void* out = to_caller ? y : activation(ctx, activations_, end);
    forward_child(ctx, i, fused, out);
    relu_fused_[i] = fused;
    outputs_[end] = out;
    if (to_caller) caller_boundary_ = end;
    i = end - 1;
  }
  train_forward_done_ = ctx.mode == Mode::train;
  return outputs_[count];
}

void Chain::forward_child(const LayerContext& ctx, std::size_t i, bool fused, void* out) {
  Layer& layer = *layers_[i];
  const std::size_t end = fused ? i + 2 : i + 1;
  const LayerContext child{ctx.stream, ctx.device,           shapes_[i], ctx.mode, ctx.random,
                           ctx.sync,   ctx.accumulate_grads, ctx.amp,    bf16_[i], bf16_[end]};
  const float* x = static_cast<const float*>(outputs_[i]);
  auto* y = static_cast<float*>(out);
  const bool ids = layer.input_dtype() == DType::i32;
  if (ctx.amp && !layer.is_container() && !layer.native_bf16()) {  // the others take the storage as it is
    AutocastScratch& amp = *ctx.amp;
    if (!ids) x = widened(ctx, outputs_[i], bf16_[i], layer.autocasts(), shapes_[i].numel(), amp.x);
    if (bf16_[end]) y = amp.get<float>(amp.out, ctx.device, shapes_[end].numel());
  }
  if (ids)
    layer.forward_ids(child, static_cast<const std::int32_t*>(outputs_[i]), y);
  else if (fused)
    layer.forward_relu(child, x, y);
  else
    layer.forward(child, x, y);
  if (y != out) kernels::to_bf16(ctx.stream, shapes_[end].numel(), y, static_cast<std::uint16_t*>(out));
}

void Chain::backward(const LayerContext& ctx, const void* dy, void* dx, const std::function<void(Layer&)>& after) {
  if (!train_forward_done_) throw InvalidArgument("backward without a train-mode forward");
  const std::size_t first = first_compute();
  if (first == layers_.size()) {  // identity: dL/dx = dL/dy
    if (dx && dx != dy)
      ctx.stream.copy(dx, dy, static_cast<std::size_t>(shapes_.back().numel()) * element_size(layers_.size()));
    return;
  }
  const std::uint16_t* dy16 = ctx.dy_bf16;  // the caller's, for the last computing child (rounds_dy)
  for (std::size_t i = layers_.size(); i-- > 0;) {
    Layer& layer = *layers_[i];
    if (layer.is_view()) continue;  // same memory, same gradient
    if (i > 0 && relu_fused_[i - 1]) {
      // The ReLU of a fused pair: its mask is applied by the layer before it, reading dy as it is.
      if (after) after(layer);
      continue;
    }
    // The first computing child writes the chain's input gradient (the caller's dx, maybe null:
    // nothing upstream needs it); the others write activation_grads_[i] = dL/d(input of child i).
    void* child_dx = i == first ? dx : activation(ctx, activation_grads_, i);
    // Under autocast a LayerNorm that writes the fp32 stream's gradient also writes its bf16
    // rounding where the residual branch before it would round it (one pass over the gradient
    // fewer; the same bits): the chain's caller asks for the chain's dx, the chain for the others,
    // into its own two buffers taking turns. Its own: a child's dy16 may be read until the child's
    // backward ends (a residual's shortcut), while chains nested in the child make their copies.
    std::uint16_t* dx16 = nullptr;
    if (i == first)
      dx16 = ctx.dx_bf16;
    else if (ctx.amp && !bf16_[i] && !relu_fused_[i] && layer.copies_dx_bf16() && next_rounds_dy(i)) {
      const std::int64_t n = shapes_[i].numel();
      dx16 = ctx.amp->get<std::uint16_t>(grad_copies_[0], ctx.device, n);
      if (dx16 == dy16) dx16 = ctx.amp->get<std::uint16_t>(grad_copies_[1], ctx.device, n);
    }
    backward_child(ctx, i, relu_fused_[i], dy, child_dx, dy16, dx16, after);
    dy = child_dx;
    dy16 = dx16;
  }
}

void Chain::backward_child(const LayerContext& ctx, std::size_t i, bool fused, const void* dy, void* dx,
                           const std::uint16_t* dy16, std::uint16_t* dx16, const std::function<void(Layer&)>& after) {
  Layer& layer = *layers_[i];
  progress::set_phase("backward", layer.name());
  // Fused, dy is dL/d(ReLU's output) and outputs_[i + 2] that output.
  const std::size_t end = fused ? i + 2 : i + 1;
  const bool first = i == first_compute();
  const LayerContext child{ctx.stream,
                           ctx.device,
                           shapes_[i],
                           Mode::train,
                           ctx.random,
                           ctx.sync,
                           ctx.accumulate_grads,
                           ctx.amp,
                           bf16_[i],
                           bf16_[end],
                           first && layer.adds_to_dx() ? ctx.dx_add : nullptr,
                           dx16,
                           fused ? nullptr : dy16};
  const bool ids = layer.input_dtype() == DType::i32;  // no x: the ids are not activations
  const auto* x = ids ? nullptr : static_cast<const float*>(outputs_[i]);
  const auto* y = static_cast<const float*>(outputs_[end]);
  const auto* dy32 = static_cast<const float*>(dy);
  auto* dx32 = static_cast<float*>(dx);
  if (ctx.amp && !layer.is_container() && !layer.native_bf16()) {
    AutocastScratch& amp = *ctx.amp;
    const std::int64_t n_in = shapes_[i].numel(), n_out = shapes_[end].numel();
    x = !ids && (layer.backward_reads_input() || !bf16_[i])
            ? widened(ctx, outputs_[i], bf16_[i], layer.autocasts(), n_in, amp.x)
            : nullptr;
    y = fused || layer.backward_reads_output() || !bf16_[end]
            ? widened(ctx, outputs_[end], bf16_[end], false, n_out, amp.y)
            : nullptr;
    dy32 = widened(ctx, dy, bf16_[end], false, n_out, amp.dy);
    if (dx && bf16_[i]) dx32 = amp.get<float>(amp.dx, ctx.device, n_in);
  }
  if (fused) {
    layer.backward_relu(child, x, y, dy32, dx32);
    if (after) after(layer);
  } else {
    layer.backward_reporting(child, x, y, dy32, dx32, after);
  }
  if (dx32 != dx) kernels::to_bf16(ctx.stream, shapes_[i].numel(), dx32, static_cast<std::uint16_t*>(dx));
}

std::size_t Chain::saved_bytes() const {
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = *layers_[i];
    bytes += layer.saved_bytes();
    if (layer.is_view() || (i > 0 && relu_fused_.size() == layers_.size() && relu_fused_[i - 1])) continue;
    const std::size_t end = i < relu_fused_.size() && relu_fused_[i] ? i + 2 : i + 1;
    if (end >= outputs_.size() || end == caller_boundary_) continue;  // the caller's memory
    bytes += static_cast<std::size_t>(shapes_[end].numel()) * element_size(end);
  }
  return bytes;
}

}  // namespace dp::nn::detail
