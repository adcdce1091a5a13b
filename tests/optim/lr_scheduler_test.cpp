#include "test_util.h"

#include <ztrain/optim/lr_scheduler.h>

#include <cmath>
#include <functional>
#include <memory>
#include <numbers>

namespace lr_scheduler_test {

using ztrain::LRScheduler;
using ztrain::LRSchedulerOptions;
using ztrain::LRSchedulerState;
namespace sched = ztrain::lr_scheduler;

namespace {

constexpr double kPi = std::numbers::pi;
constexpr double kRtol = 1e-13;  // the closed forms here and in the library differ in rounding only

#define EXPECT_LR(scheduler, step, expected)                                                    \
  EXPECT_NEAR((scheduler).lr_at(step), (expected), kRtol * std::abs(expected) + 1e-300)       \
      << (scheduler).kind() << " at step " << (step)

// One factory per schedule, all with the same common options.
using Factory = std::function<std::unique_ptr<LRScheduler>(LRSchedulerOptions)>;
std::vector<std::pair<std::string, Factory>> all_schedules() {
  return {
      {"no_decay", [](LRSchedulerOptions o) { o.min_lr = 0; return std::make_unique<sched::NoDecay>(o); }},
      {"linear", [](LRSchedulerOptions o) { return std::make_unique<sched::Linear>(o); }},
      {"cosine", [](LRSchedulerOptions o) { return std::make_unique<sched::Cosine>(o); }},
      {"exponential", [](LRSchedulerOptions o) { return std::make_unique<sched::Exponential>(o, 0.9); }},
      {"noam", [](LRSchedulerOptions o) { return std::make_unique<sched::Noam>(o); }},
      {"wsd_linear",
       [](LRSchedulerOptions o) { return std::make_unique<sched::WarmupStableDecay>(o, 3, sched::DecayShape::kLinear); }},
      {"wsd_cosine",
       [](LRSchedulerOptions o) { return std::make_unique<sched::WarmupStableDecay>(o, 3, sched::DecayShape::kCosine); }},
  };
}

}  // namespace

// ---- golden values from PyTorch: .venv/bin/python tests/optim/golden_lr.py ---------------------
// golden_lr.py, torch 2.11.0+cu130 (and 1.13.0a0, the same values): peak_lr 0.001, min_lr 0.0001, warmup_start_lr 0.0001, warmup_steps 5, total_steps 20, gamma 0.9
// kGoldenLinearNoWarmup: steps 0..20
constexpr double kGoldenLinearNoWarmup[] = {
    0.001, 0.000955, 0.00091,
    0.000865, 0.00082, 0.000775,
    0.00073, 0.000685, 0.0006399999999999999,
    0.0005949999999999999, 0.0005499999999999999, 0.0005049999999999999,
    0.00045999999999999996, 0.00041499999999999995, 0.00036999999999999994,
    0.00032499999999999993, 0.00028, 0.000235,
    0.00018999999999999998, 0.000145, 9.999999999999998e-05,
};
// kGoldenCosineNoWarmup: steps 0..20
constexpr double kGoldenCosineNoWarmup[] = {
    0.001, 0.000994459753267812, 0.000977975432332819,
    0.0009509529358847653, 0.0009140576474687262, 0.0008681980515339462,
    0.0008145033635316127, 0.0007542957248827959, 0.0006890576474687263,
    0.0006203955092681039, 0.0005499999999999999, 0.00047960449073189616,
    0.0004109423525312736, 0.0003457042751172039, 0.0002854966364683871,
    0.00023180194846605365, 0.0001859423525312737, 0.0001490470641152345,
    0.00012202456766718092, 0.00010554024673218806, 0.0001,
};
// kGoldenExponentialNoWarmup: steps 0..20
constexpr double kGoldenExponentialNoWarmup[] = {
    0.001, 0.0009000000000000001, 0.0008100000000000001,
    0.000729, 0.0006561000000000001, 0.00059049,
    0.000531441, 0.0004782969, 0.00043046721,
    0.000387420489, 0.0003486784401, 0.00031381059609000004,
    0.00028242953648100003, 0.00025418658283290005, 0.00022876792454961005,
    0.00020589113209464906, 0.00018530201888518417, 0.00016677181699666576,
    0.0001500946352969992, 0.0001350851717672993, 0.00012157665459056936,
};
// kGoldenLinearWarmup: steps 0..20
constexpr double kGoldenLinearWarmup[] = {
    0.0001, 0.00028, 0.00045999999999999996,
    0.0006399999999999999, 0.00082, 0.001,
    0.00094, 0.00088, 0.00082,
    0.00076, 0.0007, 0.0006399999999999999,
    0.00058, 0.0005200000000000001, 0.00046,
    0.0004, 0.00034, 0.00028000000000000003,
    0.00022, 0.00015999999999999999, 9.999999999999999e-05,
};
// kGoldenCosineWarmup: steps 0..20
constexpr double kGoldenCosineWarmup[] = {
    0.0001, 0.00028, 0.00045999999999999996,
    0.0006399999999999999, 0.00082, 0.001,
    0.0009901664203302125, 0.0009610954559391702, 0.0009140576474687262,
    0.0008511087728614861, 0.000775, 0.0006890576474687264,
    0.0005970378084704442, 0.000502962191529556, 0.00041094235253127373,
    0.0003250000000000001, 0.00024889122713851394, 0.00018594235253127368,
    0.00013890454406082956, 0.00010983357966978745, 0.0001,
};
// kGoldenExponentialWarmup: steps 0..20
constexpr double kGoldenExponentialWarmup[] = {
    0.0001, 0.00028, 0.00045999999999999996,
    0.0006399999999999999, 0.00082, 0.001,
    0.0009000000000000001, 0.0008100000000000001, 0.000729,
    0.0006561000000000001, 0.00059049, 0.000531441,
    0.0004782969, 0.00043046721, 0.000387420489,
    0.0003486784401, 0.00031381059609000004, 0.00028242953648100003,
    0.00025418658283290005, 0.00022876792454961005, 0.00020589113209464906,
};

namespace {

// The options golden_lr.py uses.
LRSchedulerOptions golden_options(int64_t warmup_steps) {
  return {.peak_lr = 1e-3, .warmup_steps = warmup_steps, .warmup_start_lr = 1e-4, .total_steps = 20, .min_lr = 1e-4};
}

void expect_golden(const LRScheduler& s, const double (&golden)[21]) {
  for (int64_t i = 0; i < 21; ++i) {
    EXPECT_NEAR(s.lr_at(i), golden[i], 1e-14 * golden[i]) << s.kind() << " at step " << i;
  }
}

}  // namespace

TEST(LRSchedulerGolden, LinearMatchesPyTorch) {
  expect_golden(sched::Linear(golden_options(0)), kGoldenLinearNoWarmup);
  expect_golden(sched::Linear(golden_options(5)), kGoldenLinearWarmup);
}

TEST(LRSchedulerGolden, CosineMatchesPyTorch) {
  expect_golden(sched::Cosine(golden_options(0)), kGoldenCosineNoWarmup);
  expect_golden(sched::Cosine(golden_options(5)), kGoldenCosineWarmup);
}

TEST(LRSchedulerGolden, ExponentialMatchesPyTorch) {
  // PyTorch's ExponentialLR has no floor: min_lr 0 here.
  auto o = golden_options(0);
  o.min_lr = 0;
  expect_golden(sched::Exponential(o, 0.9), kGoldenExponentialNoWarmup);
  o.warmup_steps = 5;
  expect_golden(sched::Exponential(o, 0.9), kGoldenExponentialWarmup);
}

// ---- formulas, computed independently ------------------------------------------------------------

TEST(LRScheduler, EveryScheduleWarmsUpLinearlyFromTheStartToThePeak) {
  for (double start : {0.0, 2e-4}) {
    for (auto& [name, make] : all_schedules()) {
      auto s = make({.peak_lr = 1e-3, .warmup_steps = 4, .warmup_start_lr = start, .total_steps = 12, .min_lr = 1e-5});
      EXPECT_EQ(s->lr_at(0), start) << name;
      for (int64_t i = 1; i < 4; ++i) EXPECT_LR(*s, i, start + (1e-3 - start) * i / 4.0);
      EXPECT_LR(*s, 4, 1e-3);  // peak at the end of warmup
    }
  }
}

TEST(LRScheduler, NoDecayHoldsThePeak) {
  sched::NoDecay s({.peak_lr = 0.5, .warmup_steps = 2});
  EXPECT_EQ(s.lr_at(1), 0.25);
  for (int64_t i : std::initializer_list<int64_t>{2, 3, 1000, int64_t{1} << 40}) EXPECT_EQ(s.lr_at(i), 0.5);
}

TEST(LRScheduler, LinearFollowsItsFormula) {
  const double p = 3e-4, m = 3e-5;
  const int64_t w = 10, t = 110;
  sched::Linear s({.peak_lr = p, .warmup_steps = w, .total_steps = t, .min_lr = m});
  for (int64_t i : {10, 11, 35, 60, 99, 109, 110}) EXPECT_LR(s, i, m + (p - m) * double(t - i) / double(t - w));
  EXPECT_LR(s, 60, (p + m) / 2);  // half way
  for (int64_t i : {110, 111, 5000}) EXPECT_EQ(s.lr_at(i), m);
}

TEST(LRScheduler, CosineFollowsItsFormula) {
  const double p = 3e-4, m = 3e-5;
  const int64_t w = 10, t = 110;
  sched::Cosine s({.peak_lr = p, .warmup_steps = w, .total_steps = t, .min_lr = m});
  for (int64_t i : {10, 11, 35, 60, 85, 109, 110}) {
    EXPECT_LR(s, i, m + (p - m) * 0.5 * (1 + std::cos(kPi * double(i - w) / double(t - w))));
  }
  EXPECT_LR(s, 60, (p + m) / 2);
  EXPECT_LR(s, 35, m + (p - m) * (2 + std::sqrt(2.0)) / 4);  // a quarter of the way: cos(π/4)
  for (int64_t i : {110, 111, 5000}) EXPECT_EQ(s.lr_at(i), m);
}

TEST(LRScheduler, ExponentialFollowsItsFormulaAndStopsAtTheFloor) {
  const double p = 1.0, g = 0.5;
  sched::Exponential s({.peak_lr = p, .warmup_steps = 3, .min_lr = 1.0 / 64}, g);
  for (int64_t k = 0; k <= 6; ++k) EXPECT_EQ(s.lr_at(3 + k), std::ldexp(1.0, -static_cast<int>(k)));
  EXPECT_EQ(s.lr_at(10), 1.0 / 64);  // 2^-7 is under the floor
  EXPECT_EQ(s.lr_at(100000), 1.0 / 64);
  sched::Exponential ended({.peak_lr = 0.1, .total_steps = 5}, 0.9);
  EXPECT_LR(ended, 5, 0.1 * std::pow(0.9, 5));
  EXPECT_LR(ended, 50, 0.1 * std::pow(0.9, 5));  // held after total_steps
  sched::Exponential flat({.peak_lr = 0.1}, 1.0);
  EXPECT_EQ(flat.lr_at(1000), 0.1);
}

TEST(LRScheduler, NoamMatchesTheTransformerPaper) {
  // lrate = d^-0.5 · min(s^-0.5, s · W^-1.5) with P = (d·W)^-0.5 and no warmup start.
  const double d = 512;
  const int64_t w = 4000;
  sched::Noam s({.peak_lr = 1 / std::sqrt(d * w), .warmup_steps = w});
  for (int64_t i : {1, 2, 100, 3999, 4000, 4001, 10000, 1000000}) {
    const double x = double(i);
    EXPECT_LR(s, i, std::pow(d, -0.5) * std::min(std::pow(x, -0.5), x * std::pow(double(w), -1.5)));
  }
  EXPECT_EQ(s.lr_at(0), 0.0);
}

TEST(LRScheduler, NoamDecaysAsInverseSquareRootWithFloorAndEnd) {
  sched::Noam s({.peak_lr = 1.0, .warmup_steps = 4, .min_lr = 0.1});
  EXPECT_EQ(s.lr_at(4), 1.0);
  EXPECT_LR(s, 16, 0.5);
  EXPECT_LR(s, 100, 0.2);
  EXPECT_LR(s, 9, 2.0 / 3);
  EXPECT_EQ(s.lr_at(1000), 0.1);  // 2/sqrt(1000) = 0.063 is under the floor
  sched::Noam ended({.peak_lr = 1.0, .warmup_steps = 4, .total_steps = 64});
  EXPECT_LR(ended, 64, 0.25);
  EXPECT_LR(ended, 6400, 0.25);
}

TEST(LRScheduler, NoamWithoutWarmupStartsAtThePeak) {
  sched::Noam s({.peak_lr = 1.0});
  EXPECT_EQ(s.lr_at(0), 1.0);  // defined as lr(1): no division by zero
  EXPECT_EQ(s.lr_at(1), 1.0);
  EXPECT_LR(s, 4, 0.5);
  EXPECT_LR(s, 25, 0.2);
}

TEST(LRScheduler, WarmupStableDecayHoldsThenDecaysAtTheEnd) {
  const double p = 1e-3, m = 1e-4;
  const int64_t w = 2, t = 10, d = 4;  // stable on [2, 6), decay on [6, 10]
  sched::WarmupStableDecay lin({.peak_lr = p, .warmup_steps = w, .total_steps = t, .min_lr = m}, d);
  sched::WarmupStableDecay cos({.peak_lr = p, .warmup_steps = w, .total_steps = t, .min_lr = m}, d,
                               sched::DecayShape::kCosine);
  for (int64_t i = w; i <= t - d; ++i) {
    EXPECT_EQ(lin.lr_at(i), p) << i;
    EXPECT_EQ(cos.lr_at(i), p) << i;
  }
  for (int64_t i = t - d; i <= t; ++i) {
    const double progress = double(i - (t - d)) / double(d);
    EXPECT_LR(lin, i, m + (p - m) * (1 - progress));
    EXPECT_LR(cos, i, m + (p - m) * (1 + std::cos(kPi * progress)) / 2);
  }
  EXPECT_LR(lin, 7, m + (p - m) * 0.75);
  EXPECT_LR(cos, 8, (p + m) / 2);
  for (int64_t i : {10, 11, 1000}) {
    EXPECT_EQ(lin.lr_at(i), m);
    EXPECT_EQ(cos.lr_at(i), m);
  }
  // No decay steps: the peak up to the last step, then min_lr.
  sched::WarmupStableDecay drop({.peak_lr = p, .total_steps = t, .min_lr = m}, 0);
  EXPECT_EQ(drop.lr_at(t - 1), p);
  EXPECT_EQ(drop.lr_at(t), m);
}

TEST(LRScheduler, WithoutWarmupStepZeroIsFiniteAndTheStartOfTheDecay) {
  for (auto& [name, make] : all_schedules()) {
    auto s = make({.peak_lr = 1e-3, .total_steps = 12, .min_lr = 1e-5});
    EXPECT_TRUE(std::isfinite(s->lr_at(0))) << name;
    EXPECT_LR(*s, 0, 1e-3);
  }
  // Degenerate lengths: total_steps == warmup_steps (no decay phase), and zero of everything.
  for (int64_t n : {0, 3}) {
    for (auto& [name, make] : all_schedules()) {
      if (name.starts_with("wsd")) continue;  // needs warmup + 3 decay steps <= total
      auto s = make({.peak_lr = 1e-3, .warmup_steps = n, .total_steps = n, .min_lr = 1e-5});
      for (int64_t i = 0; i < n + 3; ++i) EXPECT_TRUE(std::isfinite(s->lr_at(i))) << name << " at " << i;
    }
  }
}

TEST(LRScheduler, HoldsTheFinalValueAfterTotalSteps) {
  for (auto& [name, make] : all_schedules()) {
    auto s = make({.peak_lr = 1e-3, .warmup_steps = 3, .total_steps = 12, .min_lr = 1e-5});
    for (int64_t i : std::initializer_list<int64_t>{13, 14, 100, int64_t{1} << 50}) EXPECT_EQ(s->lr_at(i), s->lr_at(12)) << name << " at " << i;
  }
}

TEST(LRScheduler, StepAdvancesTheCounter) {
  sched::Cosine s({.peak_lr = 1e-3, .warmup_steps = 3, .total_steps = 12});
  EXPECT_EQ(s.step_count(), 0);
  EXPECT_EQ(s.current_lr(), 0.0);
  for (int i = 0; i < 5; ++i) s.step();
  EXPECT_EQ(s.step_count(), 5);
  EXPECT_EQ(s.current_lr(), s.lr_at(5));
}

TEST(LRScheduler, SavedStateContinuesIdentically) {
  for (auto& [name, make] : all_schedules()) {
    LRSchedulerOptions o{.peak_lr = 1e-3, .warmup_steps = 5, .warmup_start_lr = 1e-5, .total_steps = 30, .min_lr = 1e-5};
    auto a = make(o);
    for (int i = 0; i < 7; ++i) a->step();
    const LRSchedulerState saved = a->state();
    EXPECT_EQ(saved.step, 7);
    EXPECT_EQ(saved.kind, a->kind());
    auto b = make(o);
    b->load_state(saved);
    EXPECT_EQ(b->state(), saved) << name;
    for (int i = 0; i < 30; ++i) {
      EXPECT_EQ(a->current_lr(), b->current_lr()) << name << " after " << i << " more steps";
      a->step();
      b->step();
    }
  }
}

TEST(LRScheduler, LoadingAnotherKindOfStateIsAnError) {
  sched::Cosine cosine({.peak_lr = 1e-3, .total_steps = 10});
  sched::Linear linear({.peak_lr = 1e-3, .total_steps = 10});
  cosine.step();
  auto msg = ztrain::test::error_message([&] { linear.load_state(cosine.state()); });
  EXPECT_NE(msg.find("'cosine' lr schedule into a 'linear'"), std::string::npos) << msg;
  EXPECT_EQ(linear.step_count(), 0);
  msg = ztrain::test::error_message([&] { linear.load_state({"linear", -1}); });
  EXPECT_NE(msg.find("negative step -1"), std::string::npos) << msg;
}

// ---- apply() -------------------------------------------------------------------------------------

TEST(LRScheduler, ApplySetsEveryParamGroupOfAdamW) {
  auto a = torch::zeros({3}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
  torch::optim::AdamW adamw({a}, torch::optim::AdamWOptions(1.0).weight_decay(0.1));
  adamw.add_param_group({{b}, std::make_unique<torch::optim::AdamWOptions>(5.0)});
  sched::Linear s({.peak_lr = 1e-3, .warmup_steps = 2, .total_steps = 10});
  s.step();
  s.apply(adamw);
  ASSERT_EQ(adamw.param_groups().size(), 2u);
  const double weight_decay[] = {0.1, 0.01};  // the group's own, untouched
  for (size_t i = 0; i < 2; ++i) {
    auto& o = static_cast<torch::optim::AdamWOptions&>(adamw.param_groups()[i].options());
    EXPECT_EQ(o.lr(), 5e-4) << "group " << i;
    EXPECT_EQ(o.weight_decay(), weight_decay[i]) << "group " << i;
  }
  EXPECT_EQ(adamw.defaults().get_lr(), 5e-4);
}

TEST(LRScheduler, ApplyChangesTheStepSgdTakes) {
  auto w = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1.0));
  sched::Exponential s({.peak_lr = 0.5}, 0.5);
  for (int i = 0; i < 3; ++i) {
    s.apply(sgd);
    w.mutable_grad() = torch::ones({4});
    sgd.step();
    s.step();
  }
  // w = −(0.5 + 0.25 + 0.125)
  EXPECT_TRUE(ztrain::test::tensors_equal(w.detach(), torch::full({4}, -0.875f)));
  EXPECT_EQ(sgd.param_groups()[0].options().get_lr(), 0.125);
}

TEST(LRScheduler, ApplyWorksWithTheOtherLibtorchOptimizers) {
  auto w = torch::zeros({2}, torch::requires_grad());
  sched::NoDecay s({.peak_lr = 0.25});
  torch::optim::Adam adam({w}, torch::optim::AdamOptions(1.0));
  torch::optim::RMSprop rmsprop({w}, torch::optim::RMSpropOptions(1.0));
  torch::optim::Adagrad adagrad({w}, torch::optim::AdagradOptions(1.0));
  for (torch::optim::Optimizer* opt : std::initializer_list<torch::optim::Optimizer*>{&adam, &rmsprop, &adagrad}) {
    s.apply(*opt);
    EXPECT_EQ(opt->param_groups()[0].options().get_lr(), 0.25);
  }
}

namespace {
// Options that do not implement set_lr, like a third-party optimizer's might.
struct NoLrOptions : torch::optim::OptimizerCloneableOptions<NoLrOptions> {};
struct NoLrOptimizer : torch::optim::Optimizer {
  explicit NoLrOptimizer(std::vector<torch::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<NoLrOptions>()) {}
  torch::Tensor step(LossClosure) override { return {}; }
};
}  // namespace

TEST(LRScheduler, ApplyToOptionsWithoutSetLrIsAClearError) {
  NoLrOptimizer opt({torch::zeros({1}, torch::requires_grad())});
  sched::NoDecay s({.peak_lr = 0.25});
  auto msg = ztrain::test::error_message([&] { s.apply(opt); });
  EXPECT_NE(msg.find("do not implement OptimizerOptions::set_lr"), std::string::npos) << msg;
}

// ---- validation ----------------------------------------------------------------------------------

TEST(LRScheduler, RejectsBadOptions) {
  auto expect_error = [](auto make, const std::string& needle) {
    auto msg = ztrain::test::error_message(make);
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  };
  expect_error([] { sched::NoDecay({}); }, "peak_lr must be finite and > 0, got 0");
  expect_error([] { sched::NoDecay({.peak_lr = -1}); }, "peak_lr must be finite and > 0, got -1");
  expect_error([] { sched::NoDecay({.peak_lr = INFINITY}); }, "peak_lr must be finite");
  expect_error([] { sched::NoDecay({.peak_lr = 1, .warmup_steps = -2}); }, "warmup_steps must be >= 0, got -2");
  expect_error([] { sched::NoDecay({.peak_lr = 1, .warmup_start_lr = 2}); }, "warmup_start_lr must be in [0, peak_lr");
  expect_error([] { sched::Cosine({.peak_lr = 1, .total_steps = 10, .min_lr = 2}); }, "min_lr must be in [0, peak_lr");
  expect_error([] { sched::Cosine({.peak_lr = 1, .warmup_steps = 5, .total_steps = 4}); },
               "total_steps (4) must be >= warmup_steps (5)");
  expect_error([] { sched::Linear({.peak_lr = 1}); }, "the linear schedule needs total_steps");
  expect_error([] { sched::Cosine({.peak_lr = 1}); }, "the cosine schedule needs total_steps");
  expect_error([] { sched::WarmupStableDecay({.peak_lr = 1}, 2); }, "needs total_steps");
  expect_error([] { sched::NoDecay({.peak_lr = 1, .min_lr = 0.1}); }, "min_lr has no effect on a no_decay");
  expect_error([] { sched::Exponential({.peak_lr = 1}, 1.5); }, "gamma must be in (0, 1], got 1.5");
  expect_error([] { sched::Exponential({.peak_lr = 1}, 0); }, "gamma must be in (0, 1], got 0");
  expect_error([] { sched::WarmupStableDecay({.peak_lr = 1, .warmup_steps = 4, .total_steps = 10}, 7); },
               "warmup_steps (4) + decay_steps (7) must not exceed total_steps (10)");
  expect_error([] { sched::WarmupStableDecay({.peak_lr = 1, .total_steps = 10}, -1); },
               "decay_steps must be >= 0, got -1");
  expect_error([] { sched::NoDecay({.peak_lr = 1}).lr_at(-1); }, "step must be >= 0, got -1");
}

}  // namespace lr_scheduler_test
