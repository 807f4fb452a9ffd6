// kv_blocks.hpp — the paged KV cache's bookkeeping: which blocks of the pool
// each sequence holds.
//
// Owns: KvBlocks, the pool of `blocks` blocks of `block_size` positions, their
// reference counts, the block table (one row of table_ld block ids per slot,
// shardlm/kv_pages.hpp), each slot's length, and the table entries written
// since a device mirror last took them. A sequence takes blocks as it grows
// and gives them back when it ends; the samples of a group share the blocks
// of their prompt (reference counted, never written again: a position is
// written once), each with its own copy of the prompt's last, partly filled
// block. Hands out blocks from a stack, so the same calls give the same
// blocks (runs, and the CPU and GPU decoders, lay the cache out alike).
// Must not know: what a block holds (the decoders keep the keys and values),
// the device, sampling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardlm/kv_pages.hpp"

namespace shardlm {

// A block whose positions a new owner needs copied (the last, partly filled
// block of a shared prompt): every layer's keys and values of block `from`
// into block `to`.
struct BlockCopy {
  int32_t from = 0, to = 0;
};

class KvBlocks {
 public:
  // `slots` table rows of ceil(max_len / block_size) entries over a pool of `blocks`.
  KvBlocks(int64_t blocks, int64_t block_size, int64_t slots, int64_t max_len);

  int64_t blocks() const { return int64_t(refs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t free_blocks() const { return int64_t(free_.size()); }
  int64_t used_blocks() const { return blocks() - free_blocks(); }
  int64_t peak_used_blocks() const { return peak_used_; }
  // Positions the used blocks hold (a shared block once), now and when the
  // most blocks were in use: what the cache would hold without paging's waste.
  int64_t held_positions() const { return held_; }
  int64_t held_positions_at_peak() const { return held_at_peak_; }
  int64_t blocks_for(int64_t positions) const { return (positions + block_size_ - 1) / block_size_; }
  int64_t length(int32_t slot) const { return length_[size_t(slot)]; }
  int64_t table_ld() const { return table_ld_; }
  // The host table (slots, table_ld): entries past a slot's blocks are stale.
  KvPages pages() const { return {table_.data(), table_ld_, block_size_}; }

  // Blocks to add for `slot` to hold `length` positions (0 when it already does).
  int64_t blocks_to_grow(int32_t slot, int64_t length) const;
  // Slot holds `length` positions: blocks added for the new ones. Throws an
  // internal Error when the pool has too few (callers check free_blocks first)
  // or length is past the table's row.
  void grow(int32_t slot, int64_t length);
  // An empty `dst` takes the `length` positions `src` holds: src's full
  // blocks shared, a partly filled last block replaced by a fresh one that
  // the caller fills (returned; from = to = -1 when there is none). Needs one
  // free block when length is not a multiple of block_size.
  BlockCopy share(int32_t src, int32_t dst);
  // Every block of `slot` given up (freed when no other slot holds it); length 0.
  void release(int32_t slot);

  // Table entries (slot * table_ld + i) written since the last call, for a
  // device copy of the table (kept only once keep_written() is called); cleared.
  void keep_written() { keep_written_ = true; }
  std::vector<int32_t> take_written();

 private:
  int32_t take_block();
  void set_entry(int32_t slot, int64_t i, int32_t block);
  void set_filled(int32_t block, int64_t positions);

  int64_t block_size_, table_ld_;
  std::vector<int32_t> table_;    // (slots, table_ld)
  std::vector<int64_t> length_;   // (slots) positions held
  std::vector<int32_t> refs_;     // (blocks) slots holding each block
  std::vector<int32_t> filled_;   // (blocks) positions written in each block
  std::vector<int32_t> free_;     // a stack of free blocks, the lowest id on top at the start
  std::vector<int32_t> written_;  // table entries since take_written
  int64_t peak_used_ = 0, held_ = 0, held_at_peak_ = 0;
  bool keep_written_ = false;
};

}  // namespace shardlm
