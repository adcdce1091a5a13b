#pragma once
/// DistributedParameter: one sharded parameter outside any block (a token embedding, a final
/// norm), gathered once per forward.
///
/// `forward()` (or calling the holder) returns the full tensor. The first call of a forward
/// gathers it; later calls before its backward return the same tensor, so a weight used twice
/// (an embedding tied to the LM head) is gathered once and its gradient — the sum over both
/// uses — reduce-scattered once. Levels as Block (default 2: the gathered tensor is kept until
/// its backward; at level 3 each use owns a copy instead, except where the full tensor maps
/// the ranks' shards on one host, ShardGroup::mapped, and is returned as it is). The returned
/// tensor is valid until the backward that consumes it.
///
/// Checkpoints and initialisation see the parameter under `<module path>.<name>` with its full
/// shape; `parameters()` returns the shard an optimizer updates. Construction is collective
/// over the data-parallel group (the value is broadcast from dp rank 0), so is every forward.
///
///   struct GptImpl : torch::nn::Module {
///     ztrain::DistributedParameter wte{torch::randn({256, 64}) * 0.02};
///     GptImpl() { register_module("wte", wte); }                // saved as "wte.weight"
///     torch::Tensor forward(torch::Tensor ids) {
///       auto w = wte();
///       return torch::matmul(torch::embedding(w, ids), w.t());  // tied: one gather
///     }
///   };

#include <ztrain/zero/sharded_module.h>

namespace ztrain {

struct DistributedParameterOptions {
  int zero_level = 2;
  /// The parameter's name inside this module.
  std::string name = "weight";
  bool requires_grad = true;
  /// The value is this rank's slice of a tensor-parallel parameter split this way over the
  /// context's tp group (tp/split.h); checkpoints and init_parameters then see the full tensor.
  std::optional<TensorSplit> tp_split;
  /// The mesh whose dp group shards it. Not set: the default context.
  std::shared_ptr<ParallelContext> context;
  /// Whether weight decay applies to it by default (optim::default_weight_decay): false for an
  /// embedding; a tensor of fewer than two dimensions never decays.
  bool weight_decay = true;
};

class DistributedParameterImpl : public ShardedModule {
 public:
  explicit DistributedParameterImpl(torch::Tensor value, DistributedParameterOptions options = {});

  /// The full tensor (see above).
  torch::Tensor forward();
  /// The next call gathers again, starting a forward of its own, instead of returning the
  /// tensor of a forward whose backward is still to come: for micro-batches in flight together
  /// (a pipeline schedule runs forwards ahead of backwards), each with its own backward.
  void new_forward() { cached_ = torch::Tensor(); }
  const std::string& name() const { return name_; }
  /// A place for the value's whole gradient (full shape, uninitialised) in the buffer a backward
  /// through it reduces, for one operator that computes that gradient itself, such as a tied LM
  /// head's weight-gradient gemm: a gradient made there and handed to autograd, alone or with
  /// more added to it in place, is reduced from there by the backward it arrives at, without a
  /// copy. Undefined where the parameter takes no gradient or the place is handed out already
  /// (a second use then computes its gradient out of place, as usual).
  torch::Tensor gradient_place();

 private:
  void on_backward() override { cached_ = torch::Tensor(); }
  bool keeps_its_output() const override { return true; }

  std::string name_;
  torch::Tensor cached_;
  bool cached_with_grad_ = false;
  std::vector<int64_t> cached_versions_;
};

/// The module holder of DistributedParameterImpl.
class DistributedParameter : public torch::nn::ModuleHolder<DistributedParameterImpl> {
 public:
  using torch::nn::ModuleHolder<DistributedParameterImpl>::ModuleHolder;
  DistributedParameter(torch::Tensor value, DistributedParameterOptions options = {})
      : ModuleHolder(std::make_shared<DistributedParameterImpl>(std::move(value), std::move(options))) {}
};

}  // namespace ztrain
