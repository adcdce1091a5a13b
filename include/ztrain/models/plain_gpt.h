#pragma once
/// PlainGpt: the GPT of models/gpt.h in plain libtorch modules — the same blocks (GptBlock),
/// parameter names and arithmetic, with no ztrain engine inside: the model a Booster plugin
/// takes unchanged, and the single-process reference. Its blocks sit in a LayerList, which
/// FullyShard wraps one by one; its token embedding is the ztrain::nn drop-in, which
/// HybridParallel's policy splits by vocabulary.
///
///   ztrain::models::PlainGpt model(ztrain::models::GptConfig::preset("small"));
///   booster.boost(*model, optimizer);
///   auto loss = model->loss(tokens);     // tokens [batch, seq + 1]

#include <ztrain/booster/policy.h>
#include <ztrain/comm/functional.h>
#include <ztrain/models/gpt.h>
#include <ztrain/tp/nn.h>
#include <ztrain/zero/layer_list.h>

#include <torch/torch.h>

namespace ztrain::models {

struct PlainTransformerImpl : torch::nn::Module {
  explicit PlainTransformerImpl(const GptConfig& c)
      : wte(c.vocab_size, c.d_model), wpe(c.context, c.d_model),
        h(static_cast<size_t>(c.n_layer), [&c](size_t) { return GptBlock(c); }),  // a stage's only, in build()
        ln_f(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)) {
    register_module("wte", wte);
    register_module("wpe", wpe);
    register_module("h", h);
    register_module("ln_f", ln_f);
  }
  nn::Embedding wte;
  torch::nn::Embedding wpe;
  LayerList<GptBlock> h;
  GptLayerNorm ln_f;
};
TORCH_MODULE(PlainTransformer);

struct PlainGptImpl : torch::nn::Module {
  explicit PlainGptImpl(const GptConfig& c) : config(c), transformer(c) {
    register_module("transformer", transformer);
    to(c.dtype);
  }
  /// Logits [batch, seq, vocab] for tokens [batch, seq]; the head is the token embedding.
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto logits = head(blocks(embed(tokens)));
    auto* tp = vocab_group();
    return tp ? functional::gather_from_group(logits, *tp, -1).narrow(-1, 0, config.vocab_size) : logits;
  }
  /// Mean next-token cross-entropy over tokens [batch, seq + 1].
  torch::Tensor loss(const torch::Tensor& tokens) { return head_loss(blocks(embed(tokens.slice(1, 0, -1))), tokens); }
  /// The pieces of forward (also a pipeline stage's ends): token plus position embedding of
  /// tokens [batch, seq]; the blocks; the final LayerNorm and the head (the token embedding),
  /// this rank's part of the vocabulary where the embedding is split; the head and the mean
  /// next-token loss over tokens [batch, seq + 1].
  torch::Tensor embed(const torch::Tensor& tokens) {
    auto& tr = *transformer;
    return tr.wte(tokens) + tr.wpe(torch::arange(tokens.size(1), tokens.options()));
  }
  torch::Tensor blocks(torch::Tensor x) {
    for (auto& block : *transformer->h) x = block(x);
    return x;
  }
  torch::Tensor head(const torch::Tensor& x) {
    auto& tr = *transformer;
    return tied_head_logits(tr.ln_f(x), tr.wte->weight, config.vocab_size, vocab_group());
  }
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& tokens) {
    return next_token_loss(head(x), tokens, vocab_group());
  }
  /// The tp group the token embedding is split over by vocabulary, else null.
  Communicator* vocab_group() const { return transformer->wte->vocab_group(); }
  GptConfig config;
  PlainTransformer transformer;
};
TORCH_MODULE(PlainGpt);

/// HybridParallel's policy for PlainGpt. Its blocks are made of ztrain::tp layers, whole when
/// the model is built over a default context of tp size 1: the policy splits each attention's
/// fused q, k, v projection by column (whole heads per rank) and its output projection by row,
/// the MLP's c_fc by column and c_proj by row, and sets the heads per rank. (Built after
/// init_distributed({.tp_size = t}) the blocks split at construction over the default context's
/// tp group, and a plugin over that group finds them split.) The token embedding splits by
/// vocabulary (padded to a multiple of tp; files hold the unpadded one), and with it the tied
/// head, whose loss then never gathers the logits; the position embedding stays whole.
/// Pipeline stages share out transformer.h; the first holds the position embedding, the last
/// the final LayerNorm, and both the token embedding, which the head reuses (a tied module: the
/// two copies step alike). A micro-batch is {tokens [batch, seq + 1]}, as loss() takes.
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
        return gpt(m).head_loss(x.at(0), mb.at(0));
      },
      .check = check};
  using nn::TpRole;
  auto adapt = [gpt](torch::nn::Module& m, int tp) {
    const auto heads = gpt(m).config.n_head;
    ZTRAIN_CHECK(heads % tp == 0, "GPT-2 policy: ", heads, " attention heads do not split over ", tp,
                 " tensor-parallel ranks");
    for (const auto& module : m.modules()) {
      if (auto* attn = dynamic_cast<GptAttentionImpl*>(module.get())) attn->n_head = heads / tp;
    }
  };
  return {.name = "gpt2",
          .tensor_parallel = {{"transformer.wte", {.role = TpRole::kVocab}},
                              {"transformer.h.*.attn.c_attn", {.role = TpRole::kColumn, .fused_parts = 3}},
                              {"transformer.h.*.attn.c_proj", {.role = TpRole::kRow}},
                              {"transformer.h.*.mlp.c_fc", {.role = TpRole::kColumn}},
                              {"transformer.h.*.mlp.c_proj", {.role = TpRole::kRow}}},
          .pipeline = std::move(pipeline),
          .adapt = adapt};
}

}  // namespace ztrain::models
