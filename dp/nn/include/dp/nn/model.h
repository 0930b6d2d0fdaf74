// dp/nn/model.h — what the engine sees of a model. DP and DDP work only through this interface, so a
// user's own hand-written model is as good as the reference MLP and ConvNet in models/.
// Contract: all parameters of a replica live in ONE contiguous float buffer and all gradients in
// another with the same layout (bucketed all-reduce and broadcast work on slices of them);
// buffers (BatchNorm running stats, num_batches_tracked) live apart, in one byte buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/nn/batch.h"
#include "dp/nn/tensor.h"
#include "dp/runtime/device.h"
#include "dp/runtime/precision.h"

namespace dp {

class Communicator;

enum class Mode { train, eval };

// Backward calls this once per layer that has parameters, in reverse layer order, right after
// that layer's gradient work has been enqueued on the stream (SequentialModel: inside containers —
// Sequential, Residual — per child layer, as the backward reaches it): gradients in
// [offset, offset + count) of the flat gradient buffer are final once that work completes.
using GradientsReady = std::function<void(std::size_t offset, std::size_t count)>;

// Where a backward writes the parameter gradients when an engine keeps no whole gradient buffer
// (ZeRO-2: each gradient bucket in a slot of bucket size, held from the first write to a gradient
// in it until the bucket's reduction has taken it; zero.cpp).
class GradientSlots {
 public:
  virtual ~GradientSlots() = default;
  // Where this backward writes the gradient of [offset, offset + count) of the flat layout (one
  // parameter), asked by its layer's backward as it is enqueued; the same address for every ask
  // until the engine's reduction has taken it. May enqueue a wait on the backward's stream.
  virtual float* gradient(std::size_t offset, std::size_t count) = 0;
};

// What stochastic layers (Dropout) draw from. A mask element is a pure function of these, the
// layer and the element's index, so a run is reproducible, resumes where it stopped (the step is in
// the checkpoint) and draws the same bits on sim and cuda. The engines set it before every
// training forward: single and DP use the run's seed (a DP chunk passes its first sample's
// index, so DP draws exactly the masks of single-device training on the global batch); DDP rank r
// uses seed + r, as each torch process seeds itself with seed + rank.
struct RandomContext {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;           // optimizer steps taken before this forward
  std::uint64_t sample_offset = 0;  // index of the batch's first sample in the step's batch
  // Where the kernels read `step` when they run (the model's device memory, set by the model: see
  // Model::upload_random_step), so that a captured step draws the step of each replay; null: `step`
  // itself goes into the launches.
  const std::uint32_t* step_on_device = nullptr;
};

// SyncBatchNorm (torch.nn.SyncBatchNorm under DDP): BatchNorm layers in train mode normalise with
// the statistics of every replica's batch together. As torch's module does, a layer sums its
// statistics over the replicas between two kernels: an in-place all-reduce on `comm` as local rank
// `rank`, on the layer's stream (every replica makes the same calls in the same order: two in a
// BatchNorm forward, one in its backward); `global_samples` is the step's number of samples over
// all replicas.
struct BatchNormSync {
  Communicator* comm = nullptr;
  int rank = 0;
  std::int64_t global_samples = 0;
  // The sums over the replicas in rank order (an all-gather, then additions rank after rank), not
  // in the all-reduce's own order: fixed shards (EngineOptions::shards), whose bits no collective's
  // algorithm may change.
  bool ordered = false;
};

class Model {
 public:
  virtual ~Model() = default;

  virtual std::string name() const = 0;
  virtual Device& device() const = 0;

  // Flat buffers (device memory). Parameter order = PyTorch's model.parameters() order.
  // grads_flat() enqueues the fill of a pending zero_grad (see zero_grad) on zero_grad's stream.
  virtual float* params_flat() const = 0;
  virtual float* grads_flat() const = 0;
  // The gradients' address without filling in a pending zero_grad, for a caller that reads them
  // only once the next backward has written them: DDP's reducer is handed it before the backward
  // and all-reduces each bucket after the backward wrote it. Models that write no gradients in
  // their backward, or cannot say, keep the default (grads_flat(): the zeros are filled in).
  virtual float* grads_address() const { return grads_flat(); }
  // Gradients in `slots` from the next backward on (its gradients written, never accumulated: no
  // gradient accumulation), and the flat gradient buffer freed: grads_flat() and gradients() then
  // throw and grads_address() is null. Null: the flat buffer back, zeroed. False (the default):
  // the model cannot place its gradients, and nothing changed. Not during a step.
  virtual bool place_gradients(GradientSlots* slots) { return slots == nullptr; }
  virtual std::size_t param_count() const = 0;
  virtual void* buffers_flat() const = 0;  // may be null when there are no buffers
  virtual std::size_t buffers_bytes() const = 0;

  // Named views into those buffers, with PyTorch state-dict names. They are device memory written
  // by stream work: read them on the stream that trains the model, or after the engine's synchronize().
  // gradients() after a zero_grad that no backward followed fills in the zeros and waits for them.
  virtual std::vector<TensorRef> parameters() const = 0;
  virtual std::vector<TensorRef> gradients() const = 0;  // same names and layout as parameters()
  virtual std::vector<TensorRef> buffers() const = 0;
  // A tied parameter's other names, as torch's state_dict() lists the one tensor under each module
  // that holds it: {alias, parameters()' name}. Checkpoints write the alias too, so that torch loads
  // them with strict=True; loading accepts it (equal to the parameter) or its absence.
  virtual std::vector<std::pair<std::string, std::string>> aliases() const { return {}; }

  // Per-sample input shape, e.g. {1, 28, 28}, and number of output features (logits) per target.
  virtual std::vector<std::int64_t> input_shape() const = 0;
  // What the input's elements are: f32 features, or i32 token ids (a language model's).
  virtual DType input_dtype() const { return DType::f32; }
  virtual int output_features() const = 0;
  // Each sample's output is this many rows of output_features() logits, one class target each: 1 for
  // a classifier, the sequence length for a language model (a next-token prediction per position,
  // nanoGPT's logits.view(-1, vocab)). Its loss is the mean over all rows of the batch.
  virtual int targets_per_sample() const { return 1; }

  // Enqueues the forward pass on `stream` for `batch` samples at `input` (device memory, batch x
  // input_shape, of input_dtype(): another dtype is refused). Returns the (batch x
  // targets_per_sample, output_features) output, valid until the next forward. The input must stay
  // as it is until the backward of a train-mode forward (the first layer may read it there).
  // In train mode, layers keep what backward needs and BatchNorm updates its running stats.
  virtual const float* forward(const Stream& stream, Inputs input, int batch, Mode mode) = 0;

  // Enqueues the backward pass of the last train-mode forward, given dL/doutput. The first backward
  // after zero_grad WRITES every parameter gradient into grads_flat; later ones ACCUMULATE into it
  // (as PyTorch accumulates .grad: gradient accumulation, DDP's no_sync).
  virtual void backward(const Stream& stream, const float* grad_output, const GradientsReady& on_ready = {}) = 0;

  // A train-mode forward for a loss that reads the output as the model made it: fp32 (forward()'s),
  // or under autocast the bf16 storage of a last Linear (torch's logits under autocast), without
  // forward()'s widened copy; backward_from_loss then takes dL/doutput in that storage (a bf16
  // gradient: the rounding the backward of `logits.float()` makes, without backward()'s pass).
  struct Output {
    const void* data = nullptr;
    bool bf16 = false;
  };
  virtual Output forward_for_loss(const Stream& stream, Inputs input, int batch) {
    return {forward(stream, input, batch, Mode::train), false};
  }
  virtual void backward_from_loss(const Stream& stream, const void* grad_output, bool bf16,
                                  const GradientsReady& on_ready = {});

  // Note [pending zero_grad]
  // The gradients read as zeros from here on, as after PyTorch's zero_grad(set_to_none=True): the
  // model enqueues nothing (one launch fewer per step) and notes on the host that the zeros are
  // pending; the next backward then writes the gradients instead of adding to them. Anything that
  // reads the gradients before that backward gets the zeros materialised on `stream`, where an
  // eager zero_grad would have enqueued the fill, by the first of
  //   - grads_flat(): enqueues the fill (work the caller orders after `stream` reads zeros, as an
  //     optimizer step after a zero_grad with no backward);
  //   - gradients(): enqueues the fill and waits for it (views may be read after a synchronize);
  // so a caller that takes grads_flat() before the backward (DDP's reducer) pays for the fill and
  // gets an accumulating backward; one that takes it after (an optimizer step) never pays for it.
  // Graph replays do not go through the model: a captured step (zero_grad + backward inside)
  // replays what it captured, a written gradient, whatever the host state says; the engine then
  // calls replayed_backward(), so a zero_grad issued before the replay is done with, as after an
  // eager step. One thread at a time per model, as for backward.
  virtual void zero_grad(const Stream& stream) = 0;

  // The randomness the next train-mode forwards draw from (see RandomContext); models without
  // stochastic layers ignore it.
  virtual void set_random_context(const RandomContext&) {}
  // Until reset with null, train-mode forwards and backwards synchronise BatchNorm statistics
  // through `sync` (owned by the caller, alive while set); models without BatchNorm ignore it.
  virtual void set_batchnorm_sync(const BatchNormSync*) {}
  // Autocast (dp/runtime/precision.h) for every later forward and backward, as torch.autocast around
  // the forward: Autocast::bf16 computes Linear and Conv2d from bf16-rounded inputs and weights and
  // keeps the activations in bf16; forward() still returns fp32 logits (widened, for an fp32 loss)
  // and backward() takes an fp32 gradient. Replicas keep the setting; set it between steps. A model
  // that does not implement it refuses bf16 with InvalidArgument (the default).
  virtual void set_autocast(Autocast autocast);
  virtual Autocast autocast() const { return Autocast::off; }
  // Bytes the last train-mode forward keeps for the backward: the activations between layers and
  // what layers save (max-pool indices, BatchNorm statistics), not reusable scratch. 0 when the
  // model cannot say.
  virtual std::size_t saved_activation_bytes() const { return 0; }
  // An engine replayed a captured step whose backward wrote the gradients: on the host, the model
  // is where that backward leaves it (a pending zero_grad is done with), as if it had run.
  virtual void replayed_backward() {}

  // Whether an engine may capture a training step of this model into a graph once and replay it
  // for later steps (EngineOptions::graphs): true only when forward, backward and zero_grad enqueue
  // the same work with the same arguments at every step of one batch size that makes the same
  // calls (a step's backward after its own zero_grad always writes the gradients; RandomContext's
  // step read from random_step_on_device(), no host value that changes baked into a launch), and
  // allocate nothing once a step of that batch size has run. Models that do not say so run every
  // step eagerly.
  virtual bool capturable() const { return false; }

  // A stochastic model's step on its device (RandomContext::step_on_device): what its train-mode
  // kernels read when they run; null for a model that draws nothing. An eager training forward
  // copies the step of its RandomContext there itself; a captured one copies nothing, and an engine
  // replaying it calls upload_random_step(stream, step) first, on the stream the replay is launched
  // on, or copies another replica's (DataParallel's broadcast, inside the graph).
  virtual std::uint32_t* random_step_on_device() const { return nullptr; }
  virtual void upload_random_step(const Stream& /*stream*/, std::uint64_t /*step*/) {}

  // The same architecture on another device, with its own buffers (values uninitialised: the
  // engine broadcasts them).
  virtual std::unique_ptr<Model> replicate(Device& device) const = 0;
};

}  // namespace dp
