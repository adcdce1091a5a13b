#include <ztrain/optim/loss_scaler.h>

#include <ztrain/error.h>

#include <algorithm>
#include <cmath>

// How it works (dynamic mode): two counters drive the scale. growth_tracker counts clean steps
// since the last growth or overflow; reaching growth_interval grows the scale and restarts it.
// hysteresis_left counts the overflows that may still be tolerated; a clean step refills it to
// hysteresis − 1, a tolerated overflow spends one, and at 0 an overflow backs off. Both counters
// and the scale are the state, so a resumed run makes the same decisions.

namespace ztrain {
namespace {

const char* mode_name(LossScaleMode mode) {
  switch (mode) {
    case LossScaleMode::kDynamic: return "dynamic";
    case LossScaleMode::kStatic: return "static";
    case LossScaleMode::kOff: return "off";
  }
  return "unknown";
}

}  // namespace

LossScaler::LossScaler(LossScaleMode mode, double scale, DynamicLossScaleOptions options)
    : mode_(mode), options_(options), scale_(scale) {
  if (mode_ != LossScaleMode::kDynamic) return;
  const auto& o = options_;
  ZTRAIN_CHECK(std::isfinite(o.min_scale) && o.min_scale > 0, "min_scale must be finite and > 0, got ", o.min_scale);
  ZTRAIN_CHECK(std::isfinite(o.max_scale) && o.max_scale >= o.min_scale, "max_scale must be finite and >= min_scale (",
               o.min_scale, "), got ", o.max_scale);
  ZTRAIN_CHECK(o.initial_scale >= o.min_scale && o.initial_scale <= o.max_scale, "initial_scale must be in [min_scale, ",
               "max_scale] = [", o.min_scale, ", ", o.max_scale, "], got ", o.initial_scale);
  ZTRAIN_CHECK(std::isfinite(o.growth_factor) && o.growth_factor > 1, "growth_factor must be finite and > 1, got ",
               o.growth_factor);
  ZTRAIN_CHECK(o.backoff_factor > 0 && o.backoff_factor < 1, "backoff_factor must be in (0, 1), got ",
               o.backoff_factor);
  ZTRAIN_CHECK(o.growth_interval >= 1, "growth_interval must be >= 1, got ", o.growth_interval);
  ZTRAIN_CHECK(o.hysteresis >= 1, "hysteresis must be >= 1 (1: back off on every overflow), got ", o.hysteresis);
  hysteresis_left_ = o.hysteresis - 1;
}

LossScaler LossScaler::dynamic(DynamicLossScaleOptions options) {
  return LossScaler(LossScaleMode::kDynamic, options.initial_scale, options);
}

LossScaler LossScaler::static_scale(double scale) {
  ZTRAIN_CHECK(std::isfinite(scale) && scale > 0, "a static loss scale must be finite and > 0, got ", scale);
  return LossScaler(LossScaleMode::kStatic, scale, {});
}

LossScaler LossScaler::off() { return LossScaler(LossScaleMode::kOff, 1.0, {}); }

bool LossScaler::update(bool found_overflow) {
  if (mode_ != LossScaleMode::kDynamic) return !found_overflow;
  if (!found_overflow) {
    hysteresis_left_ = options_.hysteresis - 1;
    if (++growth_tracker_ == options_.growth_interval) {
      scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
      growth_tracker_ = 0;
    }
    return true;
  }
  growth_tracker_ = 0;
  if (hysteresis_left_ > 0) {
    --hysteresis_left_;
  } else {
    scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
  }
  return false;
}

void LossScaler::load_state(const LossScalerState& state) {
  ZTRAIN_CHECK(state.mode == mode_, "cannot load the state of a ", mode_name(state.mode), " loss scaler into a ",
               mode_name(mode_), " one; resume with the loss scaling mode the checkpoint was saved with");
  if (mode_ != LossScaleMode::kDynamic) {
    ZTRAIN_CHECK(state.scale == scale_, "the saved ", mode_name(mode_), " loss scale ", state.scale,
                 " differs from this scaler's ", scale_, "; resume with the scale the checkpoint was saved with");
    return;
  }
  const auto& o = options_;
  ZTRAIN_CHECK(state.scale >= o.min_scale && state.scale <= o.max_scale, "the saved loss scale ", state.scale,
               " is outside this scaler's [min_scale, max_scale] = [", o.min_scale, ", ", o.max_scale,
               "]; resume with the options the checkpoint was saved with");
  ZTRAIN_CHECK(state.growth_tracker >= 0 && state.growth_tracker < o.growth_interval, "the saved growth_tracker ",
               state.growth_tracker, " is outside [0, growth_interval = ", o.growth_interval,
               "); resume with the options the checkpoint was saved with");
  ZTRAIN_CHECK(state.hysteresis_left >= 0 && state.hysteresis_left < o.hysteresis, "the saved hysteresis_left ",
               state.hysteresis_left, " is outside [0, hysteresis - 1 = ", o.hysteresis - 1,
               "]; resume with the options the checkpoint was saved with");
  scale_ = state.scale;
  growth_tracker_ = state.growth_tracker;
  hysteresis_left_ = state.hysteresis_left;
}

}  // namespace ztrain
