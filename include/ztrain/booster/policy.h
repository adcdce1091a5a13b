#pragma once
/// Policy: how one model family splits over tensor-parallel ranks (ColossalAI's Shardformer
/// policies), the only model-specific part of HybridParallel.
///
/// A policy maps module paths — the names named_modules() gives, with `*` standing for one
/// path component, so "layers.*.attention.wq" names that projection in every layer — to how
/// the layer there splits (nn::TpStyle: column, row, vocabulary; fused parts; a gathered
/// output). The layers it names must be ztrain::nn::Linear and ztrain::nn::Embedding
/// (tp/nn.h), the drop-ins for torch's; everything it does not name stays replicated. A model
/// whose forward reads a size that the split changes (a head count in a view) says how to
/// adjust it in `adapt`, called after the split with the tp size.
///
///   ztrain::Policy llama_policy() {
///     using ztrain::nn::TpRole;
///     return {.name = "llama",
///             .tensor_parallel = {{"tok_embeddings", {.role = TpRole::kVocab}},
///                                 {"layers.*.attention.wq", {.role = TpRole::kColumn}},
///                                 {"layers.*.attention.wo", {.role = TpRole::kRow}},
///                                 {"output", {.role = TpRole::kColumn, .gather_output = true}}},
///             .adapt = [](torch::nn::Module& m, int tp) { /* heads per rank: heads / tp */ }};
///   }
///
/// Applying it is checked: every rule must name at least one module, a module may match one
/// rule, and each must be a ztrain::nn layer whose role fits it; errors name the path.

#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/parallel_context.h>
#include <ztrain/tp/nn.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace ztrain {

struct TpRule {
  /// A module path; `*` matches one component (never a dot).
  std::string path;
  nn::TpStyle style;
};

struct Policy {
  /// The model family, in messages.
  std::string name = "policy";
  /// How the named layers split over the tp group, first matching rule per module.
  std::vector<TpRule> tensor_parallel;
  /// Adjusts what the model's forward reads that the split changed (heads per rank), given the
  /// tp size. Optional.
  std::function<void(torch::nn::Module& model, int tp_size)> adapt;
};

/// Whether module path `path` matches `pattern` (`*`: one component).
bool path_matches(const std::string& pattern, const std::string& path);

/// Splits `model`'s layers over `tp` as `policy` says, their records naming `context`; then
/// policy.adapt. Throws ztrain::Error naming the rule or path that does not apply.
void apply_tensor_parallel(torch::nn::Module& model, const Policy& policy, Communicator& tp, ParallelContext* context);

}  // namespace ztrain
