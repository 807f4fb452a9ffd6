// skinny_gemm.hpp — the decoder's projections at a decode step's few rows:
// out (M, N) = A (M, K) Wᵀ (+ bias) (+ residual) for M ≤ 64, W (N, K) a bf16
// weight read once from HBM. The time is the weight's bytes; what matters is
// that every SM streams some of them. cuBLASLt's tiles for M = 64 can leave
// most of the 132 SMs idle on a 2048-wide output (docs/benchmarks.md, the
// decode step's trace), so this kernel cuts N into 64-column tiles and K into
// splits until ~2 CTAs an SM have work, and adds the splits' fp32 partials in a
// second kernel in split order: deterministic, the same bits for the same shape
// on the same GPU model.
//
// Each CTA: 4 warps, a 64 × 64 output tile (all rows), 64-deep K steps through
// a 3-stage cp.async pipeline into XOR-swizzled shared memory, ldmatrix
// fragments, bf16 mma.sync with fp32 accumulators (m16n8k16). Rows ≥ M and
// columns ≥ N are zero-filled on load and not stored.
//
// Owns: the kernels, the split rule and the partials' size.
// Must not know: which projection it computes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm.hpp"

namespace shardlm::cuda {

inline constexpr int64_t kSkinnyMaxRows = 64;

// Whether skinny_linear_forward takes this shape: 1 ≤ M ≤ 64, K a multiple of 8
// (16-byte rows), lda a multiple of 8, A and W 16-byte aligned.
bool skinny_supported(int64_t M, int64_t N, int64_t K, int64_t lda, const void* A, const void* W);

// The splits of K for this shape on a GPU of `sms` SMs, and the fp32 partials
// they need (0 when K is not split): never more than kSkinnyPartialBytes, so a
// caller can hold that much for every shape without knowing the GPU.
inline constexpr size_t kSkinnyPartialBytes = size_t(8) << 20;
int skinny_splits(int64_t M, int64_t N, int64_t K, int sms);
size_t skinny_workspace_bytes(int64_t M, int64_t N, int64_t K, int sms);

// out (M, N), row stride N: bf16 (out_type BF16; + bias (N) and + residual (M, N)
// when given, each added to the fp32 sum before the one rounding) or fp32
// (out_type F32; no bias or residual). A (M, K) at row stride lda. `workspace`:
// at least skinny_workspace_bytes(M, N, K, sms), 16-byte aligned. residual may
// be out (read before written, element by element).
void skinny_linear_forward(void* out, GemmOut out_type, const bf16* A, int64_t lda, const bf16* W,
                           const bf16* bias, const bf16* residual, int64_t M, int64_t N, int64_t K,
                           float* workspace, size_t workspace_bytes, int sms, cudaStream_t stream);

}  // namespace shardlm::cuda
