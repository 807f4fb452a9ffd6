// tokenizer.hpp — token ids back to text with a Hugging Face tokenizer.json
// (byte-level BPE: Llama 3 / 3.1 / 3.2, Qwen2 / 2.5 / 3), for the sampler and
// the rewards that read what a policy wrote.
//
// Owns: TokenDecoder (ids -> the exact bytes they stand for, and -> UTF-8 text
// with U+FFFD for bytes that are not valid UTF-8, as the `tokenizers` package
// and tools/hf_tokenizer.py decode), StreamDecoder (text as ids arrive, never
// cutting a character in two), and the UTF-8 helpers both use. Encoding text is
// tools/hf_tokenizer.py's job (data is tokenized before a run); this file knows
// nothing about models, MPI or kernels.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shardlm {

// Token ids a tokenizer.json may use: [0, kMaxTokenizerIds). The largest real
// vocabularies hold about 262K tokens; an id past this is a damaged file, refused
// (naming the entry) before the tables indexed by id are allocated.
constexpr int64_t kMaxTokenizerIds = int64_t(1) << 22;

// The text of a tokenizer.json, given as the file or a model folder that holds
// one; `file` gets the file's path (for messages). Throws Error naming what is
// missing or unreadable. TokenDecoder::load and TokenEncoder::load read through it.
std::string read_tokenizer_json(const std::string& path, std::string& file);

class TokenDecoder {
 public:
  // From a tokenizer.json, or a model folder that holds one. Throws shardlm::Error
  // naming the file: missing, not JSON, not a byte-level BPE tokenizer.
  static TokenDecoder load(const std::string& path);
  // From the text of a tokenizer.json; `where` names it in errors.
  static TokenDecoder from_json_text(std::string_view json_text, const std::string& where);

  int64_t vocab_size() const { return static_cast<int64_t>(token_bytes_.size()); }
  bool is_special(int32_t id) const;
  // The bytes of one id (an added token's text, or a vocabulary piece's bytes).
  const std::string& token_bytes(int32_t id) const;
  // The ids' bytes, exactly: a token may hold part of a character.
  std::string bytes(std::span<const int32_t> ids, bool skip_special = false) const;
  // The ids' text: bytes() with every maximal invalid UTF-8 sequence as U+FFFD.
  std::string text(std::span<const int32_t> ids, bool skip_special = false) const;
  const std::string& where() const { return where_; }

 private:
  void check_id(int32_t id) const;
  std::vector<std::string> token_bytes_;  // (vocab_size,) bytes per id
  std::vector<uint8_t> special_;          // (vocab_size,) 1 = a special added token
  std::string where_;
};

// Text as ids arrive: push() returns what is final so far; an unfinished
// character's bytes wait for the next id. The pushes' outputs followed by
// finish() are exactly TokenDecoder::text() of all the ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const TokenDecoder& decoder, bool skip_special = false)
      : decoder_(decoder), skip_special_(skip_special) {}
  std::string push(int32_t id);
  std::string finish();  // what is left (an unfinished character becomes U+FFFD)

 private:
  const TokenDecoder& decoder_;
  bool skip_special_;
  std::string pending_;  // bytes not yet turned into text (at most 3: one unfinished character)
};

// Bytes to valid UTF-8: each maximal subpart of an ill-formed sequence becomes
// U+FFFD (the Unicode Standard's recommended practice; Python's "replace").
std::string replace_invalid_utf8(std::string_view bytes);
// Length of the longest prefix of `bytes` that does not end inside a character
// that further bytes could still complete.
size_t finished_utf8_prefix(std::string_view bytes);

}  // namespace shardlm
