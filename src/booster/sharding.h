#pragma once
// What the ZeRO plugins (LowLevelZero, FullyShard) share: level-1 sharded modules over plain
// modules, the optimizer handed their shards, and gradient buckets that reduce into the shards.

#include "gradient_buckets.h"

#include <ztrain/runtime/parallel_context.h>
#include <ztrain/zero/sharded_module.h>

#include <functional>
#include <memory>
#include <vector>

namespace ztrain::detail {

/// A plain module's parameters in flat level-1 groups: full buffers the module computes with,
/// shards an optimizer updates. Not called through run(): the plugin reduces its gradients.
class ZeroShards final : public ShardedModule {
 public:
  ZeroShards(std::shared_ptr<torch::nn::Module> module, const ShardGrouping& grouping, const std::string& kind,
             std::shared_ptr<ParallelContext> context)
      : ShardedModule(std::move(module),
                      BlockOptions{.zero_level = 1, .use_checkpoint = false, .context = std::move(context)}, kind,
                      grouping) {}
};

/// Which parameter group of `optimizer` updates a tensor (-1: none), as a ShardGrouping::unit.
std::function<int(const torch::Tensor&)> optimizer_units(const torch::optim::Optimizer& optimizer);

/// Replaces the optimizer's parameters with the trainable shards of `modules`, each shard in
/// the group its parameters came from (`unit`, from optimizer_units before the call).
void hand_shards(torch::optim::Optimizer& optimizer, const std::vector<ShardedModule*>& modules,
                 const std::function<int(const torch::Tensor&)>& unit);

/// Gradient buckets over the trainable groups of `modules` (level 1, not run through their
/// own autograd node), later modules and groups first — the order backward produces them —
/// whose means over the dp group land in the shards' .grad. Stage 1 all-reduces and keeps the
/// buffers, the parameters' .grad viewing the mean; stage 2 reduce-scatters and frees each
/// buffer once reduced, the parameters' .grad left undefined. Armed.
std::shared_ptr<GradientBuckets> shard_buckets(ParallelContext& context, const std::vector<ShardedModule*>& modules,
                                               int stage);

/// The shard of every module, written by an optimizer step or a load, gathered back into its
/// full buffers (collective).
void refresh(const std::vector<ShardedModule*>& modules);

}  // namespace ztrain::detail
