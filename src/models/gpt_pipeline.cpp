#include <ztrain/models/gpt_pipeline.h>

#include <ztrain/comm/functional.h>
#include <ztrain/error.h>
#include <ztrain/runtime/init.h>

namespace ztrain::models {

namespace {

/// The tp group of the options' context when it has several ranks, else null.
Communicator* split_group(const BlockOptions& options) {
  auto& tp = options.context->tp();
  return tp.size() > 1 ? &tp : nullptr;
}

/// `module` cast to dtype, wrapped alone in a Block without recomputation (the ends of the
/// model are cheap to keep).
template <class M>
std::shared_ptr<BlockImpl<M>> end_block(M module, const GptConfig& c, const BlockOptions& options) {
  module->to(c.dtype);
  auto o = options;
  o.use_checkpoint = false;
  return Block<M>(std::move(module), o).ptr();
}

}  // namespace

// ---- the head ----------------------------------------------------------------------------------

GptHeadImpl::GptHeadImpl(const GptConfig& c, Communicator* group) : tp(group) {
  // Zeros until init_parameters, a load or the tie with the embedding sets it.
  const int64_t parts = tp ? tp->size() : 1;
  weight = register_parameter("weight", torch::zeros({c.vocab_size / parts, c.d_model}, c.dtype));
  declare_split("weight", weight, {.dim = 0}, tp);
  record("weight").no_weight_decay = true;  // the embedding's tied copy: it must step as the embedding does
}

torch::Tensor GptHeadImpl::forward(const torch::Tensor& x, const torch::Tensor& targets) {
  auto logits = torch::matmul(tp ? functional::copy_to_group(x, *tp) : x, weight.t());
  auto flat = logits.reshape({-1, logits.size(-1)});
  if (tp) return tp::parallel_cross_entropy(flat, targets.reshape(-1), {}, tp);
  return torch::nn::functional::cross_entropy(flat.to(torch::kFloat32), targets.reshape(-1));
}

// ---- a chunk -----------------------------------------------------------------------------------

GptChunkImpl::GptChunkImpl(const GptConfig& c, const BlockOptions& options, int64_t first, int64_t last,
                           bool has_embedding, bool has_head)
    : first_layer(first),
      last_layer(last),
      h(
          last - first,
          [&](int64_t) {
            GptBlock block(c, &options.context->tp());
            block->to(c.dtype);
            return block;
          },
          options, first),
      drop(c.dropout) {
  if (has_embedding) {
    wte = register_module("wte", end_block(tp::VocabParallelEmbedding({.num_embeddings = c.vocab_size,
                                                                        .embedding_dim = c.d_model},
                                                                       &options.context->tp()),
                                           c, options));
    wpe = register_module("wpe", end_block(torch::nn::Embedding(c.context, c.d_model), c, options));
    register_module("drop", drop);
  }
  register_module("h", h);
  if (has_head) {
    ln_f = register_module(
        "ln_f", end_block(torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)), c, options));
    head = register_module("head", end_block(GptHead(c, split_group(options)), c, options));
  }
}

pipe::TensorList GptChunkImpl::forward(const pipe::TensorList& inputs, const pipe::TensorList& micro_batch) {
  ZTRAIN_CHECK(micro_batch.size() == 1, "GptChunk: a micro-batch is {tokens [batch, seq + 1]}");
  const auto& tokens = micro_batch[0];
  torch::Tensor x;
  if (wte) {
    auto input = tokens.slice(1, 0, -1);
    x = drop(wte->forward(input) + wpe->forward(torch::arange(input.size(1), input.options().dtype(torch::kLong))));
  } else {
    ZTRAIN_CHECK(inputs.size() == 1, "GptPipeline: a stage expects one hidden-state tensor, got ", inputs.size());
    x = inputs[0];
  }
  x = h(x);
  if (!head) return {x};
  return {head->forward(ln_f->forward(x), tokens.slice(1, 1))};
}

// ---- the pipeline ------------------------------------------------------------------------------

GptPipelineImpl::GptPipelineImpl(GptConfig config, BlockOptions options, GptPipelineOptions pipeline)
    : config_(std::move(config)), context_(context_or_default(options.context)) {
  options.context = context_;
  config_.validate(context_->tp().size());
  ZTRAIN_CHECK(config_.vocab_size % context_->tp().size() == 0, "GptPipeline: vocab_size (", config_.vocab_size,
               ") is not divisible by the tensor-parallel size (", context_->tp().size(),
               "); pipelines do not pad the vocabulary yet (Gpt does): pad it yourself or change tp");
  const int p = context_->pp().size(), s = context_->pp().rank(), v = pipeline.chunks;
  ZTRAIN_CHECK(p >= 2, "GptPipeline: needs at least two pipeline stages (init_distributed's pp_size), got ", p,
               "; use Gpt for one");
  ZTRAIN_CHECK(v >= 1, "GptPipeline: chunks must be >= 1, got ", v);
  const auto bounds = pipeline.bounds.empty() ? pipe::partition_uniform(config_.n_layer, p * v)
                                              : pipe::partition_explicit(pipeline.bounds, config_.n_layer, p * v);

  // The rank's model under Gpt's names: transformer.{wte, wpe, drop, h.<i>, ln_f}.
  auto transformer = register_module("transformer", std::make_shared<torch::nn::Module>());
  auto h = transformer->register_module("h", std::make_shared<torch::nn::Module>());
  std::vector<std::shared_ptr<pipe::StageImpl>> stages;
  for (int c = 0; c < v; ++c) {
    const int vs = pipe::virtual_stage(s, c, p);
    GptChunk chunk(config_, options, bounds[vs], bounds[vs + 1], vs == 0, vs == p * v - 1);
    if (chunk->wte) {
      transformer->register_module("wte", chunk->wte);
      transformer->register_module("wpe", chunk->wpe);
      transformer->register_module("drop", chunk->drop);
    }
    for (int64_t i = chunk->first_layer; i < chunk->last_layer; ++i) {
      h->register_module(std::to_string(i), (*chunk->h)[i - chunk->first_layer].ptr());
    }
    if (chunk->head) {
      transformer->register_module("ln_f", chunk->ln_f);
      transformer->register_module("wte", chunk->head);  // the tied copy, under the embedding's name
    }
    chunks_.push_back(chunk);
    stages.push_back(chunk.ptr());
  }
  pipeline_ = std::make_unique<pipe::Pipeline>(
      std::move(stages),
      pipe::PipelineOptions{.schedule = pipeline.schedule, .broadcast_loss = true, .context = context_});
  std::vector<torch::Tensor> tied;
  for (auto& chunk : chunks_) {
    if (chunk->wte) tied = chunk->wte->parameters();
    if (chunk->head) tied = chunk->head->parameters();
  }
  pipeline_->tie("transformer.wte.weight", tied);
}

std::vector<pipe::TensorList> GptPipelineImpl::checked(const std::vector<torch::Tensor>& micro_batches) const {
  std::vector<pipe::TensorList> lists;
  for (const auto& mb : micro_batches) {
    ZTRAIN_CHECK(mb.defined() && mb.dim() == 2 && mb.size(1) >= 2, "GptPipeline: a micro-batch must be tokens "
                 "[batch, seq + 1] with seq >= 1, got ", mb.defined() ? c10::str(mb.sizes()) : "an undefined tensor");
    ZTRAIN_CHECK(!c10::isFloatingType(mb.scalar_type()), "GptPipeline: tokens must be integer, got ", mb.scalar_type());
    ZTRAIN_CHECK(mb.size(1) - 1 <= config_.context, "GPT: sequence length ", mb.size(1) - 1, " exceeds the context ",
                 config_.context);
    lists.push_back({mb});
  }
  return lists;
}

torch::Tensor GptPipelineImpl::forward_backward_step(const std::vector<torch::Tensor>& micro_batches,
                                                     double loss_scale) {
  return sum_loss(pipeline_->forward_backward_step(checked(micro_batches), loss_scale), context_.get());
}

torch::Tensor GptPipelineImpl::loss(const std::vector<torch::Tensor>& micro_batches) {
  return sum_loss(pipeline_->evaluate(checked(micro_batches)), context_.get());
}

std::vector<std::pair<int64_t, int64_t>> GptPipelineImpl::layers() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& chunk : chunks_) out.emplace_back(chunk->first_layer, chunk->last_layer);
  return out;
}

}  // namespace ztrain::models
