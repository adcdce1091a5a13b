#pragma once
/// HybridParallel: tensor parallelism inside groups of `tp_size` ranks, data parallelism with
/// any ZeRO level across them (ColossalAI's HybridParallelPlugin, Megatron-LM's tp × dp).
///
/// boost() lays the world out as dp × tp (the default context when it already has that tp
/// size, else a mesh of its own over the same ranks, named "hybrid"), makes every rank's model
/// equal to rank 0's, splits the layers the policy names over the tp group (booster/policy.h:
/// the model's ztrain::nn layers slice their own parameters in place, so the optimizer's
/// references hold), then shards over the dp group by `zero_level`:
///
/// | zero_level | over dp                                  | the plugin underneath |
/// |------------|------------------------------------------|-----------------------|
/// | 0          | replicated, bucketed all-reduce          | DataParallel          |
/// | 1, 2       | optimizer state (and gradients) sharded  | LowLevelZero          |
/// | 3          | parameters too, per layer of a LayerList | FullyShard            |
///
/// Each rank feeds its dp rank's share of the batch, the same on every rank of a tp group
/// (`plugin.context().dp()` says which); the loss is replicated across a tp group. The global
/// gradient norm counts each split parameter once per slice and each replicated one once.
/// Files are the usual ones and hold the full tensors: a model saved at tp 2 loads under any
/// plugin, tp size or world size, and back.
///
/// What a model must do: the layers the policy splits are ztrain::nn::Linear and
/// ztrain::nn::Embedding (drop-ins for torch's, identical alone); at zero_level 3 the repeated
/// layers sit in a ztrain::LayerList, as FullyShard requires. Dropout inside a tensor-parallel
/// region needs the same generator state on every rank of the tp group.
///
///   ztrain::Booster booster(std::make_shared<ztrain::HybridParallel>(
///       ztrain::HybridParallelOptions{.tp_size = 2, .zero_level = 2, .policy = llama::policy()}));
///   booster.boost(*model, optimizer);

#include <ztrain/booster/booster.h>
#include <ztrain/booster/policy.h>
#include <ztrain/runtime/parallel_context.h>

#include <cstdint>
#include <memory>

namespace ztrain {

struct HybridParallelOptions {
  /// Ranks of one tensor-parallel group (consecutive ranks); must divide the world.
  int tp_size = 1;
  /// ZeRO over the dp group: 0 DataParallel, 1 and 2 LowLevelZero's stages, 3 FullyShard.
  int zero_level = 0;
  /// Which layers split over tp, and how.
  Policy policy;
  /// zero_level 3: recompute each layer's forward in backward; layers gathered ahead.
  bool use_checkpoint = false;
  int prefetch_depth = 1;
  /// The most gradient bytes one bucket carries.
  int64_t bucket_bytes = int64_t{25} << 20;
};

class HybridParallel : public Plugin {
 public:
  explicit HybridParallel(HybridParallelOptions options);
  ~HybridParallel() override;

  std::string name() const override { return "HybridParallel"; }
  void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) override;
  torch::nn::Module& boosted(torch::nn::Module& model) override;
  void set_gradient_sync(bool on) override;
  void after_zero_grad() override;
  void after_update() override;

  /// The dp × tp mesh the model lives on, after boost().
  ParallelContext& context();
  /// The data-parallel plugin underneath (DataParallel, LowLevelZero or FullyShard).
  Plugin& data_parallel();
  const HybridParallelOptions& options() const { return options_; }

 private:
  HybridParallelOptions options_;
  std::shared_ptr<ParallelContext> context_;
  std::shared_ptr<Plugin> inner_;
};

}  // namespace ztrain
