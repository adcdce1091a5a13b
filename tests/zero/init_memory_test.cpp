// init_parameters gives the same weights at every world size; memory accounting follows the
// ZeRO levels.

#include "test_util.h"
#include "zero_model.h"

#include <ztrain/optim/adam.h>

namespace ztrain::test {
namespace init_memory_test {

TEST(InitParameters, ShardedWeightsEqualThePlainModelBitForBit) {
  ASSERT_EQ(world_size(), expected_world_size());
  ModelConfig c;
  RefModel plain(c);
  init_parameters(*plain, {.seed = 5});
  for (int level : {1, 3}) {
    ZeroModel model(c, BlockOptions{.zero_level = level}, level == 1 ? 0 : 2);
    init_parameters(*model, {.seed = 5});
    const auto got = gathered_parameters(*model);
    const auto want = plain->named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, want[i].key());
      EXPECT_TRUE(got[i].second.equal(want[i].value())) << got[i].first << " at level " << level;
    }
  }
  // The default rule: weights N(0, 0.02), biases zero, norm scales one.
  EXPECT_NEAR(plain->layers[0]->as<LayerImpl>()->fc->weight.std().item<double>(), 0.02, 0.004);
  EXPECT_EQ(plain->layers[0]->as<LayerImpl>()->fc->bias.abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(plain->layers[0]->as<LayerImpl>()->ln1->weight.eq(1).all().item<bool>());
  // Another seed gives other weights.
  RefModel other(c);
  init_parameters(*other, {.seed = 6});
  EXPECT_FALSE(other->wte->weight.equal(plain->wte->weight));
}

TEST(InitParameters, ATrainingStepAfterInitMatchesThePlainModel) {
  ModelConfig c;
  RefModel plain(c);
  init_parameters(*plain, {.seed = 9});
  ZeroModel model(c, BlockOptions{.zero_level = 3, .use_checkpoint = true}, 3);
  init_parameters(*model, {.seed = 9});
  auto tokens = batch_tokens(0, runtime().dp().size(), 6, c.vocab);
  const auto want = lm_loss(plain(tokens), tokens).item<double>();
  auto local = tokens.slice(0, runtime().dp().rank(), runtime().dp().rank() + 1);
  const auto got = sum_loss(lm_loss(model(local), local)).item<double>();
  EXPECT_NEAR(got, want, 1e-5 * want);
}

TEST(MemoryStats, ParameterAndGradientBytesFollowTheLevel) {
  const int n = runtime().dp().size();
  ModelConfig c{.vocab = 32, .dim = 32, .layers = 4};
  std::vector<MemoryStats> by_level;
  int64_t psi = 0;  // model parameters, elements
  for (int level = 0; level <= 3; ++level) {
    ZeroModel model(c, BlockOptions{.zero_level = level, .use_checkpoint = false}, level);
    psi = 0;
    for (const auto& [name, t] : gathered_parameters(*model)) psi += t.numel();
    torch::optim::SGD opt(model->parameters(), 0.1);
    auto tokens = batch_tokens(0, 2, 6, c.vocab);
    lm_loss(model(tokens), tokens).backward();
    opt.step();
    by_level.push_back(memory_stats(*model, &opt));
    EXPECT_EQ(by_level.back().gathered_bytes, 0) << "level " << level;
    EXPECT_GT(by_level.back().peak_rss_bytes, 0);
  }
  const double full = 4.0 * psi;
  auto near = [](double got, double want) { return std::abs(got - want) <= 0.05 * want + 64.0 * 16; };
  // Levels 0 and 1 keep the whole model; 2 and 3 a 1/n shard (padding aside).
  EXPECT_TRUE(near(by_level[0].parameter_bytes, full)) << by_level[0].parameter_bytes << " vs " << full;
  EXPECT_TRUE(near(by_level[1].parameter_bytes, full));
  EXPECT_TRUE(near(by_level[2].parameter_bytes, full / n)) << by_level[2].parameter_bytes << " vs " << full / n;
  EXPECT_TRUE(near(by_level[3].parameter_bytes, full / n));
  // Level 0 keeps full gradients; 1–3 a shard's.
  EXPECT_TRUE(near(by_level[0].gradient_bytes, full));
  for (int level = 1; level <= 3; ++level) EXPECT_TRUE(near(by_level[level].gradient_bytes, full / n)) << level;
}

/// memory_stats' optimizer bytes after one step of `opt` on `model`, and twice the shard bytes
/// (Adam's two moments of fp32 parameters).
std::pair<int64_t, int64_t> adam_bytes_after_a_step(ZeroModel& model, torch::optim::Optimizer& opt) {
  auto tokens = batch_tokens(0, 2, 6, 32);
  lm_loss(model(tokens), tokens).backward();
  opt.step();
  int64_t shard_bytes = 0;
  for (const auto& p : model->parameters()) shard_bytes += p.nbytes();
  return {memory_stats(*model, &opt).optimizer_bytes, 2 * shard_bytes};
}

TEST(MemoryStats, OptimizerStateIsCounted) {
  ZeroModel model(ModelConfig{}, BlockOptions{.zero_level = 3}, 3);
  torch::optim::Adam opt(model->parameters(), 0.1);
  const auto [counted, expected] = adam_bytes_after_a_step(model, opt);
  EXPECT_EQ(counted, expected);
}

TEST(MemoryStats, ZtrainAdamStateIsCounted) {
  // ztrain's AdamW keeps its state outside torch's state(): two moments (and an fp32 master
  // for low-precision parameters, none here).
  ZeroModel model(ModelConfig{}, BlockOptions{.zero_level = 3}, 3);
  optim::AdamW opt(model->parameters(), optim::AdamOptions(0.1));
  const auto [counted, expected] = adam_bytes_after_a_step(model, opt);
  EXPECT_EQ(counted, expected);
}

}  // namespace init_memory_test
}  // namespace ztrain::test
