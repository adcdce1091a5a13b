#pragma once
/// Text data for ztrain-gpt: a corpus of tokens (bytes, or the ids of a tokenizer, cached in a
/// memory-mapped token file), a deterministic data-parallel sampler of training windows, and
/// sequential validation windows.
///
/// Tokens stay in their narrowest width in memory (1, 2 or 4 bytes); a batch is widened to int64
/// only when it is made. A batch row holds `seq + 1` tokens: inputs are row[:seq], targets row[1:].
///
///   auto corpus = Corpus::load("data/shakespeare.txt", 0.05);                 // bytes
///   auto corpus = Corpus::load("data/", *load_tokenizer("tok.json"), 0.05, "~/.cache/ztrain/tokens");
///   Sampler sampler(corpus.train_size(), /*seq=*/256, /*batch_per_rank=*/8, dp.rank(), dp.size(),
///                   /*seed=*/1234);
///   sampler.set_state(saved.at("sampler").get<SamplerState>());  // when resuming
///   torch::Tensor batch = sampler.next(corpus);                   // [8, 257] int64
///   auto inputs = batch.narrow(1, 0, 256), targets = batch.narrow(1, 1, 256);
///   nlohmann::json state = sampler.state();                       // into the checkpoint
///   for (const auto& b : validation_batches(corpus, 256, 8, 20)) { ... }
///
/// Nothing here is collective; every rank builds its own corpus and sampler from the same
/// arguments (except dp_rank). None of these objects is thread-safe.

#include "tokenizer.h"

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ztrain::gpt_app {

/// The files of a corpus `path`: itself, or a directory's regular files (recursively, hidden
/// entries skipped) in the order of their paths. Raises ztrain::Error for a missing path or a
/// directory without files.
std::vector<std::filesystem::path> list_corpus(const std::string& path);

/// The tokens of a text corpus, split into a training part and a validation part.
///
/// `path` is a file, or a directory whose regular files (recursively; entries whose name starts
/// with '.' — hidden files and directories — are skipped) are read in the order of their paths.
/// The last `validation_fraction` of the tokens (rounded to a whole token; the training split
/// keeps at least one) is the validation split, the rest the training split. Raises ztrain::Error
/// for a missing path, a directory without files, an empty corpus, or a fraction outside [0, 1).
///
/// With a tokenizer other than bytes, each file is encoded on its own (files in parallel, one
/// thread each, up to the host's cores) and the ids concatenated.
/// The ids are kept in a token file in `cache_dir`, named by the SHA-256 of the tokenizer file and
/// the corpus' bytes: a later load of the same text with the same tokenizer maps that file instead
/// of tokenizing again. The file is written under a temporary name and renamed when complete, so
/// ranks or runs that load at once never see half of it.
///
///   auto corpus = Corpus::load("data/", 0.1);
///   corpus.check_sequence_length(256);  // both splits hold at least one window of 257 tokens
class Corpus {
 public:
  /// Bytes (vocabulary 256) of `path`, as described above.
  static Corpus load(const std::string& path, double validation_fraction = 0.05);
  /// The ids `tokenizer` gives `path`, through the token cache in `cache_dir`.
  static Corpus load(const std::string& path, const Tokenizer& tokenizer, double validation_fraction,
                     const std::string& cache_dir);
  /// A corpus from bytes in memory (`source` names it in messages).
  static Corpus from_bytes(std::string bytes, double validation_fraction = 0.05, std::string source = "<memory>");

  /// Raises ztrain::Error unless the training split holds at least `seq + 1` tokens and the
  /// validation split is empty or holds at least `seq + 1` tokens.
  void check_sequence_length(int64_t seq) const;

  int64_t size() const { return size_; }
  int64_t train_size() const { return train_size_; }
  int64_t validation_size() const { return size_ - train_size_; }
  /// Ids are in [0, vocab_size()).
  int64_t vocab_size() const { return vocab_size_; }
  /// Copies tokens [begin, begin + n) of the corpus (the training split, then the validation
  /// split) into `out`, widened.
  void copy(int64_t begin, int64_t n, int64_t* out) const;
  /// The files read, in order (one entry for a file corpus; empty for from_bytes).
  const std::vector<std::string>& files() const { return files_; }
  /// What the corpus was read from: the path given to load, or from_bytes' `source`.
  const std::string& source() const { return source_; }
  /// The token file mapped, or "" for bytes.
  const std::string& cache_file() const { return cache_file_; }

 private:
  void split(double validation_fraction);

  std::shared_ptr<const void> storage_;  // owns what data_ points into
  const uint8_t* data_ = nullptr;
  int width_ = 1;  // bytes per token
  int64_t size_ = 0, train_size_ = 0, vocab_size_ = 256;
  std::vector<std::string> files_;
  std::string source_, cache_file_;
};

/// Where a Sampler stands: enough to resume it exactly, at the same or another dp_size, and to
/// refuse a resume that could not be exact. Serialises to JSON with to_json/from_json below:
///   {"step": 120, "epoch": 3, "seed": 1234, "global_batch": 16, "seq": 256, "num_tokens": 1000000}
struct SamplerState {
  int64_t step = 0;          // global steps drawn so far
  int64_t epoch = 0;         // the epoch of the next step (derived from step; for reports)
  uint64_t seed = 0;
  int64_t global_batch = 0;  // batch_per_rank * dp_size
  int64_t seq = 0;
  int64_t num_tokens = 0;    // size of the training split
  bool operator==(const SamplerState&) const = default;
};
void to_json(nlohmann::json& j, const SamplerState& s);
void from_json(const nlohmann::json& j, SamplerState& s);

/// Deterministic training batches for `dp_size` data-parallel ranks.
///
/// The training split is cut into W = num_tokens / (seq + 1) non-overlapping windows of seq + 1
/// tokens, shifted by a per-epoch random offset in [0, num_tokens - W (seq + 1)]. Each epoch
/// visits the windows in a per-epoch random order (a keyed permutation, so nothing of size W is
/// stored); a step takes the next G = batch_per_rank * dp_size windows of that order (the global
/// batch), and rank r takes windows [r * batch_per_rank, (r + 1) * batch_per_rank) of it. An epoch
/// has W / G steps; the last W mod G windows of its order are left out.
///
/// Guarantees:
///  - Everything is a function of (seed, step, G, seq, num_tokens) only: the same on every host.
///  - Within a step the ranks' windows are distinct and do not overlap.
///  - dp-size independence: for a fixed global batch G, the global batch of a step — the ranks'
///    batches concatenated in rank order — is the same whatever dp_size is. A run at 2 ranks x
///    batch 4 sees exactly the data of a run at 1 rank x batch 8, step by step.
///  - Exact resume: after set_state(state()) the batches equal those of an uninterrupted run,
///    also when the resumed run has another dp_size with the same global batch.
///
/// Raises ztrain::Error for seq < 1, batch_per_rank < 1, a bad dp_rank/dp_size, or a training
/// split with fewer than G windows (then lower the batch or the sequence length).
///
///   Sampler s(corpus.train_size(), 128, 4, dp_rank, dp_size, 1234);
///   auto batch = s.next(corpus);  // [4, 129] int64
class Sampler {
 public:
  Sampler(int64_t num_tokens, int64_t seq, int64_t batch_per_rank, int dp_rank, int dp_size, uint64_t seed);

  /// This rank's batch of the next step, [batch_per_rank, seq + 1] int64 tokens from the
  /// training split of `corpus` (whose train_size() must equal num_tokens); advances the step.
  torch::Tensor next(const Corpus& corpus);

  /// The start offsets (in the training split) of this rank's windows at global step `step`.
  /// Does not advance anything.
  std::vector<int64_t> window_starts(int64_t step) const;

  SamplerState state() const;
  /// Resumes at `state`; raises ztrain::Error when it was taken with another seed, global batch,
  /// sequence length or training split, or is inconsistent.
  void set_state(const SamplerState& state);

  int64_t step() const { return step_; }
  int64_t epoch() const { return step_ / steps_per_epoch_; }
  int64_t windows_per_epoch() const { return windows_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t global_batch() const { return global_batch_; }

 private:
  int64_t num_tokens_, seq_, batch_per_rank_;
  int dp_rank_, dp_size_;
  uint64_t seed_;
  int64_t global_batch_, windows_, steps_per_epoch_;
  int64_t step_ = 0;
};

/// Sequential windows over the validation split, the same on every rank: window i starts at token
/// i * seq and holds seq + 1 tokens, so consecutive windows overlap by one token and every
/// validation token after the first is a target exactly once (a tail shorter than a window is left
/// out). Windows are grouped into batches of `batch` rows ([batch, seq + 1] int64; the last batch
/// may have fewer rows); at most `max_batches` batches when given. The caller may split the
/// batches across ranks. Raises ztrain::Error when the validation split is empty or shorter than
/// seq + 1 tokens.
///
///   for (const auto& b : validation_batches(corpus, 256, 8, 20)) loss += eval(b);
std::vector<torch::Tensor> validation_batches(const Corpus& corpus, int64_t seq, int64_t batch,
                                              std::optional<int64_t> max_batches = std::nullopt);

namespace detail {
/// A keyed pseudo-random permutation of [0, n): a Feistel network on the next even power of two
/// with cycle walking. Exposed for tests.
class IndexPermutation {
 public:
  IndexPermutation(int64_t n, uint64_t key);
  int64_t operator()(int64_t i) const;

 private:
  uint64_t permute_domain(uint64_t x) const;
  int64_t n_;
  int half_bits_;
  uint64_t half_mask_;
  uint64_t keys_[6];
};
/// splitmix64's finaliser: a strong 64-bit mix.
uint64_t mix64(uint64_t x);
}  // namespace detail

}  // namespace ztrain::gpt_app
