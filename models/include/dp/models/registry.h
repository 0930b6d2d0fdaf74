// dp/models/registry.h — every reference model by name: what it takes, its input, its size and its
// GEMM work (computed from its layers), and how to build it. Tools ask it; a new model is a new
// entry in models/ and nothing else.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/models/gpt.h"
#include "dp/nn/layers.h"
#include "dp/nn/model.h"

namespace dp::models {

// The arguments a model may take; each model reads only those its spec says it takes.
struct ModelArgs {
  std::vector<int> hidden = {256, 256};  // mlp: hidden layer sizes
  double dropout = 0.0;                  // mlp: Dropout(p) after each hidden ReLU; gpt: its dropout (0: none)
  int num_classes = 10;                  // resnet18/34: fc's outputs
  int image_size = 224;                  // resnet18/34: inputs 3 x S x S
  GptConfig gpt;                         // gpt: vocab, context, layers, heads, width (dropout: above)
};

enum class ModelArg { hidden, dropout, num_classes, image_size, gpt };

class ModelSpec {
 public:
  using LayersFn = nn::Layers (*)(const ModelArgs&);
  using InputFn = std::vector<std::int64_t> (*)(const ModelArgs&);
  // Re-initialises a built model's parameters where the model's own init differs from its layers'
  // defaults (torchvision's, nanoGPT's); null: the layers' defaults.
  using InitFn = void (*)(Model&, const ModelArgs&, std::uint64_t seed);

  ModelSpec(std::string_view name, std::string_view description, std::vector<ModelArg> takes, LayersFn layers,
            InputFn input_shape, InitFn init = nullptr)
      : name_(name),
        description_(description),
        takes_(std::move(takes)),
        layers_(layers),
        input_shape_(input_shape),
        init_(init) {}

  std::string_view name() const { return name_; }
  std::string_view description() const { return description_; }  // one line
  bool takes(ModelArg arg) const;
  // Per sample: (C, H, W), or (T) token ids.
  std::vector<std::int64_t> input_shape(const ModelArgs& args) const { return input_shape_(args); }
  // Their number: four bytes each (f32 features or i32 token ids).
  std::uint64_t input_elements(const ModelArgs& args) const;
  // The classes of each target: the logits per row (a language model's vocabulary).
  int num_classes(const ModelArgs& args) const;
  // Targets per sample (Model::targets_per_sample): 1, or a language model's positions.
  int targets_per_sample(const ModelArgs& args) const;
  // Initialised from `seed` as dp initialises every model. Throws InvalidArgument on bad arguments.
  // The model is its layers(args) on `device`, taking input_shape(args): the one list of each.
  std::unique_ptr<Model> build(Device& device, const ModelArgs& args, std::uint64_t seed) const;
  // From the layers' declarations, without a device; equals the built model's param_count().
  // Throws InvalidArgument when it does not fit in 64 bits.
  std::uint64_t param_count(const ModelArgs& args) const;
  // GEMM and convolution FLOPs per sample of one training step: forward, weight gradients, and
  // input gradients of every layer but the first that computes (the engine skips its dx, as
  // PyTorch does); each of the three is 2 FLOPs per multiply-add of the forward.
  double gemm_flops_per_sample(const ModelArgs& args) const;

 private:
  std::string_view name_, description_;
  std::vector<ModelArg> takes_;
  LayersFn layers_;
  InputFn input_shape_;
  InitFn init_;
};

// Every model, in the order --help lists them.
std::span<const ModelSpec> all_models();
// Null when no model has that name.
const ModelSpec* find_model(std::string_view name);
// Throws InvalidArgument naming the known models when no model has that name.
const ModelSpec& model_spec(std::string_view name);
// {"mlp", "convnet", ...}, in all_models()' order.
std::vector<std::string> model_names();

}  // namespace dp::models
