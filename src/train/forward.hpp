// forward.hpp — `shardlm forward`: logits of an HF model for a batch of token
// rows, the way shardlm is compared with outside implementations.
//
// Owns: reading IN.h5 (int32 `tokens` [B, T], each row one sequence) and
// writing OUT.h5 (float32 `logits` [B, T, V]). Single process; knows nothing
// about MPI.
#pragma once

#include <filesystem>
#include <vector>

#include "shardlm/model_config.hpp"

namespace shardlm {

struct TokenRows {
  int64_t rows = 0, cols = 0;
  std::vector<int32_t> tokens;  // (rows, cols)
};
// Validates dtype (int32), rank (2) and ids < vocab_size; errors name the file.
TokenRows read_token_rows(const std::filesystem::path& file, int64_t vocab_size);
// Writes `logits` (rows, cols, vocab) to FILE.tmp, then renames it to FILE.
void write_logits(const std::filesystem::path& file, const std::vector<float>& logits, int64_t rows, int64_t cols,
                  int64_t vocab);

// Loads the HF directory, runs every row (positions 0.., one sequence a row),
// writes the logits. Returns the number of rows.
int64_t forward_hf(const std::filesystem::path& hf_dir, const std::filesystem::path& tokens_file,
                   const std::filesystem::path& out_file);

}  // namespace shardlm
