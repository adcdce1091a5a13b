#pragma once
/// The GPT of gpt.h cut into pipeline stages (pipe/pipeline.h).
///
/// Its n_layer transformer blocks are cut into p·v contiguous parts (p: the pipeline size of
/// BlockOptions::context, the default context when not set; v: chunks per rank, 1 unless the schedule is interleaved), uniformly unless explicit
/// cut points are given. Rank s holds the parts of virtual stages s, p+s, …; the first
/// virtual stage also holds the token and position embeddings, the last the final LayerNorm
/// and the LM head, whose weight is a copy of the token embedding tied to it
/// (Pipeline::tie: equal initial values, gradients summed across the two stages). Every
/// part is a Block at the configured ZeRO level over the stage's data-parallel group; with a
/// tensor-parallel group the blocks, the embedding and the head are split as in Gpt.
///
/// Parameter names are those of Gpt (Hugging Face's), with each block keeping its index in the
/// whole model, so model files and optimizer-state files written from any pipeline size load
/// at any other, and into Gpt: the stages write the union of their parameters (the tied
/// weight once). init_parameters draws each parameter from its name, so the weights are those
/// of Gpt for the same seed. (With dropout, the masks are not Gpt's: each stage draws from
/// its own generator.)
///
/// A training step is one call: forward_backward_step runs the step's micro-batches through
/// the schedule and returns their mean loss on every rank; the optimizer then steps as usual
/// (OptimManager counts the tied weight once in the gradient norm).
///
///   auto& rt = ztrain::init_distributed({.pp_size = 2});
///   ztrain::models::GptPipeline model(config, {.zero_level = 1}, {.schedule = ztrain::pipe::ScheduleKind::k1F1B});
///   ztrain::init_parameters(*model, {.init = ztrain::models::gpt_init(config)});
///   ztrain::optim::AdamW opt(model->parameters(), 1e-3);
///   opt.zero_grad();
///   auto loss = model->forward_backward_step(micro_batches);  // each tokens [b, seq + 1]
///   opt.step();
///
/// Needs at least two pipeline stages (use Gpt for one). Construction and every call are
/// collective over the world.

#include <ztrain/models/gpt.h>
#include <ztrain/pipe/pipeline.h>

#include <memory>
#include <utility>
#include <vector>

namespace ztrain::models {

struct GptPipelineOptions {
  pipe::ScheduleKind schedule = pipe::ScheduleKind::k1F1B;
  /// Model chunks (virtual stages) per rank; more than one only with the interleaved schedule.
  int chunks = 1;
  /// Cut points of the blocks into p·chunks parts (pipe::partition_explicit); empty: uniform.
  std::vector<int64_t> bounds;
};

/// The LM head and loss on the last stage: its weight is the tied copy of the token embedding,
/// split by vocabulary rows over `tp` (null: one rank).
struct GptHeadImpl : torch::nn::Module, ParameterRecords {
  GptHeadImpl(const GptConfig& c, Communicator* tp);
  /// Mean cross-entropy of hidden states x [b, t, d] predicting targets [b, t].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& targets);
  torch::Tensor weight;
  Communicator* tp;
};
TORCH_MODULE(GptHead);

/// One model chunk: blocks [first, last) with the ends its virtual stage holds.
class GptChunkImpl : public pipe::StageImpl {
 public:
  GptChunkImpl(const GptConfig& c, const BlockOptions& options, int64_t first, int64_t last, bool has_embedding,
               bool has_head);
  /// Micro-batch {tokens [b, seq + 1]}: the first chunk embeds tokens[:, :-1], the last returns
  /// {mean loss predicting tokens[:, 1:]}; the others pass hidden states [b, seq, d] on.
  pipe::TensorList forward(const pipe::TensorList& inputs, const pipe::TensorList& micro_batch) override;

  int64_t first_layer, last_layer;
  std::shared_ptr<BlockImpl<tp::VocabParallelEmbedding>> wte;  // first virtual stage
  std::shared_ptr<BlockImpl<torch::nn::Embedding>> wpe;
  BlockList<GptBlock> h;
  std::shared_ptr<BlockImpl<torch::nn::LayerNorm>> ln_f;  // last virtual stage
  std::shared_ptr<BlockImpl<GptHead>> head;
  torch::nn::Dropout drop;
};
TORCH_MODULE(GptChunk);

class GptPipelineImpl : public torch::nn::Module {
 public:
  GptPipelineImpl(GptConfig config, BlockOptions options = {}, GptPipelineOptions pipeline = {});

  /// Forward and backward of one step's micro-batches (tokens [b, seq + 1] each, the same
  /// count on every rank; every stage passes its dp rank's): gradients of the mean loss
  /// accumulate into the parameters, tied gradients summed. Returns the mean loss over the
  /// micro-batches and the data-parallel replicas (sum_loss), on every rank. `loss_scale` as
  /// Pipeline::forward_backward_step.
  torch::Tensor forward_backward_step(const std::vector<torch::Tensor>& micro_batches, double loss_scale = 1.0);
  /// The mean loss of the micro-batches without gradients (evaluation), over the
  /// data-parallel replicas too, on every rank.
  torch::Tensor loss(const std::vector<torch::Tensor>& micro_batches);

  const GptConfig& config() const { return config_; }
  pipe::Pipeline& pipeline() { return *pipeline_; }
  /// Blocks [first, last) of each chunk on this rank.
  std::vector<std::pair<int64_t, int64_t>> layers() const;

 private:
  /// The micro-batches as the pipeline takes them, validated on every rank (so a bad one
  /// fails everywhere, not on one stage while the others wait for it).
  std::vector<pipe::TensorList> checked(const std::vector<torch::Tensor>& micro_batches) const;

  GptConfig config_;
  std::shared_ptr<ParallelContext> context_;
  std::vector<GptChunk> chunks_;
  std::unique_ptr<pipe::Pipeline> pipeline_;
};

/// The module holder of GptPipelineImpl.
class GptPipeline : public torch::nn::ModuleHolder<GptPipelineImpl> {
 public:
  using torch::nn::ModuleHolder<GptPipelineImpl>::ModuleHolder;
  GptPipeline(GptConfig config, BlockOptions options = {}, GptPipelineOptions pipeline = {})
      : ModuleHolder(std::make_shared<GptPipelineImpl>(std::move(config), options, std::move(pipeline))) {}
};

}  // namespace ztrain::models
