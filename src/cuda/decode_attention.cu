// decode_attention.cu — one query per sequence over its paged KV cache (read
// through the block table), split-K over the cache length (see
// decode_attention.hpp), and the row copies of the cache.
#include "cuda/check.hpp"
#include "cuda/decode_attention.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <algorithm>
#include <cmath>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, to_bf16, kFullMask; div_up, aligned, align256

constexpr int kWarps = 4;          // warps per block, each on every kWarps-th position of the chunk
constexpr int kHeadsPerBlock = 8;  // query heads of one GQA group a block serves (larger groups: more blocks)
constexpr int kUnroll = 8;         // positions a warp loads and scores at once
constexpr int kBlockAlign = 16;    // cache block sizes are multiples: a warp's group of rows lies in one block

// The block table as the kernels read it (KvPages): position p of a table row
// lies in block row[p / block_size] at offset p % block_size. p / block_size
// by a multiply-high and a shift instead of a 32-bit division (~10 more
// instructions), as a warp computes it for every group of rows it reads:
// div_mul = ceil(2^(31 + l) / block_size), l = ceil(log2(block_size)), exact
// for p < 2^31 (Granlund and Montgomery's round-up method).
struct PageTable {
  const int32_t* table = nullptr;  // (rows, table_ld) block ids, device memory
  int64_t table_ld = 0;
  int block_size = 0;
  uint32_t div_mul = 0, div_shift = 0;

  __device__ __forceinline__ const int32_t* row(int s) const { return table + int64_t(s) * table_ld; }
  __device__ __forceinline__ int index(int p) const { return int(__umulhi(uint32_t(p), div_mul) >> div_shift); }
  // The block id of position p of a table row (read-only for the launch).
  __device__ __forceinline__ int32_t block_of(const int32_t* row, int p) const { return __ldg(row + index(p)); }
  // Where kv head kh's row of position p, which lies in `block`, starts
  // (kv_cache_at's (blocks, KV, block_size, D)).
  __device__ __forceinline__ int64_t at(int32_t block, int p, int kh, int KV, int D) const {
    return ((int64_t(block) * KV + kh) * block_size + (p - index(p) * block_size)) * D;
  }
};

PageTable page_table(const KvPages& pages) {
  int l = 0;
  while ((int64_t(1) << l) < pages.block_size) ++l;  // block_size >= 16 (checked): l >= 4
  PageTable t;
  t.table = pages.table, t.table_ld = pages.table_ld, t.block_size = int(pages.block_size);
  t.div_mul = uint32_t(((uint64_t(1) << (31 + l)) + uint64_t(pages.block_size) - 1) / uint64_t(pages.block_size));
  t.div_shift = uint32_t(l - 1);
  return t;
}

// The block's kWarps online softmaxes (max, sum, unnormalised output per
// head, in shared memory) merged in warp order into chunk c's partials of
// heads h0 .. h0 + nh - 1 of row b: `first` = (b H + h0) chunks + c, the
// partial index of the first head (the next head's is `chunks` further).
// With one chunk the merged head is the answer: out written here, normalised
// as the combine would (o times 1 / sum), and no combine runs.
template <int HEADS, int WIDTH>
__device__ __forceinline__ void write_chunk_partials(const float (&sm_ml)[kWarps][HEADS][2],
                                                     const float (&sm_acc)[kWarps][HEADS][WIDTH], int nh, int D,
                                                     int64_t first, int chunks, float* __restrict__ part_o,
                                                     float* __restrict__ part_ml, bf16* __restrict__ out) {
  for (int i = threadIdx.x; i < nh * D; i += kWarps * 32) {
    const int g = i / D, d = i % D;
    float M = sm_ml[0][g][0];
    for (int w = 1; w < kWarps; ++w) M = fmaxf(M, sm_ml[w][g][0]);
    float sum = 0.0f, o = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = sm_ml[w][g][0] == -INFINITY ? 0.0f : expf(sm_ml[w][g][0] - M);  // a warp with no position
      sum += f * sm_ml[w][g][1];
      o += f * sm_acc[w][g][d];
    }
    const int64_t at = first + int64_t(g) * chunks;
    if (chunks == 1) {
      out[at * D + d] = to_bf16(o * (1.0f / sum));
      continue;
    }
    part_o[at * D + d] = o;
    if (d == 0) part_ml[at * 2] = M, part_ml[at * 2 + 1] = sum;
  }
}

// Partials of chunk c of row b for the query heads kv * G + hg * 8 .. + nh:
// (max, sum) in part_ml and the unnormalised output in part_o, fp32.
// Lane j holds elements j, j + 32, ... of a head (E = ceil(D / 32) of them).
template <int E>
__global__ void __launch_bounds__(kWarps * 32)
decode_partial_kernel(bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const bf16* __restrict__ q,
                      const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                      PageTable pages, const int32_t* __restrict__ seq, const int32_t* __restrict__ len, int H,
                      int KV, int D, int64_t q_ld, int chunk, int chunks, int G, int head_groups, float scale) {
  __shared__ float sm_ml[kWarps][kHeadsPerBlock][2];
  __shared__ float sm_acc[kWarps][kHeadsPerBlock][32 * E];
  const int b = blockIdx.x, kvh = blockIdx.y / head_groups, hg = blockIdx.y % head_groups, c = blockIdx.z;
  const int L = len[b];
  const int start = c * chunk;
  if (start >= L) return;  // the combine reads only the chunks a row's length reaches
  const int end = min(start + chunk, L);
  const int h0 = kvh * G + hg * kHeadsPerBlock, nh = min(kHeadsPerBlock, G - hg * kHeadsPerBlock);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float qr[kHeadsPerBlock][E];
#pragma unroll
  for (int g = 0; g < kHeadsPerBlock; ++g)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = lane + 32 * e;
      qr[g][e] = (g < nh && d < D) ? f32(q[int64_t(b) * q_ld + int64_t(h0 + g) * D + d]) : 0.0f;
    }
  float m[kHeadsPerBlock], l[kHeadsPerBlock], acc[kHeadsPerBlock][E];
#pragma unroll
  for (int g = 0; g < kHeadsPerBlock; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }
  // Warp w takes positions start + 8 w .. + 7, then the next 32: the eight rows'
  // keys and values are loaded before any is used, so a lane has 16 loads in
  // flight instead of one dependent load per position. The eight lie in one
  // cache block (p0 a multiple of 8); the next group's block id is asked for
  // a group ahead, so the table's latency is not in front of the rows'.
  const int32_t* blocks = pages.row(seq[b]);
  const int first = start + warp * kUnroll;
  int32_t next_block = first < end ? pages.block_of(blocks, first) : 0;
  for (int p0 = first; p0 < end; p0 += kWarps * kUnroll) {
    const int64_t base = pages.at(next_block, p0, kvh, KV, D);
    if (p0 + kWarps * kUnroll < end) next_block = pages.block_of(blocks, p0 + kWarps * kUnroll);
    float kr[kUnroll][E], vr[kUnroll][E];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = min(p0 + u, end - 1);  // past the end: a valid row (of p0's block), never used
      const int64_t row = base + int64_t(p - p0) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = lane + 32 * e;
        kr[u][e] = d < D ? f32(k_cache[row + d]) : 0.0f;
        vr[u][e] = d < D ? f32(v_cache[row + d]) : 0.0f;
      }
    }
    // Scores of the group's positions first (independent shuffles and exps),
    // then one rescale of the running sums per group: a serial chain of
    // shuffle -> exp -> rescale per position made the kernel latency-bound.
    const int valid = min(kUnroll, end - p0);
#pragma unroll
    for (int g = 0; g < kHeadsPerBlock; ++g) {
      if (g >= nh) break;
      float sc[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(qr[g][e], kr[u][e], s);
        sc[u] = s;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) sc[u] += __shfl_xor_sync(kFullMask, sc[u], o);
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        sc[u] = u < valid ? sc[u] * scale : -INFINITY;
        m_new = fmaxf(m_new, sc[u]);
      }
      const float rescale = expf(m[g] - m_new);  // 0 on the first group (m = -inf)
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= rescale;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float p_s = expf(sc[u] - m_new);  // 0 past the chunk's end
        sum += p_s;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p_s, vr[u][e], acc[g][e]);
      }
      l[g] = l[g] * rescale + sum;
      m[g] = m_new;
    }
  }
  // The warps' partials, combined in warp order.
#pragma unroll
  for (int g = 0; g < kHeadsPerBlock; ++g) {
    if (lane == 0) sm_ml[warp][g][0] = m[g], sm_ml[warp][g][1] = l[g];
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane + 32 * e] = acc[g][e];
  }
  __syncthreads();
  write_chunk_partials(sm_ml, sm_acc, nh, D, (int64_t(b) * H + h0) * chunks + c, chunks, part_o, part_ml, out);
}

// 8 bf16 of a 16-byte load as floats.
__device__ __forceinline__ void unpack8(const uint4& r, float f[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}

// The same partials as decode_partial_kernel for D = 8 LG (32 and 256; 64 and
// 128 run on the tensor cores, below), read 16 bytes a lane: LG lanes hold one
// cache row (8 elements each), a warp P = 32 / LG rows per load and U = 8 / P loads an iteration (8 positions a
// warp, 32 a block, as the scalar kernel: the same chunks). A score is LG
// lanes' partial dots added by log2(LG) shuffles (the scalar kernel: 5 per
// position and head), and each group of LG lanes keeps its own online softmax
// over its positions; the groups, then the warps, are merged in a fixed order.
// Blocks an SM must hold at once (__launch_bounds__'s minimum): 4 at head dim
// 32 with 4 query heads a block (at most 128 registers a thread). Measured at
// head dim 64, which this kernel served before the tensor-core one: unbounded
// it took 147 registers a thread, 3 blocks an SM, so the 512 blocks of the 1B
// shape at batch 64 ran in two rounds on 132 SMs; bounded to 4 blocks (no
// spills: ptxas -v) they ran in one. Elsewhere the bound would spill (head dim
// 128 at 4 heads: 336 bytes), and the compiler's choice stands.
constexpr int vec_min_blocks(int LG, int HPB) { return HPB == 4 && LG <= 8 ? 4 : 1; }

template <int LG, int HPB>
__global__ void __launch_bounds__(kWarps * 32, vec_min_blocks(LG, HPB))
decode_partial_vec_kernel(bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, const bf16* __restrict__ q,
                          const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                          PageTable pages, const int32_t* __restrict__ seq, const int32_t* __restrict__ len, int H,
                          int KV, int64_t q_ld, int chunk, int chunks, int G, int head_groups, float scale) {
  constexpr int D = 8 * LG, P = 32 / LG, U = kUnroll / P;
  static_assert(P * U == kUnroll, "a warp takes kUnroll positions an iteration");
  __shared__ float sm_ml[kWarps][HPB][2];
  __shared__ float sm_acc[kWarps][HPB][D];
  const int b = blockIdx.x, kvh = blockIdx.y / head_groups, hg = blockIdx.y % head_groups, c = blockIdx.z;
  const int L = len[b];
  const int start = c * chunk;
  if (start >= L) return;
  const int end = min(start + chunk, L);
  const int h0 = kvh * G + hg * HPB, nh = min(HPB, G - hg * HPB);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LG, part = lane % LG;

  float qr[HPB][8];
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    if (g < nh) {
      unpack8(*reinterpret_cast<const uint4*>(q + int64_t(b) * q_ld + int64_t(h0 + g) * D + part * 8), qr[g]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) qr[g][j] = 0.0f;
    }
  }
  float m[HPB], l[HPB], acc[HPB][8];
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.0f;
  }
  // The loads run ahead of the arithmetic: an iteration's K and V rows are in
  // registers before the last iteration's scores are computed, and the rows of
  // the iteration after that are asked into L2. A block has only ~8 KiB an
  // iteration to load (the cache is 33.5 MB a layer over 512 blocks at the 1B
  // shape, batch 64), and the kernel ran at ~1.4 TB/s. Measured: ~0.01-0.02 ms
  // of a 1.56-1.58 ms step, measured on an H200; the
  // kernel is still ~3x its floor. Same positions, same order of arithmetic:
  // the same bits as loading each iteration's rows at its start.
  // A warp's 8 positions an iteration lie in one cache block (p0 a multiple
  // of 8): the block ids of the next two groups (the register loads' and the
  // L2 prefetch's) are held, the one after asked for an iteration ahead.
  constexpr int kStep = kWarps * kUnroll;
  const int32_t* blocks = pages.row(seq[b]);
  auto block_of = [&](int p) { return p < end ? pages.block_of(blocks, p) : 0; };
  auto row_of = [&](int32_t block, int p0, int u) {
    const int p = min(p0 + u * P + sub, end - 1);  // past the end: a valid row (of p0's block), never used
    return pages.at(block, p0, kvh, KV, D) + int64_t(p - p0) * D + part * 8;
  };
  uint4 kn[U], vn[U];
  const int first = start + warp * kUnroll;
  int32_t block1 = block_of(first + kStep), block2 = block_of(first + 2 * kStep);
  if (first < end) {
    const int32_t block0 = block_of(first);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kn[u] = *reinterpret_cast<const uint4*>(k_cache + row_of(block0, first, u));
      vn[u] = *reinterpret_cast<const uint4*>(v_cache + row_of(block0, first, u));
    }
  }
  for (int p0 = first; p0 < end; p0 += kStep) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) kr[u] = kn[u], vr[u] = vn[u];
    if (p0 + kStep < end) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t row = row_of(block1, p0 + kStep, u);
        kn[u] = *reinterpret_cast<const uint4*>(k_cache + row);
        vn[u] = *reinterpret_cast<const uint4*>(v_cache + row);
      }
    }
    if (p0 + 2 * kStep < end) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t row = row_of(block2, p0 + 2 * kStep, u);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k_cache + row));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v_cache + row));
      }
    }
    block1 = block2, block2 = block_of(p0 + 3 * kStep);
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
      if (g >= nh) break;
      float sc[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float kf[8];
        unpack8(kr[u], kf);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qr[g][j], kf[j], s);
        sc[u] = s;
      }
#pragma unroll
      for (int o = LG / 2; o > 0; o >>= 1)
#pragma unroll
        for (int u = 0; u < U; ++u) sc[u] += __shfl_xor_sync(kFullMask, sc[u], o);
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        sc[u] = p0 + u * P + sub < end ? sc[u] * scale : -INFINITY;
        m_new = fmaxf(m_new, sc[u]);
      }
      if (m_new == -INFINITY) continue;  // this lane group has no position here (the chunk's tail)
      const float rescale = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] *= rescale;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p_s = sc[u] == -INFINITY ? 0.0f : expf(sc[u] - m_new);
        sum += p_s;
        float vf[8];
        unpack8(vr[u], vf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(p_s, vf[j], acc[g][j]);
      }
      l[g] = l[g] * rescale + sum;
      m[g] = m_new;
    }
  }
  // The warp's P lane groups merged by xor butterflies: both partners add the
  // same two terms (IEEE addition commutes), so every lane keeps the same bits.
#pragma unroll
  for (int o = LG; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
      const float m_o = __shfl_xor_sync(kFullMask, m[g], o), l_o = __shfl_xor_sync(kFullMask, l[g], o);
      const float M = fmaxf(m[g], m_o);
      const float fa = m[g] == -INFINITY ? 0.0f : expf(m[g] - M), fb = m_o == -INFINITY ? 0.0f : expf(m_o - M);
      l[g] = l[g] * fa + l_o * fb;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float a_o = __shfl_xor_sync(kFullMask, acc[g][j], o);
        acc[g][j] = acc[g][j] * fa + a_o * fb;
      }
      m[g] = M;
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
      if (part == 0) sm_ml[warp][g][0] = m[g], sm_ml[warp][g][1] = l[g];
#pragma unroll
      for (int j = 0; j < 8; ++j) sm_acc[warp][g][part * 8 + j] = acc[g][j];
    }
  }
  __syncthreads();
  write_chunk_partials(sm_ml, sm_acc, nh, D, (int64_t(b) * H + h0) * chunks + c, chunks, part_o, part_ml, out);
}

// The same partials on the tensor cores (mma.sync m16n8k16, bf16 operands,
// fp32 accumulation) for D = 64 and 128, up to 8 query heads a block (the
// matrix's rows; rows past the group's heads are zero). A warp takes 16
// positions a step: S = Q K^T as two n-tiles of 8 positions over D / 16
// k-steps, the online softmax on S's rows (4 lanes hold a row: 2 shuffles for
// its max), then O += P V with P straight from S's accumulators (rounded to
// bf16, as flash attention does) and V's columns gathered from 16-byte row
// loads. A lane loads only 16-byte pieces: K's k dimension is permuted (lane t
// of a row's four holds dims t D/4 .. t D/4 + D/4 - 1, the same permutation
// in Q's fragments) and O's columns are (dim n D/8 + t of n-tile t). Per 16
// positions and up to 8 heads a warp issues ~80 instructions where the
// vectorised kernel issues ~1,800 (the conversions, FMAs and shuffles of
// every head), counted on an H200.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// The 32-bit word w of N 16-byte pieces (w a compile-time constant after unrolling).
template <int N>
__device__ __forceinline__ uint32_t word_of(const uint4 (&r)[N], int w) {
  const uint4& x = r[w / 4];
  const int i = w % 4;
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

constexpr int kMmaHeads = 8;  // query heads a block at most (rows 0-7 of the m16 tile)

// At head dim 64 bounded to 4 blocks an SM (128 registers): the 512 blocks of
// the 1B shape at batch 64 in one round.
template <int D, bool ROPE>
__global__ void __launch_bounds__(kWarps * 32, D == 64 ? 4 : 1)
decode_partial_mma_kernel(bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                          const bf16* __restrict__ q, const bf16* k_cache, const bf16* v_cache,
                          PageTable pages, const int32_t* __restrict__ seq, const int32_t* __restrict__ len, int H,
                          int KV, int64_t q_ld, int chunk, int chunks, int G, int head_groups, float scale,
                          DecodeRope rope) {
  // k_cache and v_cache not __restrict__: with ROPE this kernel writes a row of
  // them (through rope.k_cache, rope.v_cache) and reads it back, so their loads
  // must not take the read-only path.
  static_assert(D == 64 || D == 128, "the mma decode kernel takes head dims 64 and 128");
  constexpr int KS = D / 16;    // k-steps of S = Q K^T
  constexpr int NT = D / 8;     // n-tiles of O = P V
  constexpr int QV = D / 32;    // 16-byte pieces of a lane's D / 4 dims of a q or k row
  constexpr int VV = D / 64;    // 16-byte pieces of a lane's D / 8 dims of a v row
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  __shared__ float sm_ml[kWarps][kMmaHeads][2];
  __shared__ float sm_acc[kWarps][kMmaHeads][D];
  const int b = blockIdx.x, kvh = blockIdx.y / head_groups, hg = blockIdx.y % head_groups, c = blockIdx.z;
  const int L = len[b];
  const int start = c * chunk;
  if (start >= L) return;
  const int end = min(start + chunk, L);
  const int h0 = kvh * G + hg * kMmaHeads, nh = min(kMmaHeads, G - hg * kMmaHeads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  // A step's 16 positions lie in one cache block (p0 and the block size
  // multiples of 16), its kv head's rows together there (kv_cache_at). Each
  // step's block id is asked for a step ahead (the first before the RoPE and
  // q loads), so the table's latency is not in front of the rows' loads.
  const int32_t* blocks = pages.row(seq[b]);
  auto block_of = [&](int p) { return p < end ? pages.block_of(blocks, p) : 0; };
  int32_t next_block = block_of(start + warp * 16);

  // ROPE: the block rotates its query heads into shared memory and, if its
  // chunk holds the new position (L - 1), k into the cache and v beside it
  // (every block of that chunk writes the same bits), before any warp reads a
  // row. Positions decide, not cache rows: the table puts a row anywhere.
  __shared__ __align__(16) bf16 sm_q[ROPE ? kMmaHeads : 1][D];
  if constexpr (ROPE) {
    constexpr int half = D / 2;
    const float pos = float(rope.positions[b]);
    const int64_t crow = rope.cache_rows[b];
    const bool writer = L - 1 < end;  // start <= L - 1 (returned above otherwise)
    const bf16* row = q + int64_t(b) * q_ld;
    for (int e = threadIdx.x; e < (nh + 1) * half; e += kWarps * 32) {
      const int hh = e / half, i = e % half;
      if (hh == nh && !writer) break;
      float sn, cs;
      sincosf(pos * rope.inv_freq[i], &sn, &cs);  // as rope_kernel
      const bf16* x = row + int64_t(hh < nh ? h0 + hh : H + kvh) * D;
      bf16 lo, hi;
      rope_pair(f32(x[i]), f32(x[i + half]), cs, sn, lo, hi);
      if (hh < nh) {
        sm_q[hh][i] = lo, sm_q[hh][i + half] = hi;
      } else {
        const int64_t at = kv_cache_at(crow, kvh, KV, pages.block_size, D);
        const bf16* v = row + int64_t(H + KV + kvh) * D;
        rope.k_cache[at + i] = lo, rope.k_cache[at + i + half] = hi;
        rope.v_cache[at + i] = v[i], rope.v_cache[at + i + half] = v[i + half];
      }
    }
    __syncthreads();
  }
  // Q's fragments: row g (head h0 + g, zero past the group), dims t4 D/4 ..: word 2j is
  // k-step j's cols 2 t4 .. + 1 (a0), word 2j + 1 its cols 8 + 2 t4 .. + 1 (a2).
  uint4 qv[QV];
#pragma unroll
  for (int i = 0; i < QV; ++i) {
    const bf16* from = ROPE ? &sm_q[g < nh ? g : 0][0] : q + int64_t(b) * q_ld + int64_t(h0 + g) * D;
    qv[i] = g < nh ? *reinterpret_cast<const uint4*>(from + t4 * (D / 4) + 8 * i) : make_uint4(0, 0, 0, 0);
  }
  const float scale2 = scale * kLog2e;  // scores in log2 units: exp2f below
  float m = -INFINITY, l = 0.0f;        // row g's running max (log2 units) and this lane's part of its sum
  float o[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  // The 16 positions' rows a lane reads: K rows p0 + g (n-tile 0) and p0 + 8 + g
  // (n-tile 1), this lane's dims; V rows p0 + 2 t4, + 1, p0 + 8 + 2 t4, + 1 (P's k
  // index = position - p0), dims g D/8 ... Loading the next step's rows into
  // registers ahead, or asking them into L2, measured no faster (1.302 and
  // 1.298 against 1.288 ms a decode step on an H200).
  for (int p0 = start + warp * 16; p0 < end; p0 += kWarps * 16) {
    const int64_t base = pages.at(next_block, p0, kvh, KV, D);
    next_block = block_of(p0 + kWarps * 16);
    // Past the end: a valid row (of p0's block), never used.
    auto row_at = [&](int p) { return base + int64_t(min(p, end - 1) - p0) * D; };
    uint4 kr[2][QV], vr[4][VV];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < QV; ++i)
        kr[n][i] = *reinterpret_cast<const uint4*>(k_cache + row_at(p0 + 8 * n + g) + t4 * (D / 4) + 8 * i);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int i = 0; i < VV; ++i)
        vr[r][i] = *reinterpret_cast<const uint4*>(v_cache + row_at(p0 + (r / 2) * 8 + 2 * t4 + (r % 2)) + g * (D / 8) + 8 * i);
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int j = 0; j < KS; ++j)
        mma_bf16_16816(s[n], word_of(qv, 2 * j), word_of(qv, 2 * j + 1), word_of(kr[n], 2 * j),
                       word_of(kr[n], 2 * j + 1));
    }
    // Row g's scores at positions p0 + 2 t4, + 1 (n-tile 0) and p0 + 8 + 2 t4, + 1 (n-tile 1).
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int p = p0 + (i / 2) * 8 + 2 * t4 + (i % 2);
      x[i] = p < end ? s[i / 2][i % 2] * scale2 : -INFINITY;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));  // finite: position p0 is in the chunk
    const float m_new = fmaxf(m, mx);
    const float rescale = exp2f(m - m_new);  // 0 on the first step (m = -inf)
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = exp2f(x[i] - m_new);  // 0 past the end
    l = l * rescale + ((p[0] + p[1]) + (p[2] + p[3]));
    m = m_new;
    const uint32_t a0 = pack_bf16x2(p[0], p[1]), a2 = pack_bf16x2(p[2], p[3]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      o[t][0] *= rescale, o[t][1] *= rescale;  // rows g + 8 (c2, c3) stay zero: A's rows 8-15 are
      const int w = t / 2;
      const unsigned sel = t % 2 ? 0x7632u : 0x5410u;  // the high or low bf16 of each word
      const uint32_t b0 = __byte_perm(word_of(vr[0], w), word_of(vr[1], w), sel);
      const uint32_t b1 = __byte_perm(word_of(vr[2], w), word_of(vr[3], w), sel);
      mma_bf16_16816(o[t], a0, a2, b0, b1);
    }
  }
  // Row g's sum over its four lanes; then the warp's partials to shared memory:
  // lane (g, t4) holds O[g][(2 t4) D/8 + t] (c0) and O[g][(2 t4 + 1) D/8 + t] (c1).
  l += __shfl_xor_sync(kFullMask, l, 1);
  l += __shfl_xor_sync(kFullMask, l, 2);
  if (g < nh) {
    if (t4 == 0) sm_ml[warp][g][0] = m * kLn2, sm_ml[warp][g][1] = l;  // natural units, as the combine reads them
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      sm_acc[warp][g][(2 * t4) * (D / 8) + t] = o[t][0];
      sm_acc[warp][g][(2 * t4 + 1) * (D / 8) + t] = o[t][1];
    }
  }
  __syncthreads();
  write_chunk_partials(sm_ml, sm_acc, nh, D, (int64_t(b) * H + h0) * chunks + c, chunks, part_o, part_ml, out);
}

// out[b, h] = the row's chunks combined in chunk order. One block per (b, h).
__global__ void decode_combine_kernel(bf16* __restrict__ out, const float* __restrict__ part_o,
                                      const float* __restrict__ part_ml, const int32_t* __restrict__ len, int H,
                                      int D, int chunk, int chunks) {
  const int64_t bh = blockIdx.x;
  const int b = int(bh / H);
  const int n = min(chunks, (len[b] + chunk - 1) / chunk);
  const float* ml = part_ml + bh * chunks * 2;
  float M = ml[0];
  for (int c = 1; c < n; ++c) M = fmaxf(M, ml[c * 2]);
  float sum = 0.0f;
  for (int c = 0; c < n; ++c) sum += expf(ml[c * 2] - M) * ml[c * 2 + 1];
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int c = 0; c < n; ++c) o += expf(ml[c * 2] - M) * part_o[(bh * chunks + c) * D + d];
    out[bh * D + d] = to_bf16(o * inv);
  }
}

template <int VEC>
__global__ void copy_rows_kernel(bf16* __restrict__ dst, const int32_t* __restrict__ dst_row,
                                 const bf16* __restrict__ src, const int32_t* __restrict__ src_row, int64_t width,
                                 int64_t src_ld) {
  const int64_t i = blockIdx.x;
  const int64_t to = (dst_row ? int64_t(dst_row[i]) : i) * width;
  const int64_t from = (src_row ? int64_t(src_row[i]) : i) * src_ld;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < width; j += int64_t(blockDim.x) * VEC)
    Pack<bf16, VEC>::load(src + from + j).store(dst + to + j);
}

// Row i's KV heads of k (k_src + i src_ld) and of v (v_src + i src_ld) into
// cache row rows[i] of k_cache and v_cache (kv_cache_at). VEC divides D.
template <int VEC>
__global__ void store_kv_kernel(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                const int32_t* __restrict__ rows, const bf16* __restrict__ k_src,
                                const bf16* __restrict__ v_src, int64_t src_ld, int KV, int D, int64_t block_size) {
  const int64_t i = blockIdx.x, width = int64_t(KV) * D;
  for (int64_t j = int64_t(threadIdx.x) * VEC; j < 2 * width; j += int64_t(blockDim.x) * VEC) {
    const bool is_v = j >= width;
    const int64_t e = is_v ? j - width : j;
    const Pack<bf16, VEC> x = Pack<bf16, VEC>::load((is_v ? v_src : k_src) + i * src_ld + e);
    x.store((is_v ? v_cache : k_cache) + kv_cache_at(rows[i], int(e / D), KV, block_size, D) + e % D);
  }
}

}  // namespace

namespace {

// Blocks one chunk of B rows takes: a block per (row, kv head, group of query heads).
int64_t row_blocks(int64_t B, int64_t H, int64_t KV) {
  const int64_t G = H / KV;
  return B * KV * div_up(G, G <= 4 ? 4 : kHeadsPerBlock);
}

int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
  }();
  return n;
}

// Positions a chunk holds when max_len is cut into at most `chunks`: a multiple
// of kWarps * kUnroll, so every warp's group of rows starts inside the chunk,
// and of kBlockAlign, so every group (8 positions, or the tensor-core
// kernel's 16) lies in one cache block.
int64_t chunk_positions(int64_t max_len, int64_t chunks) {
  constexpr int64_t kStep = kWarps * kUnroll;
  static_assert(kStep % kBlockAlign == 0 && kBlockAlign % kUnroll == 0 && kBlockAlign % 16 == 0,
                "a warp's group of positions must not straddle two cache blocks");
  return std::max<int64_t>(kStep, div_up(div_up(max_len, chunks), kStep) * kStep);
}

size_t partial_bytes(int64_t B, int64_t H, int64_t D, int64_t chunks) {
  return align256(size_t(B * H * chunks * D) * sizeof(float)) + align256(size_t(B * H * chunks * 2) * sizeof(float));
}

}  // namespace

int64_t decode_attention_chunks(int64_t B, int64_t H, int64_t KV, int64_t max_len) {
  const int64_t blocks = row_blocks(B, H, KV);
  const int64_t want = std::max<int64_t>(1, sm_count() / std::max<int64_t>(1, blocks));
  const int64_t most = std::min(kDecodeMaxChunks, div_up(max_len, kWarps * kUnroll));
  return std::clamp<int64_t>(want, 1, most);
}

size_t decode_attention_scratch_bytes(int64_t B, int64_t H, int64_t D, int64_t max_len) {
  // Enough for any pass of at most B rows and any chunk count the forward takes
  // (b rows cut into more chunks than B rows never hold more partials than B rows
  // at the most chunks), with no device to ask: `check` plans on machines without one.
  const int64_t most = std::min(kDecodeMaxChunks, div_up(max_len, kWarps * kUnroll));
  return partial_bytes(B, H, D, div_up(max_len, chunk_positions(max_len, most)));
}

bool decode_attention_ropes(int64_t D) { return D == 64 || D == 128; }

void decode_attention_forward(bf16* out, const bf16* q, int64_t q_ld, const bf16* k_cache, const bf16* v_cache,
                              const KvPages& pages, const int32_t* seq, const int32_t* len, int64_t B, int64_t H,
                              int64_t KV, int64_t D, int64_t max_len, int64_t chunks, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream, const DecodeRope* rope) {
  if (B == 0) return;
  SHARDLM_CHECK(KV >= 1 && H % KV == 0, "decode_attention: %lld query heads over %lld kv heads", (long long)H,
                (long long)KV);
  SHARDLM_CHECK(D >= 1 && D <= 256, "decode_attention: head dim %lld is outside [1, 256]", (long long)D);
  SHARDLM_CHECK(q_ld >= H * D, "decode_attention: q rows of %lld elements hold %lld heads of %lld", (long long)q_ld,
                (long long)H, (long long)D);
  SHARDLM_CHECK(B <= INT32_MAX && max_len >= 1 && max_len <= INT32_MAX, "decode_attention: %lld rows, %lld positions",
                (long long)B, (long long)max_len);
  SHARDLM_CHECK(pages.block_size >= kBlockAlign && pages.block_size % kBlockAlign == 0 && pages.block_size <= INT32_MAX,
                "decode_attention: a KV cache block of %lld positions; the block size must be a positive "
                "multiple of %d (a warp reads 16 positions inside one block)",
                (long long)pages.block_size, kBlockAlign);
  SHARDLM_CHECK(pages.table != nullptr && max_len <= pages.capacity(),
                "decode_attention: rows of %lld positions over a block table of %lld blocks of %lld a row",
                (long long)max_len, (long long)pages.table_ld, (long long)pages.block_size);
  if (chunks == 0) chunks = decode_attention_chunks(B, H, KV, max_len);
  SHARDLM_CHECK(chunks >= 1 && chunks <= kDecodeMaxChunks, "decode_attention: %lld chunks (1 to %lld)",
                (long long)chunks, (long long)kDecodeMaxChunks);
  const int64_t chunk = chunk_positions(max_len, chunks);
  chunks = div_up(max_len, chunk);
  SHARDLM_CHECK(scratch_bytes >= partial_bytes(B, H, D, chunks), "internal: decode_attention scratch of %zu bytes, needs %zu",
                scratch_bytes, partial_bytes(B, H, D, chunks));
  const int G = int(H / KV), head_groups = int(div_up(G, kHeadsPerBlock));
  SHARDLM_CHECK(KV * head_groups <= 65535, "decode_attention: %lld kv heads x %d head groups over one grid",
                (long long)KV, head_groups);
  float* part_o = static_cast<float*>(scratch);
  float* part_ml = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                            align256(size_t(B * H * chunks * D) * sizeof(float)));
  const dim3 grid(unsigned(B), unsigned(KV * head_groups), unsigned(chunks));
  const float scale = float(1.0 / std::sqrt(double(D)));
  const PageTable table = page_table(pages);
  // Head dims of 64 and 128 with 16-byte rows: the tensor-core kernel; 32 and
  // 256: the vectorised one; else the scalar one (decode_attention_ropes).
  const bool rows16 = q_ld % 8 == 0 && aligned(q, 16) && aligned(k_cache, 16) && aligned(v_cache, 16);
  const bool mma = decode_attention_ropes(D) && rows16;
  SHARDLM_CHECK(rope == nullptr || (mma && q_ld >= (H + 2 * KV) * D && rope->k_cache == k_cache &&
                                    rope->v_cache == v_cache),
                "internal: decode attention with RoPE needs the tensor-core kernel and the fused q|k|v rows");
  const bool vec = (D == 32 || D == 256) && rows16;
  if (mma) {
    const int groups = int(div_up(G, kMmaHeads));
    const dim3 mgrid(unsigned(B), unsigned(KV * groups), unsigned(chunks));
    const DecodeRope r = rope ? *rope : DecodeRope{};
#define SHARDLM_DECODE_MMA(DIM, ROPE)                                                                     \
  decode_partial_mma_kernel<DIM, ROPE><<<mgrid, kWarps * 32, 0, stream>>>(                               \
      out, part_o, part_ml, q, k_cache, v_cache, table, seq, len, int(H), int(KV), q_ld, int(chunk),   \
      int(chunks), G, groups, scale, r)
    if (D == 64 && rope) SHARDLM_DECODE_MMA(64, true);
    else if (D == 64) SHARDLM_DECODE_MMA(64, false);
    else if (rope) SHARDLM_DECODE_MMA(128, true);
    else SHARDLM_DECODE_MMA(128, false);
#undef SHARDLM_DECODE_MMA
  } else if (vec) {
    // Query heads a block: 4 for groups of up to 4 (measured with this kernel at
    // head dim 64: 1.509 against 1.555 ms a decode step with 2 heads a block at
    // the 1B shape, batch 64, on an H200), 8 for larger groups (not measured). Every head's
    // arithmetic is its own, so the bits are the same at any count.
    const int hpb = G <= 4 ? 4 : 8, groups = int(div_up(G, hpb));
    const dim3 vgrid(unsigned(B), unsigned(KV * groups), unsigned(chunks));
#define SHARDLM_DECODE_VEC(LG, HPB)                                                                       \
  decode_partial_vec_kernel<LG, HPB><<<vgrid, kWarps * 32, 0, stream>>>(                                  \
      out, part_o, part_ml, q, k_cache, v_cache, table, seq, len, int(H), int(KV), q_ld, int(chunk),   \
      int(chunks), G, groups, scale)
    if (D == 32 && hpb == 4) SHARDLM_DECODE_VEC(4, 4);
    else if (D == 32) SHARDLM_DECODE_VEC(4, 8);
    else if (hpb == 4) SHARDLM_DECODE_VEC(32, 4);
    else SHARDLM_DECODE_VEC(32, 8);
#undef SHARDLM_DECODE_VEC
  } else {
#define SHARDLM_DECODE_PARTIAL(E)                                                                              \
  decode_partial_kernel<E><<<grid, kWarps * 32, 0, stream>>>(out, part_o, part_ml, q, k_cache, v_cache, table, seq, \
                                                             len, int(H), int(KV), int(D), q_ld, int(chunk),        \
                                                             int(chunks), G, head_groups, scale)
  if (D <= 32) SHARDLM_DECODE_PARTIAL(1);
  else if (D <= 64) SHARDLM_DECODE_PARTIAL(2);
  else if (D <= 128) SHARDLM_DECODE_PARTIAL(4);
  else SHARDLM_DECODE_PARTIAL(8);
#undef SHARDLM_DECODE_PARTIAL
  }
  CUDA_CHECK(cudaGetLastError());
  if (chunks == 1) return;  // the partial kernel wrote out
  decode_combine_kernel<<<unsigned(B * H), unsigned(std::min<int64_t>(256, div_up(D, 32) * 32)), 0, stream>>>(
      out, part_o, part_ml, len, int(H), int(D), int(chunk), int(chunks));
  CUDA_CHECK(cudaGetLastError());
}

void copy_rows(bf16* dst, const int32_t* dst_row, const bf16* src, const int32_t* src_row, int64_t n, int64_t width,
               cudaStream_t stream, int64_t src_ld) {
  if (n == 0 || width == 0) return;
  if (src_ld == 0) src_ld = width;
  SHARDLM_CHECK(n <= INT32_MAX && src_ld >= width, "copy_rows: %lld rows of %lld (source rows of %lld)",
                (long long)n, (long long)width, (long long)src_ld);
  if (width % 8 == 0 && src_ld % 8 == 0 && aligned(dst, 16) && aligned(src, 16))
    copy_rows_kernel<8><<<unsigned(n), 128, 0, stream>>>(dst, dst_row, src, src_row, width, src_ld);
  else
    copy_rows_kernel<1><<<unsigned(n), 128, 0, stream>>>(dst, dst_row, src, src_row, width, src_ld);
  CUDA_CHECK(cudaGetLastError());
}

void store_kv(bf16* k_cache, bf16* v_cache, const int32_t* rows, const bf16* k_src, const bf16* v_src, int64_t src_ld,
              int64_t n, int64_t KV, int64_t D, int64_t block_size, cudaStream_t stream) {
  if (n == 0 || KV == 0 || D == 0) return;
  SHARDLM_CHECK(n <= INT32_MAX && src_ld >= KV * D && KV <= INT32_MAX && D <= INT32_MAX && block_size >= 1,
                "store_kv: %lld rows of %lld x %lld (source rows of %lld) into blocks of %lld positions", (long long)n,
                (long long)KV, (long long)D, (long long)src_ld, (long long)block_size);
  if (D % 8 == 0 && src_ld % 8 == 0 && aligned(k_src, 16) && aligned(v_src, 16) && aligned(k_cache, 16) &&
      aligned(v_cache, 16))
    store_kv_kernel<8><<<unsigned(n), 128, 0, stream>>>(k_cache, v_cache, rows, k_src, v_src, src_ld, int(KV), int(D),
                                                         block_size);
  else
    store_kv_kernel<1><<<unsigned(n), 128, 0, stream>>>(k_cache, v_cache, rows, k_src, v_src, src_ld, int(KV), int(D),
                                                         block_size);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
