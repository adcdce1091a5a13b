#include <ztrain/models/gpt.h>

#include <ztrain/comm/functional.h>
#include <ztrain/error.h>
#include <ztrain/models/fused.h>
#include <ztrain/runtime/init.h>
#include <ztrain/runtime/tp_rng.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace ztrain::models {

// ---- configuration -----------------------------------------------------------------------------

GptConfig GptConfig::preset(const std::string& name) {
  if (name == "tiny") return {.vocab_size = 256, .context = 64, .d_model = 64, .n_layer = 2, .n_head = 2};
  if (name == "small") return {.vocab_size = 256, .context = 256, .d_model = 256, .n_layer = 4, .n_head = 4};
  if (name == "medium") return {.vocab_size = 256, .context = 512, .d_model = 512, .n_layer = 8, .n_head = 8};
  if (name == "gpt2") {
    return {.vocab_size = 50257, .context = 1024, .d_model = 768, .n_layer = 12, .n_head = 12, .dropout = 0.1};
  }
  std::string names;
  for (const auto& n : preset_names()) names += " " + n;
  ZTRAIN_CHECK(false, "unknown GPT preset '", name, "'; presets:", names);
  return {};
}

std::vector<std::string> GptConfig::preset_names() { return {"tiny", "small", "medium", "gpt2"}; }

void GptConfig::validate(int tp_size) const {
  ZTRAIN_CHECK(vocab_size > 0, "GPT: vocab_size must be > 0, got ", vocab_size);
  ZTRAIN_CHECK(context > 0, "GPT: context must be > 0, got ", context);
  ZTRAIN_CHECK(n_layer >= 0, "GPT: n_layer must be >= 0, got ", n_layer);
  ZTRAIN_CHECK(n_head > 0 && d_model > 0 && d_model % n_head == 0, "GPT: d_model (", d_model,
               ") must be a positive multiple of n_head (", n_head, ")");
  ZTRAIN_CHECK(dropout >= 0 && dropout < 1, "GPT: dropout must be in [0, 1), got ", dropout);
  ZTRAIN_CHECK(tp_size >= 1, "GPT: the tensor-parallel size must be >= 1, got ", tp_size);
  for (const auto& [what, value] : {std::pair<const char*, int64_t>{"d_model", d_model}, {"n_head", n_head}}) {
    ZTRAIN_CHECK(value % tp_size == 0, "GPT: ", what, " (", value, ") is not divisible by the tensor-parallel size (",
                 tp_size, ")");
  }
  ZTRAIN_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
               "GPT: dtype must be float32, bfloat16 or float16, got ", dtype);
  if (dtype == torch::kFloat16) {
    try {
      torch::matmul(torch::ones({2, 2}, torch::kFloat16), torch::ones({2, 2}, torch::kFloat16));
    } catch (const std::exception&) {
      ZTRAIN_CHECK(false, "GPT: this libtorch build has no float16 matmul on this device; use bfloat16");
    }
  }
}

int64_t GptConfig::num_parameters() const {
  const int64_t d = d_model;
  const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
  return vocab_size * d + context * d + n_layer * block + 2 * d;
}

double GptConfig::flops_per_token(int64_t seq) const {
  // 6 FLOPs per parameter used per token (forward 2, backward 4) — the position embedding is a
  // lookup, not a matmul — plus attention scores and weighted sums: 2 · 2 · seq · d per layer
  // forward, ×3 with backward (PaLM appendix B).
  const double matmul_params = static_cast<double>(num_parameters() - context * d_model);
  return 6.0 * matmul_params + 12.0 * n_layer * seq * d_model;
}

// ---- layers ------------------------------------------------------------------------------------

namespace {
/// GPT-2's Conv1D layout ([in, out]) for the parallel linears.
tp::ColumnParallelLinear column(int64_t in, int64_t out, Communicator* tp, int64_t parts = 1) {
  return tp::ColumnParallelLinear(
      {.in_features = in, .out_features = out, .fused_parts = parts, .layout = tp::WeightLayout::kInOut}, tp);
}
tp::RowParallelLinear row(int64_t in, int64_t out, Communicator* tp) {
  return tp::RowParallelLinear({.in_features = in, .out_features = out, .layout = tp::WeightLayout::kInOut}, tp);
}
int size_of(const Communicator* tp) { return tp ? tp->size() : 1; }
/// The module's dropout through the fused kernel (models/fused.h).
torch::Tensor dropped(const torch::nn::Dropout& m, const torch::Tensor& x) {
  return models::dropout(x, m->options.p(), m->is_training());
}
}  // namespace

GptAttentionImpl::GptAttentionImpl(const GptConfig& c, Communicator* tp)
    : n_head(c.n_head / size_of(tp::resolve_group(tp))),
      head_dim(c.d_model / c.n_head),
      c_attn(column(c.d_model, 3 * c.d_model, tp, 3)),
      c_proj(row(c.d_model, c.d_model, tp)),
      attn_dropout(c.dropout), resid_dropout(c.dropout), fused(c.fused_attention) {
  register_module("c_attn", c_attn);
  register_module("c_proj", c_proj);
  register_module("attn_dropout", attn_dropout);
  register_module("resid_dropout", resid_dropout);
}

torch::Tensor GptAttentionImpl::forward(const torch::Tensor& x) {
  const auto b = x.size(0), t = x.size(1), hd = head_dim;
  const auto packed = c_attn(x).view({b, t, 3, n_head, hd});
  // When this rank holds some of the heads, their dropout mask is its own, not the tp group's.
  std::optional<TensorParallelRng> split_rng;
  if (n_head * hd < x.size(-1)) split_rng.emplace(x.device());
  const double p = is_training() ? attn_dropout->options.p() : 0.0;
  torch::Tensor y;
  // models::packed_attention is libtorch's scaled_dot_product_attention where its own kernel does
  // not take the tensors: 16-bit types on the CPU, unless the kernel runs on them widened
  // (models::detail::attention_widened). libtorch's CPU attention with dropout is its unfused
  // path, which draws the masks with bernoulli_, so there 16-bit types with dropout take the
  // eager path below, which computes the same with the fused dropout in less time.
  const bool kernel = !x.device().is_cpu() || x.scalar_type() == torch::kFloat ||
                      models::detail::attention_widened(x.scalar_type());
  if (fused && (p == 0 || kernel)) {
    y = models::packed_attention(packed, p, /*causal=*/true);  // its gradient in c_attn's layout
  } else {
    // q, k, v of [b, h, t, hd]; unbound, not indexed, so that backward stacks their gradients once
    // instead of zero-filling a whole [3, b, h, t, hd] gradient for each and summing the three.
    const auto qkv = packed.permute({2, 0, 3, 1, 4}).unbind(0);
    // Scores = causal + q kᵀ / √hd in one batched gemm: -inf above the diagonal, and no pass of
    // their own for the scale and the mask, forward or backward.
    const auto causal = torch::full({t, t}, -std::numeric_limits<float>::infinity(), x.options()).triu(1);
    const auto q = qkv[0].reshape({-1, t, hd}), k = qkv[1].reshape({-1, t, hd}), v = qkv[2].reshape({-1, t, hd});
    const auto scores = torch::baddbmm(causal, q, k.transpose(1, 2), 1.0, 1.0 / std::sqrt(static_cast<double>(hd)));
    const auto probs = torch::softmax(scores, -1, torch::kFloat32).to(x.scalar_type());
    y = torch::bmm(dropped(attn_dropout, probs), v).view({b, -1, t, hd});
  }
  split_rng.reset();
  return dropped(resid_dropout, c_proj(y.transpose(1, 2).reshape({b, t, n_head * hd})));
}

GptMlpImpl::GptMlpImpl(const GptConfig& c, Communicator* tp)
    : c_fc(column(c.d_model, 4 * c.d_model, tp)), c_proj(row(4 * c.d_model, c.d_model, tp)), dropout(c.dropout) {
  register_module("c_fc", c_fc);
  register_module("c_proj", c_proj);
  register_module("dropout", dropout);
}

torch::Tensor GptMlpImpl::forward(const torch::Tensor& x) { return dropped(dropout, c_proj(gelu_tanh(c_fc(x)))); }

torch::Tensor GptLayerNormImpl::forward(const torch::Tensor& x) {
  if (options.normalized_shape().size() != 1) return torch::nn::LayerNormImpl::forward(x);
  return layer_norm(x, weight, bias, options.eps());
}

GptBlockImpl::GptBlockImpl(const GptConfig& c, Communicator* tp)
    : ln_1(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)),
      ln_2(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)), attn(c, tp), mlp(c, tp) {
  register_module("ln_1", ln_1);
  register_module("attn", attn);
  register_module("ln_2", ln_2);
  register_module("mlp", mlp);
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  auto h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

GptTransformerImpl::GptTransformerImpl(const GptConfig& c, const BlockOptions& options, Communicator& tp)
    : wte(tp::slice(torch::empty({c.vocab_size, c.d_model}).normal_(0.0, 0.02),
                    {.dim = 0, .padding = padding_for(c.vocab_size, tp.size())}, tp.rank(), tp.size())
              .to(c.dtype),
          {.zero_level = options.zero_level,
           .tp_split = tp::Split{.dim = 0, .padding = padding_for(c.vocab_size, tp.size())},
           .context = options.context,
           .weight_decay = false}),
      wpe(torch::empty({c.context, c.d_model}).normal_(0.0, 0.01).to(c.dtype),
          {.zero_level = options.zero_level, .context = options.context, .weight_decay = false}),
      h(c.n_layer,
        [&](int64_t) {
          GptBlock block(c, &tp);
          block->to(c.dtype);
          return block;
        },
        options),
      ln_f(
          [&] {
            GptLayerNorm ln(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps));
            ln->to(c.dtype);
            return ln;
          }(),
          {.zero_level = options.zero_level, .use_checkpoint = false, .context = options.context}),
      drop(c.dropout) {
  register_module("wte", wte);
  register_module("wpe", wpe);
  register_module("drop", drop);
  register_module("h", h);
  register_module("ln_f", ln_f);
}

// ---- the model ---------------------------------------------------------------------------------

namespace {
/// The tp group of the context the options name (the default context's when not set).
Communicator& tp_of(const BlockOptions& options) { return context_or_default(options.context)->tp(); }

// ---- the head's products over slices of the vocabulary -----------------------------------------
// On the CPU the head's three products (the logits, the input's gradient and the table's) go
// through the vocabulary kHeadSlice rows at a time. Whole, GPT-2's 512 × 768 × 50257 products ran
// in oneDNN's bf16 gemm on an AMX Xeon core at 300–400 GFLOP/s, in slices at 640–840 (100 → 64,
// 147 → 74 and 119 → 64 ms), and in fp32 at 359 → 317, 286 → 282 and 351 → 291 ms: whole, the
// table (77 MB in bf16) and the logits (51 MB) leave the caches between the gemm's blocks. The
// input's gradient, a sum over the vocabulary, adds the slices' products in float (or wider).

constexpr int64_t kHeadSlice = 4096;

bool sliced_head(const torch::Tensor& wte) { return wte.device().is_cpu() && wte.size(0) > kHeadSlice; }

/// Calls f(first row, rows) for the table's slices.
template <typename F>
void for_head_slices(int64_t vocab, F&& f) {
  for (int64_t r = 0; r < vocab; r += kHeadSlice) f(r, std::min(kHeadSlice, vocab - r));
}

/// x · wteᵀ for x of [..., d]: the logits.
torch::Tensor head_logits(const torch::Tensor& x, const torch::Tensor& wte) {
  if (!sliced_head(wte)) return torch::matmul(x, wte.t());
  const auto flat = x.reshape({-1, x.size(-1)});
  auto logits = torch::empty({flat.size(0), wte.size(0)}, x.options());
  for_head_slices(wte.size(0), [&](int64_t r, int64_t rows) {
    logits.narrow(1, r, rows).copy_(torch::mm(flat, wte.narrow(0, r, rows).t()));
  });
  auto sizes = x.sizes().vec();
  sizes.back() = wte.size(0);
  return logits.view(sizes);
}

/// g · wte for g of [..., V]: the input's gradient.
torch::Tensor head_input_gradient(const torch::Tensor& g, const torch::Tensor& wte) {
  if (!sliced_head(wte)) return torch::matmul(g, wte);
  const auto flat = g.reshape({-1, g.size(-1)});
  const auto sum_type = c10::isReducedFloatingType(g.scalar_type()) ? torch::kFloat : g.scalar_type();
  auto sum = torch::zeros({flat.size(0), wte.size(1)}, g.options().dtype(sum_type));
  for_head_slices(wte.size(0), [&](int64_t r, int64_t rows) {
    const auto part = flat.narrow(1, r, rows), table = wte.narrow(0, r, rows);
    if (sum_type == g.scalar_type()) {
      sum.addmm_(part, table);
    } else {
      sum.add_(torch::mm(part, table));
    }
  });
  auto sizes = g.sizes().vec();
  sizes.back() = wte.size(1);
  return sum.to(g.scalar_type()).view(sizes);
}

/// out = gᵀ · x, [V, d], from gᵀ [V, tokens] and x [tokens, d]: the table's gradient from the head.
torch::Tensor head_table_product(const torch::Tensor& gt, const torch::Tensor& x, torch::Tensor out) {
  if (!sliced_head(out)) return at::mm_out(out, gt, x);
  for_head_slices(out.size(0), [&](int64_t r, int64_t rows) {
    auto slice = out.narrow(0, r, rows);
    at::mm_out(slice, gt.narrow(0, r, rows), x);
  });
  return out;
}

// ---- the tied embedding's gradient -------------------------------------------------------------
// The token table is used twice, by the lookup and by the head. Through libtorch's operators its
// gradient would be the head's [V, d] product, a zero-filled [V, d] for the lookup's rows and
// their sum, made out of place (the head's product arrives as a transposed view): three passes over
// the whole table beside the product. Here the head's backward keeps its product, and the lookup's
// backward, which always comes later (its gradient flows through the whole model from the head),
// adds its rows into it and hands the sum over as the table's gradient. The head's gemm writes its
// product straight into the place where the table's sharded module sums the gradient for its
// reduction (DistributedParameter::gradient_place), so the sum needs no copy there either. Where
// the head's product is not there (a graph being built for a second derivative, or a backward that
// did not pass the head), each is its own.

struct TiedGradient : torch::CustomClassHolder {
  explicit TiedGradient(const DistributedParameter& table) : table(table.ptr()) {}
  std::weak_ptr<DistributedParameterImpl> table;  // the graph does not keep the model alive
  torch::Tensor head;  // the head's product, awaiting the lookup's rows

  /// a · b for the head's product: in the table's gradient place where it has one of the
  /// product's type.
  torch::Tensor product(const torch::Tensor& a, const torch::Tensor& b) const {
    if (const auto owner = table.lock()) {
      if (auto place = owner->gradient_place(); place.defined() && place.scalar_type() == a.scalar_type()) {
        return head_table_product(a, b, place);
      }
    }
    return head_table_product(a, b, torch::empty({a.size(0), b.size(1)}, a.options()));
  }
};

c10::intrusive_ptr<TiedGradient> tied_gradient(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<TiedGradient>(ctx->saved_data["tied"].toCapsule());
}

struct TiedLookup : torch::autograd::Function<TiedLookup> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& wte,
                               const torch::Tensor& tokens, c10::IValue tied) {
    ctx->save_for_backward({tokens});
    ctx->saved_data["tied"] = std::move(tied);
    ctx->saved_data["rows"] = wte.size(0);
    return torch::embedding(wte, tokens);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto tokens = ctx->get_saved_variables()[0];
    auto head = std::exchange(tied_gradient(ctx)->head, torch::Tensor());
    if (!head.defined()) {
      return {torch::embedding_backward(grads[0], tokens, ctx->saved_data["rows"].toInt(), -1, false, false), {}, {}};
    }
    head.index_add_(0, tokens.reshape(-1), grads[0].reshape({-1, head.size(1)}).to(head.scalar_type()));
    return {head, {}, {}};
  }
};

struct TiedHead : torch::autograd::Function<TiedHead> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& wte,
                               c10::IValue tied) {
    ctx->save_for_backward({x, wte});
    ctx->saved_data["tied"] = std::move(tied);
    return head_logits(x, wte);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wte = saved[1], &g = grads[0];
    torch::Tensor dx, dwte;
    if (ctx->needs_input_grad(0)) {
      dx = torch::GradMode::is_enabled() ? torch::matmul(g, wte) : head_input_gradient(g, wte);
    }
    if (ctx->needs_input_grad(1)) {
      const auto a = g.reshape({-1, g.size(-1)}).t(), b = x.reshape({-1, x.size(-1)});
      if (torch::GradMode::is_enabled()) {
        dwte = torch::mm(a, b);
      } else {
        auto& tied = *tied_gradient(ctx);
        tied.head = tied.product(a, b);
      }
    }
    return {dx, dwte, {}};
  }
};
}  // namespace

GptImpl::GptImpl(GptConfig config, BlockOptions options)
    : transformer((config.validate(tp_of(options).size()), config), options, tp_of(options)),
      config_(std::move(config)),
      tp_(tp_of(options).size() > 1 ? &tp_of(options) : nullptr) {
  register_module("transformer", transformer);
}

torch::Tensor GptImpl::local_logits(const torch::Tensor& tokens) {
  ZTRAIN_CHECK(tokens.dim() == 2, "GPT: tokens must be [batch, seq], got ", tokens.sizes());
  const auto t = tokens.size(1);
  ZTRAIN_CHECK(t <= config_.context, "GPT: sequence length ", t, " exceeds the context ", config_.context);
  auto& tr = *transformer;
  auto wte = tr.wte();
  auto positions = torch::arange(t, tokens.options().dtype(torch::kLong));
  if (tp_) {
    auto tok = tp::vocab_parallel_embedding(tokens, wte, tp_);
    auto x = dropped(tr.drop, tok + torch::embedding(tr.wpe(), positions));
    return tied_head_logits(tr.ln_f(tr.h(x)), wte, config_.vocab_size, tp_);
  }
  const auto tied = c10::IValue::make_capsule(c10::make_intrusive<TiedGradient>(tr.wte));
  auto x = dropped(tr.drop, TiedLookup::apply(wte, tokens, tied) + torch::embedding(tr.wpe(), positions));
  return TiedHead::apply(tr.ln_f(tr.h(x)), wte, tied);
}

torch::Tensor tied_head_logits(const torch::Tensor& x, const torch::Tensor& wte, int64_t vocab_size, Communicator* tp) {
  auto logits = torch::matmul(tp ? functional::copy_to_group(x, *tp) : x, wte.t());
  // The padding's rows of the vocabulary (the last rank's last ones) are no tokens: masked out
  // of the softmax.
  const int64_t local = wte.size(0);
  const int64_t valid = tp ? std::max<int64_t>(vocab_size - tp->rank() * local, 0) : std::min(local, vocab_size);
  if (valid < local) {
    logits = logits.index_fill(-1, torch::arange(valid, local, logits.options().dtype(torch::kLong)),
                               -std::numeric_limits<float>::infinity());
  }
  return logits;
}

torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens, Communicator* tp) {
  auto flat = logits.reshape({-1, logits.size(-1)});
  auto targets = tokens.slice(1, 1).reshape(-1);
  if (tp) return tp::parallel_cross_entropy(flat, targets, {}, tp);
  return cross_entropy(flat, targets);  // 16-bit logits in float
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  auto logits = local_logits(tokens);
  if (!tp_) return logits;
  return functional::gather_from_group(logits, *tp_, -1).narrow(-1, 0, config_.vocab_size);
}

torch::Tensor GptImpl::loss(const torch::Tensor& tokens) {
  ZTRAIN_CHECK(tokens.dim() == 2 && tokens.size(1) >= 2,
               "GPT loss: tokens must be [batch, seq + 1] with seq >= 1, got ", tokens.sizes());
  return next_token_loss(local_logits(tokens.slice(1, 0, -1)), tokens, tp_);
}

ParameterInit gpt_init(const GptConfig& config) {
  const double proj_std = 0.02 / std::sqrt(2.0 * std::max<int64_t>(config.n_layer, 1));
  return [proj_std](const std::string& name, torch::Tensor& value, at::Generator& gen) {
    auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends_with("c_proj.weight")) {
      value.normal_(0.0, proj_std, gen);
    } else if (ends_with("wpe.weight")) {
      value.normal_(0.0, 0.01, gen);
    } else {
      gpt2_init(name, value, gen);
    }
  };
}

}  // namespace ztrain::models
