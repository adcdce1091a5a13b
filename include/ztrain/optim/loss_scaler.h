#pragma once
/// Loss scaling for fp16 training: the loss is multiplied by scale() before backward, the
/// gradients are divided by it before the optimizer step, and a step whose gradients hold an
/// inf or a NaN ("overflow") is skipped.
///
/// Three modes:
///   dynamic  the scale adapts: it is multiplied by backoff_factor on an overflow and by
///            growth_factor after growth_interval consecutive clean steps, within
///            [min_scale, max_scale]. Defaults: initial 2^16, growth ×2 every 2000 clean steps,
///            backoff ×0.5, min 1, max 2^24, hysteresis 1.
///   static   a fixed scale; overflowing steps are skipped, the scale never changes.
///   off      scale 1 (no scaling, for fp32/bf16); overflowing steps are still skipped, because
///            applying an inf/NaN gradient would destroy the weights. To apply such a step anyway,
///            do not report the overflow.
///
/// Hysteresis h (dynamic mode, like DeepSpeed's delayed shift with consecutive hysteresis):
/// the first h − 1 overflows in a row are tolerated — the step is skipped but the scale kept —
/// and the h-th and every further consecutive overflow backs off. A clean step restores the
/// allowance to h − 1. h = 1 backs off on every overflow.
///
/// Every overflow, tolerated or not, restarts the count of clean steps towards growth.
///
/// No communication: update() must be given the overflow flag already reduced over every rank
/// that takes part in the step (any rank overflowed → all skip), so that all ranks keep the same
/// scale. Not thread-safe.
///
///   auto scaler = ztrain::LossScaler::dynamic({.initial_scale = 1024, .hysteresis = 2});
///   (loss * scaler.scale()).backward();
///   bool overflow = ...;            // any non-finite gradient on any rank
///   if (scaler.update(overflow)) {
///     ...                           // unscale the gradients by 1/scale used above, step
///   }

#include <cstdint>

namespace ztrain {

enum class LossScaleMode { kDynamic, kStatic, kOff };

/// Options of dynamic loss scaling. Validated by LossScaler::dynamic, which throws
/// ztrain::Error naming the bad value.
struct DynamicLossScaleOptions {
  /// The scale of the first step; min_scale <= initial_scale <= max_scale.
  double initial_scale = 65536.0;  // 2^16
  /// Multiplies the scale after growth_interval clean steps in a row; finite, > 1.
  double growth_factor = 2.0;
  /// Multiplies the scale on an overflow that is not tolerated; in (0, 1).
  double backoff_factor = 0.5;
  /// Clean steps in a row before the scale grows; >= 1.
  int64_t growth_interval = 2000;
  /// Bounds the scale is clamped to; finite, 0 < min_scale <= max_scale.
  double min_scale = 1.0;
  double max_scale = 16777216.0;  // 2^24
  /// Consecutive overflows that back off only at the h-th; >= 1 (1: every overflow).
  int64_t hysteresis = 1;
};

/// Everything update() changes, so that a resumed run scales exactly as the original would.
struct LossScalerState {
  LossScaleMode mode = LossScaleMode::kDynamic;
  double scale = 1.0;
  /// Clean steps since the last growth or overflow (dynamic; 0 otherwise).
  int64_t growth_tracker = 0;
  /// Overflows in a row still tolerated before a back-off (dynamic; 0 otherwise).
  int64_t hysteresis_left = 0;
  bool operator==(const LossScalerState&) const = default;
};

class LossScaler {
 public:
  /// A dynamic scaler; throws ztrain::Error on invalid options.
  static LossScaler dynamic(DynamicLossScaleOptions options = {});
  /// A static scaler with the fixed `scale` (finite, > 0); throws ztrain::Error otherwise.
  static LossScaler static_scale(double scale);
  /// No scaling: scale() is 1; overflowing steps are still skipped.
  static LossScaler off();

  /// Call once per optimizer step, after the overflow check, with the flag reduced over all
  /// ranks. Returns true when the step should be applied (no overflow), false when it must be
  /// skipped; in dynamic mode it also updates the scale for the next step.
  bool update(bool found_overflow);

  /// The scale to multiply the next loss by.
  double scale() const { return scale_; }
  LossScaleMode mode() const { return mode_; }
  /// The dynamic options (the defaults for static and off scalers, where they are unused).
  const DynamicLossScaleOptions& options() const { return options_; }

  LossScalerState state() const { return {mode_, scale_, growth_tracker_, hysteresis_left_}; }
  /// Restores a state saved by a scaler of the same mode (and, for static, the same scale).
  /// Throws ztrain::Error when it does not fit this scaler: another mode, a scale outside
  /// [min_scale, max_scale], a growth_tracker outside [0, growth_interval) or hysteresis_left
  /// outside [0, hysteresis − 1] — resume with the options the state was saved under.
  void load_state(const LossScalerState& state);

 private:
  LossScaler(LossScaleMode mode, double scale, DynamicLossScaleOptions options);

  LossScaleMode mode_;
  DynamicLossScaleOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_left_ = 0;
};

}  // namespace ztrain
