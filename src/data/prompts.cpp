// prompts.cpp — reading RL prompt files (format: docs/data.md).
#include "data/prompts.hpp"

#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace fs = std::filesystem;

namespace shardlm {

namespace {

constexpr const char* kFormat = "shardlm-prompts-1";

// 1-D integer dataset `name` of `bytes`-sized elements, its length checked against the file.
template <class T>
std::vector<T> read_ints(hid_t file, const std::string& path, const char* name, hid_t mem_type, int64_t file_bytes) {
  SHARDLM_CHECK(H5_CHECK(H5Lexists(file, name, H5P_DEFAULT)) > 0,
                "prompt file '%s' has no dataset '%s' (tools/make_prompts.py writes 'tokens' int32 and 'offsets' "
                "int64; docs/data.md)", path.c_str(), name);
  h5::Handle d = h5::open_dataset(file, name, fmt("prompt file '%s'", path.c_str()));
  h5::Handle type(H5_CHECK(H5Dget_type(d)), H5Tclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == sizeof(T) &&
                    H5Tget_sign(type) == H5T_SGN_2,
                "prompt file '%s': dataset '%s' has dtype %s, expected int%zu", path.c_str(), name,
                h5::dtype_name(type).c_str(), sizeof(T) * 8);
  h5::Handle space(H5_CHECK(H5Dget_space(d)), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  SHARDLM_CHECK(rank == 1, "prompt file '%s': dataset '%s' has rank %d, expected a 1-D array", path.c_str(), name,
                rank);
  hsize_t length = 0;
  H5_CHECK(H5Sget_simple_extent_dims(space, &length, nullptr));
  h5::check_declared_size(d, name, static_cast<int64_t>(length), sizeof(T), file_bytes,
                          fmt("prompt file '%s'", path.c_str()));
  std::vector<T> values(length);
  if (length > 0) H5_CHECK(H5Dread(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  return values;
}

std::string read_format(hid_t file, const std::string& path) {
  SHARDLM_CHECK(H5_CHECK(H5Aexists(file, "format")) > 0,
                "prompt file '%s' has no 'format' attribute (expected '%s'; is it a prompt file from "
                "tools/make_prompts.py?)", path.c_str(), kFormat);
  h5::Handle a(H5_CHECK(H5Aopen(file, "format", H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(a)), H5Tclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING, "prompt file '%s': attribute 'format' is not a string",
                path.c_str());
  return h5::read_string_attribute_value(a, type);
}

std::vector<int32_t> read_stop_ids(hid_t file, const std::string& path) {
  std::vector<int32_t> ids;
  if (H5_CHECK(H5Aexists(file, "stop_token_ids")) <= 0) return ids;
  h5::Handle a(H5_CHECK(H5Aopen(file, "stop_token_ids", H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(a)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(a)), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && n >= 0 && n <= 4096,
                "prompt file '%s': attribute 'stop_token_ids' must be at most 4096 integers, found %s with %lld "
                "values", path.c_str(), h5::dtype_name(type).c_str(), (long long)n);
  std::vector<int64_t> wide(static_cast<size_t>(n));
  if (n > 0) H5_CHECK(H5Aread(a, H5T_NATIVE_INT64, wide.data()));
  for (int64_t v : wide) {
    SHARDLM_CHECK(v >= 0 && v <= INT32_MAX, "prompt file '%s': stop_token_ids holds %lld, not a token id",
                  path.c_str(), (long long)v);
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

// A reference answer is short (a number, a word, an expression), a prompt's
// metadata a small JSON object; a longer one is a damaged or forged file,
// refused before its strings are allocated.
constexpr size_t kMaxAnswerBytes = size_t(1) << 20;

// An optional dataset of P UTF-8 strings, `name` ('answer', 'metadata'; variable
// length, as h5py writes them; fixed length too), their declared bytes checked
// against the file's first. `one` names an entry in errors ("an answer").
std::vector<std::string> read_strings(hid_t file, const char* name, const char* one, const std::string& path,
                                      int64_t prompts, int64_t file_bytes) {
  std::vector<std::string> answers;
  if (H5_CHECK(H5Lexists(file, name, H5P_DEFAULT)) <= 0) return answers;
  h5::Handle d = h5::open_dataset(file, name, fmt("prompt file '%s'", path.c_str()));
  h5::Handle type(H5_CHECK(H5Dget_type(d)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Dget_space(d)), H5Sclose);
  hsize_t length = 0;
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  if (rank == 1) H5_CHECK(H5Sget_simple_extent_dims(space, &length, nullptr));
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING && rank == 1 && int64_t(length) == prompts,
                "prompt file '%s': dataset '%s' must hold one string per prompt (%lld), found %s of rank %d and "
                "%llu entries", path.c_str(), name, (long long)prompts, h5::dtype_name(type).c_str(), rank,
                (unsigned long long)length);
  h5::Handle mem(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)));
  if (H5_CHECK(H5Tis_variable_str(type)) > 0) {
    H5_CHECK(H5Tset_size(mem, H5T_VARIABLE));
    hsize_t text_bytes = 0;  // every string's bytes: they lie in the file, uncompressed
    if (length > 0) H5_CHECK(H5Dvlen_get_buf_size(d, mem, space, &text_bytes));
    SHARDLM_CHECK(int64_t(text_bytes) <= file_bytes,
                  "prompt file '%s': dataset '%s' declares %llu strings of %llu bytes in all but the file has %lld "
                  "bytes: a damaged or forged file; nothing was read for it", path.c_str(), name,
                  (unsigned long long)length, (unsigned long long)text_bytes, (long long)file_bytes);
    std::vector<char*> texts(length, nullptr);
    if (length > 0) H5_CHECK(H5Dread(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, texts.data()));
    for (char* t : texts) answers.emplace_back(t ? t : "");
    if (length > 0) H5_CHECK(H5Dvlen_reclaim(mem, space, H5P_DEFAULT, texts.data()));
    for (size_t i = 0; i < answers.size(); ++i)
      SHARDLM_CHECK(answers[i].size() <= kMaxAnswerBytes, "prompt file '%s': %s %zu has %zu bytes; %s holds at "
                    "most %zu bytes", path.c_str(), name, i, answers[i].size(), one, kMaxAnswerBytes);
  } else {
    const size_t size = H5Tget_size(type);
    SHARDLM_CHECK(size <= kMaxAnswerBytes,
                  "prompt file '%s': dataset '%s' declares %llu strings of %zu bytes; %s holds at most %zu "
                  "bytes (a damaged or forged file?)", path.c_str(), name, (unsigned long long)length, size, one,
                  kMaxAnswerBytes);
    h5::check_declared_size(d, name, static_cast<int64_t>(length), size, file_bytes,
                            fmt("prompt file '%s'", path.c_str()));
    H5_CHECK(H5Tset_size(mem, size + 1));
    std::vector<char> text(length * (size + 1), '\0');
    if (length > 0) H5_CHECK(H5Dread(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()));
    for (hsize_t i = 0; i < length; ++i) answers.emplace_back(text.data() + i * (size + 1));
  }
  return answers;
}

void check_ids(const PromptSet& p, int64_t vocab_size) {
  for (int64_t i = 0; i < p.size(); ++i)
    for (int64_t t = p.offsets[size_t(i)]; t < p.offsets[size_t(i) + 1]; ++t)
      SHARDLM_CHECK(p.tokens[size_t(t)] >= 0 && p.tokens[size_t(t)] < vocab_size,
                    "%s: prompt %lld, token %lld is %d, outside the model's vocabulary [0, %lld)", p.path.c_str(),
                    (long long)i, (long long)(t - p.offsets[size_t(i)]), p.tokens[size_t(t)], (long long)vocab_size);
}

}  // namespace

PromptSet read_prompts(const std::string& path, int64_t vocab_size) {
  std::error_code ec;
  SHARDLM_CHECK(fs::exists(path, ec), "prompt file '%s' does not exist", path.c_str());
  SHARDLM_CHECK(fs::is_regular_file(path, ec), "prompt file '%s' is not a regular file", path.c_str());
  const int64_t file_bytes = static_cast<int64_t>(fs::file_size(path, ec));
  h5::silence_error_stack();
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  H5Eclear2(H5E_DEFAULT);
  SHARDLM_CHECK(is_hdf5 > 0, "prompt file '%s' is not an HDF5 file (make one with tools/make_prompts.py)",
                path.c_str());
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
  SHARDLM_CHECK(file.get() >= 0, "prompt file '%s': cannot open (%s)", path.c_str(),
                h5::error_stack_message().c_str());
  const std::string format = read_format(file, path);
  SHARDLM_CHECK(format == kFormat, "prompt file '%s' has format '%s'; this shardlm reads '%s'", path.c_str(),
                format.c_str(), kFormat);
  PromptSet p;
  p.path = path;
  p.tokens = read_ints<int32_t>(file, path, "tokens", H5T_NATIVE_INT32, file_bytes);
  p.offsets = read_ints<int64_t>(file, path, "offsets", H5T_NATIVE_INT64, file_bytes);
  p.stop_ids = read_stop_ids(file, path);
  SHARDLM_CHECK(p.offsets.size() >= 2, "prompt file '%s' holds no prompt ('offsets' has %zu entries, needs P+1 >= 2)",
                path.c_str(), p.offsets.size());
  SHARDLM_CHECK(p.offsets.front() == 0, "prompt file '%s': offsets[0] is %lld, must be 0", path.c_str(),
                (long long)p.offsets.front());
  for (size_t i = 1; i < p.offsets.size(); ++i)
    SHARDLM_CHECK(p.offsets[i] > p.offsets[i - 1] && p.offsets[i] <= int64_t(p.tokens.size()),
                  "prompt file '%s': prompt %zu spans tokens [%lld, %lld) of %zu: offsets must increase (no empty "
                  "prompt) and stay within 'tokens'", path.c_str(), i - 1, (long long)p.offsets[i - 1],
                  (long long)p.offsets[i], p.tokens.size());
  SHARDLM_CHECK(p.offsets.back() == int64_t(p.tokens.size()),
                "prompt file '%s': the last offset is %lld but 'tokens' holds %zu ids", path.c_str(),
                (long long)p.offsets.back(), p.tokens.size());
  check_ids(p, vocab_size);
  p.answers = read_strings(file, "answer", "an answer", path, p.size(), file_bytes);
  p.metadata = read_strings(file, "metadata", "a metadata entry", path, p.size(), file_bytes);
  return p;
}

PromptSet prompt_from_ids(const std::string& text, int64_t vocab_size) {
  PromptSet p;
  p.path = "--prompt-ids";
  const char* s = text.c_str();
  while (*s) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s, &end, 10);
    SHARDLM_CHECK(end != s && errno == 0 && v >= 0 && v <= INT32_MAX,
                  "--prompt-ids '%s': expected comma-separated token ids, e.g. \"1,2,3\"", text.c_str());
    p.tokens.push_back(static_cast<int32_t>(v));
    s = end;
    while (*s == ' ') ++s;
    if (*s == ',') ++s;
    else SHARDLM_CHECK(*s == '\0', "--prompt-ids '%s': expected comma-separated token ids, e.g. \"1,2,3\"",
                       text.c_str());
  }
  SHARDLM_CHECK(!p.tokens.empty(), "--prompt-ids is empty: give at least one token id");
  p.offsets = {0, int64_t(p.tokens.size())};
  check_ids(p, vocab_size);
  return p;
}

PromptSet prompt_from_tokens(std::vector<int32_t> ids, const std::string& what, int64_t vocab_size) {
  PromptSet p;
  p.path = what;
  SHARDLM_CHECK(!ids.empty(), "%s is empty: it has no tokens", what.c_str());
  p.tokens = std::move(ids);
  p.offsets = {0, int64_t(p.tokens.size())};
  check_ids(p, vocab_size);
  return p;
}

}  // namespace shardlm
