// Tokenizers: bytes, Hugging Face byte-level BPE, SentencePiece.
//
// How a byte-level BPE encodes (the `tokenizers` library's pipeline, the parts GPT-style files use)
// ---------------------------------------------------------------------------------------------
// 1. Added tokens (<|endoftext|>, ...) are cut out of the text first, leftmost and then longest
//    match; each becomes its id, and the text between them goes on alone.
// 2. Pre-tokenizers cut each such segment into pieces: a Split by a regular expression, then
//    ByteLevel (GPT-2's expression unless use_regex is false; optionally a space prepended to
//    what it receives). Pieces never merge across a cut.
// 3. The model runs BPE on each piece: its bytes start as byte tokens (the byte-to-character map
//    exists only to store bytes as printable strings in the file; here the map is undone when
//    the file is read, and BPE works on bytes), then the adjacent pair with the lowest merge rank,
//    leftmost first, is merged until no pair has a rank.
// 4. The post-processor may add special tokens around the result (TemplateProcessing).
//
// The regular expressions are Oniguruma's in the file; PCRE2 runs them, with one difference
// mended when they are compiled: Oniguruma's \s is Unicode's White_Space, which includes U+0085,
// and PCRE2's does not.
#include "tokenizer.h"

#include <ztrain/error.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <array>
#include <deque>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace ztrain::gpt_app {

namespace {

using json = nlohmann::json;

// ---- UTF-8 ---------------------------------------------------------------------------------------

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

/// The length of the valid UTF-8 sequence at s[i], or 0 with `*consumed` set to the bytes of the
/// maximal invalid subpart to replace (at least 1).
size_t utf8_sequence(std::string_view s, size_t i, size_t* consumed) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    *consumed = 1;
    return 0;
  }
  size_t k = 1;
  for (; k <= need && i + k < s.size(); ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < lo || c > hi) break;
    lo = 0x80, hi = 0xBF;
  }
  if (k == need + 1) return k;
  *consumed = k;
  return 0;
}

/// The code points of a valid UTF-8 string (JSON strings are).
std::u32string code_points(std::string_view s) {
  std::u32string out;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    char32_t c = n == 1 ? b : n == 2 ? b & 0x1F : n == 3 ? b & 0x0F : b & 0x07;
    for (size_t k = 1; k < n && i + k < s.size(); ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(c);
    i += n;
  }
  return out;
}

// ---- the byte-level map --------------------------------------------------------------------------

/// GPT-2's map of bytes to printable characters: printable Latin-1 bytes stand for themselves,
/// the others for 256, 257, ... in byte order.
struct ByteLevelMap {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, uint8_t> to_byte;
  ByteLevelMap() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<uint8_t>(b);
    }
  }
  std::string encode(std::string_view bytes) const {
    std::string out;
    for (unsigned char b : bytes) append_utf8(out, to_char[b]);
    return out;
  }
  /// The bytes a token string stands for, as the ByteLevel decoder gives them: every character
  /// mapped back when all of them are in the map, else the string's own bytes.
  std::string decode(std::string_view token) const {
    std::string out;
    for (char32_t c : code_points(token)) {
      const auto it = to_byte.find(c);
      if (it == to_byte.end()) return std::string(token);
      out.push_back(static_cast<char>(it->second));
    }
    return out;
  }
};

const ByteLevelMap& byte_level() {
  static const ByteLevelMap map;
  return map;
}

// ---- regular expressions -------------------------------------------------------------------------

/// GPT-2's pre-tokenizer expression, which ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// An Oniguruma expression as PCRE2 reads it with the same meaning: \s and \S include U+0085.
std::string pcre2_pattern(std::string_view onig) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < onig.size(); ++i) {
    const char c = onig[i];
    if (c == '\\' && i + 1 < onig.size()) {
      const char e = onig[++i];
      if (e == 's') {
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      } else if (e == 'S' && !in_class) {
        out += "[^\\s\\x{85}]";
      } else {
        out += '\\';
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < onig.size() && onig[i + 1] == '^') out += onig[++i];
      if (i + 1 < onig.size() && onig[i + 1] == ']') out += onig[++i];  // a literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

/// A compiled expression (JIT where available) that cuts text into matches and the gaps between.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) : where_(where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const std::string p = literal ? pattern : pcre2_pattern(pattern);
    const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), options, &error, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      ZTRAIN_CHECK(false, where, ": the regular expression ", pattern, " does not compile at offset ", offset, ": ",
                   reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is unavailable
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Appends to `out` the non-empty gaps between the matches in `text` and, when `keep_matches`,
  /// the non-empty matches, in order.
  void split(std::string_view text, bool keep_matches, std::vector<std::string_view>& out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t pos = 0, gap = 0;
    while (pos < text.size()) {
      const int rc = pcre2_match(code_, subject, text.size(), pos, 0, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {  // a resource limit: cutting on would encode differently, so say so
        pcre2_match_data_free(md);
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof(message));
        ZTRAIN_CHECK(false, where_, ": matching the pre-tokenizer's expression at byte ", pos, " failed: ",
                     reinterpret_cast<const char*>(message));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t start = ov[0], end = ov[1];
      if (end == start) {  // an empty match cuts nothing
        pos = start + 1;
        continue;
      }
      if (start > gap) out.push_back(text.substr(gap, start - gap));
      if (keep_matches) out.push_back(text.substr(start, end - start));
      pos = gap = end;
    }
    if (gap < text.size()) out.push_back(text.substr(gap));
    pcre2_match_data_free(md);
  }

 private:
  std::string where_;
  pcre2_code* code_ = nullptr;
};

// ---- bytes ---------------------------------------------------------------------------------------

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    return {reinterpret_cast<const unsigned char*>(text.data()), reinterpret_cast<const unsigned char*>(text.data()) + text.size()};
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      ZTRAIN_CHECK(id >= 0 && id < 256, "byte tokens are 0-255, got ", id);
      out.push_back(static_cast<char>(id));
    }
    return out;
  }
  int64_t vocab_size() const override { return 256; }
  std::vector<int64_t> byte_lengths() const override { return std::vector<int64_t>(256, 1); }
  std::string kind() const override { return "bytes"; }
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
};

// ---- byte-level BPE ------------------------------------------------------------------------------

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using PieceCache = std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>;

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const std::string& path, const json& j);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(bytes_.size()); }
  std::vector<int64_t> byte_lengths() const override {
    std::vector<int64_t> out(bytes_.size());
    for (size_t i = 0; i < bytes_.size(); ++i) out[i] = special_[i] ? 0 : static_cast<int64_t>(bytes_[i].size());
    return out;
  }
  std::string kind() const override { return "bpe"; }
  const std::string& path() const override { return path_; }

 private:
  struct Stage {  // one pre-tokenizer step
    std::shared_ptr<Regex> regex;  // null: no cut
    bool keep_matches = true;      // Split "Removed" drops them
    bool add_prefix_space = false;
  };
  struct Merge {
    int32_t rank, id;
  };
  struct AddedToken {
    std::string content;
    int32_t id;
  };

  void parse_pre_tokenizer(const json& p);
  void parse_post_processor(const json& p);
  std::string where(const std::string& what) const { return "'" + path_ + "': " + what; }
  /// BPE of one piece, appended to `out`.
  void encode_piece(std::string_view piece, PieceCache& cache, std::vector<int32_t>& out) const;
  void merge_symbols(std::vector<int32_t>& symbols) const;
  void encode_segment(std::string_view segment, PieceCache& cache, std::vector<int32_t>& out) const;

  std::string path_;
  std::vector<Stage> stages_;
  std::vector<std::string> bytes_;  // by id: the bytes each token stands for
  std::vector<bool> special_;       // by id: a special added token (skipped by decode)
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> ids_;  // bytes -> id
  std::array<int32_t, 256> byte_ids_;  // -1: not in the vocabulary
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_;
  bool fuse_unk_ = false, ignore_merges_ = false, byte_level_ = false;
  std::vector<AddedToken> added_;          // longest first
  std::array<bool, 256> added_first_{};    // bytes an added token starts with
  std::vector<int32_t> prefix_, suffix_;   // the post-processor's special tokens
};

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

BpeTokenizer::BpeTokenizer(const std::string& path, const json& j) : path_(path) {
  auto require_null = [&](const char* key, const std::string& what) {
    ZTRAIN_CHECK(!j.contains(key) || j.at(key).is_null(), where(what), " (", key, " = ", j.at(key).dump(), ")");
  };
  require_null("normalizer", "normalizers are not supported; a byte-level BPE has none");
  require_null("truncation", "truncation is not supported; save the tokenizer without it");
  require_null("padding", "padding is not supported; save the tokenizer without it");
  ZTRAIN_CHECK(j.contains("model") && j.at("model").is_object(), where("no \"model\""));
  const json& m = j.at("model");
  ZTRAIN_CHECK(m.value("type", "") == "BPE", where("the model is " + m.value("type", std::string("missing")) +
                                                    "; only BPE models are supported (SentencePiece files: pass the .model)"));
  ZTRAIN_CHECK(!m.contains("dropout") || m.at("dropout").is_null() || m.at("dropout") == 0, where("BPE dropout is not supported"));
  ZTRAIN_CHECK(m.value("continuing_subword_prefix", json()).is_null() && m.value("end_of_word_suffix", json()).is_null(),
               where("subword prefixes and suffixes are not supported (byte-level BPE has none)"));
  ZTRAIN_CHECK(!m.value("byte_fallback", false),
               where("byte_fallback BPE (Llama 2 style) is not supported; use its SentencePiece .model"));
  fuse_unk_ = m.value("fuse_unk", false);
  ignore_merges_ = m.value("ignore_merges", false);
  ZTRAIN_CHECK(j.contains("decoder") && j.at("decoder").is_object() && j.at("decoder").value("type", "") == "ByteLevel",
               where("the decoder must be ByteLevel, got " + (j.contains("decoder") ? j.at("decoder").dump() : "none")));
  ZTRAIN_CHECK(j.contains("pre_tokenizer") && j.at("pre_tokenizer").is_object(), where("no pre_tokenizer"));
  parse_pre_tokenizer(j.at("pre_tokenizer"));
  ZTRAIN_CHECK(byte_level_, where("the pre-tokenizer has no ByteLevel step; only byte-level BPE is supported"));

  // Vocabulary: token strings are byte-level strings; keep the bytes they stand for.
  const auto& map = byte_level();
  ZTRAIN_CHECK(m.contains("vocab") && m.at("vocab").is_object(), where("the model has no vocab"));
  const json& vocab = m.at("vocab");
  int64_t size = 0;
  for (const auto& [token, id] : vocab.items()) {
    ZTRAIN_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0, where("vocab id of '" + token + "' is not an id"));
    size = std::max<int64_t>(size, id.get<int64_t>() + 1);
  }
  std::vector<json> added = j.value("added_tokens", std::vector<json>{});
  for (const auto& a : added) size = std::max<int64_t>(size, a.at("id").get<int64_t>() + 1);
  ZTRAIN_CHECK(size > 0 && size < (int64_t{1} << 31), where("the vocabulary is empty or too large"));
  bytes_.assign(size, std::string());
  special_.assign(size, false);
  std::vector<bool> present(size, false);
  std::unordered_map<std::string, int32_t> by_string;  // token string -> id, for the merges
  by_string.reserve(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    const auto i = id.get<int32_t>();
    bytes_[i] = map.decode(token);
    present[i] = true;
    by_string.emplace(token, i);
    ids_.emplace(bytes_[i], i);
  }
  byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, map.to_char[b]);
    if (auto it = by_string.find(s); it != by_string.end()) byte_ids_[b] = it->second;
  }
  if (m.contains("unk_token") && !m.at("unk_token").is_null()) {
    const auto unk = m.at("unk_token").get<std::string>();
    ZTRAIN_CHECK(by_string.count(unk), where("unk_token '" + unk + "' is not in the vocabulary"));
    unk_ = by_string.at(unk);
  }

  // Merges: "a b" strings (older files) or [a, b] pairs; the rank is the position.
  ZTRAIN_CHECK(m.contains("merges") && m.at("merges").is_array(), where("the model has no merges"));
  const json& merges = m.at("merges");
  merges_.reserve(merges.size() * 2);
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& e = merges[r];
    std::string a, b;
    if (e.is_string()) {
      const auto s = e.get<std::string>();
      const auto space = s.find(' ');
      ZTRAIN_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                   where("merge " + std::to_string(r) + " '" + s + "' is not two tokens"));
      a = s.substr(0, space), b = s.substr(space + 1);
    } else {
      ZTRAIN_CHECK(e.is_array() && e.size() == 2, where("merge " + std::to_string(r) + " is not a pair: " + e.dump()));
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    }
    const auto ia = by_string.find(a), ib = by_string.find(b), iab = by_string.find(a + b);
    ZTRAIN_CHECK(ia != by_string.end() && ib != by_string.end() && iab != by_string.end(),
                 where("merge " + std::to_string(r) + " ('" + a + "', '" + b + "') names a token not in the vocabulary"));
    merges_.emplace(pair_key(ia->second, ib->second), Merge{static_cast<int32_t>(r), iab->second});
  }

  // Added tokens: cut out of the text before anything else.
  for (const auto& a : added) {
    const auto content = a.at("content").get<std::string>();
    const auto id = a.at("id").get<int32_t>();
    ZTRAIN_CHECK(!a.value("lstrip", false) && !a.value("rstrip", false) && !a.value("single_word", false),
                 where("added token '" + content + "' uses lstrip, rstrip or single_word, which are not supported"));
    ZTRAIN_CHECK(!content.empty() && id >= 0, where("added token '" + content + "' is empty or has a negative id"));
    bytes_[id] = map.decode(content);
    special_[id] = a.value("special", false);
    present[id] = true;
    added_.push_back({content, id});
    added_first_[static_cast<unsigned char>(content[0])] = true;
  }
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  const auto missing = std::count(present.begin(), present.end(), false);
  ZTRAIN_CHECK(missing == 0, where(std::to_string(missing) + " ids below the vocabulary size " + std::to_string(size) +
                                   " have no token"));
  if (j.contains("post_processor") && !j.at("post_processor").is_null()) parse_post_processor(j.at("post_processor"));
}

void BpeTokenizer::parse_pre_tokenizer(const json& p) {
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& q : p.at("pretokenizers")) parse_pre_tokenizer(q);
    return;
  }
  if (type == "ByteLevel") {
    Stage s;
    s.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) s.regex = std::make_shared<Regex>(kGpt2Pattern, false, path_);
    stages_.push_back(std::move(s));
    byte_level_ = true;
    return;
  }
  if (type == "Split") {
    const std::string behavior = p.value("behavior", "");
    ZTRAIN_CHECK(behavior == "Isolated" || behavior == "Removed",
                 where("Split behavior '" + behavior + "' is not supported (Isolated or Removed)"));
    ZTRAIN_CHECK(!p.value("invert", false), where("an inverted Split is not supported"));
    const json& pattern = p.at("pattern");
    const bool literal = pattern.contains("String");
    const auto text = (literal ? pattern.at("String") : pattern.at("Regex")).get<std::string>();
    stages_.push_back({std::make_shared<Regex>(text, literal, path_), behavior == "Isolated", false});
    return;
  }
  ZTRAIN_CHECK(false, where("pre-tokenizer '" + type + "' is not supported (ByteLevel, Split, Sequence)"));
}

void BpeTokenizer::parse_post_processor(const json& p) {
  const std::string type = p.value("type", "");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const auto& q : p.at("processors")) parse_post_processor(q);
    return;
  }
  ZTRAIN_CHECK(type == "TemplateProcessing", where("post-processor '" + type + "' is not supported"));
  bool seen_sequence = false;
  for (const auto& item : p.at("single")) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const auto name = item.at("SpecialToken").at("id").get<std::string>();
    ZTRAIN_CHECK(p.at("special_tokens").contains(name), where("template token '" + name + "' is not in special_tokens"));
    for (const auto& id : p.at("special_tokens").at(name).at("ids")) {
      (seen_sequence ? suffix_ : prefix_).push_back(id.get<int32_t>());
    }
  }
}

void BpeTokenizer::merge_symbols(std::vector<int32_t>& s) const {
  // The adjacent pair of lowest rank, leftmost first, until none has a rank. Short pieces (most
  // words) are scanned; long ones go through a heap of candidate merges with stale entries
  // skipped, which gives the same order.
  if (s.size() <= 32) {
    while (s.size() > 1) {
      int32_t best_rank = INT32_MAX, best_id = 0;
      size_t at = 0;
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const auto it = merges_.find(pair_key(s[i], s[i + 1]));
        if (it != merges_.end() && it->second.rank < best_rank) best_rank = it->second.rank, best_id = it->second.id, at = i;
      }
      if (best_rank == INT32_MAX) break;
      s[at] = best_id;
      s.erase(s.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    return;
  }
  const auto n = static_cast<int32_t>(s.size());
  std::vector<int32_t> prev(n), next(n);
  for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  std::vector<bool> alive(n, true);
  using Entry = std::tuple<int32_t, int32_t, int32_t>;  // rank, left position, merged id
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    if (const auto it = merges_.find(pair_key(s[i], s[next[i]])); it != merges_.end()) {
      heap.emplace(it->second.rank, i, it->second.id);
    }
  };
  for (int32_t i = 0; i < n; ++i) push(i);
  while (!heap.empty()) {
    const auto [rank, i, id] = heap.top();
    heap.pop();
    if (!alive[i] || next[i] < 0) continue;
    const auto it = merges_.find(pair_key(s[i], s[next[i]]));
    if (it == merges_.end() || it->second.rank != rank) continue;  // stale
    const int32_t j = next[i];
    s[i] = id;
    alive[j] = false;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  std::vector<int32_t> out;
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(s[i]);
  s = std::move(out);
}

void BpeTokenizer::encode_piece(std::string_view piece, PieceCache& cache, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (const auto it = ids_.find(piece); it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (const auto it = cache.find(piece); it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> symbols;
  symbols.reserve(piece.size());
  bool last_unk = false;
  for (unsigned char b : piece) {
    const int32_t id = byte_ids_[b];
    if (id >= 0) {
      symbols.push_back(id);
      last_unk = false;
    } else if (unk_ && !(fuse_unk_ && last_unk)) {  // as `tokenizers`: unknown, or dropped without unk
      symbols.push_back(*unk_);
      last_unk = true;
    }
  }
  merge_symbols(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
  if (cache.size() > (1u << 20)) cache.clear();
  cache.emplace(std::string(piece), std::move(symbols));
}

void BpeTokenizer::encode_segment(std::string_view segment, PieceCache& cache, std::vector<int32_t>& out) const {
  std::deque<std::string> owned;  // segments with a prepended space
  std::vector<std::string_view> pieces{segment}, cut;
  for (const auto& stage : stages_) {
    cut.clear();
    for (auto p : pieces) {
      if (stage.add_prefix_space && (p.empty() || p[0] != ' ')) p = owned.emplace_back(" " + std::string(p));
      if (stage.regex) {
        stage.regex->split(p, stage.keep_matches, cut);
      } else if (!p.empty()) {
        cut.push_back(p);
      }
    }
    std::swap(pieces, cut);
  }
  for (auto p : pieces) encode_piece(p, cache, out);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out(prefix_);
  out.reserve(text.size() / 3 + prefix_.size() + suffix_.size());
  PieceCache cache;
  size_t begin = 0;
  for (size_t i = 0; i < text.size() && !added_.empty(); ++i) {
    if (!added_first_[static_cast<unsigned char>(text[i])]) continue;
    for (const auto& a : added_) {
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      if (i > begin) encode_segment(text.substr(begin, i - begin), cache, out);
      out.push_back(a.id);
      begin = i + a.content.size();
      i = begin - 1;
      break;
    }
  }
  if (begin < text.size()) encode_segment(text.substr(begin), cache, out);
  out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    ZTRAIN_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary of ", vocab_size(), " of '",
                 path_, "'");
    if (!special_[id]) out += bytes_[id];
  }
  return out;
}

// ---- SentencePiece -------------------------------------------------------------------------------

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    ZTRAIN_CHECK(status.ok(), "'", path, "' is not a SentencePiece model (", status.ToString(),
                 "); Hugging Face tokenizers are read from files ending in .json");
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    ZTRAIN_CHECK(status.ok(), "SentencePiece '", path_, "' cannot encode: ", status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> in(ids.begin(), ids.end());
    for (int id : in) ZTRAIN_CHECK(id >= 0 && id < sp_.GetPieceSize(), "token id ", id, " is outside the vocabulary of ",
                                   sp_.GetPieceSize(), " of '", path_, "'");
    std::string out;
    const auto status = sp_.Decode(in, &out);
    ZTRAIN_CHECK(status.ok(), "SentencePiece '", path_, "' cannot decode: ", status.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::vector<int64_t> byte_lengths() const override {
    // A piece's text with its word-boundary mark (U+2581, 3 bytes) as the space it stands for;
    // byte pieces one byte; control and unknown pieces nothing.
    std::vector<int64_t> out(sp_.GetPieceSize());
    const std::string mark = "\xE2\x96\x81";
    for (int i = 0; i < sp_.GetPieceSize(); ++i) {
      if (sp_.IsByte(i)) {
        out[i] = 1;
      } else if (!sp_.IsControl(i) && !sp_.IsUnknown(i)) {
        const auto& piece = sp_.IdToPiece(i);
        int64_t marks = 0;
        for (size_t k = piece.find(mark); k != std::string::npos; k = piece.find(mark, k + 3)) ++marks;
        out[i] = static_cast<int64_t>(piece.size()) - 2 * marks;
      }
    }
    return out;
  }
  std::string kind() const override { return "sentencepiece"; }
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

// ---- BPE training --------------------------------------------------------------------------------

/// Learns merges over words (pre-tokenized pieces with their counts): each round merges the pair
/// with the highest count, updating the counts of the pairs around each occurrence.
class BpeTrainer {
 public:
  BpeTrainer(const BpeTrainOptions& o, const std::unordered_map<std::string, int64_t>& words) : o_(o) {
    for (const auto& s : o.special_tokens) token_bytes_.push_back(s);
    special_ = static_cast<int32_t>(token_bytes_.size());
    for (int b = 0; b < 256; ++b) token_bytes_.push_back(std::string(1, static_cast<char>(b)));
    for (const auto& [w, count] : words) {
      Word word{{}, count};
      for (unsigned char b : w) word.symbols.push_back(special_ + b);
      words_.push_back(std::move(word));
    }
    for (size_t wi = 0; wi < words_.size(); ++wi) {
      const auto& s = words_[wi].symbols;
      for (size_t i = 0; i + 1 < s.size(); ++i) add_pair(pair_key(s[i], s[i + 1]), words_[wi].count, wi);
    }
    for (const auto& [key, count] : counts_) push(key);
  }

  /// Merges until the vocabulary is full or no pair is frequent enough; returns the merges.
  std::vector<std::pair<int32_t, int32_t>> run() {
    std::vector<std::pair<int32_t, int32_t>> merges;
    while (static_cast<int64_t>(token_bytes_.size()) < o_.vocab_size && !heap_.empty()) {
      const Candidate top = heap_.top();
      heap_.pop();
      const auto it = counts_.find(top.key);
      const int64_t count = it == counts_.end() ? 0 : it->second;
      if (count != top.count) {  // stale: counts only fall, so re-queue at the current count
        if (count > 0) push(top.key);
        continue;
      }
      if (count < o_.min_frequency) break;
      const auto a = static_cast<int32_t>(top.key >> 32), b = static_cast<int32_t>(top.key & 0xFFFFFFFF);
      const auto id = static_cast<int32_t>(token_bytes_.size());
      token_bytes_.push_back(token_bytes_[a] + token_bytes_[b]);
      merges.emplace_back(a, b);
      apply(a, b, id);
    }
    return merges;
  }
  const std::vector<std::string>& token_bytes() const { return token_bytes_; }

 private:
  struct Word {
    std::vector<int32_t> symbols;
    int64_t count;
  };
  struct Candidate {
    int64_t count;
    uint64_t key;
    std::string merged;  // ties go to the pair whose bytes sort first
  };
  struct Lower {
    bool operator()(const Candidate& x, const Candidate& y) const {
      if (x.count != y.count) return x.count < y.count;
      if (x.merged != y.merged) return x.merged > y.merged;
      return x.key > y.key;
    }
  };

  void push(uint64_t key) {
    const auto a = static_cast<int32_t>(key >> 32), b = static_cast<int32_t>(key & 0xFFFFFFFF);
    heap_.push({counts_.at(key), key, token_bytes_[a] + token_bytes_[b]});
  }
  void add_pair(uint64_t key, int64_t count, size_t word) {
    counts_[key] += count;
    where_[key].insert(word);
  }

  void apply(int32_t a, int32_t b, int32_t id) {
    const uint64_t key = pair_key(a, b);
    const auto words = std::move(where_[key]);
    where_.erase(key);
    counts_.erase(key);
    std::unordered_set<uint64_t> touched;
    for (size_t wi : words) {
      auto& s = words_[wi].symbols;
      const int64_t c = words_[wi].count;
      std::vector<int32_t> out;
      out.reserve(s.size());
      bool merged_before = false;  // the previous symbol of `out` is a merge made just now
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          if (!out.empty()) {  // (prev, a) becomes (prev, id); after a merge, its right side did it
            if (!merged_before && pair_key(s[i - 1], a) != key) decrement(pair_key(s[i - 1], a), c);
            add_pair(pair_key(out.back(), id), c, wi);
            touched.insert(pair_key(out.back(), id));
          }
          if (i + 2 < s.size()) {  // (b, next) becomes (id, next), unless next starts a merge too
            if (pair_key(b, s[i + 2]) != key) decrement(pair_key(b, s[i + 2]), c);
            if (!(i + 3 < s.size() && s[i + 2] == a && s[i + 3] == b)) {
              add_pair(pair_key(id, s[i + 2]), c, wi);
              touched.insert(pair_key(id, s[i + 2]));
            }
          }
          out.push_back(id);
          merged_before = true;
          ++i;
        } else {
          out.push_back(s[i]);
          merged_before = false;
        }
      }
      s = std::move(out);
    }
    for (uint64_t k : touched) push(k);
  }
  void decrement(uint64_t key, int64_t count) {
    const auto it = counts_.find(key);
    if (it == counts_.end()) return;
    it->second -= count;
    if (it->second <= 0) counts_.erase(it);
  }

  BpeTrainOptions o_;
  int32_t special_ = 0;
  std::vector<std::string> token_bytes_;
  std::vector<Word> words_;
  std::unordered_map<uint64_t, int64_t> counts_;
  std::unordered_map<uint64_t, std::unordered_set<size_t>> where_;
  std::priority_queue<Candidate, std::vector<Candidate>, Lower> heap_;
};

}  // namespace

// ---- public --------------------------------------------------------------------------------------

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    size_t consumed = 0;
    if (const size_t n = utf8_sequence(bytes, i, &consumed)) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += consumed;
    }
  }
  return out;
}

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path) {
  if (path.empty()) return std::make_shared<ByteTokenizer>();
  std::ifstream in(path, std::ios::binary);
  ZTRAIN_CHECK(in, "cannot open tokenizer file '", path, "'");
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      ZTRAIN_CHECK(false, "'", path, "' is not a tokenizer.json: ", e.what());
    }
    try {
      return std::make_shared<BpeTokenizer>(path, j);
    } catch (const json::exception& e) {
      ZTRAIN_CHECK(false, "'", path, "' is a malformed tokenizer.json: ", e.what());
    }
  }
  return std::make_shared<SentencePieceTokenizer>(path);
}

std::string train_bpe(const std::vector<std::string_view>& texts, const BpeTrainOptions& o) {
  const int64_t base = static_cast<int64_t>(o.special_tokens.size()) + 256;
  ZTRAIN_CHECK(o.vocab_size >= base, "a byte-level BPE vocabulary holds the 256 bytes and ", o.special_tokens.size(),
               " special tokens: --vocab-size must be at least ", base, ", got ", o.vocab_size);
  ZTRAIN_CHECK(o.min_frequency >= 1, "min_frequency must be at least 1, got ", o.min_frequency);
  const Regex gpt2(kGpt2Pattern, false, "the GPT-2 pre-tokenizer");
  std::unordered_map<std::string, int64_t> words;
  std::vector<std::string_view> pieces;
  for (auto text : texts) {
    pieces.clear();
    gpt2.split(text, true, pieces);
    for (auto p : pieces) ++words[std::string(p)];
  }
  BpeTrainer trainer(o, words);
  const auto merges = trainer.run();
  const auto& tokens = trainer.token_bytes();
  const auto& map = byte_level();

  nlohmann::ordered_json vocab = nlohmann::ordered_json::object(), merge_list = nlohmann::ordered_json::array();
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool special = i < o.special_tokens.size();
    const std::string s = special ? tokens[i] : map.encode(tokens[i]);
    ZTRAIN_CHECK(!vocab.contains(s), "special token '", s, "' is given twice or is a byte token");
    vocab[s] = i;
    if (special) {
      added.push_back({{"id", i}, {"content", s}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", true}});
    }
  }
  for (const auto& [a, b] : merges) merge_list.push_back({map.encode(tokens[a]), map.encode(tokens[b])});
  const nlohmann::ordered_json byte_level_json = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  nlohmann::ordered_json j = {{"version", "1.0"},
                              {"truncation", nullptr},
                              {"padding", nullptr},
                              {"added_tokens", added},
                              {"normalizer", nullptr},
                              {"pre_tokenizer", byte_level_json},
                              {"post_processor", byte_level_json},
                              {"decoder", byte_level_json},
                              {"model",
                               {{"type", "BPE"},
                                {"dropout", nullptr},
                                {"unk_token", nullptr},
                                {"continuing_subword_prefix", nullptr},
                                {"end_of_word_suffix", nullptr},
                                {"fuse_unk", false},
                                {"byte_fallback", false},
                                {"ignore_merges", false},
                                {"vocab", vocab},
                                {"merges", merge_list}}}};
  return j.dump(2) + "\n";
}

void train_sentencepiece(const std::vector<std::string>& inputs, const std::string& prefix, int64_t vocab_size,
                         const std::string& model_type) {
  ZTRAIN_CHECK(model_type == "bpe" || model_type == "unigram", "SentencePiece model type must be bpe or unigram, got '",
               model_type, "'");
  ZTRAIN_CHECK(!inputs.empty(), "no input files to train a SentencePiece model on");
  std::string files;
  for (const auto& f : inputs) files += (files.empty() ? "" : ",") + f;
  // Identity normalization, byte fallback and kept whitespace: every byte of the text survives a
  // round trip (newlines through their byte pieces), as Llama's models are set up.
  const std::unordered_map<std::string, std::string> args{
      {"input", files},
      {"model_prefix", prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", model_type},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"character_coverage", "0.9995"},
      {"max_sentence_length", "1000000"},
      {"hard_vocab_limit", "false"},  // a small corpus gives a smaller vocabulary, as BPE's merges stop
      {"minloglevel", "2"}};
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  ZTRAIN_CHECK(status.ok(), "SentencePiece training failed: ", status.ToString());
}

}  // namespace ztrain::gpt_app
