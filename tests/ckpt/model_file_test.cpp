// Model files: saved from sharded models at any level and world size, loaded at any level and
// world size and into plain libtorch models, with clear errors for files that do not fit. The
// sharded models live on the runtime's device (a CUDA device in the .cuda variants); files and
// the plain libtorch model are on the host.

#include "../zero/zero_model.h"
#include "test_util.h"

#include <filesystem>

namespace ztrain::test {
namespace model_file_test {

/// A path every rank agrees on, in a directory all ranks of this host share.
std::string shared_path(const std::string& stem) {
  auto dir = std::filesystem::temp_directory_path() / "ztrain_model_file_test";
  std::string unique;
  if (runtime().rank() == 0) {
    std::filesystem::create_directories(dir);
    unique = (dir / c10::str(stem, "_", ::getpid(), ".safetensors")).string();
  }
  return runtime().world().broadcast_bytes(unique, 0);
}

ZeroModel trained_model(int level) {
  ModelConfig c;
  ZeroModel model(c, BlockOptions{.zero_level = level, .use_checkpoint = false}, level);
  init_parameters(*model, {.seed = 3});
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto tokens = batch_tokens(runtime().dp().rank(), 2, 6, c.vocab).to(runtime().device());
  lm_loss(model(tokens), tokens).backward();
  opt.step();
  return model;
}

void expect_same(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                 const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(a[i].second.cpu().equal(b[i].second.cpu())) << a[i].first;
  }
}

class ModelFile : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ModelFile, RoundTripsAcrossLevelsAndIntoAPlainModel) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto [level, parallel] = GetParam();
  auto model = trained_model(level);
  const auto want = gathered_parameters(*model);
  const auto path = shared_path(c10::str("roundtrip", level, parallel));
  save(*model, path, {.parallel = parallel});

  expect_same(ckpt::load_safetensors(path), want);  // the file itself, in model order

  ZeroModel other(ModelConfig{}, BlockOptions{.zero_level = 3 - level}, 3 - level);
  load(*other, path);
  expect_same(gathered_parameters(*other), want);

  RefModel plain(ModelConfig{});
  load(*plain, path);
  std::vector<std::pair<std::string, torch::Tensor>> plain_params;
  for (const auto& p : plain->named_parameters()) plain_params.emplace_back(p.key(), p.value().detach());
  expect_same(plain_params, want);

  // Training goes on from the loaded values exactly as from the saved ones.
  auto tokens = batch_tokens(7, 2, 6, 32).to(runtime().device());
  EXPECT_TRUE(other(tokens).equal(model(tokens)));
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Levels, ModelFile,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return c10::str("level", std::get<0>(info.param),
                                           std::get<1>(info.param) ? "_parallel" : "_gathered");
                         });

TEST(ModelFileErrors, NameTheProblem) {
  auto model = trained_model(3);
  const auto path = shared_path("errors");
  save(*model, path);
  EXPECT_NE(error_message([&] { load(*model, path + ".missing"); }).find(path + ".missing"), std::string::npos);

  ZeroModel wider(ModelConfig{.dim = 8}, BlockOptions{.zero_level = 3}, 3);
  const auto shape = error_message([&] { load(*wider, path); });
  EXPECT_NE(shape.find("wte.weight"), std::string::npos) << shape;
  EXPECT_NE(shape.find("shape"), std::string::npos) << shape;

  ZeroModel shallower(ModelConfig{.layers = 2}, BlockOptions{.zero_level = 2}, 2);
  EXPECT_NE(error_message([&] { load(*shallower, path); }).find("layers.2."), std::string::npos);
  EXPECT_NO_THROW(load(*shallower, path, {.strict = false}));

  ZeroModel deeper(ModelConfig{.layers = 4}, BlockOptions{.zero_level = 1}, 1);
  EXPECT_NE(error_message([&] { load(*deeper, path); }).find("has no tensor 'layers.3."), std::string::npos);
  synchronize();
  if (runtime().rank() == 0) std::filesystem::remove(path);
}

// A file saved at one world size loads at another: run with ZTRAIN_CROSS_FILE set, first at 4
// ranks (which save), then at 1, 2 and 3 (which load and compare with the file's contents).
TEST(ModelFileAcrossWorldSizes, SaveAtFourLoadAtAny) {
  const char* file = std::getenv("ZTRAIN_CROSS_FILE");
  ASSERT_NE(file, nullptr) << "set ZTRAIN_CROSS_FILE";
  if (world_size() == 4) {
    save(*trained_model(3), file);
    return;
  }
  ASSERT_TRUE(std::filesystem::exists(file)) << file << " was not written by the 4-rank run";
  for (int level : {1, 2, 3}) {
    ZeroModel model(ModelConfig{}, BlockOptions{.zero_level = level}, level);
    load(*model, file);
    expect_same(gathered_parameters(*model), ckpt::load_safetensors(file));
  }
}

}  // namespace model_file_test
}  // namespace ztrain::test
