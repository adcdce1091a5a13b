#pragma once
/// Parameter groups for weight decay, as every peer makes them: decay the weights of linear
/// and convolution layers, not biases, normalisation weights or embeddings.
///
///   auto opt = ztrain::optim::AdamW(ztrain::optim::weight_decay_groups(*model, options), options);
///
/// The groups survive flat sharding: a sharded module (Block, DistributedParameter) lays the
/// parameters weight decay skips out in flat groups of their own, whose records say so, so its
/// shards fall in the right group at every ZeRO level.

#include <ztrain/runtime/parameter_record.h>

#include <torch/torch.h>

#include <memory>
#include <unordered_set>
#include <vector>

namespace ztrain::optim {

/// For each parameter of `module`, in recorded_parameters() order, whether weight decay applies
/// to it by default. It does not to
/// - biases and normalisation weights: tensors of fewer than two dimensions;
/// - embeddings: the weight of a torch::nn::Embedding, and parameters whose record says
///   no_weight_decay (ztrain::nn::Embedding's and tp::VocabParallelEmbedding's weights, a
///   DistributedParameter made with `.weight_decay = false`, a sharded module's flat group of
///   such parameters);
/// and does to every other parameter (a sharded module's flat group of decayed parameters too,
/// whatever its shape).
std::vector<bool> default_weight_decay(torch::nn::Module& module);

/// The trainable parameters of `model` (each once) in two groups: those weight decay applies to
/// (default_weight_decay), with the optimizer's defaults, and the rest, with weight decay 0.
/// An empty group is left out. `Options` is the optimizer's options type (it must have
/// weight_decay(double)): torch::optim::AdamWOptions, SGDOptions, ztrain::optim::AdamOptions.
template <class Options>
std::vector<torch::optim::OptimizerParamGroup> weight_decay_groups(torch::nn::Module& model, const Options& options) {
  const auto params = recorded_parameters(model);
  const auto decays = default_weight_decay(model);
  std::vector<torch::Tensor> with, without;
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i].tensor;
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (decays[i] ? with : without).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!with.empty()) groups.emplace_back(with);
  if (!without.empty()) {
    auto no_decay = std::make_unique<Options>(options);
    no_decay->weight_decay(0);
    groups.emplace_back(without, std::move(no_decay));
  }
  return groups;
}

}  // namespace ztrain::optim
