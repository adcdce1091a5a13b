// HybridParallel: the Llama-style decoder, split over tensor-parallel ranks by its policy and
// sharded over the rest at every ZeRO level, trains as one process does on the global batch
// (20 clipped steps, losses and final parameters within 1e-5 relative in fp32, and within
// 1e-12 in fp64 with AdamW, which shows the split exact); its files load
// under the data-parallel plugins and into the plain model; the ztrain::nn layers are torch's
// when not split; a policy that does not fit the model says where.

#include "parity.h"

#include <filesystem>

namespace ztrain::test {
namespace {

std::shared_ptr<Plugin> hybrid(int tp, int zero_level, bool use_checkpoint = false) {
  return std::make_shared<HybridParallel>(HybridParallelOptions{.tp_size = tp,
                                                                .zero_level = zero_level,
                                                                .policy = llama::policy(),
                                                                .use_checkpoint = use_checkpoint,
                                                                .bucket_bytes = 16 << 10});
}

/// The Llama family with SGD and momentum. A tensor-parallel split sums the same products in
/// another order (a row-parallel layer's partial products, then their all-reduce), and AdamW
/// turns the rounding of gradient elements that are zero up to rounding into steps of the full
/// learning rate: after 20 fp32 steps its last layer's SwiGLU weights are 4e-5 of their norm
/// off the one-process run, where SGD's stay at 3e-7 (the fp64 test below runs AdamW).
Family llama_sgd() {
  auto family = llama_family();
  family.optimizer = [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(m.parameters(),
                                               torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  };
  return family;
}

TEST(HybridParallel, LlamaTrainsAsOneProcessAtEveryZeroLevel) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto family = llama_sgd();
  const auto want = train(family, nullptr);
  EXPECT_LT(want.losses.back(), want.losses.front() - 0.1) << "the reference run learns";
  // tp 2 and every dp size the world leaves (1 at two ranks, 2 at four), every ZeRO level.
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE("tp 2, zero " + std::to_string(level));
    expect_same(train(family, hybrid(2, level)), want);
  }
  SCOPED_TRACE("tp 2, zero 3 with recomputation");
  expect_same(train(family, hybrid(2, 3, true)), want);
  if (world_size() == 4) {
    SCOPED_TRACE("tp 4, zero 1");
    expect_same(train(family, hybrid(4, 1)), want);
  }
}

TEST(HybridParallel, TheSplitIsExactInDoublePrecisionWithAdamW) {
  auto family = llama_family();
  family.build = [] {
    auto model = llama::Llama(small_llama()).ptr();
    model->to(torch::kFloat64);
    return model;
  };
  family.optimizer = [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
    const auto options = torch::optim::AdamWOptions(3e-3).weight_decay(0.1);
    return std::make_unique<torch::optim::AdamW>(optim::weight_decay_groups(m, options), options);
  };
  const auto want = train(family, nullptr);
  const auto got = train(family, hybrid(2, 0));
  for (size_t i = 0; i < want.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], 1e-12) << "step " << i;
  for (const auto& [name, value] : want.params) {
    EXPECT_LE((got.params.at(name) - value).norm().item<double>(), 1e-12 * value.norm().item<double>()) << name;
  }
}

TEST(HybridParallel, SplitsWhatThePolicyNamesAndShardsTheRest) {
  torch::manual_seed(7);
  llama::Llama model(small_llama());
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto plugin = std::make_shared<HybridParallel>(HybridParallelOptions{.tp_size = 2, .zero_level = 0, .policy = llama::policy()});
  Booster booster(plugin);
  booster.boost(*model, opt);
  auto& mesh = plugin->context();
  EXPECT_EQ(mesh.tp().size(), 2);
  EXPECT_EQ(mesh.dp().size(), world_size() / 2);
  const auto c = small_llama();
  const auto& layer = (*model->layers)[0].module();
  EXPECT_EQ(layer->attention->wq->weight.sizes(), (std::vector<int64_t>{c.dim / 2, c.dim}));
  EXPECT_EQ(layer->attention->wo->weight.sizes(), (std::vector<int64_t>{c.dim, c.dim / 2}));
  EXPECT_EQ(layer->feed_forward->w2->weight.sizes(), (std::vector<int64_t>{c.dim, c.hidden / 2}));
  EXPECT_EQ(model->tok_embeddings->weight.sizes(), (std::vector<int64_t>{c.vocab / 2, c.dim}));
  EXPECT_EQ(model->output->weight.sizes(), (std::vector<int64_t>{c.vocab / 2, c.dim}));
  EXPECT_EQ(model->norm->weight.sizes(), (std::vector<int64_t>{c.dim})) << "norms stay replicated";
  EXPECT_EQ(layer->attention->heads, c.heads / 2) << "the policy's adapt divides the heads";
  EXPECT_EQ(layer->attention->wq->style().role, nn::TpRole::kColumn);
  // The optimizer still updates the model's parameter objects, now the slices.
  EXPECT_TRUE(std::any_of(opt.param_groups()[0].params().begin(), opt.param_groups()[0].params().end(),
                          [&](const torch::Tensor& p) { return p.is_same(layer->attention->wq->weight); }));
}

TEST(HybridParallel, FilesLoadUnderOtherPluginsAndLayouts) {
  // A run saved at tp 2 with ZeRO-2 over dp loads into the plain model, under DataParallel and
  // under FullyShard over every rank; with the optimizer state, the next step agrees.
  const auto family = llama_family();
  const auto dir = shared_temp_dir("hybrid_files");
  if (runtime().rank() == 0) std::filesystem::create_directories(dir);
  runtime().world().barrier();
  Trainee split(family, 7, hybrid(2, 2));
  for (int step = 0; step < 3; ++step) split.step(global_batch(step, family.vocab));
  split.booster->save_model(dir + "/model.safetensors");
  split.booster->save_optimizer(dir + "/optimizer.safetensors");
  const auto saved = split.params();
  const auto tokens = global_batch(3, family.vocab);
  const double next = split.step(tokens);
  const auto after = split.params();

  Trainee plain(family, 13, nullptr);
  load(*plain.model, dir + "/model.safetensors");
  for (const auto& [key, value] : plain.params()) EXPECT_TRUE(tensors_equal(value, saved.at(key))) << key;
  for (auto make : std::vector<std::function<std::shared_ptr<Plugin>()>>{
           [] { return std::make_shared<DataParallel>(); }, [] { return std::make_shared<FullyShard>(); },
           [] { return hybrid(world_size(), 1); }}) {
    Trainee other(family, 11, make());
    SCOPED_TRACE(other.booster->plugin().name());
    other.booster->load_model(dir + "/model.safetensors");
    other.booster->load_optimizer(dir + "/optimizer.safetensors");
    for (const auto& [key, value] : other.params()) EXPECT_TRUE(tensors_equal(value, saved.at(key))) << key;
    EXPECT_NEAR(other.step(tokens), next, 1e-5 * std::abs(next));
    for (const auto& [key, value] : other.params()) EXPECT_TRUE(tensors_equal(value, after.at(key), 1e-5, 1e-7)) << key;
  }
  runtime().world().barrier();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(HybridParallel, DropInLayersAreTorchsUntilSplit) {
  // Same seed, same values, same names, same outputs as torch::nn::Linear and Embedding.
  for (bool with_bias : {true, false}) {
    const auto options = torch::nn::LinearOptions(6, 4).bias(with_bias);
    torch::manual_seed(3);
    torch::nn::Linear theirs(options);
    torch::manual_seed(3);
    nn::Linear ours(options);
    EXPECT_EQ(ours->named_parameters().keys(), theirs->named_parameters().keys());
    for (const auto& p : theirs->named_parameters()) EXPECT_TRUE(tensors_equal(ours->named_parameters()[p.key()], p.value()));
    const auto x = torch::randn({3, 6});
    EXPECT_TRUE(tensors_equal(ours(x), theirs(x)));
  }
  torch::manual_seed(4);
  torch::nn::Embedding theirs(10, 3);
  torch::manual_seed(4);
  nn::Embedding ours(10, 3);
  EXPECT_TRUE(tensors_equal(ours->weight, theirs->weight));
  const auto tokens = torch::tensor({{1, 9, 0}}, torch::kLong);
  EXPECT_TRUE(tensors_equal(ours(tokens), theirs(tokens)));
  // Weight decay skips the embedding, as it skips torch's.
  EXPECT_EQ(optim::default_weight_decay(*ours), std::vector<bool>{false});
  EXPECT_NE(error_message([] { nn::Embedding(torch::nn::EmbeddingOptions(4, 2).padding_idx(0)); }).find("padding_idx"),
            std::string::npos);
}

TEST(HybridParallel, SplitLayersComputeTheWholeLayer) {
  // Over every rank as one tp group: each role's output (and input gradient) equals the whole
  // layer's; a vocabulary that does not divide is padded, and the full tensor has no padding.
  auto& world = runtime().world();
  const int tp = world.size();
  torch::manual_seed(5);
  nn::Linear column(8, 4 * tp), row(4 * tp, 8), head(8, 7 * tp + 1);
  nn::Embedding embedding(7 * tp + 1, 8);  // does not divide over more than one rank
  torch::manual_seed(5);
  torch::nn::Linear column_ref(8, 4 * tp), row_ref(4 * tp, 8), head_ref(8, 7 * tp + 1);
  torch::nn::Embedding embedding_ref(7 * tp + 1, 8);
  if (tp > 1) {
    EXPECT_NE(error_message([&] { head->parallelize({.role = nn::TpRole::kColumn}, world); }).find("do not split"),
              std::string::npos);
  }
  column->parallelize({.role = nn::TpRole::kColumn}, world);
  row->parallelize({.role = nn::TpRole::kRow}, world);
  embedding->parallelize({.role = nn::TpRole::kVocab}, world);
  EXPECT_NE(error_message([&] { row->parallelize({.role = nn::TpRole::kRow}, world); }).find("called already"),
            std::string::npos);
  auto x = torch::randn({2, 8}).requires_grad_(), x_ref = x.detach().clone().requires_grad_();
  const auto tokens = torch::arange(7 * tp + 1, torch::kLong).view({1, -1});
  auto y = row(column(x)).sum() + embedding(tokens).sum();
  auto y_ref = row_ref(column_ref(x_ref)).sum() + embedding_ref(tokens).sum();
  EXPECT_NEAR(y.item<double>(), y_ref.item<double>(), 1e-4);
  y.backward();
  y_ref.backward();
  EXPECT_TRUE(tensors_equal(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  for (const auto& ref : named_parameter_refs(*embedding)) {
    EXPECT_TRUE(tensors_equal(full_parameter(ref), embedding_ref->weight)) << "without the padding";
  }
}

TEST(HybridParallel, APolicyThatDoesNotFitSaysWhere) {
  auto boost_with = [](Policy policy) {
    torch::manual_seed(7);
    llama::Llama model(small_llama());
    torch::optim::SGD opt(model->parameters(), 0.1);
    Booster booster(std::make_shared<HybridParallel>(
        HybridParallelOptions{.tp_size = 2, .zero_level = 1, .policy = std::move(policy)}));
    return error_message([&] { booster.boost(*model, opt); });
  };
  auto policy = llama::policy();
  policy.tensor_parallel.push_back({"layers.*.attention.wqkv", {.role = nn::TpRole::kColumn}});
  auto msg = boost_with(policy);
  EXPECT_NE(msg.find("rule 'layers.*.attention.wqkv' names no module"), std::string::npos) << msg;
  policy = llama::policy();
  policy.tensor_parallel.push_back({"norm", {.role = nn::TpRole::kColumn}});
  msg = boost_with(policy);
  EXPECT_NE(msg.find("cannot split module 'norm'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ztrain::nn::Linear"), std::string::npos) << msg;
  policy = llama::policy();
  policy.tensor_parallel[0].style.role = nn::TpRole::kRow;  // tok_embeddings
  msg = boost_with(policy);
  EXPECT_NE(msg.find("splits by vocabulary"), std::string::npos) << msg;
  msg = error_message([] { HybridParallel(HybridParallelOptions{.tp_size = 2}); });
  EXPECT_NE(msg.find("splits no layer"), std::string::npos) << msg;
  EXPECT_TRUE(path_matches("layers.*.attention.wq", "layers.10.attention.wq"));
  EXPECT_FALSE(path_matches("layers.*.wq", "layers.1.attention.wq"));
}

}  // namespace
}  // namespace ztrain::test
