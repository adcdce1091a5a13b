#pragma once
// The parity harness the plugin tests share: two model families — the Llama-style decoder of
// examples/llama/llama.h (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied
// head) and the GPT-2 architecture in plain modules (models::PlainGpt, tied head) — trained for
// 20 clipped steps by one process on the global batch, or by every rank on its data-parallel
// share under a plugin; and the comparison of the two runs (losses and final parameters within
// 1e-4 relative in fp32).

#include "../../examples/llama/llama.h"
#include "test_util.h"

#include <filesystem>
#include <functional>
#include <map>

namespace ztrain::test {

constexpr int64_t kBatch = 2;  // sequences per rank in the global batch
constexpr int64_t kSeq = 16;
constexpr int kSteps = 20;

struct Run {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

/// A model family: how to build it, its loss, its optimizer.
struct Family {
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)> loss;
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&)> optimizer;
  int64_t vocab;
  /// Under HybridParallel, make the model in its build(): each stage makes its own layers only
  /// (build must then give the parameters their values by name).
  bool by_stage = false;
};

inline llama::Config small_llama() {
  return {.vocab = 64, .dim = 32, .layers = 2, .heads = 8, .kv_heads = 4, .hidden = 96, .context = kSeq};
}

inline Family llama_family() {
  const auto c = small_llama();
  return {.build = [c] { return llama::Llama(c).ptr(); },
          .loss = [](torch::nn::Module& m, const torch::Tensor& t) { return dynamic_cast<llama::LlamaImpl&>(m).loss(t); },
          // AdamW with the peers' groups: no weight decay on norms and embeddings.
          .optimizer =
              [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
                const auto options = optim::AdamOptions(3e-3).weight_decay(0.1);
                return std::make_unique<optim::AdamW>(optim::weight_decay_groups(m, options), options);
              },
          .vocab = c.vocab};
}

inline Family gpt2_family(int64_t layers = 2) {
  models::GptConfig c;
  c.vocab_size = 64;
  c.context = kSeq;
  c.d_model = 32;
  c.n_layer = layers;
  c.n_head = 4;
  return {.build = [c] { return models::PlainGpt(c).ptr(); },
          .loss = [](torch::nn::Module& m, const torch::Tensor& t) { return dynamic_cast<models::PlainGptImpl&>(m).loss(t); },
          // SGD with momentum: the attention key bias has a gradient that is zero up to rounding
          // (softmax ignores a shift of a row), which Adam would scale up to full steps.
          .optimizer =
              [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
                return std::make_unique<torch::optim::SGD>(m.parameters(),
                                                           torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
              },
          .vocab = c.vocab_size};
}

/// Step `step`'s global batch, kBatch rows per rank: rows that count up from a random start by
/// a random stride of 1 to 3 (mod vocab), which a model learns to continue within a few steps.
inline torch::Tensor global_batch(int64_t step, int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(2000 + step);
  const int64_t rows = kBatch * runtime().world_size();
  auto start = torch::randint(vocab, {rows, 1}, gen, torch::kLong);
  auto stride = torch::randint(1, 4, {rows, 1}, gen, torch::kLong);
  return (start + stride * torch::arange(kSeq + 1, torch::kLong)).remainder(vocab);
}

/// A family's model and optimizer built from `seed`, boosted under `plugin` unless it is null.
struct Trainee {
  Trainee(const Family& f, uint64_t seed, std::shared_ptr<Plugin> plugin) : family(f) {
    torch::manual_seed(seed);
    auto* hybrid = dynamic_cast<HybridParallel*>(plugin.get());
    model = hybrid && family.by_stage ? hybrid->build(family.build) : family.build();
    opt = family.optimizer(*model);
    if (plugin) {
      booster.emplace(plugin, BoosterOptions{.max_grad_norm = 1.0});
      booster->boost(*model, *opt);
    }
  }
  /// One step on the global batch `tokens` (this rank's share of it when boosted); the global
  /// mean loss.
  double step(torch::Tensor tokens) {
    if (!booster) {
      opt->zero_grad();
      auto loss = family.loss(*model, tokens);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      opt->step();
      return loss.item<double>();
    }
    // Each dp rank its share; the ranks of a tensor-parallel group the same one.
    auto* hybrid = dynamic_cast<HybridParallel*>(&booster->plugin());
    auto& dp = hybrid ? hybrid->context().dp() : runtime().dp();
    const int64_t share = tokens.size(0) / dp.size();
    tokens = tokens.slice(0, dp.rank() * share, (dp.rank() + 1) * share).to(runtime().device());
    booster->zero_grad();
    if (pipelined()) {  // the share in 4 micro-batches (2 where it has fewer rows)
      std::vector<std::vector<torch::Tensor>> micro_batches;
      for (const auto& rows : tokens.chunk(share % 4 == 0 ? 4 : 2, 0)) micro_batches.push_back({rows});
      const double loss = booster->execute_pipeline(micro_batches).item<double>();
      EXPECT_TRUE(booster->step());
      return loss;
    }
    auto loss = family.loss(*model, tokens);
    booster->backward(loss);
    EXPECT_TRUE(booster->step());
    return dp.all_reduce_scalar(loss.item<double>()) / dp.size();
  }
  bool pipelined() {
    auto* hybrid = booster ? dynamic_cast<HybridParallel*>(&booster->plugin()) : nullptr;
    return hybrid && hybrid->options().pp_size > 1;
  }
  /// Every parameter's full value under its name in the plain model (collective: a sharded
  /// model's parameters are gathered).
  std::map<std::string, torch::Tensor> params() {
    std::map<std::string, torch::Tensor> out;
    if (pipelined()) {  // each stage holds its share: read them back from a model file
      const auto dir = shared_temp_dir("stage_params");
      if (runtime().rank() == 0) std::filesystem::create_directories(dir);
      runtime().world().barrier();
      booster->save_model(dir + "/model.safetensors");
      auto whole = family.build();
      load(*whole, dir + "/model.safetensors");
      for (const auto& p : whole->named_parameters()) out[p.key()] = p.value().detach().cpu();
      runtime().world().barrier();
      if (runtime().rank() == 0) std::filesystem::remove_all(dir);
      return out;
    }
    for (const auto& ref : named_parameter_refs(*model)) out[ref.name] = full_parameter(ref).cpu();
    return out;
  }

  const Family& family;
  std::shared_ptr<torch::nn::Module> model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::optional<Booster> booster;
};

/// `plugin` null: one process on the global batch. Otherwise each rank its share, boosted.
inline Run train(const Family& family, std::shared_ptr<Plugin> plugin) {
  // Another seed on every rank: boost() makes the replicas equal to dp rank 0's. (The seed is
  // read before the plugin moves into the call: arguments have no order of evaluation.)
  const uint64_t seed = plugin ? 7 + runtime().rank() : 7;
  Trainee t(family, seed, std::move(plugin));
  Run run;
  for (int step = 0; step < kSteps; ++step) run.losses.push_back(t.step(global_batch(step, family.vocab)));
  run.params = t.params();
  return run;
}

inline void expect_same(const Run& got, const Run& want) {
  // The reference's matrix products run at other shapes than the ranks' (the whole batch in one
  // process), for which cuBLAS, and MKL on AVX-512 CPUs, pick other kernels and summation orders:
  // on an AVX-512 Xeon the Llama's attention weights under DataParallel at 2 ranks ended 20 steps
  // up to 3.7e-5 apart (relative), against under 1e-5 on AVX2 CPUs.
  const double tol = 1e-4;
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], tol * std::abs(want.losses[i])) << "step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, value] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    // Relative to the tensor's norm: Adam turns the last bits of a near-zero gradient element
    // into differences that element-wise bounds would count against its tiny value.
    const auto diff = (got.params.at(name).to(torch::kFloat64) - value.to(torch::kFloat64)).norm().item<double>();
    EXPECT_LE(diff, tol * value.to(torch::kFloat64).norm().item<double>()) << name;
  }
}

}  // namespace ztrain::test
