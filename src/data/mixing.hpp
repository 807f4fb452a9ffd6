// mixing.hpp — several token files mixed by weight into one stream of rows.
//
// Owns: the weights (given, or in proportion to each file's targets) as
// cumulative thresholds; which file stream row i comes from, a function of
// (seed, i) alone; and how many rows of each file come before any row, counted
// from an anchor (a restored position) in blocks of kRowsPerMixBlock rows.
// Must not know: how a file is stored, ordered or packed into rows (each file
// has its own row stream), steps, ranks or micro-batches.
#pragma once

#include <cstdint>
#include <vector>

namespace shardlm::data {

constexpr int64_t kRowsPerMixBlock = 1024;  // mixing: per-file counts saved every this many rows

class FileMix {
 public:
  // `pairs`: each file's (input, target) pairs, for the default weights.
  // `weights`: one per file, or empty (in proportion to pairs). Throws for a
  // negative or non-finite weight, or all 0. One file: every row is its own.
  FileMix(const std::vector<double>& weights, const std::vector<int64_t>& pairs, uint64_t seed);

  int64_t files() const { return files_; }
  int64_t anchor_row() const { return anchor_row_; }

  // Continue from a saved position: stream row `row` comes after
  // `rows_before[k]` rows of each file k.
  void restore(int64_t row, const std::vector<int64_t>& rows_before);

  // Rows of each file in the stream before `row`.
  std::vector<int64_t> rows_of_each_file_before(int64_t row);
  // Stream row -> (file, row of that file's stream).
  void locate(int64_t row, int64_t& file, int64_t& file_row);

  int64_t buffer_bytes() const;  // the tables held now

 private:
  int64_t file_of(int64_t row) const;
  // The per-file counts at the start of every block up to the one holding `row`.
  void extend_blocks(int64_t row);

  int64_t files_ = 0;
  uint64_t seed_ = 0;
  // Stream row i comes from file k with probability weight_k, drawn from
  // (seed, i); its row in file k's stream is the number of earlier rows that
  // came from k. Counted from the anchor (a restored position) on.
  std::vector<uint64_t> thresholds_;    // cumulative weights scaled to 2^53
  int64_t anchor_row_ = 0;
  std::vector<int64_t> anchor_counts_;  // (files) rows of each file before anchor_row_
  std::vector<int64_t> block_counts_;   // (blocks + 1, files): rows of each file in [anchor_row_, anchor_row_ + b*B)
};

}  // namespace shardlm::data
