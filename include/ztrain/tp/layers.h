#pragma once
/// Tensor-parallel layers with Megatron-LM semantics over a tp group.
///
/// Every rank of the tp group holds one slice of each weight and computes one replicated loss;
/// the conjugate communication (functional.h's *_group functions) makes input, weight and bias
/// gradients exact — none is lost and none is scaled by the group size. Each layer keeps the
/// records of its parameters (runtime/parameter_record.h) and declares the split ones there
/// (tp/split.h), so init_parameters draws the full tensors, and model files and gathered
/// optimizer state hold them unsplit and load at any tp size.
///
/// | layer                 | weight slice                         | forward / backward comm.        |
/// |-----------------------|--------------------------------------|---------------------------------|
/// | ColumnParallelLinear  | output features (each fused part)    | identity / all-reduce of dx     |
/// | RowParallelLinear     | input features                       | all-reduce of y / identity      |
/// | VocabParallelEmbedding| vocabulary rows                      | all-reduce of rows / identity   |
/// | parallel_cross_entropy| logits split over the vocabulary     | max, sum-exp, target logit      |
///
/// Inputs must be the same on every rank of the tp group (same batch, same dropout masks); the
/// runtime seeds the default generator the same across a tp group for that. With one rank the
/// layers are their dense counterparts with no communication. Weights are [out, in] as
/// torch::nn::Linear, or [in, out] (WeightLayout::kInOut, Hugging Face's Conv1D). The group is
/// the one given, else the default context's tp group; without a runtime it has one rank.
///
///   auto rt = ztrain::init_distributed({.tp_size = 2});
///   ztrain::tp::ColumnParallelLinear fc({.in_features = 512, .out_features = 2048});
///   ztrain::tp::RowParallelLinear proj({.in_features = 2048, .out_features = 512});
///   auto y = proj(torch::gelu(fc(x)));            // x, y: [.., 512] replicated; hidden split
///   ztrain::tp::VocabParallelEmbedding wte({.num_embeddings = 50304, .embedding_dim = 512});
///   auto loss = ztrain::tp::parallel_cross_entropy(torch::matmul(h, wte->weight.t()), targets);

#include <ztrain/comm/communicator.h>
#include <ztrain/runtime/parameter_record.h>
#include <ztrain/tp/split.h>

#include <torch/torch.h>

namespace ztrain::tp {

/// The group a layer given `group` splits over: `group`, else the default context's tp group,
/// else null (no runtime: one rank).
Communicator* resolve_group(Communicator* group);

enum class WeightLayout {
  kOutIn,  // [out, in], y = x Wᵀ + b (torch::nn::Linear)
  kInOut,  // [in, out], y = x W + b (Hugging Face Conv1D)
};

/// x Wᵀ + b (kOutIn) or x W + b (kInOut) over x's last dimension, b optional (undefined): the
/// dense linear every layer here computes on its slices, and ztrain::nn::Linear whole. Its
/// backward writes the weight's and the bias's gradients straight into their places in the flat
/// gradient buffer of the sharded module running its backward (zero/gradient_place.h), where
/// torch's linear would hand them over to be copied there.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     WeightLayout layout = WeightLayout::kOutIn);

struct ColumnParallelLinearOptions {
  int64_t in_features = 0;
  /// The full (unsplit) number of output features.
  int64_t out_features = 0;
  bool bias = true;
  /// Return the full output (all-gathered) instead of this rank's features.
  bool gather_output = false;
  /// The outputs are this many equal consecutive blocks, each split over the group, so each
  /// rank holds the same features of every block: 3 for a fused q, k, v projection, whose
  /// local output is then [q slice, k slice, v slice] — whole attention heads per rank.
  int64_t fused_parts = 1;
  WeightLayout layout = WeightLayout::kOutIn;
};

/// y = x W + b with W split by output features; the local output is [.., out / tp] (or the
/// full output with gather_output).
class ColumnParallelLinearImpl : public torch::nn::Module, public ParameterRecords {
 public:
  /// `group` defaults to the default context's tp communicator. Initial weights are drawn in full from
  /// the default generator (uniform ±1/√in as torch::nn::Linear) and sliced, so they do not
  /// depend on the tp size; init_parameters replaces them.
  explicit ColumnParallelLinearImpl(ColumnParallelLinearOptions options, Communicator* group = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  /// Splits a layer built over one rank (whole) over `group` in place, as building it over
  /// `group` would have, its records naming `context` (when given): the parameter objects stay,
  /// so an optimizer keeps its references. A layer split over `group` already is left as it
  /// is; one split over another group of several ranks is refused. What a policy's kColumn rule
  /// does (booster/policy.h).
  void parallelize(Communicator& group, ParallelContext* context = nullptr);

  const ColumnParallelLinearOptions& options() const { return options_; }
  torch::Tensor weight, bias;

 private:
  ColumnParallelLinearOptions options_;
  Communicator* group_;
};
/// The module holder; constructible from designated-initialiser options.
class ColumnParallelLinear : public torch::nn::ModuleHolder<ColumnParallelLinearImpl> {
 public:
  using torch::nn::ModuleHolder<ColumnParallelLinearImpl>::ModuleHolder;
  ColumnParallelLinear(ColumnParallelLinearOptions options, Communicator* group = nullptr)
      : ModuleHolder(std::make_shared<ColumnParallelLinearImpl>(options, group)) {}
};

struct RowParallelLinearOptions {
  /// The full (unsplit) number of input features.
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  /// The input arrives split by features (the output of a ColumnParallelLinear); otherwise it
  /// is the full input and each rank takes its features.
  bool input_is_parallel = true;
  WeightLayout layout = WeightLayout::kOutIn;
};

/// y = x W + b with W split by input features: each rank multiplies its input features, the
/// partial products are all-reduced, then the (replicated) bias is added.
class RowParallelLinearImpl : public torch::nn::Module, public ParameterRecords {
 public:
  explicit RowParallelLinearImpl(RowParallelLinearOptions options, Communicator* group = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  /// ColumnParallelLinear::parallelize's counterpart (a kRow rule): the weight's input
  /// features split, the bias stays whole.
  void parallelize(Communicator& group, ParallelContext* context = nullptr);

  const RowParallelLinearOptions& options() const { return options_; }
  torch::Tensor weight, bias;

 private:
  RowParallelLinearOptions options_;
  Communicator* group_;
};
/// The module holder; constructible from designated-initialiser options.
class RowParallelLinear : public torch::nn::ModuleHolder<RowParallelLinearImpl> {
 public:
  using torch::nn::ModuleHolder<RowParallelLinearImpl>::ModuleHolder;
  RowParallelLinear(RowParallelLinearOptions options, Communicator* group = nullptr)
      : ModuleHolder(std::make_shared<RowParallelLinearImpl>(options, group)) {}
};

/// The forward of a column-parallel linear over `group` (null: one rank) with this rank's
/// `weight` and `bias` (undefined: none) slices, shaped as `options` say: what
/// ColumnParallelLinear and a ztrain::nn::Linear split by columns compute.
torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                     const ColumnParallelLinearOptions& options, Communicator* group);
/// The forward of a row-parallel linear: `weight` this rank's slice of the input features,
/// `bias` the whole (replicated) bias or undefined.
torch::Tensor row_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  const RowParallelLinearOptions& options, Communicator* group);

struct VocabParallelEmbeddingOptions {
  /// The full vocabulary; it must divide by the tp size.
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
};

/// Each rank holds rows [r·V/tp, (r+1)·V/tp) of the table, looks up the tokens in its range
/// (zeros for the others) and the rows are all-reduced, so every rank's tokens send gradient
/// to the slice that holds them.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public ParameterRecords {
 public:
  /// Initial weights N(0, 1) drawn in full and sliced, as torch::nn::Embedding.
  explicit VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options, Communicator* group = nullptr);
  torch::Tensor forward(const torch::Tensor& tokens);

  const VocabParallelEmbeddingOptions& options() const { return options_; }
  torch::Tensor weight;

 private:
  VocabParallelEmbeddingOptions options_;
  Communicator* group_;
};
/// The module holder; constructible from designated-initialiser options.
class VocabParallelEmbedding : public torch::nn::ModuleHolder<VocabParallelEmbeddingImpl> {
 public:
  using torch::nn::ModuleHolder<VocabParallelEmbeddingImpl>::ModuleHolder;
  VocabParallelEmbedding(VocabParallelEmbeddingOptions options, Communicator* group = nullptr)
      : ModuleHolder(std::make_shared<VocabParallelEmbeddingImpl>(options, group)) {}
};

/// The lookup of VocabParallelEmbedding for a weight held elsewhere (a tied embedding):
/// `weight` is this rank's rows [V / tp, d], tokens index the full vocabulary.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& tokens, const torch::Tensor& weight,
                                       Communicator* group = nullptr);

struct ParallelCrossEntropyOptions {
  /// Targets equal to this contribute neither loss nor gradient.
  int64_t ignore_index = -100;
  /// Mean over the targets not ignored (as torch's default); otherwise one loss per row (0
  /// for ignored ones).
  bool mean = true;
};

/// Cross-entropy of logits split over the vocabulary: `logits` [N, V / tp] are this rank's
/// columns (tp rank r holds [r·V/tp, (r+1)·V/tp)), `target` [N] indexes the full vocabulary.
/// The row maximum, the sum of exponentials and the target logit are reduced across the group,
/// so the full logits are never gathered; the backward is local. Computed in fp32.
torch::Tensor parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                     ParallelCrossEntropyOptions options = {}, Communicator* group = nullptr);

}  // namespace ztrain::tp
