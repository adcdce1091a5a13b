// Block, BlockList and DistributedParameter scenarios beyond plain parity.

#include "test_util.h"
#include "zero_model.h"

namespace ztrain::test {
namespace block_test {

/// Two inputs (one may not require grad), a tuple of two outputs, an int argument passed through.
struct TwoWayImpl : torch::nn::Module {
  explicit TwoWayImpl(int64_t d) : a(d, d), b(d, d) {
    register_module("a", a);
    register_module("b", b);
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor y, int64_t scale) {
    auto h = torch::tanh(a(x) + y * scale);
    return {h, b(h) * y};
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoWay);

/// A reduction of dp-local losses that makes every rank see the same global loss.
torch::Tensor local_rows(const torch::Tensor& t) {
  auto& dp = runtime().dp();
  const auto n = t.size(0) / dp.size();
  return t.slice(0, dp.rank() * n, (dp.rank() + 1) * n);
}

std::map<std::string, torch::Tensor> grads_by_name(torch::nn::Module& plain) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : plain.named_parameters()) out[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();
  return out;
}

/// The full gradient of every wrapped parameter, gathered from the shards' .grad.
std::map<std::string, torch::Tensor> sharded_grads(ShardedModule& m) {
  auto& dp = runtime().dp();
  std::map<std::string, torch::Tensor> out;
  for (const auto& g : m.groups()) {
    if (!g.shard.grad().defined()) continue;
    torch::Tensor full = g.shard.grad();
    if (m.zero_level() > 0) {
      full = torch::empty({g.layout.total_numel()}, g.shard.options());
      dp.all_gather(g.shard.grad(), full);
    }
    for (const auto& e : g.layout.entries()) out[e.name] = full.narrow(0, e.offset, e.numel).view(e.shape);
  }
  return out;
}

class BlockScenario : public ::testing::TestWithParam<int> {};

TEST_P(BlockScenario, SeveralInputsAndOutputsAndInputsWithoutGrad) {
  ASSERT_EQ(world_size(), expected_world_size());
  const int level = GetParam();
  const int64_t rows = 4 * runtime().dp().size(), d = 5;
  torch::manual_seed(3);
  TwoWay plain(d);
  torch::manual_seed(3);
  Block<TwoWay> block(TwoWay(d), {.zero_level = level, .use_checkpoint = level % 2 == 0});
  torch::manual_seed(11);
  auto x_full = torch::randn({rows, d}), y_full = torch::randn({rows, d});

  auto x = x_full.clone().requires_grad_(true);
  auto [h, z] = plain(x, y_full, 2);  // y needs no grad
  (h.sum() + (z * z).sum()).backward();
  const auto want = grads_by_name(*plain);

  auto xl = local_rows(x_full).clone().requires_grad_(true);
  auto yl = local_rows(y_full);
  auto [hl, zl] = block(xl, yl, 2);
  EXPECT_TRUE(tensors_equal(hl, local_rows(h.detach()), 1e-6, 1e-6));
  EXPECT_TRUE(tensors_equal(zl, local_rows(z.detach()), 1e-6, 1e-6));
  // The plain loss is the sum over ranks of the local ones, and ztrain averages parameter
  // gradients over dp: scaling the local loss by dp gives the plain parameter gradients (and
  // dp times the plain input gradient).
  const auto dp = runtime().dp().size();
  ((hl.sum() + (zl * zl).sum()) * dp).backward();
  EXPECT_FALSE(yl.grad().defined());
  EXPECT_TRUE(tensors_equal(xl.grad() / dp, local_rows(x.grad()), 1e-5, 1e-6));
  const auto got = sharded_grads(*block);
  for (const auto& [name, g] : want) EXPECT_TRUE(tensors_equal(got.at(name), g, 1e-5, 1e-6)) << name;
}

TEST_P(BlockScenario, InputsWithoutGradStillTrainTheBlock) {
  const int level = GetParam();
  torch::manual_seed(3);
  Block<Layer> block(Layer(8), {.zero_level = level, .use_checkpoint = level >= 2});
  auto x = torch::randn({2, 4, 8});  // no grad
  block(x).pow(2).sum().backward();
  for (const auto& g : block->groups()) {
    ASSERT_TRUE(g.shard.grad().defined());
    EXPECT_GT(g.shard.grad().abs().sum().item<double>() + (g.shard.numel() == 0), 0.0);
  }
}

TEST_P(BlockScenario, FrozenParametersGetNoGradientAndNoUpdate) {
  const int level = GetParam();
  torch::manual_seed(3);
  Layer layer(8);
  layer->ln1->weight.requires_grad_(false);
  layer->fc->bias.requires_grad_(false);
  Block<Layer> block(layer, {.zero_level = level, .use_checkpoint = false});
  // Trainable weights (weight decay), trainable biases and norm weights (none), frozen.
  ASSERT_EQ(block->groups().size(), 3u);
  const auto before = gathered_parameters(*block);
  torch::optim::Adam opt(block->parameters(), 0.1);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    block(torch::randn({2, 4, 8})).pow(2).mean().backward();
    opt.step();
  }
  for (const auto& g : block->groups()) EXPECT_EQ(g.shard.grad().defined(), g.requires_grad);
  const auto after = gathered_parameters(*block);
  for (size_t i = 0; i < before.size(); ++i) {
    const bool frozen = before[i].first == "ln1.weight" || before[i].first == "fc.bias";
    EXPECT_EQ(before[i].second.equal(after[i].second), frozen) << before[i].first;
  }
  EXPECT_FALSE(layer->ln1->weight.grad().defined());
}

/// One layer the forward uses and one it does not.
struct HalfUsedImpl : torch::nn::Module {
  explicit HalfUsedImpl(int64_t d) : used(d, d), unused(d, d) {
    register_module("used", used);
    register_module("unused", unused);
  }
  torch::Tensor forward(torch::Tensor x) { return used(x); }
  torch::nn::Linear used, unused;
};
TORCH_MODULE(HalfUsed);

TEST_P(BlockScenario, WhatNoGradientReachedIsZero) {
  const int level = GetParam();
  auto& dp = runtime().dp();
  torch::manual_seed(3);
  Block<HalfUsed> block(HalfUsed(6), {.zero_level = level, .use_checkpoint = level == 2});
  for (int step = 0; step < 3; ++step) {  // fresh gradient buffers on reused memory
    for (const auto& g : block->groups()) g.shard.mutable_grad().reset();
    block(torch::randn({3, 6})).pow(2).sum().backward();
    const auto grads = sharded_grads(*block);
    EXPECT_TRUE(torch::equal(grads.at("unused.weight"), torch::zeros({6, 6})));
    EXPECT_TRUE(torch::equal(grads.at("unused.bias"), torch::zeros({6})));
    EXPECT_GT(grads.at("used.weight").abs().sum().item<double>(), 0.0);
    // The alignment gaps and the padding of the flat gradients too.
    for (const auto& g : block->groups()) {
      auto full = g.shard.grad();
      if (level > 0) {
        full = torch::empty({g.layout.total_numel()}, g.shard.options());
        dp.all_gather(g.shard.grad(), full);
      }
      auto rest = full.clone();
      for (const auto& e : g.layout.entries()) rest.narrow(0, e.offset, e.numel).zero_();
      EXPECT_TRUE(rest.eq(0).all().item<bool>()) << "step " << step;
    }
  }
}

TEST_P(BlockScenario, TwoBackwardsWithoutZeroGradGiveTwiceTheGradient) {
  const int level = GetParam();
  torch::manual_seed(3);
  Block<Layer> block(Layer(8), {.zero_level = level, .use_checkpoint = level == 1});
  auto x = torch::randn({2, 4, 8});
  block(x).pow(2).mean().backward();
  std::vector<torch::Tensor> once;
  for (const auto& g : block->groups()) once.push_back(g.shard.grad().clone());
  block(x).pow(2).mean().backward();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_TRUE(tensors_equal(block->groups()[i].shard.grad(), once[i] * 2, 1e-6, 1e-7));
}

TEST_P(BlockScenario, AccumulationWithoutSyncReducesOnceAndGivesTheSameGradient) {
  // Three micro-batches (different on every rank): reduced each time, then held under
  // NoGradientSync and reduced once. Same gradients; a third of the reduction bytes.
  const int level = GetParam();
  auto micro = [](int i) {
    torch::manual_seed(100 + 10 * i + runtime().dp().rank());
    return torch::randn({2, 4, 8});
  };
  auto run = [&](bool hold, int64_t& reduced_bytes) {
    torch::manual_seed(3);
    Block<Layer> block(Layer(8), {.zero_level = level, .use_checkpoint = level == 1});
    auto& reducer = runtime().context().reduce_stream().communicator();
    const auto before = reducer.stats().all_reduce_bytes + reducer.stats().reduce_scatter_bytes;
    for (int i = 0; i < 3; ++i) {
      std::optional<NoGradientSync> guard;
      if (hold && i < 2) guard.emplace(*block);
      block(micro(i)).pow(2).mean().backward();
      if (hold && i < 2) {
        EXPECT_FALSE(block->groups()[0].shard.grad().defined()) << "reduced under NoGradientSync";
      }
    }
    EXPECT_TRUE(block->gradient_sync());
    reduced_bytes = reducer.stats().all_reduce_bytes + reducer.stats().reduce_scatter_bytes - before;
    std::vector<torch::Tensor> grads;
    for (const auto& g : block->groups()) grads.push_back(g.shard.grad().clone());
    return grads;
  };
  int64_t each = 0, once = 0;
  const auto want = run(false, each);
  const auto got = run(true, once);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(tensors_equal(got[i], want[i], 1e-5, 1e-7)) << "group " << i;
  if (runtime().dp().size() > 1) {
    EXPECT_EQ(once * 3, each);
  }
}

TEST_P(BlockScenario, EvalAndNoGradForwardMatchAndReleaseEverything) {
  const int level = GetParam();
  torch::manual_seed(3);
  Layer plain(8, 0.5);
  torch::manual_seed(3);
  BlockList<Layer> layers(std::vector<Block<Layer>>{Block<Layer>(Layer(8, 0.5), {.zero_level = level})});
  layers->eval();
  plain->eval();
  auto x = torch::randn({2, 4, 8});
  torch::NoGradGuard no_grad;
  auto y = layers(x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(tensors_equal(y, plain(x), 1e-6, 1e-6));
  EXPECT_EQ(layers[0]->gathered_bytes(), 0);
}

TEST_P(BlockScenario, RecomputedDropoutEqualsTheKeptGraph) {
  const int level = GetParam();
  std::vector<std::map<std::string, torch::Tensor>> grads;
  std::vector<torch::Tensor> outs;
  for (bool ckpt : {false, true}) {
    torch::manual_seed(3);
    Block<Layer> block(Layer(8, 0.3), {.zero_level = level, .use_checkpoint = ckpt});
    auto x = torch::randn({2, 4, 8}).requires_grad_(true);
    torch::manual_seed(99);
    auto y = block(x);
    y.pow(2).sum().backward();
    outs.push_back(y.detach());
    grads.push_back(sharded_grads(*block));
    grads.back()["x"] = x.grad();
  }
  EXPECT_TRUE(tensors_equal(outs[0], outs[1]));
  for (const auto& [name, g] : grads[0]) EXPECT_TRUE(tensors_equal(grads[1].at(name), g, 1e-6, 1e-7)) << name;
}

TEST_P(BlockScenario, MiddleHiddenStatesCarryTheirLoss) {
  const int level = GetParam();
  ModelConfig c;
  torch::manual_seed(5);
  torch::nn::ModuleList plain;
  for (int i = 0; i < 3; ++i) plain->push_back(Layer(c.dim));
  torch::manual_seed(5);
  BlockList<Layer> layers(3, [&](int64_t) { return Layer(c.dim); }, {.zero_level = level, .use_checkpoint = false});
  auto x = torch::randn({2, 4, c.dim});
  auto h = x;
  torch::Tensor loss = torch::zeros({});
  for (auto& m : *plain) loss = loss + (h = m->as<LayerImpl>()->forward(h)).pow(2).mean();
  loss.backward();
  auto hidden = layers->forward_all(x);
  ASSERT_EQ(hidden.size(), 3u);
  (hidden[0].pow(2).mean() + hidden[1].pow(2).mean() + hidden[2].pow(2).mean()).backward();
  for (int i = 0; i < 3; ++i) {
    const auto want = grads_by_name(*plain[i]);
    const auto got = sharded_grads(*layers[i]);
    for (const auto& [name, g] : want) EXPECT_TRUE(tensors_equal(got.at(name), g, 1e-5, 1e-7)) << i << "." << name;
  }
}

TEST_P(BlockScenario, LevelThreeFreesGatheredStorageBetweenForwardAndBackwardButTheLast) {
  const int level = GetParam();
  torch::manual_seed(3);
  std::vector<int64_t> seen;  // gathered bytes of all blocks, observed inside each block's forward
  BlockList<Layer> layers(4, [&](int64_t) { return Layer(16); }, {.zero_level = level, .use_checkpoint = false, .prefetch_depth = 1});
  int64_t block_bytes = 0;  // held while gathered; nothing where the full buffers map the shards
  for (const auto& g : layers[0]->groups()) block_bytes += g.mapped ? 0 : g.layout.total_numel() * 4;
  auto x = torch::randn({2, 4, 16}).requires_grad_(true);
  auto h = x;
  for (auto& b : *layers) {
    h = b(h);
    int64_t total = 0;
    for (auto& other : *layers) total += other->gathered_bytes();
    seen.push_back(total);
  }
  int64_t live = 0;
  for (auto& b : *layers) live += b->gathered_bytes();
  if (level == 3) {
    // The last block keeps its parameters for its backward, the first to run.
    EXPECT_EQ(live, block_bytes);
    EXPECT_EQ(layers[3]->gathered_bytes(), block_bytes);
    // After block i's forward, only block i+1 (prefetched) may be gathered, and then the last.
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_LE(seen[i], block_bytes) << "after block " << i;
  } else if (level == 2) {
    EXPECT_EQ(live, 4 * block_bytes);
  }
  int64_t waited = 0;
  for (auto& b : *layers) waited -= b->gathers_on_demand();
  h.sum().backward();
  for (auto& b : *layers) waited += b->gathers_on_demand();
  EXPECT_EQ(waited, 0) << "a gather in backward that no prefetch had started";
  live = 0;
  for (auto& b : *layers) live += b->gathered_bytes();
  EXPECT_EQ(live, 0);
  EXPECT_TRUE(x.grad().defined());
}

/// Weights whose gradients tp::linear writes into the flat buffer: `a` used twice (the second
/// write adds), `a` also through a plain operator (autograd's share added to the written one), `b`
/// in the [in, out] layout without a bias; and `c`, whose gradient a custom operator writes
/// (Scaled), recording whether it had a place to write it.
struct Scaled : torch::autograd::Function<Scaled> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& c) {
    ctx->save_for_backward({x, c});
    return x * c;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dc = (grads[0] * saved[0]).flatten(0, -2).sum(0);
    wrote.push_back(write_gradient(saved[1], [&](torch::Tensor& place, bool accumulate) {
      accumulate ? place.add_(dc) : place.copy_(dc);
    }));
    return {grads[0] * saved[1], wrote.back() ? torch::Tensor() : dc};
  }
  static inline std::vector<bool> wrote;
};

struct WrittenImpl : torch::nn::Module {
  explicit WrittenImpl(int64_t d) {
    a = register_parameter("a", torch::randn({d, d}));
    bias = register_parameter("bias", torch::randn({d}));
    b = register_parameter("b", torch::randn({d, d}));
    c = register_parameter("c", torch::randn({d}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(tp::linear(x, a, bias));
    h = tp::linear(h, a, bias) + a.pow(2).sum();
    return Scaled::apply(tp::linear(h, b, torch::Tensor(), tp::WeightLayout::kInOut), c);
  }
  torch::Tensor a, bias, b, c;
};
TORCH_MODULE(Written);

TEST_P(BlockScenario, OperatorsWriteGradientsIntoTheFlatBuffer) {
  const int level = GetParam();
  const int64_t d = 6;
  torch::manual_seed(5);
  Written plain(d);
  torch::manual_seed(5);
  Block<Written> block(Written(d), {.zero_level = level, .use_checkpoint = level % 2 == 1});
  const auto x = torch::randn({3, 4, d});
  for (int pass = 0; pass < 2; ++pass) {  // the second adds to the first's gradients
    Scaled::wrote.clear();
    plain(x).pow(2).sum().backward();
    EXPECT_EQ(Scaled::wrote, std::vector<bool>{false});  // outside a sharded module: returned
    Scaled::wrote.clear();
    block(x).pow(2).sum().backward();
    EXPECT_EQ(Scaled::wrote, std::vector<bool>{true});
    const auto grads = sharded_grads(*block);
    for (const auto& [name, grad] : grads_by_name(*plain)) {
      EXPECT_TRUE(tensors_equal(grads.at(name), grad, 1e-5, 1e-6)) << name << ", pass " << pass;
    }
  }
}

TEST_P(BlockScenario, ShardedParametersOnOneHostMapTheRanksShards) {
  const int level = GetParam();
  auto& dp = runtime().dp();
  torch::manual_seed(3);
  Layer plain(192);  // weights of 1.8 MB: shards of 256 KiB and more up to 4 ranks; biases far less
  torch::manual_seed(3);
  Block<Layer> block(Layer(192), {.zero_level = level, .use_checkpoint = false});
  const bool maps = level >= 2 && dp.size() > 1 && dp.host_local() && runtime().context().host_shared_buffers();
  ASSERT_EQ(block->maps_shards(), maps);
  block->gather();
  const auto plain_params = plain->named_parameters();
  for (const auto& p : block->wrapped()->named_parameters()) {
    EXPECT_TRUE(tensors_equal(p.value(), plain_params[p.key()])) << p.key();
  }
  if (level < 2) return;
  // Every rank adds rank + 1 to its shards: after a gather, the full buffers show each rank's
  // addition over its range, mapped or copied alike. (A mapped buffer shows a peer's write at
  // once: the barriers keep the ranks from writing while others still read.)
  std::vector<torch::Tensor> before;
  for (const auto& g : block->groups()) {
    if (g.mapped) {
      EXPECT_EQ(g.layout.shard_numel() * 4 % host_shared_page_bytes(), 0);
    }
    before.push_back(g.full.clone());
  }
  dp.barrier();
  for (const auto& g : block->groups()) {
    torch::NoGradGuard no_grad;
    g.shard.add_(dp.rank() + 1);
  }
  block->shards_changed();
  block->gather();
  int64_t copied_bytes = 0;
  for (size_t i = 0; i < block->groups().size(); ++i) {
    const auto& g = block->groups()[i];
    copied_bytes += g.mapped ? 0 : g.full.nbytes();
    for (int m = 0; m < dp.size(); ++m) {
      const auto [begin, end] = g.layout.shard_range(m);
      const auto want = before[i].narrow(0, begin, end - begin) + (m + 1);
      EXPECT_TRUE(tensors_equal(g.full.narrow(0, begin, end - begin), want, 0, 1e-6))
          << "group " << i << ", rank " << m << "'s shard";
    }
  }
  EXPECT_EQ(block->gathered_bytes(), copied_bytes);  // the mapped groups hold nothing of their own
  block->release();
  for (const auto& g : block->groups()) EXPECT_EQ(g.full.storage().data() != nullptr, g.mapped);
  dp.barrier();
}

INSTANTIATE_TEST_SUITE_P(Levels, BlockScenario, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return c10::str("level", info.param); });

TEST(BlockErrors, SameInstanceTwiceIsRejected) {
  Block<Layer> block(Layer(4), {.zero_level = 2});
  EXPECT_NE(error_message([&] { BlockList<Layer>(std::vector<Block<Layer>>{block, block}); }).find("same instance"),
            std::string::npos);
  Layer layer(4);
  Block<Layer> first(layer);
  EXPECT_NE(error_message([&] { Block<Layer> again(layer); }).find("already belongs"), std::string::npos);
}

TEST(BlockErrors, BadOptionsAreRejected) {
  EXPECT_NE(error_message([] { Block<Layer>(Layer(4), {.zero_level = 4}); }).find("zero_level must be 0..3"),
            std::string::npos);
  EXPECT_NE(error_message([] { Block<Layer>(Layer(4), {.prefetch_depth = -1}); }).find("prefetch_depth"),
            std::string::npos);
}

TEST(BlockErrors, RanksWrappingDifferentShapesFailClearly) {
  if (world_size() == 1) {
    EXPECT_NO_THROW(Block<Layer>(Layer(6)));  // nobody to disagree with
    return;
  }
  const int64_t d = runtime().dp().rank() == 1 ? 6 : 4;
  EXPECT_NE(error_message([&] { Block<Layer>(Layer(d)); }).find("wrap different parameters"), std::string::npos);
}

// Small, and large enough (1 MiB) that level 3 maps the ranks' shards on one host: there the
// output is the mapped buffer itself, elsewhere at level 3 a copy that outlives the release.
TEST(DistributedParameterTest, TiedUseIsGatheredOnceAndGetsBothGradients) {
  for (const int64_t rows : {7, 512}) {
    const int64_t cols = rows == 7 ? 3 : 512;
    for (int level : {0, 1, 2, 3}) {
      const auto where = c10::str("level ", level, ", ", rows, " x ", cols);
      torch::manual_seed(1);
      auto value = torch::randn({rows, cols});
      DistributedParameter w(value, {.zero_level = level});
      auto ids = torch::tensor({0, 3, 6, 3});
      auto a = w(), b = w();
      EXPECT_TRUE(a.is_same(b)) << where;
      const auto& group = w->groups().front();
      if (level == 3) {
        EXPECT_EQ(a.storage().unsafeGetStorageImpl() == group.full.storage().unsafeGetStorageImpl(), group.mapped)
            << where;
      }
      EXPECT_EQ(group.mapped, level >= 2 && rows == 512 && w->maps_shards()) << where;
      auto loss = (torch::embedding(a, ids) * 2).sum() + torch::matmul(torch::ones({1, cols}), b.t()).sum();
      loss.backward();
      auto ref = value.clone().requires_grad_(true);
      ((torch::embedding(ref, ids) * 2).sum() + torch::matmul(torch::ones({1, cols}), ref.t()).sum()).backward();
      const auto grads = sharded_grads(*w);
      EXPECT_TRUE(tensors_equal(grads.at("weight"), ref.grad(), 1e-6, 1e-7)) << where;
      EXPECT_EQ(gathered_parameters(*w)[0].first, "weight");
      // A step on the shards shows in the next forward, mapped or gathered.
      {
        torch::NoGradGuard no_grad;
        for (auto& p : w->parameters()) p.add_(1);
      }
      EXPECT_TRUE(tensors_equal(w().detach(), value + 1, 0, 1e-6)) << where;
    }
  }
}

// x.sum(), whose backward hands `place` over as x's gradient: an operator that computed it there.
struct GradientIn : torch::autograd::Function<GradientIn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& place) {
    ctx->saved_data["place"] = place;
    return x.sum();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    return {ctx->saved_data["place"].toTensor(), {}};
  }
};

// An operator may compute the whole gradient into gradient_place(), handed out once per
// backward: the reduced gradient is the same as from a gradient made anywhere, with a second use
// adding its share, and a place left unused by a backward is taken over by the next.
TEST(DistributedParameterTest, GradientMadeInItsPlaceIsReducedFromThere) {
  for (int level : {0, 3}) {
    torch::manual_seed(2);
    auto value = torch::randn({7, 3});
    const auto rows = torch::randn({7, 3}), other = torch::randn({7, 3});
    DistributedParameter w(value, {.zero_level = level});
    auto ref = value.clone().requires_grad_(true);
    for (int pass = 0; pass < 3; ++pass) {
      w->zero_grad();
      ref.mutable_grad().reset();
      auto place = w->gradient_place();
      ASSERT_TRUE(place.defined()) << "level " << level << " pass " << pass;
      EXPECT_EQ(place.sizes(), value.sizes());
      EXPECT_FALSE(w->gradient_place().defined()) << "handed out twice, level " << level;
      place.copy_(rows * (pass + 1));
      auto x = w();
      // The first use's gradient is the place itself; in pass 1, a second use adds its own.
      auto loss = GradientIn::apply(x, place);
      if (pass == 1) loss = loss + (x * other).sum();
      loss.backward();
      auto want = rows * (pass + 1) + (pass == 1 ? other : torch::zeros_like(other));
      EXPECT_TRUE(tensors_equal(sharded_grads(*w).at("weight"), want, 1e-6, 1e-7))
          << "level " << level << " pass " << pass;
    }
    // Handed out and not used by the backward: it computes as usual and, no other being
    // pending, lets the buffer go.
    w->zero_grad();
    ASSERT_TRUE(w->gradient_place().fill_(std::nanf("")).defined());
    (w() * other).sum().backward();
    EXPECT_TRUE(tensors_equal(sharded_grads(*w).at("weight"), other, 1e-6, 1e-7)) << "level " << level;
    EXPECT_TRUE(w->gradient_place().defined()) << "level " << level;
  }
}

// With forwards of their own (new_forward, as a pipeline's micro-batches), each use has a backward
// of its own. The place goes to the backward its gradient arrives at, whichever backward runs
// first: another leaves it alone.
TEST(DistributedParameterTest, GradientPlaceGoesToTheBackwardItArrivesAt) {
  for (int level : {0, 3}) {
    torch::manual_seed(3);
    const auto value = torch::randn({7, 3}), rows = torch::randn({7, 3}), other = torch::randn({7, 3});
    DistributedParameter w(value, {.zero_level = level});
    auto a = w();
    w->new_forward();
    auto b = w();
    ASSERT_FALSE(a.is_same(b));
    auto place = w->gradient_place();
    place.copy_(rows);
    (a * other).sum().backward();  // the first forward's backward: its gradient is not in the place
    GradientIn::apply(b, place).backward();
    EXPECT_TRUE(tensors_equal(sharded_grads(*w).at("weight"), rows + other, 1e-6, 1e-7)) << "level " << level;
  }
}

// A DistributedParameter keeps its last output, whose graph refers back to it: a forward under
// grad mode with no backward must not keep the module alive, and a backward after it is gone
// says so.
TEST(DistributedParameterTest, AnOutputWithoutBackwardDoesNotKeepItAlive) {
  for (int level : {0, 3}) {
    std::weak_ptr<DistributedParameterImpl> gone;
    torch::Tensor out;
    {
      DistributedParameter w(torch::randn({5, 2}), {.zero_level = level});
      gone = w.ptr();
      out = w();
      ASSERT_TRUE(out.requires_grad());
    }
    EXPECT_TRUE(gone.expired()) << "level " << level;
    const auto msg = error_message([&] { out.sum().backward(); });
    EXPECT_NE(msg.find("backward after the module was destroyed"), std::string::npos) << msg;
  }
}

}  // namespace block_test
}  // namespace ztrain::test
