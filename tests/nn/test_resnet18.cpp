// test_resnet18.cpp — torchvision's ResNet-18/34 (dp::models::make_resnet18/34) against torchvision:
// the state dict's names, shapes and order, ResNet-34's size, and one train-mode forward/backward and
// an eval-mode forward of ResNet-18 against tests/golden/resnet18.safetensors, on the sim backend.
// The golden's parameters come from a formula (tests/golden/make_resnet18_goldens.py) that
// formula_state() below reproduces bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dp/io/checkpoint.h"
#include "dp/io/safetensors.h"
#include "dp/models/resnet.h"
#include "dp/nn/layers.h"
#include "dp/nn/loss.h"
#include "dp/runtime/device.h"
#include "dp/runtime/error.h"
#include "test_util.h"

namespace dp {
namespace {

// torchvision's state dict of resnet18(num_classes=10), from the golden's metadata, in order.
struct StateEntry {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string dtype;
};

std::vector<StateEntry> torchvision_state(const safetensors::File& golden) {
  std::vector<StateEntry> entries;
  for (const auto& item : nlohmann::json::parse(golden.metadata.at("state_dict")))
    entries.push_back(
        {item[0].get<std::string>(), item[1].get<std::vector<std::int64_t>>(), item[2].get<std::string>()});
  return entries;
}

std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// State-dict entry `index` as make_resnet18_goldens.py defines it: every step one correctly rounded
// double operation (the products by powers of two are exact), then one rounding to float.
std::vector<float> formula_values(std::uint64_t index, const StateEntry& entry) {
  std::size_t n = 1;
  for (auto d : entry.shape) n *= static_cast<std::size_t>(d);
  const auto ends_with = [&](const std::string& tail) {
    return entry.name.size() >= tail.size() &&
           entry.name.compare(entry.name.size() - tail.size(), tail.size(), tail) == 0;
  };
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(splitmix64((index << 32) + i) >> 11) * 0x1p-53 * 2.0 - 1.0;
    double v;
    if (entry.shape.size() == 4) {
      v = u * std::sqrt(6.0 / static_cast<double>(entry.shape[1] * entry.shape[2] * entry.shape[3]));
    } else if (entry.name.rfind("fc.", 0) == 0) {
      v = u / std::sqrt(512.0);
    } else if (ends_with("running_mean")) {
      v = 0.1 * u;
    } else if (ends_with("running_var")) {
      v = 1.0 + 0.5 * u;
    } else if (ends_with("weight")) {
      v = 1.0 + 0.25 * u;
    } else {
      v = 0.1 * u;
    }
    values[i] = static_cast<float>(v);
  }
  return values;
}

// The golden's parameters and buffers, under torchvision's names.
safetensors::File formula_state(const std::vector<StateEntry>& entries) {
  safetensors::File file;
  for (std::size_t t = 0; t < entries.size(); ++t) {
    const StateEntry& entry = entries[t];
    if (entry.dtype == "I64") {
      const std::vector<std::int64_t> zeros(numel(entry.shape), 0);  // num_batches_tracked
      file.add(entry.name, safetensors::make_i64(entry.shape, zeros.data()));
    } else {
      file.add(entry.name, safetensors::make_f32(entry.shape, formula_values(t, entry).data()));
    }
  }
  return file;
}

// Logits, loss and full gradients, as tests/nn/test_models.cpp compares its goldens: elementwise rtol
// 1e-4 plus 2e-5 of the tensor's largest |value|. torch's own fp32 result differs from an fp64 rerun
// by at most 2.2e-6 of the largest logit, 0.4e-6 on the eval logits and 4e-6 on fc.weight's gradient
// (measured when the golden was made); dp sums in other orders, so test::matches_golden allows about
// ten times that.

// A gradient against its golden summary. torch fp32 vs fp64 on this golden: the sum differs by at
// most 0.9e-6 of sqrt(n * sum of squares) (the size of a sum of n values of that rms whatever
// their signs, so a sum that nearly cancels, as fc.bias's, is judged on its terms' scale), the sum
// of squares by 3.7e-6 relative, the first elements by 2e-5 of the rms. Bounds: about ten times
// those. A misrouted gradient or a wrong stride moves these by percents.
::testing::AssertionResult matches_summary(const std::vector<float>& got, const std::vector<float>& summary,
                                           const std::vector<float>& head) {
  double sum = 0.0, sum_squares = 0.0;
  for (float v : got) {
    sum += v;
    sum_squares += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(got.size());
  const double want_sum = summary[0], want_squares = summary[1];
  const double sum_scale = std::sqrt(n * want_squares), rms = std::sqrt(want_squares / n);
  if (!(std::fabs(sum - want_sum) <= 1e-5 * sum_scale + 1e-12))
    return ::testing::AssertionFailure() << "sum " << sum << " want " << want_sum << " (scale " << sum_scale << ")";
  if (!(std::fabs(sum_squares - want_squares) <= 1e-4 * want_squares + 1e-24))
    return ::testing::AssertionFailure() << "sum of squares " << sum_squares << " want " << want_squares;
  const std::vector<float> got_head(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(head.size()));
  return test::all_close(got_head, head, 1e-4, 2e-4 * rms);
}

// A model on the golden's formula state, the golden's input and targets on the device.
struct GoldenRun {
  GoldenRun()
      : golden(safetensors::read(test::golden_path("resnet18"))),
        runtime(test::sim_runtime(1)),
        stream(runtime->device(0).create_stream()),
        model(models::make_resnet18(runtime->device(0), std::stoi(golden.metadata.at("num_classes")),
                                    std::stoi(golden.metadata.at("image_size")))),
        batch(std::stoi(golden.metadata.at("batch"))),
        classes(std::stoi(golden.metadata.at("num_classes"))) {
    load_state_dict(*model, stream, formula_state(torchvision_state(golden)));
    input = test::upload(runtime->device(0), stream, golden.at("input").to_f32());
    target = test::upload(runtime->device(0), stream, golden.at("target").to_i64());
  }
  safetensors::File golden;
  std::unique_ptr<Runtime> runtime;
  Stream stream;
  std::unique_ptr<Model> model;
  int batch, classes;
  DeviceBuffer input, target;
};

TEST(ResNet18, StateDictIsTorchvisions) {
  const auto golden = safetensors::read(test::golden_path("resnet18"));
  const auto want = torchvision_state(golden);
  auto rt = test::sim_runtime(1);
  auto model = models::make_resnet18(rt->device(0), 10, 32);
  Stream stream = rt->device(0).create_stream();
  const auto state = state_dict(*model, stream);
  // Name for name, shape for shape and dtype for dtype, so that a dp checkpoint loads into
  // torchvision with strict=True and the other way round. Loading goes by name, and dp lists the
  // parameters before the buffers where torch interleaves them module by module: compare sorted.
  const auto describe = [](const std::string& name, const std::vector<std::int64_t>& shape, const std::string& dtype) {
    return name + " " + ::testing::PrintToString(shape) + " " + dtype;
  };
  std::vector<std::string> got_entries, want_entries;
  for (const auto& name : state.order)
    got_entries.push_back(describe(name, state.at(name).shape, state.at(name).dtype));
  for (const auto& entry : want) want_entries.push_back(describe(entry.name, entry.shape, entry.dtype));
  std::sort(got_entries.begin(), got_entries.end());
  std::sort(want_entries.begin(), want_entries.end());
  EXPECT_EQ(got_entries, want_entries);
  EXPECT_EQ(want_entries.size(), 122u);
  // named_parameters() order (DDP's buckets follow it): the golden wrote its gradients in it.
  std::vector<std::string> want_params, got_params;
  for (const auto& name : golden.order)
    if (name.rfind("grad_summary.", 0) == 0) want_params.push_back(name.substr(13));
  for (const TensorRef& p : model->parameters()) got_params.push_back(p.name);
  EXPECT_EQ(got_params, want_params);
  EXPECT_EQ(model->param_count(), 11181642u);  // sum(p.numel() for p in resnet18(num_classes=10).parameters())
}

TEST(ResNet18, ResNet34HasTorchvisionsSize) {
  auto rt = test::sim_runtime(1);
  auto model = models::make_resnet34(rt->device(0), 1000, 224);
  // torchvision.models.resnet34(): 21,797,672 parameters; 36 BatchNorms, 3 buffers each.
  EXPECT_EQ(model->param_count(), 21797672u);
  EXPECT_EQ(model->buffers().size(), 108u);
  EXPECT_EQ(model->parameters().front().name, "conv1.weight");
  EXPECT_EQ(model->parameters().back().name, "fc.bias");
  EXPECT_EQ(model->parameters().back().shape, (std::vector<std::int64_t>{1000}));
}

// torchvision's init: every convolution kaiming_normal_(fan_out, relu), BatchNorm weight 1 and bias
// 0, fc torch's Linear default (U(+-1/sqrt(512))); deterministic in the seed.
TEST(ResNet18, InitialisesAsTorchvision) {
  auto rt = test::sim_runtime(1);
  auto model = models::make_resnet18(rt->device(0), 10, 32, 7);
  auto again = models::make_resnet18(rt->device(0), 10, 32, 7);
  auto other = models::make_resnet18(rt->device(0), 10, 32, 8);
  const Stream stream = rt->device(0).create_stream();
  const auto read = [&](const Model& m, const std::string& name) {
    for (const TensorRef& p : m.parameters())
      if (p.name == name) {
        std::vector<float> v(p.numel());
        stream.copy(v.data(), p.data, p.bytes());
        stream.synchronize();
        return v;
      }
    ADD_FAILURE() << name;
    return std::vector<float>{};
  };
  for (const auto& [name, fan_out] : std::vector<std::pair<std::string, double>>{
           {"conv1.weight", 64 * 49}, {"layer3.0.conv2.weight", 256 * 9}, {"layer4.0.downsample.0.weight", 512}}) {
    const std::vector<float> w = read(*model, name);
    double sum = 0.0, squares = 0.0;
    for (float x : w) sum += x, squares += static_cast<double>(x) * x;
    const double n = static_cast<double>(w.size()), mean = sum / n, std = std::sqrt(squares / n - mean * mean);
    const double want = std::sqrt(2.0 / fan_out);
    EXPECT_NEAR(std / want, 1.0, 4.0 / std::sqrt(n)) << name;  // the sample std of n normals
    EXPECT_NEAR(mean / want, 0.0, 4.0 / std::sqrt(n)) << name;
    EXPECT_EQ(w, read(*again, name)) << name << ": the same seed";
    EXPECT_NE(w, read(*other, name)) << name << ": another seed";
  }
  for (float x : read(*model, "layer2.1.bn1.weight")) EXPECT_EQ(x, 1.0f);
  for (float x : read(*model, "layer2.1.bn1.bias")) EXPECT_EQ(x, 0.0f);
  for (float x : read(*model, "fc.weight")) EXPECT_LE(std::fabs(x), 1.0f / std::sqrt(512.0f));
}

TEST(ResNet18, BadArgumentsAreClearErrors) {
  auto rt = test::sim_runtime(1);
  EXPECT_THROW(models::make_resnet18(rt->device(0), 0, 32), InvalidArgument);
  EXPECT_THROW(models::make_resnet34(rt->device(0), 10, 0), InvalidArgument);
  // Every stride-2 stage keeps a 1x1 plane 1x1: the smallest image is 1x1.
  EXPECT_EQ(models::make_resnet18(rt->device(0), 3, 1)->input_shape(), (std::vector<std::int64_t>{3, 1, 1}));
  // The stem's MaxPool2d(3, 2, 1) padding follows torch's rule 0 <= pad <= kernel/2.
  EXPECT_THROW(nn::make_maxpool2d("maxpool", 3, 2, 2), InvalidArgument);
  try {
    models::make_resnet18(rt->device(0), 10, -4);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("image_size"), std::string::npos) << e.what();
  }
}

TEST(ResNet18, TrainStepMatchesTorchvision) {
  GoldenRun run;
  const auto& golden = run.golden;
  Model& model = *run.model;
  const float* logits = model.forward(run.stream, run.input.as<float>(), run.batch, Mode::train);
  const std::size_t logit_count = static_cast<std::size_t>(run.batch) * run.classes;
  EXPECT_TRUE(test::matches_golden(test::to_host(run.stream, logits, logit_count), golden.at("train.output").to_f32()))
      << "logits";
  CrossEntropyLoss loss(model.device());
  DeviceBuffer dlogits = model.device().allocate(logit_count * sizeof(float));
  const float* device_loss = loss.forward(run.stream, logits, run.target.as<std::int64_t>(), run.batch, run.classes);
  EXPECT_TRUE(test::matches_golden(test::to_host(run.stream, device_loss, 1), golden.at("train.loss").to_f32()))
      << "loss";
  loss.backward(run.stream, logits, run.target.as<std::int64_t>(), run.batch, run.classes, dlogits.as<float>(),
                run.batch);
  model.zero_grad(run.stream);
  model.backward(run.stream, dlogits.as<float>());
  std::size_t checked = 0;
  for (const TensorRef& g : model.gradients()) {
    const auto got = test::to_host(run.stream, g.as<float>(), g.numel());
    EXPECT_TRUE(
        matches_summary(got, golden.at("grad_summary." + g.name).to_f32(), golden.at("grad_head." + g.name).to_f32()))
        << "grad " << g.name;
    if (golden.has("grad." + g.name)) {
      EXPECT_TRUE(test::matches_golden(got, golden.at("grad." + g.name).to_f32())) << "grad " << g.name;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 62u);
}

TEST(ResNet18, EvalLogitsMatchTorchvision) {
  GoldenRun run;
  const float* logits = run.model->forward(run.stream, run.input.as<float>(), run.batch, Mode::eval);
  EXPECT_TRUE(test::matches_golden(test::to_host(run.stream, logits, static_cast<std::size_t>(run.batch) * run.classes),
                                   run.golden.at("eval.output").to_f32()));
}

}  // namespace
}  // namespace dp
