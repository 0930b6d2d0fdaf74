// layers.cpp — Linear, Conv2d, BatchNorm2d, ReLU, MaxPool2d, Flatten on top of the kernels.
#include "dp/nn/layers.h"

#include <fmt/format.h>

#include "dp/error.h"
#include "dp/kernels/batchnorm.h"
#include "dp/kernels/conv2d.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/maxpool.h"
#include "dp/kernels/ops.h"
#include "dp/scratch.h"

namespace dp::nn {
namespace {

class Linear final : public Layer {
 public:
  Linear(std::string name, int in, int out) : Layer(std::move(name)), in_(in), out_(out) {
    params_.push_back({"weight", DType::f32, {out, in}, Init::kaiming_uniform, in});
    params_.push_back({"bias", DType::f32, {out}, Init::fan_in_uniform, in});
  }
  ActShape output_shape(const ActShape& in) const override {
    if (in.per_sample() != in_)
      throw InvalidArgument(fmt::format("{}: expects {} input features, got {}", name(), in_, in.per_sample()));
    return ActShape{in.n, out_, 1, 1};
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::linear_forward(ctx.stream, ctx.in.n, in_, out_, x, param(0), param(1), y);
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    kernels::linear_backward(ctx.stream, ctx.in.n, in_, out_, x, param(0), dy, dx, grad(0), grad(1));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(*this); }

 private:
  int in_, out_;
};

class Conv2d final : public Layer {
 public:
  Conv2d(std::string name, int in, int out, int kernel, int stride, int pad)
      : Layer(std::move(name)), in_(in), out_(out), kernel_(kernel), stride_(stride), pad_(pad) {
    const std::int64_t fan_in = static_cast<std::int64_t>(in) * kernel * kernel;
    params_.push_back({"weight", DType::f32, {out, in, kernel, kernel}, Init::kaiming_uniform, fan_in});
    params_.push_back({"bias", DType::f32, {out}, Init::fan_in_uniform, fan_in});
  }
  kernels::Conv2dShape shape(const ActShape& in) const {
    if (in.c != in_) throw InvalidArgument(fmt::format("{}: expects {} channels, got {}", name(), in_, in.c));
    return kernels::Conv2dShape{in.n, in.c, in.h, in.w, out_, kernel_, kernel_, stride_, pad_};
  }
  ActShape output_shape(const ActShape& in) const override {
    const auto s = shape(in);
    if (s.h_out() < 1 || s.w_out() < 1)
      throw InvalidArgument(fmt::format("{}: input {}x{} is smaller than the kernel", name(), in.h, in.w));
    return ActShape{in.n, out_, s.h_out(), s.w_out()};
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto s = shape(ctx.in);
    kernels::conv2d_forward(ctx.stream, s, x, param(0), param(1), y,
                            workspace_.get<float>(ctx.device, kernels::conv2d_workspace_floats(s)));
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const auto s = shape(ctx.in);
    kernels::conv2d_backward(ctx.stream, s, x, param(0), dy, dx, grad(0), grad(1),
                             workspace_.get<float>(ctx.device, kernels::conv2d_workspace_floats(s)));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Conv2d>(*this); }

 private:
  int in_, out_, kernel_, stride_, pad_;
  Scratch workspace_;
};

class BatchNorm2d final : public Layer {
 public:
  BatchNorm2d(std::string name, int channels) : Layer(std::move(name)), channels_(channels) {
    params_.push_back({"weight", DType::f32, {channels}, Init::ones, 0});
    params_.push_back({"bias", DType::f32, {channels}, Init::zeros, 0});
    buffers_.push_back({"running_mean", DType::f32, {channels}, Init::zeros, 0});
    buffers_.push_back({"running_var", DType::f32, {channels}, Init::ones, 0});
    buffers_.push_back({"num_batches_tracked", DType::i64, {}, Init::zeros, 0});
  }
  kernels::BatchNormShape shape(const ActShape& in) const {
    if (in.c != channels_)
      throw InvalidArgument(fmt::format("{}: expects {} channels, got {}", name(), channels_, in.c));
    return kernels::BatchNormShape{in.n, in.c, in.h, in.w};
  }
  ActShape output_shape(const ActShape& in) const override {
    shape(in);
    return in;
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto s = shape(ctx.in);
    if (ctx.mode == Mode::eval) {
      kernels::batchnorm_forward_eval(ctx.stream, s, x, param(0), param(1), buffer<float>(0), buffer<float>(1), y);
      return;
    }
    float* saved = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(channels_));
    kernels::batchnorm_forward_train(ctx.stream, s, x, param(0), param(1), y, saved, saved + channels_,
                                     buffer<float>(0), buffer<float>(1), buffer<std::int64_t>(2));
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const auto s = shape(ctx.in);
    float* saved = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(channels_));
    kernels::batchnorm_backward(ctx.stream, s, x, param(0), saved, saved + channels_, dy, dx, grad(0), grad(1),
                                saved + 2 * channels_);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<BatchNorm2d>(*this); }

 private:
  int channels_;
  Scratch saved_;  // batch mean, invstd, then the backward's two sums per channel
};

class Relu final : public Layer {
 public:
  using Layer::Layer;
  ActShape output_shape(const ActShape& in) const override { return in; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::relu_forward(ctx.stream, ctx.in.numel(), x, y);
  }
  void backward(const LayerContext& ctx, const float*, const float* y, const float* dy, float* dx) override {
    if (dx) kernels::relu_backward(ctx.stream, ctx.in.numel(), y, dy, dx);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Relu>(name()); }
};

class MaxPool2d final : public Layer {
 public:
  MaxPool2d(std::string name, int kernel, int stride) : Layer(std::move(name)), kernel_(kernel), stride_(stride) {}
  kernels::MaxPoolShape shape(const ActShape& in) const {
    return kernels::MaxPoolShape{in.n, in.c, in.h, in.w, kernel_, stride_, 0};
  }
  ActShape output_shape(const ActShape& in) const override {
    const auto s = shape(in);
    if (s.h_out() < 1 || s.w_out() < 1)
      throw InvalidArgument(fmt::format("{}: input {}x{} is smaller than the window", name(), in.h, in.w));
    return ActShape{in.n, in.c, s.h_out(), s.w_out()};
  }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto s = shape(ctx.in);
    const std::size_t outputs = static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out();
    kernels::maxpool_forward(ctx.stream, s, x, y, argmax_.get<std::int32_t>(ctx.device, outputs));
  }
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float* dx) override {
    if (!dx) return;
    const auto s = shape(ctx.in);
    const std::size_t outputs = static_cast<std::size_t>(s.n) * s.c * s.h_out() * s.w_out();
    kernels::maxpool_backward(ctx.stream, s, argmax_.get<std::int32_t>(ctx.device, outputs), dy, dx);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<MaxPool2d>(*this); }

 private:
  int kernel_, stride_;
  Scratch argmax_;
};

class Flatten final : public Layer {
 public:
  using Layer::Layer;
  ActShape output_shape(const ActShape& in) const override {
    return ActShape{in.n, static_cast<int>(in.per_sample()), 1, 1};
  }
  bool is_view() const override { return true; }
  void forward(const LayerContext&, const float*, float*) override {}
  void backward(const LayerContext&, const float*, const float*, const float*, float*) override {}
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Flatten>(name()); }
};

}  // namespace

std::unique_ptr<Layer> make_linear(std::string name, int in_features, int out_features) {
  return std::make_unique<Linear>(std::move(name), in_features, out_features);
}
std::unique_ptr<Layer> make_conv2d(std::string name, int in_channels, int out_channels, int kernel, int stride,
                                   int pad) {
  return std::make_unique<Conv2d>(std::move(name), in_channels, out_channels, kernel, stride, pad);
}
std::unique_ptr<Layer> make_batchnorm2d(std::string name, int channels) {
  return std::make_unique<BatchNorm2d>(std::move(name), channels);
}
std::unique_ptr<Layer> make_relu(std::string name) { return std::make_unique<Relu>(std::move(name)); }
std::unique_ptr<Layer> make_maxpool2d(std::string name, int kernel, int stride) {
  return std::make_unique<MaxPool2d>(std::move(name), kernel, stride);
}
std::unique_ptr<Layer> make_flatten(std::string name) { return std::make_unique<Flatten>(std::move(name)); }

}  // namespace dp::nn
