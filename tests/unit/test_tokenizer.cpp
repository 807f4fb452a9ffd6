// test_tokenizer.cpp — src/data/tokenizer: ids to bytes and text on a hand-made
// byte-level tokenizer.json (pieces and bytes taken from the real Qwen3 file),
// invalid and unfinished UTF-8 as Python's "replace" decodes it, streaming that
// never cuts a character, special tokens, every load error; and, run by
// tests/scripts/test_tokenizer.sh with --no-skip, agreement with
// tools/hf_tokenizer.py on the real Llama 3 and Qwen3 files.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "data/tokenizer.hpp"
#include "shardlm/error.hpp"

namespace fs = std::filesystem;
using shardlm::StreamDecoder;
using shardlm::TokenDecoder;

namespace {

// Byte-level pieces as the real Qwen3 tokenizer.json spells them: Ġ = 0x20,
// ðŁ = F0 9F, ¤ = A4, Ĺ = 97 (so ĠðŁ ¤ Ĺ is " 🤗"), ä½ ł å¥½ = E4 BD | A0 | E5 A5 BD (你好).
const char* kTinyTokenizer = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 10, "content": "<|im_end|>", "special": true},
    {"id": 11, "content": "<think>", "special": false}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
  "model": {"type": "BPE", "vocab": {"H": 0, "i": 1, "\u0120": 2, "Hi": 3, "\u0120\u00f0\u0141": 4,
                                     "\u00a4": 5, "\u0139": 6, "\u00e4\u00bd": 7, "\u0142": 8,
                                     "\u00e5\u00a5\u00bd": 9},
            "merges": ["H i"]}
})";

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("shardlm_test_tokenizer_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return path / name;
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const shardlm::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string streamed(const TokenDecoder& decoder, const std::vector<int32_t>& ids, std::vector<std::string>* parts) {
  StreamDecoder stream(decoder);
  std::string all;
  for (int32_t id : ids) {
    std::string piece = stream.push(id);
    if (parts) parts->push_back(piece);
    all += piece;
  }
  std::string rest = stream.finish();
  if (parts) parts->push_back(rest);
  return all + rest;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

}  // namespace

TEST_CASE("tokenizer: ids to exact bytes and text") {
  const TokenDecoder d = TokenDecoder::from_json_text(kTinyTokenizer, "tiny.json");
  CHECK(d.vocab_size() == 12);
  CHECK(d.bytes(std::vector<int32_t>{3, 4, 5, 6}) == "Hi \xF0\x9F\xA4\x97");
  CHECK(d.text(std::vector<int32_t>{3, 2, 4, 5, 6}) == "Hi  \xF0\x9F\xA4\x97");
  CHECK(d.text(std::vector<int32_t>{7, 8, 9}) == "\xE4\xBD\xA0\xE5\xA5\xBD");  // 你好
  // A token that holds part of a character: its bytes exactly, its text U+FFFD.
  CHECK(d.bytes(std::vector<int32_t>{4}) == " \xF0\x9F");
  CHECK(d.text(std::vector<int32_t>{4}) == " \xEF\xBF\xBD");
  CHECK(d.text(std::vector<int32_t>{4, 3}) == " \xEF\xBF\xBDHi");
  CHECK(d.text(std::vector<int32_t>{6}) == "\xEF\xBF\xBD");  // a lone continuation byte
  CHECK(d.text(std::vector<int32_t>{8, 7}) == "\xEF\xBF\xBD\xEF\xBF\xBD");
  // Added tokens are their text; only special ones are skipped on request.
  CHECK(d.text(std::vector<int32_t>{11, 3, 10}) == "<think>Hi<|im_end|>");
  CHECK(d.text(std::vector<int32_t>{11, 3, 10}, true) == "<think>Hi");
  CHECK(d.is_special(10));
  CHECK_FALSE(d.is_special(11));
  CHECK_FALSE(d.is_special(3));
}

TEST_CASE("tokenizer: invalid UTF-8 becomes U+FFFD per maximal subpart, as Python decodes it") {
  const std::string r = "\xEF\xBF\xBD";
  CHECK(shardlm::replace_invalid_utf8("\xC0\xAF") == r + r);               // C0 starts nothing
  CHECK(shardlm::replace_invalid_utf8("\xED\xA0\x80") == r + r + r);       // a surrogate
  CHECK(shardlm::replace_invalid_utf8("\xF4\x90\x80\x80") == r + r + r + r);  // past U+10FFFF
  CHECK(shardlm::replace_invalid_utf8("\xE2\x82\x41") == r + "A");         // cut short: one U+FFFD
  CHECK(shardlm::replace_invalid_utf8("\xF0\x9F\xA4") == r);
  CHECK(shardlm::replace_invalid_utf8("\xE0\x80\xAF") == r + r + r);       // overlong
  CHECK(shardlm::replace_invalid_utf8("a\xF0\x9F\xA4\x97" "b\xC3") == "a\xF0\x9F\xA4\x97" "b" + r);
  CHECK(shardlm::finished_utf8_prefix("ab\xF0\x9F\xA4") == 2);
  CHECK(shardlm::finished_utf8_prefix("ab\xF0\x9F\xA4\x97") == 6);
  CHECK(shardlm::finished_utf8_prefix("ab\xE2\x41") == 4);   // E2 41 can never be finished
  CHECK(shardlm::finished_utf8_prefix("ab\xED\xA0") == 4);   // ED A0 is not the start of a character
  CHECK(shardlm::finished_utf8_prefix("\xC3") == 0);
}

TEST_CASE("tokenizer: streaming holds an unfinished character back") {
  const TokenDecoder d = TokenDecoder::from_json_text(kTinyTokenizer, "tiny.json");
  std::vector<std::string> parts;
  const std::vector<int32_t> ids{3, 4, 5, 6, 10, 7, 8, 9};
  CHECK(streamed(d, ids, &parts) == d.text(ids));
  CHECK(parts == std::vector<std::string>{"Hi", " ", "", "\xF0\x9F\xA4\x97", "<|im_end|>", "", "\xE4\xBD\xA0",
                                          "\xE5\xA5\xBD", ""});
  // Left unfinished at the end: one U+FFFD from finish(), as text() gives.
  parts.clear();
  CHECK(streamed(d, {3, 4, 5}, &parts) == "Hi \xEF\xBF\xBD");
  CHECK(parts.back() == "\xEF\xBF\xBD");
  // Bytes that no later byte can finish are given out at once.
  StreamDecoder stream(d);
  CHECK(stream.push(6) == "\xEF\xBF\xBD");
  CHECK(stream.push(8) == "\xEF\xBF\xBD");
  CHECK(stream.finish().empty());
}

TEST_CASE("tokenizer: load errors name the file and what is wrong") {
  TempDir dir;
  CHECK(error_of([&] { TokenDecoder::load((dir.path / "none.json").string()); }) ==
        (dir.path / "none.json").string() + ": tokenizer file does not exist");
  CHECK(error_of([&] { TokenDecoder::load(dir.path.string()); }) ==
        dir.path.string() + ": folder has no tokenizer.json");
  const auto corrupt = dir.write("corrupt.json", "{\"model\": {\"vocab\": ");
  CHECK(error_of([&] { TokenDecoder::load(corrupt.string()); }).rfind(corrupt.string() + ": invalid JSON: ", 0) == 0);
  const auto wordpiece = dir.write("wp.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
  CHECK(error_of([&] { TokenDecoder::load(wordpiece.string()); }) ==
        wordpiece.string() + ": model type 'WordPiece' is not supported (only byte-level BPE)");
  const auto decoder = dir.write("dec.json", R"({"model": {"vocab": {"a": 0}}, "decoder": {"type": "Metaspace"}})");
  CHECK(error_of([&] { TokenDecoder::load(decoder.string()); }) ==
        decoder.string() + ": decoder 'Metaspace' is not supported (ByteLevel)");
  const auto tiny = dir.write("tokenizer.json", kTinyTokenizer);
  const TokenDecoder d = TokenDecoder::load(dir.path.string());  // the folder finds tokenizer.json
  CHECK(d.text(std::vector<int32_t>{3}) == "Hi");
  CHECK(error_of([&] { d.text(std::vector<int32_t>{3, 12}); }) ==
        "token id 12 is outside the vocabulary (0..11) of " + tiny.string());
  CHECK(error_of([&] { d.text(std::vector<int32_t>{-1}); }).find("token id -1 is outside") == 0);
}

// tests/scripts/test_tokenizer.sh writes SHARDLM_TOKENIZER_CASES: a tokenizer.json
// path on the first line, then per case "ids(comma separated)\tbytes hex\ttext hex"
// as tools/hf_tokenizer.py decodes them; it runs this case with --no-skip.
TEST_CASE("tokenizer: the C++ decoder agrees with tools/hf_tokenizer.py on real files" * doctest::skip()) {
  const char* cases_path = std::getenv("SHARDLM_TOKENIZER_CASES");
  REQUIRE_MESSAGE(cases_path != nullptr, "set SHARDLM_TOKENIZER_CASES (tests/scripts/test_tokenizer.sh does)");
  std::ifstream in(cases_path);
  REQUIRE(in.good());
  std::string tokenizer_path;
  std::getline(in, tokenizer_path);
  const TokenDecoder d = TokenDecoder::load(tokenizer_path);
  std::string line;
  int cases = 0, bytes_equal = 0, text_equal = 0, stream_equal = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string ids_text, bytes_hex, text_hex;
    std::getline(fields, ids_text, '\t');
    std::getline(fields, bytes_hex, '\t');
    std::getline(fields, text_hex, '\t');
    std::vector<int32_t> ids;
    std::istringstream id_stream(ids_text);
    for (std::string id; std::getline(id_stream, id, ',');) ids.push_back(std::stoi(id));
    ++cases;
    bytes_equal += d.bytes(ids) == from_hex(bytes_hex);
    text_equal += d.text(ids) == from_hex(text_hex);
    stream_equal += streamed(d, ids, nullptr) == from_hex(text_hex);
  }
  MESSAGE(tokenizer_path << ": " << cases << " cases, vocab " << d.vocab_size());
  CHECK(cases > 100);
  CHECK(bytes_equal == cases);
  CHECK(text_equal == cases);
  CHECK(stream_equal == cases);
}
