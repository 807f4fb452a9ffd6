// order.hpp — one token file's epochs: the order of its documents (a function
// of seed and epoch) and the packing of that order into rows of seq_len.
//
// Owns: splitmix64 (the portable generator the order and the mix draw from),
// the Fisher-Yates shuffle per epoch, greedy packing (a document that fits in
// a row is never split), the row starts kept every kRowsPerStart rows, the two
// most recent epochs' packings, and the file's own row stream over epochs.
// Must not know: how the tokens are stored (TokenFile's document index says
// where a document starts and how long it is), the other files of a mix,
// steps, ranks or micro-batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "data/token_file.hpp"

namespace shardlm::data {

constexpr int64_t kRowsPerStart = 256;  // packing: one saved row start per this many rows

// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable generator, so the
// order is the same with every compiler and standard library.
inline uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t mix64(uint64_t x) { return splitmix64_next(x); }

// Where a row starts in an epoch's document order: document `index` of the
// order, `consumed` of its pairs already placed in earlier rows.
struct RowStart {
  int64_t index = 0;
  int64_t consumed = 0;
};

struct EpochPacking {
  int64_t epoch = -1;
  std::vector<uint32_t> order;   // (documents) permutation; empty without shuffling
  std::vector<RowStart> starts;  // start of rows 0, R, 2R, ... (R = kRowsPerStart)
  int64_t rows = 0;
  int64_t cursor_row = -1;       // the row after the last one walked, and where it starts
  RowStart cursor;
};

// One file of the mix: the file, its shuffle seed and its epochs' packings.
struct PackedFile {
  TokenFile file;
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t seq_len = 0;
  EpochPacking cache[2];           // the two most recently used epochs
  int next_slot = 0;
  std::vector<int64_t> epoch_row_begin{0};  // row of this file's stream where epoch e starts

  // Reserves both epochs' orders and row tables (memory is planned: later
  // epochs reuse them) and packs epoch 0, so the first step does not pay for it.
  void plan();

  // `epoch`'s document order into `order` (left empty without shuffling).
  void fill_order(int64_t epoch, std::vector<uint32_t>& order) const;

  int64_t doc_at(const EpochPacking& p, int64_t i) const {
    return p.order.empty() ? i : static_cast<int64_t>(p.order[static_cast<size_t>(i)]);
  }

  // Greedy packing of one row from `s`. A document of p <= seq_len pairs is
  // never split: if it does not fit in the row, the rest of the row is padding
  // and it starts the next row. A document of p > seq_len pairs fills the rest
  // of the row with its first piece and continues in the next rows. Calls
  // emit(first_token, pairs) per piece; returns where the next row starts.
  template <class Emit>
  RowStart walk_row(const EpochPacking& p, RowStart s, Emit&& emit) const {
    int64_t used = 0;
    while (s.index < file.documents) {
      const int64_t d = doc_at(p, s.index);
      const int64_t pairs = file.doc_pairs(d);
      if (s.consumed == 0 && pairs <= seq_len && used + pairs > seq_len) break;
      const int64_t take = std::min(pairs - s.consumed, seq_len - used);
      emit(file.doc_first(d) + s.consumed, take);
      used += take;
      s.consumed += take;
      if (s.consumed == pairs) ++s.index, s.consumed = 0;
      if (used == seq_len) break;
    }
    return s;
  }

  // `epoch`'s packing, from the cache or packed now.
  EpochPacking& packing(int64_t epoch);
  int64_t rows_in_epoch(int64_t epoch) { return packing(epoch).rows; }

  // This file's stream row -> (epoch, row within the epoch).
  void locate(int64_t row_in_stream, int64_t& epoch, int64_t& row);

  // Calls emit(first_token, pairs) for each piece of row `row_in_stream`.
  template <class Emit>
  void walk_stream_row(int64_t row_in_stream, Emit&& emit) {
    int64_t epoch = 0, row = 0;
    locate(row_in_stream, epoch, row);
    EpochPacking& p = packing(epoch);
    RowStart s;
    if (p.cursor_row == row) {
      s = p.cursor;
    } else {  // replay from the nearest saved row start
      s = p.starts[static_cast<size_t>(row / kRowsPerStart)];
      for (int64_t r = row / kRowsPerStart * kRowsPerStart; r < row; ++r) s = walk_row(p, s, [](int64_t, int64_t) {});
    }
    p.cursor = walk_row(p, s, emit);
    p.cursor_row = row + 1;
  }

  // The most the packing caches hold: two epochs' orders and row starts.
  int64_t order_bytes_bound() const;
  // What they hold now.
  int64_t order_bytes() const;

 private:
  void pack(int64_t epoch, EpochPacking& p) const;
};

}  // namespace shardlm::data
