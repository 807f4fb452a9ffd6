// decode_attention.hpp — attention of one new query per sequence over its KV
// cache (the decode step of sampling), and the row copies that fill the cache.
//
// Owns: shardlm::cuda::decode_attention_forward (split-K over the cache length,
// GQA, fp32 softmax and accumulation, bf16 in and out), its partials' scratch
// size, copy_rows (the prefill's last-row gather) and store_kv (k and v into
// the cache).
// The contract is cpu::attention_decode_forward's (cpu/ops.hpp), the reference
// tests/gpu/test_decode.cpp checks these kernels against.
// Must not know: the model, MPI, the memory plan. Kernels allocate nothing and
// never synchronise the host; every launch goes on the caller's stream.
//
// Semantics: query b (H heads of D) attends to positions 0 .. len[b] - 1 of
// block-table row seq[b] (shardlm/kv_pages.hpp: the cache is a pool of blocks,
// a table row lists a sequence's blocks in position order); query head h reads
// kv head h / (H / KV); scores scaled by 1/sqrt(D). A warp reads positions in
// groups of 8 or 16 starting at a multiple of their size, so a group lies in
// one cache block (the block size is a multiple of 16): it looks the group's
// block id up once, a group ahead of its use, and reads the group's rows as
// it would read a contiguous cache's. The
// cache length is cut into chunks (decode_attention_chunks):
// one thread block per (row, kv head, group of up to 8 query heads, chunk) keeps an
// online softmax in registers and writes (max, sum, unnormalised output) in
// fp32; a second kernel combines a row's chunks in chunk order. Deterministic: no
// atomics, fixed orders. The grid is sized by max_len, not by the lengths, so
// one launch shape serves every step (thread blocks past a row's length return).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardlm/kv_pages.hpp"

namespace shardlm::cuda {

// Chunks the cache is cut into for a pass of B rows: only while the rows'
// own blocks (one per row, kv head and group of query heads) leave SMs
// without one, at most kDecodeMaxChunks and one per 32 positions. At batch 64
// on the 1B shape (512 blocks over 132 SMs) that is one chunk: measured the
// fastest (on an H200, 1.557 ms a step against 1.929 with 12 chunks of 32
// positions); a few rows over a long
// cache take many. Asks the current device its SM count (once).
inline constexpr int64_t kDecodeMaxChunks = 64;
int64_t decode_attention_chunks(int64_t B, int64_t H, int64_t KV, int64_t max_len);
// Bytes of the partials any pass of at most B rows needs, whatever its chunks:
// (B, H, most chunks) x (D + 2) fp32. Asks no device.
size_t decode_attention_scratch_bytes(int64_t B, int64_t H, int64_t D, int64_t max_len);

// out (B, H, D) overwritten; q (B, H, D), rows q_ld >= H D elements apart (the
// decoder's fused q|k|v rows); k_cache, v_cache (blocks, KV, block_size, D): a
// kv head's positions of a block together (kernel_common.cuh's kv_cache_at).
// pages: the block table, in device memory (rows of table_ld int32 block ids);
// pages.block_size a multiple of 16. seq (B): the table row query b reads
// (queries may share a row: a sequence's new tokens, each with its own len);
// len (B): int32 on the device, len in [1, max_len]; only the table entries of
// positions below len[b] are read. max_len (at most pages.capacity()) sizes the
// grid and the chunks, so one launch shape (and one captured graph) serves
// every step. H a multiple of KV; D <= 256. chunks: 0 for
// decode_attention_chunks(B, H, KV, max_len), or a count to force (tests).
// With one chunk the partial kernel writes out itself.
// scratch: decode_attention_scratch_bytes(B, H, D, max_len).
// Head dims 64 and 128 (16-byte rows) run on the tensor cores; 32 and 256 a
// kernel that reads 16 bytes a lane; others (or rows not 16-byte aligned) a
// scalar one.
//
// rope (the decode step's fused q|k|v rows, unrotated): the kernel rotates q
// and the new k itself (RoPE at positions[b], as rope_store_kv would) and
// stores k and v into physical row cache_rows[b] of the caches before it reads
// them, so no RoPE and store kernel runs first. q then holds the rows of
// rope_store_kv's qkv (H q heads, KV k heads, KV v heads); cache_rows[b] must
// be kv_cache_row(pages, seq[b], len[b] - 1), the row the chunk holding
// position len[b] - 1 reads back, and its block must be no other query's in
// the launch (a shared prefix block is never written). Only on the tensor-core
// kernel: decode_attention_ropes(D) says whether a call would take it.
struct DecodeRope {
  const int32_t* positions = nullptr;   // (B) the new token's position (RoPE's angle)
  const float* inv_freq = nullptr;      // (D / 2) RoPE's inverse frequencies
  const int32_t* cache_rows = nullptr;  // (B) the physical cache row (block * block_size + offset) its k and v go to
  __nv_bfloat16* k_cache = nullptr;     // the caches, written (the same as k_cache, v_cache)
  __nv_bfloat16* v_cache = nullptr;
};
bool decode_attention_ropes(int64_t D);
void decode_attention_forward(__nv_bfloat16* out, const __nv_bfloat16* q, int64_t q_ld, const __nv_bfloat16* k_cache,
                              const __nv_bfloat16* v_cache, const KvPages& pages, const int32_t* seq,
                              const int32_t* len, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_len,
                              int64_t chunks, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                              const DecodeRope* rope = nullptr);

// dst[dst_row[i]] = src[src_row[i]] for i < n, rows of `width` bf16 elements
// (source rows src_ld >= width elements apart; 0: width); a null index means
// the identity (row i). Rows must not overlap.
void copy_rows(__nv_bfloat16* dst, const int32_t* dst_row, const __nv_bfloat16* src, const int32_t* src_row,
               int64_t n, int64_t width, cudaStream_t stream, int64_t src_ld = 0);

// Row i's k (KV heads of D from k_src + i src_ld) and v (from v_src + i src_ld)
// into physical cache row rows[i] (block * block_size + offset, as
// kv_cache_row gives it) of k_cache and v_cache, laid out (blocks, KV,
// block_size, D), in one launch: the prefill's k and v, or the decode step's
// fused q|k|v rows.
void store_kv(__nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int32_t* rows, const __nv_bfloat16* k_src,
              const __nv_bfloat16* v_src, int64_t src_ld, int64_t n, int64_t KV, int64_t D, int64_t block_size,
              cudaStream_t stream);

}  // namespace shardlm::cuda
