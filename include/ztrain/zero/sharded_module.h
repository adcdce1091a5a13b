#pragma once
/// The ZeRO machinery shared by Block and DistributedParameter: a wrapped user module whose
/// parameters live in flat, sharded buffers over the data-parallel group.
///
/// Construction (collective over the dp group) groups the wrapped module's parameters by
/// (dtype, requires_grad), lays each group out in a flat buffer (FlatParamLayout), broadcasts
/// the buffer from dp rank 0 so every rank starts from the same values, and points the user's
/// parameter tensors into it: the user's module keeps its parameter objects and names, only
/// their storage moves. What stays between steps depends on the ZeRO level:
///
/// | level | kept between steps          | gradient                         | optimizer sees     |
/// |-------|-----------------------------|----------------------------------|--------------------|
/// | 0     | the full buffer             | all-reduce (mean over dp)        | the full buffer    |
/// | 1     | the full buffer             | reduce-scatter (mean) to shard   | this rank's shard  |
/// | 2     | the shard; gathered in forward, freed after this block's backward  | … | shard   |
/// | 3     | the shard; gathered for forward, freed, gathered again for backward | … | shard  |
///
/// The tensors optimizers update are registered as this module's parameters (`parameters()`
/// returns them), so stock `torch::optim` optimizers work. At level 1 a step changes only this
/// rank's part of the full buffer, so the first forward after a backward (or after the shard
/// was written through its own version counter) all-gathers the buffer in place; with
/// gradient accumulation that is one gather per micro-batch. Gradients are reduced on a background stream while backward goes
/// on and land in the shards' `.grad` (accumulating, like any parameter) before backward()
/// returns.
///
/// Forward runs the wrapped module inside one autograd node. Without recomputation the inner
/// graph is kept; with it (use_checkpoint) forward saves only the inputs and the RNG state and
/// backward recomputes with the same dropout masks. Level 3 frees the gathered storage after
/// forward even when the inner graph is kept, and refills the same storage before backward.
///
/// Every member of the dp group must run the same modules' forward and backward in the same
/// order (the usual SPMD contract). Not thread-safe.

#include <ztrain/comm/work.h>
#include <ztrain/tp/split.h>
#include <ztrain/zero/flat_param.h>

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ztrain {

struct BlockOptions {
  /// 0: replicated (DDP), 1: sharded optimizer state, 2: + sharded gradients, 3: + sharded
  /// parameters (see the table above).
  int zero_level = 3;
  /// Recompute the forward in backward instead of keeping activations.
  bool use_checkpoint = true;
  /// BlockList: how many following (in backward: preceding) blocks to gather ahead.
  int prefetch_depth = 1;
};

namespace detail {
class ZeroContext;
struct ShardedCall;
class ShardedBackward;
}  // namespace detail

/// One (dtype, requires_grad) group of a sharded module.
struct ShardGroup {
  FlatParamLayout layout;
  bool requires_grad = false;
  /// What the optimizer updates: this rank's shard (levels 1–3) or the full buffer (level 0).
  torch::Tensor shard;
  /// The full flat buffer the wrapped module's parameters point into. At levels 2 and 3 its
  /// storage is released while not gathered.
  torch::Tensor full;
  /// The wrapped module's parameter tensors, in layout order.
  std::vector<torch::Tensor> params;
  /// Their tensor-parallel splits (tp/split.h), in layout order.
  std::vector<std::optional<tp::Split>> splits;
  /// Whether the group holds tensor-parallel slices (different on every tp rank). With a tp
  /// group of more than one rank, split and replicated parameters never share a group.
  bool tp_distinct = false;
};

class ShardedModule : public torch::nn::Module {
 public:
  /// A forward over a list of tensors.
  using Fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

  ~ShardedModule() override;

  const BlockOptions& options() const { return options_; }
  int zero_level() const { return options_.zero_level; }
  const std::vector<ShardGroup>& groups() const { return groups_; }
  /// (group, entry) of every wrapped parameter, in the wrapped module's parameter order.
  const std::vector<std::pair<size_t, size_t>>& parameter_order() const { return order_; }
  /// The module being wrapped, whose parameters keep their names.
  const std::shared_ptr<torch::nn::Module>& wrapped() const { return wrapped_; }

  /// Starts gathering the full parameters on the gather stream unless they are gathered or
  /// being gathered. Collective: every rank must prefetch the same modules in the same order.
  void prefetch();
  /// Makes the full parameters valid (gathering if needed) and waits for them.
  void gather();
  /// Releases the gathered storage (levels 2 and 3; a no-op otherwise).
  void release();
  /// Whether the full buffers are allocated and hold the current values.
  bool is_gathered() const;

  /// Bytes this rank holds between steps for parameters, the gathered buffers now allocated,
  /// and the shards' gradients now allocated.
  int64_t parameter_bytes() const;
  int64_t gathered_bytes() const;
  int64_t gradient_bytes() const;

  /// Modules to prefetch at the start of this one's forward and backward (set by BlockList).
  void set_prefetch_neighbours(std::vector<ShardedModule*> forward, std::vector<ShardedModule*> backward);

  void train(bool on = true) override;

 protected:
  /// Collective over the dp group. `kind` names the module in errors ("Block", …).
  ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, BlockOptions options, std::string kind);

  /// Runs `fn(inputs)` under the ZeRO protocol and returns its outputs, connected to autograd.
  std::vector<torch::Tensor> run(const Fn& fn, const std::vector<torch::Tensor>& inputs);
  /// Whether the outputs of the last run() are still waiting for their backward.
  bool last_call_pending_backward() const;
  /// Called when a backward through this module starts.
  virtual void on_backward() {}

 private:
  friend class detail::ShardedBackward;
  void before(const std::vector<ShardedModule*>& neighbours);
  void start_gather();
  void finish_gather();
  std::vector<torch::Tensor> backward(detail::ShardedCall& call, const std::vector<torch::Tensor>& grads);
  void reduce_gradients();
  std::vector<torch::Tensor> own_outputs(std::vector<torch::Tensor> outputs) const;

  std::shared_ptr<torch::nn::Module> wrapped_;
  BlockOptions options_;
  std::string kind_;
  std::shared_ptr<detail::ZeroContext> context_;
  std::vector<ShardGroup> groups_;
  std::vector<std::pair<size_t, size_t>> order_;
  std::vector<Work> gathering_;     // in-flight gathers, one per group
  bool gathered_ = false;           // full buffers allocated and filled
  bool stale_ = false;              // gradients were reduced since the last gather
  std::vector<int64_t> gathered_versions_;  // shard versions the full buffers were gathered from
  std::vector<ShardedModule*> forward_neighbours_, backward_neighbours_;
  std::weak_ptr<detail::ShardedCall> last_call_;
};

/// Every parameter of `module` under the name a plain libtorch model would give it: sharded
/// modules report their wrapped module's names (not the registered shards), other modules
/// their own parameters. For checkpoints and initialisation.
struct NamedParameterRef {
  std::string name;
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
  /// Where the parameter lives: in a group of a sharded module, or a plain tensor.
  ShardedModule* owner = nullptr;
  size_t group = 0;
  size_t entry = 0;
  torch::Tensor tensor;  // plain parameters only
  /// How a tensor-parallel parameter is split (shape is this rank's slice).
  std::optional<tp::Split> split;

  /// `split` when the runtime's tp group has more than one rank, else nothing.
  std::optional<tp::Split> tp_split() const;
  /// The unsplit shape (shape unless tp_split()).
  std::vector<int64_t> full_shape() const;
};
std::vector<NamedParameterRef> named_parameter_refs(torch::nn::Module& module);

/// The full value of one parameter: gathers its module if needed (collective over dp for
/// sharded parameters at levels 1–3, and over tp for tensor-parallel ones; every rank must ask
/// for the same parameters in the same order) and returns a copy.
torch::Tensor full_parameter(const NamedParameterRef& ref);

/// Every parameter's full value under its plain name (collective; materialises the whole
/// model on every rank, so for tests and small models — save() writes block by block).
std::vector<std::pair<std::string, torch::Tensor>> gathered_parameters(torch::nn::Module& module);

/// Whether `t` is a shard a sharded module at level 1–3 registered: each dp rank holds
/// different elements (gradient norms count it on every rank; replicated tensors once).
bool is_dp_sharded(const torch::Tensor& t);

/// Whether `t` is a tensor a sharded module registered for optimizers (a shard at levels 1–3,
/// the full buffer at level 0): sharded modules wait for pending updates of such tensors
/// themselves (runtime/pending_updates.h), so an optimizer may update them asynchronously.
bool is_sharded_module_tensor(const torch::Tensor& t);

/// Waits for the gradient reductions still in flight (backward() waits for them itself; this
/// is for code that calls torch::autograd::grad or runs backward on another thread).
void wait_gradient_reductions();

}  // namespace ztrain
