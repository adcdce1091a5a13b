// ztrain-gpt tokenizers: lossy UTF-8 as Rust's, the BPE trainer and any bytes through it,
// SentencePiece byte lengths, and token corpora through the token-file cache. Equality with the
// Hugging Face and SentencePiece libraries is tokenizer_test.sh's.
#include "data.h"
#include "test_util.h"
#include "tokenizer.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <numeric>

namespace ztrain::gpt_app {
namespace {

namespace fs = std::filesystem;
using ztrain::test::error_message;

constexpr const char* kFffd = "\xEF\xBF\xBD";

TEST(Utf8Lossy, ReplacesEachMaximalInvalidSubpartAsRustDoes) {
  EXPECT_EQ(utf8_lossy("plain ascii"), "plain ascii");
  EXPECT_EQ(utf8_lossy("\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80"), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");  // é € 😀
  EXPECT_EQ(utf8_lossy("a\x80z"), std::string("a") + kFffd + "z");                // a lone continuation byte
  EXPECT_EQ(utf8_lossy("\xE2\x82z"), std::string(kFffd) + "z");                    // a cut sequence: one
  EXPECT_EQ(utf8_lossy("\xC0\x80"), std::string(kFffd) + kFffd);                  // overlong: each byte
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), std::string(kFffd) + kFffd + kFffd);      // a surrogate
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), std::string(kFffd) + kFffd + kFffd + kFffd);  // beyond U+10FFFF
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), kFffd);                                    // cut at the end
}

class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ztrain_tokenizer_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path write(const std::string& name, const std::string& bytes) const {
    const auto p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  /// A byte-level BPE of `vocab` tokens learnt from `text`, as a tokenizer.json in the directory.
  std::shared_ptr<const Tokenizer> bpe(const std::string& text, int64_t vocab = 300) const {
    const auto path = write("tokenizer.json", train_bpe({text}, {.vocab_size = vocab}));
    return load_tokenizer(path.string());
  }
  static std::string text() {
    std::string s;
    for (int i = 0; i < 200; ++i) s += "the cat sat on the mat; the hat is on the cat " + std::to_string(i % 7) + "\n";
    return s;
  }
  fs::path dir_;
};

TEST_F(TokenizerFiles, TrainBpeMergesTheMostFrequentPairFirstAndFillsTheVocabulary) {
  const auto j = nlohmann::json::parse(train_bpe({std::string(100, 'a') + " ab ab"}, {.vocab_size = 260}));
  EXPECT_EQ(j.at("model").at("merges")[0], (nlohmann::json{"a", "a"}));
  EXPECT_EQ(j.at("added_tokens")[0].at("content"), "<|endoftext|>");
  const auto tok = bpe(text());
  EXPECT_EQ(tok->kind(), "bpe");
  // Merging stops early when no pair is seen twice: this text has fewer.
  EXPECT_GT(tok->vocab_size(), 257);
  EXPECT_LE(tok->vocab_size(), 300);
  EXPECT_LT(tok->encode(text()).size(), text().size() / 3);  // it compresses what it learnt from
  EXPECT_NE(error_message([] { train_bpe({"x"}, {.vocab_size = 100}); }).find("at least 257"), std::string::npos);
}

TEST_F(TokenizerFiles, AnyBytesRoundTripAndByteLengthsAddUpToTheText) {
  const auto tok = bpe(text());
  const std::string bytes = text() + "\xFF\xFE invalid \xC3( utf-8 \xE2\x82 and \x00 nul " + "caf\xC3\xA9";
  const auto ids = tok->encode(bytes);
  EXPECT_EQ(tok->decode(ids), bytes);
  const auto lengths = tok->byte_lengths();
  int64_t sum = 0;
  for (auto id : ids) sum += lengths.at(id);
  EXPECT_EQ(sum, static_cast<int64_t>(bytes.size()));
  // The special token is cut out of the text, is one id, counts no bytes and decodes to nothing.
  const auto with_special = tok->encode("cat<|endoftext|>hat");
  EXPECT_EQ(std::count(with_special.begin(), with_special.end(), 0), 1);
  EXPECT_EQ(lengths.at(0), 0);
  EXPECT_EQ(tok->decode(with_special), "cathat");
  EXPECT_NE(error_message([&] { tok->decode({static_cast<int32_t>(tok->vocab_size())}); }).find("outside the vocabulary"),
            std::string::npos);
}

TEST_F(TokenizerFiles, BytesAreTheDefault) {
  const auto tok = load_tokenizer("");
  EXPECT_EQ(tok->kind(), "bytes");
  EXPECT_EQ(tok->vocab_size(), 256);
  EXPECT_EQ(tok->encode("\x01\xFF"), (std::vector<int32_t>{1, 255}));
  EXPECT_EQ(tok->decode({104, 105}), "hi");
}

TEST_F(TokenizerFiles, SentencePieceByteLengthsCountTheTextAndItsWordMark) {
  const auto corpus = write("corpus.txt", text());
  train_sentencepiece({corpus.string()}, (dir_ / "sp").string(), 320, "unigram");  // 256 byte pieces and more
  const auto tok = load_tokenizer((dir_ / "sp.model").string());
  EXPECT_EQ(tok->kind(), "sentencepiece");
  EXPECT_GT(tok->vocab_size(), 256);
  EXPECT_LE(tok->vocab_size(), 320);
  const std::string line = "the cat sat\non the mat: \xC3\xA9!";
  const auto ids = tok->encode(line);
  EXPECT_EQ(tok->decode(ids), line);
  const auto lengths = tok->byte_lengths();
  int64_t sum = 0;
  for (auto id : ids) sum += lengths.at(id);
  // The leading word mark SentencePiece adds is counted as the space it stands for.
  EXPECT_EQ(sum, static_cast<int64_t>(line.size()) + 1);
}

TEST_F(TokenizerFiles, ATokenCorpusIsTokenizedOnceAndMapped) {
  const auto tok = bpe(text());
  write("data/a.txt", text());
  write("data/b.txt", "the end of the text\n");
  const auto cache = (dir_ / "cache").string();
  const auto c = Corpus::load((dir_ / "data").string(), *tok, 0.1, cache);
  auto want = tok->encode(text());
  const auto tail = tok->encode("the end of the text\n");
  want.insert(want.end(), tail.begin(), tail.end());
  ASSERT_EQ(c.size(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(c.vocab_size(), tok->vocab_size());
  EXPECT_EQ(c.validation_size(), std::llround(0.1 * static_cast<double>(want.size())));
  std::vector<int64_t> got(c.size());
  c.copy(0, c.size(), got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));
  ASSERT_TRUE(fs::exists(c.cache_file()));
  EXPECT_EQ(fs::path(c.cache_file()).parent_path(), fs::path(cache));

  // Loaded again, it maps the same file; other text gets a file of its own.
  const auto written = fs::last_write_time(c.cache_file());
  const auto again = Corpus::load((dir_ / "data").string(), *tok, 0.1, cache);
  EXPECT_EQ(again.cache_file(), c.cache_file());
  EXPECT_EQ(fs::last_write_time(c.cache_file()), written);
  write("data/b.txt", "another end\n");
  EXPECT_NE(Corpus::load((dir_ / "data").string(), *tok, 0.1, cache).cache_file(), c.cache_file());

  // Batches of a token corpus hold its ids.
  Sampler s(c.train_size(), 8, 2, 0, 1, 5);
  const auto batch = s.next(c);
  EXPECT_LT(batch.max().item<int64_t>(), tok->vocab_size());

  // A damaged token file is named, not read.
  fs::resize_file(c.cache_file(), fs::file_size(c.cache_file()) - 2);
  write("data/b.txt", "the end of the text\n");
  const auto msg = error_message([&] { Corpus::load((dir_ / "data").string(), *tok, 0.1, cache); });
  EXPECT_NE(msg.find(c.cache_file()), std::string::npos) << msg;
  EXPECT_NE(msg.find("delete it"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ztrain::gpt_app
