// mixing.cpp — mixing token files by weight (see mixing.hpp; rules: docs/data.md).
#include "data/mixing.hpp"

#include <cmath>

#include "data/order.hpp"
#include "shardlm/error.hpp"

namespace shardlm::data {

FileMix::FileMix(const std::vector<double>& weights, const std::vector<int64_t>& pairs, uint64_t seed)
    : files_(static_cast<int64_t>(pairs.size())), seed_(seed) {
  if (pairs.size() > 1) {
    std::vector<double> w = weights;
    if (w.empty())  // in proportion to each file's targets, as if they were one file
      for (int64_t p : pairs) w.push_back(static_cast<double>(p));
    double total = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      SHARDLM_CHECK(w[k] >= 0 && std::isfinite(w[k]), "data.weights[%zu] = %g: weights must be >= 0", k, w[k]);
      total += w[k];
    }
    SHARDLM_CHECK(total > 0, "data.weights are all 0: at least one file must have a positive weight");
    double cumulative = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      cumulative += w[k];
      const double scaled = cumulative / total * 9007199254740992.0;  // 2^53
      thresholds_.push_back(k + 1 == w.size() ? (uint64_t(1) << 53) : static_cast<uint64_t>(scaled));
    }
  }
  anchor_counts_.assign(pairs.size(), 0);
  block_counts_.assign(pairs.size(), 0);
}

void FileMix::restore(int64_t row, const std::vector<int64_t>& rows_before) {
  anchor_row_ = row;
  for (size_t k = 0; k < anchor_counts_.size(); ++k) anchor_counts_[k] = rows_before[k];
  block_counts_.assign(anchor_counts_.size(), 0);
}

int64_t FileMix::file_of(int64_t row) const {
  if (files_ == 1) return 0;
  const uint64_t draw = mix64(seed_ ^ mix64(static_cast<uint64_t>(row) + 0xA24BAED4963EE407ull)) >> 11;
  for (size_t k = 0; k + 1 < thresholds_.size(); ++k)
    if (draw < thresholds_[k]) return static_cast<int64_t>(k);
  return static_cast<int64_t>(thresholds_.size()) - 1;
}

void FileMix::extend_blocks(int64_t row) {
  SHARDLM_CHECK(row >= anchor_row_, "internal: data row %lld before the restored row %lld", (long long)row,
                (long long)anchor_row_);
  const int64_t K = files_;
  const int64_t block = (row - anchor_row_) / kRowsPerMixBlock;
  while (static_cast<int64_t>(block_counts_.size()) / K <= block) {
    const int64_t b = static_cast<int64_t>(block_counts_.size()) / K - 1;
    for (int64_t k = 0; k < K; ++k) block_counts_.push_back(block_counts_[b * K + k]);
    for (int64_t r = anchor_row_ + b * kRowsPerMixBlock; r < anchor_row_ + (b + 1) * kRowsPerMixBlock; ++r)
      ++block_counts_[(b + 1) * K + file_of(r)];
  }
}

std::vector<int64_t> FileMix::rows_of_each_file_before(int64_t row) {
  if (files_ == 1) return {row};
  extend_blocks(row);
  const int64_t K = files_;
  const int64_t block = (row - anchor_row_) / kRowsPerMixBlock;
  std::vector<int64_t> out(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) out[k] = anchor_counts_[k] + block_counts_[block * K + k];
  for (int64_t r = anchor_row_ + block * kRowsPerMixBlock; r < row; ++r) ++out[file_of(r)];
  return out;
}

void FileMix::locate(int64_t row, int64_t& file, int64_t& file_row) {
  if (files_ == 1) {
    file = 0, file_row = row;
    return;
  }
  extend_blocks(row);
  const int64_t K = files_;
  const int64_t block = (row - anchor_row_) / kRowsPerMixBlock;
  file = file_of(row);
  int64_t count = block_counts_[block * K + file];
  for (int64_t r = anchor_row_ + block * kRowsPerMixBlock; r < row; ++r) count += file_of(r) == file;
  file_row = anchor_counts_[file] + count;
}

int64_t FileMix::buffer_bytes() const {
  return static_cast<int64_t>(block_counts_.capacity() * 8 + thresholds_.capacity() * 8 +
                              anchor_counts_.capacity() * 8);
}

}  // namespace shardlm::data
