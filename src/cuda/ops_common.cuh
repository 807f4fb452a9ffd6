// ops_common.cuh — what the kernel files behind ops.hpp and optim_kernels.hpp
// (embedding, rmsnorm, elementwise, cross_entropy, reduce, optim_kernels .cu) share;
// not an installed header: launch sizing, the checks on sizes a kernel cannot take,
// the 256-byte alignment of scratch layouts, and the ordered column pass that
// finishes every deterministic column reduction (defined in reduce.cu).
// Must not know: any one op; the model, the deck, MPI.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "shardlm/error.hpp"

namespace shardlm::cuda::dev {

// ---------------------------------------------------------------- common

inline constexpr int kThreads = 256;        // elementwise kernels

__host__ __device__ constexpr int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

inline unsigned grid_for(int64_t items, int threads) {
  const int64_t blocks = div_up(items, threads);
  SHARDLM_CHECK(blocks <= INT_MAX, "CUDA launch: %lld blocks do not fit one grid",
                static_cast<long long>(blocks));
  return static_cast<unsigned>(blocks);
}

// Grid-stride loops cap their grid here: enough blocks to fill any GPU many times.
inline unsigned grid_capped(int64_t items, int threads) {
  return static_cast<unsigned>(std::min<int64_t>(div_up(items, threads), 1 << 16));
}

inline void check_size(int64_t v, int64_t max, const char* what, const char* op) {
  SHARDLM_CHECK(v >= 0 && v <= max, "%s: %s = %lld is outside [0, %lld]", op, what,
                static_cast<long long>(v), static_cast<long long>(max));
}

inline size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// *amax = 0 on the stream (amax nullptr: nothing): before a kernel whose blocks
// fold a tensor's FP8 amax into it (block_amax_into, kernel_common.cuh).
void zero_amax(float* amax, cudaStream_t stream);

// dst[c] += sum over p of partial[p][c], p in order: the second pass of every
// deterministic column reduction. partial (P, C) fp32, dst (C) fp32.
void launch_column_finish(float* dst, const float* partial, int64_t P, int C,
                          cudaStream_t stream);

}  // namespace shardlm::cuda::dev
