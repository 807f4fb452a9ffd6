// kv_pages.hpp — where a sequence's positions lie in a paged KV cache.
//
// Owns: KvPages, the block table a decode attention reads the cache through,
// and kv_cache_row, its addressing. The cache is a pool of blocks of
// `block_size` positions; each sequence has a row of the table listing its
// blocks in position order, so position p of table row s lies in block
// table[s * table_ld + p / block_size] at offset p % block_size. Shared by the
// CPU reference (cpu::attention_decode_forward), the CUDA kernels
// (cuda/decode_attention.hpp) and the decoders that keep the table
// (infer/kv_blocks.hpp). Knows nothing of how blocks are handed out.
#pragma once

#include <cstdint>

namespace shardlm {

struct KvPages {
  const int32_t* table = nullptr;  // (rows, table_ld) block ids; device memory for the CUDA kernels
  int64_t table_ld = 0;            // entries per table row: the most blocks one sequence holds
  int64_t block_size = 0;          // positions per block
  int64_t capacity() const { return table_ld * block_size; }  // positions one table row can address
};

// The cache row (block * block_size + offset) of position p of table row s.
inline int64_t kv_cache_row(const KvPages& pages, int64_t s, int64_t p) {
  return int64_t(pages.table[s * pages.table_ld + p / pages.block_size]) * pages.block_size + p % pages.block_size;
}

}  // namespace shardlm
