#pragma once
/// FullyShard: ZeRO-3 for a model whose repeated layers sit in ztrain::LayerList (FSDP's
/// fully_shard, ColossalAI's Gemini).
///
/// boost() wraps every layer of every LayerList in a Block at ZeRO level 3 (LayerList::shard):
/// the layer's parameters, gradients and optimizer state live sharded over the data-parallel
/// group; its forward gathers them (the next layer's gather already under way), frees them
/// after, gathers them again for backward and reduce-scatters the gradient on the reduction
/// stream. Which layer is next is list order until the first step has run, then the order in
/// which that step's forward called the layers (FSDP's recorded execution order): a model that
/// calls its layers in another order, or skips some, has the right ones prefetched from then
/// on. With `use_checkpoint` a layer keeps only its inputs and recomputes in backward. The
/// parameters outside the lists — embeddings, final norms, heads — are sharded as
/// LowLevelZero's stage 2 shards them: each module that owns such parameters is replaced in its
/// parent by a sharded module over it (same names), whose parameters stay whole for the model's
/// own forward while their gradients (reduce-scattered in buckets during backward) and optimizer
/// state are 1/dp; the updated shards are all-gathered after each step. The optimizer (any
/// torch::optim or ztrain optimizer over `model->parameters()`, any parameter groups) is handed
/// the shards, group by group. Files are the usual ones and load under any plugin or world size.
///
/// What a model must do:
/// - hold its repeated layers in a `ztrain::LayerList<Layer>` (a drop-in for
///   torch::nn::ModuleList: push_back, iteration, `layer(x, ...)` calls) and call them through
///   it; a layer's forward takes tensors (other arguments pass through) and returns tensors;
/// - register every other parameter in a submodule (an embedding, a norm, a linear), not on the
///   model itself or on a module that also holds a LayerList, and each tensor under one name;
/// - nothing else: the rest of its forward runs as written.

#include <ztrain/booster/booster.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/zero/sharded_module.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace ztrain {

struct FullyShardOptions {
  /// Recompute each layer's forward in backward instead of keeping its activations.
  bool use_checkpoint = false;
  /// Layers gathered ahead: in forward the following ones, in backward the preceding ones (in
  /// the recorded execution order once a step has run).
  int prefetch_depth = 1;
  /// The most bytes one bucket of the parameters outside the layer lists holds.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The mesh whose dp group the plugin spans. Not set: the default context (init_distributed).
  std::shared_ptr<ParallelContext> context;
  /// The layers' parameter and gradient shards in files in this directory instead of memory
  /// (BlockOptions::offload_dir; CPU only). Unset: in memory.
  std::optional<std::string> offload_dir;
};

namespace detail {
class GradientBuckets;
class ZeroShards;
struct ExecutionOrder;
}  // namespace detail

class FullyShard : public Plugin {
 public:
  explicit FullyShard(FullyShardOptions options = {});
  ~FullyShard() override;

  std::string name() const override { return "FullyShard"; }
  void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) override;
  void set_gradient_sync(bool on) override;
  void after_zero_grad() override;
  ParallelContext* mesh() override { return options_.context.get(); }
  void after_update() override;

  /// The Blocks of the layer lists, in model order.
  const std::vector<ShardedModule*>& blocks() const { return blocks_; }
  /// The Blocks in the order the first step's forward called them (first calls), once a step
  /// has run; empty before.
  std::vector<ShardedModule*> execution_order() const;
  /// The buckets of the parameters outside the layer lists.
  BucketStats stats() const;
  const FullyShardOptions& options() const { return options_; }

 private:
  std::vector<ShardedModule*> roots() const;
  void link_in_execution_order();

  FullyShardOptions options_;
  bool boosted_ = false;
  std::vector<ShardedModule*> blocks_;
  std::vector<std::shared_ptr<detail::ZeroShards>> roots_;
  std::shared_ptr<detail::GradientBuckets> buckets_;
  std::shared_ptr<detail::ExecutionOrder> order_;  // shared with the Blocks' forward observers
};

}  // namespace ztrain
