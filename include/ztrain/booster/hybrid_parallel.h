#pragma once
/// HybridParallel: tensor parallelism inside groups of `tp_size` ranks, pipeline stages of
/// `pp_size` such groups' worth, data parallelism with any ZeRO level across the rest
/// (ColossalAI's HybridParallelPlugin, Megatron-LM's tp × pp × dp).
///
/// boost() lays the world out as pp × dp × tp (the default context when it already has those
/// sizes, else a mesh of its own over the same ranks, named "hybrid"), makes every rank's model
/// equal to rank 0's, splits the layers the policy names over the tp group (booster/policy.h:
/// the model's ztrain::nn layers slice their own parameters in place, so the optimizer's
/// references hold), keeps on each pipeline stage its share of the policy's layer list and its
/// ends (the others are let go of, and dropped from the optimizer), then shards over the dp
/// group by `zero_level`:
///
/// | zero_level | over dp                                  | the plugin underneath |
/// |------------|------------------------------------------|-----------------------|
/// | 0          | replicated, bucketed all-reduce          | DataParallel          |
/// | 1, 2       | optimizer state (and gradients) sharded  | LowLevelZero          |
/// | 3          | parameters too, per layer of a LayerList | FullyShard            |
///
/// Each rank feeds its dp rank's share of the batch, the same on every rank of a tp group
/// (`plugin.context().dp()` says which); the loss is replicated across a tp group. With
/// pp_size > 1 a step is Booster::execute_pipeline(micro_batches) in place of the model's
/// forward and backward(): the micro-batches run through the stages by `schedule` (GPipe, 1F1B
/// or interleaved 1F1B), the gradients are reduced over dp once, in each stage's last
/// backward; modules the policy ties across stages (a head reusing the embedding) are kept on
/// the first and last stage both, their gradients summed. The global
/// gradient norm counts each split parameter once per slice and each replicated one once.
/// Files are the usual ones and hold the full tensors: a model saved at tp 2 loads under any
/// plugin, tp size or world size, and back.
///
/// What a model must do: the layers the policy splits are ztrain::nn::Linear and
/// ztrain::nn::Embedding (drop-ins for torch's, identical alone); at zero_level 3 or with
/// pipeline stages the repeated layers sit in a ztrain::LayerList, which the stages share out.
/// Dropout inside a tensor-parallel region needs the same generator state on every rank of the
/// tp group. A model made whole is let go of in part by boost() (a stage frees the layers it
/// does not hold); made in build(), with its LayerList made with a size and a factory, a stage
/// never materialises the layers it does not hold.
///
///   auto plugin = std::make_shared<ztrain::HybridParallel>(ztrain::HybridParallelOptions{
///       .pp_size = 2, .zero_level = 2, .policy = llama::policy()});
///   auto model = plugin->build([&] { return llama::Llama(config); });   // this stage's layers
///   ztrain::init_parameters(*model, {.seed = 42});                      // values by name
///   ztrain::Booster booster(plugin);
///   booster.boost(*model, optimizer);

#include <ztrain/booster/booster.h>
#include <ztrain/booster/policy.h>
#include <ztrain/pipe/pipeline.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/zero/layer_list.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace ztrain {

struct HybridParallelOptions {
  /// Ranks of one tensor-parallel group (consecutive ranks); must divide the world.
  int tp_size = 1;
  /// Pipeline stages; more than one needs the policy's pipeline part.
  int pp_size = 1;
  /// The pipeline schedule: GPipe, 1F1B, or interleaved 1F1B over `chunks` model chunks.
  pipe::ScheduleKind schedule = pipe::ScheduleKind::k1F1B;
  /// Model chunks (virtual stages) per rank: 1, or at least 2 with the interleaved schedule,
  /// where rank s holds the parts of virtual stages s, pp_size + s, ...
  int chunks = 1;
  /// Cut points of the policy's layer list into pp_size × chunks parts
  /// (pipe::partition_explicit); empty: uniform, the first parts taking the extra layers.
  std::vector<int64_t> bounds;
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
  ParallelContext* mesh() override { return context_.get(); }
  void after_update() override;
  torch::Tensor execute_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches,
                                 double loss_scale) override;
  torch::Tensor evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches) override;

  /// Returns make(), the model made so that this rank's pipeline stage builds only its own
  /// layers: the LayerLists made in it with a size and a factory (zero/layer_list.h) — the
  /// policy's list, which must be the only one — make the layers this stage will hold and no
  /// others. Their values are not those of a model made whole (the generator draws for fewer
  /// layers) and boost() then makes each stage's ranks equal to the stage's first, not to world
  /// rank 0: give the parameters their values by name with init_parameters, or load a file.
  /// Collective over the world (the plugin's mesh is made here). With one stage, just make().
  template <class Make>
  auto build(Make&& make) {
    LayerListScope scope([this](size_t size) { return stage_layers(size); });
    return std::forward<Make>(make)();
  }
  /// The layers [first, last) that this rank's stage holds of a list of `size`, one range per
  /// model chunk (all of them with one stage). Collective over the world the first time (the
  /// plugin's mesh is made).
  LayerListScope::Ranges stage_layers(size_t size);
  /// The pp × dp × tp mesh the model lives on (made by the first of build() and boost()).
  ParallelContext& context();
  /// The data-parallel plugin underneath (DataParallel, LowLevelZero or FullyShard).
  Plugin& data_parallel();
  /// With pipeline stages: the layers [first, last) of the policy's list this rank holds, one
  /// range per model chunk.
  const std::vector<std::pair<int64_t, int64_t>>& held_layers() const { return held_; }
  const HybridParallelOptions& options() const { return options_; }

 private:
  /// The mesh: the default context where it has the plugin's sizes, else one split from it.
  ParallelContext& mesh_context();
  /// Makes every rank's model rank 0's (each stage's first rank's where the model was made in
  /// build() for its stage) and splits it over tp as the policy says.
  void split_tensor_parallel(torch::nn::Module& model, bool by_stage);
  /// Keeps this stage's layers and ends, lets go of the rest and drops them from the optimizer.
  void hold_stage(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  /// The ZeRO level's plugin over the dp group.
  void boost_data_parallel(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  /// The pipeline over this rank's stage, its tied modules' copies tied to the other stage's.
  void build_pipeline(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  /// The policy's check of every micro-batch, on this rank (each rank checks all of them).
  void check_micro_batches(const std::vector<std::vector<torch::Tensor>>& micro_batches);

  HybridParallelOptions options_;
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<ParallelContext> context_;
  std::shared_ptr<Plugin> inner_;
  std::vector<std::pair<int64_t, int64_t>> held_;
  std::unique_ptr<pipe::Pipeline> pipeline_;
  /// Per tied module of the policy: the optimizer groups its parameters were moved into (empty
  /// on the stages between, which let go of it).
  std::vector<std::vector<size_t>> tied_groups_;
  bool sync_ = true;  // outside no_sync
};

}  // namespace ztrain
