// embedding.cu — the token embedding's forward (a row gather) and its deterministic
// backward (a stable sort by id, then per-id sums in token order); the contract is in
// ops.hpp, precision and bytes moved in docs/kernels.md.
#include "cuda/ops.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <climits>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

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

// out[t, c] = the table's element (ids[t], c) when this rank's shard holds it.
__global__ void __launch_bounds__(kThreads)
owned_rows_kernel(float* __restrict__ out, const int32_t* __restrict__ ids, int64_t n,
                  const float* __restrict__ shard, int64_t begin, int64_t numel, int64_t C) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * C) return;
  const int64_t t = idx / C, c = idx % C;
  const int32_t id = ids[t];
  const int64_t e = int64_t(id) * C + c - begin;  // in the shard: [0, numel)
  out[idx] = id >= 0 && e >= 0 && e < numel ? shard[e] : 0.0f;
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

}  // namespace shardlm::cuda

namespace shardlm {

void cuda_owned_rows(float* out, const int32_t* ids, int64_t n, const float* shard, int64_t shard_begin,
                     int64_t shard_numel, int64_t C, void* stream) {
  using cuda::dev::kThreads;
  if (n == 0 || C == 0) return;
  cuda::owned_rows_kernel<<<cuda::dev::grid_for(n * C, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, ids, n, shard, shard_begin, shard_numel, C);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm
