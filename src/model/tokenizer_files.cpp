// tokenizer_files.cpp — copying the tokenizer files beside exported weights (see tokenizer_files.hpp).
#include "model/tokenizer_files.hpp"

#include "shardlm/error.hpp"

namespace shardlm {

namespace fs = std::filesystem;

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
      "chat_template.jinja", "chat_template.json",   "tokenizer.model",         "vocab.json",
      "merges.txt",          "added_tokens.json"};
  return names;
}

std::string copy_tokenizer_files(const fs::path& src_dir, const fs::path& dst_dir) {
  if (src_dir.empty()) return "no tokenizer files: the weights did not come from an HF directory (model.hf is not set)";
  if (!fs::is_directory(src_dir))
    return "no tokenizer files: the source model directory " + src_dir.string() + " is not there";
  std::vector<std::string> copied;
  for (const auto& name : tokenizer_file_names()) {
    const fs::path from = src_dir / name;
    if (!fs::is_regular_file(from)) continue;
    const fs::path to = dst_dir / name, tmp = dst_dir / (name + ".tmp");
    std::error_code ec;
    fs::copy_file(from, tmp, fs::copy_options::overwrite_existing, ec);
    if (!ec) fs::rename(tmp, to, ec);
    if (ec) {
      fs::remove(tmp);
      SHARDLM_FAIL("cannot copy %s to %s: %s", from.c_str(), to.c_str(), ec.message().c_str());
    }
    copied.push_back(name);
  }
  if (copied.empty())
    return "no tokenizer files: " + src_dir.string() + " has none (tokenizer.json, tokenizer_config.json, ...); "
           "add them beside the weights before serving";
  std::string list;
  for (size_t i = 0; i < copied.size(); ++i) list += (i ? ", " : "") + copied[i];
  return "tokenizer files from " + src_dir.string() + ": " + list;
}


}  // namespace shardlm
