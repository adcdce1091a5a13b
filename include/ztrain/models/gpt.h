#pragma once
/// A GPT-2-compatible language model built from ztrain blocks.
///
/// Architecture as GPT-2: learned position embeddings, pre-LayerNorm blocks (eps 1e-5), causal
/// multi-head self-attention, a 4× MLP with tanh-approximated GELU, dropout on embeddings,
/// attention probabilities and residual branches, a final LayerNorm, and an LM head tied to the
/// token embedding. Parameter names and layouts are Hugging Face `GPT2LMHeadModel`'s, so a
/// model file moves both ways (the tied head is not stored, as in Hugging Face's files):
///
/// | name                                   | shape            | note                         |
/// |----------------------------------------|------------------|------------------------------|
/// | transformer.wte.weight                 | [vocab, d]       | also the LM head             |
/// | transformer.wpe.weight                 | [context, d]     |                              |
/// | transformer.h.{i}.ln_1.weight / .bias  | [d]              |                              |
/// | transformer.h.{i}.attn.c_attn.weight   | [d, 3d]          | Conv1D: (in, out), y = xW + b |
/// | transformer.h.{i}.attn.c_attn.bias     | [3d]             | q, k, v in that order        |
/// | transformer.h.{i}.attn.c_proj.weight   | [d, d]           | Conv1D                       |
/// | transformer.h.{i}.attn.c_proj.bias     | [d]              |                              |
/// | transformer.h.{i}.ln_2.weight / .bias  | [d]              |                              |
/// | transformer.h.{i}.mlp.c_fc.weight      | [d, 4d]          | Conv1D                       |
/// | transformer.h.{i}.mlp.c_fc.bias        | [4d]             |                              |
/// | transformer.h.{i}.mlp.c_proj.weight    | [4d, d]          | Conv1D                       |
/// | transformer.h.{i}.mlp.c_proj.bias      | [d]              |                              |
/// | transformer.ln_f.weight / .bias        | [d]              |                              |
///
/// The token and position embeddings are DistributedParameters, every transformer block is a
/// Block in one BlockList, the final LayerNorm a Block of its own; all at the configured ZeRO
/// level, over the parallel context of BlockOptions::context (the default context when not
/// set). Construction and every forward are collective over its data-parallel group.
///
/// When the context has a tensor-parallel group of several ranks (its tp_size), the model is
/// split over it Megatron-style (tp/layers.h): attention heads and MLP features
/// in every block, and the vocabulary of the tied embedding and LM head, whose loss is computed
/// from split logits. ZeRO then shards each rank's slices over dp. Names, shapes in files and
/// init_parameters are those of the full model, so checkpoints move between tp sizes. With
/// dropout, the attention-probability masks of heads on different tp ranks come from the same
/// generator state (the residual masks must, to keep activations replicated).
///
///   ztrain::models::Gpt model(ztrain::models::GptConfig::preset("tiny"), {.zero_level = 3});
///   ztrain::init_parameters(*model, {.init = ztrain::models::gpt_init(model->config())});
///   auto loss = model->loss(tokens);                       // tokens [batch, seq + 1]

#include <ztrain/tp/layers.h>
#include <ztrain/zero/block.h>
#include <ztrain/zero/block_list.h>
#include <ztrain/zero/distributed_parameter.h>
#include <ztrain/zero/init_parameters.h>

#include <string>
#include <vector>

namespace ztrain::models {

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t context = 256;
  int64_t d_model = 128;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  /// Embeddings, attention probabilities, residual branches; on the CPU through the fused
  /// dropout (models/fused.h).
  double dropout = 0.0;
  double layer_norm_eps = 1e-5;
  /// The parameters' and activations' dtype: fp32 or bf16 (optimizers keep fp32 masters).
  c10::ScalarType dtype = c10::ScalarType::Float;
  /// Attention through a fused kernel that never materialises the score matrix: in float on the
  /// CPU models::attention's own (models/fused.h), dropout included; elsewhere libtorch's
  /// scaled_dot_product_attention (flash or memory-efficient kernels where the device and dtype
  /// have one). When false, the eager product, softmax and product (the form a reference writes
  /// out). The same arithmetic up to float rounding; not stored in model files. bf16 attention
  /// with dropout on the CPU (when training) takes the eager form: there libtorch's attention is
  /// its unfused fallback, which draws the masks slowly.
  bool fused_attention = true;

  /// "tiny", "small", "medium", "gpt2" (124M: vocab 50257, context 1024, 12 × 768, 12 heads).
  static GptConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  /// Throws ztrain::Error naming the first invalid field, or a size that does not divide over
  /// `tp_size` tensor-parallel ranks (d_model and n_head must; Gpt pads the vocabulary to a
  /// multiple of tp_size).
  void validate(int tp_size = 1) const;
  /// Parameters (the tied head counted once).
  int64_t num_parameters() const;
  /// Forward + backward FLOPs per token (6 per parameter-use plus attention).
  double flops_per_token(int64_t seq) const;
};

/// Attention heads split over the tp group `tp` (tp::resolve_group: the default context's when
/// null): c_attn column-parallel with q, k and v fused, c_proj row-parallel.
struct GptAttentionImpl : torch::nn::Module {
  GptAttentionImpl(const GptConfig& c, Communicator* tp = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t n_head;  // on this rank
  int64_t head_dim;
  tp::ColumnParallelLinear c_attn;
  tp::RowParallelLinear c_proj;
  torch::nn::Dropout attn_dropout, resid_dropout;
  bool fused;  // GptConfig::fused_attention
};
TORCH_MODULE(GptAttention);

/// Hidden features split over the tp group `tp`: c_fc column-parallel, c_proj row-parallel.
struct GptMlpImpl : torch::nn::Module {
  GptMlpImpl(const GptConfig& c, Communicator* tp = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  tp::ColumnParallelLinear c_fc;
  tp::RowParallelLinear c_proj;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(GptMlp);

/// torch::nn::LayerNorm (same parameters, names and options) whose forward over one last
/// dimension is models::layer_norm (fused.h): statistics in float, the fused CPU kernel.
struct GptLayerNormImpl : torch::nn::LayerNormImpl {
  using torch::nn::LayerNormImpl::LayerNormImpl;
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(GptLayerNorm);

/// One transformer block (plain libtorch and tp layers; GptImpl wraps it in a ztrain Block).
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptConfig& c, Communicator* tp = nullptr);
  torch::Tensor forward(const torch::Tensor& x);
  GptLayerNorm ln_1, ln_2;
  GptAttention attn;
  GptMlp mlp;
};
TORCH_MODULE(GptBlock);

struct GptTransformerImpl : torch::nn::Module {
  GptTransformerImpl(const GptConfig& c, const BlockOptions& options, Communicator& tp);
  DistributedParameter wte, wpe;
  BlockList<GptBlock> h;
  Block<GptLayerNorm> ln_f;
  torch::nn::Dropout drop;
};
TORCH_MODULE(GptTransformer);

class GptImpl : public torch::nn::Module {
 public:
  GptImpl(GptConfig config, BlockOptions options = {});

  /// Logits [batch, seq, vocab] for tokens [batch, seq] (seq ≤ context); with tensor
  /// parallelism they are gathered from the tp group.
  torch::Tensor forward(const torch::Tensor& tokens);
  /// Mean next-token cross-entropy over tokens [batch, seq + 1]: inputs tokens[:, :-1],
  /// targets tokens[:, 1:]. With tensor parallelism the logits stay split over the vocabulary
  /// (tp::parallel_cross_entropy).
  torch::Tensor loss(const torch::Tensor& tokens);
  const GptConfig& config() const { return config_; }

  GptTransformer transformer;

 private:
  /// This tp rank's logits [batch, seq, padded vocab / tp]; the padding's are -inf.
  torch::Tensor local_logits(const torch::Tensor& tokens);

  GptConfig config_;
  Communicator* tp_;  // the context's tp group when it has several ranks, else null
};

/// The module holder of GptImpl.
class Gpt : public torch::nn::ModuleHolder<GptImpl> {
 public:
  using torch::nn::ModuleHolder<GptImpl>::ModuleHolder;
  Gpt(GptConfig config, BlockOptions options = {})
      : ModuleHolder(std::make_shared<GptImpl>(std::move(config), options)) {}
};

/// The head tied to a token embedding `wte` split by vocabulary rows over `tp` (null: whole):
/// this rank's logits [.., rows of wte] of the final hidden states `x`, the padding's (rows past
/// `vocab_size`) -inf. x is the same on every rank of tp; its gradient is summed over tp.
torch::Tensor tied_head_logits(const torch::Tensor& x, const torch::Tensor& wte, int64_t vocab_size, Communicator* tp);
/// Mean next-token cross-entropy of logits [batch, seq, vocab] — this rank's part of the
/// vocabulary when it is split over `tp` (tp::parallel_cross_entropy) — predicting tokens[:, 1:]
/// of tokens [batch, seq + 1]. In fp32.
torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens, Communicator* tp = nullptr);

/// GPT-2's initialisation: weights N(0, 0.02²), the residual projections (c_proj)
/// N(0, (0.02/√(2·n_layer))²), biases zero, LayerNorm scales one.
ParameterInit gpt_init(const GptConfig& config);

}  // namespace ztrain::models
