#pragma once
/// LowLevelZero: ZeRO stage 1 and 2 for any plain libtorch model (ColossalAI's LowLevelZero,
/// DeepSpeed's stages 1 and 2).
///
/// Parameters stay whole on every rank — the model's forward runs as written, nothing gathers
/// in it — but the optimizer updates only this rank's 1/dp of them, so its state (momenta,
/// masters) is sharded over the data-parallel group. boost() lays the model's parameters out in
/// flat buffers (one per optimizer parameter group and dtype, cut into buckets of at most
/// `bucket_bytes`; the user's parameter objects keep their names and now point into them),
/// broadcasts them and the buffers from dp rank 0, and hands the optimizer this rank's shard
/// of each buffer in place of the parameters: a stock torch::optim or ztrain optimizer, built
/// over `model->parameters()` with any parameter groups, works unchanged. After each applied
/// step the shards are all-gathered back into the buffers.
///
/// Gradients reach the buckets as backward produces them (last registered first), and a
/// bucket's reduction over the dp group starts as soon as its last gradient has landed,
/// overlapping the rest of backward:
///
/// | stage | reduction      | after backward                                               |
/// |-------|----------------|--------------------------------------------------------------|
/// | 1     | all-reduce     | every parameter's `.grad` holds the mean gradient (as DDP)    |
/// | 2     | reduce-scatter | only the shards hold gradients; the parameters' `.grad` stay undefined, and a bucket's full gradient is freed once reduced |
///
/// Under Booster::no_sync the local gradients accumulate in the buckets and the next synced
/// backward reduces the sum once. Checkpoints are the usual files: save_model writes the full
/// tensors under the model's names, save_optimizer the state in the resharding format, so a run
/// saved here loads under DataParallel, or at another world size, and back.
///
/// Optimizer offload: build optim::AdamOffload over the model before boost(); it keeps the
/// shards' state in host memory and updates them inside step().
///
/// What a model must do: nothing beyond being a torch::nn::Module owned by a shared_ptr (a
/// TORCH_MODULE holder) or outliving the booster, with each parameter tensor registered under
/// one name. The optimizer must not hold state yet (boost before the first step).

#include <ztrain/booster/booster.h>
#include <ztrain/runtime/parallel_context.h>

#include <cstdint>
#include <memory>

namespace ztrain {

struct LowLevelZeroOptions {
  /// 1: sharded optimizer state; 2: also sharded gradients (the table above).
  int stage = 2;
  /// The most parameter bytes one bucket holds: one flat buffer and one reduction. Smaller
  /// buckets start reducing earlier in backward, larger ones pay fewer per-call costs.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The mesh whose dp group the plugin spans. Not set: the default context (init_distributed).
  std::shared_ptr<ParallelContext> context;
};

namespace detail {
class GradientBuckets;
class ZeroShards;
}  // namespace detail

class LowLevelZero : public Plugin {
 public:
  explicit LowLevelZero(LowLevelZeroOptions options = {});
  ~LowLevelZero() override;

  std::string name() const override { return "LowLevelZero"; }
  void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) override;
  /// The module holding the shards (a level-1 ShardedModule over the model).
  torch::nn::Module& boosted(torch::nn::Module& model) override;
  void set_gradient_sync(bool on) override;
  void after_zero_grad() override;
  ParallelContext* mesh() override { return options_.context.get(); }
  void after_update() override;

  BucketStats stats() const;
  const LowLevelZeroOptions& options() const { return options_; }

 private:
  LowLevelZeroOptions options_;
  std::shared_ptr<detail::ZeroShards> shards_;
  std::shared_ptr<detail::GradientBuckets> buckets_;
};

}  // namespace ztrain
