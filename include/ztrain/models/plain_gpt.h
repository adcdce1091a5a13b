#pragma once
/// PlainGpt: the GPT of models/gpt.h in plain libtorch modules — the same blocks (GptBlock),
/// parameter names and arithmetic, with no ztrain engine inside: the model a Booster plugin
/// takes unchanged, and the single-process reference. Its blocks sit in a LayerList, which
/// FullyShard wraps one by one.
///
///   ztrain::models::PlainGpt model(ztrain::models::GptConfig::preset("small"));
///   booster.boost(*model, optimizer);
///   auto loss = model->loss(tokens);     // tokens [batch, seq + 1]

#include <ztrain/booster/policy.h>
#include <ztrain/models/gpt.h>
#include <ztrain/zero/layer_list.h>

#include <torch/torch.h>

namespace ztrain::models {

struct PlainTransformerImpl : torch::nn::Module {
  explicit PlainTransformerImpl(const GptConfig& c)
      : wte(c.vocab_size, c.d_model), wpe(c.context, c.d_model),
        ln_f(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)) {
    register_module("wte", wte);
    register_module("wpe", wpe);
    for (int64_t i = 0; i < c.n_layer; ++i) h->push_back(GptBlock(c));
    register_module("h", h);
    register_module("ln_f", ln_f);
  }
  torch::nn::Embedding wte, wpe;
  LayerList<GptBlock> h;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(PlainTransformer);

struct PlainGptImpl : torch::nn::Module {
  explicit PlainGptImpl(const GptConfig& c) : config(c), transformer(c) {
    register_module("transformer", transformer);
    to(c.dtype);
  }
  /// Logits [batch, seq, vocab] for tokens [batch, seq]; the head is the token embedding.
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embed(tokens);
    for (auto& block : *transformer->h) x = block(x);
    return head(x);
  }
  /// Mean next-token cross-entropy over tokens [batch, seq + 1].
  torch::Tensor loss(const torch::Tensor& tokens) { return next_token_loss(forward(tokens.slice(1, 0, -1)), tokens); }
  /// The pieces of forward (also a pipeline stage's ends): token plus position embedding of
  /// tokens [batch, seq]; the final LayerNorm and the head (the token embedding) on hidden states.
  torch::Tensor embed(const torch::Tensor& tokens) {
    auto& tr = *transformer;
    return tr.wte(tokens) + tr.wpe(torch::arange(tokens.size(1), tokens.options()));
  }
  torch::Tensor head(const torch::Tensor& x) {
    auto& tr = *transformer;
    return torch::matmul(tr.ln_f(x), tr.wte->weight.t());
  }
  /// Mean cross-entropy of logits [batch, seq, vocab] predicting tokens[:, 1:] of [batch, seq + 1].
  static torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32),
                                                tokens.slice(1, 1).reshape(-1));
  }
  GptConfig config;
  PlainTransformer transformer;
};
TORCH_MODULE(PlainGpt);

/// HybridParallel's policy for PlainGpt. Its blocks are made of ztrain::tp layers, which split
/// at construction over the default context's tp group (build the model after
/// init_distributed({.tp_size = t}) and give HybridParallel the same tp_size), so the policy
/// names no layer; the embeddings and the tied head stay replicated. Pipeline stages share out
/// transformer.h; the first holds the position embedding, the last the final LayerNorm, and
/// both the token embedding, which the head reuses (a tied module: the two copies step alike).
/// A micro-batch is {tokens [batch, seq + 1]}, as loss() takes.
inline Policy plain_gpt_policy() {
  auto gpt = [](torch::nn::Module& m) -> PlainGptImpl& { return dynamic_cast<PlainGptImpl&>(m); };
  auto check = [gpt](torch::nn::Module& m, const TensorList& mb) {
    const auto& c = gpt(m).config;
    ZTRAIN_CHECK(mb.size() == 1 && mb[0].defined() && mb[0].dim() == 2 && mb[0].size(1) >= 2,
                 "GPT pipeline: a micro-batch must be {tokens [batch, seq + 1]} with seq >= 1, got ",
                 mb.size() == 1 && mb[0].defined() ? c10::str(mb[0].sizes()) : c10::str(mb.size(), " tensors"));
    ZTRAIN_CHECK(!c10::isFloatingType(mb[0].scalar_type()), "GPT pipeline: tokens must be integer, got ",
                 mb[0].scalar_type());
    ZTRAIN_CHECK(mb[0].size(1) - 1 <= c.context, "GPT: sequence length ", mb[0].size(1) - 1, " exceeds the context ",
                 c.context);
  };
  PipelinePolicy pipeline{
      .layers = "transformer.h",
      .first_stage = {"transformer.wpe"},
      .last_stage = {"transformer.ln_f"},
      .tied = {"transformer.wte"},
      .embed = [gpt](torch::nn::Module& m, const TensorList& mb) -> TensorList {
        return {gpt(m).embed(mb.at(0).slice(1, 0, -1))};
      },
      .layer = [gpt](torch::nn::Module& m, int64_t i, const TensorList& x) -> TensorList {
        return {(*gpt(m).transformer->h)[static_cast<size_t>(i)](x.at(0))};
      },
      .loss = [gpt](torch::nn::Module& m, const TensorList& x, const TensorList& mb) {
        return PlainGptImpl::next_token_loss(gpt(m).head(x.at(0)), mb.at(0));
      },
      .check = check};
  return {.name = "gpt2", .pipeline = std::move(pipeline)};
}

}  // namespace ztrain::models
