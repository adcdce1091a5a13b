// Every plugin trains two model families unchanged — the Llama-style decoder of
// examples/llama/llama.h (RMSNorm, rotary embeddings, SwiGLU, untied head) and the GPT-2
// architecture in plain modules (models::PlainGpt, tied head) — as one process does on the
// global batch: 20 clipped steps, every loss and every final parameter tensor within 1e-5
// relative (fp32). Models are built from another seed on every rank (boost() makes them equal) and on
// the CPU (boost() moves them to the runtime's device). Files saved under one plugin load
// under the others, and FullyShard refuses models it cannot shard, naming what to change.

#include "../../examples/llama/llama.h"
#include "test_util.h"

#include <filesystem>
#include <functional>
#include <map>

namespace ztrain::test {
namespace {

constexpr int64_t kBatch = 2;  // sequences per rank
constexpr int64_t kSeq = 16;
constexpr int kSteps = 20;

struct Run {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

/// A model family: how to build it, its loss, its optimizer.
struct Family {
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)> loss;
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&)> optimizer;
  int64_t vocab;
};

llama::Config small_llama() { return {.vocab = 64, .dim = 32, .layers = 2, .heads = 4, .hidden = 96, .context = kSeq}; }

Family llama_family() {
  const auto c = small_llama();
  return {.build = [c] { return llama::Llama(c).ptr(); },
          .loss = [](torch::nn::Module& m, const torch::Tensor& t) { return dynamic_cast<llama::LlamaImpl&>(m).loss(t); },
          // AdamW with the peers' groups: no weight decay on norms and embeddings.
          .optimizer =
              [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
                const auto options = optim::AdamOptions(3e-3).weight_decay(0.1);
                return std::make_unique<optim::AdamW>(optim::weight_decay_groups(m, options), options);
              },
          .vocab = c.vocab};
}

Family gpt2_family() {
  models::GptConfig c;
  c.vocab_size = 64;
  c.context = kSeq;
  c.d_model = 32;
  c.n_layer = 2;
  c.n_head = 4;
  return {.build = [c] { return models::PlainGpt(c).ptr(); },
          .loss = [](torch::nn::Module& m, const torch::Tensor& t) { return dynamic_cast<models::PlainGptImpl&>(m).loss(t); },
          // SGD with momentum: the attention key bias has a gradient that is zero up to rounding
          // (softmax ignores a shift of a row), which Adam would scale up to full steps.
          .optimizer =
              [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
                return std::make_unique<torch::optim::SGD>(m.parameters(),
                                                           torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
              },
          .vocab = c.vocab_size};
}

/// Step `step`'s global batch: rows that count up from a random start by a random stride of 1
/// to 3 (mod vocab), which a model learns to continue within a few steps.
torch::Tensor global_batch(int64_t step, int64_t vocab) {
  auto gen = at::detail::createCPUGenerator(2000 + step);
  const int64_t rows = kBatch * runtime().dp().size();
  auto start = torch::randint(vocab, {rows, 1}, gen, torch::kLong);
  auto stride = torch::randint(1, 4, {rows, 1}, gen, torch::kLong);
  return (start + stride * torch::arange(kSeq + 1, torch::kLong)).remainder(vocab);
}

/// A family's model and optimizer built from `seed`, boosted under `plugin` unless it is null.
struct Trainee {
  Trainee(const Family& f, uint64_t seed, std::shared_ptr<Plugin> plugin) : family(f) {
    torch::manual_seed(seed);
    model = family.build();
    opt = family.optimizer(*model);
    if (plugin) {
      booster.emplace(plugin, BoosterOptions{.max_grad_norm = 1.0});
      booster->boost(*model, *opt);
    }
  }
  /// One step on the global batch `tokens` (this rank's share of it when boosted); the global
  /// mean loss.
  double step(torch::Tensor tokens) {
    if (!booster) {
      opt->zero_grad();
      auto loss = family.loss(*model, tokens);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      opt->step();
      return loss.item<double>();
    }
    auto& dp = runtime().dp();
    tokens = tokens.slice(0, dp.rank() * kBatch, (dp.rank() + 1) * kBatch).to(runtime().device());
    booster->zero_grad();
    auto loss = family.loss(*model, tokens);
    booster->backward(loss);
    EXPECT_TRUE(booster->step());
    return dp.all_reduce_scalar(loss.item<double>()) / dp.size();
  }
  /// Every parameter's full value under its name in the plain model (collective: a sharded
  /// model's parameters are gathered).
  std::map<std::string, torch::Tensor> params() {
    std::map<std::string, torch::Tensor> out;
    for (const auto& ref : named_parameter_refs(*model)) out[ref.name] = full_parameter(ref).cpu();
    return out;
  }

  const Family& family;
  std::shared_ptr<torch::nn::Module> model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::optional<Booster> booster;
};

/// `plugin` null: one process on the global batch. Otherwise each rank its share, boosted.
Run train(const Family& family, std::shared_ptr<Plugin> plugin) {
  // Another seed on every rank: boost() makes the replicas equal to dp rank 0's.
  Trainee t(family, plugin ? 7 + runtime().dp().rank() : 7, std::move(plugin));
  Run run;
  for (int step = 0; step < kSteps; ++step) run.losses.push_back(t.step(global_batch(step, family.vocab)));
  run.params = t.params();
  return run;
}

void expect_same(const Run& got, const Run& want) {
  // On a GPU the reference's matrix products run at other shapes than the ranks' (the whole
  // batch in one process), for which cuBLAS picks other algorithms and summation orders.
  const double tol = runtime().device().is_cuda() ? 1e-4 : 1e-5;
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], tol * std::abs(want.losses[i])) << "step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, value] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    // Relative to the tensor's norm: Adam turns the last bits of a near-zero gradient element
    // into differences that element-wise bounds would count against its tiny value.
    const auto diff = (got.params.at(name).to(torch::kFloat64) - value.to(torch::kFloat64)).norm().item<double>();
    EXPECT_LE(diff, tol * value.to(torch::kFloat64).norm().item<double>()) << name;
  }
}

std::vector<std::pair<std::string, std::function<std::shared_ptr<Plugin>()>>> plugins() {
  constexpr int64_t kBucket = 16 << 10;  // several buckets for these models
  return {
      {"DataParallel", [] { return std::make_shared<DataParallel>(DataParallelOptions{.bucket_bytes = kBucket}); }},
      {"LowLevelZero stage 1",
       [] { return std::make_shared<LowLevelZero>(LowLevelZeroOptions{.stage = 1, .bucket_bytes = kBucket}); }},
      {"LowLevelZero stage 2",
       [] { return std::make_shared<LowLevelZero>(LowLevelZeroOptions{.stage = 2, .bucket_bytes = kBucket}); }},
      {"FullyShard", [] { return std::make_shared<FullyShard>(FullyShardOptions{.bucket_bytes = kBucket}); }},
      {"FullyShard with recomputation",
       [] { return std::make_shared<FullyShard>(FullyShardOptions{.use_checkpoint = true, .prefetch_depth = 2}); }},
  };
}

void every_plugin_trains_as_one_process(const Family& family) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto want = train(family, nullptr);
  EXPECT_LT(want.losses.back(), want.losses.front() - 0.1) << "the reference run learns";
  for (const auto& [name, make] : plugins()) {
    SCOPED_TRACE(name);
    expect_same(train(family, make()), want);
  }
}

TEST(PluginParity, LlamaStyleDecoder) { every_plugin_trains_as_one_process(llama_family()); }

TEST(PluginParity, Gpt2) { every_plugin_trains_as_one_process(gpt2_family()); }

TEST(PluginParity, FilesMoveBetweenPlugins) {
  const auto family = llama_family();
  const auto dir = shared_temp_dir("plugin_files");
  if (runtime().rank() == 0) std::filesystem::create_directories(dir);
  runtime().world().barrier();
  auto fully = std::make_shared<FullyShard>();
  Trainee sharded(family, 7, fully);
  for (int step = 0; step < 3; ++step) sharded.step(global_batch(step, family.vocab));
  // Every layer is a level-3 Block, and what the model registers now is this rank's shards:
  // about 1/dp of the parameters.
  ASSERT_EQ(fully->blocks().size(), static_cast<size_t>(small_llama().layers));
  for (auto* block : fully->blocks()) EXPECT_EQ(block->zero_level(), 3);
  int64_t held = 0, total = 0;
  for (const auto& p : sharded.model->parameters()) held += p.numel();
  for (const auto& [name, value] : sharded.params()) total += value.numel();
  const int dp = runtime().dp().size();
  EXPECT_GE(held * dp, total);
  EXPECT_LE(held * dp, total + 16 * 64 * dp) << "64-byte alignment of each parameter and shard at most";
  sharded.booster->save_model(dir + "/model.safetensors");
  sharded.booster->save_optimizer(dir + "/optimizer.safetensors");
  // The files load under the other plugins, into models built from other seeds, and the next
  // step agrees; the model file also loads into the plain model without any plugin.
  for (const auto& [name, make] : plugins()) {
    SCOPED_TRACE(name);
    Trainee other(family, 11, make());
    other.booster->load_model(dir + "/model.safetensors");
    other.booster->load_optimizer(dir + "/optimizer.safetensors");
    auto want = sharded.params();
    for (const auto& [key, value] : other.params()) EXPECT_TRUE(tensors_equal(value, want.at(key))) << key;
    const auto tokens = global_batch(3, family.vocab);
    Trainee again(family, 7, std::make_shared<FullyShard>());
    again.booster->load_model(dir + "/model.safetensors");
    again.booster->load_optimizer(dir + "/optimizer.safetensors");
    EXPECT_NEAR(other.step(tokens), again.step(tokens), 1e-6);
    want = again.params();
    for (const auto& [key, value] : other.params()) EXPECT_TRUE(tensors_equal(value, want.at(key), 1e-5, 1e-7)) << key;
  }
  Trainee plain(family, 13, nullptr);
  load(*plain.model, dir + "/model.safetensors");
  const auto want = sharded.params();
  for (const auto& [key, value] : plain.params()) EXPECT_TRUE(tensors_equal(value, want.at(key))) << key;
  runtime().world().barrier();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

/// A model that registers a parameter on itself, beside its layer list.
struct SelfOwnedImpl : torch::nn::Module {
  SelfOwnedImpl() {
    layers->push_back(torch::nn::Linear(4, 4));
    register_module("layers", layers);
    scale = register_parameter("scale", torch::ones({4}));
  }
  LayerList<torch::nn::Linear> layers;
  torch::Tensor scale;
};
TORCH_MODULE(SelfOwned);

TEST(PluginParity, FullyShardRefusesModelsItCannotShard) {
  {
    torch::nn::Sequential plain(torch::nn::Linear(4, 4));
    torch::optim::SGD opt(plain->parameters(), 0.1);
    Booster booster(std::make_shared<FullyShard>());
    const auto msg = error_message([&] { booster.boost(*plain, opt); });
    EXPECT_NE(msg.find("holds no ztrain::LayerList"), std::string::npos) << msg;
  }
  {
    SelfOwned model;
    torch::optim::SGD opt(model->parameters(), 0.1);
    Booster booster(std::make_shared<FullyShard>());
    const auto msg = error_message([&] { booster.boost(*model, opt); });
    EXPECT_NE(msg.find("registers parameter 'scale' on itself"), std::string::npos) << msg;
  }
  {
    torch::manual_seed(7);
    llama::Llama model(small_llama());
    torch::optim::SGD opt(model->parameters(), 0.1);
    Booster booster(std::make_shared<FullyShard>(FullyShardOptions{.prefetch_depth = -1}));
    const auto msg = error_message([&] { booster.boost(*model, opt); });
    EXPECT_NE(msg.find("prefetch_depth must be >= 0"), std::string::npos) << msg;
  }
}

/// Four layers in a LayerList, called in list order or in its reverse.
struct StackImpl : torch::nn::Module {
  explicit StackImpl(bool reversed) : reversed(reversed) {
    torch::manual_seed(5);
    embed = register_module("embed", torch::nn::Linear(8, 8));
    for (int i = 0; i < 4; ++i) layers->push_back(torch::nn::Linear(8, 8));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    for (size_t k = 0; k < layers->size(); ++k) x = torch::tanh((*layers)[reversed ? layers->size() - 1 - k : k](x));
    return x;
  }
  bool reversed;
  torch::nn::Linear embed{nullptr};
  LayerList<torch::nn::Linear> layers;
};
TORCH_MODULE(Stack);

TEST(PluginParity, FullyShardPrefetchesInTheOrderTheLayersRan) {
  // In its first step FullyShard prefetches in list order; from then on in the order that
  // step called the layers. Counted: the gathers a layer waited for from their start. With
  // the order known only the first layer of forward and of backward waits (each step's first
  // gather has nothing before it to start it). In list order a reversed stack waits at every
  // layer of its forward and at the first of its backward (whose others its forward's misplaced
  // prefetches had gathered): 5. The layers prefetched but not run before the step are
  // gathered again after it, so the losses are the plain model's throughout.
  std::map<bool, std::vector<int64_t>> waits;
  for (bool reversed : {false, true}) {
    SCOPED_TRACE(reversed ? "reversed" : "in order");
    Stack plain(reversed), model(reversed);
    torch::optim::SGD plain_opt(plain->parameters(), 0.1), opt(model->parameters(), 0.1);
    auto fully = std::make_shared<FullyShard>();
    Booster booster(fully);
    booster.boost(*model, opt);
    int64_t before = 0;
    for (int step = 0; step < 3; ++step) {
      const auto x = torch::randn({4, 8}, torch::Generator(at::detail::createCPUGenerator(step)));
      plain_opt.zero_grad();
      const auto want = plain(x).pow(2).mean();
      want.backward();
      plain_opt.step();
      booster.zero_grad();
      const auto loss = model(x.to(runtime().device())).pow(2).mean();
      booster.backward(loss);
      ASSERT_TRUE(booster.step());
      EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-6) << "step " << step;
      int64_t now = 0;
      for (auto* block : fully->blocks()) now += block->gathers_on_demand();
      waits[reversed].push_back(now - before);
      before = now;
    }
    auto expected = fully->blocks();
    if (reversed) std::reverse(expected.begin(), expected.end());
    EXPECT_EQ(fully->execution_order(), expected);
  }
  EXPECT_EQ(waits[false], (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(waits[true], (std::vector<int64_t>{5, 2, 2}));
}

}  // namespace
}  // namespace ztrain::test
