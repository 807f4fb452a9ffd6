// order.cpp — a token file's document order per epoch and its packing into
// rows (see order.hpp; rules: docs/data.md).
#include "data/order.hpp"

namespace shardlm::data {

namespace {

// Uniform in [0, bound) without modulo bias: reject the lowest 2^64 mod bound values.
uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = splitmix64_next(state);
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

void PackedFile::plan() {
  const int64_t rows_bound = file.documents + file.pairs / seq_len + 1;
  for (int slot = 0; slot < (shuffle ? 2 : 1); ++slot) {
    if (shuffle) cache[slot].order.reserve(static_cast<size_t>(file.documents));
    cache[slot].starts.reserve(static_cast<size_t>(rows_bound / kRowsPerStart + 1));
  }
  (void)rows_in_epoch(0);
}

void PackedFile::fill_order(int64_t epoch, std::vector<uint32_t>& order) const {
  order.clear();
  if (!shuffle) return;
  order.resize(static_cast<size_t>(file.documents));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
  // Fisher-Yates driven by splitmix64 seeded from (seed, epoch).
  uint64_t state = mix64(seed ^ mix64(static_cast<uint64_t>(epoch) + 0xD1B54A32D192ED03ull));
  for (size_t i = order.size(); i > 1; --i) {
    const uint64_t j = uniform_below(state, i);
    std::swap(order[i - 1], order[j]);
  }
}

void PackedFile::pack(int64_t epoch, EpochPacking& p) const {
  p.epoch = epoch;
  fill_order(epoch, p.order);
  p.starts.clear();
  p.rows = 0;
  RowStart s;
  while (s.index < file.documents) {
    if (p.rows % kRowsPerStart == 0) p.starts.push_back(s);
    s = walk_row(p, s, [](int64_t, int64_t) {});
    ++p.rows;
  }
  p.cursor_row = -1;
}

EpochPacking& PackedFile::packing(int64_t epoch) {
  if (!shuffle) {  // every epoch is the file order: one packing serves all
    if (cache[0].epoch < 0) pack(0, cache[0]);
    return cache[0];
  }
  for (EpochPacking& cached : cache)
    if (cached.epoch == epoch) return cached;
  EpochPacking& slot = cache[next_slot];
  next_slot ^= 1;
  pack(epoch, slot);
  return slot;
}

void PackedFile::locate(int64_t row_in_stream, int64_t& epoch, int64_t& row) {
  while (epoch_row_begin.back() <= row_in_stream) {
    const auto next_epoch = static_cast<int64_t>(epoch_row_begin.size()) - 1;
    epoch_row_begin.push_back(epoch_row_begin.back() + rows_in_epoch(next_epoch));
  }
  const auto it = std::upper_bound(epoch_row_begin.begin(), epoch_row_begin.end(), row_in_stream);
  epoch = (it - epoch_row_begin.begin()) - 1;
  row = row_in_stream - epoch_row_begin[static_cast<size_t>(epoch)];
}

int64_t PackedFile::order_bytes_bound() const {
  const int64_t rows_bound = file.documents + file.pairs / seq_len + 1;
  const int64_t starts = (rows_bound / kRowsPerStart + 1) * static_cast<int64_t>(sizeof(RowStart));
  const int64_t orders = shuffle ? file.documents * 4 : 0;
  return (shuffle ? 2 : 1) * (orders + starts);
}

int64_t PackedFile::order_bytes() const {
  int64_t total = 0;
  for (const EpochPacking& p : cache)
    total += static_cast<int64_t>(p.order.capacity() * 4 + p.starts.capacity() * sizeof(RowStart));
  return total + static_cast<int64_t>(epoch_row_begin.capacity() * 8);
}

}  // namespace shardlm::data
