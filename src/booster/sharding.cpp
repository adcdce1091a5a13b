#include "sharding.h"

#include <ztrain/error.h>

#include <unordered_map>

namespace ztrain::detail {

std::function<int(const torch::Tensor&)> optimizer_units(const torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, int> group_of;
  const auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const auto& p : groups[i].params()) group_of.emplace(p.unsafeGetTensorImpl(), static_cast<int>(i));
  }
  return [group_of = std::move(group_of)](const torch::Tensor& t) {
    const auto it = group_of.find(t.unsafeGetTensorImpl());
    return it == group_of.end() ? -1 : it->second;
  };
}

void hand_shards(torch::optim::Optimizer& optimizer, const std::vector<ShardedModule*>& modules,
                 const std::function<int(const torch::Tensor&)>& unit) {
  auto& groups = optimizer.param_groups();
  for (auto& group : groups) group.params().clear();
  for (auto* module : modules) {
    for (const auto& group : module->groups()) {
      const int u = unit(group.params.front());  // a group never mixes units
      if (u >= 0 && group.requires_grad) groups[static_cast<size_t>(u)].params().push_back(group.shard);
    }
  }
}

std::shared_ptr<GradientBuckets> shard_buckets(ParallelContext& context, const std::vector<ShardedModule*>& modules,
                                               int stage) {
  ZTRAIN_INTERNAL_ASSERT(stage == 1 || stage == 2, "stage ", stage);
  std::vector<BucketPlan> plans;
  std::vector<torch::Tensor> shard_of_plan;
  for (auto m = modules.rbegin(); m != modules.rend(); ++m) {
    const auto& groups = (*m)->groups();
    for (size_t g = groups.size(); g-- > 0;) {
      const auto& group = groups[g];
      if (!group.requires_grad) continue;
      BucketPlan plan{.numel = group.layout.total_numel(), .options = group.full.options()};
      for (size_t e = 0; e < group.params.size(); ++e) {
        const auto& entry = group.layout.entries()[e];
        plan.members.push_back({.name = entry.name, .param = group.params[e], .offset = entry.offset});
      }
      plans.push_back(std::move(plan));
      shard_of_plan.push_back(group.shard);
    }
  }
  if (context.dp().size() > 1) context.reduce_stream();  // made now: collective, the same point on every rank
  const bool stage2 = stage == 2;
  auto start = [&context, shard_of_plan = std::move(shard_of_plan), stage2](size_t b, torch::Tensor flat) -> Work {
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
    const auto device = flat.device();
    return context.reduce_stream().submit(std::move(reduce), stage2 ? "gradient reduce_scatter" : "gradient all_reduce",
                                          device);
  };
  auto buckets = std::make_shared<GradientBuckets>(
      std::move(plans), stage2 ? GradientBuckets::Keep::kNothing : GradientBuckets::Keep::kBuffers, std::move(start));
  buckets->arm();
  return buckets;
}

void refresh(const std::vector<ShardedModule*>& modules) {
  for (auto* m : modules) m->shards_changed();
  for (auto* m : modules) m->prefetch();  // all gathers in flight at once
  for (auto* m : modules) m->gather();
}

}  // namespace ztrain::detail
