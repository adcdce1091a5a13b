// AdamOffload: the same numbers as AdamW, bit for bit, with the update running behind the next
// forward; sharded modules wait for their own shards, plain parameters are updated in step().

#include "test_util.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace ztrain::test {
namespace adam_offload_test {

using models::Gpt;
using models::GptConfig;

const GptConfig kConfig{.vocab_size = 64, .context = 16, .d_model = 32, .n_layer = 3, .n_head = 4};
constexpr int kSteps = 12;

torch::Tensor batch(int step) {
  const int dp = runtime().dp().size(), r = runtime().dp().rank();
  auto tokens = torch::randint(kConfig.vocab_size, {4, 13}, at::detail::createCPUGenerator(300 + step), torch::kLong);
  return tokens.slice(0, 4 / dp * r, 4 / dp * (r + 1));
}

struct Run {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<int64_t> steps;  // AdamParamState::step of every optimizer parameter
  std::vector<std::pair<std::string, int64_t>> state_mappings;  // each state tensor's file and resident kB
  std::vector<std::pair<std::string, int64_t>> shard_mappings;  // each block parameter shard's
};

/// The file behind the mapping that holds `address` in this process, and how many kB of it are
/// resident ("" when it is not a file mapping).
std::pair<std::string, int64_t> mapping_of(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::string line;
  bool inside = false;
  std::string path;
  while (std::getline(smaps, line)) {
    std::istringstream fields(line);
    std::string range;
    fields >> range;
    if (const auto dash = range.find('-'); dash != std::string::npos && range.find(':') == std::string::npos) {
      const auto begin = std::stoull(range.substr(0, dash), nullptr, 16);
      const auto end = std::stoull(range.substr(dash + 1), nullptr, 16);
      inside = begin <= at && at < end;
      std::string perms, offset, device, inode;
      fields >> perms >> offset >> device >> inode;
      std::getline(fields >> std::ws, path);
    } else if (inside && range == "Rss:") {
      int64_t kb = 0;
      fields >> kb;
      return {path, kb};
    }
  }
  return {"", -1};
}

/// AdamW over the model's parameters, AdamOffload over the model.
template <class Optimizer>
Optimizer optimizer_for(torch::nn::Module& model, const optim::AdamOptions& options,
                        const optim::AdamEngineOptions& engine) {
  if constexpr (std::is_same_v<Optimizer, optim::AdamOffload>) {
    return Optimizer(model, options, engine);
  } else {
    return Optimizer(model.parameters(), options, engine);
  }
}

template <class Optimizer>
Run train(int level, c10::ScalarType dtype, int grad_accum, const optim::AdamEngineOptions& engine = {},
          std::optional<std::string> param_dir = std::nullopt) {
  auto c = kConfig;
  c.dtype = dtype;
  Gpt model(c, {.zero_level = level, .use_checkpoint = level % 2 == 1, .offload_dir = param_dir});
  init_parameters(*model, {.seed = 3, .init = models::gpt_init(c)});
  Optimizer opt = optimizer_for<Optimizer>(*model, optim::AdamOptions(1e-2).weight_decay(0.1), engine);
  optim::OptimManager mgr(*model);
  // The schedule changes the lr after each step, while AdamOffload's updates may still run.
  mgr.add_optimizer(opt, std::make_shared<lr_scheduler::Cosine>(
                             LRSchedulerOptions{.peak_lr = 1e-2, .warmup_steps = 3, .total_steps = kSteps}));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    mgr.zero_grad();
    double loss = 0;
    for (int micro = 0; micro < grad_accum; ++micro) {
      auto l = model->loss(batch(step * grad_accum + micro)) / grad_accum;
      mgr.backward(l);
      loss += l.item<double>();
    }
    mgr.clip_grad_norm(0.5);
    mgr.step();
    run.losses.push_back(sum_loss(torch::tensor(loss)).item<double>());
  }
  for (const auto& p : model->parameters()) {
    const auto* s = opt.state_of(p);
    run.steps.push_back(s ? s->step : -1);
    if (!s) continue;
    for (const auto* t : {&s->exp_avg, &s->exp_avg_sq, &s->master}) {
      if (t->defined() && t->numel() > 0) run.state_mappings.push_back(mapping_of(t->data_ptr()));
    }
  }
  for (const auto& p : model->named_parameters()) {
    if (p.key().find(".h.") != std::string::npos) run.shard_mappings.push_back(mapping_of(p.value().data_ptr()));
  }
  run.params = gathered_parameters(*model);
  return run;
}

TEST(AdamOffload, EqualsAdamWBitForBitAtEveryZeroLevel) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int level = 0; level <= 3; ++level) {
      SCOPED_TRACE(c10::str("level ", level, " ", dtype));
      const int accum = level == 2 ? 2 : 1;
      const auto ref = train<optim::AdamW>(level, dtype, accum);
      const auto got = train<optim::AdamOffload>(level, dtype, accum);
      for (int i = 0; i < kSteps; ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
      ASSERT_EQ(got.params.size(), ref.params.size());
      for (size_t i = 0; i < ref.params.size(); ++i) {
        EXPECT_TRUE(tensors_equal(got.params[i].second, ref.params[i].second)) << ref.params[i].first;
      }
      EXPECT_EQ(got.steps, ref.steps);
      EXPECT_EQ(got.steps.front(), kSteps);
    }
  }
}

/// The same losses and final parameters, bit for bit.
void expect_same_training(const Run& got, const Run& ref) {
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(tensors_equal(got.params[i].second, ref.params[i].second)) << ref.params[i].first;
  }
}

/// Every mapping is an offload file in `dir`, unlinked, with no page resident.
void expect_unlinked_files_in(const std::string& dir, const std::vector<std::pair<std::string, int64_t>>& mappings) {
  for (const auto& [path, resident_kb] : mappings) {
    EXPECT_EQ(path.rfind(dir + "/ztrain-offload-", 0), 0u) << path;
    EXPECT_NE(path.find("(deleted)"), std::string::npos) << path;
    EXPECT_EQ(resident_kb, 0) << path;
  }
}

// ZeRO-Infinity's offload of the optimizer state to disk: with a state_dir the moments and masters
// are mappings of (unlinked) files there, none of their pages resident between steps, and the
// training is the same bit for bit, for AdamW and AdamOffload.
TEST(AdamOffload, StateInFilesEqualsStateInMemory) {
  const auto dir = c10::str(std::filesystem::temp_directory_path().string(), "/ztrain_state_dir_", ::getpid());
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int level : {0, 3}) {
      SCOPED_TRACE(c10::str("level ", level, " ", dtype));
      const auto ref = train<optim::AdamW>(level, dtype, 1);
      for (const auto& got : {train<optim::AdamW>(level, dtype, 1, {.state_dir = dir}),
                              train<optim::AdamOffload>(level, dtype, 1, {.state_dir = dir})}) {
        expect_same_training(got, ref);
        EXPECT_EQ(got.steps, ref.steps);
        ASSERT_FALSE(got.state_mappings.empty());
        expect_unlinked_files_in(dir, got.state_mappings);
      }
      for (const auto& m : ref.state_mappings) EXPECT_EQ(m.first.find(dir), std::string::npos) << "in memory";
    }
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the state files are unlinked";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// ZeRO-Infinity's parameter offload: with BlockOptions::offload_dir (and the state in files too)
// every block's parameter shard is a mapping of an unlinked file there, none of its pages resident
// after the step wrote it back, and the training is the same bit for bit.
TEST(AdamOffload, ShardsInFilesEqualShardsInMemory) {
  const auto dir = c10::str(std::filesystem::temp_directory_path().string(), "/ztrain_param_dir_", ::getpid());
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::str(dtype));
    const auto ref = train<optim::AdamW>(3, dtype, 2);
    for (const auto& got : {train<optim::AdamW>(3, dtype, 2, {.state_dir = dir}, dir),
                            train<optim::AdamOffload>(3, dtype, 2, {.state_dir = dir}, dir)}) {
      expect_same_training(got, ref);
      ASSERT_GE(got.shard_mappings.size(), static_cast<size_t>(kConfig.n_layer));
      expect_unlinked_files_in(dir, got.shard_mappings);
    }
    for (const auto& m : ref.shard_mappings) EXPECT_EQ(m.first.find(dir), std::string::npos) << "in memory";
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the files are unlinked";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST(AdamOffload, ParameterShardsOnDiskNeedShardedParameters) {
  const auto dir = std::filesystem::temp_directory_path().string();
  for (int level : {0, 1}) {
    const auto message = error_message([&] { Gpt model(kConfig, {.zero_level = level, .offload_dir = dir}); });
    EXPECT_NE(message.find("offload_dir keeps parameter shards on disk, which needs zero_level 2 or 3"), std::string::npos)
        << message;
  }
}

TEST(AdamOffload, StateDirThatCannotBeUsedIsNamed) {
  torch::nn::Linear layer(4, 4);
  const auto file = c10::str(std::filesystem::temp_directory_path().string(), "/ztrain_not_a_dir_", ::getpid(), "_",
                             runtime().rank());
  std::ofstream(file) << "x";
  optim::AdamW opt(layer->parameters(), optim::AdamOptions(1e-2), {.state_dir = file + "/state"});
  layer(torch::ones({1, 4})).sum().backward();
  const auto message = error_message([&] { opt.step(); });
  EXPECT_NE(message.find("optimizer state_dir '" + file + "/state'"), std::string::npos) << message;
  std::filesystem::remove(file);
}

// A model with a plain parameter next to sharded ones: the plain one is updated inside step(),
// the sharded ones before their module next uses them; step() takes every gradient.
TEST(AdamOffload, PlainParametersInStepShardsBeforeTheirUse) {
  struct Net : torch::nn::Module {
    BlockList<torch::nn::Linear> blocks{4, [](int64_t) { return torch::nn::Linear(64, 64); }, {.zero_level = 3}};
    torch::nn::Linear head{64, 4};
    Net() {
      register_module("blocks", blocks);
      register_module("head", head);
    }
    torch::Tensor forward(const torch::Tensor& x) { return head(blocks(x)); }
  };
  torch::manual_seed(1);
  auto a = std::make_shared<Net>();
  torch::manual_seed(1);
  auto b = std::make_shared<Net>();
  optim::AdamW plain_opt(a->parameters(), optim::AdamOptions(1e-2));
  optim::AdamOffload offload_opt(*b, optim::AdamOptions(1e-2));
  auto x = torch::randn({8, 64}, at::detail::createCPUGenerator(7));
  for (int step = 0; step < 3; ++step) {
    a->forward(x).pow(2).mean().backward();
    b->forward(x).pow(2).mean().backward();
    plain_opt.step();
    offload_opt.step();
    // The head (not in a sharded module) is already updated when step() returns.
    EXPECT_TRUE(tensors_equal(b->head->weight.detach(), a->head->weight.detach()));
    for (const auto& p : b->parameters()) EXPECT_FALSE(p.grad().defined()) << "step() takes the gradients";
    plain_opt.zero_grad();
    if (step == 1) {
      // A model file written right after step() holds the updated weights.
      const auto path = c10::str(std::filesystem::temp_directory_path().string(), "/adam_offload_", ::getpid(), "_",
                                 runtime().rank(), ".safetensors");
      const auto shared = runtime().world().broadcast_bytes(path, 0);
      save(*b, shared);
      const ckpt::SafetensorsReader file(shared);
      for (const auto& [name, value] : gathered_parameters(*a)) EXPECT_TRUE(tensors_equal(file.read(name), value)) << name;
      synchronize();
      if (runtime().rank() == 0) std::filesystem::remove(shared);
    }
    // The next forward waits for each block's shard: the outputs agree.
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(tensors_equal(b->forward(x), a->forward(x)));
  }
  offload_opt.wait();
  EXPECT_FALSE(offload_opt.busy());
  for (const auto& p : b->parameters()) EXPECT_EQ(offload_opt.state_of(p)->step, 3);
}

}  // namespace adam_offload_test
}  // namespace ztrain::test
