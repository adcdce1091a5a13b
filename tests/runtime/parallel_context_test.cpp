// Several parallel contexts in one process: the world split into two 2-rank sub-meshes with
// different layouts, each training its own model, while every rank also trains a third model
// on the whole world, step by step in turn — each with the losses and weights of its
// single-process reference, computed in the same process on a context of one rank.

#include "../zero/zero_model.h"
#include "test_util.h"

namespace ztrain::test {
namespace parallel_context_test {

using models::Gpt;
using models::GptConfig;

constexpr int kSteps = 8;
constexpr int64_t kBatch = 4;  // divisible by every dp size below
const GptConfig kGpt{.vocab_size = 64, .context = 16, .d_model = 32, .n_layer = 2, .n_head = 4};
const ModelConfig kSmall{.vocab = 32, .dim = 16, .layers = 2};

/// Step `step`'s rows of a global batch for dp rank `r` of `dp`.
torch::Tensor rows(const torch::Tensor& global, int r, int dp) {
  const int64_t per = global.size(0) / dp;
  return global.slice(0, per * r, per * (r + 1));
}
torch::Tensor gpt_batch(int step) {
  return torch::randint(kGpt.vocab_size, {kBatch, 9}, at::detail::createCPUGenerator(300 + step), torch::kLong);
}
torch::Tensor small_batch(int step) { return batch_tokens(step, kBatch, 8, kSmall.vocab); }

/// One model, its optimizer and manager on one context, stepped on the rows of its dp rank.
template <class Model>
struct Trainer {
  Model model;
  torch::optim::SGD opt;
  optim::OptimManager mgr;
  ParallelContext& ctx;
  std::vector<double> losses;

  Trainer(Model m, ParallelContext& context)
      : model(std::move(m)),
        opt(model->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9)),
        mgr(*model),
        ctx(context) {
    mgr.add_optimizer(opt);
  }
  template <class Loss>
  void step(const torch::Tensor& global, Loss&& loss_of) {
    torch::Tensor loss = loss_of(*model, rows(global, ctx.dp_rank(), ctx.dp().size()));
    mgr.zero_grad();
    mgr.backward(loss);
    mgr.clip_grad_norm(1.0);
    mgr.step();
    losses.push_back(sum_loss(loss, &ctx).item<double>());
  }
};

auto gpt_loss = [](auto& model, const torch::Tensor& tokens) { return model.loss(tokens); };
auto small_loss = [](auto& model, const torch::Tensor& tokens) { return lm_loss(model.forward(tokens), tokens); };

Gpt gpt_on(const std::shared_ptr<ParallelContext>& ctx, int level) {
  Gpt model(kGpt, {.zero_level = level, .context = ctx});
  init_parameters(*model, {.init = models::gpt_init(kGpt)});
  return model;
}

ZeroModel small_on(const std::shared_ptr<ParallelContext>& ctx, int level) {
  torch::manual_seed(7);
  return ZeroModel(kSmall, BlockOptions{.zero_level = level, .use_checkpoint = level == 3, .context = ctx}, level);
}

template <class A, class B>
void expect_same_training(A& got, B& want, const char* what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::abs(want.losses[i])) << what << ", step " << i;
  }
  const auto want_params = gathered_parameters(*want.model), got_params = gathered_parameters(*got.model);
  ASSERT_EQ(got_params.size(), want_params.size()) << what;
  for (size_t i = 0; i < want_params.size(); ++i) {
    EXPECT_TRUE(tensors_equal(got_params[i].second, want_params[i].second, 1e-5, 1e-6)) << what << " " << want_params[i].first;
  }
}

TEST(ParallelContext, SplitsTheWorldIntoMeshesOfTheirOwn) {
  ASSERT_EQ(world_size(), 4) << "launch with mpirun -np 4";
  auto& world = default_context();
  const int half_id = world.rank() / 2;
  auto half = world.split(half_id, {.tp_size = half_id == 0 ? 1 : 2, .seed = 5, .name = c10::str("half", half_id)});
  EXPECT_EQ(half->world_size(), 2);
  EXPECT_EQ(half->rank(), world.rank() % 2);
  EXPECT_EQ(half->world().world_rank_of(0), 2 * half_id);
  EXPECT_EQ(half->dp().size(), half_id == 0 ? 2 : 1);
  EXPECT_EQ(half->tp().size(), half_id == 0 ? 1 : 2);
  EXPECT_EQ(half->dp().name(), c10::str("half", half_id, ".dp"));
  EXPECT_EQ(half->seed(), 5u);
  // The groups connect the ranks they name, and no others.
  auto sum = torch::tensor({static_cast<int64_t>(world.rank())});
  half->world().all_reduce(sum);
  EXPECT_EQ(sum.item<int64_t>(), half_id == 0 ? 0 + 1 : 2 + 3);
  EXPECT_NE(error_message([&] { world.split(0, {.tp_size = 3}); }).find("does not divide"), std::string::npos);
  // A split keeps its parent's device unless it names one; a device is checked before anything
  // collective happens.
  EXPECT_EQ(half->device(), world.device());
  EXPECT_NE(error_message([&] { world.split(0, {.device = c10::Device(c10::kMeta)}); }).find("cpu or cuda"),
            std::string::npos);
}

TEST(ParallelContext, TwoSubMeshesAndTheWorldTrainWithSingleProcessParity) {
  ASSERT_EQ(world_size(), 4) << "launch with mpirun -np 4";
  auto& world = default_context();
  const int half_id = world.rank() / 2;
  // Half 0: data parallel over its two ranks, ZeRO 3 with recomputation. Half 1: tensor
  // parallel over its two ranks, ZeRO 1. The whole world: data parallel over four, ZeRO 2.
  auto half = world.split(half_id, {.tp_size = half_id == 0 ? 1 : 2, .name = c10::str("half", half_id)});
  auto solo = world.split(world.rank(), {.name = "solo"});
  auto everyone = world.shared_from_this();

  Trainer<ZeroModel> on_world(small_on(everyone, 2), world);
  Trainer<ZeroModel> ref_small(small_on(solo, 0), *solo);
  std::optional<Trainer<ZeroModel>> small_half;
  std::optional<Trainer<Gpt>> gpt_half, ref_gpt;
  if (half_id == 0) {
    small_half.emplace(small_on(half, 3), *half);
  } else {
    gpt_half.emplace(gpt_on(half, 1), *half);
    ref_gpt.emplace(gpt_on(solo, 0), *solo);
  }
  for (int step = 0; step < kSteps; ++step) {
    // The three contexts' collectives interleave within each step.
    on_world.step(small_batch(step), small_loss);
    if (small_half) small_half->step(small_batch(step), small_loss);
    if (gpt_half) gpt_half->step(gpt_batch(step), gpt_loss);
    ref_small.step(small_batch(step), small_loss);
    if (ref_gpt) ref_gpt->step(gpt_batch(step), gpt_loss);
  }
  EXPECT_LT(ref_small.losses.back(), ref_small.losses.front());  // it learns
  expect_same_training(on_world, ref_small, "world, dp 4, ZeRO 2");
  if (small_half) expect_same_training(*small_half, ref_small, "half 0, dp 2, ZeRO 3");
  if (gpt_half) expect_same_training(*gpt_half, *ref_gpt, "half 1, tp 2, ZeRO 1");
}

}  // namespace parallel_context_test
}  // namespace ztrain::test
