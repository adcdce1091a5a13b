#include <ztrain/booster/low_level_zero.h>

#include "plugin_util.h"
#include "sharding.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

namespace ztrain {

LowLevelZero::LowLevelZero(LowLevelZeroOptions options) : options_(options) {}

LowLevelZero::~LowLevelZero() = default;

void LowLevelZero::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!shards_, "LowLevelZero: this plugin has boosted a model already; make one plugin per model");
  ZTRAIN_CHECK(options_.stage == 1 || options_.stage == 2, "LowLevelZero: stage must be 1 or 2, got ",
               options_.stage, " (stage 3 shards parameters too: use FullyShard)");
  ZTRAIN_CHECK(options_.bucket_bytes > 0, "LowLevelZero: bucket_bytes must be positive, got ", options_.bucket_bytes);
  detail::check_optimizer_over(model, optimizer, name());
  detail::check_no_state(optimizer, name());
  auto& context = detail::plugin_context(options_.context);
  detail::move_to_device(model, optimizer, context.device(), name());
  detail::check_same_model(model, context.dp(), name());
  detail::broadcast_from_first(model.buffers(), context.dp());

  const auto unit = detail::optimizer_units(optimizer);
  shards_ = std::make_shared<detail::ZeroShards>(
      detail::shared_module(model), ShardGrouping{.unit = unit, .max_group_bytes = options_.bucket_bytes}, name(),
      context.shared_from_this());
  detail::hand_shards(optimizer, {shards_.get()}, unit);
  buckets_ = detail::shard_buckets(context, {shards_.get()}, options_.stage);
}

torch::nn::Module& LowLevelZero::boosted(torch::nn::Module& /*model*/) {
  ZTRAIN_CHECK(shards_, "LowLevelZero: boost() first");
  return *shards_;
}

void LowLevelZero::set_gradient_sync(bool on) {
  ZTRAIN_CHECK(buckets_, "LowLevelZero: no_sync before boost()");
  buckets_->set_sync(on);
}

void LowLevelZero::after_zero_grad() {
  if (buckets_) buckets_->zero();
}

void LowLevelZero::after_update() {
  if (shards_) detail::refresh({shards_.get()});
}

BucketStats LowLevelZero::stats() const { return buckets_ ? buckets_->stats() : BucketStats{}; }

}  // namespace ztrain
