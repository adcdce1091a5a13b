#pragma once
/// Tokenizers for ztrain-gpt: bytes (the default, vocabulary 256), Hugging Face byte-level BPE
/// (`tokenizer.json`, as GPT-2, RoBERTa, Llama 3 and `tokenizers`' own trainer write it) and
/// SentencePiece models (`*.model`, through libsentencepiece).
///
///   auto tok = load_tokenizer("tokenizer.json");      // or "spm.model"; "" is bytes
///   std::vector<int32_t> ids = tok->encode("Hello world");
///   std::string bytes = tok->decode(ids);             // the original bytes
///   int64_t v = tok->vocab_size();
///
/// A byte-level BPE encodes exactly as the `tokenizers` library does (`Tokenizer.encode(text).ids`,
/// added tokens included), and decode_text equals its `decode(ids)` (special tokens skipped,
/// invalid UTF-8 replaced by U+FFFD). What such a file may contain: no normalizer; a ByteLevel
/// pre-tokenizer, alone or after Split pre-tokenizers (regular expressions, "Isolated" or "Removed");
/// a BPE model without dropout, subword affixes or byte fallback (ignore_merges is honoured);
/// added tokens without lstrip, rstrip or single_word; a ByteLevel decoder; a ByteLevel or
/// TemplateProcessing post-processor. Anything else is refused by name when the file is loaded.
///
/// Tokenizers are immutable after loading; encode and decode may be called from several threads.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ztrain::gpt_app {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Ids of `text` (any bytes; a BPE tokenizer maps bytes that are not valid UTF-8 to their
  /// byte tokens), with the post-processor's special tokens (a BOS, say) when it has them.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  /// The bytes of `ids` concatenated, special tokens skipped. Raises ztrain::Error for an id
  /// outside [0, vocab_size()).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  /// Ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  /// Bytes of text each id stands for (0 for special tokens): the length of what decode gives
  /// it alone, so that a loss per token converts to a loss per byte of text.
  virtual std::vector<int64_t> byte_lengths() const = 0;
  /// "bytes", "bpe" or "sentencepiece".
  virtual std::string kind() const = 0;
  /// The file it was loaded from ("" for bytes).
  virtual const std::string& path() const = 0;
};

/// The tokenizer in `path`: a Hugging Face tokenizer.json (any file name ending in .json), a
/// SentencePiece model (any other file), or bytes when `path` is empty. Raises ztrain::Error
/// naming the file and what is unsupported or malformed in it.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& path);

/// `bytes` as UTF-8 with every maximal invalid subsequence replaced by U+FFFD, as Rust's
/// String::from_utf8_lossy (and so the `tokenizers` library's decode) does.
std::string utf8_lossy(std::string_view bytes);

/// What train_bpe makes.
struct BpeTrainOptions {
  int64_t vocab_size = 4096;                              // special tokens and 256 bytes included
  std::vector<std::string> special_tokens{"<|endoftext|>"};  // ids 0, 1, ... in this order
  int64_t min_frequency = 2;                              // pairs seen fewer times are not merged
};

/// A byte-level BPE tokenizer learnt from `texts` (GPT-2's pre-tokenizer, the most frequent pair
/// merged first, ties to the pair whose merged bytes sort first; merging stops when no pair is
/// seen min_frequency times), as the text of a standard tokenizer.json that the `tokenizers`
/// library and load_tokenizer read.
std::string train_bpe(const std::vector<std::string_view>& texts, const BpeTrainOptions& options);

/// A SentencePiece model learnt from the text files `inputs` with libsentencepiece's trainer
/// (BPE or unigram; byte fallback, newlines and whitespace kept), written to `prefix`.model. Its
/// vocabulary holds the 256 byte pieces; a small corpus may give fewer pieces than `vocab_size`.
void train_sentencepiece(const std::vector<std::string>& inputs, const std::string& prefix, int64_t vocab_size,
                         const std::string& model_type);

}  // namespace ztrain::gpt_app
