// OptimManager: a global gradient norm equal to the single-process one, loss scaling that skips
// the same steps on every rank when one rank overflows, and exact state round trips.

#include "../zero/zero_model.h"
#include "test_util.h"

namespace ztrain::test {
namespace optim_manager_test {

using optim::OptimManager;

/// A module holding loose tensors: the model of a manager over them.
std::shared_ptr<torch::nn::Module> holding(const std::vector<torch::Tensor>& params) {
  auto m = std::make_shared<torch::nn::Module>();
  for (size_t i = 0; i < params.size(); ++i) m->register_parameter(std::to_string(i), params[i]);
  return m;
}

TEST(OptimManager, GradNormAndClippingEqualTheSingleProcessOnes) {
  ASSERT_EQ(world_size(), expected_world_size());
  ModelConfig c;
  const int dp = runtime().dp().size(), r = runtime().dp().rank();
  auto tokens = batch_tokens(0, 4 * dp, 8, c.vocab);
  torch::manual_seed(2);
  RefModel plain(c);
  lm_loss(plain(tokens), tokens).backward();
  double want_sq = 0;
  for (const auto& p : plain->parameters()) want_sq += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  const double want = std::sqrt(want_sq);

  for (int level : {0, 1, 3}) {
    torch::manual_seed(2);
    ZeroModel model(c, BlockOptions{.zero_level = level}, level == 3 ? 0 : 2);  // mixes sharded and replicated
    torch::optim::SGD opt(model->parameters(), 0.1);
    OptimManager mgr(*model, LossScaler::static_scale(1024));
    mgr.add_optimizer(opt);
    auto local = tokens.slice(0, r * 4, (r + 1) * 4);
    mgr.backward(lm_loss(model(local), local));
    const double got = mgr.clip_grad_norm(want / 2);
    EXPECT_NEAR(got, want, 1e-6 * want) << "level " << level;
    EXPECT_NEAR(mgr.grad_norm(), want / 2, 1e-6 * want) << "clipped, level " << level;
  }
}

/// Scripted overflows on the last rank only: every rank must skip the same steps and follow the
/// same scale.
TEST(OptimManager, OneRankOverflowingSkipsTheStepEverywhere) {
  const int last = world_size() - 1;
  auto w = torch::zeros({5}, torch::requires_grad());
  torch::optim::SGD opt({w}, 1.0);
  auto model = holding({w});
  OptimManager mgr(*model, LossScaler::dynamic({.initial_scale = 8, .growth_factor = 2, .backoff_factor = 0.5,
                                        .growth_interval = 2, .min_scale = 1, .max_scale = 64}));
  mgr.add_optimizer(opt);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const std::vector<double> injected = {0, 0, inf, 0, 0, nan, -inf, 0};
  const std::vector<double> want_scale = {8, 16, 8, 8, 16, 8, 4, 4};  // after each step
  const std::vector<bool> want_applied = {true, true, false, true, true, false, false, true};
  for (size_t i = 0; i < injected.size(); ++i) {
    const auto before = w.detach().clone();
    mgr.backward(w.sum() * 0 + (w * torch::arange(5)).sum());  // grad = scale * [0, 1, 2, 3, 4]
    if (rank() == last && injected[i] != 0) w.mutable_grad()[2] = injected[i];
    EXPECT_EQ(mgr.step(), want_applied[i]) << "step " << i;
    EXPECT_EQ(mgr.loss_scale(), want_scale[i]) << "step " << i;
    EXPECT_EQ(w.grad().defined(), false);
    if (want_applied[i]) {
      EXPECT_TRUE(tensors_equal(w.detach(), before - torch::arange(5).to(torch::kFloat32), 0, 1e-6)) << "step " << i;
    } else {
      EXPECT_TRUE(w.detach().equal(before)) << "step " << i;
    }
  }
  EXPECT_EQ(mgr.steps(), 5);
  EXPECT_EQ(mgr.skipped_steps(), 3);
}

TEST(OptimManager, StateRoundTripsAndSchedulesDriveTheLr) {
  auto w = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD opt({w}, 1.0);
  auto sched = std::make_shared<lr_scheduler::Linear>(LRSchedulerOptions{.peak_lr = 1.0, .warmup_steps = 2, .total_steps = 10});
  auto model = holding({w});
  OptimManager mgr(*model, LossScaler::dynamic({.initial_scale = 4, .growth_interval = 3}));
  mgr.add_optimizer(opt, sched);
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.0);  // warmup from 0
  for (int i = 0; i < 5; ++i) {
    mgr.backward(w.sum());
    mgr.step();
  }
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), sched->lr_at(5));
  const auto state = mgr.state();

  auto w2 = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD opt2({w2}, 0.5);
  auto sched2 = std::make_shared<lr_scheduler::Linear>(LRSchedulerOptions{.peak_lr = 1.0, .warmup_steps = 2, .total_steps = 10});
  auto other_model = holding({w2});
  OptimManager other(*other_model, LossScaler::dynamic({.initial_scale = 4, .growth_interval = 3}));
  other.add_optimizer(opt2, sched2);
  other.load_state(state);
  EXPECT_EQ(other.state(), state);
  EXPECT_EQ(other.loss_scale(), mgr.loss_scale());
  EXPECT_DOUBLE_EQ(opt2.param_groups()[0].options().get_lr(), sched->lr_at(5));

  OptimManager wrong(*other_model);
  EXPECT_NE(error_message([&] { wrong.load_state(state); }).find("optimizers"), std::string::npos);
}

}  // namespace optim_manager_test
}  // namespace ztrain::test
