#pragma once
/// OptimManager: the steps around the optimizers — loss scaling, gradient clipping over every
/// shard and rank, overflow checks agreed by all ranks, learning-rate schedules.
///
/// Manages any number of torch::optim optimizers (ztrain's or libtorch's) over one model, each
/// with an optional schedule. One training step:
///
///   ztrain::optim::OptimManager mgr(*model, ztrain::LossScaler::dynamic());
///   mgr.add_optimizer(opt, std::make_shared<ztrain::lr_scheduler::Cosine>(lr_options));
///   mgr.zero_grad();
///   mgr.backward(loss);              // (loss × scale).backward()
///   mgr.clip_grad_norm(1.0);         // the unscaled global norm, before clipping
///   bool applied = mgr.step();       // false: an inf/NaN somewhere, the step was skipped
///
/// The model is where the manager learns what each gradient is: its parameters' records
/// (runtime/parameter_record.h) and the parallel context they live on. step() is collective
/// over that context's world: every rank calls it, and if any rank's gradients hold an inf or
/// NaN, every rank skips the step (gradients zeroed, the scale backed off, schedules not
/// advanced). clip_grad_norm() is collective too and counts each gradient element of the model
/// once: shards of ZeRO levels 1–3 on every dp rank, replicated gradients (level 0, plain
/// parameters) once per dp group; tensor-parallel slices on every tp rank, parameters
/// replicated over the tp group once; a parameter tied across pipeline stages
/// (pipe::Pipeline::tie) once. The optimizers must update parameters of the model. Without
/// init_distributed everything is local.

#include <ztrain/optim/loss_scaler.h>
#include <ztrain/optim/lr_scheduler.h>
#include <ztrain/runtime/parallel_context.h>

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <vector>

namespace ztrain::optim {

/// Everything OptimManager needs to resume a run exactly (optimizer states are saved apart).
struct OptimManagerState {
  LossScalerState scaler;
  std::vector<std::optional<LRSchedulerState>> schedulers;  // one per optimizer, in add order
  int64_t steps = 0;    // step() calls that applied
  int64_t skipped = 0;  // step() calls skipped for an overflow
  bool operator==(const OptimManagerState&) const = default;
};

class OptimManager {
 public:
  /// `model` must outlive the manager. `context`: the mesh the model lives on, whose groups
  /// the gradient norm and overflow checks reduce over; null: the one its parameters' records
  /// name (context_of).
  explicit OptimManager(torch::nn::Module& model, LossScaler scaler = LossScaler::off(),
                        ParallelContext* context = nullptr);

  /// The optimizer must outlive the manager. The schedule, if any, sets the optimizer's lr
  /// before each step.
  void add_optimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<LRScheduler> scheduler = nullptr);

  /// Drops every managed parameter's gradient.
  void zero_grad();
  /// Backward of loss × scale.
  void backward(const torch::Tensor& loss);
  /// Unscales the gradients (once per step), returns their global L2 norm and, when it is
  /// finite and above max_norm, scales them down to max_norm. Collective.
  double clip_grad_norm(double max_norm);
  /// The global L2 norm of the unscaled gradients, without clipping. Collective.
  double grad_norm();
  /// Applies the step unless some rank found an inf or NaN. Collective.
  bool step();

  double loss_scale() const { return scaler_.scale(); }
  /// The lr the next step will use (the first optimizer's schedule, else its first group's lr).
  double current_lr() const;
  int64_t steps() const { return steps_; }
  int64_t skipped_steps() const { return skipped_; }
  const std::vector<torch::optim::Optimizer*>& optimizers() const { return optimizers_; }

  OptimManagerState state() const;
  /// Throws ztrain::Error when the state's number of optimizers or schedules differs.
  void load_state(const OptimManagerState& state);

 private:
  std::vector<torch::Tensor> gradients() const;
  void unscale();

  torch::nn::Module& model_;
  ParallelContext* context_;  // null without a runtime
  LossScaler scaler_;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  bool unscaled_ = false;
  int64_t steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace ztrain::optim
