// attention.hpp — causal, GQA, packed-document flash attention on the GPU, and the
// per-block passes of context parallelism's ring.
//
// Owns: shardlm::cuda::attention_forward / attention_backward (bf16 in and out,
// fp32 softmax, accumulation and logsumexp), the document-start scan they use, and
// the scratch size backward needs. The same contract as shardlm::cpu::attention_*
// (cpu/ops.hpp), which is the reference these kernels are tested against
// (tests/gpu/test_attention.cu). Context parallelism's block passes, the same
// kernels under another mask, are cuda/ring_attention.hpp's attention_masked_*.
// Must not know: the model, MPI, NCCL, the memory plan. Kernels allocate nothing
// and never synchronise the host; every launch goes on the caller's stream.
//
// Semantics (as the CPU reference):
//   - q (N, H, D), k and v (N, KV, D), out (N, H, D): bf16, token-major; N is every
//     packed token of the micro-batch. Query head h reads kv head h / (H / KV).
//   - Token i attends to token j iff j <= i and j lies in i's document, a maximal
//     run of equal seq_id (N) (so adjacent documents need different seq_id).
//   - Scores are scaled by 1/sqrt(D); lse (N, H) fp32 is the natural logsumexp of
//     the scaled scores, saved for backward.
//   - Memory is O(N): scores and probabilities live in registers, tile by tile.
//   - Deterministic: no atomics; every sum runs in a fixed order, so the same
//     inputs give the same bits on every run.
//
// Head dims 32, 64 and 128 run on tensor cores (mma.sync m16n8k16 bf16, fp32
// accumulate; sm_80 and later). Any other D <= 256 runs on a slow, simple fallback
// kernel (for tiny test models).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace shardlm::cuda {

// out (N, H, D) overwritten; lse (N, H) overwritten; q (N, H, D); k, v (N, KV, D);
// seq_id (N); doc_start_scratch (N) int32 is overwritten with the index of the
// first token of each token's document (a prefix scan over seq_id).
// H must be a multiple of KV; D <= 256; pointers 16-byte aligned.
void attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* v,
                       const int32_t* seq_id, int32_t* doc_start_scratch, int64_t N,
                       int64_t H, int64_t KV, int64_t D, cudaStream_t stream);

// Bytes of delta_scratch attention_backward needs: delta = rowsum(dout * out), fp32
// (N, H).
size_t attention_backward_scratch_bytes(int64_t N, int64_t H, int64_t KV, int64_t D);

// FlashAttention-2 style backward, recomputing probabilities from q, k and lse.
//   dq (N, H, D), dk and dv (N, KV, D) overwritten (bf16); dout (N, H, D); q, k, v,
//   out, lse as forward produced them; seq_id (N).
//   doc_start_scratch (N) int32 and delta_scratch (attention_backward_scratch_bytes)
//   are overwritten: backward rescans seq_id itself, so it never depends on what
//   survived in forward's scratch.
// One kernel owns key blocks (dk, dv summed over the GQA group's heads, then query
// blocks, in that order) and another owns query blocks (dq): no atomics.
void attention_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                        const __nv_bfloat16* dout, const __nv_bfloat16* q,
                        const __nv_bfloat16* k, const __nv_bfloat16* v,
                        const __nv_bfloat16* out, const float* lse,
                        const int32_t* seq_id, int32_t* doc_start_scratch,
                        float* delta_scratch, int64_t N, int64_t H, int64_t KV,
                        int64_t D, cudaStream_t stream);

// doc_start (N) = the first index of each token's run of equal seq_id. Forward and
// backward call it; exposed for tests and for callers that want it once per batch.
void attention_doc_start(int32_t* doc_start, const int32_t* seq_id, int64_t N,
                         cudaStream_t stream);

// ---- testing and tuning only (tests/gpu/test_attention.cu) ----
// Which kernel configuration the calls above use. kAuto picks the tuned tensor-core
// kernels (generic fallback for unsupported D); kGeneric forces the simple
// fallback for any D; kVariantN picks an alternative tensor-core tiling, so the test
// can check and time each one. kGeneric also sends the ring's block passes
// (ring_attention.hpp) to the generic kernels. Not thread-safe; leave it at kAuto
// in the trainer.
enum class AttentionKernel { kAuto, kGeneric, kVariant1, kVariant2, kVariant3, kVariant4 };
void attention_set_kernel(AttentionKernel kernel);
// A one-line description of the kernels attention_* would launch for head dim D
// (tile sizes, warps), for test and benchmark logs.
const char* attention_kernel_name(int64_t D);

}  // namespace shardlm::cuda
