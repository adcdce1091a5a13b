// Training checkpoints: exact resume, atomic publication, corruption detected by name. The model
// trains on the runtime's device (a CUDA device in the .cuda variants, whose dropout masks come
// from the device's generator: a resume restores it).

#include "../../src/ckpt/sha256.h"
#include "../zero/zero_model.h"
#include "test_util.h"

#include <filesystem>
#include <fstream>
#include <tuple>

namespace ztrain::test {
namespace checkpoint_test {

namespace fs = std::filesystem;

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(detail::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(detail::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(detail::sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

struct Trainer {
  ZeroModel model{ModelConfig{.dropout = 0.1}, BlockOptions{.zero_level = 3}, 2};
  optim::AdamW opt{model->parameters(), optim::AdamOptions(1e-2)};
  optim::OptimManager mgr{*model, LossScaler::dynamic({.initial_scale = 1024, .growth_interval = 3})};
  int64_t step = 0;
  explicit Trainer(uint64_t seed) {
    init_parameters(*model, {.seed = seed});
    mgr.add_optimizer(opt, std::make_shared<lr_scheduler::Cosine>(
                               LRSchedulerOptions{.peak_lr = 1e-2, .warmup_steps = 2, .total_steps = 30}));
  }
  TrainingState state() { return {*model, opt, mgr}; }
  void train(int n) {
    const int dp = runtime().dp().size(), r = runtime().dp().rank(), local = 4 / dp;
    for (int i = 0; i < n; ++i, ++step) {
      auto tokens = batch_tokens(step, 4, 8, 32).slice(0, r * local, (r + 1) * local).to(runtime().device());
      mgr.zero_grad();
      mgr.backward(lm_loss(model(tokens), tokens));  // with dropout: the generator state matters
      mgr.step();
    }
  }
};

TEST(Checkpoint, ResumeContinuesBitForBit) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto root = shared_temp_dir("ckpt_resume");
  torch::manual_seed(100 + rank());
  Trainer reference(1);
  reference.train(5);
  const auto dir = save_checkpoint(root, reference.step, reference.state(), R"({"data": {"position": 5}})");
  EXPECT_EQ(latest_checkpoint(root), dir);
  reference.train(5);

  torch::manual_seed(999);  // another generator state: the checkpoint restores it
  Trainer resumed(7);
  const auto info = load_checkpoint(*latest_checkpoint(root), resumed.state());
  EXPECT_EQ(info.step, 5);
  EXPECT_EQ(info.world_size, world_size());
  EXPECT_EQ(info.extra_json, R"({"data":{"position":5}})");
  resumed.step = info.step;
  resumed.train(5);
  const auto want = gathered_parameters(*reference.model), got = gathered_parameters(*resumed.model);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].second.equal(want[i].second)) << want[i].first;
  EXPECT_EQ(resumed.mgr.state(), reference.mgr.state());
  synchronize();
  if (rank() == 0) fs::remove_all(root);
}

// The optimizer state is written while training goes on; the checkpoint is published only after
// that file is complete, and resumes like a synchronous one.
TEST(Checkpoint, AsyncSaveResumesBitForBitAndPublishesLast) {
  ASSERT_EQ(world_size(), expected_world_size());
  const auto root = shared_temp_dir("ckpt_async");
  torch::manual_seed(100 + rank());
  Trainer reference(1);
  reference.train(5);
  const auto want_dir = fs::path(root) / "step-00000005";
  bool published_early = true, optimizer_file_ready = false;
  CheckpointOptions options{.before_publish = [&] {
    published_early = fs::exists(want_dir) || latest_checkpoint(root).has_value();
    optimizer_file_ready = false;
    for (const auto& d : fs::directory_iterator(root)) {
      if (d.path().filename().string().starts_with(".step-00000005.tmp")) {
        const auto file = (d.path() / "optimizer.safetensors").string();
        optimizer_file_ready = !ckpt::SafetensorsReader(file).entries().empty();
      }
    }
  }};
  auto pending =
      save_checkpoint_async(root, reference.step, reference.state(), R"({"data": {"position": 5}})", options);
  EXPECT_EQ(pending.path(), want_dir.string());
  reference.train(5);  // steps while the optimizer file is written
  pending.wait();
  EXPECT_FALSE(published_early);
  EXPECT_TRUE(optimizer_file_ready);
  EXPECT_EQ(latest_checkpoint(root), want_dir.string());

  torch::manual_seed(999);
  Trainer resumed(7);
  const auto info = load_checkpoint(want_dir.string(), resumed.state());
  EXPECT_EQ(info.step, 5);
  EXPECT_EQ(info.extra_json, R"({"data":{"position":5}})");
  resumed.step = info.step;
  resumed.train(5);
  const auto want = gathered_parameters(*reference.model), got = gathered_parameters(*resumed.model);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i].second.equal(want[i].second)) << want[i].first;
  EXPECT_EQ(resumed.mgr.state(), reference.mgr.state());

  // A publication that fails on rank 0 (its optimizer file vanished) is rethrown at wait() on
  // every rank and publishes nothing.
  auto failing = save_checkpoint_async(root, 11, reference.state(), "{}", {.before_publish = [&] {
    if (rank() != 0) return;
    for (const auto& d : fs::directory_iterator(root)) {
      if (d.path().filename().string().starts_with(".step-00000011.tmp")) {
        fs::remove(d.path() / "optimizer.safetensors");
      }
    }
  }});
  reference.train(1);
  const auto msg = error_message([&] { failing.wait(); });
  EXPECT_NE(msg.find("optimizer.safetensors"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(fs::path(root) / "step-00000011"));
  EXPECT_EQ(latest_checkpoint(root), want_dir.string());
  synchronize();
  if (rank() == 0) fs::remove_all(root);
}

TEST(Checkpoint, CorruptOrMissingFilesAreNamed) {
  const auto root = shared_temp_dir("ckpt_corrupt");
  Trainer t(1);
  t.train(1);
  const auto dir = save_checkpoint(root, 1, t.state());
  synchronize();
  if (rank() == 0) {
    std::fstream f(dir + "/optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x5a');
  }
  synchronize();
  const auto msg = error_message([&] { load_checkpoint(dir, t.state()); });
  EXPECT_NE(msg.find("optimizer.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
  // verify_checkpoint, for readers that do not load through load_checkpoint, says the same.
  EXPECT_EQ(error_message([&] { verify_checkpoint(dir); }), msg);
  // The manifest checks itself: a changed field, or its checksum's own name changed.
  for (const auto& [from, to, says] : {std::tuple<std::string, std::string, std::string>{
                                           "\"step\": 1", "\"step\": 3", "its content does not match its own SHA-256"},
                                       {"manifest_sha256", "manifest_sha257", "its own SHA-256 is missing"}}) {
    synchronize();
    std::string text;
    if (rank() == 0) {
      std::ifstream in(dir + "/manifest.json");
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      ASSERT_NE(text.find(from), std::string::npos) << text;
      std::ofstream(dir + "/manifest.json") << std::string(text).replace(text.find(from), from.size(), to);
      const auto m = error_message([&] { verify_checkpoint(dir); });
      EXPECT_NE(m.find("manifest.json' is corrupt: " + says), std::string::npos) << m;
      std::ofstream(dir + "/manifest.json") << text;
    }
  }
  const auto second = save_checkpoint(root, 2, t.state());
  synchronize();
  if (rank() == 0) fs::remove(second + "/rng.safetensors");
  synchronize();
  EXPECT_NE(error_message([&] { load_checkpoint(second, t.state()); }).find("rng.safetensors' is missing"),
            std::string::npos);
  synchronize();
  if (rank() == 0) fs::remove_all(root);
}

TEST(Checkpoint, IncompleteSavesAreIgnoredAndOldOnesPruned) {
  const auto root = shared_temp_dir("ckpt_atomic");
  Trainer t(1);
  for (int s : {1, 2, 3}) save_checkpoint(root, s, t.state(), "{}", {.keep_last = 2});
  synchronize();
  if (rank() == 0) {
    EXPECT_FALSE(fs::exists(root + "/step-00000001"));
    EXPECT_TRUE(fs::exists(root + "/step-00000002"));
    // A save killed before its rename, and one killed before `latest` moved on.
    fs::create_directories(root + "/.step-00000004.tmp-1");
    fs::create_directories(root + "/step-00000005");  // no manifest: incomplete
    EXPECT_EQ(latest_checkpoint(root), root + "/step-00000003");
    std::ofstream(root + "/latest") << "step-00000009\n";  // names a checkpoint that is gone
    EXPECT_EQ(latest_checkpoint(root), root + "/step-00000003");
    // Complete ones only, newest first, each verifying, with the step its manifest records.
    EXPECT_EQ(checkpoints(root), (std::vector<std::string>{root + "/step-00000003", root + "/step-00000002"}));
    EXPECT_EQ(verify_checkpoint(root + "/step-00000002").step, 2);
  }
  EXPECT_EQ(latest_checkpoint(root + "/nothing-here"), std::nullopt);
  EXPECT_TRUE(checkpoints(root + "/nothing-here").empty());
  synchronize();
  if (rank() == 0) fs::remove_all(root);
}

}  // namespace checkpoint_test
}  // namespace ztrain::test
