// Optimizer state files: a resumed run continues bit for bit at the same world size, and within
// fp32 rounding at another one.

#include "../zero/zero_model.h"
#include "test_util.h"

#include <ztrain/torch_compat.h>

#include <cmath>
#include <cstring>
#include <filesystem>

namespace ztrain::test {
namespace optimizer_state_test {

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>, double lr)>;

const std::map<std::string, Factory>& optimizers() {
  static const std::map<std::string, Factory> all = {
      {"torch_adamw",
       [](std::vector<torch::Tensor> p, double lr) {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(lr).weight_decay(0.1));
       }},
      {"torch_sgd",
       [](std::vector<torch::Tensor> p, double lr) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(lr).momentum(0.9));
       }},
      {"torch_rmsprop",
       [](std::vector<torch::Tensor> p, double lr) {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(lr).momentum(0.5).centered(true));
       }},
      {"torch_adagrad",
       [](std::vector<torch::Tensor> p, double lr) {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(lr));
       }},
      {"ztrain_adamw",
       [](std::vector<torch::Tensor> p, double lr) {
         return std::make_unique<optim::AdamW>(p, optim::AdamOptions(lr).weight_decay(0.1));
       }},
  };
  return all;
}

/// A model, its optimizer and manager; steps draw batch `step` of a global batch of 8.
struct Trainer {
  ZeroModel model;
  std::unique_ptr<torch::optim::Optimizer> opt;
  optim::OptimManager mgr;
  int64_t vocab;
  int64_t step = 0;

  Trainer(const std::string& kind, int level, uint64_t seed, double lr, ModelConfig config = {})
      : model(config, BlockOptions{.zero_level = level, .use_checkpoint = false}, level == 3 ? 2 : level),
        mgr(*model) {
    vocab = config.vocab;
    init_parameters(*model, {.seed = seed});
    opt = optimizers().at(kind)(model->parameters(), lr);
    mgr.add_optimizer(*opt, std::make_shared<lr_scheduler::Cosine>(
                                LRSchedulerOptions{.peak_lr = 1e-2, .warmup_steps = 3, .total_steps = 40}));
  }
  void train(int steps) {
    const int dp = runtime().dp().size(), r = runtime().dp().rank(), local = 8 / dp;
    for (int i = 0; i < steps; ++i, ++step) {
      auto tokens = batch_tokens(step, 8, 8, vocab).slice(0, r * local, (r + 1) * local);
      mgr.zero_grad();
      mgr.backward(lm_loss(model(tokens), tokens));
      mgr.clip_grad_norm(1.0);
      mgr.step();
    }
  }
  void save_all(const std::string& dir) {
    save(*model, dir + "/model.safetensors");
    save_optimizer_state(*model, *opt, dir + "/optim.safetensors");
  }
  void load_all(const std::string& dir, const optim::OptimManagerState& state, int64_t at_step) {
    load(*model, dir + "/model.safetensors");
    load_optimizer_state(*model, *opt, dir + "/optim.safetensors");
    mgr.load_state(state);
    step = at_step;
  }
};

std::string shared_dir(const std::string& stem) {
  std::string dir;
  if (runtime().rank() == 0) {
    dir = (std::filesystem::temp_directory_path() / c10::str("ztrain_optim_state_", stem, "_", ::getpid())).string();
    std::filesystem::create_directories(dir);
  }
  return runtime().world().broadcast_bytes(dir, 0);
}

class OptimizerState : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(OptimizerState, ResumeIsBitExact) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto [kind, level] = GetParam();
  const auto dir = shared_dir(c10::str(kind, level));
  Trainer reference(kind, level, 1, 1e-2);
  reference.train(10);
  reference.save_all(dir);
  const auto state = reference.mgr.state();
  reference.train(10);

  Trainer resumed(kind, level, 99, 0.5);  // other weights, another lr: everything comes from the files
  resumed.load_all(dir, state, 10);
  resumed.train(10);
  const auto want = gathered_parameters(*reference.model), got = gathered_parameters(*resumed.model);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].second.equal(want[i].second)) << want[i].first;
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerState,
                         ::testing::Combine(::testing::Values("torch_adamw", "torch_sgd", "torch_rmsprop",
                                                              "torch_adagrad", "ztrain_adamw"),
                                            ::testing::Values(0, 1, 3)),
                         [](const auto& info) { return c10::str(std::get<0>(info.param), "_level", std::get<1>(info.param)); });

// With ZTRAIN_CROSS_DIR set: at 4 ranks train 10 steps, save, train 10 more and save the final
// parameters as the reference; at 2 ranks load the step-10 files, train 10 steps, compare.
TEST(OptimizerStateAcrossWorldSizes, SavedAtFourResumesAtTwo) {
  const char* dir = std::getenv("ZTRAIN_CROSS_DIR");
  ASSERT_NE(dir, nullptr) << "set ZTRAIN_CROSS_DIR";
  optim::OptimManagerState state;
  if (world_size() == 4) {
    if (rank() == 0) std::filesystem::create_directories(dir);
    synchronize();
    Trainer run("ztrain_adamw", 3, 1, 1e-2);
    run.train(10);
    run.save_all(dir);
    state = run.mgr.state();
    ASSERT_EQ(state.steps, 10);
    run.train(10);
    save(*run.model, std::string(dir) + "/reference.safetensors");
    return;
  }
  Trainer run("ztrain_adamw", 2, 5, 1e-3);
  // The manager state at step 10 is the same at any world size: recompute it by position.
  Trainer probe("ztrain_adamw", 2, 1, 1e-2);
  probe.train(10);
  run.load_all(dir, probe.mgr.state(), 10);
  run.train(10);
  const auto want = ckpt::load_safetensors(std::string(dir) + "/reference.safetensors");
  const auto got = gathered_parameters(*run.model);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    // The key part of the qkv bias has a gradient that is zero in exact arithmetic (a shift of
    // every key by the same vector leaves the softmax unchanged); Adam normalises its rounding
    // noise, which depends on the reduction order and so on the world size, to full-size
    // steps. Everything else must agree to fp32 rounding.
    const bool noise_driven = want[i].first.ends_with("qkv.bias");
    EXPECT_TRUE(tensors_equal(got[i].second, want[i].second, 1e-6, noise_driven ? 1e-3 : 1e-7)) << want[i].first;
  }
}

// ---- asynchronous save ------------------------------------------------------------------

/// Every entry of two files has the same name, dtype, shape and bytes, and the metadata agree.
::testing::AssertionResult files_identical(const std::string& a, const std::string& b) {
  ckpt::SafetensorsReader x(a), y(b);
  if (x.metadata() != y.metadata()) return ::testing::AssertionFailure() << "metadata differ";
  if (x.entries().size() != y.entries().size()) {
    return ::testing::AssertionFailure() << x.entries().size() << " entries vs " << y.entries().size();
  }
  for (const auto& e : x.entries()) {
    if (!y.contains(e.name)) return ::testing::AssertionFailure() << "'" << e.name << "' missing in " << b;
    const auto u = x.read(e.name), v = y.read(e.name);
    if (u.scalar_type() != v.scalar_type() || u.sizes() != v.sizes() ||
        std::memcmp(u.data_ptr(), v.data_ptr(), u.nbytes()) != 0) {
      return ::testing::AssertionFailure() << "'" << e.name << "' differs";
    }
  }
  return ::testing::AssertionSuccess();
}

/// Every moment tensor of an Adam-type optimizer (they share storage with the optimizer's).
std::vector<torch::Tensor> moments(torch::optim::Optimizer& opt) {
  std::vector<torch::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      if (auto* ours = dynamic_cast<optim::AdamW*>(&opt)) {
        out.push_back(ours->state_of(p)->exp_avg);
        out.push_back(ours->state_of(p)->exp_avg_sq);
      } else {
        auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(ztrain::detail::optimizer_state_key(p)));
        out.push_back(s.exp_avg());
        out.push_back(s.exp_avg_sq());
      }
    }
  }
  return out;
}

const ModelConfig kAsyncModel{.vocab = 64, .dim = 64, .layers = 3};

class OptimizerStateAsync : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// The async file, written while training goes on (optimizer steps, ZeRO gathers and reductions on
// the training thread), equals a synchronous save taken at the same moment, and resumes bit-exactly.
TEST_P(OptimizerStateAsync, EqualsSyncSaveWhileTrainingContinues) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto [kind, level] = GetParam();
  const auto dir = shared_dir(c10::str("async_", kind, level));
  Trainer reference(kind, level, 1, 1e-2, kAsyncModel);
  reference.train(5);
  save(*reference.model, dir + "/model.safetensors");
  save_optimizer_state(*reference.model, *reference.opt, dir + "/sync.safetensors");
  const auto state = reference.mgr.state();

  // The state is copied before the call returns: overwriting it at once changes nothing in the file.
  auto clobbered = save_optimizer_state_async(*reference.model, *reference.opt, dir + "/clobbered.safetensors");
  auto live = moments(*reference.opt);
  std::vector<torch::Tensor> kept;
  for (auto& t : live) kept.push_back(t.clone()), t.fill_(std::nanf(""));
  clobbered.wait();
  for (size_t i = 0; i < live.size(); ++i) live[i].copy_(kept[i]);
  EXPECT_TRUE(files_identical(dir + "/sync.safetensors", dir + "/clobbered.safetensors"));

  auto pending = save_optimizer_state_async(*reference.model, *reference.opt, dir + "/async.safetensors");
  EXPECT_EQ(pending.path(), dir + "/async.safetensors");
  reference.train(5);  // steps, gathers and reductions while the file is written
  pending.wait();
  EXPECT_TRUE(pending.is_done());
  EXPECT_TRUE(files_identical(dir + "/sync.safetensors", dir + "/async.safetensors"));

  Trainer resumed(kind, level, 99, 0.5, kAsyncModel);
  load(*resumed.model, dir + "/model.safetensors");
  load_optimizer_state(*resumed.model, *resumed.opt, dir + "/async.safetensors");
  resumed.mgr.load_state(state);
  resumed.step = 5;
  resumed.train(5);
  const auto want = gathered_parameters(*reference.model), got = gathered_parameters(*resumed.model);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].second.equal(want[i].second)) << want[i].first;
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerStateAsync,
                         ::testing::Combine(::testing::Values("torch_adamw", "ztrain_adamw"), ::testing::Values(0, 3)),
                         [](const auto& info) {
                           return c10::str(std::get<0>(info.param), "_level", std::get<1>(info.param));
                         });

// A second save waits for the first; both files are complete and equal.
TEST(OptimizerStateAsyncQueue, SecondSaveWaitsForTheFirst) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto dir = shared_dir("async_queue");
  Trainer t("ztrain_adamw", 3, 1, 1e-2, kAsyncModel);
  t.train(3);
  auto first = save_optimizer_state_async(*t.model, *t.opt, dir + "/first.safetensors");
  auto second = save_optimizer_state_async(*t.model, *t.opt, dir + "/second.safetensors");
  EXPECT_TRUE(first.is_done());
  first.wait();
  second.wait();
  EXPECT_TRUE(files_identical(dir + "/first.safetensors", dir + "/second.safetensors"));
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

// A path that cannot be written: wait() rethrows a ztrain::Error naming it on every rank, training
// goes on meanwhile, and the next save works.
TEST(OptimizerStateAsyncErrors, UnwritablePathIsRethrownAtWait) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto dir = shared_dir("async_error");
  const std::string bad = dir + "/no/such/dir/optim.safetensors";
  Trainer t("torch_adamw", 3, 1, 1e-2);
  t.train(2);
  auto pending = save_optimizer_state_async(*t.model, *t.opt, bad);
  t.train(3);  // collectives on the training thread are not blocked by the failing save
  const auto message = error_message([&] { pending.wait(); });
  EXPECT_NE(message.find(bad), std::string::npos) << message;
  EXPECT_TRUE(pending.is_done());
  EXPECT_NE(error_message([&] { pending.wait(); }).find(bad), std::string::npos);  // every wait() rethrows
  EXPECT_FALSE(std::filesystem::exists(bad));

  // A handle dropped without wait() reports the failure on stderr and does not throw.
  ::testing::internal::CaptureStderr();
  { auto dropped = save_optimizer_state_async(*t.model, *t.opt, bad); }
  const auto printed = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(printed.find(bad), std::string::npos) << printed;

  const auto good = dir + "/optim.safetensors";
  save_optimizer_state_async(*t.model, *t.opt, good).wait();
  save_optimizer_state(*t.model, *t.opt, dir + "/sync.safetensors");
  EXPECT_TRUE(files_identical(good, dir + "/sync.safetensors"));
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace optimizer_state_test
}  // namespace ztrain::test
