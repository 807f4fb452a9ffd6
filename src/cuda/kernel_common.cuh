// kernel_common.cuh — helpers shared by the .cu files of src/cuda (not an
// installed header): vector packs, the fixed-order block reduction, and the
// row-cluster kernels' (cross-entropy, RL policy loss) split of a row, launch
// configuration and first pass.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "shardlm/error.hpp"

namespace shardlm::cuda::dev {

namespace cg = cooperative_groups;

using bf16 = __nv_bfloat16;
inline constexpr unsigned kFullMask = 0xffffffffu;

// VEC elements of T moved as one access (16 bytes for 8 bf16 or 4 floats).
template <int BYTES> struct RawType;
template <> struct RawType<16> { using type = uint4; };
template <> struct RawType<8> { using type = uint2; };
template <> struct RawType<4> { using type = uint32_t; };
template <> struct RawType<2> { using type = uint16_t; };

template <class T, int VEC>
struct Pack {
  using Raw = typename RawType<sizeof(T) * VEC>::type;
  union {
    Raw raw;
    T v[VEC];
  };
  __device__ __forceinline__ static Pack load(const T* p) {
    Pack x;
    x.raw = *reinterpret_cast<const Raw*>(p);
    return x;
  }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<Raw*>(p) = raw; }
};

__device__ __forceinline__ float f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }

// The CUDA decoder's paged KV cache layout, (blocks, KV, block_size, D): a
// kv head's positions of one block lie together, so a decode-attention warp
// streams a contiguous range for each group of positions inside a block. A
// physical cache row (block * block_size + offset, shardlm/kv_pages.hpp's
// kv_cache_row) of kv head kh starts here.
__device__ __forceinline__ int64_t kv_cache_at(int64_t row, int kh, int KV, int64_t block_size, int D) {
  const int64_t block = row / block_size, offset = row - block * block_size;
  return ((block * KV + kh) * block_size + offset) * D;
}

// RoPE of one pair (x1 at dim i, x2 at i + D/2) at an angle's cos and sin, as
// transformers' x cos + rotate_half(x) sin. One definition for every kernel
// that rotates (the training and decode RoPE, the decode attention's own), so
// they round alike: the decoder's paths give the same bits.
__device__ __forceinline__ void rope_pair(float x1, float x2, float cs, float sn, bf16& lo, bf16& hi) {
  lo = to_bf16(x1 * cs - x2 * sn);
  hi = to_bf16(x2 * cs + x1 * sn);
}

struct SumOp {
  template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Whole-warp butterflies: every lane ends with the same bits (each level
// combines the same two partials, only in swapped order).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Whole-block reduction in a fixed order: an xor butterfly inside each warp (both
// partners combine the same two values, so every lane holds the same bits), then
// the warp results in warp order. Every thread returns the same value.
// red: blockDim.x / 32 elements; contains __syncthreads(), call from all threads.
// THREADS: the block size when it is known at compile time (the warp loop is then
// unrolled, its shared loads issued together: 6% of the RL loss kernel's time
// against the loop over blockDim), else 0.
template <int THREADS = 0, class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* red) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with red
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  T t = red[0];
  if constexpr (THREADS > 0) {
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) t = op(t, red[w]);
  } else {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) t = op(t, red[w]);
  }
  return t;
}

// Folds m, the largest |x| a thread wrote, into *amax (model.fp8's amax of a
// tensor, computed by the kernel that writes it instead of in a pass of its
// own): the block's max (MaxOp: NaN ignored, as cuda::fp8_amax), then one
// atomicMax on its bits (non-negative floats order as their bit patterns), so
// the result is fp8_amax's bit for bit in any order. amax nullptr: nothing.
// Call from all threads (block_reduce's barriers) with amax uniform over the
// block; the caller zeroes *amax before the launch.
template <int THREADS>
__device__ __forceinline__ void block_amax_into(float* amax, float m, float* red) {
  if (amax == nullptr) return;
  m = block_reduce<THREADS>(m, MaxOp{}, red);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

// How the row kernels of a loss over the vocabulary (cross_entropy.cu's cross-entropy and
// rl_loss.cu's RL loss) split a row of V logits: one cluster of `csize`
// CTAs per row, CTA r holding columns [r * chunk, ...) in `smem` bytes of shared
// memory. The smallest power-of-two cluster whose bf16 slice fits 64 KiB (several
// CTAs per SM), else 8 CTAs (the portable cluster limit) with up to 200 KiB each;
// chunk is a multiple of vec_width. Throws (naming op) when V is too large.
// (Inline: the RL loss's standalone test build links no cross_entropy.cu.)
struct RowClusterSplit {
  int csize = 1;
  int64_t chunk = 0;
  size_t smem = 0;
};
constexpr int kRowClusterMax = 8;
constexpr size_t kRowClusterSmemTarget = 64 * 1024;
constexpr size_t kRowClusterSmemMax = 200 * 1024;
inline RowClusterSplit row_cluster_split(int64_t V, int64_t vec_width, const char* op) {
  RowClusterSplit s;
  for (s.csize = 1;; s.csize *= 2) {
    const int64_t per_cta = (V + s.csize - 1) / s.csize;
    s.chunk = (per_cta + vec_width - 1) / vec_width * vec_width;
    if (size_t(s.chunk) * sizeof(bf16) <= kRowClusterSmemTarget || s.csize == kRowClusterMax) break;
  }
  s.smem = size_t(s.chunk) * sizeof(bf16);
  SHARDLM_CHECK(s.smem <= kRowClusterSmemMax, "%s: V = %lld is too large for one cluster (at most %lld)", op,
                static_cast<long long>(V),
                static_cast<long long>(kRowClusterSmemMax / sizeof(bf16) * kRowClusterMax));
  return s;
}

// The launch configuration of n rows split that way, threads per CTA: pass
// &launch.cfg to cudaLaunchKernelEx (it points at launch's own attribute, so a
// RowClusterLaunch stays where it was made).
struct RowClusterLaunch {
  RowClusterLaunch(const RowClusterSplit& split, int64_t n, int threads, cudaStream_t stream) {
    cfg.gridDim = dim3(unsigned(n * split.csize));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = split.smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(split.csize);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  RowClusterLaunch(const RowClusterLaunch&) = delete;
  RowClusterLaunch& operator=(const RowClusterLaunch&) = delete;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1]{};
};

// Pass 1 of a row-cluster kernel (one row per cluster, each CTA a slice of it in
// shared memory): the slice's nvec packs of VEC bf16 at xs go to slice, BATCH
// 16-byte loads in flight per thread (each thread reads back only the packs it
// stored); returns the row max over the cluster, the same bits in every thread.
// red: THREADS / 32 floats; cta_max: a __shared__ float the other CTAs read.
// Contains a cluster barrier: call from every thread of every CTA of the cluster.
template <int VEC, int THREADS, int BATCH>
__device__ __forceinline__ float slice_to_smem_row_max(const bf16* __restrict__ xs, int nvec,
                                                       Pack<bf16, VEC>* slice, float* red,
                                                       float* cta_max, cg::cluster_group& cluster) {
  using P = Pack<bf16, VEC>;
  float m = -INFINITY;
  for (int i0 = threadIdx.x; i0 < nvec; i0 += BATCH * THREADS) {
    P p[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = i0 + b * THREADS;
      if (i < nvec) p[b] = P::load(xs + int64_t(i) * VEC);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = i0 + b * THREADS;
      if (i >= nvec) break;
      slice[i] = p[b];
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = fmaxf(m, f32(p[b].v[j]));
    }
  }
  m = block_reduce<THREADS>(m, MaxOp{}, red);
  if (threadIdx.x == 0) *cta_max = m;
  cluster.sync();
  float row_max = -INFINITY;  // in rank order: the same bits in every CTA
  for (int r = 0; r < int(cluster.num_blocks()); ++r)
    row_max = fmaxf(row_max, *cluster.map_shared_rank(cta_max, r));
  return row_max;
}

}  // namespace shardlm::cuda::dev
