// Every plugin trains two model families unchanged — the Llama-style decoder of
// examples/llama/llama.h (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied
// head) and the GPT-2 architecture in plain modules (models::PlainGpt, tied head) — as one
// process does on the global batch: 20 clipped steps, every loss and every final parameter
// tensor within 1e-4 relative (fp32; parity.h says why not less). Models are built from another seed on every rank (boost()
// makes them equal) and on the CPU (boost() moves them to the runtime's device). Files saved
// under one plugin load under the others, and FullyShard refuses models it cannot shard, naming
// what to change.

#include "parity.h"

#include <filesystem>
#include <functional>
#include <map>

namespace ztrain::test {
namespace plugin_parity_test {
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
      {"FullyShard with the layers' shards on disk",
       [] {
         const auto dir = std::filesystem::temp_directory_path() / "ztrain_plugin_parity_offload";
         return std::make_shared<FullyShard>(FullyShardOptions{.offload_dir = dir.string()});
       }},
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
  // the order known only the first layer of forward waits (each step's first gather has nothing
  // before it to start it); the last one keeps its parameters for its backward, the first. In
  // list order a reversed stack waits at every layer of its forward and at the first of its
  // backward (whose others its forward's misplaced prefetches had gathered): 5. The layers
  // prefetched but not run before the step are gathered again after it, so the losses are the
  // plain model's throughout.
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
  EXPECT_EQ(waits[false], (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(waits[true], (std::vector<int64_t>{5, 1, 1}));
}

}  // namespace plugin_parity_test
}  // namespace ztrain::test
