#pragma once
/// ztrain::nn: drop-ins for torch::nn::Linear and torch::nn::Embedding that a tensor-parallel
/// policy can split after the model is built.
///
/// Alone they are the torch layers: the same options, parameter names ("weight" [out, in] and
/// "bias"; "weight" [num, dim]), initial values (the same draws from the default generator in
/// the same order, so a model seeded alike holds the same numbers) and arithmetic. A model that
/// writes `ztrain::nn::Linear` where it wrote `torch::nn::Linear` runs unchanged — alone and
/// under every plugin — and its files are the same. What they add is parallelize(): a policy
/// (booster/policy.h, HybridParallel) names which layers split over a tp group and how, and
/// each slices its own parameters in place — the parameter objects stay, so an optimizer built
/// over the model keeps its references — declares the split in its records (so files, gathered
/// optimizer state and init_parameters keep the full tensors) and from then on computes as the
/// Megatron-LM layer of tp/layers.h does:
///
/// | role       | layer     | this rank holds                   | forward / backward comm.     |
/// |------------|-----------|-----------------------------------|------------------------------|
/// | kColumn    | Linear    | output features (each fused part) | identity / all-reduce of dx  |
/// | kRow       | Linear    | input features; the bias whole    | all-reduce of y / identity   |
/// | kVocab     | Embedding | vocabulary rows (padded to tp)    | all-reduce of rows / identity|
/// | kReplicated| both      | everything                        | none                         |
///
///   struct MlpImpl : torch::nn::Module {
///     MlpImpl() { register_module("up", up); register_module("down", down); }
///     torch::Tensor forward(const torch::Tensor& x) { return down(torch::gelu(up(x))); }
///     ztrain::nn::Linear up{512, 2048}, down{2048, 512};
///   };
///   mlp->up->parallelize({.role = ztrain::nn::TpRole::kColumn}, tp);   // what a policy does
///   mlp->down->parallelize({.role = ztrain::nn::TpRole::kRow}, tp);
///
/// Inputs must be the same on every rank of the group (the tp layers' rule), and the layers
/// must hold the same values on every rank when split (HybridParallel broadcasts them first).

#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/parameter_record.h>

#include <torch/torch.h>

#include <string>

namespace ztrain::nn {

enum class TpRole {
  kReplicated,  // whole on every rank: the layer as built
  kColumn,      // Linear: output features split
  kRow,         // Linear: input features split, output all-reduced
  kVocab,       // Embedding: vocabulary rows split
};

/// "column", "row", "vocab", "replicated".
std::string role_name(TpRole role);

/// How a layer splits.
struct TpStyle {
  TpRole role = TpRole::kReplicated;
  /// kColumn: the output is this many equal consecutive blocks, each split over the group, so
  /// each rank holds the same features of every block (3 for a fused q, k, v projection).
  int64_t fused_parts = 1;
  /// kColumn: all-gather the output, so the model sees the full features (a head whose full
  /// logits the model's loss reads); otherwise the output is this rank's [.., out / tp].
  bool gather_output = false;
  /// kRow: the input arrives split by features (after a kColumn layer); otherwise it is the
  /// full input and each rank takes its features.
  bool input_is_parallel = true;
};

/// Marks every parameter record of `module` that names no context as living on `context`
/// (what a plugin that lays a model out on a mesh of its own does after splitting it).
void adopt_records(torch::nn::Module& module, ParallelContext& context);

/// torch::nn::Linear, splittable by columns or rows.
class LinearImpl : public torch::nn::Module, public ParameterRecords {
 public:
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  /// torch::nn::Linear's initialisation: weight kaiming-uniform (a = √5), bias U(±1/√in).
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& x);
  /// Splits the layer over `group` as `style` says (kColumn, kRow or kReplicated), in place,
  /// its records naming `context` (null: the default context). Once; the values must be the
  /// same on every rank of the group. Throws ztrain::Error when a split dimension does not
  /// divide by the group's size or the role is not a Linear's.
  void parallelize(const TpStyle& style, Communicator& group, ParallelContext* context = nullptr);
  const TpStyle& style() const { return style_; }

  torch::nn::LinearOptions options;
  torch::Tensor weight, bias;

 private:
  TpStyle style_;
  Communicator* group_ = nullptr;
};
TORCH_MODULE(Linear);

/// torch::nn::Embedding (num_embeddings and embedding_dim; the other options are refused),
/// splittable by vocabulary rows. Weight decay skips its weight (optim::default_weight_decay).
class EmbeddingImpl : public torch::nn::Module, public ParameterRecords {
 public:
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}
  /// torch::nn::Embedding's initialisation: N(0, 1).
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& tokens);
  /// Splits the table's rows over `group` (kVocab; a vocabulary that does not divide is padded
  /// with zero rows at its end, which files never hold), or keeps it whole (kReplicated).
  void parallelize(const TpStyle& style, Communicator& group, ParallelContext* context = nullptr);
  const TpStyle& style() const { return style_; }
  /// The group the rows are split over (kVocab), else null.
  Communicator* vocab_group() const { return style_.role == TpRole::kVocab ? group_ : nullptr; }

  torch::nn::EmbeddingOptions options;
  torch::Tensor weight;

 private:
  TpStyle style_;
  Communicator* group_ = nullptr;
};
TORCH_MODULE(Embedding);

}  // namespace ztrain::nn
