// ring_attention.hpp — context parallelism's attention on the CUDA backend: the
// ring over a group of C ranks that share one micro-batch's sequences. The CPU
// twin (the reference) is cpu/ring_attention.hpp; same algorithm, same order of
// ring exchanges, so the two backends' rings are numbered alike by the watchdog.
//
// Owns: cuda::RingAttention and the sizes of its buffers (the backend's table
// allocates them and counts them in the memory plan). Each rank holds its own
// tokens' q, k, v; a block (k | v | token_index | seq_id | tile bounds) travels
// rank to rank through a device Comm's ring_exchange (NCCL, or MPI staged through
// pinned host memory when ranks share a GPU) while the masked flash kernels
// (attention.hpp) attend this rank's queries to the block held, merging into fp32
// accumulators by log-sum-exp. Backward passes the blocks round again with their
// fp32 dK/dV accumulators, which are back at their owners after C hops.
// Overlap: forward attends to block s while block s+1 travels; backward computes
// dK/dV of block s while block s+1 travels, then dQ while the accumulators travel.
// Must not know: MPI, NCCL, the model, units or shards.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "shardlm/comm.hpp"

namespace shardlm::cuda {

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
