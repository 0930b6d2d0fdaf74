// transformer.cpp — a transformer's layers on sequences of tokens: LayerNorm, GELU and causal
// multi-head self-attention, with torch's semantics and nanoGPT's parameter names. A sequence of T
// tokens of C features is the activation shape (N, T, 1, C); these layers, and Linear, act on its
// last dimension, one token (row) at a time, as torch's do.
#include <fmt/format.h>

#include "container.h"
#include "dp/kernels/attention.h"
#include "dp/kernels/embedding.h"
#include "dp/kernels/gelu.h"
#include "dp/kernels/layernorm.h"
#include "dp/kernels/linear.h"
#include "dp/kernels/ops.h"
#include "dp/nn/layers.h"
#include "dp/runtime/error.h"
#include "dropout_draw.h"

namespace dp::nn {
namespace {

// The rows of a (N, T, 1, C) activation: N * T tokens of C features.
kernels::index_t token_rows(const ActShape& in) { return static_cast<kernels::index_t>(in.n) * in.positions() * in.h; }

void check_tokens(const std::string& name, const ActShape& in, int width) {
  if (in.features() != width)
    throw InvalidArgument(fmt::format("{}: expects {} features per token (the last dimension), got {} in ({}, {}, {})",
                                      name, width, in.features(), in.c, in.h, in.w));
}

// torch.nn.LayerNorm(width) (eps 1e-5) over each token's features. torch's autocast runs layer_norm
// in fp32: its output is fp32 whatever its input, unless its reader rounds it to bf16 (a Linear under
// autocast): then it writes those bf16 values and takes its gradient in bf16 (may_round_output). It
// reads a bf16 input as it is and writes its gradient in the input's dtype.
class LayerNorm final : public Layer {
 public:
  LayerNorm(std::string name, int width) : Layer(std::move(name)), width_(width) {
    if (width < 1) throw InvalidArgument(fmt::format("{}: LayerNorm over {} features", this->name(), width));
    params_.push_back({"weight", DType::f32, {width}, Init::ones, 0});
    params_.push_back({"bias", DType::f32, {width}, Init::zeros, 0});
  }
  ActShape output_shape(const ActShape& in) const override {
    check_tokens(name(), in, width_);
    return in;
  }
  bool output_bf16(bool) const override { return false; }
  bool native_bf16() const override { return true; }
  bool may_round_output() const override { return true; }
  bool adds_to_dx() const override { return true; }
  bool copies_dx_bf16() const override { return true; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const auto rows = token_rows(ctx.in);
    float* stats = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(rows));
    kernels::layernorm_forward(ctx.stream, rows, width_, {x, ctx.bf16}, param(0), param(1), {y, ctx.out_bf16}, stats,
                               stats + rows);
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    const auto rows = token_rows(ctx.in);
    float* stats = saved_.get<float>(ctx.device, 4 * static_cast<std::size_t>(rows));
    kernels::layernorm_backward(ctx.stream, rows, width_, {x, ctx.bf16}, param(0), stats, stats + rows,
                                {dy, ctx.out_bf16}, {dx, ctx.bf16}, grad(0), grad(1), stats + 2 * rows,
                                ctx.accumulate_grads, {ctx.dx_add, ctx.bf16}, kernels::Out(ctx.dx_bf16));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<LayerNorm>(*this); }
  std::size_t saved_bytes() const override { return saved_.size() / 2; }  // mean and rstd

 private:
  int width_;
  Scratch saved_;  // mean, rstd (rows each), then the backward's row sums (2 * rows)
};

// torch.nn.GELU(approximate='none' | 'tanh'): elementwise, in the input's dtype (bf16 storage read
// and written as it is).
class Gelu final : public Layer {
 public:
  Gelu(std::string name, kernels::GeluForm form) : Layer(std::move(name)), form_(form) {}
  ActShape output_shape(const ActShape& in) const override { return in; }
  bool native_bf16() const override { return true; }
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    kernels::gelu_forward(ctx.stream, ctx.in.numel(), form_, {x, ctx.bf16}, {y, ctx.bf16});
  }
  void backward(const LayerContext& ctx, const float* x, const float*, const float* dy, float* dx) override {
    if (dx) kernels::gelu_backward(ctx.stream, ctx.in.numel(), form_, {x, ctx.bf16}, {dy, ctx.bf16}, {dx, ctx.bf16});
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Gelu>(*this); }

 private:
  kernels::GeluForm form_;
};

// The attention between nanoGPT's CausalSelfAttention's two Linears (dp/kernels/attention.h): qkv
// (N, T, 1, 3C) in, the heads side by side (N, T, 1, C) out, its attn_dropout on the probabilities
// in training. Fused, it keeps each query row's log-sum-exp where the unfused form keeps the (T, T)
// probabilities, and takes autocast's bf16 storage as it is (torch runs scaled_dot_product_attention
// in bf16 there); unfused, it is fp32 inside (the chain widens and rounds around it).
class CausalAttention final : public Layer {
 public:
  CausalAttention(std::string name, int width, int heads, double dropout, bool fused)
      : Layer(std::move(name)), width_(width), heads_(heads), dropout_(dropout), fused_(fused) {}
  ActShape output_shape(const ActShape& in) const override {
    if (in.h != 1 || in.features() != 3 * width_)
      throw InvalidArgument(
          fmt::format("{}: expects (tokens, 1, {}) per sample (q, k, v of {} features), got ({}, "
                      "{}, {})",
                      name(), 3 * width_, width_, in.c, in.h, in.w));
    return ActShape::sequence(in.n, in.positions(), width_);
  }
  // Per sample. Unfused: the scores' and values' 2 * T * T * C (GEMMs over the whole (T, T)
  // matrices). Fused, only the T(T+1)/2 causal pairs, D multiply-adds each per product: 2 forward
  // and 7 backward products (the query pass recomputes the score and dy.v, the key pass both again),
  // counted as a third of the 9 since a step's count is three times the forward's.
  std::int64_t multiply_adds(const ActShape& in) const override {
    const std::int64_t t = in.positions(), c = width_;
    return fused_ ? 3 * t * (t + 1) * c / 2 : 2 * t * t * c;
  }
  bool stochastic() const override { return dropout_ > 0.0; }
  bool native_bf16() const override { return fused_; }
  bool backward_reads_output() const override { return fused_; }  // delta = dy . y
  void forward(const LayerContext& ctx, const float* x, float* y) override {
    const kernels::AttentionShape s = shape(ctx.in);
    if (fused_)
      kernels::attention_fused_forward(ctx.stream, s, {x, ctx.bf16}, {y, ctx.bf16}, saved(ctx),
                                       attn_dropout(ctx, nullptr));
    else
      kernels::attention_forward(ctx.stream, s, x, saved(ctx), y, attn_dropout(ctx, dropped(ctx)));
  }
  void backward(const LayerContext& ctx, const float* x, const float* y, const float* dy, float* dx) override {
    const kernels::AttentionShape s = shape(ctx.in);
    float* scratch = scratch_.get<float>(ctx.device, static_cast<std::size_t>(held(s)));
    if (fused_)
      kernels::attention_fused_backward(ctx.stream, s, {x, ctx.bf16}, {y, ctx.bf16}, saved(ctx), {dy, ctx.bf16},
                                        {dx, ctx.bf16}, scratch, attn_dropout(ctx, nullptr));
    else
      kernels::attention_backward(ctx.stream, s, x, saved(ctx), dy, dx, scratch, attn_dropout(ctx, dropped(ctx)));
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<CausalAttention>(*this); }
  std::size_t saved_bytes() const override { return kept_; }

 private:
  kernels::AttentionShape shape(const ActShape& in) const { return {in.n, in.positions(), heads_, width_ / heads_}; }
  // What the forward keeps for the backward: fused, each query row's log-sum-exp (the backward's
  // delta the same size, in scratch); unfused, the (T, T) probabilities (their gradients in scratch).
  kernels::index_t held(const kernels::AttentionShape& s) const {
    return fused_ ? kernels::attention_fused_rows(s) : s.probs();
  }
  float* saved(const LayerContext& ctx) {
    const auto n = static_cast<std::size_t>(held(shape(ctx.in)));
    const bool dropping = !fused_ && ctx.mode == Mode::train && dropout_ > 0.0;
    kept_ = n * sizeof(float) * (dropping ? 2 : 1);
    return saved_.get<float>(ctx.device, n);
  }
  // Unfused training with dropout: the dropped probabilities, from the forward to the backward.
  float* dropped(const LayerContext& ctx) {
    if (fused_ || ctx.mode != Mode::train || dropout_ == 0.0) return nullptr;
    return dropped_.get<float>(ctx.device, static_cast<std::size_t>(shape(ctx.in).probs()));
  }
  // nanoGPT's attn_dropout, a sibling of this layer in its CausalSelfAttention ("<attn>.attn_dropout"),
  // in training only; drawn over the (B, H, T, T) probabilities in both forms.
  kernels::AttentionDropout attn_dropout(const LayerContext& ctx, float* dropped) const {
    if (ctx.mode != Mode::train || dropout_ == 0.0) return {};
    const auto per_sample = static_cast<std::int64_t>(shape(ctx.in).probs() / ctx.in.n);
    const std::string attn = name().substr(0, name().rfind('.'));
    const auto [key, offset] = detail::dropout_draw(ctx, attn + ".attn_dropout", per_sample);
    return {dropout_, key, static_cast<kernels::index_t>(offset), dropped};
  }

  int width_, heads_;
  double dropout_;
  bool fused_;
  Scratch saved_, scratch_, dropped_;
  std::size_t kept_ = 0;
};

// nanoGPT's token and position embeddings, transformer.wte (vocab, C) and transformer.wpe (context, C):
// y[b, t] = wte[id] + wpe[t] for the token ids of (N, T, 1, 1). Under a
// tied head (LanguageModel) the table's gradient already holds the head's part: its own is added.
class TokenEmbedding final : public Layer {
 public:
  TokenEmbedding(std::string name, int vocab, int context, int width)
      : Layer(std::move(name)), vocab_(vocab), context_(context), width_(width) {
    if (vocab < 1 || context < 1 || width < 1)
      throw InvalidArgument(
          fmt::format("{}: embeddings of {} tokens, {} positions, {} features", this->name(), vocab, context, width));
    params_.push_back({"wte.weight", DType::f32, {vocab, width}, Init::normal, 0});
    params_.push_back({"wpe.weight", DType::f32, {context, width}, Init::normal, 0});
  }
  ActShape output_shape(const ActShape& in) const override {
    if (in.h != 1 || in.features() != 1 || in.positions() < 1 || in.positions() > context_)
      throw InvalidArgument(fmt::format("{}: expects 1 to {} token ids per sample, got ({}, {}, {})", name(), context_,
                                        in.c, in.h, in.w));
    return ActShape::sequence(in.n, in.positions(), width_);
  }
  DType input_dtype() const override { return DType::i32; }
  void forward(const LayerContext&, const float*, float*) override {
    throw InvalidArgument(fmt::format("{}: reads token ids, not activations", name()));
  }
  void forward_ids(const LayerContext& ctx, const std::int32_t* ids, float* y) override {
    const auto rows = static_cast<kernels::index_t>(ctx.in.n) * ctx.in.positions();
    kernels::embedding_forward(ctx.stream, rows, vocab_, width_, ids, param(0), y);
    kernels::add_positions(ctx.stream, ctx.in.n, ctx.in.positions(), width_, param(1), y);
    ids_ = ids;
  }
  bool backward_reads_input() const override { return false; }
  // The ids have no gradient. The backward reads the forward's ids where they are: a model's input
  // stays until its backward (Model::forward).
  void backward(const LayerContext& ctx, const float*, const float*, const float* dy, float*) override {
    const auto rows = static_cast<kernels::index_t>(ctx.in.n) * ctx.in.positions();
    const std::int32_t* ids = ids_;
    std::int32_t* order = order_.get<std::int32_t>(ctx.device, static_cast<std::size_t>(rows + vocab_ + 1));
    kernels::embedding_backward(ctx.stream, rows, vocab_, width_, ids, dy, grad(0), order, order + rows,
                                tied_ || ctx.accumulate_grads);
    // wpe: rows [0, T) sum over the batch; a shorter sequence leaves the rest, written 0 if writing.
    const kernels::index_t used = static_cast<kernels::index_t>(ctx.in.positions()) * width_;
    kernels::column_sum(ctx.stream, ctx.in.n, used, dy, grad(1), ctx.accumulate_grads ? 1.0f : 0.0f);
    if (!ctx.accumulate_grads && ctx.in.positions() < context_)
      kernels::fill(ctx.stream, grad(1) + used, static_cast<kernels::index_t>(context_) * width_ - used, 0.0f);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<TokenEmbedding>(*this); }

  int vocab() const { return vocab_; }
  const float* table() const { return param(0); }
  float* table_grad() const { return grad(0); }
  // Whether the table's gradient was written by a tied head in this backward.
  void set_tied(bool tied) { tied_ = tied; }

 private:
  int vocab_, context_, width_;
  bool tied_ = false;
  const std::int32_t* ids_ = nullptr;  // the last forward's ids
  Scratch order_;                      // the backward's sort: order (rows), then offsets (vocab + 1)
};

// nanoGPT's GPT around its body: TokenEmbedding "transformer", the body (blocks transformer.h.*, then
// transformer.ln_f), and lm_head tied to wte: logits (N, T, 1, vocab) = x wte^T (no bias); its
// gradient dlogits^T x is written (or added) to wte's first, the embedding's own added after it,
// and the embedding reports the table ready last. Unnamed: its children keep their names. Under
// autocast the head autocasts as nanoGPT's lm_head Linear does: bf16 operands (ln_f's output and the
// table rounded), bf16 logits and their gradient, the table's gradient rounded to bf16.
class LanguageModel final : public detail::Container {
 public:
  LanguageModel(int vocab, int context, int width, Layers body, int classes)
      : detail::Container(""),
        chain_(with_embedding(vocab, context, width, std::move(body))),
        width_(width),
        classes_(classes > 0 ? classes : vocab) {
    if (classes_ > vocab)
      throw InvalidArgument(fmt::format("a language model of {} table rows cannot give {} logits", vocab, classes_));
    chain_.set_reader_rounds(true);  // the head, under autocast
    adopt_children();
  }
  LanguageModel(const LanguageModel&) = default;
  ActShape output_shape(const ActShape& in) const override {
    const ActShape h = chain_.output_shape(in);
    if (h.features() != width_ || h.h != 1)
      throw InvalidArgument(fmt::format("the language model's body gives ({}, {}, {}) per sample, not (T, 1, {})", h.c,
                                        h.h, h.w, width_));
    return ActShape::sequence(h.n, h.positions(), classes_);
  }
  std::int64_t multiply_adds(const ActShape& in) const override {
    return detail::Container::multiply_adds(in) + static_cast<std::int64_t>(in.positions()) * width_ * classes_;
  }
  std::int64_t first_layer_skipped_multiply_adds(const ActShape&) const override { return 0; }
  std::vector<std::pair<std::string, std::string>> aliases() const override {
    return {{"lm_head.weight", "transformer.wte.weight"}};
  }
  // Under autocast the head is a Linear as torch's lm_head is: bf16 logits.
  bool output_bf16(bool) const override { return true; }
  DType input_dtype() const override { return DType::i32; }
  void forward(const LayerContext&, const float*, float*) override {
    throw InvalidArgument("a language model reads token ids, not activations");
  }
  void forward_ids(const LayerContext& ctx, const std::int32_t* ids, float* y) override {
    hidden_ = static_cast<const float*>(chain_.forward(ctx, ids, nullptr));
    const int rows = ctx.in.n * ctx.in.positions(), vocab = classes_;
    if (!ctx.amp) {
      kernels::gemm(ctx.stream, false, true, rows, vocab, width_, 1.0f, hidden_, width_, embedding().table(), width_,
                    0.0f, y, vocab);
      return;
    }
    // ln_f writes the bf16 its reader rounds to (the chain's reader_rounds); a body that ends
    // otherwise in fp32 is cast here, once for both passes. The table is cast once a forward too.
    if (!chain_.output_bf16(false)) {
      const auto n = static_cast<kernels::index_t>(rows) * width_;
      auto* cast = hidden_cast_.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(n));
      kernels::to_bf16(ctx.stream, n, hidden_, cast);
      hidden_ = reinterpret_cast<const float*>(cast);
    }
    const auto table = static_cast<kernels::index_t>(classes_) * width_;
    auto* bits = cast_.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(table));
    kernels::to_bf16(ctx.stream, table, embedding().table(), bits);
    kernels::gemm(ctx.stream, false, true, rows, vocab, width_, 1.0f, kernels::In(hidden_, true), width_, bits, width_,
                  0.0f, kernels::Out(y, true), vocab);
  }
  void backward_reporting(const LayerContext& ctx, const float*, const float*, const float* dy, float*,
                          const std::function<void(Layer&)>& done) override {
    TokenEmbedding& table = embedding();
    const int rows = ctx.in.n * ctx.in.positions(), vocab = classes_;
    const auto n_hidden = static_cast<std::size_t>(rows) * width_;
    void* dhidden = nullptr;
    if (!ctx.amp) {
      dhidden = dhidden_.get<float>(ctx.device, n_hidden);
      kernels::gemm(ctx.stream, false, false, rows, width_, vocab, 1.0f, dy, vocab, table.table(), width_, 0.0f,
                    static_cast<float*>(dhidden), width_);
      kernels::gemm(ctx.stream, true, false, vocab, width_, rows, 1.0f, dy, vocab, hidden_, width_,
                    ctx.accumulate_grads ? 1.0f : 0.0f, table.table_grad(), width_);
    } else {
      // bf16 dlogits and operands; the table's gradient written as bf16 (rounded once) and widened
      // into the fp32 buffer, as a Linear's under autocast.
      const auto n_table = static_cast<kernels::index_t>(classes_) * width_;
      const auto* bits = cast_.get<std::uint16_t>(ctx.device, static_cast<std::size_t>(n_table));
      const kernels::In dlogits(dy, true), hidden(hidden_, true);
      // In the body's output dtype: bf16 from ln_f, else the fp32 gradient of the cast.
      const bool hidden16 = chain_.output_bf16(false);
      dhidden = hidden16 ? static_cast<void*>(dhidden_.get<std::uint16_t>(ctx.device, n_hidden))
                         : dhidden_.get<float>(ctx.device, n_hidden);
      kernels::gemm(ctx.stream, false, false, rows, width_, vocab, 1.0f, dlogits, vocab, bits, width_, 0.0f,
                    kernels::Out(dhidden, hidden16), width_);
      auto* computed = ctx.amp->get<std::uint16_t>(ctx.amp->grad16, ctx.device, n_table);
      kernels::gemm(ctx.stream, true, false, vocab, width_, rows, 1.0f, dlogits, vocab, hidden, width_, 0.0f,
                    kernels::Out(computed), width_);
      kernels::add_bf16_rounded(ctx.stream, n_table, computed, table.table_grad(), ctx.accumulate_grads);
    }
    // The padded rows have no logit: a written gradient is 0 there (the embedding adds nothing to them).
    if (!ctx.accumulate_grads && classes_ < table.vocab())
      kernels::fill(ctx.stream, table.table_grad() + static_cast<std::size_t>(classes_) * width_,
                    static_cast<kernels::index_t>(table.vocab() - classes_) * width_, 0.0f);
    table.set_tied(true);
    chain_.backward(ctx, dhidden, nullptr, done);
    table.set_tied(false);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<LanguageModel>(*this); }

 private:
  static Layers with_embedding(int vocab, int context, int width, Layers body) {
    Layers all;
    all.push_back(std::make_unique<TokenEmbedding>("transformer", vocab, context, width));
    for (auto& layer : body) all.push_back(std::move(layer));
    return all;
  }
  std::vector<detail::Chain*> chains() override { return {&chain_}; }
  TokenEmbedding& embedding() const { return static_cast<TokenEmbedding&>(*chain_.layers().front()); }

  detail::Chain chain_;
  int width_;
  int classes_;                    // the logits per position: the table's first rows
  const float* hidden_ = nullptr;  // the last forward's ln_f output (the chain's memory; bf16 under autocast)
  Scratch dhidden_;
  Scratch cast_;         // autocast: the table's first classes_ rows as bf16, from the forward to its backward
  Scratch hidden_cast_;  // autocast: an fp32 body output as bf16
};

}  // namespace

std::unique_ptr<Layer> make_layernorm(std::string name, int width) {
  return std::make_unique<LayerNorm>(std::move(name), width);
}
std::unique_ptr<Layer> make_gelu(std::string name, bool tanh_approximation) {
  return std::make_unique<Gelu>(std::move(name),
                                tanh_approximation ? kernels::GeluForm::tanh : kernels::GeluForm::exact);
}
// nanoGPT's CausalSelfAttention as the Sequential of its parts: c_attn (C -> 3C), the attention,
// c_proj (C -> C), so that under autocast its Linears run in bf16 as torch's do; its state-dict
// names are nanoGPT's (attn.c_attn.weight, ...).
std::unique_ptr<Layer> make_causal_self_attention(std::string name, int width, int heads, double dropout, bool fused) {
  if (width < 1 || heads < 1 || width % heads != 0)
    throw InvalidArgument(fmt::format("{}: {} features do not split into {} heads", name, width, heads));
  if (fused && width / heads > kernels::kAttentionMaxHeadDim)
    throw InvalidArgument(
        fmt::format("{}: the fused attention takes heads of up to {} features, got {} (--attention "
                    "unfused takes any)",
                    name, kernels::kAttentionMaxHeadDim, width / heads));
  if (!(dropout >= 0.0 && dropout <= 1.0))
    throw InvalidArgument(fmt::format("{}: dropout probability has to be between 0 and 1, but got {}", name, dropout));
  Layers parts;
  parts.push_back(make_linear("c_attn", width, 3 * width));
  parts.push_back(std::make_unique<CausalAttention>("attention", width, heads, dropout, fused));
  parts.push_back(make_linear("c_proj", width, width));
  return make_sequential(std::move(name), std::move(parts));
}

std::unique_ptr<Layer> make_language_model(int vocab, int context, int width, Layers body, int classes) {
  return std::make_unique<LanguageModel>(vocab, context, width, std::move(body), classes);
}

}  // namespace dp::nn
