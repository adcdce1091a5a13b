#pragma once
/// Booster: one training loop, the parallelism chosen by a plugin.
///
/// A plugin (DataParallel, …) decides how a model's parameters, gradients and optimizer state
/// are spread over the ranks; the Booster runs the steps around it — loss scaling, gradient
/// clipping over every rank, learning-rate schedules (OptimManager) — and saves and loads
/// through the resharding checkpoint formats. The model is the user's plain libtorch module
/// and the optimizer any torch::optim optimizer built over its parameters; boost() prepares
/// both in place (C++ has no wrappers to hand back that would differ from the objects
/// themselves), so the user's handles keep working.
///
///   auto model = Net();                                           // plain libtorch
///   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
///   ztrain::Booster booster(std::make_shared<ztrain::DataParallel>());
///   booster.boost(*model, opt);                                   // collective
///   for (auto& batch : loader) {
///     booster.zero_grad();
///     booster.backward(loss_fn(model->forward(batch.x), batch.y));
///     booster.step();
///   }
///   booster.save_model("model.safetensors");
///
/// Every rank runs the same calls in the same order. Not thread-safe.

#include <ztrain/ckpt/model_file.h>
#include <ztrain/optim/loss_scaler.h>
#include <ztrain/optim/lr_scheduler.h>
#include <ztrain/optim/optim_manager.h>

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ztrain {

/// How a parallelism strategy prepares a model and takes part in its steps. Implementations:
/// DataParallel (booster/data_parallel.h), LowLevelZero (booster/low_level_zero.h), FullyShard
/// (booster/fully_shard.h).
class Plugin {
 public:
  virtual ~Plugin() = default;
  /// The plugin's name in messages and checkpoints.
  virtual std::string name() const = 0;
  /// Prepares `model` and `optimizer` (collective over the ranks the plugin spans). Called once.
  virtual void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer) = 0;
  /// The module whose parameters the optimizer updates after boost(): what gradient norms,
  /// overflow checks and checkpoints walk. The model itself unless the plugin shards it.
  virtual torch::nn::Module& boosted(torch::nn::Module& model) { return model; }
  /// The mesh the plugin lays the model out on, over which gradient norms and checkpoints
  /// communicate; null: the default context. Valid after boost().
  virtual ParallelContext* mesh() { return nullptr; }
  /// Whether the next backward passes reduce gradients across ranks (false under no_sync).
  virtual void set_gradient_sync(bool on) = 0;
  /// Called after the gradients were dropped, to re-arm whatever the plugin keeps in them.
  virtual void after_zero_grad() {}
  /// Called after the optimizer's parameters were written (an applied step, a loaded model
  /// file), to bring what the model computes with up to date. Collective.
  virtual void after_update() {}
  /// Forward and backward of one step's micro-batches through the plugin's pipeline stages,
  /// the backward of the mean loss × `loss_scale`; returns the mean loss on every rank. The
  /// plugins without stages refuse: their steps are the model's forward and backward().
  virtual torch::Tensor execute_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches,
                                         double loss_scale);
  /// The forward alone of micro-batches through the stages (evaluation, no gradients); returns
  /// the mean loss on every rank. Refused as execute_pipeline is.
  virtual torch::Tensor evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches);
};

/// What a plugin's gradient buckets did, for tests and logs.
struct BucketStats {
  int64_t buckets = 0;
  /// Reductions started while backward was still running (overlapped), and at its end.
  int64_t reductions_during_backward = 0;
  int64_t reductions_at_end = 0;
};

struct BoosterOptions {
  /// Loss scaling for fp16 (LossScaler::dynamic()); off for fp32 and bf16.
  LossScaler loss_scaler = LossScaler::off();
  /// Clip the global gradient norm to this before each step; 0: no clipping.
  double max_grad_norm = 0;
  /// The optimizer's learning-rate schedule, applied before each step.
  std::shared_ptr<LRScheduler> lr_scheduler;
};

class Booster {
 public:
  explicit Booster(std::shared_ptr<Plugin> plugin, BoosterOptions options = {});
  Booster(const Booster&) = delete;
  Booster& operator=(const Booster&) = delete;

  /// Applies the plugin to `model` and `optimizer` (collective). Both must outlive the booster;
  /// a booster boosts one pair, once.
  void boost(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

  /// Drops the gradients.
  void zero_grad();
  /// Backward of the (scaled) loss; with the plugin's reductions done when it returns.
  void backward(const torch::Tensor& loss);
  /// A pipeline plugin's step in place of forward and backward (HybridParallel with pp_size > 1):
  /// every micro-batch (a list of tensors, as the policy's embed and loss take them; the same
  /// count on every rank, each dp rank its own) runs forward and backward through the stages by
  /// the plugin's schedule, gradients are reduced once, and the mean loss over the
  /// micro-batches and the data-parallel replicas is returned on every rank. Collective.
  torch::Tensor execute_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches);
  /// The mean loss of micro-batches through the stages without gradients (evaluation), on every
  /// rank, over the data-parallel replicas too. Collective.
  torch::Tensor evaluate_pipeline(const std::vector<std::vector<torch::Tensor>>& micro_batches);
  /// Clips (BoosterOptions::max_grad_norm), then applies the step unless some rank found an inf
  /// or NaN, and advances the schedule. Collective. Returns whether the step was applied.
  bool step();
  /// The global gradient norm before the last step's clipping (NaN before the first step or
  /// without clipping).
  double last_grad_norm() const { return last_grad_norm_; }

  /// While the returned guard lives, backward passes accumulate gradients locally without
  /// reducing them; the first backward after it reduces the accumulated sum (gradient
  /// accumulation communicating once per step, as DDP's no_sync).
  class NoSync {
   public:
    explicit NoSync(Plugin& plugin) : plugin_(&plugin) { plugin_->set_gradient_sync(false); }
    ~NoSync() {
      if (plugin_) plugin_->set_gradient_sync(true);
    }
    NoSync(NoSync&& other) noexcept : plugin_(std::exchange(other.plugin_, nullptr)) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    Plugin* plugin_;
  };
  [[nodiscard]] NoSync no_sync();

  /// The model file (full tensors, the model's own names; ztrain::save). Collective.
  void save_model(const std::string& path, const SaveOptions& options = {});
  /// Loads a model file written at any world size and layout (ztrain::load). Collective.
  void load_model(const std::string& path, const LoadOptions& options = {});
  /// The optimizer state (save_optimizer_state). Collective.
  void save_optimizer(const std::string& path, const SaveOptions& options = {});
  void load_optimizer(const std::string& path);

  Plugin& plugin() { return *plugin_; }
  /// Loss scale, step counts, schedule state (for checkpoints and logs). Valid after boost().
  optim::OptimManager& manager();

 private:
  torch::nn::Module& model();
  torch::optim::Optimizer& optimizer();
  /// `options` on the plugin's mesh unless they name one.
  template <class Options>
  Options on_mesh(Options options) {
    if (!options.context) options.context = plugin_->mesh();
    return options;
  }

  std::shared_ptr<Plugin> plugin_;
  BoosterOptions options_;
  torch::nn::Module* model_ = nullptr;  // the plugin's boosted view of the model
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::optional<optim::OptimManager> manager_;
  double last_grad_norm_;
};

}  // namespace ztrain
