// Booster with the DataParallel and LowLevelZero plugins: a plain libtorch model trains as the
// single-process one on the global batch (losses and parameters), reductions overlap backward,
// no_sync accumulates with one reduction per step, unused parameters count as zero, optimizer
// state (and at stage 2 gradients) are sharded, checkpoints round-trip across plugins, and bad
// input is refused with a clear error. Models are built on the CPU and boosted onto the
// runtime's device (a CUDA device in the .cuda variants); the single-process reference stays on
// the CPU.

#include "../zero/zero_model.h"
#include "test_util.h"

#include <filesystem>
#include <functional>

namespace ztrain::test {
namespace booster_test {

constexpr int64_t kBatch = 2;  // sequences per rank and micro-batch
constexpr int64_t kSeq = 8;

struct Trajectory {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

// SGD with momentum, not Adam: some of the model's gradients are zero up to rounding (the key
// bias: softmax ignores a shift of a row), and Adam would scale that rounding up to full steps.
// Two parameter groups, as peers make them: weight decay on matrices only, and the vectors
// at another learning rate.
torch::optim::SGD make_sgd(torch::nn::Module& model) {
  std::vector<torch::Tensor> matrices, vectors;
  for (const auto& p : model.parameters()) (p.dim() >= 2 ? matrices : vectors).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(matrices);
  groups.emplace_back(vectors, std::make_unique<torch::optim::SGDOptions>(
                                   torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0)));
  return torch::optim::SGD(groups, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
}

using MakePlugin = std::function<std::shared_ptr<Plugin>()>;
MakePlugin data_parallel(DataParallelOptions options = {}) {
  return [options] { return std::make_shared<DataParallel>(options); };
}
MakePlugin low_level_zero(LowLevelZeroOptions options) {
  return [options] { return std::make_shared<LowLevelZero>(options); };
}

std::vector<torch::Tensor> values(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

/// One process, the global batch of every step, `micro` micro-batches accumulated per step.
Trajectory reference(const ModelConfig& c, int steps, int micro, double max_norm) {
  const int dp = runtime().dp().size();
  torch::manual_seed(3);
  RefModel model(c);
  auto opt = make_sgd(*model);
  Trajectory t;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto tokens = batch_tokens(step, micro * dp * kBatch, kSeq, c.vocab);
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      // Micro-batch m of every rank: rank r's sequences come first on rank r, as below.
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < dp; ++r) parts.push_back(tokens.slice(0, (r * micro + m) * kBatch, (r * micro + m + 1) * kBatch));
      auto batch = torch::cat(parts);
      auto loss = lm_loss(model(batch), batch) / micro;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    if (max_norm > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
    opt.step();
    t.losses.push_back(loss_sum);
  }
  t.params = values(*model);
  return t;
}

/// The same run under a plugin: each rank its share of the global batch.
Trajectory boosted(const ModelConfig& c, int steps, int micro, double max_norm, const MakePlugin& make) {
  auto& dp = runtime().dp();
  torch::manual_seed(3 + dp.rank());  // different on every rank: boost() makes them equal
  RefModel model(c);
  auto opt = make_sgd(*model);
  Booster booster(make(), {.max_grad_norm = max_norm});
  booster.boost(*model, opt);
  Trajectory t;
  for (int step = 0; step < steps; ++step) {
    booster.zero_grad();
    auto tokens = batch_tokens(step, micro * dp.size() * kBatch, kSeq, c.vocab);
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      const int64_t first = (dp.rank() * micro + m) * kBatch;
      auto local = tokens.slice(0, first, first + kBatch).to(runtime().device());
      auto loss = lm_loss(model(local), local) / micro;
      if (m + 1 < micro) {
        auto guard = booster.no_sync();
        booster.backward(loss);
      } else {
        booster.backward(loss);
      }
      loss_sum += loss.item<double>();
    }
    EXPECT_TRUE(booster.step());
    t.losses.push_back(dp.all_reduce_scalar(loss_sum) / dp.size());
  }
  t.params = values(*model);
  return t;
}

RefModel seeded_model(const ModelConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  return RefModel(c);
}

/// A model built from `seed` and boosted under `plugin`.
template <class P>
struct BoostedModel {
  BoostedModel(const ModelConfig& c, std::shared_ptr<P> p, uint64_t seed = 3)
      : model(seeded_model(c, seed)), opt(make_sgd(*model)), plugin(std::move(p)), booster(plugin) {
    booster.boost(*model, opt);
  }
  void backward(const torch::Tensor& tokens) {
    const auto local = tokens.to(runtime().device());
    booster.backward(lm_loss(model(local), local));
  }
  void step(const torch::Tensor& tokens) {
    booster.zero_grad();
    backward(tokens);
    booster.step();
  }

  RefModel model;
  torch::optim::SGD opt;
  std::shared_ptr<P> plugin;
  Booster booster;
};

/// Two backward passes of `tokens` under no_sync, then a synced one: the plugin's stats after
/// the held passes and after the synced one.
template <class P>
std::pair<BucketStats, BucketStats> accumulate_then_sync(BoostedModel<P>& m, const torch::Tensor& tokens) {
  {
    auto guard = m.booster.no_sync();
    m.backward(tokens);
    m.backward(tokens);
  }
  const auto quiet = m.plugin->stats();
  m.backward(tokens);
  return {quiet, m.plugin->stats()};
}

std::shared_ptr<DataParallel> buckets_of(int64_t bytes) {
  return std::make_shared<DataParallel>(DataParallelOptions{.bucket_bytes = bytes});
}

void expect_same(const Trajectory& got, const Trajectory& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::abs(want.losses[i])) << "step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    EXPECT_TRUE(tensors_equal(got.params[i], want.params[i], 1e-5, 1e-6)) << "parameter " << i;
  }
}

TEST(DataParallel, TrainsAsOneProcessOnTheGlobalBatch) {
  ASSERT_EQ(world_size(), expected_world_size());
  const ModelConfig c;
  const auto want = reference(c, 20, 1, 1.0);
  expect_same(boosted(c, 20, 1, 1.0, data_parallel({.bucket_bytes = 4096})), want);
  expect_same(boosted(c, 20, 1, 1.0, data_parallel()), want);  // one bucket
}

TEST(DataParallel, NoSyncAccumulatesAndReducesOncePerStep) {
  const ModelConfig c;
  const auto want = reference(c, 6, 3, 0);
  expect_same(boosted(c, 6, 3, 0, data_parallel({.bucket_bytes = 4096})), want);

  auto& dp = runtime().dp();
  BoostedModel m(c, buckets_of(4096));
  for (const auto& p : m.model->parameters()) EXPECT_EQ(p.device(), runtime().device()) << "boost() moves the model";
  const int64_t buckets = m.plugin->stats().buckets;
  EXPECT_GT(buckets, 3);
  const auto [quiet, synced] = accumulate_then_sync(m, batch_tokens(0, kBatch, kSeq, c.vocab));
  EXPECT_EQ(quiet.reductions_during_backward + quiet.reductions_at_end, 0);
  EXPECT_EQ(synced.reductions_during_backward + synced.reductions_at_end, dp.size() > 1 ? buckets : 0);
}

TEST(DataParallel, ReductionsOverlapBackward) {
  const ModelConfig c{.layers = 4};
  BoostedModel m(c, buckets_of(2048));
  m.backward(batch_tokens(0, kBatch, kSeq, c.vocab));
  const auto s = m.plugin->stats();
  if (runtime().dp().size() == 1) {
    EXPECT_EQ(s.reductions_during_backward + s.reductions_at_end, 0);
    return;
  }
  // Every bucket starts from inside backward, as soon as its last gradient has landed; none is
  // left for the end.
  EXPECT_GT(s.buckets, 3);
  EXPECT_EQ(s.reductions_during_backward, s.buckets);
  EXPECT_EQ(s.reductions_at_end, 0);
}

/// Two linears; the second is used on dp rank 0 only.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() : a(4, 4), b(4, 4) {
    register_module("a", a);
    register_module("b", b);
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_b) { return use_b ? b(a(x)) : a(x); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Branchy);

TEST(DataParallel, AParameterWithoutGradientOnARankCountsAsZero) {
  auto& dp = runtime().dp();
  torch::manual_seed(5);
  Branchy model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Booster booster(std::make_shared<DataParallel>());
  booster.boost(*model, opt);
  auto x = (torch::arange(8, torch::kFloat32).reshape({2, 4}) + dp.rank()).to(runtime().device());
  // A plain backward() reduces as well: the plugin needs no call of its own.
  model->forward(x, dp.rank() == 0).sum().backward();

  torch::manual_seed(5);
  Branchy ref;
  for (int r = 0; r < dp.size(); ++r) {
    ref->forward(torch::arange(8, torch::kFloat32).reshape({2, 4}) + r, r == 0).sum().backward();
  }
  auto got = model->named_parameters();
  for (const auto& p : ref->named_parameters()) {
    ASSERT_TRUE(got[p.key()].grad().defined()) << p.key();
    EXPECT_TRUE(tensors_equal(got[p.key()].grad(), p.value().grad() / dp.size(), 1e-6, 1e-6)) << p.key();
  }
}

TEST(DataParallel, CheckpointsRoundTrip) {
  const ModelConfig c;
  const auto dir = shared_temp_dir("booster_ckpt");
  if (runtime().rank() == 0) std::filesystem::create_directories(dir);
  runtime().world().barrier();
  auto tokens = batch_tokens(0, kBatch, kSeq, c.vocab);
  BoostedModel m(c, std::make_shared<DataParallel>());
  for (int i = 0; i < 3; ++i) m.step(tokens);
  m.booster.save_model(dir + "/model.safetensors");
  m.booster.save_optimizer(dir + "/optimizer.safetensors");

  BoostedModel again(c, std::make_shared<DataParallel>(), 11);
  again.booster.load_model(dir + "/model.safetensors");
  again.booster.load_optimizer(dir + "/optimizer.safetensors");
  m.step(tokens);
  again.step(tokens);
  const auto a = values(*m.model), b = values(*again.model);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(tensors_equal(a[i], b[i])) << "parameter " << i;

  // The model file is a plain one: a model without ztrain loads it.
  RefModel plain(c);
  load(*plain, dir + "/model.safetensors");
  runtime().world().barrier();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

/// Ranks holding different models: the plugin names the difference.
void expect_refuses_models_that_differ(const MakePlugin& make, const std::string& name) {
  auto& dp = runtime().dp();
  if (dp.size() == 1) return;
  torch::manual_seed(3);
  RefModel model(ModelConfig{.dim = dp.rank() == 1 ? 8 : 16});
  auto opt = make_sgd(*model);
  Booster booster(make());
  const auto msg = error_message([&] { booster.boost(*model, opt); });
  EXPECT_NE(msg.find(name + ": dp ranks 0 and 1 hold different models"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wte.weight"), std::string::npos) << msg;
}

TEST(DataParallel, RefusesBadInput) {
  expect_refuses_models_that_differ(data_parallel(), "DataParallel");
  torch::manual_seed(3);
  RefModel model(ModelConfig{});
  // An optimizer over tensors that are not the model's.
  torch::optim::SGD stray({torch::zeros({3}, torch::requires_grad())}, 0.1);
  Booster first(std::make_shared<DataParallel>());
  auto msg = error_message([&] { first.boost(*model, stray); });
  EXPECT_NE(msg.find("not a parameter of the model"), std::string::npos) << msg;
  // Steps before boost(), boosting twice, a bad option.
  auto opt = make_sgd(*model);
  Booster booster(std::make_shared<DataParallel>());
  msg = error_message([&] { booster.step(); });
  EXPECT_NE(msg.find("call boost(model, optimizer) first"), std::string::npos) << msg;
  booster.boost(*model, opt);
  msg = error_message([&] { booster.boost(*model, opt); });
  EXPECT_NE(msg.find("boost() was called already"), std::string::npos) << msg;
  Booster bad(std::make_shared<DataParallel>(DataParallelOptions{.bucket_bytes = 0}));
  RefModel other(ModelConfig{});
  auto other_opt = make_sgd(*other);
  msg = error_message([&] { bad.boost(*other, other_opt); });
  EXPECT_NE(msg.find("bucket_bytes must be positive"), std::string::npos) << msg;
}

// ---- LowLevelZero ------------------------------------------------------------------------------

std::shared_ptr<LowLevelZero> zero_stage(int stage, int64_t bucket_bytes = 4096) {
  return std::make_shared<LowLevelZero>(LowLevelZeroOptions{.stage = stage, .bucket_bytes = bucket_bytes});
}

/// This rank's share of a global batch (kBatch sequences per rank).
torch::Tensor local_share(int64_t step, int64_t vocab) {
  auto& dp = runtime().dp();
  return batch_tokens(step, kBatch * dp.size(), kSeq, vocab).slice(0, dp.rank() * kBatch, (dp.rank() + 1) * kBatch);
}

TEST(LowLevelZero, TrainsAsOneProcessOnTheGlobalBatch) {
  const ModelConfig c;
  const auto want = reference(c, 20, 1, 1.0);
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    expect_same(boosted(c, 20, 1, 1.0, low_level_zero({.stage = stage, .bucket_bytes = 4096})), want);
    expect_same(boosted(c, 20, 1, 1.0, low_level_zero({.stage = stage})), want);  // one bucket per group
  }
}

TEST(LowLevelZero, NoSyncAccumulatesAndEveryReductionOverlapsBackward) {
  const ModelConfig c;
  const auto want = reference(c, 6, 3, 0);
  const int dp = runtime().dp().size();
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    expect_same(boosted(c, 6, 3, 0, low_level_zero({.stage = stage, .bucket_bytes = 4096})), want);

    BoostedModel m(c, zero_stage(stage));
    const int64_t buckets = m.plugin->stats().buckets;
    EXPECT_GT(buckets, 3);
    const auto [quiet, synced] = accumulate_then_sync(m, local_share(0, c.vocab));
    EXPECT_EQ(quiet.reductions_during_backward + quiet.reductions_at_end, 0);
    // One reduction per bucket, each started inside backward as soon as its gradients landed.
    EXPECT_EQ(synced.reductions_during_backward, dp > 1 ? buckets : 0);
    EXPECT_EQ(synced.reductions_at_end, 0);
  }
}

TEST(LowLevelZero, ShardsOptimizerStateAndAtStageTwoGradients) {
  const ModelConfig c;
  auto& dp = runtime().dp();
  const auto tokens = local_share(0, c.vocab);
  BoostedModel ddp(c, std::make_shared<DataParallel>());
  ddp.step(tokens);
  ddp.booster.zero_grad();
  ddp.backward(tokens);
  int64_t total = 0;
  for (const auto& p : ddp.model->parameters()) total += p.numel();

  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    BoostedModel m(c, zero_stage(stage));
    m.step(tokens);
    // The optimizer steps this rank's shards: its momenta hold 1/dp of the elements (each
    // parameter starting on 64 bytes, each bucket padded to dp shards starting on 64 bytes).
    int64_t state = 0;
    for (const auto& item : m.opt.state()) {
      state += static_cast<const torch::optim::SGDParamState&>(*item.second).momentum_buffer().numel();
    }
    const int64_t slack = 16 * (static_cast<int64_t>(ddp.model->parameters().size()) + m.plugin->stats().buckets * dp.size());
    EXPECT_GE(state * dp.size(), total);
    EXPECT_LE(state * dp.size(), total + slack);
    // Every rank holds the whole model, equal to DataParallel's after the same step.
    auto got = m.model->named_parameters();
    for (const auto& p : ddp.model->named_parameters()) {
      EXPECT_TRUE(tensors_equal(got[p.key()], p.value(), 1e-6, 1e-7)) << p.key();
    }
    m.booster.zero_grad();
    m.backward(tokens);
    for (const auto& p : ddp.model->named_parameters()) {
      const auto& grad = got[p.key()].grad();
      if (stage == 1) {
        ASSERT_TRUE(grad.defined()) << p.key();
        EXPECT_TRUE(tensors_equal(grad, p.value().grad(), 1e-6, 1e-7)) << p.key() << ": the mean gradient";
      } else {
        EXPECT_FALSE(grad.defined()) << p.key() << ": stage 2 keeps gradients on the shards only";
      }
    }
    for (const auto& group : m.opt.param_groups()) {
      for (const auto& shard : group.params()) {
        ASSERT_TRUE(shard.grad().defined());
        EXPECT_EQ(shard.grad().sizes(), shard.sizes());
      }
    }
  }
}

TEST(LowLevelZero, OffloadedAdamUpdatesTheShardsAsAdamW) {
  // AdamOffload built over the model before boost() updates the shards it is handed, with its
  // state in host memory: the same steps as ztrain's AdamW, state 1/dp.
  const ModelConfig c;
  auto& dp = runtime().dp();
  std::vector<std::vector<torch::Tensor>> finals;
  for (bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "AdamOffload" : "AdamW");
    RefModel model = seeded_model(c, 3);
    std::unique_ptr<optim::AdamW> opt = offload
        ? std::make_unique<optim::AdamOffload>(*model, optim::AdamOptions(1e-3))
        : std::make_unique<optim::AdamW>(model->parameters(), optim::AdamOptions(1e-3));
    auto plugin = zero_stage(2);
    Booster booster(plugin, {.max_grad_norm = 1.0});
    booster.boost(*model, *opt);
    for (int step = 0; step < 5; ++step) {
      booster.zero_grad();
      const auto tokens = local_share(step, c.vocab).to(runtime().device());
      booster.backward(lm_loss(model(tokens), tokens));
      EXPECT_TRUE(booster.step());
    }
    if (offload) static_cast<optim::AdamOffload&>(*opt).wait();
    int64_t state = 0, total = 0;
    for (const auto& group : opt->param_groups()) {
      for (const auto& shard : group.params()) {
        const auto* s = opt->state_of(shard);
        ASSERT_NE(s, nullptr);
        EXPECT_EQ(s->exp_avg.device(), offload ? torch::Device(torch::kCPU) : runtime().device());
        state += s->exp_avg.numel();
      }
    }
    for (const auto& p : model->parameters()) total += p.numel();
    const int64_t slack = 16 * (static_cast<int64_t>(model->parameters().size()) + plugin->stats().buckets * dp.size());
    EXPECT_LE(state * dp.size(), total + slack);
    finals.push_back(values(*model));
  }
  // Bit for bit on the CPU. On a GPU AdamW is libtorch's fused kernel and AdamOffload the host's,
  // whose last bits differ; Adam scales a gradient that is zero up to rounding (the attention
  // key's bias: softmax ignores a constant added to every score) into steps of up to lr, so the
  // measure there is relative to each tensor's norm.
  for (size_t i = 0; i < finals[0].size(); ++i) {
    if (!runtime().device().is_cuda()) {
      EXPECT_TRUE(tensors_equal(finals[0][i], finals[1][i], 0, 0)) << "parameter " << i;
      continue;
    }
    const auto diff = (finals[0][i].to(torch::kFloat64) - finals[1][i].to(torch::kFloat64)).norm().item<double>();
    EXPECT_LE(diff, 1e-3 * finals[0][i].to(torch::kFloat64).norm().item<double>()) << "parameter " << i;
  }
}

TEST(LowLevelZero, CheckpointsLoadUnderEitherPlugin) {
  const ModelConfig c;
  const auto dir = shared_temp_dir("booster_zero_ckpt");
  if (runtime().rank() == 0) std::filesystem::create_directories(dir);
  runtime().world().barrier();
  BoostedModel m(c, zero_stage(2));
  for (int i = 0; i < 3; ++i) m.step(local_share(i, c.vocab));
  m.booster.save_model(dir + "/model.safetensors");
  m.booster.save_optimizer(dir + "/optimizer.safetensors");

  // Another stage and bucket layout, and DataParallel, each built from another seed.
  BoostedModel other(c, zero_stage(1, int64_t{1} << 20), 11);
  BoostedModel ddp(c, std::make_shared<DataParallel>(), 13);
  other.booster.load_model(dir + "/model.safetensors");
  other.booster.load_optimizer(dir + "/optimizer.safetensors");
  ddp.booster.load_model(dir + "/model.safetensors");
  ddp.booster.load_optimizer(dir + "/optimizer.safetensors");
  const auto tokens = local_share(3, c.vocab);
  m.step(tokens);
  other.step(tokens);
  ddp.step(tokens);
  const auto a = values(*m.model), b = values(*other.model), d = values(*ddp.model);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(tensors_equal(a[i], b[i], 1e-6, 1e-7)) << "parameter " << i;
    EXPECT_TRUE(tensors_equal(a[i], d[i], 1e-6, 1e-7)) << "parameter " << i;
  }
  // And back: DataParallel's optimizer file loads under LowLevelZero.
  ddp.booster.save_optimizer(dir + "/ddp_optimizer.safetensors");
  ddp.booster.save_model(dir + "/ddp_model.safetensors");
  BoostedModel back(c, zero_stage(2), 17);
  back.booster.load_model(dir + "/ddp_model.safetensors");
  back.booster.load_optimizer(dir + "/ddp_optimizer.safetensors");
  back.step(tokens);
  ddp.step(tokens);
  const auto e = values(*back.model), f = values(*ddp.model);
  for (size_t i = 0; i < e.size(); ++i) EXPECT_TRUE(tensors_equal(e[i], f[i], 1e-6, 1e-7)) << "parameter " << i;
  runtime().world().barrier();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(LowLevelZero, RefusesBadInput) {
  expect_refuses_models_that_differ(low_level_zero({}), "LowLevelZero");
  const auto expect_refused = [](LowLevelZeroOptions options, const std::string& what, bool stepped = false) {
    torch::manual_seed(3);
    RefModel model(ModelConfig{});
    auto opt = make_sgd(*model);
    if (stepped) {
      auto tokens = batch_tokens(0, kBatch, kSeq, 32);
      lm_loss(model(tokens), tokens).backward();
      opt.step();
    }
    Booster booster(std::make_shared<LowLevelZero>(options));
    const auto msg = error_message([&] { booster.boost(*model, opt); });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  expect_refused({.stage = 3}, "stage must be 1 or 2, got 3");
  expect_refused({.bucket_bytes = 0}, "bucket_bytes must be positive");
  expect_refused({}, "the optimizer holds state already", true);
}

}  // namespace booster_test
}  // namespace ztrain::test
