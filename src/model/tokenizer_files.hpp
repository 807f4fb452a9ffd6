// tokenizer_files.hpp — the tokenizer files an exported model is served with.
//
// Owns: the list of files vLLM or transformers read beside config.json and the
// weights, and copying them from the model directory a run loaded.
// Knows nothing about their contents (they are copied byte for byte), weights
// or the model's configuration.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardlm {

// ---- the files served beside the weights -----------------------------------

// What vLLM or transformers need beside config.json and the weights to serve a
// model: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// generation_config.json, chat_template.jinja, chat_template.json, and the slow
// tokenizers' tokenizer.model, vocab.json, merges.txt, added_tokens.json.
const std::vector<std::string>& tokenizer_file_names();
// Copies those that `src_dir` (the model.hf a run loaded; "" = none) holds into
// `dst_dir` (each as .tmp, then renamed) and returns one sentence for the log:
// which files came from where, or why there were none. Throws Error naming the
// file when a copy fails.
std::string copy_tokenizer_files(const std::filesystem::path& src_dir, const std::filesystem::path& dst_dir);

}  // namespace shardlm
