#pragma once
// A Llama-style decoder in plain libtorch: RMSNorm, rotary position embeddings, causal
// self-attention with grouped-query heads (several query heads share each key and value head,
// as in Llama 2 70B and Llama 3), a SwiGLU feed-forward and an untied output head. The Booster
// trains it unchanged under every plugin (examples/llama/train.cpp); nothing in the model knows
// about ranks. Its ztrain types are drop-ins, identical alone: the layer stack is a
// ztrain::LayerList (for torch::nn::ModuleList), which lets FullyShard shard the layers one by
// one; the linears and the embedding are ztrain::nn's (for torch::nn's), which lets
// HybridParallel split them over tensor-parallel ranks as `policy()` at the end says — the one
// model-specific part; and the attention is ztrain::models::attention (for
// at::scaled_dot_product_attention), fused on the CPU.

#include <ztrain/booster/policy.h>
#include <ztrain/models/fused.h>
#include <ztrain/tp/nn.h>
#include <ztrain/zero/layer_list.h>

#include <torch/torch.h>

#include <optional>
#include <utility>

namespace llama {

struct Config {
  int64_t vocab = 256;    // byte tokens
  int64_t dim = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t kv_heads = 2;   // key and value heads, a divisor of heads
  int64_t hidden = 344;   // SwiGLU width: about 8/3 × dim
  int64_t context = 128;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
};

/// Root-mean-square layer norm (no mean subtraction, no bias).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps) : eps(eps) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// cos and sin of the rotary angles, [context, head_dim / 2] each.
inline std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t context, int64_t head_dim, double theta) {
  auto inv = torch::pow(theta, -torch::arange(0, head_dim, 2, torch::kFloat64) / static_cast<double>(head_dim));
  auto angles = torch::outer(torch::arange(context, torch::kFloat64), inv);
  return {angles.cos().to(torch::kFloat32), angles.sin().to(torch::kFloat32)};
}

/// Rotates pairs (x[2i], x[2i+1]) of the last dimension of x [batch, heads, t, head_dim].
inline torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto t = x.size(2);
  auto pairs = x.unflatten(-1, {-1, 2});
  auto even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
  auto c = cos.slice(0, 0, t).to(x.dtype()), s = sin.slice(0, 0, t).to(x.dtype());
  return torch::stack({even * c - odd * s, even * s + odd * c}, -1).flatten(-2);
}

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const Config& c)
      : heads(c.heads), kv_heads(c.kv_heads), head_dim(c.dim / c.heads),
        wq(torch::nn::LinearOptions(c.dim, c.dim).bias(false)),
        wk(torch::nn::LinearOptions(c.dim, c.kv_heads * head_dim).bias(false)),
        wv(torch::nn::LinearOptions(c.dim, c.kv_heads * head_dim).bias(false)),
        wo(torch::nn::LinearOptions(c.dim, c.dim).bias(false)) {
    register_module("wq", wq);
    register_module("wk", wk);
    register_module("wv", wv);
    register_module("wo", wo);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const auto b = x.size(0), t = x.size(1);
    auto split = [&](const torch::Tensor& y, int64_t n) { return y.view({b, t, n, head_dim}).transpose(1, 2); };
    auto q = rotate(split(wq(x), heads), cos, sin), k = rotate(split(wk(x), kv_heads), cos, sin);
    // softmax(q kᵀ / √head_dim, causal) v, each key and value head serving heads / kv_heads query
    // heads: at::scaled_dot_product_attention, fused on the CPU (models/fused.h)
    auto y = ztrain::models::attention(q, k, split(wv(x), kv_heads), /*dropout_p=*/0.0, /*causal=*/true,
                                       std::nullopt, /*enable_gqa=*/true);
    return wo(y.transpose(1, 2).reshape({b, t, -1}));
  }
  int64_t heads, kv_heads, head_dim;  // heads: on this rank (policy() divides them over tp)
  ztrain::nn::Linear wq, wk, wv, wo;
};
TORCH_MODULE(Attention);

struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(const Config& c)
      : w1(torch::nn::LinearOptions(c.dim, c.hidden).bias(false)),
        w2(torch::nn::LinearOptions(c.hidden, c.dim).bias(false)),
        w3(torch::nn::LinearOptions(c.dim, c.hidden).bias(false)) {
    register_module("w1", w1);
    register_module("w2", w2);
    register_module("w3", w3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }
  ztrain::nn::Linear w1, w2, w3;
};
TORCH_MODULE(FeedForward);

struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const Config& c)
      : attention_norm(c.dim, c.norm_eps), attention(c), ffn_norm(c.dim, c.norm_eps), feed_forward(c) {
    register_module("attention_norm", attention_norm);
    register_module("attention", attention);
    register_module("ffn_norm", ffn_norm);
    register_module("feed_forward", feed_forward);
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
    x = x + attention(attention_norm(x), cos, sin);
    return x + feed_forward(ffn_norm(x));
  }
  RMSNorm attention_norm;
  Attention attention;
  RMSNorm ffn_norm;
  FeedForward feed_forward;
};
TORCH_MODULE(DecoderLayer);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const Config& c)
      : config(c), tok_embeddings(c.vocab, c.dim),
        // Made with its size and a factory: under HybridParallel::build a pipeline stage makes
        // only the layers it holds.
        layers(static_cast<size_t>(c.layers), [&c](size_t) { return DecoderLayer(c); }), norm(c.dim, c.norm_eps),
        output(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)) {
    TORCH_CHECK(c.dim % c.heads == 0 && (c.dim / c.heads) % 2 == 0, "llama: dim / heads must be even");
    TORCH_CHECK(c.kv_heads > 0 && c.heads % c.kv_heads == 0, "llama: ", c.kv_heads,
                " key and value heads do not divide ", c.heads, " heads");
    register_module("tok_embeddings", tok_embeddings);
    register_module("layers", layers);
    register_module("norm", norm);
    register_module("output", output);
    auto [cos, sin] = rotary_tables(c.context, c.dim / c.heads, c.rope_theta);
    rope_cos = register_buffer("rope_cos", cos);
    rope_sin = register_buffer("rope_sin", sin);
    // Llama's initialisation: normal(0, 0.02) for every matrix, ones for the norms.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.value().dim() == 2) p.value().normal_(0.0, 0.02);
    }
  }
  /// Logits [batch, t, vocab] of tokens [batch, t].
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = tok_embeddings(tokens);
    for (auto& layer : *layers) x = layer(x, rope_cos, rope_sin);
    return output(norm(x));
  }
  /// Mean next-token cross-entropy over tokens [batch, t + 1].
  torch::Tensor loss(const torch::Tensor& tokens) { return next_token_loss(forward(tokens.slice(1, 0, -1)), tokens); }
  /// The cross-entropy of logits [batch, t, vocab] predicting tokens[:, 1:].
  static torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), tokens.slice(1, 1).reshape(-1));
  }
  Config config;
  ztrain::nn::Embedding tok_embeddings;
  ztrain::LayerList<DecoderLayer> layers;
  RMSNorm norm;
  ztrain::nn::Linear output;
  torch::Tensor rope_cos, rope_sin;
};
TORCH_MODULE(Llama);

/// How HybridParallel splits the model over tp ranks (Megatron-LM's layout): the vocabulary of
/// the embedding; q, k, v and the SwiGLU's w1 and w3 by output features (whole heads per
/// rank), wo and w2 by input features; the head by vocabulary, its logits gathered for the
/// loss. The norms stay replicated. Over pipeline stages: the decoder layers shared out, the
/// embedding on the first stage, the final norm and the head on the last; a micro-batch is
/// {tokens [batch, t + 1]}, and forward() falls into the three calls below.
inline ztrain::Policy policy() {
  using ztrain::nn::TpRole;
  using ztrain::TensorList;
  const ztrain::nn::TpStyle column{.role = TpRole::kColumn}, row{.role = TpRole::kRow};
  auto llama = [](torch::nn::Module& model) -> LlamaImpl& { return dynamic_cast<LlamaImpl&>(model); };
  return {.name = "llama",
          .tensor_parallel = {{"tok_embeddings", {.role = TpRole::kVocab}},
                              {"layers.*.attention.wq", column},
                              {"layers.*.attention.wk", column},
                              {"layers.*.attention.wv", column},
                              {"layers.*.attention.wo", row},
                              {"layers.*.feed_forward.w1", column},
                              {"layers.*.feed_forward.w3", column},
                              {"layers.*.feed_forward.w2", row},
                              {"output", {.role = TpRole::kColumn, .gather_output = true}}},
          .pipeline = {.layers = "layers",
                       .first_stage = {"tok_embeddings"},
                       .last_stage = {"norm", "output"},
                       .embed = [llama](torch::nn::Module& m, const TensorList& micro_batch) -> TensorList {
                         return {llama(m).tok_embeddings(micro_batch[0].slice(1, 0, -1))};
                       },
                       .layer = [llama](torch::nn::Module& m, int64_t i, const TensorList& x) -> TensorList {
                         auto& model = llama(m);
                         return {(*model.layers)[i](x[0], model.rope_cos, model.rope_sin)};
                       },
                       .loss = [llama](torch::nn::Module& m, const TensorList& x, const TensorList& micro_batch) {
                         auto& model = llama(m);
                         return LlamaImpl::next_token_loss(model.output(model.norm(x[0])), micro_batch[0]);
                       }},
          .adapt =
              [llama](torch::nn::Module& m, int tp) {
                auto& model = llama(m);
                TORCH_CHECK(model.config.kv_heads % tp == 0, "llama: ", model.config.kv_heads,
                            " key and value heads do not split over ", tp, " tensor-parallel ranks");
                for (size_t i = 0; i < model.layers->size(); ++i) {  // the layers made here
                  if (!model.layers->holds(i)) continue;
                  auto& attention = *(*model.layers)[i].module()->attention;
                  attention.heads = model.config.heads / tp;
                  attention.kv_heads = model.config.kv_heads / tp;
                }
              }};
}

}  // namespace llama
