// token_encoder.hpp — text to token ids with a Hugging Face tokenizer.json
// (byte-level BPE: Llama 3 / 3.1 / 3.2, Qwen2 / 2.5 / 3), for a prompt given as
// text (`shardlm generate --prompt`, `shardlm tokenize`).
//
// Owns: TokenEncoder — added (special) tokens matched in the text first
// (longest first, their lstrip / rstrip), the Split-regex + ByteLevel
// pre-tokenizer (PCRE2 with Unicode properties; ByteLevel's own GPT-2 pattern
// when it has use_regex), byte-level BPE by merge rank (ignore_merges
// honoured), and the NFC normalizer of the files that declare one. The same
// algorithm as tools/hf_tokenizer.py, which tokenizes data before a run; both
// are checked against the pure-JS @huggingface/tokenizers on the real files
// (tests/scripts/test_tokenizer.sh). Ids are those of add_special_tokens =
// False: no BOS is added.
//
// NFC: without an ICU here, a text for an NFC tokenizer must already be its own
// NFC form, which holds for every text free of the ~2,100 code points that NFC
// can change or combine (combining marks, Hangul jamo, compatibility
// singletons: src/data/nfc_unstable.inc). Other text is refused with a message
// naming the character; tools/make_prompts.py tokenizes it.
// Must not know: models, MPI, kernels, files other than the tokenizer.json.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shardlm {

class TokenEncoder {
 public:
  // From a tokenizer.json, or a model folder that holds one. Throws shardlm::Error
  // naming the file: missing, not JSON, not a byte-level BPE tokenizer, a
  // pre-tokenizer or normalizer this encoder does not support.
  static TokenEncoder load(const std::string& path);
  static TokenEncoder from_json_text(std::string_view json_text, const std::string& where);
  TokenEncoder(TokenEncoder&&) noexcept;
  TokenEncoder& operator=(TokenEncoder&&) noexcept;
  ~TokenEncoder();

  // The ids of `text` (valid UTF-8; invalid bytes are refused by name).
  std::vector<int32_t> encode(std::string_view text) const;
  const std::string& where() const { return where_; }

 private:
  TokenEncoder() = default;
  struct Regex;  // the compiled pre-tokenizer pattern (PCRE2)
  struct Added {
    std::string content;
    int32_t id;
    bool lstrip, rstrip;
  };
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const;
  void bpe(const std::string& word, std::vector<int32_t>& ids) const;

  std::string where_;
  bool nfc_ = false;
  bool ignore_merges_ = false;
  std::unique_ptr<Regex> split_;
  std::unordered_map<std::string, int32_t> vocab_;   // alphabet string -> id
  std::unordered_map<std::string, int32_t> ranks_;   // "left right" -> merge rank
  std::vector<Added> added_;                          // longest content first
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;  // short pre-tokens seen
};

}  // namespace shardlm
