// test_token_encoder.cpp — src/data/token_encoder: text to ids on a hand-made
// byte-level tokenizer.json (merges by rank, the GPT-2 pre-tokenizer, a Split
// regex, added tokens with lstrip / rstrip, ignore_merges, NFC refusals, load
// errors); and, run by tests/scripts/test_tokenizer.sh with --no-skip, agreement
// with @huggingface/tokenizers (pure JS) on the real Llama 3 and Qwen3 files.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "data/token_encoder.hpp"
#include "shardlm/error.hpp"

using shardlm::TokenEncoder;

namespace {

// Ġ = the space byte in the ByteLevel alphabet, Ċ the newline, Ã © the bytes of
// é. Merges by rank: "Ġ a" (0), "a b" (1), "Ġa b" (2), "ab c" (3).
std::string tiny(const std::string& pre_tokenizer, const std::string& normalizer = "null",
                 const std::string& extra_model = "") {
  return R"({"added_tokens": [
      {"id": 20, "content": "<|end|>", "special": true},
      {"id": 21, "content": "<|end|>x", "special": true},
      {"id": 22, "content": "<L>", "special": true, "lstrip": true},
      {"id": 23, "content": "<R>", "special": true, "rstrip": true}],
    "normalizer": )" + normalizer + R"(,
    "pre_tokenizer": )" + pre_tokenizer + R"(,
    "model": {"type": "BPE", )" + extra_model + R"("vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4, "\u0120a": 5,
              "abc": 6, "\u0120ab": 7, "1": 8, "2": 9, "3": 10, "\u00c3": 11, "\u00a9": 12, "\u010a": 13,
              "\u0120\u0120": 14, "cab": 15},
              "merges": ["\u0120 a", "a b", "\u0120a b", "ab c"]}})";
}
const std::string kByteLevel = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const shardlm::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<int32_t> ids(std::initializer_list<int32_t> l) { return std::vector<int32_t>(l); }

}  // namespace

TEST_CASE("token encoder: BPE by merge rank through the GPT-2 pre-tokenizer") {
  const TokenEncoder e = TokenEncoder::from_json_text(tiny(kByteLevel), "tiny");
  CHECK(e.encode("ab") == ids({4}));
  CHECK(e.encode("abc") == ids({6}));               // a b -> ab, ab c -> abc
  CHECK(e.encode(" ab") == ids({7}));               // Ġ a first (rank 0), then Ġa b (rank 2)
  CHECK(e.encode("ab abc") == ids({4, 7, 2}));      // " abc": Ġ a, Ġa b; "Ġab c" is no merge
  CHECK(e.encode("cab") == ids({2, 4}));            // no "c ab" merge: the vocab's "cab" is not reached
  CHECK(e.encode("123") == ids({8, 9, 10}));        // ?\p{N}+ is one pre-token; no merges
  CHECK(e.encode("\u00e9") == ids({11, 12}));       // é = C3 A9, shown as Ã ©
  CHECK(e.encode("") == ids({}));
  CHECK(e.encode("a\n") == ids({0, 13}));           // \n is byte 0x0A -> Ċ
  CHECK(e.encode("a  ") == ids({0, 3, 3}));         // "  " at the end: \s+(?!\S) then no merge of Ġ Ġ
}

TEST_CASE("token encoder: added tokens, longest first, lstrip and rstrip") {
  const TokenEncoder e = TokenEncoder::from_json_text(tiny(kByteLevel), "tiny");
  CHECK(e.encode("ab<|end|>ab") == ids({4, 20, 4}));
  CHECK(e.encode("<|end|>x") == ids({21}));         // the longer added token wins
  CHECK(e.encode("<|end|>a") == ids({20, 0}));
  CHECK(e.encode("a <L>b") == ids({0, 22, 1}));     // lstrip: the space before <L> is its
  CHECK(e.encode("a<R>  b") == ids({0, 23, 1}));    // rstrip: the spaces after <R> are its
  CHECK(e.encode("a <R> b") == ids({0, 3, 23, 1})); // the space before <R> stays text
  CHECK(error_of([&] { e.encode("<|end"); }).find("piece '<' is not in the vocabulary") !=
        std::string::npos);                         // a broken added token is plain text
}

TEST_CASE("token encoder: a Split regex (Isolated) before ByteLevel without its own regex") {
  const std::string split = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{N}{1,2}| ?\\p{L}+|\\s+"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})";
  const TokenEncoder e = TokenEncoder::from_json_text(tiny(split), "split");
  CHECK(e.encode("123") == ids({8, 9, 10}));        // "12" and "3": no merges either way
  CHECK(e.encode("ab ab") == ids({4, 7}));
  CHECK(error_of([&] { e.encode(";"); }).find("piece ';' is not in the vocabulary") != std::string::npos);
}

TEST_CASE("token encoder: ignore_merges takes a whole pre-token that is in the vocabulary") {
  const TokenEncoder with = TokenEncoder::from_json_text(tiny(kByteLevel, "null", R"("ignore_merges": true, )"), "t");
  const TokenEncoder without = TokenEncoder::from_json_text(tiny(kByteLevel), "t");
  CHECK(with.encode("cab") == ids({15}));
  CHECK(without.encode("cab") == ids({2, 4}));
}

TEST_CASE("token encoder: NFC tokenizers take NFC-stable text and refuse the rest by name") {
  const TokenEncoder e = TokenEncoder::from_json_text(tiny(kByteLevel, R"({"type": "NFC"})"), "nfc.json");
  CHECK(e.encode("ab") == ids({4}));
  const std::string why = error_of([&] { e.encode("ab\xCC\x81"); });  // a + U+0301 combining acute
  CHECK(why.find("nfc.json normalizes text to NFC") != std::string::npos);
  CHECK(why.find("U+0301 (at byte 2)") != std::string::npos);
  CHECK(why.find("tools/make_prompts.py") != std::string::npos);
  CHECK(error_of([&] { e.encode("\xE2\x84\xAB"); }).find("U+212B") != std::string::npos);  // ANGSTROM SIGN -> Å
  // Without a normalizer the same text is encoded as it is.
  const TokenEncoder plain = TokenEncoder::from_json_text(tiny(kByteLevel), "plain");
  CHECK(error_of([&] { plain.encode("a\xCC\x81"); }).find("not in the vocabulary") != std::string::npos);
}

TEST_CASE("token encoder: bad files and bad text are named") {
  CHECK(error_of([] { TokenEncoder::from_json_text("{", "x.json"); }).find("x.json: invalid JSON") == 0);
  CHECK(error_of([] { TokenEncoder::from_json_text(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})", "w"); })
            .find("model type 'WordPiece' is not supported") != std::string::npos);
  CHECK(error_of([] { TokenEncoder::from_json_text(tiny(R"({"type": "Whitespace"})"), "p"); })
            .find("pre-tokenizer 'Whitespace' is not supported") != std::string::npos);
  CHECK(error_of([] { TokenEncoder::from_json_text(tiny(kByteLevel, R"({"type": "NFKC"})"), "n"); })
            .find("normalizer 'NFKC' is not supported") != std::string::npos);
  const std::string bad_regex = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})";
  CHECK(error_of([&] { TokenEncoder::from_json_text(tiny(bad_regex), "r"); }).find("does not compile") !=
        std::string::npos);
  CHECK(error_of([] { TokenEncoder::load("/nonexistent/tok.json"); }).find("does not exist") != std::string::npos);
  const TokenEncoder e = TokenEncoder::from_json_text(tiny(kByteLevel), "t");
  CHECK(error_of([&] { e.encode("ab\xFF"); }).find("not valid UTF-8 (byte 2)") != std::string::npos);
}

namespace {
std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}
}  // namespace

// tests/scripts/test_tokenizer.sh writes SHARDLM_ENCODER_CASES: a tokenizer.json
// path on the first line, then per case "text hex\tids (comma separated)\t0|1" with the
// ids @huggingface/tokenizers gives and 1 where the text holds a character NFC may
// change (tools/gen_nfc_unstable.py; only an NFC tokenizer's); it runs this case with --no-skip.
TEST_CASE("token encoder: agrees with @huggingface/tokenizers on real files" * doctest::skip()) {
  const char* cases_path = std::getenv("SHARDLM_ENCODER_CASES");
  REQUIRE_MESSAGE(cases_path != nullptr, "set SHARDLM_ENCODER_CASES (tests/scripts/test_tokenizer.sh does)");
  std::ifstream in(cases_path);
  REQUIRE(in.good());
  std::string tokenizer_path, line;
  std::getline(in, tokenizer_path);
  const TokenEncoder e = TokenEncoder::load(tokenizer_path);
  int cases = 0, equal = 0, refused_nfc = 0, tokens = 0;
  std::string first_difference;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t'), tab2 = line.find('\t', tab + 1);
    const std::string text = from_hex(line.substr(0, tab));
    const bool may_change = line.substr(tab2 + 1) == "1";  // holds a character NFC may change (Python's view)
    std::vector<int32_t> want;
    std::istringstream id_stream(line.substr(tab + 1, tab2 - tab - 1));
    for (std::string id; std::getline(id_stream, id, ',');) want.push_back(std::stoi(id));
    ++cases;
    tokens += static_cast<int>(want.size());
    try {
      const std::vector<int32_t> got = e.encode(text);
      if (got == want) ++equal;
      else if (first_difference.empty()) first_difference = "case " + std::to_string(cases) + ": " + line.substr(0, 80);
    } catch (const shardlm::Error& err) {
      if (std::string(err.what()).find("normalizes text to NFC") != std::string::npos && may_change) ++refused_nfc;
      else if (first_difference.empty()) first_difference = err.what();
    }
  }
  MESSAGE(tokenizer_path << ": " << cases << " texts, " << tokens << " tokens; equal " << equal
                         << ", refused as not NFC-stable " << refused_nfc << " " << first_difference);
  CHECK(cases > 100);
  CHECK(equal + refused_nfc == cases);  // refused only texts with a character NFC may change
  CHECK(equal * 2 > cases);
}
