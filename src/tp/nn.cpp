#include <ztrain/tp/nn.h>

#include <ztrain/error.h>
#include <ztrain/tp/layers.h>
#include <ztrain/tp/split.h>

#include <cmath>

namespace ztrain::nn {

namespace {

void check_once(const TpStyle& current, Communicator* group, const char* layer) {
  ZTRAIN_CHECK(group == nullptr && current.role == TpRole::kReplicated, layer,
               ": parallelize() was called already (a layer is split once)");
}

}  // namespace

std::string role_name(TpRole role) {
  switch (role) {
    case TpRole::kReplicated: return "replicated";
    case TpRole::kColumn: return "column";
    case TpRole::kRow: return "row";
    case TpRole::kVocab: return "vocab";
  }
  return "unknown";
}

void adopt_records(torch::nn::Module& module, ParallelContext& context) {
  for (const auto& item : module.named_modules()) {
    auto* records = dynamic_cast<ParameterRecords*>(item.value().get());
    if (!records) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (!records->find_record(p.key())) continue;
      auto& record = records->record(p.key());
      if (!record.context) record.context = &context;
    }
  }
}

// ---- Linear ------------------------------------------------------------------------------------

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) {
  ZTRAIN_CHECK(options.in_features() > 0 && options.out_features() > 0,
               "ztrain::nn::Linear: in_features and out_features must be > 0, got ", options.in_features(), " and ",
               options.out_features());
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias()) bias = register_parameter("bias", torch::empty({options.out_features()}));
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  // torch::nn::LinearImpl::reset_parameters, draw for draw.
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  switch (style_.role) {
    case TpRole::kColumn:
      return tp::column_parallel_linear(x, weight, bias,
                                        {.in_features = options.in_features(),
                                         .out_features = options.out_features(),
                                         .bias = options.bias(),
                                         .gather_output = style_.gather_output,
                                         .fused_parts = style_.fused_parts},
                                        group_);
    case TpRole::kRow:
      return tp::row_parallel_linear(x, weight, bias,
                                     {.in_features = options.in_features(),
                                      .out_features = options.out_features(),
                                      .bias = options.bias(),
                                      .input_is_parallel = style_.input_is_parallel},
                                     group_);
    default:
      return tp::linear(x, weight, bias);
  }
}

void LinearImpl::parallelize(const TpStyle& style, Communicator& group, ParallelContext* context) {
  check_once(style_, group_, "ztrain::nn::Linear");
  const int tp = group.size();
  const int64_t in = options.in_features(), out = options.out_features();
  switch (style.role) {
    case TpRole::kColumn:
      ZTRAIN_CHECK(style.fused_parts >= 1 && out % (style.fused_parts * tp) == 0, "ztrain::nn::Linear: ", out,
                   " output features do not split into ", style.fused_parts, " fused part(s) x ", tp,
                   " tensor-parallel ranks");
      tp::split_in_place(*this, "weight", weight, {.dim = 0, .parts = style.fused_parts}, group);
      if (bias.defined()) tp::split_in_place(*this, "bias", bias, {.dim = 0, .parts = style.fused_parts}, group);
      break;
    case TpRole::kRow:
      ZTRAIN_CHECK(in % tp == 0, "ztrain::nn::Linear: ", in, " input features do not split over ", tp,
                   " tensor-parallel ranks");
      tp::split_in_place(*this, "weight", weight, {.dim = 1}, group);
      break;
    case TpRole::kReplicated:
      break;
    default:
      ZTRAIN_CHECK(false, "ztrain::nn::Linear splits by column or row, not by ", role_name(style.role),
                   " (that is an Embedding's role)");
  }
  style_ = style;
  group_ = &group;
  if (context) adopt_records(*this, *context);
}

// ---- Embedding ---------------------------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options_) : options(options_) {
  ZTRAIN_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0,
               "ztrain::nn::Embedding: num_embeddings and embedding_dim must be > 0, got ", options.num_embeddings(),
               " and ", options.embedding_dim());
  ZTRAIN_CHECK(!options.padding_idx() && !options.max_norm() && !options.scale_grad_by_freq() && !options.sparse() &&
                   !options._weight().defined(),
               "ztrain::nn::Embedding takes num_embeddings and embedding_dim only (no padding_idx, max_norm, "
               "scale_grad_by_freq, sparse or _weight); use torch::nn::Embedding for those");
  weight = register_parameter("weight", torch::empty({options.num_embeddings(), options.embedding_dim()}));
  record("weight").no_weight_decay = true;
  reset_parameters();
}

void EmbeddingImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(weight);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  if (style_.role == TpRole::kVocab) return tp::vocab_parallel_embedding(tokens, weight, group_);
  return torch::embedding(weight, tokens);
}

void EmbeddingImpl::parallelize(const TpStyle& style, Communicator& group, ParallelContext* context) {
  check_once(style_, group_, "ztrain::nn::Embedding");
  ZTRAIN_CHECK(style.role == TpRole::kVocab || style.role == TpRole::kReplicated,
               "ztrain::nn::Embedding splits by vocabulary, not by ", role_name(style.role),
               " (that is a Linear's role)");
  if (style.role == TpRole::kVocab) {
    tp::split_in_place(*this, "weight", weight,
                   {.dim = 0, .padding = padding_for(options.num_embeddings(), group.size())}, group);
  }
  style_ = style;
  group_ = &group;
  if (context) adopt_records(*this, *context);
}

}  // namespace ztrain::nn
