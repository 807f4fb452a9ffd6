// ops.cu — CUDA kernels and launchers; see src/cuda/ops.hpp for the
// contract and docs/kernels.md for precision, determinism and bytes moved per op.
#include "cuda/ops.hpp"
#include "kernel_common.cuh"

#include <cooperative_groups.h>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cmath>

namespace shardlm::cuda {

namespace {

namespace cg = cooperative_groups;
using namespace dev;  // Pack, f32, to_bf16, block_reduce, SumOp, MaxOp (kernel_common.cuh)

// ---------------------------------------------------------------- common

constexpr int kThreads = 256;        // elementwise kernels

__host__ __device__ constexpr int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

unsigned grid_for(int64_t items, int threads) {
  const int64_t blocks = div_up(items, threads);
  SHARDLM_CHECK(blocks <= INT_MAX, "CUDA launch: %lld blocks do not fit one grid",
                static_cast<long long>(blocks));
  return static_cast<unsigned>(blocks);
}

// Grid-stride loops cap their grid here: enough blocks to fill any GPU many times.
unsigned grid_capped(int64_t items, int threads) {
  return static_cast<unsigned>(std::min<int64_t>(div_up(items, threads), 1 << 16));
}

void check_size(int64_t v, int64_t max, const char* what, const char* op) {
  SHARDLM_CHECK(v >= 0 && v <= max, "%s: %s = %lld is outside [0, %lld]", op, what,
                static_cast<long long>(v), static_cast<long long>(max));
}

// Sum over the G consecutive threads of a group (G a power of two, uniform over the
// block). Every thread of the group gets the same bits: the xor butterfly adds the
// same two values on both sides, and across warps every thread adds the warp sums
// in warp order. Contains __syncthreads() when G > 32: call from all threads.
__device__ __forceinline__ float group_sum(float v, int G, float* red) {
  for (int o = min(G, 32) >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  if (G <= 32) return v;
  const int warp = threadIdx.x >> 5;
  const int warps_per_group = G >> 5;
  const int first = (warp / warps_per_group) * warps_per_group;
  __syncthreads();  // red may still be read from the previous call
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float t = red[first];
  for (int w = 1; w < warps_per_group; ++w) t += red[first + w];
  return t;
}

// dst[c] += sum over p of partial[p][c], p in order: the second pass of every
// deterministic column reduction. partial (P, C). Block (32, kFinishSlices): each
// thread sums the rows p = y, y + kFinishSlices, ... then slice sums in slice order.
constexpr int kFinishSlices = 16;
__global__ void __launch_bounds__(32 * kFinishSlices)
column_finish_kernel(float* __restrict__ dst, const float* __restrict__ partial, int64_t P,
                     int C) {
  __shared__ float slice_sum[kFinishSlices][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float t = 0.0f;
  if (c < C)
    for (int64_t p = threadIdx.y; p < P; p += kFinishSlices) t += partial[p * C + c];
  slice_sum[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float s = slice_sum[0][threadIdx.x];
  for (int y = 1; y < kFinishSlices; ++y) s += slice_sum[y][threadIdx.x];
  dst[c] += s;
}

void launch_column_finish(float* dst, const float* partial, int64_t P, int C,
                          cudaStream_t stream) {
  column_finish_kernel<<<grid_for(C, 32), dim3(32, kFinishSlices), 0, stream>>>(dst, partial,
                                                                                 P, C);
  CUDA_CHECK(cudaGetLastError());
}

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

// ---------------------------------------------------------------- embedding

template <int VEC>
__global__ void __launch_bounds__(kThreads)
embedding_forward_kernel(bf16* __restrict__ out, const int32_t* __restrict__ ids,
                         const bf16* __restrict__ table, int64_t N, int64_t V, int C) {
  using P = Pack<bf16, VEC>;
  const int nvec = C / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * nvec) return;
  const int64_t t = idx / nvec;
  const int c = int(idx % nvec) * VEC;
  const int32_t id = ids[t];
  P p;
  if (id >= 0 && id < V) {
    p = P::load(table + int64_t(id) * C + c);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = __ushort_as_bfloat16(0x7fc0);  // NaN
  }
  p.store(out + t * C + c);
}

constexpr int kEmbedTile = 32;   // sorted tokens per tile (fixes the summation order)
constexpr int kEmbedBatch = 8;   // rows loaded before they are added (loads in flight)

struct EmbedScratch {
  size_t keys_sorted, toks_in, toks_sorted, partial, cub_temp, cub_bytes, total;
};

EmbedScratch embed_scratch(int64_t N, int64_t C) {
  EmbedScratch s{};
  size_t cub_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), int(N), 0, 32));
  const size_t ints = size_t(N) * sizeof(int32_t);
  const int64_t tiles = div_up(N, kEmbedTile);
  s.keys_sorted = 0;
  s.toks_in = s.keys_sorted + align256(ints);
  s.toks_sorted = s.toks_in + align256(ints);
  s.partial = s.toks_sorted + align256(ints);
  s.cub_temp = s.partial + align256(size_t(2 * tiles * C) * sizeof(float));
  s.cub_bytes = cub_bytes;
  s.total = s.cub_temp + align256(cub_bytes);
  return s;
}

__global__ void iota_kernel(int32_t* __restrict__ x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = int32_t(i);
}

template <int VEC>
__device__ __forceinline__ void add_to_row(float* __restrict__ row, const float (&acc)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      auto p = Pack<float, 4>::load(row + j);
#pragma unroll
      for (int q = 0; q < 4; ++q) p.v[q] += acc[j + q];
      p.store(row + j);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) row[j] += acc[j];
  }
}

template <int VEC>
__device__ __forceinline__ void store_row(float* __restrict__ row, const float (&acc)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      Pack<float, 4> p;
#pragma unroll
      for (int q = 0; q < 4; ++q) p.v[q] = acc[j + q];
      p.store(row + j);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) row[j] = acc[j];
  }
}

template <int VEC>
__device__ __forceinline__ void load_row(const float* __restrict__ row, float (&acc)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 4) {
      const auto p = Pack<float, 4>::load(row + j);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j + q] += p.v[q];
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += row[j];
  }
}

// Pass 1 over tiles of kEmbedTile sorted tokens. Within a tile each run of equal
// ids is summed in token order; a run that lies wholly inside the tile is added to
// dtable here (no other tile touches that id). A run that crosses a tile boundary
// leaves this tile's portion in partial[tile][slot] (slot 0: the portion that
// starts the tile, slot 1: the last portion) for pass 2.
template <int VEC>
__global__ void __launch_bounds__(64)
embedding_backward_tiles_kernel(float* __restrict__ dtable, float* __restrict__ partial,
                                const bf16* __restrict__ dout,
                                const int32_t* __restrict__ keys,
                                const int32_t* __restrict__ toks, int64_t N, int64_t V,
                                int C) {
  using P = Pack<bf16, VEC>;
  __shared__ int32_t s_key[kEmbedTile];
  __shared__ int32_t s_tok[kEmbedTile];
  __shared__ bool prev_same, next_same;
  const int64_t tile = blockIdx.x;
  const int64_t t0 = tile * kEmbedTile, t1 = min(N, t0 + kEmbedTile);
  const int len = int(t1 - t0);
  if (threadIdx.x < len) {
    s_key[threadIdx.x] = keys[t0 + threadIdx.x];
    s_tok[threadIdx.x] = toks[t0 + threadIdx.x];
  }
  if (threadIdx.x == 0) {
    prev_same = t0 > 0 && keys[t0 - 1] == keys[t0];
    next_same = t1 < N && keys[t1] == keys[t1 - 1];
  }
  __syncthreads();
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (c >= C) return;

  float acc[VEC] = {};
  int begin = 0;  // first index (in the tile) of the current portion
  for (int i0 = 0; i0 < len; i0 += kEmbedBatch) {
    P rows[kEmbedBatch];
#pragma unroll
    for (int b = 0; b < kEmbedBatch; ++b)
      if (i0 + b < len) rows[b] = P::load(dout + int64_t(s_tok[i0 + b]) * C + c);
#pragma unroll
    for (int b = 0; b < kEmbedBatch; ++b) {
      const int i = i0 + b;
      if (i >= len) break;
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += f32(rows[b].v[j]);
      const int32_t key = s_key[i];
      const bool last = i == len - 1;
      const bool run_ends = last ? !next_same : s_key[i + 1] != key;
      if (!run_ends && !last) continue;
      const bool crosses = (begin == 0 && prev_same) || !run_ends;
      if (!crosses) {
        if (key >= 0 && key < V) add_to_row<VEC>(dtable + int64_t(key) * C + c, acc);
      } else {
        store_row<VEC>(partial + (tile * 2 + (begin == 0 ? 0 : 1)) * C + c, acc);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
      begin = i + 1;
    }
  }
}

// Pass 2: the tile where a boundary-crossing run starts owns it and adds the
// portions of the following tiles in tile order.
template <int VEC>
__global__ void __launch_bounds__(64)
embedding_backward_cross_kernel(float* __restrict__ dtable, const float* __restrict__ partial,
                                const int32_t* __restrict__ keys, int64_t N, int64_t V,
                                int C) {
  const int64_t tile = blockIdx.x;
  const int64_t t0 = tile * kEmbedTile, t1 = min(N, t0 + kEmbedTile);
  if (t1 >= N) return;
  const int32_t key = keys[t1 - 1];
  if (keys[t1] != key) return;  // the last run ends inside this tile
  int64_t lb = t1 - 1;          // where the last run's portion begins
  while (lb > t0 && keys[lb - 1] == key) --lb;
  if (lb == t0 && t0 > 0 && keys[t0 - 1] == key) return;  // an earlier tile owns it
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
  if (c >= C) return;
  float acc[VEC] = {};
  load_row<VEC>(partial + (tile * 2 + (lb == t0 ? 0 : 1)) * C + c, acc);
  for (int64_t t2 = tile + 1;; ++t2) {
    load_row<VEC>(partial + (t2 * 2) * C + c, acc);
    const int64_t s1 = min(N, (t2 + 1) * kEmbedTile);
    if (s1 >= N || keys[s1 - 1] != key || keys[s1] != key) break;
  }
  if (key >= 0 && key < V) add_to_row<VEC>(dtable + int64_t(key) * C + c, acc);
}

// ---------------------------------------------------------------- RMSNorm

// A row is handled by a group of G threads (a power of two, up to the block), each
// owning K vectors of VEC columns: column (k * G + lane) * VEC + j.
constexpr int kNormThreads = 256;
// Row chunks of the dweight reduction. 1024 (more blocks in flight) measured slower
// at the 1B shape: 41.8 against 34.4 us a call, its partials' extra traffic included.
constexpr int kNormMaxPartials = 256;

struct NormGeom {
  int vec, G, K, kmax;  // kmax: the kernel instantiation's register arrays (K <= kmax)
  int rows_per_iter() const { return kNormThreads / G; }
};

// The smallest group that keeps K at 2 vectors per thread (8 bf16 each), so a
// 256-thread block holds 256 * 2 * 8 columns in registers; wider rows take K up to 4.
// K = 2 keeps the backward at ~100 registers (K = 4 needs ~180: one block per SM).
NormGeom norm_geom(int64_t C, bool vec_ok, const char* op) {
  NormGeom g{};
  g.vec = vec_ok ? 8 : 1;
  const int prefer = vec_ok ? 2 : 4, limit = 4;
  const int64_t nvec = div_up(C, g.vec);
  g.G = 1;
  while (g.G < kNormThreads && int64_t(g.G) * prefer < nvec) g.G *= 2;
  g.K = int(div_up(nvec, g.G));
  SHARDLM_CHECK(g.K <= limit, "%s: C = %lld is too large (at most %d, or %d when C is not a "
                "multiple of 8)", op, static_cast<long long>(C), kNormThreads * 4 * 8,
                kNormThreads * 4);
  g.kmax = vec_ok ? (g.K <= 2 ? 2 : 4) : 4;
  return g;
}

bool norm_vec_ok(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned(p, 16)) return false;
  return true;
}

template <int VEC, int KMAX, bool kResidual>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_forward_kernel(bf16* residual_out, bf16* normed, float* __restrict__ rstd,
                       const bf16* a, const bf16* b, const bf16* __restrict__ weight,
                       int64_t rows, int C, float eps, int G, int K) {
  using P = Pack<bf16, VEC>;
  __shared__ float red[kNormThreads / 32];
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  const int64_t row = int64_t(blockIdx.x) * (kNormThreads / G) + group;
  const bool active = row < rows;
  P xs[KMAX];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    if (!active || k >= K || c >= C) continue;
    const int64_t off = row * C + c;
    if constexpr (kResidual) {
      const P pa = P::load(a + off), pb = P::load(b + off);
#pragma unroll
      for (int j = 0; j < VEC; ++j) xs[k].v[j] = to_bf16(f32(pa.v[j]) + f32(pb.v[j]));
      xs[k].store(residual_out + off);
    } else {
      xs[k] = P::load(a + off);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = f32(xs[k].v[j]);
      ss += x * x;
    }
  }
  ss = group_sum(ss, G, red);
  const float s = 1.0f / sqrtf(ss / float(C) + eps);  // as HF: rsqrt(variance + eps)
  if (!active) return;
  if (lane == 0) rstd[row] = s;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    if (k >= K || c >= C) continue;
    const P w = P::load(weight + c);
    P y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = to_bf16(f32(w.v[j]) * (f32(xs[k].v[j]) * s));
    y.store(normed + row * C + c);
  }
}

// dx = s * (w * dy) - x * (sum(w * dy * x) / C) * s^3 (+ dresidual), one group per
// row; the dweight terms dy * x * s are summed per thread over the block's rows in
// row order, then over the block's groups in group order, into partial[block].
template <int VEC, int KMAX, bool kResidual>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_backward_kernel(bf16* dinp, float* __restrict__ partial, const bf16* __restrict__ dout,
                        const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                        const float* __restrict__ rstd, const bf16* dresidual, int64_t rows,
                        int C, int G, int K, int64_t rows_per_block) {
  using P = Pack<bf16, VEC>;
  extern __shared__ float group_acc[];  // (rows_per_iter, C)
  __shared__ float red[kNormThreads / 32];
  const int rows_per_iter = kNormThreads / G;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;

  float w[KMAX][VEC], acc[KMAX][VEC];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    P wp;
    wp.raw = {};
    if (k < K && c < C) wp = P::load(weight + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      w[k][j] = f32(wp.v[j]);
      acc[k][j] = 0.0f;
    }
  }

  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  // The next row's x, dy (and dresidual) are loaded before this row's reduction, so
  // two rows' loads are in flight across its barriers (one left the kernel at half
  // the bandwidth). The arithmetic and its order are unchanged.
  P x[KMAX], dy[KMAX], dr[KMAX];
  auto load_row = [&](int64_t row, P* xs, P* dys, P* drs) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      xs[k].raw = {};
      dys[k].raw = {};
      drs[k].raw = {};
      if (row >= r1 || k >= K || c >= C) continue;
      xs[k] = P::load(inp + row * C + c);
      dys[k] = P::load(dout + row * C + c);
      if constexpr (kResidual) drs[k] = P::load(dresidual + row * C + c);
    }
  };
  load_row(r0 + group, x, dy, dr);
  for (int64_t base = r0; base < r1; base += rows_per_iter) {
    const int64_t row = base + group;
    const bool active = row < r1;
    P xn[KMAX], dyn[KMAX], drn[KMAX];
    load_row(row + rows_per_iter, xn, dyn, drn);
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      if (!active || k >= K || c >= C) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += (w[k][j] * f32(dy[k].v[j])) * f32(x[k].v[j]);
    }
    const float s = active ? rstd[row] : 0.0f;
    dot = group_sum(dot, G, red);
    const float coef = (dot / float(C)) * s * s * s;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      if (!active || k >= K || c >= C) continue;
      const int64_t off = row * C + c;
      P dx;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xf = f32(x[k].v[j]), dyf = f32(dy[k].v[j]);
        float g = s * (w[k][j] * dyf) - xf * coef;
        if constexpr (kResidual) g += f32(dr[k].v[j]);
        dx.v[j] = to_bf16(g);
        acc[k][j] += dyf * (xf * s);
      }
      dx.store(dinp + off);
    }
#pragma unroll
    for (int k = 0; k < KMAX; ++k) x[k] = xn[k], dy[k] = dyn[k], dr[k] = drn[k];
  }

#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    if (k >= K || c >= C) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) group_acc[group * C + c + j] = acc[k][j];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += kNormThreads) {
    float t = group_acc[c];
    for (int g = 1; g < rows_per_iter; ++g) t += group_acc[g * C + c];
    partial[int64_t(blockIdx.x) * C + c] = t;
  }
}

int64_t norm_rows_per_block(int64_t rows, const NormGeom& g) {
  const int64_t rpi = g.rows_per_iter();
  return rpi * std::max<int64_t>(1, div_up(rows, rpi * kNormMaxPartials));
}

template <bool kResidual>
void launch_rmsnorm_forward(bf16* residual_out, bf16* normed, float* rstd, const bf16* a,
                            const bf16* b, const bf16* weight, int64_t rows, int64_t C,
                            double eps, cudaStream_t stream, const char* op) {
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  if (rows == 0 || C == 0) return;
  const bool vec = norm_vec_ok(C, {residual_out, normed, a, b, weight});
  const NormGeom g = norm_geom(C, vec, op);
  const unsigned blocks = grid_for(rows, g.rows_per_iter());
  const float eps_f = static_cast<float>(eps);
#define SHARDLM_RMS_FWD(VEC, KMAX)                                                           \
  rmsnorm_forward_kernel<VEC, KMAX, kResidual><<<blocks, kNormThreads, 0, stream>>>(          \
      residual_out, normed, rstd, a, b, weight, rows, int(C), eps_f, g.G, g.K)
  if (g.vec == 1) SHARDLM_RMS_FWD(1, 4);  // unaligned or C % 8 != 0: scalar loads
  else if (g.kmax == 2) SHARDLM_RMS_FWD(8, 2);
  else SHARDLM_RMS_FWD(8, 4);
#undef SHARDLM_RMS_FWD
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- RoPE

constexpr int kRopeHeadsPerThread = 4;  // cos/sin computed once, applied to 4 heads

template <int VEC>
__global__ void __launch_bounds__(kThreads)
rope_kernel(bf16* __restrict__ x, const int32_t* __restrict__ positions,
            const float* __restrict__ inv_freq, int64_t N, int heads, int D,
            int64_t row_stride, float sign) {
  using P = Pack<bf16, VEC>;
  const int half = D / 2, nvec = half / VEC;
  const int hgroups = int(div_up(heads, kRopeHeadsPerThread));
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * hgroups * nvec) return;
  const int iv = int(idx % nvec);
  const int64_t rest = idx / nvec;
  const int hg = int(rest % hgroups);
  const int64_t t = rest / hgroups;
  const int i = iv * VEC;

  // HF: freqs = inv_freq (fp32) * position (fp32); cos, sin in fp32.
  const float pos = float(positions[t]);
  float cs[VEC], sn[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sincosf(pos * inv_freq[i + j], &sn[j], &cs[j]);
    sn[j] *= sign;
  }
  const int h0 = hg * kRopeHeadsPerThread;
  P lo[kRopeHeadsPerThread], hi[kRopeHeadsPerThread];
#pragma unroll
  for (int q = 0; q < kRopeHeadsPerThread; ++q) {
    if (h0 + q >= heads) break;
    const bf16* xh = x + t * row_stride + int64_t(h0 + q) * D;
    lo[q] = P::load(xh + i);
    hi[q] = P::load(xh + i + half);
  }
#pragma unroll
  for (int q = 0; q < kRopeHeadsPerThread; ++q) {
    if (h0 + q >= heads) break;
    P out_lo, out_hi;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x1 = f32(lo[q].v[j]), x2 = f32(hi[q].v[j]);
      out_lo.v[j] = to_bf16(x1 * cs[j] - x2 * sn[j]);
      out_hi.v[j] = to_bf16(x2 * cs[j] + x1 * sn[j]);
    }
    bf16* xh = x + t * row_stride + int64_t(h0 + q) * D;
    out_lo.store(xh + i);
    out_hi.store(xh + i + half);
  }
}

void launch_rope(bf16* x, const int32_t* positions, const float* inv_freq, int64_t N,
                 int64_t heads, int64_t D, int64_t row_stride, float sign,
                 cudaStream_t stream, const char* op) {
  check_size(N, INT_MAX, "N", op);
  check_size(heads, 4096, "heads", op);
  SHARDLM_CHECK(D > 0 && D % 2 == 0 && D <= 4096, "%s: head dim must be even and positive, got %lld",
                op, static_cast<long long>(D));
  if (row_stride == 0) row_stride = heads * D;
  SHARDLM_CHECK(row_stride >= heads * D, "%s: row_stride %lld < heads * D = %lld", op,
                static_cast<long long>(row_stride), static_cast<long long>(heads * D));
  if (N == 0 || heads == 0) return;
  const int64_t half = D / 2;
  const bool vec = half % 8 == 0 && row_stride % 8 == 0 && aligned(x, 16);
  const int64_t hgroups = div_up(heads, kRopeHeadsPerThread);
  if (vec) {
    rope_kernel<8><<<grid_for(N * hgroups * (half / 8), kThreads), kThreads, 0, stream>>>(
        x, positions, inv_freq, N, int(heads), int(D), row_stride, sign);
  } else {
    rope_kernel<1><<<grid_for(N * hgroups * half, kThreads), kThreads, 0, stream>>>(
        x, positions, inv_freq, N, int(heads), int(D), row_stride, sign);
  }
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- SwiGLU

template <int VEC>
__global__ void __launch_bounds__(kThreads)
swiglu_forward_kernel(bf16* __restrict__ h, int64_t ld_h, const bf16* __restrict__ gate,
                      int64_t ld_gate, const bf16* __restrict__ up, int64_t ld_up,
                      int64_t rows, int I) {
  using P = Pack<bf16, VEC>;
  const int nvec = I / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nvec) return;
  const int64_t r = idx / nvec;
  const int c = int(idx % nvec) * VEC;
  const P g = P::load(gate + r * ld_gate + c), u = P::load(up + r * ld_up + c);
  P out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float gf = f32(g.v[j]);
    out.v[j] = to_bf16(gf / (1.0f + __expf(-gf)) * f32(u.v[j]));  // silu as torch
  }
  out.store(h + r * ld_h + c);
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
swiglu_backward_kernel(bf16* dgate, int64_t ld_dgate, bf16* dup, int64_t ld_dup,
                       const bf16* __restrict__ dh, int64_t ld_dh, const bf16* gate,
                       int64_t ld_gate, const bf16* up, int64_t ld_up, int64_t rows, int I) {
  using P = Pack<bf16, VEC>;
  const int nvec = I / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nvec) return;
  const int64_t r = idx / nvec;
  const int c = int(idx % nvec) * VEC;
  const P g = P::load(gate + r * ld_gate + c), u = P::load(up + r * ld_up + c);
  const P d = P::load(dh + r * ld_dh + c);
  P dg, du;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float gf = f32(g.v[j]), uf = f32(u.v[j]), df = f32(d.v[j]);
    const float sig = 1.0f / (1.0f + __expf(-gf));
    // d silu / dg = sig * (1 + g * (1 - sig))
    dg.v[j] = to_bf16(df * uf * sig * (1.0f + gf * (1.0f - sig)));
    du.v[j] = to_bf16(df * (gf * sig));
  }
  dg.store(dgate + r * ld_dgate + c);
  du.store(dup + r * ld_dup + c);
}

// ---------------------------------------------------------------- cross-entropy

constexpr int kCeThreads = 512;
constexpr int kCeBatch = 4;  // 16-byte loads in flight per thread while filling smem

// One row per cluster of csize CTAs; CTA `rank` holds columns [rank * chunk, ...) of
// the row in shared memory, so the logits are read from HBM once and written once.
// max and sum-of-exp are combined across the cluster through distributed shared
// memory in rank order (deterministic); every CTA then writes its own gradient slice.
template <int VEC>
__global__ void __launch_bounds__(kCeThreads, 2)
cross_entropy_kernel(bf16* __restrict__ logits, float* __restrict__ loss,
                     const int32_t* __restrict__ targets, const float* __restrict__ weights,
                     float grad_scale, int64_t V, int64_t chunk) {
  using P = Pack<bf16, VEC>;
  extern __shared__ __align__(16) unsigned char ce_smem[];
  P* sx = reinterpret_cast<P*>(ce_smem);
  __shared__ float red[kCeThreads / 32];
  __shared__ float cta_max, cta_sum;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int csize = int(cluster.num_blocks());
  const int64_t row = blockIdx.x / csize;
  bf16* x = logits + row * V;
  const int64_t c0 = min(V, rank * chunk), c1 = min(V, c0 + chunk);
  const int nvec = int((c1 - c0) / VEC);
  const int tid = threadIdx.x;

  const int32_t target = targets[row];
  const float w = weights ? weights[row] : 1.0f;
  if (target < 0 || target >= V || w == 0.0f) {  // the same for the whole cluster
    P zero;
    zero.raw = {};
    for (int i = tid; i < nvec; i += kCeThreads) zero.store(x + c0 + int64_t(i) * VEC);
    if (rank == 0 && tid == 0) loss[row] = target >= V ? __int_as_float(0x7fc00000) : 0.0f;
    return;
  }
  // Read before the first cluster barrier: no CTA writes the row before it.
  const float x_target = (rank == 0 && tid == 0) ? f32(x[target]) : 0.0f;

  const float row_max =
      slice_to_smem_row_max<VEC, kCeThreads, kCeBatch>(x + c0, nvec, sx, red, &cta_max, cluster);

  float s = 0.0f;
  for (int i = tid; i < nvec; i += kCeThreads) {
    const P p = sx[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += __expf(f32(p.v[j]) - row_max);
  }
  s = block_reduce<kCeThreads>(s, SumOp{}, red);
  if (tid == 0) cta_sum = s;
  cluster.sync();
  float row_sum = 0.0f;
  for (int r = 0; r < csize; ++r) row_sum += *cluster.map_shared_rank(&cta_sum, r);

  const float coef = w * grad_scale / row_sum;
  const float w_scale = w * grad_scale;
  for (int i = tid; i < nvec; i += kCeThreads) {
    const P p = sx[i];
    P g;
    const int64_t col0 = c0 + int64_t(i) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float d = __expf(f32(p.v[j]) - row_max) * coef;
      if (col0 + j == target) d -= w_scale;
      g.v[j] = to_bf16(d);
    }
    g.store(x + col0);
  }
  if (rank == 0 && tid == 0) loss[row] = w * ((row_max + logf(row_sum)) - x_target);
  cluster.sync();  // no CTA may exit while another still reads its cta_max / cta_sum
}

__global__ void __launch_bounds__(1024)
sum_rows_kernel(double* __restrict__ out, const float* __restrict__ x, int64_t n,
                bool accumulate) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += double(x[i]);
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

// ---------------------------------------------------------------- optimizer

struct AdamWArgs {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, inv_bc2_sqrt,
      weight_decay, grad_scale;
};
struct SgdArgs {
  float lr, momentum, weight_decay, grad_scale;
};

// The CPU optimizer's arithmetic, one IEEE operation at a time (no FMA contraction),
// so the update is the CPU's to the last bit.
__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g, float wd,
                                             float gs, const AdamWArgs& a) {
  const float gi = __fmul_rn(g, gs);
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(a.one_minus_beta1, gi));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(a.one_minus_beta2, gi), gi));
  p = __fsub_rn(p, __fmul_rn(__fmul_rn(a.lr, wd), p));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), a.inv_bc2_sqrt), a.eps);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(a.step_size, m), denom));
}

__device__ __forceinline__ void sgd_update(float& p, float* buf, float g, float wd, float gs,
                                           const SgdArgs& a) {
  float d = __fadd_rn(__fmul_rn(g, gs), __fmul_rn(wd, p));
  if (buf) {
    d = __fadd_rn(__fmul_rn(a.momentum, *buf), d);
    *buf = d;
  }
  p = __fsub_rn(p, __fmul_rn(a.lr, d));
}

// The segment holding element e: index, or -1 (padding). segs sorted by offset.
__device__ __forceinline__ int find_segment(const OptimSegment* segs, int nseg, int64_t e) {
  int lo = 0, hi = nseg - 1, found = -1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (segs[mid].offset <= e) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  if (found >= 0 && e < segs[found].offset + segs[found].count) return found;
  return -1;
}

// Weight decay of elements e0 .. e0+VEC-1 and whether each is updated at all.
// nseg == 0: one segment covering everything with default_wd.
template <int VEC>
__device__ __forceinline__ void segment_lookup(const OptimSegment* segs, int nseg,
                                               float default_wd, int64_t e0, float (&wd)[VEC],
                                               bool (&upd)[VEC]) {
  if (nseg == 0) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      wd[j] = default_wd;
      upd[j] = true;
    }
    return;
  }
  const int s = find_segment(segs, nseg, e0);
  if (s >= 0 && e0 + VEC <= segs[s].offset + segs[s].count) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      wd[j] = segs[s].weight_decay;
      upd[j] = true;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int sj = find_segment(segs, nseg, e0 + j);
    upd[j] = sj >= 0;
    wd[j] = sj >= 0 ? segs[sj].weight_decay : 0.0f;
  }
}

// Loads the segment table into shared memory and the effective gradient scale;
// false when *device_scale is not finite (the step is skipped).
__device__ __forceinline__ bool optim_prologue(OptimSegment* s_seg, const OptimSegment* segs,
                                               int nseg, const float* device_scale,
                                               float grad_scale, float& gs) {
  for (int i = threadIdx.x; i < nseg; i += blockDim.x) s_seg[i] = segs[i];
  __syncthreads();
  gs = grad_scale;
  if (device_scale) {
    const float d = *device_scale;
    if (!isfinite(d)) return false;
    gs = __fmul_rn(gs, d);
  }
  return true;
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(float* __restrict__ param, bf16* __restrict__ param_bf16,
             const float* __restrict__ grad, float* __restrict__ m_state,
             float* __restrict__ v_state, int64_t n, AdamWArgs a,
             const OptimSegment* __restrict__ segs, int nseg,
             const float* __restrict__ device_scale) {
  __shared__ OptimSegment s_seg[kMaxOptimSegments];
  float gs;
  if (!optim_prologue(s_seg, segs, nseg, device_scale, a.grad_scale, gs)) return;
  using F = Pack<float, VEC>;
  using B = Pack<bf16, VEC>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      float wd[VEC];
      bool upd[VEC];
      segment_lookup<VEC>(s_seg, nseg, a.weight_decay, e0, wd, upd);
      F p = F::load(param + e0), m = F::load(m_state + e0), v = F::load(v_state + e0);
      const F g = F::load(grad + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (upd[j]) adamw_update(p.v[j], m.v[j], v.v[j], g.v[j], wd[j], gs, a);
      p.store(param + e0);
      m.store(m_state + e0);
      v.store(v_state + e0);
      if (param_bf16) {
        B pb;
#pragma unroll
        for (int j = 0; j < VEC; ++j) pb.v[j] = to_bf16(p.v[j]);
        pb.store(param_bf16 + e0);
      }
    } else {  // the tail of n, element by element
      for (int64_t e = e0; e < n; ++e) {
        float wd[1];
        bool upd[1];
        segment_lookup<1>(s_seg, nseg, a.weight_decay, e, wd, upd);
        if (upd[0]) adamw_update(param[e], m_state[e], v_state[e], grad[e], wd[0], gs, a);
        if (param_bf16) param_bf16[e] = to_bf16(param[e]);
      }
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
sgd_kernel(float* __restrict__ param, bf16* __restrict__ param_bf16,
           const float* __restrict__ grad, float* __restrict__ momentum_buf, int64_t n,
           SgdArgs a, const OptimSegment* __restrict__ segs, int nseg,
           const float* __restrict__ device_scale) {
  __shared__ OptimSegment s_seg[kMaxOptimSegments];
  float gs;
  if (!optim_prologue(s_seg, segs, nseg, device_scale, a.grad_scale, gs)) return;
  using F = Pack<float, VEC>;
  using B = Pack<bf16, VEC>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      float wd[VEC];
      bool upd[VEC];
      segment_lookup<VEC>(s_seg, nseg, a.weight_decay, e0, wd, upd);
      F p = F::load(param + e0);
      const F g = F::load(grad + e0);
      F buf;
      if (momentum_buf) buf = F::load(momentum_buf + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (upd[j]) sgd_update(p.v[j], momentum_buf ? &buf.v[j] : nullptr, g.v[j], wd[j], gs, a);
      p.store(param + e0);
      if (momentum_buf) buf.store(momentum_buf + e0);
      if (param_bf16) {
        B pb;
#pragma unroll
        for (int j = 0; j < VEC; ++j) pb.v[j] = to_bf16(p.v[j]);
        pb.store(param_bf16 + e0);
      }
    } else {
      for (int64_t e = e0; e < n; ++e) {
        float wd[1];
        bool upd[1];
        segment_lookup<1>(s_seg, nseg, a.weight_decay, e, wd, upd);
        if (upd[0]) sgd_update(param[e], momentum_buf ? momentum_buf + e : nullptr, grad[e], wd[0], gs, a);
        if (param_bf16) param_bf16[e] = to_bf16(param[e]);
      }
    }
  }
}

AdamWArgs adamw_args(const AdamWConfig& c) {
  SHARDLM_CHECK(c.step >= 1, "adamw_step: step must be >= 1 (1-based), got %lld",
                static_cast<long long>(c.step));
  // As Optimizer::step: bias corrections in double, then everything in float.
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(c.step));
  AdamWArgs a{};
  a.lr = static_cast<float>(c.lr);
  a.beta1 = static_cast<float>(c.beta1);
  a.beta2 = static_cast<float>(c.beta2);
  a.one_minus_beta1 = 1.0f - a.beta1;
  a.one_minus_beta2 = 1.0f - a.beta2;
  a.eps = static_cast<float>(c.eps);
  a.step_size = static_cast<float>(c.lr / bc1);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  a.weight_decay = static_cast<float>(c.weight_decay);
  a.grad_scale = c.grad_scale;
  return a;
}

SgdArgs sgd_args(const SgdConfig& c) {
  return SgdArgs{static_cast<float>(c.lr), static_cast<float>(c.momentum),
                 static_cast<float>(c.weight_decay), c.grad_scale};
}

bool optim_vec_ok(std::initializer_list<const void*> f32_ptrs, const void* bf16_ptr) {
  for (const void* p : f32_ptrs)
    if (p && !aligned(p, 16)) return false;
  return bf16_ptr == nullptr || aligned(bf16_ptr, 8);
}

void launch_adamw(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                  int64_t n, const OptimSegment* segs, int nseg, const AdamWArgs& a,
                  const float* device_scale, cudaStream_t stream, const char* op) {
  check_size(n, INT64_MAX / 8, "n", op);
  SHARDLM_CHECK(nseg >= 0 && nseg <= kMaxOptimSegments, "%s: %d segments (at most %d)", op,
                nseg, kMaxOptimSegments);
  if (n == 0) return;
  if (optim_vec_ok({param, grad, m, v}, param_bf16))
    adamw_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(
        param, param_bf16, grad, m, v, n, a, segs, nseg, device_scale);
  else
    adamw_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(
        param, param_bf16, grad, m, v, n, a, segs, nseg, device_scale);
  CUDA_CHECK(cudaGetLastError());
}

void launch_sgd(float* param, bf16* param_bf16, const float* grad, float* buf, int64_t n,
                const OptimSegment* segs, int nseg, const SgdArgs& a,
                const float* device_scale, cudaStream_t stream, const char* op) {
  check_size(n, INT64_MAX / 8, "n", op);
  SHARDLM_CHECK(nseg >= 0 && nseg <= kMaxOptimSegments, "%s: %d segments (at most %d)", op,
                nseg, kMaxOptimSegments);
  SHARDLM_CHECK(buf != nullptr || a.momentum == 0.0f,
                "%s: momentum %g needs a momentum buffer", op, double(a.momentum));
  if (n == 0) return;
  if (a.momentum == 0.0f) buf = nullptr;  // as the CPU: no buffer without momentum
  if (optim_vec_ok({param, grad, buf}, param_bf16))
    sgd_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(
        param, param_bf16, grad, buf, n, a, segs, nseg, device_scale);
  else
    sgd_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(
        param, param_bf16, grad, buf, n, a, segs, nseg, device_scale);
  CUDA_CHECK(cudaGetLastError());
}

__global__ void clip_scale_kernel(float* __restrict__ scale_out, const double* __restrict__ sumsq,
                                  double max_norm) {
  const double norm = sqrt(*sumsq);
  float s = 1.0f;
  if (!isfinite(norm)) s = __int_as_float(0x7fc00000);
  else if (max_norm > 0 && norm > max_norm) s = float(max_norm / (norm + 1e-6));
  *scale_out = s;
}

// ---------------------------------------------------------------- helpers

template <int VEC>
__global__ void __launch_bounds__(kThreads)
cast_f32_to_bf16_kernel(bf16* __restrict__ out, const float* __restrict__ in, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      const auto x = Pack<float, VEC>::load(in + e0);
      Pack<bf16, VEC> y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] = to_bf16(x.v[j]);
      y.store(out + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) out[e] = to_bf16(in[e]);
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
accumulate_f32_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      auto a = Pack<float, VEC>::load(y + e0);
      const auto b = Pack<float, VEC>::load(x + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] += b.v[j];
      a.store(y + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) y[e] += x[e];
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
scale_f32_kernel(float* __restrict__ x, float alpha, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      auto a = Pack<float, VEC>::load(x + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] *= alpha;
      a.store(x + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) x[e] *= alpha;
    }
  }
}

// A fixed grid (kSumSquaresBlocks x kThreads) whatever the GPU: thread i sums the
// vectors i, i + stride, ... in double; blocks reduce in a fixed tree.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
sum_squares_partial_kernel(double* __restrict__ partial, const float* __restrict__ x,
                           int64_t n) {
  __shared__ double red[kThreads / 32];
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t nvec = n / VEC;
  double s = 0.0;
  for (int64_t i = tid; i < nvec; i += stride) {
    const auto p = Pack<float, VEC>::load(x + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += double(p.v[j]) * double(p.v[j]);
  }
  if (nvec * VEC + tid < n) {
    const double t = x[nvec * VEC + tid];
    s += t * t;
  }
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kSumSquaresBlocks)
sum_partials_kernel(double* __restrict__ out, const double* __restrict__ partial,
                    int64_t P, bool accumulate) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) s += partial[i];
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

constexpr int kColumnSlices = 8;       // block (32, kColumnSlices)
constexpr int kColumnMaxPartials = 64; // row chunks of bias_grad

// partial[chunk][c] = sum of x[r][c] over the chunk's rows: thread (x, y) sums rows
// y, y + kColumnSlices, ... of its VEC columns, then the slices in order.
template <int VEC>
__global__ void __launch_bounds__(32 * kColumnSlices)
column_sum_partial_kernel(float* __restrict__ partial, const bf16* __restrict__ x, int64_t N,
                          int C, int64_t rows_per_chunk) {
  __shared__ float slice_sum[kColumnSlices][32 * VEC + 1];
  const int c = (blockIdx.x * 32 + threadIdx.x) * VEC;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float acc[VEC] = {};
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColumnSlices) {
      const auto p = Pack<bf16, VEC>::load(x + r * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += f32(p.v[j]);
    }
#pragma unroll
  for (int j = 0; j < VEC; ++j) slice_sum[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float s = slice_sum[0][threadIdx.x * VEC + j];
    for (int y = 1; y < kColumnSlices; ++y) s += slice_sum[y][threadIdx.x * VEC + j];
    partial[int64_t(blockIdx.y) * C + c + j] = s;
  }
}

int64_t bias_rows_per_chunk(int64_t N) {
  return kColumnSlices * std::max<int64_t>(1, div_up(N, int64_t(kColumnSlices) * kColumnMaxPartials));
}

}  // namespace

// ================================================================ launchers

void embedding_forward(bf16* out, const int32_t* ids, const bf16* table, int64_t N,
                       int64_t V, int64_t C, cudaStream_t stream) {
  const char* op = "embedding_forward";
  check_size(N, INT_MAX, "N", op);
  check_size(V, INT_MAX, "V", op);
  check_size(C, INT_MAX, "C", op);
  if (N == 0 || C == 0) return;
  if (C % 8 == 0 && aligned(out, 16) && aligned(table, 16))
    embedding_forward_kernel<8><<<grid_for(N * (C / 8), kThreads), kThreads, 0, stream>>>(
        out, ids, table, N, V, int(C));
  else
    embedding_forward_kernel<1><<<grid_for(N * C, kThreads), kThreads, 0, stream>>>(
        out, ids, table, N, V, int(C));
  CUDA_CHECK(cudaGetLastError());
}

size_t embedding_backward_scratch_bytes(int64_t N, int64_t C) {
  check_size(N, INT_MAX, "N", "embedding_backward");
  check_size(C, INT_MAX, "C", "embedding_backward");
  return embed_scratch(N, C).total;
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* ids, int64_t N,
                        int64_t V, int64_t C, void* scratch, size_t scratch_bytes,
                        cudaStream_t stream) {
  const char* op = "embedding_backward";
  check_size(N, INT_MAX, "N", op);
  check_size(V, INT_MAX, "V", op);
  check_size(C, INT_MAX, "C", op);
  if (N == 0 || C == 0) return;
  const EmbedScratch lay = embed_scratch(N, C);
  SHARDLM_CHECK(scratch_bytes >= lay.total && scratch != nullptr,
                "%s: scratch of %zu bytes is smaller than the %zu needed", op, scratch_bytes,
                lay.total);
  char* base = static_cast<char*>(scratch);
  auto* keys_sorted = reinterpret_cast<int32_t*>(base + lay.keys_sorted);
  auto* toks_in = reinterpret_cast<int32_t*>(base + lay.toks_in);
  auto* toks_sorted = reinterpret_cast<int32_t*>(base + lay.toks_sorted);
  auto* partial = reinterpret_cast<float*>(base + lay.partial);
  size_t cub_bytes = lay.cub_bytes;

  iota_kernel<<<grid_for(N, kThreads), kThreads, 0, stream>>>(toks_in, N);
  CUDA_CHECK(cudaGetLastError());
  // Stable: equal ids keep token order, so each id's rows are summed in token order.
  // All 32 bits: an id outside [0, V) must not merge with a valid id's run.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + lay.cub_temp, cub_bytes, ids, keys_sorted,
                                             toks_in, toks_sorted, int(N), 0, 32, stream));
  const int64_t tiles = div_up(N, kEmbedTile);
  SHARDLM_CHECK(tiles <= INT_MAX, "%s: N too large", op);
  const bool vec = C % 8 == 0 && aligned(dtable, 16) && aligned(dout, 16);
  const int threads = 64;
  if (vec) {
    const dim3 grid(unsigned(tiles), grid_for(C / 8, threads));
    embedding_backward_tiles_kernel<8><<<grid, threads, 0, stream>>>(
        dtable, partial, dout, keys_sorted, toks_sorted, N, V, int(C));
    CUDA_CHECK(cudaGetLastError());
    embedding_backward_cross_kernel<8><<<grid, threads, 0, stream>>>(dtable, partial,
                                                                     keys_sorted, N, V, int(C));
  } else {
    const dim3 grid(unsigned(tiles), grid_for(C, threads));
    embedding_backward_tiles_kernel<1><<<grid, threads, 0, stream>>>(
        dtable, partial, dout, keys_sorted, toks_sorted, N, V, int(C));
    CUDA_CHECK(cudaGetLastError());
    embedding_backward_cross_kernel<1><<<grid, threads, 0, stream>>>(dtable, partial,
                                                                     keys_sorted, N, V, int(C));
  }
  CUDA_CHECK(cudaGetLastError());
}

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight,
                     int64_t rows, int64_t C, double eps, cudaStream_t stream) {
  launch_rmsnorm_forward<false>(nullptr, out, rstd, inp, nullptr, weight, rows, C, eps, stream,
                                "rmsnorm_forward");
}

void residual_rmsnorm_forward(bf16* residual_out, bf16* normed, float* rstd, const bf16* a,
                              const bf16* b, const bf16* weight, int64_t rows, int64_t C,
                              double eps, cudaStream_t stream) {
  launch_rmsnorm_forward<true>(residual_out, normed, rstd, a, b, weight, rows, C, eps, stream,
                               "residual_rmsnorm_forward");
}

size_t rmsnorm_backward_scratch_bytes(int64_t rows, int64_t C) {
  const char* op = "rmsnorm_backward";
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  if (rows == 0 || C == 0) return 0;
  // Either path may be taken (it depends on pointer alignment): the larger need.
  size_t bytes = 0;
  for (bool vec : {true, false}) {
    if (vec && C % 8 != 0) continue;
    if (!vec && C > kNormThreads * 4) continue;
    const NormGeom g = norm_geom(C, vec, op);
    const int64_t P = div_up(rows, norm_rows_per_block(rows, g));
    bytes = std::max(bytes, size_t(P * C) * sizeof(float));
  }
  return bytes;
}

void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp,
                      const bf16* weight, const float* rstd, const bf16* dresidual,
                      int64_t rows, int64_t C, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream) {
  const char* op = "rmsnorm_backward";
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  if (rows == 0 || C == 0) return;
  const bool vec = norm_vec_ok(C, {dinp, dout, inp, weight, dresidual});
  const NormGeom g = norm_geom(C, vec, op);
  const int64_t rows_per_block = norm_rows_per_block(rows, g);
  const int64_t P = div_up(rows, rows_per_block);
  const size_t need = size_t(P * C) * sizeof(float);
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= need,
                "%s: scratch of %zu bytes is smaller than the %zu needed", op, scratch_bytes, need);
  auto* partial = static_cast<float*>(scratch);
  const size_t smem = size_t(g.rows_per_iter()) * C * sizeof(float);
  const unsigned blocks = unsigned(P);
#define SHARDLM_RMS_BWD(VEC, KMAX, RES)                                                      \
  rmsnorm_backward_kernel<VEC, KMAX, RES><<<blocks, kNormThreads, smem, stream>>>(           \
      dinp, partial, dout, inp, weight, rstd, dresidual, rows, int(C), g.G, g.K, rows_per_block)
  const bool res = dresidual != nullptr;
  if (g.vec == 1) {  // unaligned or C % 8 != 0: scalar loads
    if (res) SHARDLM_RMS_BWD(1, 4, true);
    else SHARDLM_RMS_BWD(1, 4, false);
  } else if (g.kmax == 2) {
    if (res) SHARDLM_RMS_BWD(8, 2, true);
    else SHARDLM_RMS_BWD(8, 2, false);
  } else {
    if (res) SHARDLM_RMS_BWD(8, 4, true);
    else SHARDLM_RMS_BWD(8, 4, false);
  }
#undef SHARDLM_RMS_BWD
  CUDA_CHECK(cudaGetLastError());
  launch_column_finish(dweight, partial, P, int(C), stream);
}

void rope_forward(bf16* x, const int32_t* positions, const float* inv_freq, int64_t N,
                  int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream) {
  launch_rope(x, positions, inv_freq, N, heads, D, row_stride, 1.0f, stream, "rope_forward");
}

void rope_backward(bf16* dx, const int32_t* positions, const float* inv_freq, int64_t N,
                   int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream) {
  launch_rope(dx, positions, inv_freq, N, heads, D, row_stride, -1.0f, stream, "rope_backward");
}

void swiglu_forward(bf16* h, int64_t ld_h, const bf16* gate, int64_t ld_gate, const bf16* up,
                    int64_t ld_up, int64_t rows, int64_t I, cudaStream_t stream) {
  const char* op = "swiglu_forward";
  check_size(rows, INT_MAX, "rows", op);
  check_size(I, INT_MAX, "I", op);
  SHARDLM_CHECK(ld_h >= I && ld_gate >= I && ld_up >= I, "%s: a row stride is smaller than I", op);
  if (rows == 0 || I == 0) return;
  const bool vec = I % 8 == 0 && ld_h % 8 == 0 && ld_gate % 8 == 0 && ld_up % 8 == 0 &&
                   aligned(h, 16) && aligned(gate, 16) && aligned(up, 16);
  if (vec)
    swiglu_forward_kernel<8><<<grid_for(rows * (I / 8), kThreads), kThreads, 0, stream>>>(
        h, ld_h, gate, ld_gate, up, ld_up, rows, int(I));
  else
    swiglu_forward_kernel<1><<<grid_for(rows * I, kThreads), kThreads, 0, stream>>>(
        h, ld_h, gate, ld_gate, up, ld_up, rows, int(I));
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward(bf16* dgate, int64_t ld_dgate, bf16* dup, int64_t ld_dup, const bf16* dh,
                     int64_t ld_dh, const bf16* gate, int64_t ld_gate, const bf16* up,
                     int64_t ld_up, int64_t rows, int64_t I, cudaStream_t stream) {
  const char* op = "swiglu_backward";
  check_size(rows, INT_MAX, "rows", op);
  check_size(I, INT_MAX, "I", op);
  SHARDLM_CHECK(ld_dgate >= I && ld_dup >= I && ld_dh >= I && ld_gate >= I && ld_up >= I,
                "%s: a row stride is smaller than I", op);
  if (rows == 0 || I == 0) return;
  const bool vec = I % 8 == 0 && ld_dgate % 8 == 0 && ld_dup % 8 == 0 && ld_dh % 8 == 0 &&
                   ld_gate % 8 == 0 && ld_up % 8 == 0 && aligned(dgate, 16) &&
                   aligned(dup, 16) && aligned(dh, 16) && aligned(gate, 16) && aligned(up, 16);
  if (vec)
    swiglu_backward_kernel<8><<<grid_for(rows * (I / 8), kThreads), kThreads, 0, stream>>>(
        dgate, ld_dgate, dup, ld_dup, dh, ld_dh, gate, ld_gate, up, ld_up, rows, int(I));
  else
    swiglu_backward_kernel<1><<<grid_for(rows * I, kThreads), kThreads, 0, stream>>>(
        dgate, ld_dgate, dup, ld_dup, dh, ld_dh, gate, ld_gate, up, ld_up, rows, int(I));
  CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_forward_backward(bf16* logits, float* loss, const int32_t* targets,
                                    const float* weights, float grad_scale, int64_t n,
                                    int64_t V, cudaStream_t stream) {
  const char* op = "cross_entropy_forward_backward";
  check_size(n, INT_MAX / kRowClusterMax, "n", op);
  check_size(V, INT_MAX, "V", op);
  if (n == 0) return;
  SHARDLM_CHECK(V > 0, "%s: V must be positive", op);
  const bool vec = V % 8 == 0 && aligned(logits, 16);
  const RowClusterSplit split = row_cluster_split(V, vec ? 8 : 1, op);
  const RowClusterLaunch launch(split, n, kCeThreads, stream);
  if (vec) {
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel<8>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, cross_entropy_kernel<8>, logits, loss, targets, weights,
                                  grad_scale, V, split.chunk));
  } else {
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel<1>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, cross_entropy_kernel<1>, logits, loss, targets, weights,
                                  grad_scale, V, split.chunk));
  }
  CUDA_CHECK(cudaGetLastError());
}

void sum_rows(double* out, const float* x, int64_t n, bool accumulate, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "sum_rows");
  sum_rows_kernel<<<1, 1024, 0, stream>>>(out, x, n, accumulate);
  CUDA_CHECK(cudaGetLastError());
}

void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                int64_t n, const AdamWConfig& config, const float* device_scale,
                cudaStream_t stream) {
  launch_adamw(param, param_bf16, grad, m, v, n, nullptr, 0, adamw_args(config), device_scale,
               stream, "adamw_step");
}

void adamw_step_segments(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                         int64_t n, const OptimSegment* segments, int num_segments,
                         const AdamWConfig& config, const float* device_scale,
                         cudaStream_t stream) {
  SHARDLM_CHECK(num_segments == 0 || segments != nullptr,
                "adamw_step_segments: no segment table");
  if (num_segments == 0) return;  // nothing in this shard is a parameter
  launch_adamw(param, param_bf16, grad, m, v, n, segments, num_segments, adamw_args(config),
               device_scale, stream, "adamw_step_segments");
}

void sgd_step(float* param, bf16* param_bf16, const float* grad, float* momentum_buf,
              int64_t n, const SgdConfig& config, const float* device_scale,
              cudaStream_t stream) {
  launch_sgd(param, param_bf16, grad, momentum_buf, n, nullptr, 0, sgd_args(config),
             device_scale, stream, "sgd_step");
}

void sgd_step_segments(float* param, bf16* param_bf16, const float* grad, float* momentum_buf,
                       int64_t n, const OptimSegment* segments, int num_segments,
                       const SgdConfig& config, const float* device_scale,
                       cudaStream_t stream) {
  SHARDLM_CHECK(num_segments == 0 || segments != nullptr, "sgd_step_segments: no segment table");
  if (num_segments == 0) return;
  launch_sgd(param, param_bf16, grad, momentum_buf, n, segments, num_segments,
             sgd_args(config), device_scale, stream, "sgd_step_segments");
}

void clip_scale(float* scale_out, const double* sumsq, double max_norm, cudaStream_t stream) {
  clip_scale_kernel<<<1, 1, 0, stream>>>(scale_out, sumsq, max_norm);
  CUDA_CHECK(cudaGetLastError());
}

void cast_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "cast_f32_to_bf16");
  if (n == 0) return;
  if (aligned(out, 8) && aligned(in, 16))
    cast_f32_to_bf16_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(out, in, n);
  else
    cast_f32_to_bf16_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(out, in, n);
  CUDA_CHECK(cudaGetLastError());
}

void accumulate_f32(float* y, const float* x, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "accumulate_f32");
  if (n == 0) return;
  if (aligned(y, 16) && aligned(x, 16))
    accumulate_f32_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(y, x, n);
  else
    accumulate_f32_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(y, x, n);
  CUDA_CHECK(cudaGetLastError());
}

void scale_f32(float* x, float alpha, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "scale_f32");
  if (n == 0) return;
  if (aligned(x, 16))
    scale_f32_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(x, alpha, n);
  else
    scale_f32_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(x, alpha, n);
  CUDA_CHECK(cudaGetLastError());
}

size_t sum_squares_scratch_bytes() { return kSumSquaresBlocks * sizeof(double); }

void sum_squares(double* out, const float* x, int64_t n, bool accumulate, void* scratch,
                 size_t scratch_bytes, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "sum_squares");
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= sum_squares_scratch_bytes(),
                "sum_squares: scratch of %zu bytes is smaller than the %zu needed", scratch_bytes,
                sum_squares_scratch_bytes());
  auto* partial = static_cast<double*>(scratch);
  if (aligned(x, 16))
    sum_squares_partial_kernel<4><<<kSumSquaresBlocks, kThreads, 0, stream>>>(partial, x, n);
  else
    sum_squares_partial_kernel<1><<<kSumSquaresBlocks, kThreads, 0, stream>>>(partial, x, n);
  CUDA_CHECK(cudaGetLastError());
  sum_partials_kernel<<<1, kSumSquaresBlocks, 0, stream>>>(out, partial, kSumSquaresBlocks,
                                                          accumulate);
  CUDA_CHECK(cudaGetLastError());
}

size_t bias_grad_scratch_bytes(int64_t N, int64_t OC) {
  check_size(N, INT_MAX, "N", "bias_grad");
  check_size(OC, INT_MAX, "OC", "bias_grad");
  if (N == 0) return 0;
  return size_t(div_up(N, bias_rows_per_chunk(N)) * OC) * sizeof(float);
}

void bias_grad(float* dbias, const bf16* dout, int64_t N, int64_t OC, void* scratch,
               size_t scratch_bytes, cudaStream_t stream) {
  const char* op = "bias_grad";
  check_size(N, INT_MAX, "N", op);
  check_size(OC, INT_MAX, "OC", op);
  if (N == 0 || OC == 0) return;
  const int64_t rows_per_chunk = bias_rows_per_chunk(N);
  const int64_t P = div_up(N, rows_per_chunk);
  const size_t need = size_t(P * OC) * sizeof(float);
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= need,
                "%s: scratch of %zu bytes is smaller than the %zu needed", op, scratch_bytes, need);
  auto* partial = static_cast<float*>(scratch);
  const dim3 block(32, kColumnSlices);
  if (OC % 8 == 0 && aligned(dout, 16))
    column_sum_partial_kernel<8><<<dim3(grid_for(OC / 8, 32), unsigned(P)), block, 0, stream>>>(
        partial, dout, N, int(OC), rows_per_chunk);
  else
    column_sum_partial_kernel<1><<<dim3(grid_for(OC, 32), unsigned(P)), block, 0, stream>>>(
        partial, dout, N, int(OC), rows_per_chunk);
  CUDA_CHECK(cudaGetLastError());
  launch_column_finish(dbias, partial, P, int(OC), stream);
}

}  // namespace shardlm::cuda
