#include <ztrain/tp/layers.h>

#include <ztrain/comm/functional.h>
#include <ztrain/cpu_matmul16.h>
#include <ztrain/error.h>
#include <ztrain/runtime/init.h>
#include <ztrain/tp/nn.h>
#include <ztrain/zero/gradient_place.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ztrain::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int size_of(const Communicator* g) { return g ? g->size() : 1; }
int rank_of(const Communicator* g) { return g ? g->rank() : 0; }

/// Registers this rank's slice of `full` as parameter `name` of `m`, declared split over `g`.
template <class M>
torch::Tensor register_slice(M& m, const std::string& name, const torch::Tensor& full, Split split, Communicator* g) {
  auto p = m.register_parameter(name, slice(full, split, rank_of(g), size_of(g)));
  m.declare_split(name, p, split, g);
  return p;
}

torch::Tensor uniform(std::vector<int64_t> shape, int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return torch::empty(shape).uniform_(-bound, bound);
}

std::vector<int64_t> weight_shape(WeightLayout layout, int64_t in, int64_t out) {
  return layout == WeightLayout::kOutIn ? std::vector<int64_t>{out, in} : std::vector<int64_t>{in, out};
}

/// The gradient a · b of parameter p: written into p's place in its sharded module's flat
/// gradient buffer where it has one (zero/gradient_place.h), returning undefined; else returned.
torch::Tensor product_gradient(const torch::Tensor& p, const torch::Tensor& a, const torch::Tensor& b) {
  const bool written = write_gradient(p, [&](torch::Tensor& place, bool accumulate) {
    if (!accumulate) {
      at::mm_out(place, a, b);  // 16-bit ones widened where this process widens (cpu_matmul16.h)
    } else if (place.is_cpu() && detail::cpu_matmul_through_fp32(place.scalar_type())) {
      place.add_(torch::mm(a, b));  // widened, which the in-place form is not
    } else {
      place.addmm_(a, b);
    }
  });
  return written ? torch::Tensor() : torch::mm(a, b);
}

/// The sum of g's rows, as the gradient of bias b (as product_gradient).
torch::Tensor bias_gradient(const torch::Tensor& b, const torch::Tensor& g) {
  const bool written = write_gradient(b, [&](torch::Tensor& place, bool accumulate) {
    accumulate ? place.add_(g.sum(0)) : at::sum_out(place, g, 0);
  });
  return written ? torch::Tensor() : g.sum(0);
}

/// [m, n] of m copies of b [n], copied a doubling block of rows at a time: libtorch's addmm
/// fills its output from the broadcast bias element by element first (5 GB/s on the Xeon in
/// docs/benchmarks.md, about 30 ms of a GPT-2 124M step).
torch::Tensor rows_of(const torch::Tensor& b, int64_t m) {
  auto out = torch::empty({m, b.numel()}, b.options());
  if (m == 0) return out;
  const auto row = static_cast<size_t>(b.nbytes());
  auto* first = static_cast<char*>(out.data_ptr());
  std::memcpy(first, b.contiguous().data_ptr(), row);
  for (int64_t done = 1; done < m;) {
    const int64_t n = std::min(done, m - done);
    std::memcpy(first + done * row, first, n * row);
    done += n;
  }
  return out;
}

/// x · w + b: on the CPU the bias fills the output by rows_of and the gemm adds to it, where the
/// gemm is libtorch's own (not widened from 16 bits, whose addmm takes the bias itself).
torch::Tensor affine(const torch::Tensor& b, const torch::Tensor& x, const torch::Tensor& w) {
  if (!x.is_cpu() || detail::cpu_matmul_through_fp32(x.scalar_type())) return torch::addmm(b, x, w);
  return rows_of(b, x.size(0)).addmm_(x, w);
}

/// x W + b (layout kInOut) or x Wᵀ + b (kOutIn) over x's last dimension, b optional. Backward
/// writes the weight's and the bias's gradients straight into their places in the flat gradient
/// buffer of the sharded module running its backward, where they have one, saving the copy there
/// (Megatron's gradient accumulation fusion).
struct Affine : torch::autograd::Function<Affine> {
  // A function's tensor arguments must be defined: no bias is an empty one.
  static torch::Tensor none(const torch::Tensor& w) { return torch::empty({0}, w.options()); }
  static bool has(const torch::Tensor& b) { return b.numel() > 0; }

  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, bool in_out) {
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(in_out ? 1 : 0);
    const auto x2 = x.reshape({-1, x.size(-1)}), w2 = in_out ? w : w.t();
    ctx->save_for_backward({x2, w, b});
    ctx->saved_data["in_out"] = in_out;
    return (has(b) ? affine(b, x2, w2) : torch::mm(x2, w2)).view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &w = saved[1], &b = saved[2];
    const bool in_out = ctx->saved_data["in_out"].toBool();
    const auto g = grads[0].reshape({-1, grads[0].size(-1)});
    variable_list out(4);
    if (ctx->needs_input_grad(0)) {
      auto sizes = grads[0].sizes().vec();
      sizes.back() = x2.size(1);
      out[0] = g.mm(in_out ? w.t() : w).view(sizes);
    }
    // Under create_graph the gradients are returned, to be differentiated again.
    const bool direct = !torch::GradMode::is_enabled();
    if (ctx->needs_input_grad(1)) {
      const auto a = in_out ? x2.t() : g.t(), c = in_out ? g : x2;
      out[1] = direct ? product_gradient(w, a, c) : a.mm(c);
    }
    if (ctx->needs_input_grad(2)) out[2] = direct ? bias_gradient(b, g) : g.sum(0);
    return out;
  }
};

/// Whether a layer over `current` is to be split over `group` (false: it is split over it
/// already); refuses one split over another group of several ranks.
bool resplit(Communicator*& current, Communicator& group, const char* layer) {
  if (current == &group) return false;
  ZTRAIN_CHECK(size_of(current) == 1, layer, ": built split over ", size_of(current),
               " tensor-parallel ranks, it cannot be split again over another group of ", group.size(),
               "; build it over one rank (whole) or over that group");
  current = &group;
  return true;
}

void check_features(const char* layer, int64_t in, int64_t out) {
  ZTRAIN_CHECK(in > 0 && out > 0, layer, ": in_features and out_features must be > 0, got ", in, " and ", out);
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                     WeightLayout layout) {
  return Affine::apply(x, weight, bias.defined() ? bias : Affine::none(weight), layout == WeightLayout::kInOut);
}

Communicator* resolve_group(Communicator* group) {
  if (group) return group;
  return is_initialized() ? &default_context().tp() : nullptr;
}

// ---- ColumnParallelLinear ----------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options, Communicator* group)
    : options_(options), group_(resolve_group(group)) {
  const auto& o = options_;
  check_features("ColumnParallelLinear", o.in_features, o.out_features);
  const int tp = size_of(group_);
  ZTRAIN_CHECK(o.fused_parts >= 1 && o.out_features % (o.fused_parts * tp) == 0, "ColumnParallelLinear: out_features (",
               o.out_features, ") is not divisible by fused_parts (", o.fused_parts, ") x the tensor-parallel size (", tp,
               ")");
  const Split split{.dim = o.layout == WeightLayout::kOutIn ? 0 : 1, .parts = o.fused_parts};
  torch::NoGradGuard no_grad;
  weight = register_slice(*this, "weight", uniform(weight_shape(o.layout, o.in_features, o.out_features), o.in_features),
                          split, group_);
  if (o.bias) bias = register_slice(*this, "bias", uniform({o.out_features}, o.in_features), {.dim = 0, .parts = o.fused_parts}, group_);
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return column_parallel_linear(x, weight, bias, options_, group_);
}

void ColumnParallelLinearImpl::parallelize(Communicator& group, ParallelContext* context) {
  const auto& o = options_;
  ZTRAIN_CHECK(o.out_features % (o.fused_parts * group.size()) == 0, "ColumnParallelLinear: out_features (",
               o.out_features, ") is not divisible by fused_parts (", o.fused_parts, ") x the tensor-parallel size (",
               group.size(), ")");
  if (!resplit(group_, group, "ColumnParallelLinear")) return;
  split_in_place(*this, "weight", weight, {.dim = o.layout == WeightLayout::kOutIn ? 0 : 1, .parts = o.fused_parts},
                 group);
  if (bias.defined()) split_in_place(*this, "bias", bias, {.dim = 0, .parts = o.fused_parts}, group);
  if (context) nn::adopt_records(*this, *context);
}

torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                     const ColumnParallelLinearOptions& options, Communicator* group) {
  const int tp = size_of(group);
  if (tp == 1) return linear(x, weight, bias, options.layout);
  auto y = linear(functional::copy_to_group(x, *group), weight, bias, options.layout);
  if (!options.gather_output) return y;
  y = functional::gather_from_group(y, *group, -1);  // features ordered (rank, part, chunk)
  if (options.fused_parts == 1) return y;
  auto shape = y.sizes().vec();
  shape.back() = tp;
  shape.push_back(options.fused_parts);
  shape.push_back(options.out_features / (options.fused_parts * tp));
  return y.view(shape).transpose(-3, -2).reshape(y.sizes());  // → (part, rank, chunk)
}

// ---- RowParallelLinear -------------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options, Communicator* group)
    : options_(options), group_(resolve_group(group)) {
  const auto& o = options_;
  check_features("RowParallelLinear", o.in_features, o.out_features);
  const int tp = size_of(group_);
  ZTRAIN_CHECK(o.in_features % tp == 0, "RowParallelLinear: in_features (", o.in_features,
               ") is not divisible by the tensor-parallel size (", tp, ")");
  torch::NoGradGuard no_grad;
  weight = register_slice(*this, "weight", uniform(weight_shape(o.layout, o.in_features, o.out_features), o.in_features),
                          {.dim = o.layout == WeightLayout::kOutIn ? 1 : 0}, group_);
  // The bias is added after the reduction, so it is replicated (the default generator draws
  // the same values on every rank of the tp group).
  if (o.bias) bias = register_parameter("bias", uniform({o.out_features}, o.in_features));
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  return row_parallel_linear(x, weight, bias, options_, group_);
}

void RowParallelLinearImpl::parallelize(Communicator& group, ParallelContext* context) {
  ZTRAIN_CHECK(options_.in_features % group.size() == 0, "RowParallelLinear: in_features (", options_.in_features,
               ") is not divisible by the tensor-parallel size (", group.size(), ")");
  if (!resplit(group_, group, "RowParallelLinear")) return;
  split_in_place(*this, "weight", weight, {.dim = options_.layout == WeightLayout::kOutIn ? 1 : 0}, group);
  if (context) nn::adopt_records(*this, *context);
}

torch::Tensor row_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  const RowParallelLinearOptions& options, Communicator* group) {
  if (size_of(group) == 1) return linear(x, weight, bias, options.layout);
  auto in = options.input_is_parallel ? x : functional::scatter_to_group(x, *group, -1);
  auto y = functional::reduce_from_group(linear(in, weight, torch::Tensor(), options.layout), *group);
  return bias.defined() ? y + bias : y;
}

// ---- VocabParallelEmbedding --------------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options, Communicator* group)
    : options_(options), group_(resolve_group(group)) {
  const int tp = size_of(group_);
  ZTRAIN_CHECK(options_.num_embeddings > 0 && options_.embedding_dim > 0,
               "VocabParallelEmbedding: num_embeddings and embedding_dim must be > 0, got ", options_.num_embeddings,
               " and ", options_.embedding_dim);
  ZTRAIN_CHECK(options_.num_embeddings % tp == 0, "VocabParallelEmbedding: num_embeddings (", options_.num_embeddings,
               ") is not divisible by the tensor-parallel size (", tp, ")");
  torch::NoGradGuard no_grad;
  weight = register_slice(*this, "weight", torch::randn({options_.num_embeddings, options_.embedding_dim}), {.dim = 0},
                          group_);
  record("weight").no_weight_decay = true;
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  return vocab_parallel_embedding(tokens, weight, group_);
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& tokens, const torch::Tensor& weight, Communicator* group) {
  group = resolve_group(group);
  const int tp = size_of(group);
  ZTRAIN_CHECK(weight.dim() == 2, "vocab_parallel_embedding: the weight must be [vocab / tp, dim], got ", weight.sizes());
  ZTRAIN_CHECK(!at::isFloatingType(tokens.scalar_type()), "vocab_parallel_embedding: tokens must be integers, got ",
               tokens.scalar_type());
  if (tp == 1) return torch::embedding(weight, tokens);
  const int64_t rows = weight.size(0), begin = rank_of(group) * rows;
  ZTRAIN_CHECK(tokens.numel() == 0 || (tokens.min().item<int64_t>() >= 0 && tokens.max().item<int64_t>() < rows * tp),
               "vocab_parallel_embedding: token ids must be in [0, ", rows * tp, ")");
  const auto outside = (tokens < begin).logical_or(tokens >= begin + rows);
  auto rows_out = torch::embedding(weight, (tokens - begin).masked_fill(outside, 0));
  return functional::reduce_from_group(rows_out.masked_fill(outside.unsqueeze(-1), 0), *group);
}

// ---- parallel cross-entropy --------------------------------------------------------------------

namespace {

struct ParallelCrossEntropy : torch::autograd::Function<ParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target,
                               Communicator* group, int64_t ignore_index) {
    torch::NoGradGuard no_grad;
    const auto x = logits.to(torch::kFloat32);
    const int64_t cols = x.size(1), begin = rank_of(group) * cols;
    auto max = std::get<0>(x.max(1)).contiguous();
    if (group) group->all_reduce(max, ReduceOp::kMax);
    auto probs = (x - max.unsqueeze(1)).exp_();
    auto sum = probs.sum(1);
    const auto valid = target != ignore_index;
    const auto mine = valid.logical_and(target >= begin).logical_and(target < begin + cols);
    const auto local = (target - begin).masked_fill(mine.logical_not(), 0);
    // The target's shifted logit, from the rank that holds it (log of its exp(z) is z).
    auto picked = (x.gather(1, local.unsqueeze(1)).squeeze(1) - max).masked_fill(mine.logical_not(), 0);
    if (group) {
      group->all_reduce(sum, ReduceOp::kSum);
      group->all_reduce(picked, ReduceOp::kSum);
    }
    probs.div_(sum.unsqueeze(1));
    ctx->saved_data["probs"] = probs;
    ctx->saved_data["local"] = local;
    ctx->saved_data["mine"] = mine;
    ctx->saved_data["valid"] = valid;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sum.log() - picked).masked_fill(valid.logical_not(), 0);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto probs = ctx->saved_data["probs"].toTensor();
    const auto local = ctx->saved_data["local"].toTensor();
    const auto g = grads[0].to(torch::kFloat32);
    const auto gv = g * ctx->saved_data["valid"].toTensor();
    auto grad = probs * gv.unsqueeze(1);
    grad.scatter_add_(1, local.unsqueeze(1), -(g * ctx->saved_data["mine"].toTensor()).unsqueeze(1));
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                     ParallelCrossEntropyOptions options, Communicator* group) {
  group = resolve_group(group);
  ZTRAIN_CHECK(logits.dim() == 2 && target.dim() == 1 && logits.size(0) == target.size(0),
               "parallel_cross_entropy: logits must be [N, vocab / tp] and target [N], got ", logits.sizes(), " and ",
               target.sizes());
  ZTRAIN_CHECK(target.scalar_type() == torch::kLong, "parallel_cross_entropy: target must be int64, got ",
               target.scalar_type());
  const int64_t vocab = logits.size(1) * size_of(group);
  const auto valid = target != options.ignore_index;
  ZTRAIN_CHECK(!valid.logical_and(target.lt(0).logical_or(target.ge(vocab))).any().item<bool>(),
               "parallel_cross_entropy: targets must be in [0, ", vocab, ") or ignore_index (", options.ignore_index, ")");
  auto losses = ParallelCrossEntropy::apply(logits, target, group, options.ignore_index);
  if (!options.mean) return losses;
  return losses.sum() / valid.sum().to(torch::kFloat32);
}

}  // namespace ztrain::tp
