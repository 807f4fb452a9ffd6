// ring_attention.hpp — context parallelism's attention on the CUDA backend: the
// ring over a group of C ranks that share one micro-batch's sequences. The CPU
// twin (the reference) is cpu/ring_attention.hpp; same algorithm, same order of
// ring exchanges, so the two backends' rings are numbered alike by the watchdog.
//
// Owns: the passes over one K/V block (attention_masked_*, ring_attention.cu: the
// flash kernels of attention_kernels.cuh under the ring's mask, forward merged by
// log-sum-exp) and cuda::RingAttention with the sizes of its buffers (ring_walk.cu;
// the backend's table allocates them and counts them in the memory plan). Each rank
// holds its own tokens' q, k, v; a block (k | v | token_index | seq_id | tile
// bounds) travels rank to rank through a device Comm's ring_exchange (NCCL, or MPI
// staged through pinned host memory when ranks share a GPU) while the block passes
// attend this rank's queries to the block held, merging into fp32 accumulators by
// log-sum-exp. Backward passes the blocks round again with their fp32 dK/dV
// accumulators, which are back at their owners after C hops.
// Overlap: forward attends to block s while block s+1 travels; backward computes
// dK/dV of block s while block s+1 travels, then dQ while the accumulators travel.
// Must not know: MPI, NCCL, the model, units or shards. The Comm is only named
// here, so the block passes' test builds without MPI.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace shardlm {
class Comm;
}

namespace shardlm::cuda {

// ---- one K/V block of the ring (ring_attention.cu) ----
//
// Queries and keys are separate token arrays (this rank's queries; the K/V block of
// some rank of the group), each token carrying its index in the group's whole
// micro-batch and its seq_id: key j is visible to query i iff
// k.index[j] <= q.index[i] and k.seq[j] == q.seq[i]. Indices increase along each
// array (context_split.hpp), so a tile of keys whose smallest index is past a tile of
// queries' largest, or whose seq_ids do not meet theirs, is skipped whole.
//
// `bounds` is per run of 16 tokens (min index, max index, min seq, max seq), int32 x 4
// (attention_tile_bounds); the kernels combine runs into their own tile sizes.
struct AttentionTokens {
  const int32_t* index = nullptr;   // (n) index in the group's micro-batch, increasing
  const int32_t* seq = nullptr;     // (n) seq_id
  const int32_t* bounds = nullptr;  // (attention_tile_bounds_bytes(n) / 4) from attention_tile_bounds
  int64_t n = 0;
};

size_t attention_tile_bounds_bytes(int64_t n);
void attention_tile_bounds(int32_t* bounds, const int32_t* index, const int32_t* seq, int64_t n,
                           cudaStream_t stream);

// One block of the ring's forward, merged into fp32 accumulators by log-sum-exp:
//   out_acc (Nq, H, D) fp32 and lse_acc (Nq, H) fp32 hold the result over the blocks
//   seen so far (normalised: out_acc = sum_j softmax_j v_j over those keys). first =
//   true overwrites them with this block's result (out 0, lse -inf for a row that
//   sees none of its keys); first = false merges: lse' = log(e^lse + e^lse_block),
//   out' = out e^(lse - lse') + out_block e^(lse_block - lse'). Each (row, head) is
//   owned by one thread group, so the merge is deterministic. The caller rounds
//   out_acc to bf16 once, after the last block.
// q (Nq, H, D); k, v (Nk, KV, D) bf16.
void attention_masked_forward(float* out_acc, float* lse_acc, bool first, const __nv_bfloat16* q,
                              const AttentionTokens& queries, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const AttentionTokens& keys, int64_t H,
                              int64_t KV, int64_t D, cudaStream_t stream);

// delta (N, H) fp32 = rowsum(dout * out) over the final out (FlashAttention-2):
// computed once per backward, before the blocks.
void attention_masked_delta(float* delta, const __nv_bfloat16* dout, const __nv_bfloat16* out,
                            int64_t N, int64_t H, int64_t D, cudaStream_t stream);

// One block of the ring's backward with the final lse (Nq, H) and delta:
//   dq_acc (Nq, H, D) fp32 += the block's keys' share of dq;
//   dk_acc, dv_acc (Nk, KV, D) fp32 += this rank's queries' share of the block's dk, dv
//   (the accumulators that travel the ring with the block).
// Additions are owned per element (dq by query rows, dk/dv by key rows): no atomics.
// dq_acc = nullptr skips the dq kernel, dk_acc = dv_acc = nullptr the dk/dv kernel
// (the ring sends the dk/dv accumulators on while dq is computed).
void attention_masked_backward(float* dq_acc, float* dk_acc, float* dv_acc,
                               const __nv_bfloat16* dout, const __nv_bfloat16* q,
                               const float* lse, const float* delta,
                               const AttentionTokens& queries, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const AttentionTokens& keys, int64_t H,
                               int64_t KV, int64_t D, cudaStream_t stream);

// ---- the ring over the group (ring_walk.cu) ----

// The ring's device buffers for up to N tokens per rank (kv width KVD = KV * D,
// H * D query width), allocated by the backend from its table.
struct RingBuffers {
  void* block[2] = {};             // (block_bytes) the block attended to, the one arriving
  float* grad[2] = {};             // (2, N, KV, D) its dk | dv accumulators, held and arriving
  float* acc = nullptr;            // (N, H, D) forward's out accumulator, then backward's dq
  int32_t* query_bounds = nullptr; // (tile_bounds_bytes / 4) this rank's tokens' tile bounds

  static int64_t block_bytes(int64_t N, int64_t KVD);
  static int64_t grad_bytes(int64_t N, int64_t KVD) { return 2 * N * KVD * int64_t(sizeof(float)); }
  static int64_t acc_bytes(int64_t N, int64_t HD) { return N * HD * int64_t(sizeof(float)); }
  static int64_t bounds_bytes(int64_t N);
  // A staged device Comm's pinned buffers must hold the largest message: the
  // accumulators (4 bytes an element) outweigh the block (2).
  static int64_t staging_bytes(int64_t N, int64_t KVD) {
    const int64_t b = block_bytes(N, KVD), g = grad_bytes(N, KVD);
    return b > g ? b : g;
  }
};

class RingAttention {
 public:
  // `group`: a device Comm over the C ranks sharing the sequences, in ring order,
  // ordered against `stream` (not owned); `buffers` sized for at least N tokens.
  RingAttention(Comm& group, const RingBuffers& buffers, int64_t capacity_tokens, cudaStream_t stream)
      : group_(group), b_(buffers), capacity_(capacity_tokens), stream_(stream) {}

  // out (n, H, D) bf16 and lse (n, H) fp32 overwritten; q (n, H, D), k, v (n, KV, D);
  // token_index, seq_id (n) device int32, the index increasing.
  void forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v, const int32_t* token_index, const int32_t* seq_id, int64_t n,
               int64_t H, int64_t KV, int64_t D);
  // dq (n, H, D), dk, dv (n, KV, D) bf16 overwritten; out, lse as forward made them;
  // delta (n, H) fp32 scratch.
  void backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                const __nv_bfloat16* out, const float* lse, const int32_t* token_index,
                const int32_t* seq_id, float* delta, int64_t n, int64_t H, int64_t KV, int64_t D);

 private:
  Comm& group_;
  RingBuffers b_;
  int64_t capacity_;
  cudaStream_t stream_;
};

}  // namespace shardlm::cuda
