#pragma once
/// Learning-rate schedules with linear warmup.
///
/// A schedule is a pure function of the optimizer step, lr_at(step); the scheduler also keeps a
/// step counter (step(), current_lr()) and writes the current lr into a torch optimizer
/// (apply()). The counter is the whole state: state()/load_state() resume a run exactly.
/// No communication: every rank holds its own scheduler and computes the same values.
///
/// Notation: s = step (0-based: the lr for the first optimizer step is lr_at(0)),
/// P = peak_lr, S = warmup_start_lr, W = warmup_steps, T = total_steps, m = min_lr.
///
/// Every schedule:
///   warmup, s < W:        lr = S + (P − S)·s/W       (step 0 gives S; P is reached at s = W)
///   after the end, s > T: lr = lr(T)                (when T is set: the final value is held)
/// and from s = W on it follows its decay, documented with each class below. With W = 0 there
/// is no warmup and the decay starts at step 0.
///
///   namespace sched = ztrain::lr_scheduler;
///   sched::Cosine lr({.peak_lr = 3e-4, .warmup_steps = 100, .total_steps = 10000, .min_lr = 3e-5});
///   for (int64_t i = 0; i < 10000; ++i) {
///     lr.apply(optimizer);     // the lr of step lr.step_count()
///     ...                      // forward, backward, optimizer.step()
///     lr.step();
///   }
///
/// Not thread-safe: one thread drives a scheduler (const methods may be called concurrently).

#include <cstdint>
#include <optional>
#include <string>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace ztrain {

/// What every schedule shares. Validated by the scheduler's constructor, which throws
/// ztrain::Error naming the bad value.
struct LRSchedulerOptions {
  /// The lr at the end of warmup. Required: must be finite and > 0.
  double peak_lr = 0;
  /// Steps of linear warmup from warmup_start_lr to peak_lr; >= 0.
  int64_t warmup_steps = 0;
  /// The lr at step 0 when warmup_steps > 0; 0 <= warmup_start_lr <= peak_lr.
  double warmup_start_lr = 0;
  /// The step at which the decay ends; the lr is held after it. Required by Linear, Cosine and
  /// WarmupStableDecay; optional for Exponential and Noam (unset: they decay for ever); not
  /// needed by NoDecay. When set, total_steps >= warmup_steps.
  std::optional<int64_t> total_steps;
  /// The lr the decay ends at (Linear, Cosine, WarmupStableDecay) or is floored at
  /// (Exponential, Noam); 0 <= min_lr <= peak_lr. Must stay 0 for NoDecay, which has no decay.
  double min_lr = 0;
};

/// What a checkpoint stores: the schedule's kind, checked on load, and its step counter.
struct LRSchedulerState {
  std::string kind;
  int64_t step = 0;
  bool operator==(const LRSchedulerState&) const = default;
};

/// Base of the schedules in ztrain::lr_scheduler.
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;

  /// The lr of optimizer step `step` (>= 0; throws ztrain::Error otherwise). Pure: depends on
  /// the options and `step` only.
  double lr_at(int64_t step) const;

  /// Steps taken so far: the number of step() calls since construction or the loaded state.
  int64_t step_count() const { return step_; }
  /// lr_at(step_count()).
  double current_lr() const { return lr_at(step_); }
  /// Advances to the next step. Does not touch any optimizer; call apply() for that.
  void step() { ++step_; }

  /// The name of the schedule: "no_decay", "linear", "cosine", "exponential", "noam" or
  /// "warmup_stable_decay".
  virtual std::string kind() const = 0;
  const LRSchedulerOptions& options() const { return options_; }

  LRSchedulerState state() const { return {kind(), step_}; }
  /// Restores the step counter. Throws ztrain::Error when `state` comes from another kind of
  /// schedule or holds a negative step. The options are not part of the state: a resumed run
  /// may change them (e.g. extend total_steps).
  void load_state(const LRSchedulerState& state);

  /// Sets the lr of every parameter group of `optimizer` (and of its defaults, used by groups
  /// added later) to current_lr(), overwriting any per-group lr. Works with every libtorch
  /// optimizer whose options implement set_lr (Adam, AdamW, SGD, RMSprop, Adagrad, LBFGS);
  /// throws ztrain::Error for options that do not.
  void apply(torch::optim::Optimizer& optimizer) const;

 protected:
  explicit LRScheduler(LRSchedulerOptions options);

  /// The lr for step s >= warmup_steps (s <= total_steps when that is set).
  virtual double decay_lr(int64_t s) const = 0;
  /// options_.total_steps, or a ztrain::Error saying that this schedule needs it.
  int64_t required_total_steps() const;

  LRSchedulerOptions options_;

 private:
  int64_t step_ = 0;
};

namespace lr_scheduler {

/// Warmup, then P for ever:  lr = P.  min_lr must be 0.
class NoDecay : public LRScheduler {
 public:
  explicit NoDecay(LRSchedulerOptions options);
  std::string kind() const override { return "no_decay"; }

 protected:
  double decay_lr(int64_t s) const override;
};

/// Warmup, then a straight line from P at W to m at T:  lr = m + (P − m)·(T − s)/(T − W).
/// Requires total_steps. Equivalent to torch.optim.lr_scheduler.LinearLR(1, m/P, T − W).
class Linear : public LRScheduler {
 public:
  explicit Linear(LRSchedulerOptions options);
  std::string kind() const override { return "linear"; }

 protected:
  double decay_lr(int64_t s) const override;
};

/// Warmup, then half a cosine from P at W to m at T:
///   lr = m + (P − m)·(1 + cos(π·(s − W)/(T − W)))/2.
/// Requires total_steps. Equivalent to torch.optim.lr_scheduler.CosineAnnealingLR(T − W, m).
class Cosine : public LRScheduler {
 public:
  explicit Cosine(LRSchedulerOptions options);
  std::string kind() const override { return "cosine"; }

 protected:
  double decay_lr(int64_t s) const override;
};

/// Warmup, then a factor `gamma` per step:  lr = max(m, P·gamma^(s − W)),  0 < gamma <= 1.
/// Equivalent to torch.optim.lr_scheduler.ExponentialLR(gamma) when m = 0.
class Exponential : public LRScheduler {
 public:
  Exponential(LRSchedulerOptions options, double gamma);
  std::string kind() const override { return "exponential"; }
  double gamma() const { return gamma_; }

 protected:
  double decay_lr(int64_t s) const override;

 private:
  double gamma_;
};

/// Warmup, then inverse square root ("Attention is all you need"):
///   lr = max(m, P·sqrt(max(W, 1)/max(s, 1))).
/// With S = 0 this is the paper's d^−0.5·min(s^−0.5, s·W^−1.5) for P = (d·W)^−0.5.
/// Step 0: with W > 0 it is in the warmup (lr = S); with W = 0 the max(·, 1) guards give
/// lr(0) = lr(1) = P, then P/sqrt(s): no division by zero, and the first step is not wasted.
class Noam : public LRScheduler {
 public:
  explicit Noam(LRSchedulerOptions options);
  std::string kind() const override { return "noam"; }

 protected:
  double decay_lr(int64_t s) const override;
};

/// The shape of WarmupStableDecay's final decay.
enum class DecayShape { kLinear, kCosine };

/// Warmup-stable-decay ("trapezoidal"): warmup, hold P, then decay to m over the last
/// `decay_steps` steps. With D = decay_steps and p = (s − (T − D))/D:
///   W <= s < T − D:  lr = P
///   T − D <= s <= T: lr = m + (P − m)·(T − s)/D            (DecayShape::kLinear)
///                    lr = m + (P − m)·(1 + cos(π·p))/2      (DecayShape::kCosine)
/// Requires total_steps, decay_steps >= 0 and W + D <= T (D = 0: the lr drops to m at T).
class WarmupStableDecay : public LRScheduler {
 public:
  WarmupStableDecay(LRSchedulerOptions options, int64_t decay_steps, DecayShape shape = DecayShape::kLinear);
  std::string kind() const override { return "warmup_stable_decay"; }
  int64_t decay_steps() const { return decay_steps_; }
  DecayShape shape() const { return shape_; }

 protected:
  double decay_lr(int64_t s) const override;

 private:
  int64_t decay_steps_;
  DecayShape shape_;
};

}  // namespace lr_scheduler
}  // namespace ztrain
