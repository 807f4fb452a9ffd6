// kv_blocks.cpp — the paged KV cache's bookkeeping (see kv_blocks.hpp).
#include "infer/kv_blocks.hpp"

#include <algorithm>

#include "shardlm/error.hpp"

namespace shardlm {

KvBlocks::KvBlocks(int64_t blocks, int64_t block_size, int64_t slots, int64_t max_len)
    : block_size_(block_size), table_ld_((max_len + block_size - 1) / block_size) {
  SHARDLM_CHECK(blocks >= 1 && blocks <= INT32_MAX && block_size >= 1 && slots >= 1 && max_len >= 1,
                "internal: a KV pool of %lld blocks of %lld positions for %lld slots of %lld", (long long)blocks,
                (long long)block_size, (long long)slots, (long long)max_len);
  table_.assign(size_t(slots * table_ld_), 0);
  length_.assign(size_t(slots), 0);
  refs_.assign(size_t(blocks), 0);
  filled_.assign(size_t(blocks), 0);
  free_.resize(size_t(blocks));
  for (int64_t b = 0; b < blocks; ++b) free_[size_t(b)] = int32_t(blocks - 1 - b);
}

int32_t KvBlocks::take_block() {
  SHARDLM_CHECK(!free_.empty(), "internal: no free KV block of %lld", (long long)blocks());
  const int32_t b = free_.back();
  free_.pop_back();
  refs_[size_t(b)] = 1;
  return b;
}

void KvBlocks::set_filled(int32_t block, int64_t positions) {
  held_ += positions - filled_[size_t(block)];
  filled_[size_t(block)] = int32_t(positions);
  if (used_blocks() > peak_used_ || (used_blocks() == peak_used_ && held_ > held_at_peak_))
    peak_used_ = used_blocks(), held_at_peak_ = held_;
}

void KvBlocks::set_entry(int32_t slot, int64_t i, int32_t block) {
  const int64_t at = int64_t(slot) * table_ld_ + i;
  table_[size_t(at)] = block;
  if (keep_written_) written_.push_back(int32_t(at));
}

int64_t KvBlocks::blocks_to_grow(int32_t slot, int64_t length) const {
  return std::max<int64_t>(0, blocks_for(length) - blocks_for(length_[size_t(slot)]));
}

void KvBlocks::grow(int32_t slot, int64_t length) {
  SHARDLM_CHECK(length <= table_ld_ * block_size_, "internal: slot %d to %lld positions, %lld at most", slot,
                (long long)length, (long long)(table_ld_ * block_size_));
  SHARDLM_CHECK(blocks_to_grow(slot, length) <= free_blocks(), "internal: slot %d needs %lld KV blocks, %lld free",
                slot, (long long)blocks_to_grow(slot, length), (long long)free_blocks());
  const int64_t from = length_[size_t(slot)];
  for (int64_t i = blocks_for(from); i < blocks_for(length); ++i) set_entry(slot, i, take_block());
  for (int64_t i = from / block_size_; i < blocks_for(length); ++i)
    set_filled(table_[size_t(int64_t(slot) * table_ld_ + i)], std::min(block_size_, length - i * block_size_));
  length_[size_t(slot)] = std::max(from, length);
}

BlockCopy KvBlocks::share(int32_t src, int32_t dst) {
  SHARDLM_CHECK(length_[size_t(dst)] == 0, "internal: slot %d shares into a slot holding %lld positions", dst,
                (long long)length_[size_t(dst)]);
  const int64_t length = length_[size_t(src)], full = length / block_size_;
  for (int64_t i = 0; i < full; ++i) {
    const int32_t b = table_[size_t(int64_t(src) * table_ld_ + i)];
    ++refs_[size_t(b)];
    set_entry(dst, i, b);
  }
  BlockCopy copy{-1, -1};
  if (full * block_size_ < length) {
    copy.from = table_[size_t(int64_t(src) * table_ld_ + full)];
    copy.to = take_block();
    set_entry(dst, full, copy.to);
    set_filled(copy.to, length - full * block_size_);
  }
  length_[size_t(dst)] = length;
  return copy;
}

void KvBlocks::release(int32_t slot) {
  for (int64_t i = 0; i < blocks_for(length_[size_t(slot)]); ++i) {
    const int32_t b = table_[size_t(int64_t(slot) * table_ld_ + i)];
    if (--refs_[size_t(b)] == 0) set_filled(b, 0), free_.push_back(b);
  }
  length_[size_t(slot)] = 0;
}

std::vector<int32_t> KvBlocks::take_written() {
  std::vector<int32_t> out;
  out.swap(written_);
  return out;
}

}  // namespace shardlm
