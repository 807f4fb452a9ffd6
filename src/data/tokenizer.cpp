// tokenizer.cpp — TokenDecoder, StreamDecoder and the UTF-8 helpers (tokenizer.hpp).
#include "data/tokenizer.hpp"

#include <array>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardlm/error.hpp"

namespace shardlm {
namespace {

constexpr int kNoByte = -1;

// The ByteLevel alphabet, inverted: the code point that shows byte b is b itself
// for printable Latin-1 (! .. ~, ¡ .. ¬, ® .. ÿ); the other 68 bytes, in
// increasing order, are shown as U+0100, U+0101, ...
std::array<int, 324> alphabet_to_byte() {
  std::array<int, 324> table;
  table.fill(kNoByte);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[printable ? b : 0x100 + extra++] = b;
  }
  return table;
}

// Code points of valid UTF-8 text (the JSON strings nlohmann hands over are valid).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

// A vocabulary piece's bytes: through the alphabet, or as its own UTF-8 when
// some character is not in it (a piece that is not byte-level).
std::string piece_bytes(const std::string& piece, const std::array<int, 324>& table) {
  std::string out;
  for (uint32_t cp : code_points(piece)) {
    if (cp >= table.size() || table[cp] == kNoByte) return piece;
    out.push_back(static_cast<char>(table[cp]));
  }
  return out;
}

// How many bytes the sequence led by `lead` has (0: not a lead byte), and the
// range its second byte must lie in (Unicode Table 3-7).
int sequence_length(unsigned char lead, unsigned char& lo, unsigned char& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) {
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;  // no surrogates
    return 3;
  }
  if (lead >= 0xF0 && lead <= 0xF4) {
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
    return 4;
  }
  return 0;
}

// Bytes of a well-formed sequence starting at s[i], or of the longest prefix of
// one (the maximal subpart) as a negative number; 0 for a byte no sequence starts with.
int next_sequence(std::string_view s, size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return 1;
  unsigned char lo, hi;
  const int n = sequence_length(lead, lo, hi);
  if (n == 0) return 0;
  int k = 1;
  for (; k < n && i + k < s.size(); ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) break;
  }
  return k == n ? n : -k;
}

}  // namespace

std::string replace_invalid_utf8(std::string_view bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const int n = next_sequence(bytes, i);
    if (n > 0) {
      out.append(bytes.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      out += kReplacement;  // one U+FFFD per maximal subpart (or lone bad byte)
      i += static_cast<size_t>(n == 0 ? 1 : -n);
    }
  }
  return out;
}

size_t finished_utf8_prefix(std::string_view bytes) {
  // Only the last three bytes can hold the start of an unfinished character.
  const size_t first = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = bytes.size(); i-- > first;) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x80 && c <= 0xBF) continue;  // a continuation byte: look further back
    unsigned char lo, hi;
    const int n = sequence_length(c, lo, hi);
    const int have = static_cast<int>(bytes.size() - i);
    if (n > have && next_sequence(bytes, i) == -have) return i;  // a valid start, not yet complete
    return bytes.size();
  }
  return bytes.size();
}

std::string read_tokenizer_json(const std::string& path, std::string& file) {
  namespace fs = std::filesystem;
  file = path;
  if (fs::is_directory(path)) {
    file = (fs::path(path) / "tokenizer.json").string();
    SHARDLM_CHECK(fs::is_regular_file(file), "%s: folder has no tokenizer.json", path.c_str());
  }
  SHARDLM_CHECK(fs::is_regular_file(file), "%s: tokenizer file does not exist", file.c_str());
  std::ifstream in(file, std::ios::binary);
  SHARDLM_CHECK(in.good(), "%s: cannot open the tokenizer file", file.c_str());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TokenDecoder TokenDecoder::load(const std::string& path) {
  std::string file;
  const std::string text = read_tokenizer_json(path, file);
  return from_json_text(text, file);
}

TokenDecoder TokenDecoder::from_json_text(std::string_view json_text, const std::string& where) {
  nlohmann::json spec;
  try {
    spec = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    SHARDLM_FAIL("%s: invalid JSON: %s", where.c_str(), e.what());
  }
  SHARDLM_CHECK(spec.is_object() && spec.contains("model") && spec["model"].is_object(),
                "%s: not a tokenizer.json (no 'model' object)", where.c_str());
  const auto& model = spec["model"];
  const std::string type = model.value("type", std::string("BPE"));
  SHARDLM_CHECK(type == "BPE", "%s: model type '%s' is not supported (only byte-level BPE)", where.c_str(),
                type.c_str());
  SHARDLM_CHECK(model.contains("vocab") && model["vocab"].is_object() && !model["vocab"].empty(),
                "%s: model.vocab must be a non-empty object", where.c_str());
  if (spec.contains("decoder") && !spec["decoder"].is_null()) {
    const std::string decoder = spec["decoder"].value("type", std::string("?"));
    SHARDLM_CHECK(decoder == "ByteLevel", "%s: decoder '%s' is not supported (ByteLevel)", where.c_str(),
                  decoder.c_str());
  }

  // (id, bytes, special) of every entry first: the size is the largest id + 1.
  struct Entry {
    int64_t id;
    std::string bytes;
    bool special;
  };
  std::vector<Entry> entries;
  const auto table = alphabet_to_byte();
  // An id is checked before it sizes or indexes anything.
  const auto checked_id = [&](const nlohmann::json& id, const std::string& entry) {
    const bool in_range = id.is_number_unsigned() ? id.get<uint64_t>() < uint64_t(kMaxTokenizerIds)
                                                  : id.get<int64_t>() >= 0 && id.get<int64_t>() < kMaxTokenizerIds;
    SHARDLM_CHECK(in_range, "%s: %s has id %s; an id must be in [0, %lld)", where.c_str(), entry.c_str(),
                  id.dump().c_str(), static_cast<long long>(kMaxTokenizerIds));
    return id.get<int64_t>();
  };
  for (const auto& [piece, id] : model["vocab"].items()) {
    SHARDLM_CHECK(id.is_number_integer(), "%s: model.vocab['%s'] is not an id", where.c_str(), piece.c_str());
    entries.push_back({checked_id(id, "model.vocab['" + piece + "']"), piece_bytes(piece, table), false});
  }
  if (spec.contains("added_tokens") && !spec["added_tokens"].is_null()) {
    SHARDLM_CHECK(spec["added_tokens"].is_array(), "%s: added_tokens must be an array", where.c_str());
    size_t index = 0;
    for (const auto& token : spec["added_tokens"]) {
      SHARDLM_CHECK(token.is_object() && token.contains("id") && token["id"].is_number_integer() &&
                        token.contains("content") && token["content"].is_string(),
                    "%s: added_tokens[%zu] needs an integer 'id' and a string 'content'", where.c_str(), index);
      const std::string content = token["content"].get<std::string>();
      entries.push_back({checked_id(token["id"], fmt("added_tokens[%zu] '%s'", index, content.c_str())), content,
                         token.value("special", false)});
      ++index;
    }
  }
  int64_t size = 0;
  for (const auto& e : entries) size = std::max(size, e.id + 1);
  TokenDecoder decoder;
  decoder.where_ = where;
  decoder.token_bytes_.resize(static_cast<size_t>(size));
  decoder.special_.assign(static_cast<size_t>(size), 0);
  for (auto& e : entries) {  // added tokens come last, so they win over a vocabulary piece with their id
    decoder.token_bytes_[static_cast<size_t>(e.id)] = std::move(e.bytes);
    decoder.special_[static_cast<size_t>(e.id)] = e.special ? 1 : 0;
  }
  return decoder;
}

void TokenDecoder::check_id(int32_t id) const {
  SHARDLM_CHECK(id >= 0 && id < vocab_size(), "token id %d is outside the vocabulary (0..%lld) of %s", id,
                static_cast<long long>(vocab_size() - 1), where_.c_str());
}

bool TokenDecoder::is_special(int32_t id) const {
  check_id(id);
  return special_[static_cast<size_t>(id)] != 0;
}

const std::string& TokenDecoder::token_bytes(int32_t id) const {
  check_id(id);
  return token_bytes_[static_cast<size_t>(id)];
}

std::string TokenDecoder::bytes(std::span<const int32_t> ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (skip_special && is_special(id)) continue;
    out += token_bytes(id);
  }
  return out;
}

std::string TokenDecoder::text(std::span<const int32_t> ids, bool skip_special) const {
  return replace_invalid_utf8(bytes(ids, skip_special));
}

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_ && decoder_.is_special(id)) return {};
  pending_ += decoder_.token_bytes(id);
  const size_t finished = finished_utf8_prefix(pending_);
  std::string out = replace_invalid_utf8(std::string_view(pending_).substr(0, finished));
  pending_.erase(0, finished);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = replace_invalid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace shardlm
