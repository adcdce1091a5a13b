// Weight-decay parameter groups: biases, norm weights and embeddings are left out of weight decay,
// for plain libtorch models and for sharded modules at every ZeRO level (their shards fall in
// the right group), the GPT model included. One step with zero gradients shows what decays: a
// decayed parameter is scaled by 1 − lr·wd, the others keep their values.

#include "../zero/zero_model.h"
#include "test_util.h"

namespace ztrain::test {
namespace param_groups_test {

constexpr double kLr = 0.1, kWd = 0.5;

struct PlainImpl : torch::nn::Module {
  PlainImpl() : emb(10, 8), fc(8, 8), ln(torch::nn::LayerNormOptions({8})) {
    register_module("emb", emb);
    register_module("fc", fc);
    register_module("ln", ln);
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return ln(fc(emb(tokens))); }
  torch::nn::Embedding emb;
  torch::nn::Linear fc;
  torch::nn::LayerNorm ln;
};
TORCH_MODULE(Plain);

/// The documented rule, by name and full shape: linear weights decay; biases, norm weights
/// (one dimension) and embeddings (here: names with "wte", "wpe" or "emb") do not.
bool should_decay(const std::string& name, const torch::Tensor& full) {
  for (const char* e : {"wte", "wpe", "emb"}) {
    if (name.find(e) != std::string::npos) return false;
  }
  return full.dim() >= 2;
}

/// One step of `opt` with zero gradients from `forward`; checks every parameter of `model`
/// against should_decay. Returns how many decayed.
template <class Forward>
int step_and_check(torch::nn::Module& model, torch::optim::Optimizer& opt, Forward forward) {
  const auto before = gathered_parameters(model);
  opt.zero_grad();
  (forward().sum() * 0).backward();
  opt.step();
  const auto after = gathered_parameters(model);
  int decayed = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    const auto& [name, old] = before[i];
    const bool decays = should_decay(name, old);
    decayed += decays;
    EXPECT_TRUE(tensors_equal(after[i].second, decays ? old * (1 - kLr * kWd) : old, 1e-6, 1e-7))
        << name << (decays ? " should decay" : " should keep its value");
  }
  return decayed;
}

TEST(WeightDecayGroups, PlainModelSkipsBiasesNormsAndEmbeddings) {
  Plain model;
  const auto decays = optim::default_weight_decay(*model);
  const auto named = model->named_parameters();
  ASSERT_EQ(decays.size(), named.size());
  for (size_t i = 0; i < decays.size(); ++i) {
    EXPECT_EQ(decays[i], named[i].key() == "fc.weight") << named[i].key();
  }
  auto tokens = torch::arange(6).reshape({2, 3});
  {
    optim::AdamOptions o(kLr);
    o.weight_decay(kWd);
    optim::AdamW opt(optim::weight_decay_groups(*model, o), o);
    ASSERT_EQ(opt.param_groups().size(), 2u);
    EXPECT_EQ(step_and_check(*model, opt, [&] { return model(tokens); }), 1);
  }
  {
    torch::optim::AdamW opt(optim::weight_decay_groups(*model, torch::optim::AdamWOptions(kLr).weight_decay(kWd)),
                            torch::optim::AdamWOptions(kLr).weight_decay(kWd));
    EXPECT_EQ(step_and_check(*model, opt, [&] { return model(tokens); }), 1);
  }
}

/// A tied embedding (a DistributedParameter that does not decay) and sharded layers.
struct ShardedImpl : torch::nn::Module {
  explicit ShardedImpl(int level)
      : wte(torch::randn({16, 8}), {.zero_level = level, .weight_decay = false}),
        layers(2, [](int64_t) { return Layer(8); }, {.zero_level = level, .use_checkpoint = level == 3}) {
    register_module("wte", wte);
    register_module("layers", layers);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto w = wte();
    return torch::matmul(layers(torch::embedding(w, tokens)), w.t());
  }
  DistributedParameter wte;
  BlockList<Layer> layers;
};
TORCH_MODULE(Sharded);

TEST(WeightDecayGroups, ShardsFallInTheRightGroupAtEveryLevel) {
  ASSERT_EQ(world_size(), expected_world_size());
  auto tokens = torch::arange(8).reshape({2, 4});
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE("level " + std::to_string(level));
    torch::manual_seed(4);
    Sharded model(level);
    optim::AdamOptions o(kLr);
    o.weight_decay(kWd);
    optim::AdamW opt(optim::weight_decay_groups(*model, o), o);
    ASSERT_EQ(opt.param_groups().size(), 2u);
    for (const auto& p : opt.param_groups()[0].params()) EXPECT_EQ(p.dim(), 1) << "flat shards";
    // qkv, proj, fc and out weights of two layers.
    EXPECT_EQ(step_and_check(*model, opt, [&] { return model(tokens); }), 8);
  }
}

TEST(WeightDecayGroups, GptDecaysItsLinearWeightsOnly) {
  for (int level : {0, 3}) {
    SCOPED_TRACE("level " + std::to_string(level));
    torch::manual_seed(5);
    models::Gpt model(models::GptConfig{.vocab_size = 32, .context = 16, .d_model = 16, .n_layer = 2, .n_head = 2},
                      {.zero_level = level, .use_checkpoint = false});
    optim::AdamOptions o(kLr);
    o.weight_decay(kWd);
    optim::AdamOffload opt(*model, optim::weight_decay_groups(*model, o), o);
    auto tokens = torch::arange(16).reshape({2, 8});
    // c_attn, c_proj, c_fc and c_proj (mlp) weights of two layers.
    EXPECT_EQ(step_and_check(*model, opt, [&] { return model(tokens); }), 8);
  }
}

}  // namespace param_groups_test
}  // namespace ztrain::test
