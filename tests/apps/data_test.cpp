// ztrain-gpt data: byte and token corpora from files and directories (the token cache), the data-parallel sampler
// (determinism, disjoint ranks, dp-size independence, exact resume) and validation windows.
#include "data.h"
#include "test_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

namespace ztrain::gpt_app {
namespace {

namespace fs = std::filesystem;
using ztrain::test::error_message;
using ztrain::test::tensors_equal;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            c10::str("ztrain_gpt_data_test_", ::getpid(), "_", info->test_suite_name(), "_", info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  fs::path write(const std::string& rel, const std::string& bytes) const {
    const auto p = path_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

/// n bytes that rarely repeat a window: different windows have different contents.
std::string random_bytes(int64_t n, uint32_t seed = 7) {
  std::mt19937 gen(seed);
  std::string s(static_cast<size_t>(n), '\0');
  for (auto& c : s) c = static_cast<char>(gen() & 0xFF);
  return s;
}

std::string tensor_bytes(const torch::Tensor& row) {
  std::string s;
  for (int64_t i = 0; i < row.numel(); ++i) s.push_back(static_cast<char>(row[i].item<int64_t>()));
  return s;
}

/// Tokens [begin, begin + n) of a byte corpus, as bytes.
std::string corpus_bytes(const Corpus& c, int64_t begin, int64_t n) {
  std::vector<int64_t> ids(n);
  c.copy(begin, n, ids.data());
  return std::string(ids.begin(), ids.end());
}

// ---- corpus ----------------------------------------------------------------------------------

TEST(Corpus, LoadsAFileAndSplitsOffTheLastFraction) {
  TempDir dir;
  const auto text = random_bytes(1000);
  const auto file = dir.write("corpus.txt", text);
  auto c = Corpus::load(file.string(), 0.05);
  EXPECT_EQ(c.size(), 1000);
  EXPECT_EQ(c.train_size(), 950);
  EXPECT_EQ(c.validation_size(), 50);
  EXPECT_EQ(corpus_bytes(c, 0, 950), text.substr(0, 950));
  EXPECT_EQ(corpus_bytes(c, c.train_size(), 50), text.substr(950));
  EXPECT_EQ(c.files(), std::vector<std::string>{file.string()});

  auto none = Corpus::load(file.string(), 0.0);
  EXPECT_EQ(none.train_size(), 1000);
  EXPECT_EQ(none.validation_size(), 0);
  EXPECT_EQ(Corpus::load(file.string(), 0.333).validation_size(), 333);
}

TEST(Corpus, ConcatenatesADirectoryInPathOrderSkippingHiddenEntries) {
  TempDir dir;
  dir.write("b.txt", "BBB");
  dir.write("a.txt", "AAA");
  dir.write("sub/c.txt", "CCC");
  dir.write("aa/z.txt", "ZZZ");
  dir.write(".hidden", "HHH");
  dir.write(".git/objects/x", "XXX");
  dir.write("sub/.swp", "SSS");
  auto c = Corpus::load(dir.path().string(), 0.0);
  EXPECT_EQ(corpus_bytes(c, 0, c.size()), "AAAZZZBBBCCC");
  const std::vector<std::string> want = {(dir.path() / "a.txt").string(), (dir.path() / "aa/z.txt").string(),
                                         (dir.path() / "b.txt").string(), (dir.path() / "sub/c.txt").string()};
  EXPECT_EQ(c.files(), want);
  EXPECT_EQ(c.source(), dir.path().string());
}

TEST(Corpus, ClearErrors) {
  TempDir dir;
  EXPECT_NE(error_message([&] { Corpus::load((dir.path() / "nope.txt").string()); }).find("does not exist"),
            std::string::npos);
  const auto empty = dir.write("empty/e.txt", "");
  EXPECT_NE(error_message([&] { Corpus::load(empty.string()); }).find("is empty"), std::string::npos);
  EXPECT_NE(error_message([&] { Corpus::load(empty.parent_path().string()); }).find("is empty"),
            std::string::npos);
  dir.write("hidden_only/.a", "abc");
  EXPECT_NE(error_message([&] { Corpus::load((dir.path() / "hidden_only").string()); }).find("no regular files"),
            std::string::npos);
  fs::create_directories(dir.path() / "nothing");
  EXPECT_NE(error_message([&] { Corpus::load((dir.path() / "nothing").string()); }).find("no regular files"),
            std::string::npos);
  const auto file = dir.write("x.txt", random_bytes(100));
  EXPECT_NE(error_message([&] { Corpus::load(file.string(), 1.0); }).find("validation_fraction"),
            std::string::npos);
  EXPECT_NE(error_message([&] { Corpus::load(file.string(), -0.1); }).find("validation_fraction"),
            std::string::npos);

  auto c = Corpus::load(file.string(), 0.1);  // 90 + 10 bytes
  c.check_sequence_length(9);
  EXPECT_NE(error_message([&] { c.check_sequence_length(10); }).find("validation split"), std::string::npos);
  EXPECT_NE(error_message([&] { c.check_sequence_length(90); }).find("training split"), std::string::npos);
  EXPECT_NE(error_message([&] { Sampler(c.train_size(), 90, 1, 0, 1, 0); }).find("fewer than the global batch"),
            std::string::npos);
  EXPECT_NE(error_message([&] { Sampler(c.train_size(), 9, 5, 0, 2, 0); }).find("fewer than the global batch"),
            std::string::npos);
  auto no_val = Corpus::load(file.string(), 0.0);
  EXPECT_NE(error_message([&] { validation_batches(no_val, 8, 2); }).find("no validation split"),
            std::string::npos);
  EXPECT_NE(error_message([&] { Sampler(100, 8, 1, 2, 2, 0); }).find("dp_rank"), std::string::npos);
}

// ---- permutation -----------------------------------------------------------------------------

TEST(IndexPermutation, IsABijectionForAnySize) {
  for (int64_t n : {1, 2, 3, 17, 64, 1000, 1023, 4097}) {
    detail::IndexPermutation p(n, 42);
    std::vector<bool> seen(n, false);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = p(i);
      ASSERT_GE(v, 0);
      ASSERT_LT(v, n);
      ASSERT_FALSE(seen[v]) << "n " << n << ": " << v << " twice";
      seen[v] = true;
    }
  }
  detail::IndexPermutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    fixed += a(i) == i;
  }
  EXPECT_LT(same, 20);  // another key, another order
  EXPECT_LT(fixed, 20);  // and it does shuffle
}

// ---- sampler ---------------------------------------------------------------------------------

constexpr int64_t kSeq = 15;  // windows of 16

Corpus sampler_corpus(int64_t n = 1000) { return Corpus::from_bytes(random_bytes(n), 0.0, "test"); }

/// Global batches of `steps` steps, the ranks' batches concatenated in rank order.
std::vector<torch::Tensor> global_batches(const Corpus& c, int dp, int64_t per_rank, int64_t steps,
                                          uint64_t seed = 11, std::optional<SamplerState> resume = std::nullopt) {
  std::vector<Sampler> ranks;
  for (int r = 0; r < dp; ++r) {
    ranks.emplace_back(c.train_size(), kSeq, per_rank, r, dp, seed);
    if (resume) ranks.back().set_state(*resume);
  }
  std::vector<torch::Tensor> out;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> parts;
    for (auto& r : ranks) parts.push_back(r.next(c));
    out.push_back(torch::cat(parts));
  }
  return out;
}

TEST(Sampler, BatchesAreWindowsOfTheTrainingSplit) {
  const auto c = Corpus::from_bytes(random_bytes(1001), 0.0, "test");
  Sampler s(c.train_size(), kSeq, 4, 1, 3, 5);
  EXPECT_EQ(s.windows_per_epoch(), 1001 / 16);
  EXPECT_EQ(s.steps_per_epoch(), (1001 / 16) / 12);
  for (int step = 0; step < 12; ++step) {
    const auto starts = s.window_starts(step);
    const auto b = s.next(c);
    ASSERT_EQ(b.sizes(), (c10::IntArrayRef{4, 16}));
    ASSERT_EQ(b.scalar_type(), torch::kInt64);
    for (int i = 0; i < 4; ++i) {
      ASSERT_GE(starts[i], 0);
      ASSERT_LE(starts[i] + 16, c.train_size());
      EXPECT_EQ(tensor_bytes(b[i]), corpus_bytes(c, starts[i], 16));
    }
  }
  EXPECT_EQ(s.step(), 12);
}

TEST(Sampler, IsDeterministicAndDependsOnTheSeed) {
  const auto c = sampler_corpus();
  const auto a = global_batches(c, 2, 3, 10, 1), b = global_batches(c, 2, 3, 10, 1), d = global_batches(c, 2, 3, 10, 2);
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(tensors_equal(a[i], b[i])) << "step " << i;
    differ += !a[i].equal(d[i]);
  }
  EXPECT_EQ(differ, 10);
  // Steps differ from each other too.
  EXPECT_FALSE(a[0].equal(a[1]));
}

TEST(Sampler, RanksGetDisjointWindowsWithinAStep) {
  const int64_t n = 1000, window = kSeq + 1;
  const int dp = 4;
  std::vector<Sampler> ranks;
  for (int r = 0; r < dp; ++r) ranks.emplace_back(n, kSeq, 3, r, dp, 9);
  const int64_t spe = ranks[0].steps_per_epoch();
  for (int64_t step = 0; step < 3 * spe + 1; ++step) {
    std::vector<int64_t> all;
    for (const auto& r : ranks) {
      const auto s = r.window_starts(step);
      all.insert(all.end(), s.begin(), s.end());
    }
    std::sort(all.begin(), all.end());
    for (size_t i = 1; i < all.size(); ++i) {
      ASSERT_GE(all[i] - all[i - 1], window) << "step " << step << ": windows at " << all[i - 1] << " and " << all[i]
                                            << " overlap";
    }
  }
}

TEST(Sampler, AnEpochVisitsEveryWindowOnceThenReshuffles) {
  // 64 windows of 16 = 1024 tokens plus a slack of 5 for the per-epoch offset; G = 8: 8 steps/epoch.
  const int64_t n = 64 * 16 + 5;
  Sampler s(n, kSeq, 8, 0, 1, 3);
  ASSERT_EQ(s.steps_per_epoch(), 8);
  std::vector<std::vector<int64_t>> epochs(3);
  std::set<int64_t> offsets;
  for (int64_t step = 0; step < 24; ++step) {
    const auto starts = s.window_starts(step);
    epochs[step / 8].insert(epochs[step / 8].end(), starts.begin(), starts.end());
  }
  for (auto& e : epochs) {
    const int64_t offset = *std::min_element(e.begin(), e.end());
    offsets.insert(offset);
    ASSERT_LE(offset, 5);
    std::set<int64_t> windows;
    for (int64_t start : e) {
      ASSERT_EQ((start - offset) % 16, 0);
      windows.insert((start - offset) / 16);
    }
    EXPECT_EQ(windows.size(), 64u);  // all windows, each once
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
}

TEST(Sampler, GlobalBatchDoesNotDependOnDpSize) {
  const auto c = sampler_corpus();  // 62 windows, G = 8: 7 steps per epoch; 20 steps cross two epochs
  const auto one = global_batches(c, 1, 8, 20);
  const auto two = global_batches(c, 2, 4, 20);
  const auto four = global_batches(c, 4, 2, 20);
  const auto eight = global_batches(c, 8, 1, 20);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(tensors_equal(two[i], one[i])) << "step " << i;
    EXPECT_TRUE(tensors_equal(four[i], one[i])) << "step " << i;
    EXPECT_TRUE(tensors_equal(eight[i], one[i])) << "step " << i;
  }
}

SamplerState through_json(const SamplerState& s) {
  const std::string text = nlohmann::json(s).dump();
  return nlohmann::json::parse(text).get<SamplerState>();
}

TEST(Sampler, ResumesExactlyAtTheSameAndAnotherDpSize) {
  const auto c = sampler_corpus();
  const auto uninterrupted = global_batches(c, 2, 4, 25);

  // Six steps at dp 2, then the state of rank 0 (every rank's state is the same).
  std::vector<Sampler> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back(c.train_size(), kSeq, 4, r, 2, 11);
  for (int step = 0; step < 6; ++step) {
    for (auto& r : ranks) r.next(c);
  }
  EXPECT_EQ(ranks[0].state(), ranks[1].state());
  const auto saved = through_json(ranks[0].state());
  EXPECT_EQ(saved, ranks[0].state());
  EXPECT_EQ(saved.step, 6);
  EXPECT_EQ(saved.global_batch, 8);

  for (auto [dp, per_rank] : {std::pair{2, 4}, {1, 8}, {4, 2}}) {
    const auto resumed = global_batches(c, dp, per_rank, 19, 11, saved);
    for (size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_TRUE(tensors_equal(resumed[i], uninterrupted[6 + i])) << "dp " << dp << " step " << 6 + i;
    }
  }
  // A state taken later, in another epoch.
  Sampler late(c.train_size(), kSeq, 8, 0, 1, 11);
  for (int step = 0; step < 17; ++step) late.next(c);
  EXPECT_EQ(late.state().epoch, 2);
  const auto resumed = global_batches(c, 2, 4, 3, 11, through_json(late.state()));
  for (size_t i = 0; i < resumed.size(); ++i) EXPECT_TRUE(tensors_equal(resumed[i], uninterrupted[17 + i]));
}

TEST(Sampler, RefusesAStateItCannotResumeExactly) {
  Sampler s(1000, kSeq, 4, 0, 2, 11);
  auto st = s.state();
  EXPECT_EQ(st, (SamplerState{.step = 0, .epoch = 0, .seed = 11, .global_batch = 8, .seq = kSeq, .num_tokens = 1000}));
  auto bad = st;
  bad.seed = 12;
  EXPECT_NE(error_message([&] { s.set_state(bad); }).find("seed"), std::string::npos);
  bad = st;
  bad.global_batch = 4;
  EXPECT_NE(error_message([&] { s.set_state(bad); }).find("global batch"), std::string::npos);
  bad = st;
  bad.seq = 16;
  EXPECT_NE(error_message([&] { s.set_state(bad); }).find("sequence length"), std::string::npos);
  bad = st;
  bad.num_tokens = 999;
  EXPECT_NE(error_message([&] { s.set_state(bad); }).find("training split"), std::string::npos);
  bad = st;
  bad.step = 30;  // epoch 4, not 0
  EXPECT_NE(error_message([&] { s.set_state(bad); }).find("inconsistent"), std::string::npos);
  EXPECT_NE(error_message([&] { nlohmann::json{{"step", 1}}.get<SamplerState>(); }).find("epoch"), std::string::npos);
  const auto c = sampler_corpus(1200);
  EXPECT_NE(error_message([&] { s.next(c); }).find("1000"), std::string::npos);
}

// ---- validation ------------------------------------------------------------------------------

TEST(ValidationBatches, SequentialWindowsCoverEveryTargetOnce) {
  const auto text = random_bytes(1000);
  const auto c = Corpus::from_bytes(text, 0.1, "test");  // 100 validation bytes
  const std::string val = text.substr(900);
  const int64_t seq = 8;  // (100 - 1) / 8 = 12 windows: batches of 5, 5, 2
  const auto batches = validation_batches(c, seq, 5);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].size(0), 5);
  EXPECT_EQ(batches[2].size(0), 2);
  std::string targets;
  int64_t row = 0;
  for (const auto& b : batches) {
    ASSERT_EQ(b.size(1), seq + 1);
    ASSERT_EQ(b.scalar_type(), torch::kInt64);
    for (int64_t i = 0; i < b.size(0); ++i, ++row) {
      EXPECT_EQ(tensor_bytes(b[i]), val.substr(row * seq, seq + 1));
      targets += tensor_bytes(b[i]).substr(1);
    }
  }
  EXPECT_EQ(targets, val.substr(1, 12 * seq));
  EXPECT_EQ(validation_batches(c, seq, 5, 2).size(), 2u);
  EXPECT_EQ(validation_batches(c, seq, 5, 0).size(), 0u);
  EXPECT_TRUE(tensors_equal(validation_batches(c, seq, 5, 1)[0], batches[0]));
  // Exactly one window: seq + 1 = 100.
  const auto one = validation_batches(c, 99, 4);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].size(0), 1);
  EXPECT_NE(error_message([&] { validation_batches(c, 100, 4); }).find("validation split"), std::string::npos);
}

}  // namespace
}  // namespace ztrain::gpt_app
