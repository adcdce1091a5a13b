#pragma once
// A small GPT-like model for the ZeRO tests, built twice from the same seed: once from plain
// libtorch modules (the single-process reference) and once with ztrain's DistributedParameter
// and BlockList. The token embedding is tied to the output head, so the reference and the
// sharded model both use one weight twice.

#include <ztrain/ztrain.h>

#include <torch/torch.h>

namespace ztrain::test {

struct LayerImpl : torch::nn::Module {
  LayerImpl(int64_t d, double dropout = 0.0)
      : ln1(torch::nn::LayerNormOptions({d})), ln2(torch::nn::LayerNormOptions({d})), qkv(d, 3 * d), proj(d, d),
        fc(d, 4 * d), out(4 * d, d), drop(dropout) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc", fc);
    register_module("out", out);
    register_module("drop", drop);
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto t = x.size(1), d = x.size(2);
    auto qkv_out = qkv(ln1(x)).chunk(3, -1);
    auto scores = torch::matmul(qkv_out[0], qkv_out[1].transpose(1, 2)) / std::sqrt(static_cast<double>(d));
    auto mask = torch::ones({t, t}, x.options().dtype(torch::kBool)).triu(1);
    auto att = torch::softmax(scores.masked_fill(mask, -1e9), -1);
    x = x + drop(proj(torch::matmul(att, qkv_out[2])));
    return x + drop(out(torch::gelu(fc(ln2(x)), "tanh")));
  }
  torch::nn::LayerNorm ln1, ln2;
  torch::nn::Linear qkv, proj, fc, out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Layer);

struct ModelConfig {
  int64_t vocab = 32;
  int64_t dim = 16;
  int64_t layers = 3;
  double dropout = 0.0;
};

inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
  const auto v = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.slice(1, 0, -1).reshape({-1, v}),
                                              tokens.slice(1, 1).reshape(-1));
}

/// The single-process reference.
struct RefModelImpl : torch::nn::Module {
  explicit RefModelImpl(const ModelConfig& c) : wte(c.vocab, c.dim) {
    register_module("wte", wte);
    for (int64_t i = 0; i < c.layers; ++i) layers->push_back(Layer(c.dim, c.dropout));
    register_module("layers", layers);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = wte(tokens);
    for (auto& layer : *layers) x = layer->as<LayerImpl>()->forward(x);
    return torch::matmul(x, wte->weight.t());
  }
  torch::nn::Embedding wte;
  torch::nn::ModuleList layers;
};
TORCH_MODULE(RefModel);

/// The same model with ztrain: the embedding sharded as a DistributedParameter, the layers in a
/// BlockList. Built from the same generator draws as RefModel.
struct ZeroModelImpl : torch::nn::Module {
  ZeroModelImpl(const ModelConfig& c, BlockOptions options, int embedding_level)
      : wte(torch::nn::Embedding(c.vocab, c.dim)->weight.detach(), {.zero_level = embedding_level, .context = options.context}),
        layers(c.layers, [&](int64_t) { return Layer(c.dim, c.dropout); }, options) {
    register_module("wte", wte);
    register_module("layers", layers);
  }
  torch::Tensor forward(const torch::Tensor& tokens, bool as_one = true) {
    auto w = wte();
    auto x = torch::embedding(w, tokens);
    if (as_one) {
      x = layers(x);
    } else {
      for (auto& block : *layers) x = block(x);
    }
    return torch::matmul(x, w.t());
  }
  DistributedParameter wte;
  BlockList<Layer> layers;
};
TORCH_MODULE(ZeroModel);

/// Batch `step` of `batch` sequences of `seq` tokens, the same on every rank.
inline torch::Tensor batch_tokens(int64_t step, int64_t batch, int64_t seq, int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  return torch::randint(vocab, {batch, seq}, gen, torch::kLong);
}

}  // namespace ztrain::test
