#pragma once
/// Fused Adam and AdamW for flat parameter shards.
///
/// ztrain::optim::AdamW is a torch::optim::Optimizer (so lr schedulers, zero_grad() and
/// param_groups() work as with any libtorch optimizer) whose step() updates each parameter in
/// one pass: a vectorised kernel reads the weight, the gradient and both moments once and writes
/// them once, on a persistent thread pool. The arithmetic is PyTorch 1.13's, operation by
/// operation (amsgrad = false, maximize = false), for every parameter with a defined gradient:
///
///   t += 1                              (a parameter whose grad is undefined is skipped: its t stays)
///   w  = w·(1 − lr·wd)                  (AdamW, decoupled_weight_decay = true)
///   g  = g + wd·w                       (Adam,  decoupled_weight_decay = false)
///   m  = β1·m + (1 − β1)·g
///   v  = β2·v + (1 − β2)·g²
///   w  = w − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + eps)
///
/// with the step-size scalars computed in double and applied in float, and every operation rounded
/// as libtorch's CPU kernels round it: the results equal 1.13's torch.optim.AdamW / Adam bit for
/// bit. PyTorch 2.x rounds some operations differently (its Python optimizers compute m with
/// lerp_): within 1.3e-6 relative of 2.11's after 100 steps, 1e-6 of its C++ optimizers.
///
/// Parameters: any contiguous tensor on the CPU or a CUDA device (ZeRO shards are large flat 1-D
/// ones; sizes 0 and 1 work); the state lives on the parameter's device.
///   float32          updated in place; state: fp32 exp_avg, exp_avg_sq.
///   bfloat16/float16 the state also holds an fp32 master copy, taken from the parameter at its
///                    first step; the gradient is read in the parameter's dtype, the master is
///                    updated in fp32 and written back to the parameter rounded to nearest even.
/// Anything else (other dtypes, non-contiguous or sparse tensors, a gradient of another dtype or
/// shape) makes step() throw ztrain::Error before any parameter is touched.
///
/// Kernels: on the CPU a plain scalar reference, AVX2+FMA+F16C and AVX-512 (F, BW, VL), chosen
/// at run time from what the CPU supports (AdamEngineOptions::kernel overrides it). All three
/// give the same results bit for bit (apart from which payload a NaN produced by the arithmetic
/// carries). Parameters on a CUDA device are updated by libtorch's fused kernel
/// (aten::_fused_adamw_ / _fused_adam_, what torch.optim's fused=True runs; kTorchFused), which
/// rounds as PyTorch 2.x does: on the CPU it can be chosen too, to compare the two.
///
/// No communication: every rank steps its own shards. Not thread-safe: one thread calls step()
/// at a time (the optimizer's own pool does the parallel work inside it).
///
///   namespace zo = ztrain::optim;
///   zo::AdamW opt(model->parameters(), zo::AdamOptions(3e-4).weight_decay(0.1));
///   ztrain::lr_scheduler::Cosine lr({.peak_lr = 3e-4, .warmup_steps = 100, .total_steps = 10000});
///   for (int64_t i = 0; i < 10000; ++i) {
///     lr.apply(opt);
///     opt.zero_grad();
///     loss_of(batch(i)).backward();
///     opt.step();
///     lr.step();
///   }
///   zo::AdamParamState* s = opt.state_of(shard);  // t, moments and master of one parameter

#include <ztrain/optim/adam_kernel.h>

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace ztrain::detail {
class ThreadPool;
}  // namespace ztrain::detail

namespace ztrain::optim {

/// Hyperparameters of one parameter group (torch::optim style: chained setters, and a copy per
/// group). Validated by the optimizer's constructor and again at every step, because they may be
/// changed in between: lr >= 0, 0 <= β1, β2 < 1, eps >= 0, weight_decay >= 0, all finite.
///
///   AdamOptions().lr(1e-3).betas({0.9, 0.95}).weight_decay(0.1)   // AdamW
///   AdamOptions::adam(1e-3).weight_decay(1e-4)                     // classic Adam, L2 in the gradient
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  /// torch.optim.AdamW's defaults.
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim::AdamWOptions
  /// torch.optim.Adam's defaults: weight_decay 0, decoupled_weight_decay false.
  static AdamOptions adam(double lr = 1e-3);

  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// true: AdamW (the weight shrinks by lr·wd); false: Adam (wd·w is added to the gradient).
  TORCH_ARG(bool, decoupled_weight_decay) = true;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const AdamOptions& a, const AdamOptions& b);
};

/// What the optimizer keeps per parameter. exp_avg, exp_avg_sq and master are contiguous fp32
/// tensors shaped like the parameter; master is undefined for fp32 parameters. A checkpoint that
/// keys state by parameter name and range reads and writes it through AdamW::state_of and
/// AdamW::set_state.
struct AdamParamState {
  int64_t step = 0;  ///< updates applied so far (t above)
  torch::Tensor exp_avg;
  torch::Tensor exp_avg_sq;
  torch::Tensor master;
};

/// How the optimizer runs: one setting for the whole optimizer (unlike AdamOptions, which is
/// per group). Validated by the constructor.
struct AdamEngineOptions {
  /// Threads that share the update of a large tensor, the calling thread included; >= 1.
  /// Unset: at::get_num_threads() at construction. The pool's threads are created once, by the
  /// constructor, and live as long as the optimizer.
  std::optional<int> num_threads;
  /// The kernel for CPU parameters. Unset: best_adam_kernel(). A kernel the CPU cannot run is an
  /// error, never a fallback. CUDA parameters always use kTorchFused.
  std::optional<AdamKernel> kernel;
  /// A tensor is split over threads only when each gets at least this many elements; smaller
  /// tensors are updated inline by the calling thread. >= 1.
  int64_t min_numel_per_thread = 65536;
  /// Optimizer state held on the CPU (moments and masters: of CPU parameters, and AdamOffload's
  /// host state of device parameters) in files under this directory instead of memory — ZeRO-
  /// Infinity's offload of the optimizer state to disk. Each state tensor is a shared mapping of
  /// a file of its own (created with its space reserved, unlinked at once: nothing is left
  /// behind); step() asks the kernel to read the next parameter's state in while it updates one,
  /// and writes each parameter's state back and drops it from memory after its update, so
  /// between steps the state occupies disk, not this process's memory. The updates are the same
  /// bit for bit. Unset: in memory.
  std::optional<std::string> state_dir;
};

/// AdamW, or Adam for groups whose options have decoupled_weight_decay(false).
class AdamW : public torch::optim::Optimizer {
 public:
  /// Throws ztrain::Error on invalid options, on group options that are not AdamOptions, or on a
  /// parameter that step() could not update (dtype, layout).
  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamOptions defaults = {},
                 AdamEngineOptions engine = {});
  explicit AdamW(std::vector<torch::Tensor> params, AdamOptions defaults = {}, AdamEngineOptions engine = {});
  AdamW(AdamW&&);
  ~AdamW() override;

  /// One update of every parameter that has a gradient (see the top of the file). With a
  /// closure, calls it first with grad mode enabled and returns its loss; otherwise returns an
  /// undefined tensor. Throws ztrain::Error, before changing anything, when a parameter or its
  /// gradient cannot be updated or a group's options are invalid.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// The state of `param` (a tensor of one of the groups), or nullptr before its first step.
  AdamParamState* state_of(const torch::Tensor& param);
  const AdamParamState* state_of(const torch::Tensor& param) const;
  /// Replaces the state of `param` (loading a checkpoint). Throws ztrain::Error unless `param`
  /// belongs to a group, step >= 0, exp_avg and exp_avg_sq are contiguous fp32 tensors of the
  /// parameter's shape on its device, and master is one too for a bf16/fp16 parameter and
  /// undefined for fp32.
  /// The tensors are stored as given (not copied) and updated in place by later steps.
  void set_state(const torch::Tensor& param, AdamParamState state);

  /// libtorch serialization (torch::save(optimizer, ...)): state keyed by position in the
  /// groups, like torch::optim::AdamW.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Where the state of `param` lives: beside it (AdamW), or in host memory (AdamOffload).
  /// State kept away from its parameter always holds an fp32 master.
  virtual c10::Device state_device(const torch::Tensor& param) const { return param.device(); }

  /// The kernel step() runs for CPU parameters.
  AdamKernel kernel() const { return kernel_; }
  /// Threads a large tensor is split over (the calling thread included).
  int num_threads() const;
  const AdamEngineOptions& engine_options() const { return engine_; }

 protected:
  /// Throws ztrain::Error if step() could not update every parameter with a gradient.
  void check_step() const;
  /// The state of `param`, created (zero moments, fp32 master) before its first update.
  AdamParamState& state_for(const torch::Tensor& param);
  /// One update of `param` with `grad` (thread-compatible: different parameters may be updated
  /// on another thread once their state exists).
  void update(const torch::Tensor& param, const torch::Tensor& grad, const AdamOptions& options);
  /// Starts reading in what of `param`'s update lives in files (its state with state_dir, the
  /// parameter and its gradient when they are shards on disk): an update soon to come.
  void read_ahead(const torch::Tensor& param);
  /// Writes what of `param` and its state lives in files back to them and drops it from memory.
  void write_behind(const torch::Tensor& param);
  /// Called before the state is read or replaced from outside (an asynchronous subclass waits
  /// for its updates).
  virtual void sync() const {}

 private:
  void check_params(const torch::optim::OptimizerParamGroup& group, size_t index) const;
  /// The state of `param`, or null (no waiting: for the updating thread).
  AdamParamState* find_state(const torch::Tensor& param);
  /// A zero fp32 state tensor like `param` on `device` (in a file with state_dir).
  torch::Tensor new_state(const torch::Tensor& param, c10::Device device) const;

  AdamEngineOptions engine_;
  AdamKernel kernel_;
  std::unique_ptr<ztrain::detail::ThreadPool> pool_;
};

/// Classic Adam: AdamW constructed from torch.optim.Adam's defaults (AdamOptions::adam()), L2
/// weight decay added to the gradient. Throws ztrain::Error when `defaults` asks for decoupled
/// weight decay (use AdamW for that).
class Adam : public AdamW {
 public:
  explicit Adam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                AdamOptions defaults = AdamOptions::adam(), AdamEngineOptions engine = {});
  explicit Adam(std::vector<torch::Tensor> params, AdamOptions defaults = AdamOptions::adam(),
                AdamEngineOptions engine = {});
};

}  // namespace ztrain::optim
