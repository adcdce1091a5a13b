// HybridParallel: the Llama-style decoder, split over tensor-parallel ranks by its policy and
// sharded over the rest at every ZeRO level, trains as one process does on the global batch
// (20 clipped steps, losses and final parameters within 1e-4 relative in fp32, and within
// 1e-12 in fp64 with AdamW, which shows the split exact); its files load
// under the data-parallel plugins and into the plain model; the ztrain::nn layers are torch's
// when not split; a policy that does not fit the model says where.

#include "parity.h"

#include <filesystem>
#include <set>

namespace ztrain::test {
namespace hybrid_parallel_test {

std::shared_ptr<Plugin> hybrid(int tp, int zero_level, bool use_checkpoint = false, int pp = 1,
                               pipe::ScheduleKind schedule = pipe::ScheduleKind::k1F1B,
                               std::vector<int64_t> bounds = {}) {
  return std::make_shared<HybridParallel>(HybridParallelOptions{.tp_size = tp,
                                                                .pp_size = pp,
                                                                .schedule = schedule,
                                                                .chunks = schedule == pipe::ScheduleKind::kInterleaved1F1B ? 2 : 1,
                                                                .bounds = std::move(bounds),
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

TEST(HybridParallel, PipelineStagesTrainAsOneProcess) {
  // pp 2 (× dp 2 at four ranks) and tp 2 × pp 2 at four, every ZeRO level, 1F1B; GPipe and an
  // uneven split (one stage with both layers, the other with the head alone) once each.
  const auto family = llama_sgd();
  const auto want = train(family, nullptr);
  for (int tp : world_size() == 4 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
    for (int level = 0; level <= 3; ++level) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " pp 2, zero " + std::to_string(level));
      expect_same(train(family, hybrid(tp, level, false, 2)), want);
    }
  }
  {
    SCOPED_TRACE("pp 2, GPipe, zero 2");
    expect_same(train(family, hybrid(1, 2, false, 2, pipe::ScheduleKind::kGPipe)), want);
  }
  for (int level : {1, 3}) {
    SCOPED_TRACE("pp 2, interleaved over 2 chunks per rank, zero " + std::to_string(level));
    expect_same(train(family, hybrid(1, level, false, 2, pipe::ScheduleKind::kInterleaved1F1B)), want);
  }
  SCOPED_TRACE("pp 2, layers split {0, 2, 2}, zero 3 with recomputation");
  expect_same(train(family, hybrid(1, 3, true, 2, pipe::ScheduleKind::k1F1B, {0, 2, 2})), want);
}

TEST(HybridParallel, Gpt2StagesTieTheHeadToTheEmbedding) {
  // GPT-2's head reuses the token embedding: at pp 2 (× dp 2 at four ranks) the first and the
  // last stage keep a copy each, their gradients summed, and every ZeRO level trains as one
  // process — with the gradient norm that the clipping uses counting the tied weight once; and
  // with the interleaved schedule, where the copies sit in the first and the last model chunk.
  const auto family = gpt2_family();
  const auto want = train(family, nullptr);
  auto gpt2 = [](int level, pipe::ScheduleKind schedule) {
    return std::make_shared<HybridParallel>(HybridParallelOptions{
        .pp_size = 2, .schedule = schedule, .chunks = schedule == pipe::ScheduleKind::kInterleaved1F1B ? 2 : 1,
        .zero_level = level, .policy = models::plain_gpt_policy(), .bucket_bytes = 16 << 10});
  };
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE("GPT-2 pp 2, zero " + std::to_string(level));
    expect_same(train(family, gpt2(level, pipe::ScheduleKind::k1F1B)), want);
  }
  SCOPED_TRACE("GPT-2 pp 2, interleaved over 2 chunks per rank, zero 2");
  expect_same(train(family, gpt2(2, pipe::ScheduleKind::kInterleaved1F1B)), want);
}

TEST(HybridParallel, Gpt2SplitsOverTpThroughItsPolicy) {
  // PlainGpt built whole (the default context has tp size 1): the GPT-2 policy splits its
  // blocks' tp:: linears — the fused q, k, v by column, whole heads per rank — sets the heads
  // per rank, and splits the token embedding and with it the tied head by vocabulary (63
  // tokens: padded to 64); at tp 2 (× dp 2 at four ranks, or × pp 2, where the first and the
  // last stage hold a split copy of the tied embedding each) it trains as one process.
  auto family = gpt2_family();
  family.vocab = 63;
  family.build = [] {
    models::GptConfig c;
    c.vocab_size = 63, c.context = kSeq, c.d_model = 32, c.n_layer = 2, c.n_head = 4;
    return models::PlainGpt(c).ptr();
  };
  const auto want = train(family, nullptr);
  auto gpt2 = [](int tp, int level, int pp = 1) {
    return std::make_shared<HybridParallel>(HybridParallelOptions{
        .tp_size = tp, .pp_size = pp, .zero_level = level, .policy = models::plain_gpt_policy(), .bucket_bytes = 16 << 10});
  };
  for (int level : {0, 3}) {
    SCOPED_TRACE("GPT-2 tp 2, zero " + std::to_string(level));
    expect_same(train(family, gpt2(2, level)), want);
  }
  if (world_size() == 4) {
    SCOPED_TRACE("GPT-2 tp 2 x pp 2, zero 1");
    expect_same(train(family, gpt2(2, 1, 2)), want);
  }
  {  // the blocks and the token embedding hold their slices, the position embedding is whole;
     // whatever each rank built, the slices are those of world rank 0's model
    Trainee split(family, 7 + runtime().rank(), gpt2(2, 0));
    torch::manual_seed(7);
    const auto whole = family.build();
    for (const auto& ref : named_parameter_refs(*split.model)) {
      EXPECT_TRUE(full_parameter(ref).cpu().equal(whole->named_parameters()[ref.name])) << ref.name;
    }
    auto& gpt = dynamic_cast<models::PlainGptImpl&>(*split.model);
    auto& block = (*gpt.transformer->h)[0].module();
    EXPECT_EQ(block->attn->c_attn->weight.sizes(), (std::vector<int64_t>{32, 48}));  // [in, 3 x out / 2]
    EXPECT_EQ(block->attn->c_proj->weight.sizes(), (std::vector<int64_t>{16, 32}));
    EXPECT_EQ(block->attn->n_head, 2);
    EXPECT_EQ(gpt.transformer->wte->weight.sizes(), (std::vector<int64_t>{32, 32}));  // 63 rows + 1 of padding
    EXPECT_EQ(gpt.transformer->wpe->weight.sizes(), (std::vector<int64_t>{kSeq, 32}));
    EXPECT_EQ(gpt.forward(torch::zeros({1, 4}, torch::kLong)).sizes(), (std::vector<int64_t>{1, 4, 63}));
  }
  // A head count the tp size does not divide is refused by name.
  auto odd = gpt2_family();
  odd.build = [] {
    models::GptConfig c;
    c.vocab_size = 64, c.context = kSeq, c.d_model = 48, c.n_layer = 2, c.n_head = 3;
    return models::PlainGpt(c).ptr();
  };
  const auto msg = error_message([&] { Trainee t(odd, 7, gpt2(2, 0)); });
  EXPECT_NE(msg.find("3 attention heads do not split over 2"), std::string::npos) << msg;
}

TEST(HybridParallel, AStageMadeInBuildMakesOnlyItsLayers) {
  // A LayerList made with a size and a factory under a scope makes the layers it holds, no
  // others, and cannot hold what it never made.
  {
    std::vector<size_t> made;
    LayerListScope scope([](size_t size) { return LayerListScope::Ranges{{1, 3}, {4, size}}; });
    LayerList<torch::nn::Linear> list(6, [&](size_t i) {
      made.push_back(i);
      return torch::nn::Linear(2, 2);
    });
    EXPECT_EQ(made, (std::vector<size_t>{1, 2, 4, 5}));
    EXPECT_TRUE(list->partial());
    EXPECT_EQ(list->size(), 6u);
    EXPECT_EQ(list->parameters().size(), 8u);
    const auto msg = error_message([&] { list->hold({{0, 2}}); });
    EXPECT_NE(msg.find("layer 0 cannot be held"), std::string::npos) << msg;
    list->hold({{1, 2}});  // what it made it can hold
    EXPECT_EQ(list->parameters().size(), 2u);
  }
  LayerList<torch::nn::Linear> whole(3, [](size_t) { return torch::nn::Linear(2, 2); });  // no scope: every layer
  EXPECT_FALSE(whole->partial());
  EXPECT_EQ(whole->parameters().size(), 6u);

  // GPT-2 at pp 2 (× dp 2 at four ranks), made in build() with its values given by name: before
  // boost() each stage has its own blocks' parameters and no others, and every level trains as
  // one process made whole.
  auto by_stage = [](Family family) {
    family.build = [build = family.build] {
      auto model = build();
      init_parameters(*model, {.seed = 3});
      return model;
    };
    family.by_stage = true;
    return family;
  };
  const auto family = by_stage(gpt2_family());
  const auto want = train(family, nullptr);
  auto gpt2 = [](int level, int chunks = 1) {
    return std::make_shared<HybridParallel>(HybridParallelOptions{
        .pp_size = 2, .schedule = chunks > 1 ? pipe::ScheduleKind::kInterleaved1F1B : pipe::ScheduleKind::k1F1B,
        .chunks = chunks, .zero_level = level, .policy = models::plain_gpt_policy(), .bucket_bytes = 16 << 10});
  };
  {
    auto plugin = gpt2(0);
    const auto model = plugin->build(family.build);
    const int stage = plugin->context().pp_rank();
    std::set<std::string> blocks;
    for (const auto& p : model->named_parameters()) {
      if (p.key().starts_with("transformer.h.")) blocks.insert(p.key().substr(0, p.key().find('.', 14)));
    }
    EXPECT_EQ(blocks, std::set<std::string>{stage == 0 ? "transformer.h.0" : "transformer.h.1"});
  }
  for (int level : {0, 3}) {
    SCOPED_TRACE("GPT-2 made for its stage, pp 2, zero " + std::to_string(level));
    expect_same(train(family, gpt2(level)), want);
  }
  SCOPED_TRACE("GPT-2 of 4 blocks made for its stage, pp 2 interleaved over 2 chunks, zero 2");
  const auto deep = by_stage(gpt2_family(4));
  expect_same(train(deep, gpt2(2, 2)), train(deep, nullptr));
}

TEST(HybridParallel, AStageHoldsItsLayersAndEndsAndReducesOncePerStep) {
  const auto family = llama_sgd();
  auto plugin = std::dynamic_pointer_cast<HybridParallel>(hybrid(1, 0, false, 2));
  Trainee staged(family, 7, plugin);
  const int stage = plugin->context().pp_rank();
  EXPECT_EQ(plugin->held_layers(), (std::vector<std::pair<int64_t, int64_t>>{stage == 0 ? std::make_pair(int64_t{0}, int64_t{1})
                                                                                     : std::make_pair(int64_t{1}, int64_t{2})}));
  std::set<std::string> names;
  for (const auto& p : staged.model->named_parameters()) names.insert(p.key());
  EXPECT_EQ(names.count("tok_embeddings.weight"), stage == 0 ? 1u : 0u);
  EXPECT_EQ(names.count("output.weight"), stage == 1 ? 1u : 0u);
  EXPECT_EQ(names.count("norm.weight"), stage == 1 ? 1u : 0u);
  EXPECT_EQ(names.count("layers.0.attention.wq.weight"), stage == 0 ? 1u : 0u);
  EXPECT_EQ(names.count("layers.1.attention.wq.weight"), stage == 1 ? 1u : 0u);
  size_t updated = 0;
  for (const auto& group : staged.opt->param_groups()) updated += group.params().size();
  EXPECT_EQ(updated, names.size()) << "the optimizer updates what the stage holds";
  // Four micro-batches, one reduction of each bucket (where dp has several ranks): in the
  // stage's last backward.
  staged.step(global_batch(0, family.vocab));
  const auto stats = dynamic_cast<DataParallel&>(plugin->data_parallel()).stats();
  EXPECT_GT(stats.buckets, 0);
  EXPECT_EQ(stats.reductions_during_backward + stats.reductions_at_end,
            plugin->context().dp().size() > 1 ? stats.buckets : 0);
  // A plugin without stages refuses a pipeline step.
  torch::nn::Linear plain(2, 2);
  torch::optim::SGD opt(plain->parameters(), 0.1);
  Booster booster(std::make_shared<DataParallel>());
  booster.boost(*plain, opt);
  const auto msg = error_message([&] { booster.execute_pipeline({{torch::ones({1, 2})}}); });
  EXPECT_NE(msg.find("DataParallel runs no pipeline stages"), std::string::npos) << msg;
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
  EXPECT_EQ(layer->attention->wk->weight.sizes(), (std::vector<int64_t>{c.dim / c.heads * c.kv_heads / 2, c.dim}));
  EXPECT_EQ(layer->attention->heads, c.heads / 2) << "the policy's adapt divides the heads";
  EXPECT_EQ(layer->attention->kv_heads, c.kv_heads / 2);
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

TEST(HybridParallel, AStagedCheckpointLoadsUnderDataParallelAloneAndFullyShard) {
  // Saved at tp 2 × pp 2 (pp 2 at two ranks) under ZeRO-1; loaded by the last rank alone under
  // DataParallel and by the others together under FullyShard (3 ranks at four), each on a
  // context of its own: the parameters are identical, and the optimizer state each loads is what
  // the stages saved (written again from there, the same tensors under the same names).
  const auto family = llama_family();
  const auto dir = shared_temp_dir("hybrid_staged");
  if (runtime().rank() == 0) std::filesystem::create_directories(dir);
  runtime().world().barrier();
  Trainee staged(family, 7, hybrid(world_size() == 4 ? 2 : 1, 1, false, 2));
  for (int step = 0; step < 3; ++step) staged.step(global_batch(step, family.vocab));
  const auto saved = staged.params();
  staged.booster->save_model(dir + "/model.safetensors");
  staged.booster->save_optimizer(dir + "/optimizer.safetensors");

  const bool alone = runtime().rank() == world_size() - 1;
  auto own = default_context().split(alone ? 1 : 0, {.name = alone ? "alone" : "others"});
  std::shared_ptr<Plugin> plugin;
  if (alone) {
    plugin = std::make_shared<DataParallel>(DataParallelOptions{.context = own});
  } else {
    plugin = std::make_shared<FullyShard>(FullyShardOptions{.context = own});
  }
  Trainee other(family, 11, plugin);
  other.booster->load_model(dir + "/model.safetensors");
  EXPECT_EQ(other.params().size(), saved.size());
  for (const auto& [key, value] : other.params()) EXPECT_TRUE(tensors_equal(value, saved.at(key))) << key;
  other.booster->load_optimizer(dir + "/optimizer.safetensors");
  const auto again = dir + (alone ? "/alone.safetensors" : "/others.safetensors");
  other.booster->save_optimizer(again);
  runtime().world().barrier();
  if (runtime().rank() == 0) {
    const auto original = ckpt::load_safetensors(dir + "/optimizer.safetensors");
    ASSERT_FALSE(original.empty());
    for (const auto* name : {"/alone.safetensors", "/others.safetensors"}) {
      std::map<std::string, torch::Tensor> written;
      for (const auto& [key, value] : ckpt::load_safetensors(dir + name)) written.emplace(key, value);
      EXPECT_EQ(written.size(), original.size()) << name;
      for (const auto& [key, value] : original) {
        EXPECT_TRUE(written.count(key) && torch::equal(written.at(key), value)) << name << " " << key;
      }
    }
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
  policy.tensor_parallel.clear();
  msg = boost_with(policy);
  EXPECT_NE(msg.find("nor the model's own layers split a parameter"), std::string::npos) << msg;
  EXPECT_TRUE(path_matches("layers.*.attention.wq", "layers.10.attention.wq"));
  EXPECT_FALSE(path_matches("layers.*.wq", "layers.1.attention.wq"));
}

}  // namespace hybrid_parallel_test
}  // namespace ztrain::test
