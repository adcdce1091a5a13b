#pragma once
/// The ZeRO machinery shared by Block and DistributedParameter: a wrapped user module whose
/// parameters live in flat, sharded buffers over the data-parallel group of a parallel context
/// (BlockOptions::context; the default context when not set).
///
/// Construction (collective over the dp group) groups the wrapped module's parameters by
/// (dtype, requires_grad), lays each group out in a flat buffer (FlatParamLayout) on the
/// context's device, broadcasts the buffer from dp rank 0 so every rank starts from the same
/// values, and points the user's parameter tensors into it: the user's module keeps its
/// parameter objects and names, only their storage moves — to the context's device, from
/// wherever the module was built (as FSDP's device_id). What stays between steps depends on the ZeRO level (level_policy.h):
///
/// | level | kept between steps          | gradient                         | optimizer sees     |
/// |-------|-----------------------------|----------------------------------|--------------------|
/// | 0     | the full buffer             | all-reduce (mean over dp)        | the full buffer    |
/// | 1     | the full buffer             | reduce-scatter (mean) to shard   | this rank's shard  |
/// | 2     | the shard; gathered in forward, freed after this block's backward  | … | shard   |
/// | 3     | the shard; gathered for forward, freed, gathered again for backward | … | shard  |
///
/// The tensors optimizers update are registered as this module's parameters (`parameters()`
/// returns them), so stock `torch::optim` optimizers work; their records
/// (runtime/parameter_record.h) say which are dp shards, which hold tensor-parallel slices, and
/// carry the fence an asynchronous optimizer sets (the module waits on it before it reads). At level 1 a step changes only this
/// rank's part of the full buffer, so the first forward after a backward (or after the shard
/// was written through its own version counter) all-gathers the buffer in place; with
/// gradient accumulation that is one gather per micro-batch. Gradients are reduced on a background stream while backward goes
/// on, each added to its shard's `.grad` (accumulating, like any parameter) by the stream, and
/// all of them have landed when backward() returns.
///
/// Forward runs the wrapped module inside one autograd node. Without recomputation the inner
/// graph is kept; with it (use_checkpoint) forward saves only the inputs and the RNG state and
/// backward recomputes with the same dropout masks. Level 3 frees the gathered storage after
/// forward even when the inner graph is kept, and refills the same storage before backward.
///
/// Every member of the dp group must run the same modules' forward and backward in the same
/// order (the usual SPMD contract). Not thread-safe.

#include <ztrain/comm/work.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/runtime/parameter_record.h>
#include <ztrain/zero/flat_param.h>
#include <ztrain/zero/level_policy.h>

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
  /// The mesh whose dp group shards the parameters. Not set: the default context.
  std::shared_ptr<ParallelContext> context;
  /// Levels 2 and 3 on the CPU: this rank's parameter shards and reduced gradients live in files
  /// in this directory instead of memory (ZeRO-Infinity's parameter offload to disk; with AdamW's
  /// state_dir, the whole model state is on disk). Each is a shared mapping of an unlinked file
  /// of its own; a gather reads its shard in ahead, the optimizer writes it back and drops it
  /// after its update, and the kernel pages the rest in and out as memory allows. Values are the
  /// same bit for bit. Unset: in memory.
  std::optional<std::string> offload_dir;
};

namespace detail {
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
  /// storage is released while not gathered, unless it is `mapped`.
  torch::Tensor full;
  /// Levels 2–3 with the dp ranks on one host and host-shared buffers, for a shard of 256 KiB or
  /// more: `full` maps the ranks' shards end to end (host_shared_view_of_members) instead of
  /// holding gathered copies, for the module's life; a gather only waits until every rank's
  /// shard is up to date.
  bool mapped = false;
  /// The wrapped module's parameter tensors, in layout order.
  std::vector<torch::Tensor> params;
  /// Their tensor-parallel splits (from their owners' records), in layout order.
  std::vector<std::optional<TensorSplit>> splits;
  /// Whether the group holds tensor-parallel slices (different on every rank of `tp_group`).
  /// Split and replicated parameters never share a group when the tp group has several ranks.
  bool tp_distinct = false;
  /// The group the split parameters are cut over (null when none is split).
  Communicator* tp_group = nullptr;
};

/// How a sharded module forms its flat groups beyond (dtype, requires_grad, tensor-parallel,
/// weight decay): parameters of different units never share a group (`unit` maps a parameter
/// to its unit; unset: one unit; every dp rank must give the same, as the ranks compare them),
/// and a group takes no more parameters once it holds `max_group_bytes` (0: no limit; one
/// parameter may exceed it). Plugins use it to keep optimizer parameter groups apart and to cut
/// buckets.
struct ShardGrouping {
  std::function<int(const torch::Tensor&)> unit;
  int64_t max_group_bytes = 0;
};

class ShardedModule : public torch::nn::Module, public ParameterRecords {
 public:
  /// A forward over a list of tensors.
  using Fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

  ~ShardedModule() override;

  const BlockOptions& options() const { return options_; }
  int zero_level() const { return options_.zero_level; }
  /// What this module's level shards, gathers and reduces.
  const LevelPolicy& policy() const { return *policy_; }
  /// The mesh whose dp group shards this module.
  ParallelContext& context() const { return *context_; }
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
  /// Whether the full buffers map the dp ranks' shards (ShardGroup::mapped).
  bool maps_shards() const;
  /// The shards were written where the module cannot see it (an optimizer stepping outside a
  /// backward through the module); the next gather() refreshes the full buffers, and a gather
  /// in flight (a prefetch) is made again once it has landed.
  void shards_changed();
  /// Waits until no asynchronous optimizer is writing this module's shards; rethrows its error.
  void wait_for_updates() const;

  /// Bytes this rank holds between steps for parameters, the gathered buffers now allocated
  /// (mapped groups hold none: what they show is the ranks' shards), and the gradients now
  /// allocated (the shards', and those held unreduced by set_gradient_sync).
  int64_t parameter_bytes() const;
  int64_t gathered_bytes() const;
  int64_t gradient_bytes() const;

  /// Off: backward passes keep this module's flat gradients on this rank, summed and unreduced
  /// (a full-size buffer per group, at every level), and the next backward with sync on adds
  /// them to its own and reduces the sum once — gradient accumulation that communicates once per
  /// step, as DDP's and FSDP's no_sync. Use it for all but the last micro-batch of a step: the
  /// optimizer must not step on a held sum. Every dp rank must switch alike. NoGradientSync
  /// switches a whole model.
  void set_gradient_sync(bool on) { gradient_sync_ = on; }
  bool gradient_sync() const { return gradient_sync_; }

  /// Modules to prefetch at the start of this one's forward and backward (set by BlockList and
  /// FullyShard). At level 3 the last of such a chain (backward neighbours, no forward ones)
  /// keeps its gathered parameters from its forward to its backward, which comes next.
  void set_prefetch_neighbours(std::vector<ShardedModule*> forward, std::vector<ShardedModule*> backward);
  /// Called at the start of every forward through this module (not a recomputation in
  /// backward), before its parameters are gathered: how FullyShard records execution order.
  void set_forward_observer(std::function<void(ShardedModule&)> observer) { forward_observer_ = std::move(observer); }
  /// How many forwards and backwards found this module's parameters neither gathered nor being
  /// gathered, and so waited for a whole gather: the prefetches that did not come.
  int64_t gathers_on_demand() const { return gathers_on_demand_; }

  void train(bool on = true) override;

  /// Whether it stands for one parameter of its parent, named by the key it is registered under
  /// (Python's DistributedParameter): checkpoints and initialisation then call that parameter
  /// "<parent path>.<key>", not "<parent path>.<key>.<its own name>".
  virtual bool named_by_key() const { return false; }

 protected:
  /// Collective over the dp group. `kind` names the module in errors ("Block", …).
  ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, BlockOptions options, std::string kind);

  ShardedModule(std::shared_ptr<torch::nn::Module> wrapped, BlockOptions options, std::string kind,
                const ShardGrouping& grouping);

  /// Runs `fn(inputs)` under the ZeRO protocol and returns its outputs, connected to autograd.
  std::vector<torch::Tensor> run(const Fn& fn, const std::vector<torch::Tensor>& inputs);
  /// Whether the outputs of the last run() are still waiting for their backward.
  bool last_call_pending_backward() const;
  /// Called when a backward through this module starts.
  virtual void on_backward() {}
  /// Group g's flat gradient buffer for a backward through this module still to come, made now,
  /// for one operator: a gradient that it computes into its parameter's place there (and hands
  /// to autograd) then needs no copy into the buffer. Undefined when the buffer was handed out
  /// already, so that two operators never write the same place. The backward that the gradient
  /// arrives at takes the buffer over; one it does not arrive at, with no other still to come,
  /// lets it go.
  torch::Tensor gradient_buffer_ahead(size_t g);
  /// Whether this module keeps its own last output. The graph of that output then refers to the
  /// module weakly (a strong reference would make a cycle that outlives the model when no
  /// backward comes), and a backward after the module is gone raises.
  virtual bool keeps_its_output() const { return false; }

 private:
  friend class detail::ShardedBackward;
  void before(const std::vector<ShardedModule*>& neighbours);
  void start_gather();
  void finish_gather();
  std::vector<torch::Tensor> backward(detail::ShardedCall& call, const std::vector<torch::Tensor>& grads);
  void reduce_gradient(size_t group, torch::Tensor flat_grad);
  std::vector<torch::Tensor> own_outputs(std::vector<torch::Tensor> outputs) const;
  /// The fence an asynchronous optimizer sets on group g's shard (its record holds it too).
  const UpdateFence& fence(size_t g) const { return *fences_[g]; }

  std::shared_ptr<torch::nn::Module> wrapped_;
  BlockOptions options_;
  std::string kind_;
  std::shared_ptr<ParallelContext> context_;
  const LevelPolicy* policy_ = nullptr;
  std::vector<std::shared_ptr<UpdateFence>> fences_;  // one per group, shared with its record
  std::vector<ShardGroup> groups_;
  std::vector<std::pair<size_t, size_t>> order_;
  std::vector<Work> gathering_;     // in-flight gathers, one per group
  bool gathered_ = false;           // full buffers allocated and filled
  bool stale_ = false;              // the shards changed since the last gather
  bool changed_while_gathering_ = false;
  std::vector<int64_t> gathered_versions_;  // shard versions the full buffers were gathered from
  std::vector<int64_t> gathering_versions_;  // and those of the gathers in flight (-1: known at the end)
  std::vector<ShardedModule*> forward_neighbours_, backward_neighbours_;
  std::function<void(ShardedModule&)> forward_observer_;
  int64_t gathers_on_demand_ = 0;
  std::weak_ptr<detail::ShardedCall> last_call_;
  bool gradient_sync_ = true;
  std::vector<torch::Tensor> held_grads_;  // per group: unreduced gradients summed while sync is off
  std::vector<torch::Tensor> ahead_grads_;  // per group: gradient_buffer_ahead's, for a backward to come
};

/// While it lives, every ShardedModule in `module` (Blocks, DistributedParameters, the module
/// itself) holds its gradients unreduced (ShardedModule::set_gradient_sync); the first backward
/// after it reduces each sum once.
///
///   for (int i = 0; i < k; ++i) {
///     std::optional<ztrain::NoGradientSync> hold;
///     if (i + 1 < k) hold.emplace(*model);        // reduce once, in the last micro-batch
///     mgr.backward(model->loss(micro[i]) / k);
///   }
class NoGradientSync {
 public:
  explicit NoGradientSync(torch::nn::Module& module);
  ~NoGradientSync();
  NoGradientSync(const NoGradientSync&) = delete;
  NoGradientSync& operator=(const NoGradientSync&) = delete;

 private:
  std::vector<std::pair<ShardedModule*, bool>> switched_;  // each module and its setting before
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
  /// How a tensor-parallel parameter is split (shape is this rank's slice), and over which group.
  std::optional<TensorSplit> split;
  Communicator* tp_group = nullptr;

  /// `split` when its tp group has more than one rank, else nothing.
  std::optional<TensorSplit> tp_split() const;
  /// The unsplit shape (shape unless tp_split()).
  std::vector<int64_t> full_shape() const;
  /// The rank's dp group and position in it, for a sharded parameter (null and 0 otherwise).
  Communicator* dp_group() const { return owner ? &owner->context().dp() : nullptr; }
};
std::vector<NamedParameterRef> named_parameter_refs(torch::nn::Module& module);

/// The full value of one parameter: gathers its module if needed (collective over dp for
/// sharded parameters at levels 1–3, and over tp for tensor-parallel ones; every rank must ask
/// for the same parameters in the same order) and returns a copy. Waits for a pending
/// asynchronous update of it first.
torch::Tensor full_parameter(const NamedParameterRef& ref);

/// Every parameter's full value under its plain name (collective; materialises the whole
/// model on every rank, so for tests and small models — save() writes block by block).
std::vector<std::pair<std::string, torch::Tensor>> gathered_parameters(torch::nn::Module& module);

/// Waits for the gradient reductions still in flight on `context`'s reduction stream (the
/// default context's when null). backward() waits for them itself; this is for code that runs
/// backward on another thread.
void wait_gradient_reductions(ParallelContext* context = nullptr);

}  // namespace ztrain
