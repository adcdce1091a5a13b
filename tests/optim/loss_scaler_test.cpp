#include "test_util.h"

#include <ztrain/optim/loss_scaler.h>

#include <cmath>
#include <limits>
#include <random>

namespace loss_scaler_test {

using ztrain::DynamicLossScaleOptions;
using ztrain::LossScaleMode;
using ztrain::LossScaler;
using ztrain::LossScalerState;

namespace {

// One scripted step: 'c' clean gradients, 'i' an inf among them, 'n' a NaN; then whether the step
// must be applied and the scale expected after update().
struct Step {
  char grads;
  bool applied;
  double scale_after;
};

// The overflow check as a training loop does it: any non-finite gradient element.
bool found_overflow(char grads) {
  auto g = torch::tensor({1.0f, -2.0f, 3.0f});
  if (grads == 'i') g[1] = std::numeric_limits<float>::infinity();
  if (grads == 'n') g[2] = std::numeric_limits<float>::quiet_NaN();
  return !torch::isfinite(g).all().item<bool>();
}

void run_script(LossScaler& scaler, const std::vector<Step>& script) {
  for (size_t i = 0; i < script.size(); ++i) {
    const auto& s = script[i];
    EXPECT_EQ(scaler.update(found_overflow(s.grads)), s.applied) << "step " << i << " ('" << s.grads << "')";
    EXPECT_EQ(scaler.scale(), s.scale_after) << "step " << i << " ('" << s.grads << "')";
  }
}

}  // namespace

TEST(LossScaler, DefaultsAreDocumented) {
  auto scaler = LossScaler::dynamic();
  EXPECT_EQ(scaler.mode(), LossScaleMode::kDynamic);
  EXPECT_EQ(scaler.scale(), 65536.0);
  const auto& o = scaler.options();
  EXPECT_EQ(o.growth_factor, 2.0);
  EXPECT_EQ(o.backoff_factor, 0.5);
  EXPECT_EQ(o.growth_interval, 2000);
  EXPECT_EQ(o.min_scale, 1.0);
  EXPECT_EQ(o.max_scale, 16777216.0);
  EXPECT_EQ(o.hysteresis, 1);
  EXPECT_EQ(scaler.state(), (LossScalerState{LossScaleMode::kDynamic, 65536.0, 0, 0}));
}

TEST(LossScaler, DefaultGrowthNeedsTwoThousandCleanSteps) {
  auto scaler = LossScaler::dynamic();
  for (int i = 0; i < 1999; ++i) ASSERT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_TRUE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 131072.0);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
}

TEST(LossScaler, DynamicScriptGrowsBacksOffAndClamps) {
  auto scaler = LossScaler::dynamic(
      {.initial_scale = 8, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3, .min_scale = 1, .max_scale = 32});
  run_script(scaler, {
                         {'c', true, 8},   {'c', true, 8},   {'c', true, 16},  // grows after 3 clean steps
                         {'i', false, 8},                                      // inf: skip, back off
                         {'c', true, 8},   {'c', true, 8},                     //
                         {'n', false, 4},                                      // NaN restarts the count
                         {'c', true, 4},   {'c', true, 4},   {'c', true, 8},   //
                         {'c', true, 8},   {'c', true, 8},   {'c', true, 16},  //
                         {'c', true, 16},  {'c', true, 16},  {'c', true, 32},  //
                         {'c', true, 32},  {'c', true, 32},  {'c', true, 32},  // held at max_scale
                         {'i', false, 16}, {'n', false, 8},  {'i', false, 4},  //
                         {'i', false, 2},  {'n', false, 1},  {'i', false, 1},  // held at min_scale
                         {'c', true, 1},
                     });
}

TEST(LossScaler, ClampsWhenAFactorOvershootsTheBounds) {
  auto scaler = LossScaler::dynamic({.initial_scale = 24, .growth_interval = 1, .min_scale = 3, .max_scale = 32});
  run_script(scaler, {{'c', true, 32}, {'c', true, 32}, {'i', false, 16}, {'i', false, 8}, {'i', false, 4},
                      {'i', false, 3}, {'n', false, 3}, {'c', true, 6}});
}

TEST(LossScaler, HysteresisToleratesConsecutiveOverflows) {
  auto scaler = LossScaler::dynamic({.initial_scale = 64, .growth_interval = 2, .hysteresis = 3});
  EXPECT_EQ(scaler.state().hysteresis_left, 2);
  run_script(scaler, {
                         {'i', false, 64}, {'n', false, 64},  // tolerated: skipped, scale kept
                         {'i', false, 32}, {'i', false, 16},  // the 3rd and 4th in a row back off
                         {'c', true, 16},                     // a clean step refills the allowance
                         {'i', false, 16},                    // tolerated again, and restarts growth
                         {'c', true, 16},  {'i', false, 16},  // still only one in a row: tolerated
                         {'c', true, 16},  {'c', true, 32},   // two clean steps: growth
                     });
  EXPECT_EQ(scaler.state().hysteresis_left, 2);
  scaler.update(true);
  EXPECT_EQ(scaler.state().hysteresis_left, 1);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
}

TEST(LossScaler, StaticKeepsItsScaleAndSkipsOverflows) {
  auto scaler = LossScaler::static_scale(1024);
  EXPECT_EQ(scaler.mode(), LossScaleMode::kStatic);
  std::vector<Step> script;
  for (int i = 0; i < 50; ++i) script.push_back({'c', true, 1024});
  script.insert(script.end(), {{'i', false, 1024}, {'n', false, 1024}, {'c', true, 1024}});
  run_script(scaler, script);
  EXPECT_EQ(scaler.state(), (LossScalerState{LossScaleMode::kStatic, 1024, 0, 0}));
}

TEST(LossScaler, OffHasScaleOneButStillSkipsOverflows) {
  auto scaler = LossScaler::off();
  EXPECT_EQ(scaler.mode(), LossScaleMode::kOff);
  run_script(scaler, {{'c', true, 1}, {'i', false, 1}, {'n', false, 1}, {'c', true, 1}});
}

TEST(LossScaler, SavedStateContinuesIdentically) {
  const DynamicLossScaleOptions o{.initial_scale = 256, .growth_interval = 4, .min_scale = 1, .max_scale = 4096,
                                  .hysteresis = 3};
  auto a = LossScaler::dynamic(o);
  // Leave a part-way growth count and a part-spent hysteresis.
  for (bool overflow : {false, false, false, false, true, true, false, false, true}) a.update(overflow);
  const LossScalerState saved = a.state();
  EXPECT_EQ(saved, (LossScalerState{LossScaleMode::kDynamic, 512, 0, 1}));
  a.update(false);
  a.update(false);
  const LossScalerState mid = a.state();
  EXPECT_EQ(mid, (LossScalerState{LossScaleMode::kDynamic, 512, 2, 2}));

  auto b = LossScaler::dynamic(o);
  ASSERT_NE(b.state(), mid);
  b.load_state(mid);
  EXPECT_EQ(b.state(), mid);
  std::mt19937 rng(7);
  std::bernoulli_distribution overflow(0.2);
  for (int i = 0; i < 500; ++i) {
    const bool f = overflow(rng);
    ASSERT_EQ(a.update(f), b.update(f)) << i;
    ASSERT_EQ(a.state(), b.state()) << i;
  }
}

TEST(LossScaler, LoadingAStateThatDoesNotFitIsAnError) {
  auto dynamic = LossScaler::dynamic({.initial_scale = 16, .growth_interval = 10, .max_scale = 64, .hysteresis = 2});
  auto expect_error = [&](LossScaler& s, LossScalerState state, const std::string& needle) {
    const auto before = s.state();
    auto msg = ztrain::test::error_message([&] { s.load_state(state); });
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
    EXPECT_EQ(s.state(), before);  // unchanged
  };
  expect_error(dynamic, {LossScaleMode::kStatic, 16, 0, 0}, "static loss scaler into a dynamic one");
  expect_error(dynamic, {LossScaleMode::kDynamic, 128, 0, 0}, "saved loss scale 128 is outside");
  expect_error(dynamic, {LossScaleMode::kDynamic, 16, 10, 0}, "saved growth_tracker 10 is outside");
  expect_error(dynamic, {LossScaleMode::kDynamic, 16, 0, 2}, "saved hysteresis_left 2 is outside");
  auto fixed = LossScaler::static_scale(8);
  expect_error(fixed, {LossScaleMode::kStatic, 16, 0, 0}, "saved static loss scale 16 differs");
  auto off = LossScaler::off();
  expect_error(off, {LossScaleMode::kDynamic, 1, 0, 0}, "dynamic loss scaler into a off one");
  off.load_state(LossScaler::off().state());
}

TEST(LossScaler, RejectsBadOptions) {
  auto expect_error = [](DynamicLossScaleOptions o, const std::string& needle) {
    auto msg = ztrain::test::error_message([&] { LossScaler::dynamic(o); });
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  };
  expect_error({.growth_factor = 1}, "growth_factor must be finite and > 1, got 1");
  expect_error({.growth_factor = INFINITY}, "growth_factor must be finite and > 1");
  expect_error({.backoff_factor = 1}, "backoff_factor must be in (0, 1), got 1");
  expect_error({.backoff_factor = 0}, "backoff_factor must be in (0, 1), got 0");
  expect_error({.growth_interval = 0}, "growth_interval must be >= 1, got 0");
  expect_error({.min_scale = 0}, "min_scale must be finite and > 0, got 0");
  expect_error({.min_scale = 4, .max_scale = 2}, "max_scale must be finite and >= min_scale (4), got 2");
  expect_error({.max_scale = INFINITY}, "max_scale must be finite");
  expect_error({.initial_scale = 0.5}, "initial_scale must be in [min_scale, max_scale] = [1, 1.67772e+07], got 0.5");
  expect_error({.initial_scale = 1 << 25}, "initial_scale must be in [min_scale, max_scale]");
  expect_error({.initial_scale = NAN}, "initial_scale must be in");
  expect_error({.hysteresis = 0}, "hysteresis must be >= 1");
  for (double bad : {0.0, -1.0, double(INFINITY), double(NAN)}) {
    auto msg = ztrain::test::error_message([&] { LossScaler::static_scale(bad); });
    EXPECT_NE(msg.find("static loss scale must be finite and > 0"), std::string::npos) << msg;
  }
}

}  // namespace loss_scaler_test
