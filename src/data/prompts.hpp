// prompts.hpp — RL prompt files (tools/make_prompts.py, docs/data.md "RL
// prompt files"), read and validated.
//
// Owns: PromptSet and read_prompts: the token ids of every prompt, its offsets
// and the stop ids the file names; every declared size checked against the
// file's bytes before anything is allocated. Knows nothing about models, MPI
// or sampling (the caller checks the ids against its vocabulary).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace shardlm {

struct PromptSet {
  std::string path;                 // the file, or "--prompt-ids"
  std::vector<int32_t> tokens;      // (T) every prompt's ids, concatenated
  std::vector<int64_t> offsets;     // (P+1) prompt p = tokens[offsets[p] .. offsets[p+1])
  std::vector<int32_t> stop_ids;    // the file's stop_token_ids (end of turn, EOS); may be empty
  std::vector<std::string> answers; // (P) the reference answers ('answer'); empty when the file has none
  std::vector<std::string> metadata;  // (P) each prompt's metadata ('metadata', JSON text); empty when none
  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  std::span<const int32_t> prompt(int64_t p) const {
    return {tokens.data() + offsets[size_t(p)], size_t(offsets[size_t(p) + 1] - offsets[size_t(p)])};
  }
};

// Throws Error naming the file and what is wrong: missing, not HDF5, format
// attribute not shardlm-prompts-1, 'tokens' / 'offsets' missing or of the
// wrong dtype or rank, sizes the file cannot hold, offsets that do not start
// at 0, decrease, or end elsewhere than len(tokens), an empty prompt, no prompt,
// an id outside [0, vocab_size), an 'answer' dataset that is not P strings.
PromptSet read_prompts(const std::string& path, int64_t vocab_size);

// "1,2,3" -> one prompt; same checks on the ids.
PromptSet prompt_from_ids(const std::string& ids_text, int64_t vocab_size);
// One prompt of ids made elsewhere (--prompt's text through the model's tokenizer);
// `what` names it in errors. Same checks on the ids.
PromptSet prompt_from_tokens(std::vector<int32_t> ids, const std::string& what, int64_t vocab_size);

}  // namespace shardlm
