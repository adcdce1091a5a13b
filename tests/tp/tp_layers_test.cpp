// Tensor-parallel layers against their dense single-process counterparts: outputs and the
// gradients of inputs, weights and biases (fp32, 1e-5), on a tp group of the whole world.

#include "tp_environment.h"

namespace ztrain::test {
namespace tp_layers_test {

[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new TensorParallelEnvironment({"TensorParallel"}));

using tp::Split;

Communicator& group() { return runtime().tp(); }
int tp_rank() { return group().rank(); }
int tp_size() { return group().size(); }

/// The same random tensor on every rank.
torch::Tensor same_randn(std::vector<int64_t> shape, uint64_t seed) {
  return torch::randn(shape, at::detail::createCPUGenerator(seed));
}

torch::Tensor mine(const torch::Tensor& full, Split s) { return tp::slice(full, s, tp_rank(), tp_size()); }

constexpr double kTol = 1e-5;

TEST(TensorParallel, SplitSliceAndAssembleAreInverse) {
  auto full = same_randn({6, 12}, 1);
  for (Split s : {Split{.dim = 0}, Split{.dim = 1}, Split{.dim = 1, .parts = 3}, Split{.dim = -1, .parts = 2}}) {
    if (full.size(s.dim < 0 ? s.dim + 2 : s.dim) % (s.parts * tp_size()) != 0) continue;
    EXPECT_TRUE(tensors_equal(tp::assemble(mine(full, s), s, group()), full)) << s.dim << "/" << s.parts;
  }
  // fused parts: rank r holds [q_r, k_r, v_r]
  auto qkv = torch::arange(12 * tp_size()).to(torch::kFloat32);
  auto local = tp::slice(qkv, {.dim = 0, .parts = 3}, tp_rank(), tp_size());
  const int64_t c = 4;
  for (int p = 0; p < 3; ++p) {
    EXPECT_TRUE(tensors_equal(local.slice(0, p * c, (p + 1) * c), qkv.slice(0, p * 4 * tp_size() + tp_rank() * c).slice(0, 0, c)));
  }
  EXPECT_NE(error_message([&] { tp::slice(same_randn({5, 3}, 2), {.dim = 0}, 0, 4); }).find("does not divide"),
            std::string::npos);
  // Padded: 7 rows over tp ranks, the last slice ending with zero rows; the full shape and the
  // assembled tensor leave them out.
  auto rows = same_randn({7, 3}, 3);
  const Split padded{.dim = 0, .padding = ztrain::padding_for(7, tp_size())};
  auto local_rows = tp::slice(rows, padded, tp_rank(), tp_size());
  const int64_t per = (7 + padded.padding) / tp_size();
  ASSERT_EQ(local_rows.size(0), per);
  const int64_t real = std::max<int64_t>(0, std::min<int64_t>(per, 7 - tp_rank() * per));
  EXPECT_TRUE(tensors_equal(local_rows.narrow(0, 0, real), rows.narrow(0, tp_rank() * per, real)));
  EXPECT_EQ(local_rows.narrow(0, real, per - real).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(tp::full_shape(local_rows.sizes(), padded, tp_size()), (std::vector<int64_t>{7, 3}));
  EXPECT_TRUE(tensors_equal(tp::assemble(local_rows, padded, group()), rows));
}

TEST(TensorParallel, ColumnParallelLinearMatchesDense) {
  for (auto layout : {tp::WeightLayout::kOutIn, tp::WeightLayout::kInOut}) {
    for (int64_t parts : {1, 3}) {
      for (bool gather : {false, true}) {
        const int64_t in = 6, out = 12 * parts;
        tp::ColumnParallelLinear layer({.in_features = in, .out_features = out, .gather_output = gather,
                                        .fused_parts = parts, .layout = layout});
        const Split ws{.dim = layout == tp::WeightLayout::kOutIn ? 0 : 1, .parts = parts};
        const Split bs{.dim = 0, .parts = parts};
        ASSERT_TRUE(tp::split_of(*layer, "weight").has_value());
        EXPECT_EQ(tp::split_of(*layer, "weight")->dim, ws.dim);
        EXPECT_EQ(tp::split_of(*layer, "bias")->parts, parts);
        auto w = tp::assemble(layer->weight.detach(), ws, group()).requires_grad_();
        auto b = tp::assemble(layer->bias.detach(), bs, group()).requires_grad_();
        auto x_ref = same_randn({3, 5, in}, 10).requires_grad_();
        auto y_ref = layout == tp::WeightLayout::kOutIn ? torch::nn::functional::linear(x_ref, w, b)
                                                        : torch::matmul(x_ref, w) + b;
        auto g = same_randn(y_ref.sizes().vec(), 11);
        (y_ref * g).sum().backward();

        auto x = x_ref.detach().clone().requires_grad_();
        auto y = layer(x);
        const Split ys{.dim = -1, .parts = parts};
        EXPECT_TRUE(tensors_equal(y, gather ? y_ref.detach() : mine(y_ref.detach(), ys), kTol, kTol));
        (y * (gather ? g : mine(g, ys))).sum().backward();
        EXPECT_TRUE(tensors_equal(x.grad(), x_ref.grad(), kTol, kTol)) << "input gradient";
        EXPECT_TRUE(tensors_equal(layer->weight.grad(), mine(w.grad(), ws), kTol, kTol)) << "weight gradient";
        EXPECT_TRUE(tensors_equal(layer->bias.grad(), mine(b.grad(), bs), kTol, kTol)) << "bias gradient";
      }
    }
  }
}

TEST(TensorParallel, RowParallelLinearMatchesDense) {
  for (auto layout : {tp::WeightLayout::kOutIn, tp::WeightLayout::kInOut}) {
    for (bool parallel_input : {true, false}) {
      const int64_t in = 8 * tp_size(), out = 5;
      tp::RowParallelLinear layer(
          {.in_features = in, .out_features = out, .input_is_parallel = parallel_input, .layout = layout});
      const Split ws{.dim = layout == tp::WeightLayout::kOutIn ? 1 : 0};
      EXPECT_FALSE(tp::split_of(*layer, "bias").has_value());  // replicated
      EXPECT_EQ(tp::split_of(*layer, "weight")->dim, ws.dim);
      auto w = tp::assemble(layer->weight.detach(), ws, group()).requires_grad_();
      auto b = layer->bias.detach().clone().requires_grad_();
      auto x_ref = same_randn({4, in}, 20).requires_grad_();
      auto y_ref = layout == tp::WeightLayout::kOutIn ? torch::nn::functional::linear(x_ref, w, b)
                                                      : torch::matmul(x_ref, w) + b;
      auto g = same_randn(y_ref.sizes().vec(), 21);
      (y_ref * g).sum().backward();

      auto x = (parallel_input ? mine(x_ref.detach(), {.dim = -1}) : x_ref.detach().clone()).requires_grad_();
      auto y = layer(x);
      EXPECT_TRUE(tensors_equal(y, y_ref.detach(), kTol, kTol));
      (y * g).sum().backward();
      auto want_dx = parallel_input ? mine(x_ref.grad(), {.dim = -1}) : x_ref.grad();
      EXPECT_TRUE(tensors_equal(x.grad(), want_dx, kTol, kTol)) << "input gradient";
      EXPECT_TRUE(tensors_equal(layer->weight.grad(), mine(w.grad(), ws), kTol, kTol)) << "weight gradient";
      EXPECT_TRUE(tensors_equal(layer->bias.grad(), b.grad(), kTol, kTol)) << "bias gradient (not scaled by tp)";
    }
  }
}

// A Megatron MLP: column-parallel then row-parallel, one all-reduce each way; and the gradient
// norm over split and replicated parameters counts every element once.
TEST(TensorParallel, MlpAndGradientNormMatchDense) {
  struct Mlp : torch::nn::Module {
    tp::ColumnParallelLinear fc{tp::ColumnParallelLinearOptions{.in_features = 6, .out_features = 16}};
    tp::RowParallelLinear proj{tp::RowParallelLinearOptions{.in_features = 16, .out_features = 6}};
    Mlp() {
      register_module("fc", fc);
      register_module("proj", proj);
    }
  };
  if (16 % tp_size() != 0) GTEST_SKIP();
  auto mlp = std::make_shared<Mlp>();
  auto w1 = tp::assemble(mlp->fc->weight.detach(), {.dim = 0}, group()).requires_grad_();
  auto b1 = tp::assemble(mlp->fc->bias.detach(), {.dim = 0}, group()).requires_grad_();
  auto w2 = tp::assemble(mlp->proj->weight.detach(), {.dim = 1}, group()).requires_grad_();
  auto b2 = mlp->proj->bias.detach().clone().requires_grad_();
  auto x_ref = same_randn({7, 6}, 30).requires_grad_();
  namespace F = torch::nn::functional;
  auto loss_ref = F::linear(torch::gelu(F::linear(x_ref, w1, b1)), w2, b2).pow(2).sum();
  loss_ref.backward();
  auto x = x_ref.detach().clone().requires_grad_();
  auto loss = mlp->proj(torch::gelu(mlp->fc(x))).pow(2).sum();
  EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>(), kTol * loss_ref.item<double>());
  torch::optim::SGD opt(mlp->parameters(), 0.1);
  optim::OptimManager mgr(*mlp);
  mgr.add_optimizer(opt);
  mgr.backward(loss);
  EXPECT_TRUE(tensors_equal(x.grad(), x_ref.grad(), kTol, kTol));
  double sq = 0;
  for (const auto& t : {w1, b1, w2, b2}) sq += t.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(mgr.grad_norm(), std::sqrt(sq), 1e-5 * std::sqrt(sq));
}

TEST(TensorParallel, VocabParallelEmbeddingSendsEveryTokensGradientToItsSlice) {
  const int64_t vocab = 8 * tp_size(), dim = 5;
  tp::VocabParallelEmbedding emb({.num_embeddings = vocab, .embedding_dim = dim});
  auto w = tp::assemble(emb->weight.detach(), {.dim = 0}, group()).requires_grad_();
  // Tokens from every rank's range, some repeated.
  auto tokens = torch::randint(vocab, {3, 9}, at::detail::createCPUGenerator(40), torch::kLong);
  tokens[0][0] = 0;
  tokens[0][1] = vocab - 1;
  auto y_ref = torch::embedding(w, tokens);
  auto g = same_randn(y_ref.sizes().vec(), 41);
  (y_ref * g).sum().backward();
  auto y = emb(tokens);
  EXPECT_TRUE(tensors_equal(y, y_ref.detach(), kTol, kTol));
  (y * g).sum().backward();
  EXPECT_TRUE(tensors_equal(emb->weight.grad(), mine(w.grad(), {.dim = 0}), kTol, kTol));
  EXPECT_GT(emb->weight.grad().abs().sum().item<double>(), 0);
  EXPECT_NE(error_message([&] { emb(torch::full({1, 2}, vocab, torch::kLong)); }).find("token ids must be in"),
            std::string::npos);
}

TEST(TensorParallel, ParallelCrossEntropyMatchesDenseWithoutGatheringLogits) {
  const int64_t vocab = 6 * tp_size(), n = 11;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto logits_ref = (same_randn({n, vocab}, 50) * 3).to(dtype).requires_grad_();
    auto target = torch::randint(vocab, {n}, at::detail::createCPUGenerator(51), torch::kLong);
    target[2] = -100;  // ignored
    target[3] = vocab - 1;
    auto loss_ref = torch::nn::functional::cross_entropy(logits_ref.to(torch::kFloat32), target);
    loss_ref.backward();
    auto logits = mine(logits_ref.detach(), {.dim = 1}).requires_grad_();
    auto loss = tp::parallel_cross_entropy(logits, target);
    EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>(), 1e-5 * loss_ref.item<double>());
    loss.backward();
    const double tol = dtype == torch::kFloat32 ? kTol : 1e-2;
    EXPECT_TRUE(tensors_equal(logits.grad().to(torch::kFloat32), mine(logits_ref.grad(), {.dim = 1}).to(torch::kFloat32), tol, tol));
    EXPECT_EQ(logits.grad().scalar_type(), dtype);
    EXPECT_EQ(logits.grad()[2].abs().sum().item<double>(), 0.0) << "ignored rows get no gradient";
  }
  // Per-row losses.
  auto logits_ref = same_randn({n, vocab}, 52);
  auto target = torch::randint(vocab, {n}, at::detail::createCPUGenerator(53), torch::kLong);
  auto rows = tp::parallel_cross_entropy(mine(logits_ref, {.dim = 1}), target, {.mean = false});
  auto rows_ref = torch::nn::functional::cross_entropy(
      logits_ref, target, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  EXPECT_TRUE(tensors_equal(rows, rows_ref, kTol, kTol));
  EXPECT_NE(error_message([&] { tp::parallel_cross_entropy(mine(logits_ref, {.dim = 1}), target + vocab); })
                .find("targets must be in"),
            std::string::npos);
}

TEST(TensorParallel, InitParametersDrawsFullTensorsIndependentOfTpSize) {
  struct Split2 : torch::nn::Module {
    tp::ColumnParallelLinear fc{tp::ColumnParallelLinearOptions{.in_features = 4, .out_features = 24, .fused_parts = 3}};
    Split2() { register_module("fc", fc); }
  };
  struct Dense : torch::nn::Module {
    torch::nn::Linear fc{4, 24};
    Dense() { register_module("fc", fc); }
  };
  auto split = std::make_shared<Split2>();
  auto dense = std::make_shared<Dense>();
  init_parameters(*split, {.seed = 9});
  init_parameters(*dense, {.seed = 9});
  EXPECT_TRUE(tensors_equal(tp::assemble(split->fc->weight.detach(), {.dim = 0, .parts = 3}, group()),
                            dense->fc->weight.detach()));
  auto refs = named_parameter_refs(*split);
  ASSERT_EQ(refs.size(), 2u);
  EXPECT_EQ(refs[0].full_shape(), (std::vector<int64_t>{24, 4}));
  EXPECT_TRUE(tensors_equal(full_parameter(refs[0]), dense->fc->weight.detach()));
}

TEST(TensorParallel, SizesThatDoNotDivideAreRejected) {
  if (tp_size() == 1) GTEST_SKIP();
  EXPECT_NE(error_message([] { tp::ColumnParallelLinear({.in_features = 4, .out_features = 4 * tp_size() + 1}); })
                .find("not divisible"),
            std::string::npos);
  EXPECT_NE(error_message([] { tp::RowParallelLinear({.in_features = 4 * tp_size() + 1, .out_features = 4}); })
                .find("not divisible"),
            std::string::npos);
  EXPECT_NE(error_message([] { tp::VocabParallelEmbedding({.num_embeddings = 4 * tp_size() + 1, .embedding_dim = 4}); })
                .find("not divisible"),
            std::string::npos);
  // Gpt pads its vocabulary (tp_gpt_test); its heads must divide.
  const auto msg = error_message([] { models::Gpt(models::GptConfig{.d_model = 48, .n_head = 3}); });
  EXPECT_NE(msg.find("n_head (3) is not divisible by the tensor-parallel size"), std::string::npos) << msg;
}

}  // namespace tp_layers_test
}  // namespace ztrain::test
