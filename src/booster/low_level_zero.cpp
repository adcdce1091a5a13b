#include <ztrain/booster/low_level_zero.h>

#include "gradient_buckets.h"
#include "plugin_util.h"

#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/parameter_record.h>
#include <ztrain/zero/sharded_module.h>

#include <unordered_map>

namespace ztrain {
namespace detail {

/// The model's parameters in flat level-1 groups: full buffers the model computes with, shards
/// the optimizer updates. Groups never mix optimizer parameter groups.
class ZeroShards final : public ShardedModule {
 public:
  ZeroShards(std::shared_ptr<torch::nn::Module> model, std::function<int(size_t)> unit, int64_t bucket_bytes)
      : ShardedModule(std::move(model), BlockOptions{.zero_level = 1, .use_checkpoint = false}, "LowLevelZero",
                      Grouping{.unit = std::move(unit), .max_group_bytes = bucket_bytes}) {}
};

namespace {

std::shared_ptr<torch::nn::Module> shared_model(torch::nn::Module& model) {
  try {
    return model.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return {std::shared_ptr<torch::nn::Module>(), &model};  // not owned: the caller keeps it alive
  }
}

}  // namespace
}  // namespace detail

LowLevelZero::LowLevelZero(LowLevelZeroOptions options) : options_(options) {}

LowLevelZero::~LowLevelZero() = default;

void LowLevelZero::boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  ZTRAIN_CHECK(!shards_, "LowLevelZero: this plugin has boosted a model already; make one plugin per model");
  ZTRAIN_CHECK(options_.stage == 1 || options_.stage == 2, "LowLevelZero: stage must be 1 or 2, got ",
               options_.stage, " (stage 3 shards parameters too: use FullyShard or Blocks at zero_level 3)");
  ZTRAIN_CHECK(options_.bucket_bytes > 0, "LowLevelZero: bucket_bytes must be positive, got ", options_.bucket_bytes);
  detail::check_optimizer_over(model, optimizer, name());
  ZTRAIN_CHECK(optimizer.state().empty(), "LowLevelZero: the optimizer holds state already; it is kept per shard, "
               "so boost() before the first step");
  auto& context = default_context();
  detail::move_to_device(model, optimizer, context.device(), name());
  detail::check_same_model(model, context.dp(), name());
  detail::broadcast_from_first(model.buffers(), context.dp());

  // Which optimizer group updates each parameter (-1: none), in the model's parameter order.
  std::unordered_map<const void*, int> group_of;
  auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const auto& p : groups[i].params()) group_of.emplace(p.unsafeGetTensorImpl(), static_cast<int>(i));
  }
  std::vector<int> unit;
  for (const auto& item : recorded_parameters(model)) {
    const auto it = group_of.find(item.tensor.unsafeGetTensorImpl());
    unit.push_back(it == group_of.end() ? -1 : it->second);
  }
  shards_ = std::make_shared<detail::ZeroShards>(detail::shared_model(model), [&unit](size_t i) { return unit[i]; },
                                                 options_.bucket_bytes);

  // The optimizer updates the shards of its groups' buffers instead of the parameters.
  const auto& sharded = shards_->groups();
  std::vector<int> unit_of_group(sharded.size(), -1);
  for (size_t i = 0; i < shards_->parameter_order().size(); ++i) unit_of_group[shards_->parameter_order()[i].first] = unit[i];
  for (auto& group : groups) group.params().clear();
  for (size_t g = 0; g < sharded.size(); ++g) {
    if (unit_of_group[g] >= 0 && sharded[g].requires_grad) groups[unit_of_group[g]].params().push_back(sharded[g].shard);
  }

  // One bucket per trainable group, the last first: backward produces their gradients so.
  std::vector<detail::BucketPlan> plans;
  std::vector<torch::Tensor> shard_of_plan;
  for (size_t g = sharded.size(); g-- > 0;) {
    const auto& group = sharded[g];
    if (!group.requires_grad) continue;
    detail::BucketPlan plan{.numel = group.layout.total_numel(), .options = group.full.options()};
    for (size_t e = 0; e < group.params.size(); ++e) {
      const auto& entry = group.layout.entries()[e];
      plan.members.push_back({.name = entry.name, .param = group.params[e], .offset = entry.offset});
    }
    plans.push_back(std::move(plan));
    shard_of_plan.push_back(group.shard);
  }
  if (context.dp().size() > 1) context.reduce_stream();  // made now: collective, the same point on every rank
  const bool stage2 = options_.stage == 2;
  auto start = [&context, shard_of_plan, stage2](size_t b, torch::Tensor flat) -> Work {
    auto reduce = [shard = shard_of_plan[b], flat, stage2](Communicator& group) mutable {
      torch::NoGradGuard no_grad;
      torch::Tensor mine;
      if (group.size() == 1) {
        mine = flat;
      } else if (stage2) {
        mine = torch::empty({shard.numel()}, flat.options());
        group.reduce_scatter(flat, mine, ReduceOp::kAvg);
      } else {
        group.all_reduce(flat, ReduceOp::kAvg);
        mine = flat.narrow(0, group.rank() * shard.numel(), shard.numel());
      }
      flat = torch::Tensor();  // a stage-2 bucket goes as soon as it is reduced
      auto& grad = shard.mutable_grad();
      if (!stage2 || !grad.defined()) {
        grad = stage2 ? mine : mine.clone();  // stage 1: the bucket holds the running sum
      } else {
        grad.add_(mine);
      }
    };
    if (context.dp().size() == 1) {
      reduce(context.dp());
      return Work();
    }
    return context.reduce_stream().submit(std::move(reduce), stage2 ? "gradient reduce_scatter" : "gradient all_reduce");
  };
  buckets_ = std::make_shared<detail::GradientBuckets>(
      std::move(plans), stage2 ? detail::GradientBuckets::Keep::kNothing : detail::GradientBuckets::Keep::kBuffers,
      std::move(start));
  buckets_->arm();
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
  if (!shards_) return;
  shards_->shards_changed();
  shards_->gather();
}

BucketStats LowLevelZero::stats() const { return buckets_ ? buckets_->stats() : BucketStats{}; }

}  // namespace ztrain
