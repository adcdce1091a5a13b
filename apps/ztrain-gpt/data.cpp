// Corpus, token files, training sampler and validation windows.
//
// How the sampler draws a step
// ----------------------------
// L = seq + 1, W = num_tokens / L windows, G = batch_per_rank * dp_size, W / G steps per epoch.
// For global step s: epoch e = s / (W / G), j = s % (W / G). From (seed, e) come a key and an
// offset o_e in [0, num_tokens - W L]. Global sample k of the step (0 <= k < G) is window
// w = perm_e(j G + k) and starts at o_e + w L, where perm_e is a keyed permutation of [0, W)
// (a Feistel network, so any element is computed in O(1) without storing the order). Rank r
// takes k in [r b, (r + 1) b). Nothing depends on dp_size except which slice a rank takes, so the
// global batch, and the state needed to resume it (the step), is the same at any dp_size.
#include "data.h"

#include <ztrain/error.h>

#include <openssl/evp.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <fstream>
#include <iterator>
#include <thread>

namespace fs = std::filesystem;

namespace ztrain::gpt_app {

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  ZTRAIN_CHECK(in, "cannot open corpus file ", path.string());
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ZTRAIN_CHECK(!in.bad(), "error while reading corpus file ", path.string());
  return bytes;
}

bool is_hidden(const fs::path& p) {
  const auto name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

/// The regular files under `dir`, recursively, hidden entries (and what is under a hidden
/// directory) left out, sorted by path.
std::vector<fs::path> corpus_files(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec), end;
  ZTRAIN_CHECK(!ec, "cannot list corpus directory ", dir.string(), ": ", ec.message());
  for (; it != end; it.increment(ec)) {
    ZTRAIN_CHECK(!ec, "cannot list corpus directory ", dir.string(), ": ", ec.message());
    const auto& entry = *it;
    if (is_hidden(entry.path())) {
      if (entry.is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  ZTRAIN_CHECK(!ec, "cannot list corpus directory ", dir.string(), ": ", ec.message());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

// ---- Corpus --------------------------------------------------------------------------------------

std::vector<fs::path> list_corpus(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  const auto status = fs::status(p, ec);
  ZTRAIN_CHECK(fs::exists(status), "corpus path ", path, " does not exist; pass a text file or a directory of them");
  if (fs::is_directory(status)) {
    auto files = corpus_files(p);
    ZTRAIN_CHECK(!files.empty(), "corpus directory ", path,
                 " contains no regular files (hidden files are skipped); put text files in it");
    return files;
  }
  ZTRAIN_CHECK(fs::is_regular_file(status), "corpus path ", path, " is neither a regular file nor a directory");
  return {p};
}

namespace {

// Token files: a 64-byte header, then `count` ids of `width` bytes, little-endian.
constexpr char kTokenMagic[8] = {'Z', 'T', 'T', 'O', 'K', 'E', 'N', '1'};
struct TokenHeader {
  char magic[8];
  uint32_t width;
  uint32_t reserved;
  uint64_t count;
  uint64_t vocab_size;
  unsigned char key[32];
};
static_assert(sizeof(TokenHeader) == 64);

std::string hex(const unsigned char* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) out += digits[bytes[i] >> 4], out += digits[bytes[i] & 15];
  return out;
}

/// SHA-256 of what the token file depends on: the tokenizer's kind and file, and the corpus'
/// files (their sizes and bytes, in order).
std::array<unsigned char, 32> cache_key(const std::vector<fs::path>& files, const Tokenizer& tokenizer) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  ZTRAIN_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, "cannot start SHA-256 (libcrypto)");
  auto update = [&](const std::string& bytes) {
    const uint64_t n = bytes.size();
    EVP_DigestUpdate(ctx.get(), &n, sizeof(n));
    EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size());
  };
  update("ztrain token file 1 " + tokenizer.kind());
  update(read_file(tokenizer.path()));
  for (const auto& f : files) update(read_file(f));
  std::array<unsigned char, 32> key{};
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx.get(), key.data(), &n);
  return key;
}

/// Encodes `files` into a new token file at `target`: written aside, then renamed. The files are
/// encoded on as many threads as the host has cores (each file by one thread, so at most that
/// many files' text and ids are in memory at once) and written in order.
void write_token_file(const std::vector<fs::path>& files, const Tokenizer& tokenizer,
                      const std::array<unsigned char, 32>& key, const fs::path& target) {
  const int width = tokenizer.vocab_size() <= 65536 ? 2 : 4;
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  std::ofstream out(tmp, std::ios::binary);
  ZTRAIN_CHECK(out, "cannot write the token file ", tmp.string(), "; pass a writable --token-cache");
  TokenHeader h{};
  std::copy(std::begin(kTokenMagic), std::end(kTokenMagic), h.magic);
  h.width = width;
  h.vocab_size = tokenizer.vocab_size();
  std::copy(key.begin(), key.end(), h.key);
  out.write(reinterpret_cast<const char*>(&h), sizeof(h));
  try {
    const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, files.size());
    std::deque<std::future<std::vector<int32_t>>> pending;
    size_t next = 0;
    auto launch = [&] {
      pending.push_back(std::async(std::launch::async, [&tokenizer, f = files[next++]] {
        return tokenizer.encode(read_file(f));
      }));
    };
    while (next < files.size() && pending.size() < threads) launch();
    uint64_t count = 0;
    std::vector<uint16_t> narrow;
    while (!pending.empty()) {
      const auto ids = pending.front().get();
      pending.pop_front();
      if (next < files.size()) launch();
      count += ids.size();
      if (width == 4) {
        out.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
      } else {
        narrow.assign(ids.begin(), ids.end());
        out.write(reinterpret_cast<const char*>(narrow.data()), static_cast<std::streamsize>(narrow.size() * 2));
      }
    }
    h.count = count;
    out.seekp(0);
    out.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out.close();
    ZTRAIN_CHECK(out, "error while writing the token file ", tmp.string(), " (disk full?)");
    std::error_code ec;
    fs::rename(tmp, target, ec);
    ZTRAIN_CHECK(!ec, "cannot publish the token file ", target.string(), ": ", ec.message());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);  // nothing half-written stays behind
    throw;
  }
}

}  // namespace

Corpus Corpus::load(const std::string& path, double validation_fraction) {
  const auto files = list_corpus(path);
  std::string bytes;
  std::vector<std::string> names;
  for (const auto& f : files) {
    bytes += read_file(f);
    names.push_back(f.string());
  }
  auto corpus = from_bytes(std::move(bytes), validation_fraction, path);
  corpus.files_ = std::move(names);
  return corpus;
}

Corpus Corpus::load(const std::string& path, const Tokenizer& tokenizer, double validation_fraction,
                    const std::string& cache_dir) {
  if (tokenizer.kind() == "bytes") return load(path, validation_fraction);
  ZTRAIN_CHECK(std::isfinite(validation_fraction) && validation_fraction >= 0 && validation_fraction < 1,
               "validation_fraction must be in [0, 1), got ", validation_fraction);
  const auto files = list_corpus(path);
  const auto key = cache_key(files, tokenizer);
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  ZTRAIN_CHECK(!ec, "cannot create the token cache directory ", cache_dir, ": ", ec.message());
  const fs::path file = fs::path(cache_dir) / (hex(key.data(), 16) + ".tokens");
  if (!fs::exists(file)) write_token_file(files, tokenizer, key, file);

  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ZTRAIN_CHECK(fd >= 0, "cannot open the token file ", file.string(), ": ", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const auto bytes = static_cast<size_t>(st.st_size);
  void* map = bytes >= sizeof(TokenHeader) ? ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  ZTRAIN_CHECK(map != MAP_FAILED, "token file ", file.string(), " is not a token file (", bytes,
               " bytes); delete it to tokenize again");
  Corpus c;
  c.storage_ = std::shared_ptr<const void>(map, [bytes](const void* p) { ::munmap(const_cast<void*>(p), bytes); });
  TokenHeader h;
  std::memcpy(&h, map, sizeof(h));
  const bool valid = std::equal(std::begin(kTokenMagic), std::end(kTokenMagic), h.magic) && (h.width == 2 || h.width == 4) &&
                     bytes == sizeof(h) + h.count * h.width && std::equal(key.begin(), key.end(), h.key) &&
                     static_cast<int64_t>(h.vocab_size) == tokenizer.vocab_size();
  ZTRAIN_CHECK(valid, "token file ", file.string(), " is damaged or was not written for this corpus and tokenizer; "
               "delete it to tokenize again");
  ZTRAIN_CHECK(h.count > 0, "corpus ", path, " gives no tokens; it needs text to train on");
  c.data_ = static_cast<const uint8_t*>(map) + sizeof(h);
  c.width_ = static_cast<int>(h.width);
  c.size_ = static_cast<int64_t>(h.count);
  c.vocab_size_ = tokenizer.vocab_size();
  for (const auto& f : files) c.files_.push_back(f.string());
  c.source_ = path;
  c.cache_file_ = file.string();
  c.split(validation_fraction);
  return c;
}

Corpus Corpus::from_bytes(std::string bytes, double validation_fraction, std::string source) {
  ZTRAIN_CHECK(std::isfinite(validation_fraction) && validation_fraction >= 0 && validation_fraction < 1,
               "validation_fraction must be in [0, 1), got ", validation_fraction);
  ZTRAIN_CHECK(!bytes.empty(), "corpus ", source, " is empty; it needs text to train on");
  Corpus c;
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  c.data_ = reinterpret_cast<const uint8_t*>(owned->data());
  c.size_ = static_cast<int64_t>(owned->size());
  c.storage_ = std::move(owned);
  c.source_ = std::move(source);
  c.split(validation_fraction);
  return c;
}

void Corpus::split(double validation_fraction) {
  const auto validation = static_cast<int64_t>(std::llround(static_cast<double>(size_) * validation_fraction));
  train_size_ = size_ - std::clamp<int64_t>(validation, 0, size_ - 1);
}

void Corpus::copy(int64_t begin, int64_t n, int64_t* out) const {
  ZTRAIN_INTERNAL_ASSERT(begin >= 0 && n >= 0 && begin + n <= size_, "tokens [", begin, ", ", begin + n,
                         ") outside a corpus of ", size_);
  if (width_ == 1) {
    std::copy_n(data_ + begin, n, out);
  } else if (width_ == 2) {
    uint16_t v;
    for (int64_t i = 0; i < n; ++i) std::memcpy(&v, data_ + 2 * (begin + i), 2), out[i] = v;
  } else {
    uint32_t v;
    for (int64_t i = 0; i < n; ++i) std::memcpy(&v, data_ + 4 * (begin + i), 4), out[i] = v;
  }
}

void Corpus::check_sequence_length(int64_t seq) const {
  ZTRAIN_CHECK(seq >= 1, "sequence length must be at least 1, got ", seq);
  ZTRAIN_CHECK(train_size() >= seq + 1, "the training split of corpus ", source_, " has ", train_size(),
               " tokens, fewer than one window of seq + 1 = ", seq + 1, "; use a shorter sequence or more data");
  ZTRAIN_CHECK(validation_size() == 0 || validation_size() >= seq + 1, "the validation split of corpus ", source_,
               " has ", validation_size(), " tokens, fewer than one window of seq + 1 = ", seq + 1,
               "; raise the validation fraction, set it to 0, or use a shorter sequence");
}

// ---- SamplerState ----------------------------------------------------------------------------

void to_json(nlohmann::json& j, const SamplerState& s) {
  j = nlohmann::json{{"step", s.step},     {"epoch", s.epoch},
                     {"seed", s.seed},     {"global_batch", s.global_batch},
                     {"seq", s.seq},       {"num_tokens", s.num_tokens}};
}

void from_json(const nlohmann::json& j, SamplerState& s) {
  ZTRAIN_CHECK(j.is_object(), "sampler state must be a JSON object, got ", j.dump());
  for (const char* key : {"step", "epoch", "seed", "global_batch", "seq", "num_tokens"}) {
    ZTRAIN_CHECK(j.contains(key) && j.at(key).is_number_integer(), "sampler state ", j.dump(),
                 " lacks the integer field \"", key, "\"");
  }
  s.step = j.at("step").get<int64_t>();
  s.epoch = j.at("epoch").get<int64_t>();
  s.seed = j.at("seed").get<uint64_t>();
  s.global_batch = j.at("global_batch").get<int64_t>();
  s.seq = j.at("seq").get<int64_t>();
  s.num_tokens = j.at("num_tokens").get<int64_t>();
}

// ---- permutation -----------------------------------------------------------------------------

namespace detail {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

IndexPermutation::IndexPermutation(int64_t n, uint64_t key) : n_(n) {
  ZTRAIN_INTERNAL_ASSERT(n >= 1 && n < (int64_t{1} << 62), "permutation size ", n);
  int bits = 2;
  while ((int64_t{1} << bits) < n) ++bits;
  bits += bits % 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  for (int k = 0; k < 6; ++k) keys_[k] = mix64(key ^ mix64(static_cast<uint64_t>(k) + 1));
}

uint64_t IndexPermutation::permute_domain(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (uint64_t k : keys_) {
    const uint64_t next = left ^ (mix64(right ^ k) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

int64_t IndexPermutation::operator()(int64_t i) const {
  ZTRAIN_INTERNAL_ASSERT(i >= 0 && i < n_, "permutation index ", i, " outside [0, ", n_, ")");
  // Cycle walking: the Feistel network permutes [0, 4^half_bits); following i's cycle until it
  // comes back into [0, n) restricts it to a permutation of [0, n).
  auto x = static_cast<uint64_t>(i);
  do {
    x = permute_domain(x);
  } while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

}  // namespace detail

// ---- Sampler ---------------------------------------------------------------------------------

Sampler::Sampler(int64_t num_tokens, int64_t seq, int64_t batch_per_rank, int dp_rank, int dp_size, uint64_t seed)
    : num_tokens_(num_tokens), seq_(seq), batch_per_rank_(batch_per_rank), dp_rank_(dp_rank), dp_size_(dp_size),
      seed_(seed) {
  ZTRAIN_CHECK(seq >= 1, "sequence length must be at least 1, got ", seq);
  ZTRAIN_CHECK(batch_per_rank >= 1, "batch per rank must be at least 1, got ", batch_per_rank);
  ZTRAIN_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "dp_rank must be in [0, dp_size), got dp_rank ",
               dp_rank, " and dp_size ", dp_size);
  ZTRAIN_CHECK(num_tokens >= 0, "num_tokens must not be negative, got ", num_tokens);
  global_batch_ = batch_per_rank * dp_size;
  windows_ = num_tokens / (seq + 1);
  ZTRAIN_CHECK(windows_ >= global_batch_, "the training split has ", num_tokens, " tokens: ", windows_,
               " windows of seq + 1 = ", seq + 1, ", fewer than the global batch of ", global_batch_, " (",
               batch_per_rank, " per rank x ", dp_size,
               " ranks); use a smaller batch, a shorter sequence or more data");
  steps_per_epoch_ = windows_ / global_batch_;
}

std::vector<int64_t> Sampler::window_starts(int64_t step) const {
  ZTRAIN_CHECK(step >= 0, "step must not be negative, got ", step);
  const int64_t window = seq_ + 1;
  const int64_t epoch = step / steps_per_epoch_, j = step % steps_per_epoch_;
  const uint64_t epoch_key = detail::mix64(detail::mix64(seed_) ^ static_cast<uint64_t>(epoch));
  const detail::IndexPermutation order(windows_, detail::mix64(epoch_key ^ 1));
  const auto slack = static_cast<uint64_t>(num_tokens_ - windows_ * window);
  const auto offset = static_cast<int64_t>(detail::mix64(epoch_key ^ 2) % (slack + 1));
  std::vector<int64_t> starts(batch_per_rank_);
  for (int64_t i = 0; i < batch_per_rank_; ++i) {
    const int64_t k = j * global_batch_ + dp_rank_ * batch_per_rank_ + i;
    starts[i] = offset + order(k) * window;
  }
  return starts;
}

torch::Tensor Sampler::next(const Corpus& corpus) {
  ZTRAIN_CHECK(corpus.train_size() == num_tokens_, "the sampler was built for a training split of ", num_tokens_,
               " tokens, but corpus ", corpus.source(), " has ", corpus.train_size());
  const int64_t window = seq_ + 1;
  const auto starts = window_starts(step_);
  auto batch = torch::empty({batch_per_rank_, window}, torch::kInt64);
  int64_t* out = batch.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch_per_rank_; ++i) corpus.copy(starts[i], window, out + i * window);
  ++step_;
  return batch;
}

SamplerState Sampler::state() const {
  return {.step = step_, .epoch = epoch(), .seed = seed_, .global_batch = global_batch_, .seq = seq_,
          .num_tokens = num_tokens_};
}

void Sampler::set_state(const SamplerState& s) {
  ZTRAIN_CHECK(s.seed == seed_, "sampler state was saved with seed ", s.seed, ", this run uses ", seed_,
               "; resume with the same seed");
  ZTRAIN_CHECK(s.global_batch == global_batch_, "sampler state was saved with global batch ", s.global_batch,
               ", this run has ", global_batch_, " (", batch_per_rank_, " per rank x ", dp_size_,
               " ranks); keep batch_per_rank * dp_size the same to resume exactly");
  ZTRAIN_CHECK(s.seq == seq_, "sampler state was saved with sequence length ", s.seq, ", this run uses ", seq_);
  ZTRAIN_CHECK(s.num_tokens == num_tokens_, "sampler state was saved for a training split of ", s.num_tokens,
               " tokens, this corpus has ", num_tokens_, "; resume with the same data and validation fraction");
  ZTRAIN_CHECK(s.step >= 0 && s.epoch == s.step / steps_per_epoch_, "sampler state is inconsistent: step ", s.step,
               " is in epoch ", s.step / steps_per_epoch_, ", not ", s.epoch);
  step_ = s.step;
}

// ---- validation ------------------------------------------------------------------------------

std::vector<torch::Tensor> validation_batches(const Corpus& corpus, int64_t seq, int64_t batch,
                                              std::optional<int64_t> max_batches) {
  ZTRAIN_CHECK(seq >= 1, "sequence length must be at least 1, got ", seq);
  ZTRAIN_CHECK(batch >= 1, "validation batch must be at least 1, got ", batch);
  ZTRAIN_CHECK(!max_batches || *max_batches >= 0, "max_batches must not be negative, got ", *max_batches);
  ZTRAIN_CHECK(corpus.validation_size() > 0, "corpus ", corpus.source(),
               " has no validation split; load it with a validation fraction above 0");
  corpus.check_sequence_length(seq);
  const int64_t window = seq + 1;
  const int64_t windows = (corpus.validation_size() - 1) / seq;
  int64_t batches = (windows + batch - 1) / batch;
  if (max_batches) batches = std::min(batches, *max_batches);
  std::vector<torch::Tensor> out;
  out.reserve(batches);
  for (int64_t b = 0; b < batches; ++b) {
    const int64_t rows = std::min(batch, windows - b * batch);
    auto t = torch::empty({rows, window}, torch::kInt64);
    int64_t* dst = t.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      corpus.copy(corpus.train_size() + (b * batch + r) * seq, window, dst + r * window);
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace ztrain::gpt_app
