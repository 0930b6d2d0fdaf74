// dp/models/gpt.h — nanoGPT's GPT (Karpathy's model.py, bias=True): token and position embeddings
// transformer.wte (vocab, width) and transformer.wpe (context, width); `layers` Blocks
// transformer.h.i = x + attn(ln_1(x)), then x + mlp(ln_2(x)) with attn a causal self-attention of
// `heads` heads (c_attn, c_proj) and mlp c_fc (width -> 4 width), GELU (exact, as nn.GELU(), or GPT-2's
// tanh form), c_proj;
// transformer.ln_f; lm_head tied to wte. Input: T <= context token ids per sample (int32 in
// [0, vocab): Model::input_dtype() is i32); output: T rows of vocab logits, one next-token target each
// (Model::targets_per_sample). State-dict names are nanoGPT's, so a checkpoint loads into its GPT
// with strict=True (lm_head.weight being wte's tensor, as torch's tie makes it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dp/nn/layers.h"
#include "dp/nn/model.h"

namespace dp::models {

struct GptConfig {
  int vocab = 256;   // token ids [0, vocab): the logits per position (bytes as tokens: 256)
  int context = 64;  // block_size: the longest sequence, and wpe's rows
  int layers = 4;    // n_layer
  int heads = 4;     // n_head; width % heads == 0
  int width = 128;   // n_embd
  // nanoGPT's dropout in training: after the embeddings (transformer.drop), on the attention
  // probabilities (attn.attn_dropout), after each residual branch's projection (attn.resid_dropout,
  // mlp.dropout). Its masks are dp's (dp/kernels/dropout.h), not torch's.
  double dropout = 0.0;
  // GPT-2's GELU, the tanh approximation (llm.c's, nn.GELU(approximate='tanh')); false: nanoGPT's
  // exact nn.GELU().
  bool tanh_gelu = false;
  // wte's rows (0: vocab). llm.c pads GPT-2's 50257 to 50304: the rows past vocab are never an
  // input and get no logit, so they keep their values (and train_gpt2.c's arithmetic is kept).
  int vocab_rows = 0;
  // The attention without a (T, T) matrix in memory (nn::make_causal_self_attention's `fused`).
  bool fused_attention = true;
  int rows() const { return vocab_rows > 0 ? vocab_rows : vocab; }
};

// llm.c's padding of a vocabulary: up to a multiple of 128 rows (GPT-2's 50257: 50304; 256: 256).
constexpr int llmc_padded_vocab(int vocab) { return (vocab + 127) / 128 * 128; }

// transformer.drop, the Blocks and ln_f of `config` (what make_language_model wraps); throws
// InvalidArgument naming the field for a size < 1, a width that the heads do not divide or a dropout
// outside [0, 1].
nn::Layers gpt_body(const GptConfig& config);
// nanoGPT's Block `name` of `width` features and `heads` heads, with its dropouts.
std::unique_ptr<nn::Layer> gpt_block(const std::string& name, int width, int heads, double dropout = 0.0,
                                     bool tanh_gelu = false, bool fused_attention = true);

// GPT-2's initialisation as nanoGPT's _init_weights applies it: every Linear weight and both
// embeddings N(0, 0.02^2), the residual projections (attn.c_proj, mlp.c_proj) N(0, (0.02 /
// sqrt(2 layers))^2), biases 0, LayerNorms 1 and 0. Normals from dp's seeded generator (the same
// values on every platform), not torch's.
std::unique_ptr<Model> make_gpt(Device& device, const GptConfig& config, std::uint64_t seed = 0);

}  // namespace dp::models
