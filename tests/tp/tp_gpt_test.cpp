// GPT split over a tensor-parallel group (and ZeRO over dp) trains like the single-process
// model, its vocabulary padded to a multiple of tp, and a gathered model file written at tp = 2
// loads at tp = 1 and tp = 4.
//
// Registered as a chain of launches sharing ZTRAIN_TP_DIR (tests/tp/CMakeLists.txt):
//   TpGpt.Reference            1 rank: 30 steps, losses, gradient norms and final weights
//   TpGpt.MatchesSingleProcess tp=2, tp=4, dp=2 x tp=2, every ZeRO level; tp=2 also writes
//                              a model file
//   TpGpt.FileFromTp2Loads     1 rank and tp=4: the tp=2 file gives identical full tensors

#include "gpt_trajectory.h"
#include "tp_environment.h"

#include <filesystem>
#include <fstream>

namespace ztrain::test {
namespace tp_gpt_test {

[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new TensorParallelEnvironment({"TpGpt"}));

using models::Gpt;
using models::GptConfig;

// A vocabulary that divides by neither 2 nor 4: the split embedding and head pad it (to 98 at
// tp = 2, 100 at tp = 4), files and gathered tensors hold the 97 rows alone.
const GptConfig kConfig{.vocab_size = 97, .context = 16, .d_model = 32, .n_layer = 2, .n_head = 4};
constexpr int kSteps = 30;
constexpr int64_t kGlobalBatch = 4;

std::string dir() {
  const char* d = std::getenv("ZTRAIN_TP_DIR");
  return d ? d : "";
}

torch::Tensor batch(int step) { return counting_batch(step, kGlobalBatch, kConfig.vocab_size); }


/// Trains `model` kSteps with SGD + momentum and gradient clipping (active from the first
/// step, so the norm over split and replicated parameters matters).
LossTrajectory train(Gpt& model) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
  optim::OptimManager mgr(*model);
  mgr.add_optimizer(opt);
  LossTrajectory t;
  for (int step = 0; step < kSteps; ++step) {
    mgr.zero_grad();
    auto loss = model->loss(batch(step));
    mgr.backward(loss);
    t.norms.push_back(mgr.clip_grad_norm(0.5));
    mgr.step();
    t.losses.push_back(sum_loss(loss).item<double>());
  }
  return t;
}

Gpt fresh_model(int zero_level, bool recompute) {
  Gpt model(kConfig, {.zero_level = zero_level, .use_checkpoint = recompute});
  init_parameters(*model, {.seed = 1, .init = models::gpt_init(kConfig)});
  return model;
}

TEST(TpGpt, Reference) {
  ASSERT_FALSE(dir().empty()) << "set ZTRAIN_TP_DIR";
  ASSERT_EQ(world_size(), 1);
  std::filesystem::create_directories(dir());
  auto model = fresh_model(0, false);
  const auto t = train(model);
  EXPECT_LT(t.losses.back(), t.losses.front() - 0.5);  // it learns
  write_trajectory(dir() + "/reference.txt", t);
  save(*model, dir() + "/reference.safetensors");
}

LossTrajectory reference() { return read_trajectory(dir() + "/reference.txt"); }

TEST(TpGpt, MatchesSingleProcess) {
  ASSERT_FALSE(dir().empty()) << "set ZTRAIN_TP_DIR";
  const auto ref = reference();
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kSteps)) << "run TpGpt.Reference first";
  const ckpt::SafetensorsReader ref_file(dir() + "/reference.safetensors");
  const int tp = runtime().tp().size();
  for (int level = 0; level <= 3; ++level) {
    SCOPED_TRACE(c10::str("tp=", tp, " dp=", runtime().dp().size(), " zero_level=", level));
    auto model = fresh_model(level, level % 2 == 1);
    if (level == 0) {
      // Per-rank parameter bytes: the split parts divide by tp, the replicated ones do not.
      const double full = static_cast<double>(kConfig.num_parameters()) * 4;
      const double mine = static_cast<double>(memory_stats(*model).parameter_bytes);
      print_rank("tp=", tp, ": parameter bytes per rank ", mine, " of ", full, " (", mine / full, ")");
      EXPECT_LT(mine, full * (1.0 / tp + 0.1));
    }
    const auto got = train(model);
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "loss, step " << i;
      EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-5 * ref.norms[i]) << "gradient norm, step " << i;
    }
    for (const auto& [name, value] : gathered_parameters(*model)) {
      EXPECT_TRUE(tensors_equal(value, ref_file.read(name), 1e-5, 1e-6)) << name;
    }
    if (level == 3 && tp == 2 && world_size() == 2) {
      save(*model, dir() + "/from_tp2.safetensors");
      torch::NoGradGuard no_grad;
      const double loss = model->loss(batch(0)).item<double>();
      if (runtime().rank() == 0) std::ofstream(dir() + "/from_tp2_loss.txt") << c10::str(loss);
    }
  }
}

TEST(TpGpt, FileFromTp2Loads) {
  ASSERT_FALSE(dir().empty()) << "set ZTRAIN_TP_DIR";
  const auto path = dir() + "/from_tp2.safetensors";
  ASSERT_TRUE(std::filesystem::exists(path)) << "run TpGpt.MatchesSingleProcess at tp=2 first";
  const ckpt::SafetensorsReader file(path);
  for (int level : {0, 3}) {
    Gpt model(kConfig, {.zero_level = level});
    load(*model, path);
    int64_t count = 0;
    for (const auto& [name, value] : gathered_parameters(*model)) {
      EXPECT_TRUE(tensors_equal(value, file.read(name))) << name;  // bit-identical full tensors
      ++count;
    }
    EXPECT_EQ(count, static_cast<int64_t>(file.entries().size()));
    // And the model computes with them what the tp=2 model did.
    ASSERT_EQ(runtime().dp().size(), 1);
    torch::NoGradGuard no_grad;
    const double loss = model->loss(batch(0)).item<double>();
    double ref = 0;
    std::ifstream(dir() + "/from_tp2_loss.txt") >> ref;
    EXPECT_NEAR(loss, ref, 1e-5 * ref);
  }
}

}  // namespace tp_gpt_test
}  // namespace ztrain::test
