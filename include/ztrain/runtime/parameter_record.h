#pragma once
/// What a parameter is beyond its values: one record per parameter, held by the module that
/// owns the parameter.
///
/// The facts other parts need about a parameter tensor — whether it is a tensor-parallel slice
/// and how it cuts its full tensor, whether each data-parallel rank holds a different shard of
/// it, how many pipeline stages hold a tied copy, whether an asynchronous optimizer is still
/// writing it — live in a ParameterRecord kept by the module that registered the tensor
/// (a ParameterRecords module: tensor-parallel layers, Blocks, DistributedParameters). Who
/// declares a fact writes the owner's record: a tensor-parallel layer its split, a sharded
/// module its shard, Pipeline::tie the copies, an asynchronous optimizer its pending write. Who
/// needs the facts walks the model (`recorded_parameters`): gradient norms, checkpoints,
/// initialisation. A plain libtorch parameter has no record: replicated, unsplit, untied, never
/// written behind its reader's back. Nothing is keyed by tensor address, so nothing goes stale
/// when tensors die or addresses are reused.
///
///   struct HeadImpl : torch::nn::Module, ztrain::ParameterRecords {
///     HeadImpl(ztrain::ParallelContext& ctx, int64_t vocab, int64_t d) {
///       weight = register_parameter("weight", torch::zeros({vocab / ctx.tp().size(), d}));
///       declare_split("weight", weight, {.dim = 0}, &ctx.tp());   // rows of the vocabulary
///     }
///     torch::Tensor weight;
///   };
///   for (const auto& p : ztrain::recorded_parameters(*model)) { ... p.record ... }

#include <ztrain/comm/communicator.h>

#include <torch/torch.h>

#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ztrain {

class ParallelContext;

/// How a tensor-parallel parameter slices its full tensor: along `dim` the full tensor is
/// `parts` consecutive equal blocks (three for a fused q, k, v projection), each cut into as many
/// equal chunks as the group has ranks, chunk r held by rank r. With parts = 1, rank r holds the
/// r-th 1/size of the dimension, as in Megatron-LM.
///
/// `padding` (with parts = 1) makes a dimension that does not divide by the ranks split anyway:
/// the full tensor is extended by that many zero entries at its end before it is cut, so the
/// last rank's slice ends with them (a vocabulary of 50257 over 2 ranks: 25129 rows each, the
/// last one padding). Full tensors — files, full_parameter — never include the padding.
struct TensorSplit {
  int64_t dim = 0;
  int64_t parts = 1;
  int64_t padding = 0;
  bool operator==(const TensorSplit&) const = default;
};

/// The padding that makes `n` divide into `size` ranks: 0 when it does.
inline int64_t padding_for(int64_t n, int size) { return (size - n % size) % size; }

/// The full shape (without padding) of a slice shaped `local` split `split` over `size` ranks.
std::vector<int64_t> full_shape(c10::IntArrayRef local, TensorSplit split, int size);
/// Rank `rank`'s slice (contiguous) of `full` split `split` over `size` ranks, padded as the
/// split says. Throws ztrain::Error when the split dimension does not divide evenly.
torch::Tensor slice(const torch::Tensor& full, TensorSplit split, int rank, int size);
/// The full tensor, without padding, from every rank's `local` slice (collective over `group`;
/// not autograd).
torch::Tensor assemble(const torch::Tensor& local, TensorSplit split, Communicator& group);

/// A write to a parameter that another thread is still running (an asynchronous optimizer's
/// update). The writer sets it; a reader waits before it reads. Thread-safe.
class UpdateFence {
 public:
  /// Registers a write that completes with `done`, replacing an earlier one.
  void set(std::shared_future<void> done);
  /// Whether a registered write has not completed yet. Never blocks.
  bool pending() const;
  /// Blocks until the registered write (if any) completes; rethrows the writer's error.
  void wait() const;

 private:
  mutable std::mutex mutex_;
  std::shared_future<void> done_;
};

struct ParameterRecord {
  /// The mesh the parameter lives on (whose dp and tp groups the facts below refer to); null
  /// for the default context.
  ParallelContext* context = nullptr;
  /// Set for this rank's slice of a tensor-parallel parameter.
  std::optional<TensorSplit> tp_split;
  /// The group a tp_distinct parameter differs across (a split parameter's slices are spread
  /// over it).
  Communicator* tp_group = nullptr;
  /// The values differ across tp_group: a split parameter, or a flat shard of split ones.
  bool tp_distinct = false;
  /// Every rank of the context's dp group holds a different part (a ZeRO shard at level 1–3);
  /// otherwise the dp group holds copies.
  bool dp_sharded = false;
  /// Pipeline stages holding a copy of this parameter (pipe::Pipeline::tie); their gradients
  /// are equal once summed, so a global norm counts each copy 1/tied_copies times.
  int tied_copies = 1;
  /// Weight decay skips it (optim::default_weight_decay): an embedding, or a sharded module's
  /// flat group of parameters that weight decay skips.
  bool no_weight_decay = false;
  /// A sharded module's flat group (or this rank's shard of it): one tensor holding several
  /// parameters, whose own shape says nothing of theirs.
  bool flat = false;
  /// Where the owner waits for asynchronous writes before reading the parameter (sharded
  /// modules). Null: the owner reads without waiting, so optimizers must update it in step().
  std::shared_ptr<UpdateFence> update;
};

/// The records of the parameters a module registers itself, by their names in the module.
/// Mix it into a module class next to torch::nn::Module.
class ParameterRecords {
 public:
  virtual ~ParameterRecords() = default;
  /// The record of this module's own parameter `name`, made on first use.
  ParameterRecord& record(const std::string& name) { return records_[name]; }
  /// The record of `name`, or null when none was made.
  const ParameterRecord* find_record(const std::string& name) const;
  /// Declares parameter `name` (the tensor `param`) this rank's slice of a full tensor cut as
  /// `split` over `group` (which may be null for one rank). Throws ztrain::Error when the split
  /// does not fit the tensor's shape.
  void declare_split(const std::string& name, const torch::Tensor& param, TensorSplit split, Communicator* group);

 private:
  std::map<std::string, ParameterRecord> records_;
};

/// The record `module` keeps for its own parameter `name`, or null (a plain parameter, or a
/// module that keeps no records).
const ParameterRecord* record_of(const torch::nn::Module& module, const std::string& name);

/// One parameter reachable from a model: its qualified name, the tensor and its owner's record
/// (null for a plain parameter).
struct RecordedParameter {
  std::string name;
  torch::Tensor tensor;
  const ParameterRecord* record = nullptr;
};
/// Every parameter of `module` and its children, as named_parameters() lists them (in its order;
/// a tensor registered under two names appears twice, as there).
std::vector<RecordedParameter> recorded_parameters(torch::nn::Module& module);

/// Waits until no asynchronous write of `module`'s parameters is pending; rethrows the first
/// writer's error.
void wait_for_updates(torch::nn::Module& module);

/// The context `module`'s parameters live on: the one their records name (they must agree, or
/// ztrain::Error), else the runtime's default context, else null (no runtime).
ParallelContext* context_of(torch::nn::Module& module);

}  // namespace ztrain
