#pragma once
/// Policy: how one model family splits over tensor-parallel ranks (ColossalAI's Shardformer
/// policies), the only model-specific part of HybridParallel.
///
/// A policy maps module paths — the names named_modules() gives, with `*` standing for one
/// path component, so "layers.*.attention.wq" names that projection in every layer — to how
/// the layer there splits (nn::TpStyle: column, row, vocabulary; fused parts; a gathered
/// output). The layers it names must be ztrain::nn::Linear and ztrain::nn::Embedding
/// (tp/nn.h), the drop-ins for torch's, or the tp:: parallel linears (tp/layers.h) built over
/// one rank, which a rule splits as they were built to (its fused parts, gathered output and
/// parallel input must match theirs); everything it does not name stays replicated. A model
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
///
/// For pipeline stages the policy also says how the model's forward falls into pieces
/// (PipelinePolicy, ColossalAI's held layers and per-family pipeline forwards): the LayerList
/// the stages split, the modules only the first and the last stage hold, those both hold as
/// one (a head tied to the embedding), and the three pieces of the forward — the embedding,
/// one layer, the head with the loss — as calls into the model. A stage holds its layers and
/// ends only; it lets go of the rest.

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

using TensorList = std::vector<torch::Tensor>;

/// How a model's forward splits into pipeline stages.
struct PipelinePolicy {
  /// The path of the ztrain::LayerList whose layers the stages share out, in order.
  std::string layers;
  /// The modules (paths) that only the first stage holds (embeddings), and only the last (the
  /// final norm, the head); every other stage lets go of them.
  std::vector<std::string> first_stage, last_stage;
  /// The modules (paths) that the first and the last stage both hold and that are one module of
  /// the model (GPT-2's token embedding, whose weight its head reuses): the two stages keep a
  /// copy each, equal at the start, whose gradients are summed across them before the step, so
  /// the copies step alike; the stages between let go of them. Each must own its parameters
  /// directly (an embedding, a linear), not through submodules.
  std::vector<std::string> tied;
  /// First stage: a micro-batch → what the first layer takes.
  std::function<TensorList(torch::nn::Module& model, const TensorList& micro_batch)> embed;
  /// Layer `index` of the list on the tensors flowing through the stages.
  std::function<TensorList(torch::nn::Module& model, int64_t index, const TensorList& x)> layer;
  /// Last stage: the last layer's output and the micro-batch → the micro-batch's mean loss.
  std::function<torch::Tensor(torch::nn::Module& model, const TensorList& x, const TensorList& micro_batch)> loss;
  /// Checks a micro-batch (shapes, dtype, length), throwing ztrain::Error that says what is
  /// wrong. Called on every rank before the stages run, so that a bad micro-batch fails on every
  /// stage, not on one while the others wait for it. Optional.
  std::function<void(torch::nn::Module& model, const TensorList& micro_batch)> check;
  /// Whether the policy describes a pipeline split at all.
  explicit operator bool() const { return !layers.empty(); }
};

struct Policy {
  /// The model family, in messages.
  std::string name = "policy";
  /// How the named layers split over the tp group, first matching rule per module.
  std::vector<TpRule> tensor_parallel;
  /// How the model falls into pipeline stages (needed for pp_size > 1).
  PipelinePolicy pipeline;
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
