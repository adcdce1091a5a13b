#include <ztrain/optim/lr_scheduler.h>

#include <ztrain/error.h>

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <numbers>

// How it works: lr_at() clamps the step to total_steps (so the final value is held), answers the
// warmup itself, and hands every later step to the schedule's decay_lr(). Each decay_lr() is a
// closed form of the step, never a recurrence, so lr_at(s) is the same whether reached by s
// calls of step() or by load_state() — which is what makes resuming exact. Degenerate lengths
// (T = W, D = 0) are answered before any division by them.

namespace ztrain {

LRScheduler::LRScheduler(LRSchedulerOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  ZTRAIN_CHECK(std::isfinite(o.peak_lr) && o.peak_lr > 0, "peak_lr must be finite and > 0, got ", o.peak_lr);
  ZTRAIN_CHECK(o.warmup_steps >= 0, "warmup_steps must be >= 0, got ", o.warmup_steps);
  ZTRAIN_CHECK(o.warmup_start_lr >= 0 && o.warmup_start_lr <= o.peak_lr,
               "warmup_start_lr must be in [0, peak_lr = ", o.peak_lr, "], got ", o.warmup_start_lr);
  ZTRAIN_CHECK(o.min_lr >= 0 && o.min_lr <= o.peak_lr, "min_lr must be in [0, peak_lr = ", o.peak_lr, "], got ",
               o.min_lr);
  if (o.total_steps) {
    ZTRAIN_CHECK(*o.total_steps >= o.warmup_steps, "total_steps (", *o.total_steps,
                 ") must be >= warmup_steps (", o.warmup_steps, ")");
  }
}

int64_t LRScheduler::required_total_steps() const {
  ZTRAIN_CHECK(options_.total_steps.has_value(), "the ", kind(),
               " schedule needs total_steps (the step at which its decay ends); set it in the options");
  return *options_.total_steps;
}

double LRScheduler::lr_at(int64_t step) const {
  ZTRAIN_CHECK(step >= 0, "lr_at: step must be >= 0, got ", step);
  const auto& o = options_;
  if (o.total_steps) step = std::min(step, *o.total_steps);
  if (step < o.warmup_steps) {
    return o.warmup_start_lr +
           (o.peak_lr - o.warmup_start_lr) * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  }
  return decay_lr(step);
}

void LRScheduler::load_state(const LRSchedulerState& state) {
  ZTRAIN_CHECK(state.kind == kind(), "cannot load the state of a '", state.kind, "' lr schedule into a '", kind(),
               "' schedule; restore it into the same kind of schedule it was saved from");
  ZTRAIN_CHECK(state.step >= 0, "lr schedule state holds a negative step ", state.step);
  step_ = state.step;
}

void LRScheduler::apply(torch::optim::Optimizer& optimizer) const {
  const double lr = current_lr();
  try {
    for (auto& group : optimizer.param_groups()) {
      if (group.has_options()) group.options().set_lr(lr);
    }
    optimizer.defaults().set_lr(lr);
  } catch (const c10::Error& e) {
    throw Error(c10::str("cannot set the learning rate of this optimizer: its options do not implement "
                         "OptimizerOptions::set_lr (libtorch: ",
                         e.what_without_backtrace(), "); use Adam, AdamW, SGD, RMSprop, Adagrad or LBFGS options, "
                         "or override set_lr/get_lr in your own"));
  }
}

namespace lr_scheduler {
namespace {

// `remaining` of the way from `low` to `high`: high at 1, low at 0.
double linear_between(double high, double low, double remaining) { return low + (high - low) * remaining; }
// Half a cosine from `high` at progress 0 to `low` at progress 1.
double cosine_between(double high, double low, double progress) {
  return low + (high - low) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
}

}  // namespace

NoDecay::NoDecay(LRSchedulerOptions options) : LRScheduler(std::move(options)) {
  ZTRAIN_CHECK(options_.min_lr == 0, "min_lr has no effect on a no_decay schedule (it never decays); leave it 0, got ",
               options_.min_lr);
}

double NoDecay::decay_lr(int64_t) const { return options_.peak_lr; }

Linear::Linear(LRSchedulerOptions options) : LRScheduler(std::move(options)) { required_total_steps(); }

double Linear::decay_lr(int64_t s) const {
  const int64_t w = options_.warmup_steps, t = *options_.total_steps;
  if (s >= t) return options_.min_lr;
  return linear_between(options_.peak_lr, options_.min_lr, static_cast<double>(t - s) / static_cast<double>(t - w));
}

Cosine::Cosine(LRSchedulerOptions options) : LRScheduler(std::move(options)) { required_total_steps(); }

double Cosine::decay_lr(int64_t s) const {
  const int64_t w = options_.warmup_steps, t = *options_.total_steps;
  if (s >= t) return options_.min_lr;
  return cosine_between(options_.peak_lr, options_.min_lr, static_cast<double>(s - w) / static_cast<double>(t - w));
}

Exponential::Exponential(LRSchedulerOptions options, double gamma) : LRScheduler(std::move(options)), gamma_(gamma) {
  ZTRAIN_CHECK(gamma > 0 && gamma <= 1, "exponential schedule: gamma must be in (0, 1], got ", gamma);
}

double Exponential::decay_lr(int64_t s) const {
  const double lr = options_.peak_lr * std::pow(gamma_, static_cast<double>(s - options_.warmup_steps));
  return std::max(options_.min_lr, lr);
}

Noam::Noam(LRSchedulerOptions options) : LRScheduler(std::move(options)) {}

double Noam::decay_lr(int64_t s) const {
  const auto w = static_cast<double>(std::max<int64_t>(options_.warmup_steps, 1));
  const auto x = static_cast<double>(std::max<int64_t>(s, 1));
  return std::max(options_.min_lr, options_.peak_lr * std::sqrt(w / x));
}

WarmupStableDecay::WarmupStableDecay(LRSchedulerOptions options, int64_t decay_steps, DecayShape shape)
    : LRScheduler(std::move(options)), decay_steps_(decay_steps), shape_(shape) {
  const int64_t t = required_total_steps();
  ZTRAIN_CHECK(decay_steps >= 0, "warmup_stable_decay: decay_steps must be >= 0, got ", decay_steps);
  ZTRAIN_CHECK(options_.warmup_steps + decay_steps <= t, "warmup_stable_decay: warmup_steps (", options_.warmup_steps,
               ") + decay_steps (", decay_steps, ") must not exceed total_steps (", t, ")");
  ZTRAIN_CHECK(shape == DecayShape::kLinear || shape == DecayShape::kCosine,
               "warmup_stable_decay: unknown decay shape ", static_cast<int>(shape));
}

double WarmupStableDecay::decay_lr(int64_t s) const {
  const int64_t t = *options_.total_steps, decay_start = t - decay_steps_;
  if (s < decay_start) return options_.peak_lr;
  if (s >= t) return options_.min_lr;
  const auto d = static_cast<double>(decay_steps_);
  return shape_ == DecayShape::kLinear
             ? linear_between(options_.peak_lr, options_.min_lr, static_cast<double>(t - s) / d)
             : cosine_between(options_.peak_lr, options_.min_lr, static_cast<double>(s - decay_start) / d);
}

}  // namespace lr_scheduler
}  // namespace ztrain
