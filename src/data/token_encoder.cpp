// token_encoder.cpp — TokenEncoder (token_encoder.hpp): tools/hf_tokenizer.py's
// encoding in C++, the pre-tokenizer through PCRE2.
#include "data/token_encoder.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "data/tokenizer.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

// The GPT-2 pattern ByteLevel uses when its use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Pre-tokens longer than this are not remembered (a long run seen once would fill the cache).
constexpr size_t kCachePieceBytes = 64;
constexpr size_t kCacheEntries = size_t(1) << 20;

struct Range {
  uint32_t first, last;
};
constexpr Range kNfcUnstable[] = {
#include "data/nfc_unstable.inc"
};

bool nfc_unstable(uint32_t cp) {
  const Range* end = std::end(kNfcUnstable);
  const Range* r = std::upper_bound(std::begin(kNfcUnstable), end, cp,
                                    [](uint32_t c, const Range& x) { return c < x.first; });
  return r != std::begin(kNfcUnstable) && cp <= (r - 1)->last;
}

// Python's str.isspace, which tools/hf_tokenizer.py strips around lstrip / rstrip tokens.
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point at s[i] of valid UTF-8 and its length.
uint32_t decode_at(std::string_view s, size_t i, size_t& len) {
  const auto c = static_cast<unsigned char>(s[i]);
  len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// The byte offset of the first byte that is not valid UTF-8, or npos.
size_t invalid_utf8_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) n = 1;
    else if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return i;
    if (i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return i;
    }
    i += n;
  }
  return std::string_view::npos;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The ByteLevel alphabet: the UTF-8 of the character that shows each byte
// (printable Latin-1 shows itself; the other 68 bytes U+0100, U+0101, ...).
const std::vector<std::string>& byte_alphabet() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      append_utf8(t[size_t(b)], printable ? uint32_t(b) : uint32_t(0x100 + extra++));
    }
    return t;
  }();
  return table;
}

// ---------------------------------------------------------------- tokenizer.json's parts

using nlohmann::json;

// An id of the file (`entry` names it) within [0, kMaxTokenizerIds): a negative
// or huge one is a damaged file, refused before it is kept.
int32_t checked_token_id(const json& id, const std::string& entry, const std::string& where) {
  SHARDLM_CHECK(id.is_number_integer(), "%s: %s is not an id", where.c_str(), entry.c_str());
  const bool in_range = id.is_number_unsigned() ? id.get<uint64_t>() < uint64_t(kMaxTokenizerIds)
                                                : id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxTokenizerIds;
  SHARDLM_CHECK(in_range, "%s: %s has id %s; an id must be in [0, %lld)", where.c_str(), entry.c_str(),
                id.dump().c_str(), static_cast<long long>(kMaxTokenizerIds));
  return static_cast<int32_t>(id.get<int64_t>());
}

// model: byte-level BPE. Fills the vocabulary (alphabet string -> id) and the
// merges' ranks ("left right" -> rank); throws on what this encoder does not support.
void read_bpe(const json& model, const std::string& where, std::unordered_map<std::string, int32_t>& vocab,
              std::unordered_map<std::string, int32_t>& ranks, bool& ignore_merges) {
  const std::string kind = model.value("type", model.contains("merges") ? "BPE" : "");
  SHARDLM_CHECK(kind == "BPE", "%s: model type '%s' is not supported (only byte-level BPE)", where.c_str(),
                kind.c_str());
  SHARDLM_CHECK(!model.value("byte_fallback", false),
                "%s: BPE with byte_fallback (SentencePiece-style, Llama 2) is not supported", where.c_str());
  const auto nonempty = [&](const char* key) {
    return model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty();
  };
  SHARDLM_CHECK(!nonempty("continuing_subword_prefix") && !nonempty("end_of_word_suffix"),
                "%s: BPE with a subword prefix or suffix is not supported", where.c_str());
  SHARDLM_CHECK(!model.contains("dropout") || model["dropout"].is_null() || model["dropout"].get<double>() == 0.0,
                "%s: BPE dropout is not supported", where.c_str());
  SHARDLM_CHECK(model.contains("vocab") && model["vocab"].is_object() && !model["vocab"].empty(),
                "%s: model.vocab must be a non-empty object", where.c_str());
  for (const auto& [piece, id] : model["vocab"].items())
    vocab[piece] = checked_token_id(id, "model.vocab['" + piece + "']", where);
  ignore_merges = model.value("ignore_merges", false);
  // Merges as the `tokenizers` package takes them: two vocabulary pieces, as
  // "left right" or [left, right], whose concatenation is in the vocabulary
  // too. A merge that can never apply would leave text byte by byte, silently.
  if (!model.contains("merges") || model["merges"].is_null()) return;
  const json& merges = model["merges"];
  const std::string type = merges.type_name();
  SHARDLM_CHECK(merges.is_array(), "%s: model.merges must be an array of pairs, found a%s %s", where.c_str(),
                type[0] == 'a' || type[0] == 'o' ? "n" : "", type.c_str());
  int32_t rank = 0;
  for (const json& m : merges) {
    std::string left, right, shown;
    if (m.is_string()) {
      shown = m.get<std::string>();
      const size_t space = shown.find(' ');
      SHARDLM_CHECK(space != std::string::npos && space > 0 && space + 1 < shown.size() &&
                        shown.find(' ', space + 1) == std::string::npos,
                    "%s: model.merges[%d] '%s' is not two pieces separated by one space", where.c_str(), rank,
                    shown.c_str());
      left = shown.substr(0, space), right = shown.substr(space + 1);
    } else {
      SHARDLM_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string() &&
                        !m[0].get<std::string>().empty() && !m[1].get<std::string>().empty(),
                    "%s: model.merges[%d] is not a pair of strings", where.c_str(), rank);
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
      shown = left + " " + right;
    }
    for (const std::string& piece : {left, right, left + right})
      SHARDLM_CHECK(vocab.count(piece), "%s: model.merges[%d] '%s': '%s' is not in model.vocab", where.c_str(), rank,
                    shown.c_str(), piece.c_str());
    ranks.emplace(left + " " + right, rank++);  // the first rank of a pair counts
  }
}

// normalizer: none (false) or NFC (true); throws on any other.
bool nfc_normalizer(const json& spec, const std::string& where) {
  if (!spec.contains("normalizer") || spec["normalizer"].is_null()) return false;
  const json& n = spec["normalizer"];
  const std::string type = n.value("type", "");
  if (type == "NFC") return true;
  SHARDLM_CHECK(type == "Sequence" && (!n.contains("normalizers") || n["normalizers"].empty()),
                "%s: normalizer '%s' is not supported (none or NFC)", where.c_str(), type.c_str());
  return false;
}

// pre-tokenizer: [Split(regex, Isolated)] then ByteLevel. The pattern that
// splits the text into pre-tokens (ByteLevel's GPT-2 pattern when it has
// use_regex; the whole text when there is none); throws on any other.
std::string pre_tokenizer_pattern(const json& spec, const std::string& where) {
  std::string pattern;
  bool have_pattern = false, byte_level = false;
  std::vector<json> steps;
  if (spec.contains("pre_tokenizer") && !spec["pre_tokenizer"].is_null()) {
    const json& pre = spec["pre_tokenizer"];
    if (pre.value("type", "") == "Sequence")
      for (const json& s : pre.value("pretokenizers", json::array())) steps.push_back(s);
    else
      steps.push_back(pre);
  }
  for (const json& step : steps) {
    const std::string type = step.value("type", "");
    if (type == "Split") {
      SHARDLM_CHECK(!have_pattern && !byte_level, "%s: only one Split, before ByteLevel, is supported",
                    where.c_str());
      SHARDLM_CHECK(step.value("behavior", "") == "Isolated" && !step.value("invert", false),
                    "%s: Split with behavior '%s' is not supported (Isolated only)", where.c_str(),
                    step.value("behavior", "").c_str());
      const json& source = step.value("pattern", json::object());
      if (source.contains("Regex")) {
        pattern = source["Regex"].get<std::string>();
      } else {
        SHARDLM_CHECK(source.contains("String"), "%s: Split pattern has no Regex or String", where.c_str());
        pattern = "\\Q" + source["String"].get<std::string>() + "\\E";
      }
      have_pattern = true;
    } else if (type == "ByteLevel") {
      byte_level = true;
      SHARDLM_CHECK(!step.value("add_prefix_space", false),
                    "%s: ByteLevel add_prefix_space = true is not supported", where.c_str());
      if (step.value("use_regex", true)) {
        SHARDLM_CHECK(!have_pattern, "%s: a Split followed by ByteLevel use_regex is not supported",
                      where.c_str());
        pattern = kGpt2Pattern;
        have_pattern = true;
      }
    } else {
      SHARDLM_FAIL("%s: pre-tokenizer '%s' is not supported (Split and ByteLevel only)", where.c_str(),
                   type.c_str());
    }
  }
  SHARDLM_CHECK(byte_level, "%s: no ByteLevel pre-tokenizer; only byte-level BPE is supported", where.c_str());
  if (!have_pattern) pattern = "(?s).+";
  return pattern;
}

}  // namespace

struct TokenEncoder::Regex {
  pcre2_code* code = nullptr;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

TokenEncoder::TokenEncoder(TokenEncoder&&) noexcept = default;
TokenEncoder& TokenEncoder::operator=(TokenEncoder&&) noexcept = default;
TokenEncoder::~TokenEncoder() = default;

TokenEncoder TokenEncoder::load(const std::string& path) {
  std::string file;
  const std::string text = read_tokenizer_json(path, file);
  return from_json_text(text, file);
}

TokenEncoder TokenEncoder::from_json_text(std::string_view json_text, const std::string& where) {
  using nlohmann::json;
  json spec;
  try {
    spec = json::parse(json_text);
  } catch (const json::exception& e) {
    SHARDLM_FAIL("%s: invalid JSON: %s", where.c_str(), e.what());
  }
  SHARDLM_CHECK(spec.is_object() && spec.contains("model") && spec["model"].is_object(),
                "%s: not a tokenizer.json (no 'model' object)", where.c_str());
  TokenEncoder enc;
  enc.where_ = where;
  try {
    read_bpe(spec["model"], where, enc.vocab_, enc.ranks_, enc.ignore_merges_);
    enc.nfc_ = nfc_normalizer(spec, where);
    const std::string pattern = pre_tokenizer_pattern(spec, where);
    int error = 0;
    PCRE2_SIZE offset = 0;
    enc.split_ = std::make_unique<Regex>();
    enc.split_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
    if (!enc.split_->code) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      SHARDLM_FAIL("%s: the Split pattern does not compile (PCRE2, at offset %zu): %s", where.c_str(),
                   size_t(offset), reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(enc.split_->code, PCRE2_JIT_COMPLETE);  // faster where the JIT exists; optional
    // ---- added tokens
    const json added = spec.contains("added_tokens") && !spec["added_tokens"].is_null() ? spec["added_tokens"]
                                                                                          : json::array();
    SHARDLM_CHECK(added.is_array(), "%s: added_tokens must be an array", where.c_str());
    for (size_t index = 0; index < added.size(); ++index) {
      const json& e = added[index];
      SHARDLM_CHECK(e.is_object() && e.contains("id") && e.contains("content") && e["content"].is_string(),
                    "%s: added_tokens[%zu] needs an integer 'id' and a string 'content'", where.c_str(), index);
      const std::string content = e["content"].get<std::string>();
      // An empty token would match at every position of every text.
      SHARDLM_CHECK(!content.empty(), "%s: added_tokens[%zu] has an empty 'content'", where.c_str(), index);
      const int32_t id = checked_token_id(e["id"], fmt("added_tokens[%zu] '%s'", index, content.c_str()), where);
      SHARDLM_CHECK(!e.value("single_word", false), "%s: added token '%s' has single_word = true, which this "
                    "encoder does not support", where.c_str(), content.c_str());
      enc.added_.push_back({content, id, e.value("lstrip", false), e.value("rstrip", false)});
    }
    // Longest first (then by text), as tools/hf_tokenizer.py's alternation.
    std::sort(enc.added_.begin(), enc.added_.end(), [](const Added& a, const Added& b) {
      return a.content.size() != b.content.size() ? a.content.size() > b.content.size() : a.content < b.content;
    });
  } catch (const nlohmann::json::exception& e) {
    SHARDLM_FAIL("%s: unexpected structure: %s", where.c_str(), e.what());
  }
  return enc;
}

std::vector<int32_t> TokenEncoder::encode(std::string_view text) const {
  const size_t bad = invalid_utf8_at(text);
  SHARDLM_CHECK(bad == std::string_view::npos, "the text to tokenize is not valid UTF-8 (byte %zu)", bad);
  std::vector<int32_t> ids;
  if (added_.empty()) {
    encode_plain(text, ids);
    return ids;
  }
  size_t start = 0;  // the plain text not yet encoded begins here
  size_t i = 0;
  while (i < text.size()) {
    const Added* hit = nullptr;
    for (const Added& a : added_)
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      size_t len = 0;
      decode_at(text, i, len);
      i += len;
      continue;
    }
    std::string_view before = text.substr(start, i - start);
    if (hit->lstrip)  // the whitespace before it is the token's
      while (!before.empty()) {
        size_t k = before.size() - 1;
        while (k > 0 && (static_cast<unsigned char>(before[k]) & 0xC0) == 0x80) --k;
        size_t len = 0;
        if (!is_space(decode_at(before, k, len))) break;
        before = before.substr(0, k);
      }
    if (!before.empty()) encode_plain(before, ids);
    ids.push_back(hit->id);
    i += hit->content.size();
    if (hit->rstrip)  // and the whitespace after it
      while (i < text.size()) {
        size_t len = 0;
        if (!is_space(decode_at(text, i, len))) break;
        i += len;
      }
    start = i;
  }
  if (start < text.size()) encode_plain(text.substr(start), ids);
  return ids;
}

void TokenEncoder::encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
  if (nfc_)
    for (size_t i = 0; i < text.size();) {
      size_t len = 0;
      const uint32_t cp = decode_at(text, i, len);
      SHARDLM_CHECK(!nfc_unstable(cp),
                    "%s normalizes text to NFC, and the text holds U+%04X (at byte %zu), a character NFC may change "
                    "or combine; shardlm's encoder takes such text only when it is already NFC-stable: tokenize "
                    "it with tools/make_prompts.py (Python's unicodedata) instead",
                    where_.c_str(), cp, i);
      i += len;
    }
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(split_->code, nullptr);
  SHARDLM_CHECK(match, "out of memory for a PCRE2 match");
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const std::vector<std::string>& alphabet = byte_alphabet();
  auto piece = [&](std::string_view p) {
    if (p.empty()) return;
    if (p.size() <= kCachePieceBytes)
      if (auto it = cache_.find(std::string(p)); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    std::string word;
    for (char c : p) word += alphabet[static_cast<unsigned char>(c)];
    const size_t first = ids.size();
    bpe(word, ids);
    if (p.size() <= kCachePieceBytes) {
      if (cache_.size() >= kCacheEntries) cache_.clear();
      cache_.emplace(std::string(p), std::vector<int32_t>(ids.begin() + long(first), ids.end()));
    }
  };
  size_t at = 0;
  try {
    while (at < text.size()) {
      const int rc = pcre2_match(split_->code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, match, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      SHARDLM_CHECK(rc >= 0, "%s: the pre-tokenizer's regex failed (PCRE2 error %d)", where_.c_str(), rc);
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
      size_t b = ov[0], e = ov[1];
      piece(text.substr(at, b - at));  // what no match covers is a piece of its own (Isolated)
      if (e == b) {                    // an empty match: step over one character
        size_t len = 0;
        decode_at(text, e, len);
        e += len;
      }
      piece(text.substr(b, e - b));
      at = e;
    }
    piece(text.substr(at));
  } catch (...) {
    pcre2_match_data_free(match);
    throw;
  }
  pcre2_match_data_free(match);
}

void TokenEncoder::bpe(const std::string& word, std::vector<int32_t>& ids) const {
  if (ignore_merges_)
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  std::vector<std::string> parts;  // one alphabet character each, then merged pieces
  for (size_t i = 0; i < word.size();) {
    size_t len = 0;
    decode_at(word, i, len);
    parts.emplace_back(word.substr(i, len));
    i += len;
  }
  std::string key;
  while (parts.size() > 1) {
    int32_t best_rank = -1;
    size_t best = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      key.assign(parts[i]).append(" ").append(parts[i + 1]);
      if (auto it = ranks_.find(key); it != ranks_.end() && (best_rank < 0 || it->second < best_rank)) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank < 0) break;
    const std::string left = parts[best], right = parts[best + 1];
    std::vector<std::string> merged;
    merged.reserve(parts.size());
    for (size_t i = 0; i < parts.size();) {
      if (i + 1 < parts.size() && parts[i] == left && parts[i + 1] == right) {
        merged.push_back(left + right);
        i += 2;
      } else {
        merged.push_back(std::move(parts[i]));
        i += 1;
      }
    }
    parts = std::move(merged);
  }
  for (const std::string& p : parts) {
    auto it = vocab_.find(p);
    SHARDLM_CHECK(it != vocab_.end(), "%s: piece '%s' is not in the vocabulary (the file's merges and vocab disagree)",
                  where_.c_str(), p.c_str());
    ids.push_back(it->second);
  }
}

}  // namespace shardlm
