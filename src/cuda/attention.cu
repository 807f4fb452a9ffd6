// attention.cu — causal GQA packed-document flash attention, forward and backward.
// Contract: src/cuda/attention.hpp. Reference: shardlm::cpu::attention_*.
//
// Kernels (all deterministic, none uses atomics):
//   doc_start_kernel   one block scans seq_id: doc_start[i] = first token of i's run.
//   fwd_kernel         FlashAttention-2 forward: a block owns BM queries of one head,
//                      walks key tiles [doc_start[first query], last query], online
//                      softmax in fp32 registers, O accumulated by mma.sync.
//   delta_kernel       delta = rowsum(dout * out) (N, H) fp32.
//   dkdv_kernel        a block owns BNK keys of one kv head; it sums over the group's
//                      query heads (in order) and their query tiles (in order).
//   dq_kernel          a block owns BM queries of one head; walks key tiles like
//                      forward (recomputes P and dP: 7 matrix products instead of 5,
//                      the price of no atomics).
//   generic_*          one warp per row, fp32 dot products: any D <= 256, slow.
//
// Tensor-core tiles: mma.sync.m16n8k16 bf16 -> fp32. Operands come from shared
// memory through ldmatrix (rows padded by 16 bytes so the 8 row addresses of an
// 8x8 matrix hit distinct banks); P and dS go from the fp32 accumulators straight
// into A fragments (the accumulator layout of two n8 tiles is the A layout of one
// k16 slice). Tiles are loaded with cp.async, two stages deep. A warp owns MT
// tiles of 16 rows (MT = 2 halves the B-fragment reads from shared memory per mma).
// Templates: <D, warps per block, MT, tile length>; dispatch_fwd / dispatch_bwd pick
// the tiling per D (measured numbers in docs/kernels-attention.md).
//
// Fragment layouts used below (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8,  col): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#include "cuda/attention.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/check.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

AttentionKernel g_kernel = AttentionKernel::kAuto;

// ---------------------------------------------------------------- PTX helpers

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; valid == false writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b, m16n8k16, bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to a bf16 pair, `lo` in the low half (the lower column index).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x; ex2(-inf) = 0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// Butterfly sum: every lane ends with the same bits (each level adds the same two
// partials, only in swapped order).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---------------------------------------------------------------- tiles

// Row stride of a shared tile, in elements: 16 bytes of padding, so the 8 rows an
// ldmatrix 8x8 matrix reads start in 8 different 4-bank groups.
template <int D>
__host__ __device__ constexpr int smem_row() {
  return D + 8;
}

// ROWS x D bf16 rows [row0, row0 + ROWS) of a (N, heads, D) tensor, one head
// (`base` already offset to it, rows `row_stride` elements apart) -> shared tile
// (ROWS, D + 8). Rows outside [0, N) are zero-filled, so masked probabilities
// multiply zeros, never stale NaNs.
template <int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* base, int64_t row_stride,
                                          int row0, int N) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = threadIdx.x; c < ROWS * kChunks; c += NTHREADS) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int row = row0 + r;
    const bool valid = row < N;
    const bf16* src = base + (valid ? int64_t(row) * row_stride : 0) + col;
    cp_async16(smem_addr(tile + r * smem_row<D>() + col), src, valid);
  }
}

// A fragment (16x16) of a row-major shared tile at (row0, col0).
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(a, smem_addr(tile + (row0 + (lane & 15)) * smem_row<D>() + col0 + (lane >> 4) * 8));
}
// B fragments of two n8 tiles (n0..n0+15) for k16 slice k0, where B(k, n) = tile[n][k]
// (K for Q K^T): b[0], b[1] for n0..n0+7, b[2], b[3] for n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(b, smem_addr(tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * smem_row<D>() + k0 +
                           ((lane >> 3) & 1) * 8));
}
// The same where B(k, n) = tile[k][n] (V for P V): transposed ldmatrix.
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* tile, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(b, smem_addr(tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * smem_row<D>() +
                                 n0 + (lane >> 4) * 8));
}
// A fragment of k16 slice kc from accumulators of n8 tiles 2kc and 2kc+1.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

// The first query after key j that cannot see j: the first i > j whose document
// starts after j, or N. doc_start is nondecreasing, so the predicate is
// false..false true..true; each round a warp probes 32 points and keeps 1/32 of the
// interval. Every lane returns the same value.
__device__ int find_doc_end(const int32_t* doc_start, int j, int N) {
  const int lane = threadIdx.x & 31;
  int lo = j + 1, hi = N;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 31) / 32;
    const int pos = lo + lane * step;
    const bool probe = pos < hi;
    const bool pred = probe && doc_start[pos] > j;
    const unsigned hits = __ballot_sync(0xffffffffu, pred);
    if (hits) {
      const int first = __ffs(hits) - 1;
      const int new_hi = lo + first * step;
      lo = first == 0 ? new_hi : lo + (first - 1) * step + 1;
      hi = new_hi;
    } else {
      const unsigned probes = __ballot_sync(0xffffffffu, probe);
      lo = lo + (31 - __clz(probes)) * step + 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------- doc_start

constexpr int kScanThreads = 1024;
constexpr int kScanPerThread = 8;

// One block; chunks of 8192 tokens, a running max carried between chunks. A token
// is a boundary when it is 0 or its seq_id differs from its left neighbour's;
// doc_start[i] is the last boundary <= i (a max-scan).
__global__ void __launch_bounds__(kScanThreads) doc_start_kernel(int32_t* doc_start,
                                                                 const int32_t* seq_id, int N) {
  __shared__ int warp_max[kScanThreads / 32];
  __shared__ int carry_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int carry = 0;
  for (int base = 0; base < N; base += kScanThreads * kScanPerThread) {
    const int i0 = base + tid * kScanPerThread;
    int run[kScanPerThread];
    int m = -1;
#pragma unroll
    for (int e = 0; e < kScanPerThread; ++e) {
      const int i = i0 + e;
      if (i < N && (i == 0 || seq_id[i] != seq_id[i - 1])) m = i;
      run[e] = m;
    }
    // Inclusive max-scan of the thread maxima across the block.
    int x = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x = max(x, y);
    }
    if (lane == 31) warp_max[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = warp_max[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w = max(w, y);
      }
      warp_max[lane] = w;
    }
    __syncthreads();
    int before = __shfl_up_sync(0xffffffffu, x, 1);  // exclusive within the warp
    if (lane == 0) before = -1;
    if (warp > 0) before = max(before, warp_max[warp - 1]);
    before = max(before, carry);
#pragma unroll
    for (int e = 0; e < kScanPerThread; ++e) {
      const int i = i0 + e;
      if (i < N) doc_start[i] = max(run[e], before);
    }
    if (tid == kScanThreads - 1) carry_s = max(x, before);
    __syncthreads();
    carry = carry_s;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- forward (mma)

struct FwdParams {
  bf16* out;              // (N, H, D)
  float* lse;             // (N, H)
  const bf16* q;          // (N, H, D)
  const bf16* k;          // (N, KV, D)
  const bf16* v;          // (N, KV, D)
  const int32_t* doc_start;  // (N)
  int N, H, KV, group;
  float scale_log2;       // log2(e) / sqrt(D)
};

template <int D, int NWARPS, int MT, int BN>
struct FwdTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBM = NWARPS * 16 * MT;  // queries per block
  static constexpr size_t kSmemBytes = size_t(kBM + 4 * BN) * smem_row<D>() * sizeof(bf16);
};

// Warp w owns query rows w*16*MT + mt*16 + {g, g+8} of the block (mt < MT); MT = 2
// halves the shared-memory reads per mma (each K/V fragment feeds two row tiles).
template <int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) fwd_kernel(const FwdParams p) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sK = sQ + kBM * kSR;                      // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)

  const int h = blockIdx.x;
  const int i0 = (gridDim.y - 1 - blockIdx.y) * kBM;  // heaviest (last) blocks first
  const int i_last = min(i0 + kBM, p.N) - 1;
  const int kvh = h / p.group;
  const int kv_begin = p.doc_start[i0];
  const int ds_last = p.doc_start[i_last];  // the largest doc start in the block
  const int ntiles = (i_last - kv_begin) / BN + 1;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  const bf16* q_head = p.q + int64_t(h) * D;
  const bf16* k_head = p.k + int64_t(kvh) * D;
  const bf16* v_head = p.v + int64_t(kvh) * D;

  int row[MT][2], row_ds[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row[mt][hh] = i0 + warp * 16 * MT + mt * 16 + g + 8 * hh;
      // A padding row (>= N) sees no key.
      row_ds[mt][hh] = row[mt][hh] < p.N ? p.doc_start[row[mt][hh]] : INT_MAX;
    }

  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  load_tile<kBM, D, Tile::kThreads>(sQ, q_head, q_stride, i0, p.N);
  load_tile<BN, D, Tile::kThreads>(sK, k_head, kv_stride, kv_begin, p.N);
  load_tile<BN, D, Tile::kThreads>(sV, v_head, kv_stride, kv_begin, p.N);
  cp_async_commit();

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1;
    if (it + 1 < ntiles) {
      const int next = kv_begin + (it + 1) * BN;
      load_tile<BN, D, Tile::kThreads>(sK + (st ^ 1) * BN * kSR, k_head, kv_stride, next, p.N);
      load_tile<BN, D, Tile::kThreads>(sV + (st ^ 1) * BN * kSR, v_head, kv_stride, next, p.N);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* k_tile = sK + st * BN * kSR;
    const bf16* v_tile = sV + st * BN * kSR;
    const int kt = kv_begin + it * BN;

    // S = Q K^T (fp32).
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a<D>(a[mt], sQ, warp * 16 * MT + mt * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, k_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Mask (only tiles that cross the diagonal or a document start need it), then
    // the online softmax in the log2 domain: m is the running max of the scaled
    // scores, p = exp2(s * scale_log2 - m) in one FFMA. A row with no visible key
    // yet keeps m = -inf and subtracts 0 instead, so exp2 gives 0, never NaN.
    const bool need_mask = (kt + BN - 1 > i0) || (kt < ds_last);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float x = s[mt][nt][2 * hh + e2];
            if (need_mask) {
              const int j = kt + nt * 8 + 2 * t + e2;
              if (j > row[mt][hh] || j < row_ds[mt][hh]) x = -INFINITY;
            }
            s[mt][nt][2 * hh + e2] = x;
            mx = fmaxf(mx, x);
          }
        mx = quad_max(mx) * p.scale_log2;  // scale > 0 keeps the order; -inf stays -inf
        const float m_new = fmaxf(m[mt][hh], mx);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ex2(m[mt][hh] - base);
        m[mt][hh] = m_new;
        float rowsum = 0.f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const float pr = ex2(fmaf(s[mt][nt][2 * hh + e2], p.scale_log2, -base));
            s[mt][nt][2 * hh + e2] = pr;
            rowsum += pr;
          }
        l[mt][hh] = l[mt][hh] * alpha + rowsum;  // this thread's columns; quad sum at the end
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[mt][dt][2 * hh] *= alpha;
          o[mt][dt][2 * hh + 1] *= alpha;
        }
      }

    // O += P V, P rounded to bf16 (as FlashAttention does).
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        load_b_kn<D>(b, v_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_bf16(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled next iteration
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l_row = quad_sum(l[mt][hh]);
      const int r = row[mt][hh];
      if (r >= p.N) continue;
      const float inv = 1.f / l_row;
      bf16* out_row = p.out + (int64_t(r) * p.H + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(out_row + dt * 8 + 2 * t) =
            pack_bf16(o[mt][dt][2 * hh] * inv, o[mt][dt][2 * hh + 1] * inv);
      if (t == 0) p.lse[int64_t(r) * p.H + h] = (m[mt][hh] + log2f(l_row)) * kLn2;
    }
}

// ---------------------------------------------------------------- backward (mma)

struct BwdParams {
  bf16* dq;                  // (N, H, D)
  bf16* dk;                  // (N, KV, D)
  bf16* dv;                  // (N, KV, D)
  const bf16* dout;          // (N, H, D)
  const bf16* q;             // (N, H, D)
  const bf16* k;             // (N, KV, D)
  const bf16* v;             // (N, KV, D)
  const float* lse;          // (N, H)
  const float* delta;        // (N, H)
  const int32_t* doc_start;  // (N)
  int N, H, KV, group;
  float scale;               // 1 / sqrt(D)
  float scale_log2;          // log2(e) / sqrt(D)
};

template <int D, int NWARPS, int MT, int BMQ>
struct DkdvTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBNK = NWARPS * 16 * MT;  // keys per block
  // K, V tiles; two stages of (Q, dO tiles, lse, delta, doc_start of the queries).
  static constexpr size_t kStageBytes =
      size_t(2 * BMQ) * smem_row<D>() * sizeof(bf16) + 3 * BMQ * sizeof(float);
  static constexpr size_t kSmemBytes =
      size_t(2 * kBNK) * smem_row<D>() * sizeof(bf16) + 2 * kStageBytes;
  static_assert(kStageBytes % 16 == 0, "cp.async needs 16-byte aligned stages");
};

// Warp w owns keys w*16*MT + mt*16 + {g, g+8} of the block (mt < MT) and computes
// the transposed products S^T = K Q^T and dP^T = V dO^T, so dV += P^T dO and
// dK += dS^T Q land in its own accumulators: no reduction between warps. MT = 2
// halves the shared-memory reads per mma (each Q/dO fragment feeds two key tiles).
template <int D, int NWARPS, int MT, int BMQ>
__global__ void __launch_bounds__(NWARPS * 32) dkdv_kernel(const BwdParams p) {
  using Tile = DkdvTile<D, NWARPS, MT, BMQ>;
  constexpr int kBNK = Tile::kBNK, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // (BNK, D+8)
  bf16* sV = sK + kBNK * kSR;                     // (BNK, D+8)
  unsigned char* stage_base = reinterpret_cast<unsigned char*>(sV + kBNK * kSR);
  auto sQ = [&](int s) { return reinterpret_cast<bf16*>(stage_base + s * Tile::kStageBytes); };
  auto sdO = [&](int s) { return sQ(s) + BMQ * kSR; };
  auto sLse = [&](int s) { return reinterpret_cast<float*>(sdO(s) + BMQ * kSR); };
  auto sDelta = [&](int s) { return sLse(s) + BMQ; };
  auto sDocStart = [&](int s) { return reinterpret_cast<int32_t*>(sDelta(s) + BMQ); };

  const int kvh = blockIdx.x;
  const int j0 = blockIdx.y * kBNK;  // first blocks own the most queries: launched first
  const int j_last = min(j0 + kBNK, p.N) - 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;

  // Queries [j0, q_end) can see some key of the block; every head of the group
  // walks the same query tiles.
  const int q_end = find_doc_end(p.doc_start, j_last, p.N);
  const int nq = (q_end - j0 + BMQ - 1) / BMQ;
  const int items = p.group * nq;

  auto load_item = [&](int item, int s) {
    const int h = kvh * p.group + item / nq;
    const int i_start = j0 + (item % nq) * BMQ;
    load_tile<BMQ, D, kT>(sQ(s), p.q + int64_t(h) * D, q_stride, i_start, p.N);
    load_tile<BMQ, D, kT>(sdO(s), p.dout + int64_t(h) * D, q_stride, i_start, p.N);
    for (int c = threadIdx.x; c < BMQ; c += kT) {
      const int i = i_start + c;
      const bool valid = i < p.N;
      const int64_t ih = valid ? int64_t(i) * p.H + h : 0;
      cp_async4(smem_addr(sLse(s) + c), p.lse + ih, valid);
      cp_async4(smem_addr(sDelta(s) + c), p.delta + ih, valid);
      cp_async4(smem_addr(sDocStart(s) + c), p.doc_start + (valid ? i : 0), valid);
    }
  };

  load_tile<kBNK, D, kT>(sK, p.k + int64_t(kvh) * D, kv_stride, j0, p.N);
  load_tile<kBNK, D, kT>(sV, p.v + int64_t(kvh) * D, kv_stride, j0, p.N);
  load_item(0, 0);
  cp_async_commit();

  float dk[MT][D / 8][4], dv[MT][D / 8][4];
  int key[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][dt][e] = dv[mt][dt][e] = 0.f;
    key[mt][0] = j0 + warp * 16 * MT + mt * 16 + g;
    key[mt][1] = key[mt][0] + 8;
  }

  for (int item = 0; item < items; ++item) {
    const int st = item & 1;
    if (item + 1 < items) {
      load_item(item + 1, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* q_tile = sQ(st);
    const bf16* do_tile = sdO(st);
    const float* lse_t = sLse(st);
    const float* delta_t = sDelta(st);
    const int32_t* ds_t = sDocStart(st);
    const int i_start = j0 + (item % nq) * BMQ;

    // S^T = K Q^T and dP^T = V dO^T: (16 keys) x (BMQ queries) per key tile.
    float sT[MT][BMQ / 8][4], dpT[MT][BMQ / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BMQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sT[mt][nt][e] = dpT[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[MT][4], av[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load_a<D>(ak[mt], sK, warp * 16 * MT + mt * 16, kk * 16);
        load_a<D>(av[mt], sV, warp * 16 * MT + mt * 16, kk * 16);
      }
#pragma unroll
      for (int np = 0; np < BMQ / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, q_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(sT[mt][2 * np], ak[mt], b[0], b[1]);
          mma_bf16(sT[mt][2 * np + 1], ak[mt], b[2], b[3]);
        }
        load_b_nk<D>(b, do_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dpT[mt][2 * np], av[mt], b[0], b[1]);
          mma_bf16(dpT[mt][2 * np + 1], av[mt], b[2], b[3]);
        }
      }
    }

    // P^T = exp(S^T * scale - lse), dS^T = P^T (dP^T - delta). A tile needs the mask
    // unless every query is at or after every key, is a real token, and its
    // document started at or before the block's first key.
    const bool full = i_start >= j_last && i_start + BMQ <= p.N && ds_t[BMQ - 1] <= j0;
#pragma unroll
    for (int nt = 0; nt < BMQ / 8; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int qc = nt * 8 + 2 * t + e2;
        const float lse2 = lse_t[qc] * kLog2e, delta_q = delta_t[qc];
        const int i = i_start + qc, ds_i = ds_t[qc];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * hh + e2;
            const float pr = ex2(fmaf(sT[mt][nt][e], p.scale_log2, -lse2));
            bool visible = true;
            if (!full) {
              const int j = key[mt][hh];
              visible = i < p.N && j <= i && j >= ds_i;
            }
            const float pv = visible ? pr : 0.f;
            sT[mt][nt][e] = pv;
            dpT[mt][nt][e] = pv * (dpT[mt][nt][e] - delta_q);
          }
      }

    // dV += P^T dO, dK += dS^T Q (bf16 operands, fp32 accumulators).
#pragma unroll
    for (int kc = 0; kc < BMQ / 16; ++kc) {
      uint32_t ap[MT][4], ads[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc_to_a(ap[mt], sT[mt][2 * kc], sT[mt][2 * kc + 1]);
        acc_to_a(ads[mt], dpT[mt][2 * kc], dpT[mt][2 * kc + 1]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        load_b_kn<D>(b, do_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dv[mt][2 * dp], ap[mt], b[0], b[1]);
          mma_bf16(dv[mt][2 * dp + 1], ap[mt], b[2], b[3]);
        }
        load_b_kn<D>(b, q_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dk[mt][2 * dp], ads[mt], b[0], b[1]);
          mma_bf16(dk[mt][2 * dp + 1], ads[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled next iteration
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = key[mt][hh];
      if (j >= p.N) continue;
      const int64_t off = (int64_t(j) * p.KV + kvh) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(p.dk + off + dt * 8 + 2 * t) =
            pack_bf16(dk[mt][dt][2 * hh] * p.scale, dk[mt][dt][2 * hh + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(p.dv + off + dt * 8 + 2 * t) =
            pack_bf16(dv[mt][dt][2 * hh], dv[mt][dt][2 * hh + 1]);
      }
    }
}

template <int D, int NWARPS, int MT, int BN>
struct DqTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBM = NWARPS * 16 * MT;
  // Q, dO tiles; two stages of K, V tiles.
  static constexpr size_t kSmemBytes = size_t(2 * kBM + 4 * BN) * smem_row<D>() * sizeof(bf16);
};

// Warp w owns query rows w*16*MT + mt*16 + {g, g+8}; key tiles as in forward.
template <int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) dq_kernel(const BwdParams p) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sdO = sQ + kBM * kSR;                     // (BM, D+8)
  bf16* sK = sdO + kBM * kSR;                     // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)

  const int h = blockIdx.x;
  const int i0 = (gridDim.y - 1 - blockIdx.y) * kBM;
  const int i_last = min(i0 + kBM, p.N) - 1;
  const int kvh = h / p.group;
  const int kv_begin = p.doc_start[i0];
  const int ds_last = p.doc_start[i_last];
  const int ntiles = (i_last - kv_begin) / BN + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  const bf16* k_head = p.k + int64_t(kvh) * D;
  const bf16* v_head = p.v + int64_t(kvh) * D;

  int row[MT][2], row_ds[MT][2];
  float lse2[MT][2], delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = i0 + warp * 16 * MT + mt * 16 + g + 8 * hh;
      const bool valid = r < p.N;
      row[mt][hh] = r;
      row_ds[mt][hh] = valid ? p.doc_start[r] : INT_MAX;
      lse2[mt][hh] = valid ? p.lse[int64_t(r) * p.H + h] * kLog2e : 0.f;
      delta[mt][hh] = valid ? p.delta[int64_t(r) * p.H + h] : 0.f;
    }

  load_tile<kBM, D, kT>(sQ, p.q + int64_t(h) * D, q_stride, i0, p.N);
  load_tile<kBM, D, kT>(sdO, p.dout + int64_t(h) * D, q_stride, i0, p.N);
  load_tile<BN, D, kT>(sK, k_head, kv_stride, kv_begin, p.N);
  load_tile<BN, D, kT>(sV, v_head, kv_stride, kv_begin, p.N);
  cp_async_commit();

  float dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[mt][dt][e] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1;
    if (it + 1 < ntiles) {
      const int next = kv_begin + (it + 1) * BN;
      load_tile<BN, D, kT>(sK + (st ^ 1) * BN * kSR, k_head, kv_stride, next, p.N);
      load_tile<BN, D, kT>(sV + (st ^ 1) * BN * kSR, v_head, kv_stride, next, p.N);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* k_tile = sK + st * BN * kSR;
    const bf16* v_tile = sV + st * BN * kSR;
    const int kt = kv_begin + it * BN;

    // S = Q K^T, dP = dO V^T.
    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[MT][4], ado[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load_a<D>(aq[mt], sQ, warp * 16 * MT + mt * 16, kk * 16);
        load_a<D>(ado[mt], sdO, warp * 16 * MT + mt * 16, kk * 16);
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, k_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][2 * np], aq[mt], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], aq[mt], b[2], b[3]);
        }
        load_b_nk<D>(b, v_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dp[mt][2 * np], ado[mt], b[0], b[1]);
          mma_bf16(dp[mt][2 * np + 1], ado[mt], b[2], b[3]);
        }
      }
    }

    const bool need_mask = (kt + BN - 1 > i0) || (kt < ds_last);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          float pr = ex2(fmaf(s[mt][nt][e], p.scale_log2, -lse2[mt][hh]));
          if (need_mask) {
            const int j = kt + nt * 8 + 2 * t + (e & 1);
            if (j > row[mt][hh] || j < row_ds[mt][hh]) pr = 0.f;
          }
          dp[mt][nt][e] = pr * (dp[mt][nt][e] - delta[mt][hh]);  // dS
        }

    // dQ += dS K.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], dp[mt][2 * kc], dp[mt][2 * kc + 1]);
#pragma unroll
      for (int dpair = 0; dpair < D / 16; ++dpair) {
        uint32_t b[4];
        load_b_kn<D>(b, k_tile, kc * 16, dpair * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dq[mt][2 * dpair], a[mt], b[0], b[1]);
          mma_bf16(dq[mt][2 * dpair + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (row[mt][hh] >= p.N) continue;
      bf16* dq_row = p.dq + (int64_t(row[mt][hh]) * p.H + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dq_row + dt * 8 + 2 * t) =
            pack_bf16(dq[mt][dt][2 * hh] * p.scale, dq[mt][dt][2 * hh + 1] * p.scale);
    }
}

// delta[r] = sum_d dout[r, d] * out[r, d] for the N*H rows: one warp per row.
constexpr int kRowWarps = 8;
__global__ void __launch_bounds__(kRowWarps * 32)
    delta_kernel(float* delta, const bf16* dout, const bf16* out, int64_t rows, int D) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const bf16* a = dout + r * D;
  const bf16* b = out + r * D;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += __bfloat162float(a[d]) * __bfloat162float(b[d]);
  acc = warp_sum(acc);
  if (lane == 0) delta[r] = acc;
}

// ---------------------------------------------------------------- generic fallback

// One warp per (token, head); lane owns dims lane, lane + 32, ... (D <= 256). Two
// passes like the CPU reference: logsumexp, then out = sum_j exp(s_j - lse) v_j.
constexpr int kMaxDimPerLane = 8;

__global__ void __launch_bounds__(kRowWarps * 32)
    generic_fwd_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                       const int32_t* doc_start, int N, int H, int KV, int D, float scale) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(N) * H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / H), h = int(r % H), kvh = h / (H / KV);
  float qr[kMaxDimPerLane];
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < D ? __bfloat162float(q[r * D + d]) : 0.f;
  }
  auto score = [&](int j) {
    const bf16* kj = k + (int64_t(j) * KV + kvh) * D;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc += qr[c] * __bfloat162float(kj[d]);
    }
    return warp_sum(acc) * scale;
  };
  const int j0 = doc_start[i];
  float m = -INFINITY, l = 0.f;
  for (int j = j0; j <= i; ++j) {
    const float s = score(j);
    if (s > m) {
      l *= expf(m - s);
      m = s;
    }
    l += expf(s - m);
  }
  const float lse_r = m + logf(l);
  float acc[kMaxDimPerLane] = {};
  for (int j = j0; j <= i; ++j) {
    const float pr = expf(score(j) - lse_r);
    const bf16* vj = v + (int64_t(j) * KV + kvh) * D;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc[c] += pr * __bfloat162float(vj[d]);
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) out[r * D + d] = __float2bfloat16(acc[c]);
  }
  if (lane == 0) lse[r] = lse_r;
}

// dq: one warp per (token, head) over its keys.
__global__ void __launch_bounds__(kRowWarps * 32)
    generic_dq_kernel(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                      const float* lse, const float* delta, const int32_t* doc_start, int N,
                      int H, int KV, int D, float scale) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(N) * H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / H), h = int(r % H), kvh = h / (H / KV);
  float qr[kMaxDimPerLane], dor[kMaxDimPerLane], acc[kMaxDimPerLane] = {};
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < D ? __bfloat162float(q[r * D + d]) : 0.f;
    dor[c] = d < D ? __bfloat162float(dout[r * D + d]) : 0.f;
  }
  const float lse_r = lse[r], delta_r = delta[r];
  for (int j = doc_start[i]; j <= i; ++j) {
    const bf16* kj = k + (int64_t(j) * KV + kvh) * D;
    const bf16* vj = v + (int64_t(j) * KV + kvh) * D;
    float s = 0.f, dpv = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) {
        s += qr[c] * __bfloat162float(kj[d]);
        dpv += dor[c] * __bfloat162float(vj[d]);
      }
    }
    const float pr = expf(warp_sum(s) * scale - lse_r);
    const float ds = pr * (warp_sum(dpv) - delta_r);
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc[c] += ds * __bfloat162float(kj[d]);
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) dq[r * D + d] = __float2bfloat16(acc[c] * scale);
  }
}

// dk, dv: one warp per (key token, kv head) over queries i >= j of its document,
// and the group's heads for each query.
__global__ void __launch_bounds__(kRowWarps * 32)
    generic_dkdv_kernel(bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                        const bf16* v, const float* lse, const float* delta,
                        const int32_t* doc_start, int N, int H, int KV, int D, float scale) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(N) * KV) return;
  const int lane = threadIdx.x & 31;
  const int j = int(r / KV), kvh = int(r % KV), group = H / KV;
  float kr[kMaxDimPerLane], vr[kMaxDimPerLane], dka[kMaxDimPerLane] = {},
      dva[kMaxDimPerLane] = {};
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    kr[c] = d < D ? __bfloat162float(k[r * D + d]) : 0.f;
    vr[c] = d < D ? __bfloat162float(v[r * D + d]) : 0.f;
  }
  for (int i = j; i < N && doc_start[i] <= j; ++i) {
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      const int64_t ih = int64_t(i) * H + h;
      const bf16* qi = q + ih * D;
      const bf16* doi = dout + ih * D;
      float s = 0.f, dpv = 0.f;
#pragma unroll
      for (int c = 0; c < kMaxDimPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) {
          s += kr[c] * __bfloat162float(qi[d]);
          dpv += vr[c] * __bfloat162float(doi[d]);
        }
      }
      const float pr = expf(warp_sum(s) * scale - lse[ih]);
      const float ds = pr * (warp_sum(dpv) - delta[ih]);
#pragma unroll
      for (int c = 0; c < kMaxDimPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) {
          dva[c] += pr * __bfloat162float(doi[d]);
          dka[c] += ds * __bfloat162float(qi[d]);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) {
      dk[r * D + d] = __float2bfloat16(dka[c] * scale);
      dv[r * D + d] = __float2bfloat16(dva[c]);
    }
  }
}

// ---------------------------------------------------------------- launchers

unsigned row_blocks(int64_t rows) { return unsigned((rows + kRowWarps - 1) / kRowWarps); }

template <class Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  // Raising the dynamic shared-memory limit is per function; done once each.
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(bytes)));
}

template <int D, int NWARPS, int MT, int BN>
void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  static const bool configured = (set_smem(fwd_kernel<D, NWARPS, MT, BN>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.H, (p.N + Tile::kBM - 1) / Tile::kBM);
  fwd_kernel<D, NWARPS, MT, BN><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}

template <int D, int NWARPS, int MT, int BMQ>
void launch_dkdv(const BwdParams& p, cudaStream_t stream) {
  using Tile = DkdvTile<D, NWARPS, MT, BMQ>;
  static const bool configured =
      (set_smem(dkdv_kernel<D, NWARPS, MT, BMQ>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.KV, (p.N + Tile::kBNK - 1) / Tile::kBNK);
  dkdv_kernel<D, NWARPS, MT, BMQ><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}

template <int D, int NWARPS, int MT, int BN>
void launch_dq(const BwdParams& p, cudaStream_t stream) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  static const bool configured = (set_smem(dq_kernel<D, NWARPS, MT, BN>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.H, (p.N + Tile::kBM - 1) / Tile::kBM);
  dq_kernel<D, NWARPS, MT, BN><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}

// The tensor-core tiling for (D, kernel choice), -1 when the generic fallback
// runs. Variant 0 is the tuned default; 1..4 are the alternatives the test checks
// and times (tests/gpu/test_attention.cu), kept so a new GPU can be re-tuned.
int variant_for(int64_t D) {
  if (g_kernel == AttentionKernel::kGeneric) return -1;
  if (D != 32 && D != 64 && D != 128) return -1;
  switch (g_kernel) {
    case AttentionKernel::kVariant1: return 1;
    case AttentionKernel::kVariant2: return 2;
    case AttentionKernel::kVariant3: return 3;
    case AttentionKernel::kVariant4: return 4;
    default: return 0;
  }
}

// Forward tilings <D, warps, row tiles per warp, key tile>; keep kFwdNames in step.
// Variant 0 (the default) is the fastest measured on an H100 (2026-11-29, N = 4096,
// one document): D 64 237 TFLOP/s (it spills 92 bytes and still beats the
// spill-free 4w x2 BN64 at 216), D 128 247 TFLOP/s. docs/kernels-attention.md has
// the table for every variant.
template <int D>
void dispatch_fwd(int variant, const FwdParams& p, cudaStream_t stream) {
  if constexpr (D == 128) {
    switch (variant) {
      case 1: return launch_fwd<D, 4, 1, 64>(p, stream);
      case 2: return launch_fwd<D, 8, 1, 64>(p, stream);
      case 3: return launch_fwd<D, 8, 1, 32>(p, stream);
      case 4: return launch_fwd<D, 4, 1, 32>(p, stream);
      default: return launch_fwd<D, 4, 2, 32>(p, stream);
    }
  } else {
    switch (variant) {
      case 1: return launch_fwd<D, 4, 2, 64>(p, stream);
      case 2: return launch_fwd<D, 4, 1, 64>(p, stream);
      case 3: return launch_fwd<D, 4, 2, 32>(p, stream);
      case 4: return launch_fwd<D, 4, 1, 128>(p, stream);
      default: return launch_fwd<D, 4, 2, 128>(p, stream);
    }
  }
}
const char* const kFwdNames128[5] = {"4w x2 BM128 BN32", "4w BM64 BN64", "8w BM128 BN64",
                                     "8w BM128 BN32", "4w BM64 BN32"};
const char* const kFwdNames[5] = {"4w x2 BM128 BN128", "4w x2 BM128 BN64", "4w BM64 BN64",
                                  "4w x2 BM128 BN32", "4w BM64 BN128"};

// Backward tilings: dkdv <D, warps, key tiles per warp, query tile>, dq <D, warps,
// row tiles per warp, key tile>; keep kBwdNames in step. Variant 0 is the fastest
// pair measured (2026-11-29, H100): D 64 164 TFLOP/s, D 128 173 TFLOP/s. Variant 1
// for D 64 pairs that dkdv with the dq tiling ncu measured 23% faster than the 8-warp
// one (dq 4w x2 BN32); the pair itself is not yet timed.
template <int D>
void dispatch_bwd(int variant, const BwdParams& p, cudaStream_t stream) {
  if constexpr (D == 128) {
    switch (variant) {
      case 1: launch_dkdv<D, 4, 1, 32>(p, stream); return launch_dq<D, 4, 1, 64>(p, stream);
      case 2: launch_dkdv<D, 8, 1, 32>(p, stream); return launch_dq<D, 8, 1, 64>(p, stream);
      case 3: launch_dkdv<D, 4, 1, 16>(p, stream); return launch_dq<D, 4, 2, 32>(p, stream);
      case 4: launch_dkdv<D, 2, 1, 32>(p, stream); return launch_dq<D, 4, 2, 16>(p, stream);
      default: launch_dkdv<D, 8, 1, 64>(p, stream); return launch_dq<D, 8, 1, 32>(p, stream);
    }
  } else {
    switch (variant) {
      case 1: launch_dkdv<D, 4, 1, 64>(p, stream); return launch_dq<D, 4, 2, 32>(p, stream);
      case 2: launch_dkdv<D, 8, 1, 64>(p, stream); return launch_dq<D, 8, 1, 64>(p, stream);
      case 3: launch_dkdv<D, 4, 2, 32>(p, stream); return launch_dq<D, 4, 2, 32>(p, stream);
      case 4: launch_dkdv<D, 2, 2, 32>(p, stream); return launch_dq<D, 2, 2, 32>(p, stream);
      default: launch_dkdv<D, 4, 1, 64>(p, stream); return launch_dq<D, 4, 1, 64>(p, stream);
    }
  }
}
const char* const kBwdNames128[5] = {"dkdv 8w BNK128 BMQ64, dq 8w BM128 BN32",
                                     "dkdv 4w BNK64 BMQ32, dq 4w BM64 BN64",
                                     "dkdv 8w BNK128 BMQ32, dq 8w BM128 BN64",
                                     "dkdv 4w BNK64 BMQ16, dq 4w x2 BM128 BN32",
                                     "dkdv 2w BNK32 BMQ32, dq 4w x2 BM128 BN16"};
const char* const kBwdNames[5] = {"dkdv 4w BNK64 BMQ64, dq 4w BM64 BN64",
                                  "dkdv 4w BNK64 BMQ64, dq 4w x2 BM128 BN32",
                                  "dkdv 8w BNK128 BMQ64, dq 8w BM128 BN64",
                                  "dkdv 4w x2 BNK128 BMQ32, dq 4w x2 BM128 BN32",
                                  "dkdv 2w x2 BNK64 BMQ32, dq 2w x2 BM64 BN32"};

void check_shape(int64_t N, int64_t H, int64_t KV, int64_t D) {
  SHARDLM_CHECK(N > 0 && N < INT_MAX / 2, "attention: N = %lld tokens is out of range",
                static_cast<long long>(N));
  SHARDLM_CHECK(KV > 0 && H > 0 && H % KV == 0,
                "attention: num_heads %lld is not a multiple of num_kv_heads %lld",
                static_cast<long long>(H), static_cast<long long>(KV));
  SHARDLM_CHECK(D > 0 && D <= 256, "attention: head_dim %lld is outside [1, 256]",
                static_cast<long long>(D));
  SHARDLM_CHECK(H <= 65535 && KV <= 65535, "attention: %lld heads exceed the grid limit",
                static_cast<long long>(H));
}

// ---------------------------------------------------------------- masked (ring) kernels
//
// Context parallelism's block kernels (attention.hpp, "context parallelism's ring"):
// the tiles and fragments of fwd/dkdv/dq above, with queries and keys in separate
// arrays, the mask from (index, seq) pairs instead of doc_start, fully masked tiles
// skipped from per-16-token bounds, and epilogues that add into fp32 accumulators
// (forward: a log-sum-exp merge) instead of writing bf16.

struct MaskedTokens {
  const int32_t* index;  // (n)
  const int32_t* seq;    // (n)
  const int4* bounds;    // (ceil(n / 16)): min index, max index, min seq, max seq
  int n;
};

MaskedTokens masked_tokens(const AttentionTokens& t) {
  return {t.index, t.seq, reinterpret_cast<const int4*>(t.bounds), int(t.n)};
}

// One thread per run of 16 tokens.
__global__ void tile_bounds_kernel(int4* bounds, const int32_t* index, const int32_t* seq, int n) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r * 16 >= n) return;
  int4 b = make_int4(INT_MAX, INT_MIN, INT_MAX, INT_MIN);
  for (int i = r * 16; i < min(r * 16 + 16, n); ++i) {
    b.x = min(b.x, index[i]), b.y = max(b.y, index[i]);
    b.z = min(b.z, seq[i]), b.w = max(b.w, seq[i]);
  }
  bounds[r] = b;
}

// The bounds of tokens [first, first + count) (first a multiple of 16, clipped to n).
__device__ __forceinline__ int4 span_bounds(const MaskedTokens& t, int first, int count) {
  const int r0 = first >> 4, r1 = (min(first + count, t.n) + 15) >> 4;
  int4 b = t.bounds[r0];
  for (int r = r0 + 1; r < r1; ++r) {
    const int4 x = t.bounds[r];
    b.x = min(b.x, x.x), b.y = max(b.y, x.y), b.z = min(b.z, x.z), b.w = max(b.w, x.w);
  }
  return b;
}
// No key of span k is visible to any query of span q.
__device__ __forceinline__ bool spans_apart(const int4& q, const int4& k) {
  return k.x > q.y || k.w < q.z || k.z > q.w;
}
// Every key of span k is visible to every query of span q (one document, keys first).
__device__ __forceinline__ bool spans_full(const int4& q, const int4& k) {
  return k.y <= q.x && k.z == k.w && q.z == q.w && k.z == q.z;
}

struct MaskedFwdParams {
  float* out_acc;  // (Nq, H, D)
  float* lse_acc;  // (Nq, H)
  const bf16* q;   // (Nq, H, D)
  const bf16* k;   // (Nk, KV, D)
  const bf16* v;   // (Nk, KV, D)
  MaskedTokens qt, kt;
  int H, KV, group;
  float scale_log2;
  bool first;
};

template <int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) masked_fwd_kernel(const MaskedFwdParams p) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sK = sQ + kBM * kSR;                      // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)

  const int h = blockIdx.x;
  const int i0 = (gridDim.y - 1 - blockIdx.y) * kBM;  // later queries see more keys: first
  const int kvh = h / p.group;
  const int Nq = p.qt.n, Nk = p.kt.n;
  const int4 qb = span_bounds(p.qt, i0, kBM);
  const int ntiles = (Nk + BN - 1) / BN;
  // The next key tile from `tile` on that some query of the block can see (every
  // thread computes the same).
  auto next_tile = [&](int tile) {
    while (tile < ntiles && spans_apart(qb, span_bounds(p.kt, tile * BN, BN))) ++tile;
    return tile;
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  const bf16* q_head = p.q + int64_t(h) * D;
  const bf16* k_head = p.k + int64_t(kvh) * D;
  const bf16* v_head = p.v + int64_t(kvh) * D;

  int row[MT][2], row_index[MT][2], row_seq[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = i0 + warp * 16 * MT + mt * 16 + g + 8 * hh;
      row[mt][hh] = r;
      // A padding row (>= Nq) sees no key: key indices are >= 0.
      row_index[mt][hh] = r < Nq ? p.qt.index[r] : -1;
      row_seq[mt][hh] = r < Nq ? p.qt.seq[r] : 0;
    }

  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  int tile = next_tile(0);
  load_tile<kBM, D, Tile::kThreads>(sQ, q_head, q_stride, i0, Nq);
  if (tile < ntiles) {
    load_tile<BN, D, Tile::kThreads>(sK, k_head, kv_stride, tile * BN, Nk);
    load_tile<BN, D, Tile::kThreads>(sV, v_head, kv_stride, tile * BN, Nk);
  }
  cp_async_commit();

  for (int st = 0; tile < ntiles; st ^= 1) {
    const int next = next_tile(tile + 1);
    if (next < ntiles) {
      load_tile<BN, D, Tile::kThreads>(sK + (st ^ 1) * BN * kSR, k_head, kv_stride, next * BN, Nk);
      load_tile<BN, D, Tile::kThreads>(sV + (st ^ 1) * BN * kSR, v_head, kv_stride, next * BN, Nk);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* k_tile = sK + st * BN * kSR;
    const bf16* v_tile = sV + st * BN * kSR;
    const int kt = tile * BN;

    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a<D>(a[mt], sQ, warp * 16 * MT + mt * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, k_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // The online softmax of fwd_kernel; the mask reads the keys' (index, seq).
    const bool need_mask =
        !(i0 + kBM <= Nq && kt + BN <= Nk && spans_full(qb, span_bounds(p.kt, kt, BN)));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float x = s[mt][nt][2 * hh + e2];
            if (need_mask) {
              const int j = kt + nt * 8 + 2 * t + e2;
              if (j >= Nk || p.kt.index[j] > row_index[mt][hh] || p.kt.seq[j] != row_seq[mt][hh])
                x = -INFINITY;
            }
            s[mt][nt][2 * hh + e2] = x;
            mx = fmaxf(mx, x);
          }
        mx = quad_max(mx) * p.scale_log2;
        const float m_new = fmaxf(m[mt][hh], mx);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ex2(m[mt][hh] - base);
        m[mt][hh] = m_new;
        float rowsum = 0.f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const float pr = ex2(fmaf(s[mt][nt][2 * hh + e2], p.scale_log2, -base));
            s[mt][nt][2 * hh + e2] = pr;
            rowsum += pr;
          }
        l[mt][hh] = l[mt][hh] * alpha + rowsum;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[mt][dt][2 * hh] *= alpha;
          o[mt][dt][2 * hh + 1] *= alpha;
        }
      }

#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        load_b_kn<D>(b, v_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_bf16(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled next iteration
    tile = next;
  }
  cp_async_wait<0>();  // the Q tile, when no key tile was visible

  // Merge into the accumulators. The four threads of a quad read a row's lse
  // before any of them writes it (hence two passes around __syncwarp).
  float lse_held[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row[mt][hh];
      lse_held[mt][hh] = (p.first || r >= Nq) ? -INFINITY : p.lse_acc[int64_t(r) * p.H + h];
    }
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l_row = quad_sum(l[mt][hh]);
      const int r = row[mt][hh];
      if (r >= Nq) continue;
      float* acc = p.out_acc + (int64_t(r) * p.H + h) * D;
      float* lse_slot = p.lse_acc + int64_t(r) * p.H + h;
      if (l_row == 0.f) {  // nothing of this block is visible to the row
        if (p.first) {
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<float2*>(acc + dt * 8 + 2 * t) = make_float2(0.f, 0.f);
          if (t == 0) *lse_slot = -INFINITY;
        }
        continue;
      }
      const float lse_block = (m[mt][hh] + log2f(l_row)) * kLn2;
      const float held = lse_held[mt][hh];
      float lse_new = lse_block, keep = 0.f;
      if (held != -INFINITY) {
        const float hi = fmaxf(held, lse_block), lo = fminf(held, lse_block);
        lse_new = hi + log1pf(expf(lo - hi));
        keep = expf(held - lse_new);
      }
      const float take = expf(lse_block - lse_new) / l_row;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        float2* slot = reinterpret_cast<float2*>(acc + dt * 8 + 2 * t);
        float2 x = make_float2(0.f, 0.f);
        if (held != -INFINITY) x = *slot;
        x.x = x.x * keep + o[mt][dt][2 * hh] * take;
        x.y = x.y * keep + o[mt][dt][2 * hh + 1] * take;
        *slot = x;
      }
      if (t == 0) *lse_slot = lse_new;
    }
}

struct MaskedBwdParams {
  float* dq_acc;        // (Nq, H, D)
  float* dk_acc;        // (Nk, KV, D)
  float* dv_acc;        // (Nk, KV, D)
  const bf16* dout;     // (Nq, H, D)
  const bf16* q;        // (Nq, H, D)
  const bf16* k;        // (Nk, KV, D)
  const bf16* v;        // (Nk, KV, D)
  const float* lse;     // (Nq, H)
  const float* delta;   // (Nq, H)
  MaskedTokens qt, kt;
  int H, KV, group;
  float scale;          // 1 / sqrt(D)
  float scale_log2;     // log2(e) / sqrt(D)
};

template <int D, int NWARPS, int MT, int BMQ>
struct MaskedDkdvTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBNK = NWARPS * 16 * MT;
  // K, V tiles; two stages of (Q, dO tiles, lse, delta, index, seq of the queries).
  static constexpr size_t kStageBytes =
      size_t(2 * BMQ) * smem_row<D>() * sizeof(bf16) + 4 * BMQ * sizeof(float);
  static constexpr size_t kSmemBytes =
      size_t(2 * kBNK) * smem_row<D>() * sizeof(bf16) + 2 * kStageBytes;
  static_assert(kStageBytes % 16 == 0, "cp.async needs 16-byte aligned stages");
};

template <int D, int NWARPS, int MT, int BMQ>
__global__ void __launch_bounds__(NWARPS * 32) masked_dkdv_kernel(const MaskedBwdParams p) {
  using Tile = MaskedDkdvTile<D, NWARPS, MT, BMQ>;
  constexpr int kBNK = Tile::kBNK, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // (BNK, D+8)
  bf16* sV = sK + kBNK * kSR;                     // (BNK, D+8)
  unsigned char* stage_base = reinterpret_cast<unsigned char*>(sV + kBNK * kSR);
  auto sQ = [&](int s) { return reinterpret_cast<bf16*>(stage_base + s * Tile::kStageBytes); };
  auto sdO = [&](int s) { return sQ(s) + BMQ * kSR; };
  auto sLse = [&](int s) { return reinterpret_cast<float*>(sdO(s) + BMQ * kSR); };
  auto sDelta = [&](int s) { return sLse(s) + BMQ; };
  auto sIndex = [&](int s) { return reinterpret_cast<int32_t*>(sDelta(s) + BMQ); };
  auto sSeq = [&](int s) { return sIndex(s) + BMQ; };

  const int kvh = blockIdx.x;
  const int j0 = blockIdx.y * kBNK;
  const int Nq = p.qt.n, Nk = p.kt.n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  const int4 kb = span_bounds(p.kt, j0, kBNK);
  const int nq = (Nq + BMQ - 1) / BMQ;
  const int items = p.group * nq;  // (head of the group, query tile), heads outer
  auto next_item = [&](int item) {
    while (item < items && spans_apart(span_bounds(p.qt, (item % nq) * BMQ, BMQ), kb)) ++item;
    return item;
  };

  auto load_item = [&](int item, int s) {
    const int h = kvh * p.group + item / nq;
    const int i_start = (item % nq) * BMQ;
    load_tile<BMQ, D, kT>(sQ(s), p.q + int64_t(h) * D, q_stride, i_start, Nq);
    load_tile<BMQ, D, kT>(sdO(s), p.dout + int64_t(h) * D, q_stride, i_start, Nq);
    for (int c = threadIdx.x; c < BMQ; c += kT) {
      const int i = i_start + c;
      const bool valid = i < Nq;
      const int64_t ih = valid ? int64_t(i) * p.H + h : 0;
      cp_async4(smem_addr(sLse(s) + c), p.lse + ih, valid);
      cp_async4(smem_addr(sDelta(s) + c), p.delta + ih, valid);
      cp_async4(smem_addr(sIndex(s) + c), p.qt.index + (valid ? i : 0), valid);
      cp_async4(smem_addr(sSeq(s) + c), p.qt.seq + (valid ? i : 0), valid);
    }
  };

  int item = next_item(0);
  load_tile<kBNK, D, kT>(sK, p.k + int64_t(kvh) * D, kv_stride, j0, Nk);
  load_tile<kBNK, D, kT>(sV, p.v + int64_t(kvh) * D, kv_stride, j0, Nk);
  if (item < items) load_item(item, 0);
  cp_async_commit();

  float dk[MT][D / 8][4], dv[MT][D / 8][4];
  int key[MT][2], key_index[MT][2], key_seq[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][dt][e] = dv[mt][dt][e] = 0.f;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = j0 + warp * 16 * MT + mt * 16 + g + 8 * hh;
      key[mt][hh] = j;
      // A padding key (>= Nk) is visible to no query: query indices are < INT_MAX.
      key_index[mt][hh] = j < Nk ? p.kt.index[j] : INT_MAX;
      key_seq[mt][hh] = j < Nk ? p.kt.seq[j] : 0;
    }
  }

  for (int st = 0; item < items; st ^= 1) {
    const int next = next_item(item + 1);
    if (next < items) {
      load_item(next, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* q_tile = sQ(st);
    const bf16* do_tile = sdO(st);
    const float* lse_t = sLse(st);
    const float* delta_t = sDelta(st);
    const int32_t* index_t = sIndex(st);
    const int32_t* seq_t = sSeq(st);
    const int i_start = (item % nq) * BMQ;

    float sT[MT][BMQ / 8][4], dpT[MT][BMQ / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BMQ / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sT[mt][nt][e] = dpT[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[MT][4], av[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load_a<D>(ak[mt], sK, warp * 16 * MT + mt * 16, kk * 16);
        load_a<D>(av[mt], sV, warp * 16 * MT + mt * 16, kk * 16);
      }
#pragma unroll
      for (int np = 0; np < BMQ / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, q_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(sT[mt][2 * np], ak[mt], b[0], b[1]);
          mma_bf16(sT[mt][2 * np + 1], ak[mt], b[2], b[3]);
        }
        load_b_nk<D>(b, do_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dpT[mt][2 * np], av[mt], b[0], b[1]);
          mma_bf16(dpT[mt][2 * np + 1], av[mt], b[2], b[3]);
        }
      }
    }

    const bool full = i_start + BMQ <= Nq && j0 + kBNK <= Nk &&
                      spans_full(span_bounds(p.qt, i_start, BMQ), kb);
#pragma unroll
    for (int nt = 0; nt < BMQ / 8; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int qc = nt * 8 + 2 * t + e2;
        const float lse2 = lse_t[qc] * kLog2e, delta_q = delta_t[qc];
        const int i = i_start + qc, index_i = index_t[qc], seq_i = seq_t[qc];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int e = 2 * hh + e2;
            const float pr = ex2(fmaf(sT[mt][nt][e], p.scale_log2, -lse2));
            const bool visible =
                full || (i < Nq && key_index[mt][hh] <= index_i && key_seq[mt][hh] == seq_i);
            const float pv = visible ? pr : 0.f;
            sT[mt][nt][e] = pv;
            dpT[mt][nt][e] = pv * (dpT[mt][nt][e] - delta_q);
          }
      }

#pragma unroll
    for (int kc = 0; kc < BMQ / 16; ++kc) {
      uint32_t ap[MT][4], ads[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc_to_a(ap[mt], sT[mt][2 * kc], sT[mt][2 * kc + 1]);
        acc_to_a(ads[mt], dpT[mt][2 * kc], dpT[mt][2 * kc + 1]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        load_b_kn<D>(b, do_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dv[mt][2 * dp], ap[mt], b[0], b[1]);
          mma_bf16(dv[mt][2 * dp + 1], ap[mt], b[2], b[3]);
        }
        load_b_kn<D>(b, q_tile, kc * 16, dp * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dk[mt][2 * dp], ads[mt], b[0], b[1]);
          mma_bf16(dk[mt][2 * dp + 1], ads[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
    item = next;
  }
  cp_async_wait<0>();  // the K/V tiles, when no query tile was visible

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = key[mt][hh];
      if (j >= Nk) continue;
      const int64_t off = (int64_t(j) * p.KV + kvh) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        float2* dk_slot = reinterpret_cast<float2*>(p.dk_acc + off + dt * 8 + 2 * t);
        float2* dv_slot = reinterpret_cast<float2*>(p.dv_acc + off + dt * 8 + 2 * t);
        float2 a = *dk_slot, b = *dv_slot;
        a.x += dk[mt][dt][2 * hh] * p.scale, a.y += dk[mt][dt][2 * hh + 1] * p.scale;
        b.x += dv[mt][dt][2 * hh], b.y += dv[mt][dt][2 * hh + 1];
        *dk_slot = a, *dv_slot = b;
      }
    }
}

template <int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) masked_dq_kernel(const MaskedBwdParams p) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sdO = sQ + kBM * kSR;                     // (BM, D+8)
  bf16* sK = sdO + kBM * kSR;                     // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)

  const int h = blockIdx.x;
  const int i0 = (gridDim.y - 1 - blockIdx.y) * kBM;
  const int kvh = h / p.group;
  const int Nq = p.qt.n, Nk = p.kt.n;
  const int4 qb = span_bounds(p.qt, i0, kBM);
  const int ntiles = (Nk + BN - 1) / BN;
  auto next_tile = [&](int tile) {
    while (tile < ntiles && spans_apart(qb, span_bounds(p.kt, tile * BN, BN))) ++tile;
    return tile;
  };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  const bf16* k_head = p.k + int64_t(kvh) * D;
  const bf16* v_head = p.v + int64_t(kvh) * D;

  int row[MT][2], row_index[MT][2], row_seq[MT][2];
  float lse2[MT][2], delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = i0 + warp * 16 * MT + mt * 16 + g + 8 * hh;
      const bool valid = r < Nq;
      row[mt][hh] = r;
      row_index[mt][hh] = valid ? p.qt.index[r] : -1;
      row_seq[mt][hh] = valid ? p.qt.seq[r] : 0;
      lse2[mt][hh] = valid ? p.lse[int64_t(r) * p.H + h] * kLog2e : 0.f;
      delta[mt][hh] = valid ? p.delta[int64_t(r) * p.H + h] : 0.f;
    }

  int tile = next_tile(0);
  load_tile<kBM, D, kT>(sQ, p.q + int64_t(h) * D, q_stride, i0, Nq);
  load_tile<kBM, D, kT>(sdO, p.dout + int64_t(h) * D, q_stride, i0, Nq);
  if (tile < ntiles) {
    load_tile<BN, D, kT>(sK, k_head, kv_stride, tile * BN, Nk);
    load_tile<BN, D, kT>(sV, v_head, kv_stride, tile * BN, Nk);
  }
  cp_async_commit();

  float dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[mt][dt][e] = 0.f;

  for (int st = 0; tile < ntiles; st ^= 1) {
    const int next = next_tile(tile + 1);
    if (next < ntiles) {
      load_tile<BN, D, kT>(sK + (st ^ 1) * BN * kSR, k_head, kv_stride, next * BN, Nk);
      load_tile<BN, D, kT>(sV + (st ^ 1) * BN * kSR, v_head, kv_stride, next * BN, Nk);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* k_tile = sK + st * BN * kSR;
    const bf16* v_tile = sV + st * BN * kSR;
    const int kt = tile * BN;

    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[MT][4], ado[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load_a<D>(aq[mt], sQ, warp * 16 * MT + mt * 16, kk * 16);
        load_a<D>(ado[mt], sdO, warp * 16 * MT + mt * 16, kk * 16);
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        load_b_nk<D>(b, k_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][2 * np], aq[mt], b[0], b[1]);
          mma_bf16(s[mt][2 * np + 1], aq[mt], b[2], b[3]);
        }
        load_b_nk<D>(b, v_tile, np * 16, kk * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dp[mt][2 * np], ado[mt], b[0], b[1]);
          mma_bf16(dp[mt][2 * np + 1], ado[mt], b[2], b[3]);
        }
      }
    }

    const bool need_mask =
        !(i0 + kBM <= Nq && kt + BN <= Nk && spans_full(qb, span_bounds(p.kt, kt, BN)));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          float pr = ex2(fmaf(s[mt][nt][e], p.scale_log2, -lse2[mt][hh]));
          if (need_mask) {
            const int j = kt + nt * 8 + 2 * t + (e & 1);
            if (j >= Nk || p.kt.index[j] > row_index[mt][hh] || p.kt.seq[j] != row_seq[mt][hh])
              pr = 0.f;
          }
          dp[mt][nt][e] = pr * (dp[mt][nt][e] - delta[mt][hh]);  // dS
        }

#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], dp[mt][2 * kc], dp[mt][2 * kc + 1]);
#pragma unroll
      for (int dpair = 0; dpair < D / 16; ++dpair) {
        uint32_t b[4];
        load_b_kn<D>(b, k_tile, kc * 16, dpair * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dq[mt][2 * dpair], a[mt], b[0], b[1]);
          mma_bf16(dq[mt][2 * dpair + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
    tile = next;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (row[mt][hh] >= Nq) continue;
      float* dq_row = p.dq_acc + (int64_t(row[mt][hh]) * p.H + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        float2* slot = reinterpret_cast<float2*>(dq_row + dt * 8 + 2 * t);
        float2 x = *slot;
        x.x += dq[mt][dt][2 * hh] * p.scale, x.y += dq[mt][dt][2 * hh + 1] * p.scale;
        *slot = x;
      }
    }
}

// ---- generic masked fallback: one warp per row, fp32 dot products, any D <= 256.

__device__ __forceinline__ bool masked_visible(const MaskedTokens& kt, int j, int q_index, int q_seq) {
  return kt.index[j] <= q_index && kt.seq[j] == q_seq;
}
// Whether run r (16 tokens) of kt may hold a key visible to a query (index, seq).
__device__ __forceinline__ bool run_reaches(const MaskedTokens& kt, int r, int q_index, int q_seq) {
  const int4 b = kt.bounds[r];
  return b.x <= q_index && b.z <= q_seq && q_seq <= b.w;
}

__global__ void __launch_bounds__(kRowWarps * 32)
    generic_masked_fwd_kernel(const MaskedFwdParams p, int D, float scale) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.qt.n) * p.H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / p.H), h = int(r % p.H), kvh = h / p.group;
  const int qi_index = p.qt.index[i], qi_seq = p.qt.seq[i];
  float qr[kMaxDimPerLane];
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < D ? __bfloat162float(p.q[r * D + d]) : 0.f;
  }
  auto score = [&](int j) {
    const bf16* kj = p.k + (int64_t(j) * p.KV + kvh) * D;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDimPerLane; ++c) {
      const int d = lane + 32 * c;
      if (d < D) acc += qr[c] * __bfloat162float(kj[d]);
    }
    return warp_sum(acc) * scale;
  };
  const int runs = (p.kt.n + 15) / 16;
  float m = -INFINITY, l = 0.f;
  for (int run = 0; run < runs; ++run) {
    if (!run_reaches(p.kt, run, qi_index, qi_seq)) continue;
    for (int j = run * 16; j < min(run * 16 + 16, p.kt.n); ++j) {
      if (!masked_visible(p.kt, j, qi_index, qi_seq)) continue;
      const float s = score(j);
      if (s > m) {
        l *= expf(m - s);
        m = s;
      }
      l += expf(s - m);
    }
  }
  float* acc_row = p.out_acc + r * D;
  const float held = p.first ? -INFINITY : p.lse_acc[r];
  __syncwarp();
  if (l == 0.f) {
    if (p.first) {
      for (int d = lane; d < D; d += 32) acc_row[d] = 0.f;
      if (lane == 0) p.lse_acc[r] = -INFINITY;
    }
    return;
  }
  const float lse_block = m + logf(l);
  float lse_new = lse_block, keep = 0.f;
  if (held != -INFINITY) {
    const float hi = fmaxf(held, lse_block), lo = fminf(held, lse_block);
    lse_new = hi + log1pf(expf(lo - hi));
    keep = expf(held - lse_new);
  }
  float acc[kMaxDimPerLane] = {};
  for (int run = 0; run < runs; ++run) {
    if (!run_reaches(p.kt, run, qi_index, qi_seq)) continue;
    for (int j = run * 16; j < min(run * 16 + 16, p.kt.n); ++j) {
      if (!masked_visible(p.kt, j, qi_index, qi_seq)) continue;
      const float pr = expf(score(j) - lse_new);
      const bf16* vj = p.v + (int64_t(j) * p.KV + kvh) * D;
#pragma unroll
      for (int c = 0; c < kMaxDimPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) acc[c] += pr * __bfloat162float(vj[d]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) acc_row[d] = (held != -INFINITY ? acc_row[d] * keep : 0.f) + acc[c];
  }
  if (lane == 0) p.lse_acc[r] = lse_new;
}

__global__ void __launch_bounds__(kRowWarps * 32)
    generic_masked_dq_kernel(const MaskedBwdParams p, int D) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.qt.n) * p.H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / p.H), h = int(r % p.H), kvh = h / p.group;
  const int qi_index = p.qt.index[i], qi_seq = p.qt.seq[i];
  float qr[kMaxDimPerLane], dor[kMaxDimPerLane], acc[kMaxDimPerLane] = {};
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < D ? __bfloat162float(p.q[r * D + d]) : 0.f;
    dor[c] = d < D ? __bfloat162float(p.dout[r * D + d]) : 0.f;
  }
  const float lse_r = p.lse[r], delta_r = p.delta[r];
  const int runs = (p.kt.n + 15) / 16;
  for (int run = 0; run < runs; ++run) {
    if (!run_reaches(p.kt, run, qi_index, qi_seq)) continue;
    for (int j = run * 16; j < min(run * 16 + 16, p.kt.n); ++j) {
      if (!masked_visible(p.kt, j, qi_index, qi_seq)) continue;
      const bf16* kj = p.k + (int64_t(j) * p.KV + kvh) * D;
      const bf16* vj = p.v + (int64_t(j) * p.KV + kvh) * D;
      float s = 0.f, dpv = 0.f;
#pragma unroll
      for (int c = 0; c < kMaxDimPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) {
          s += qr[c] * __bfloat162float(kj[d]);
          dpv += dor[c] * __bfloat162float(vj[d]);
        }
      }
      const float pr = expf(warp_sum(s) * p.scale - lse_r);
      const float ds = pr * (warp_sum(dpv) - delta_r);
#pragma unroll
      for (int c = 0; c < kMaxDimPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) acc[c] += ds * __bfloat162float(kj[d]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) p.dq_acc[r * D + d] += acc[c] * p.scale;
  }
}

__global__ void __launch_bounds__(kRowWarps * 32)
    generic_masked_dkdv_kernel(const MaskedBwdParams p, int D) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.kt.n) * p.KV) return;
  const int lane = threadIdx.x & 31;
  const int j = int(r / p.KV), kvh = int(r % p.KV);
  const int kj_index = p.kt.index[j], kj_seq = p.kt.seq[j];
  float kr[kMaxDimPerLane], vr[kMaxDimPerLane], dka[kMaxDimPerLane] = {}, dva[kMaxDimPerLane] = {};
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    kr[c] = d < D ? __bfloat162float(p.k[r * D + d]) : 0.f;
    vr[c] = d < D ? __bfloat162float(p.v[r * D + d]) : 0.f;
  }
  const int runs = (p.qt.n + 15) / 16;
  for (int run = 0; run < runs; ++run) {
    const int4 b = p.qt.bounds[run];
    if (b.y < kj_index || kj_seq < b.z || kj_seq > b.w) continue;
    for (int i = run * 16; i < min(run * 16 + 16, p.qt.n); ++i) {
      if (!masked_visible(p.kt, j, p.qt.index[i], p.qt.seq[i])) continue;
      for (int h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
        const int64_t ih = int64_t(i) * p.H + h;
        const bf16* qi = p.q + ih * D;
        const bf16* doi = p.dout + ih * D;
        float s = 0.f, dpv = 0.f;
#pragma unroll
        for (int c = 0; c < kMaxDimPerLane; ++c) {
          const int d = lane + 32 * c;
          if (d < D) {
            s += kr[c] * __bfloat162float(qi[d]);
            dpv += vr[c] * __bfloat162float(doi[d]);
          }
        }
        const float pr = expf(warp_sum(s) * p.scale - p.lse[ih]);
        const float ds = pr * (warp_sum(dpv) - p.delta[ih]);
#pragma unroll
        for (int c = 0; c < kMaxDimPerLane; ++c) {
          const int d = lane + 32 * c;
          if (d < D) {
            dva[c] += pr * __bfloat162float(doi[d]);
            dka[c] += ds * __bfloat162float(qi[d]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) {
      p.dk_acc[r * D + d] += dka[c] * p.scale;
      p.dv_acc[r * D + d] += dva[c];
    }
  }
}

// One tiling per D for the ring's kernels: the tuned defaults' shapes where they do
// not spill (fwd D 64 takes BN 64, the spill-free one of docs/kernels-attention.md).
template <int D, int NWARPS, int MT, int BN>
void launch_masked_fwd(const MaskedFwdParams& p, cudaStream_t stream) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  static const bool configured =
      (set_smem(masked_fwd_kernel<D, NWARPS, MT, BN>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.H, (p.qt.n + Tile::kBM - 1) / Tile::kBM);
  masked_fwd_kernel<D, NWARPS, MT, BN><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}
template <int D, int NWARPS, int MT, int BMQ>
void launch_masked_dkdv(const MaskedBwdParams& p, cudaStream_t stream) {
  using Tile = MaskedDkdvTile<D, NWARPS, MT, BMQ>;
  static const bool configured =
      (set_smem(masked_dkdv_kernel<D, NWARPS, MT, BMQ>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.KV, (p.kt.n + Tile::kBNK - 1) / Tile::kBNK);
  masked_dkdv_kernel<D, NWARPS, MT, BMQ><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}
template <int D, int NWARPS, int MT, int BN>
void launch_masked_dq(const MaskedBwdParams& p, cudaStream_t stream) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  static const bool configured =
      (set_smem(masked_dq_kernel<D, NWARPS, MT, BN>, Tile::kSmemBytes), true);
  (void)configured;
  const dim3 grid(p.H, (p.qt.n + Tile::kBM - 1) / Tile::kBM);
  masked_dq_kernel<D, NWARPS, MT, BN><<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
}

void check_masked_shape(const AttentionTokens& queries, const AttentionTokens& keys, int64_t H,
                        int64_t KV, int64_t D) {
  check_shape(std::max<int64_t>(1, queries.n), H, KV, D);
  check_shape(std::max<int64_t>(1, keys.n), H, KV, D);
  SHARDLM_CHECK(queries.index && queries.seq && queries.bounds && keys.index && keys.seq && keys.bounds,
                "internal: masked attention without token indices, seq_ids or tile bounds");
}

}  // namespace

void attention_doc_start(int32_t* doc_start, const int32_t* seq_id, int64_t N,
                         cudaStream_t stream) {
  doc_start_kernel<<<1, kScanThreads, 0, stream>>>(doc_start, seq_id, int(N));
  CUDA_CHECK(cudaGetLastError());
}

void attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* v,
                       const int32_t* seq_id, int32_t* doc_start_scratch, int64_t N,
                       int64_t H, int64_t KV, int64_t D, cudaStream_t stream) {
  check_shape(N, H, KV, D);
  attention_doc_start(doc_start_scratch, seq_id, N, stream);
  const int variant = variant_for(D);
  if (variant < 0) {
    generic_fwd_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(
        out, lse, q, k, v, doc_start_scratch, int(N), int(H), int(KV), int(D),
        float(1.0 / std::sqrt(double(D))));
  } else {
    const FwdParams p{out, lse, q, k, v, doc_start_scratch, int(N), int(H), int(KV),
                      int(H / KV), float(1.4426950408889634 / std::sqrt(double(D)))};
    if (D == 32) dispatch_fwd<32>(variant, p, stream);
    else if (D == 64) dispatch_fwd<64>(variant, p, stream);
    else dispatch_fwd<128>(variant, p, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

size_t attention_backward_scratch_bytes(int64_t N, int64_t H, int64_t /*KV*/, int64_t /*D*/) {
  return size_t(N) * size_t(H) * sizeof(float);
}

void attention_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                        const __nv_bfloat16* dout, const __nv_bfloat16* q,
                        const __nv_bfloat16* k, const __nv_bfloat16* v,
                        const __nv_bfloat16* out, const float* lse,
                        const int32_t* seq_id, int32_t* doc_start_scratch,
                        float* delta_scratch, int64_t N, int64_t H, int64_t KV,
                        int64_t D, cudaStream_t stream) {
  check_shape(N, H, KV, D);
  attention_doc_start(doc_start_scratch, seq_id, N, stream);
  delta_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(delta_scratch, dout, out,
                                                                 N * H, int(D));
  CUDA_CHECK(cudaGetLastError());
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int variant = variant_for(D);
  if (variant < 0) {
    generic_dq_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(
        dq, dout, q, k, v, lse, delta_scratch, doc_start_scratch, int(N), int(H), int(KV),
        int(D), scale);
    CUDA_CHECK(cudaGetLastError());
    generic_dkdv_kernel<<<row_blocks(N * KV), kRowWarps * 32, 0, stream>>>(
        dk, dv, dout, q, k, v, lse, delta_scratch, doc_start_scratch, int(N), int(H),
        int(KV), int(D), scale);
  } else {
    const BwdParams p{dq, dk, dv, dout, q, k, v, lse, delta_scratch, doc_start_scratch,
                      int(N), int(H), int(KV), int(H / KV), scale,
                      float(1.4426950408889634 / std::sqrt(double(D)))};
    if (D == 32) dispatch_bwd<32>(variant, p, stream);
    else if (D == 64) dispatch_bwd<64>(variant, p, stream);
    else dispatch_bwd<128>(variant, p, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

size_t attention_tile_bounds_bytes(int64_t n) { return size_t((n + 15) / 16) * 4 * sizeof(int32_t); }

void attention_tile_bounds(int32_t* bounds, const int32_t* index, const int32_t* seq, int64_t n,
                           cudaStream_t stream) {
  const int64_t runs = (n + 15) / 16;
  if (runs == 0) return;
  tile_bounds_kernel<<<unsigned((runs + 127) / 128), 128, 0, stream>>>(reinterpret_cast<int4*>(bounds),
                                                                       index, seq, int(n));
  CUDA_CHECK(cudaGetLastError());
}

void attention_masked_forward(float* out_acc, float* lse_acc, bool first, const __nv_bfloat16* q,
                              const AttentionTokens& queries, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const AttentionTokens& keys, int64_t H,
                              int64_t KV, int64_t D, cudaStream_t stream) {
  check_masked_shape(queries, keys, H, KV, D);
  if (queries.n == 0) return;
  const MaskedFwdParams p{out_acc, lse_acc, q, k, v, masked_tokens(queries), masked_tokens(keys),
                          int(H), int(KV), int(H / KV),
                          float(1.4426950408889634 / std::sqrt(double(D))), first};
  const int variant = variant_for(D);
  if (variant < 0 || D == 32) {
    generic_masked_fwd_kernel<<<row_blocks(queries.n * H), kRowWarps * 32, 0, stream>>>(
        p, int(D), float(1.0 / std::sqrt(double(D))));
  } else if (D == 64) {
    launch_masked_fwd<64, 4, 2, 64>(p, stream);
  } else {
    launch_masked_fwd<128, 4, 2, 32>(p, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

void attention_masked_delta(float* delta, const __nv_bfloat16* dout, const __nv_bfloat16* out,
                            int64_t N, int64_t H, int64_t D, cudaStream_t stream) {
  if (N == 0) return;
  delta_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(delta, dout, out, N * H, int(D));
  CUDA_CHECK(cudaGetLastError());
}

void attention_masked_backward(float* dq_acc, float* dk_acc, float* dv_acc,
                               const __nv_bfloat16* dout, const __nv_bfloat16* q,
                               const float* lse, const float* delta,
                               const AttentionTokens& queries, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const AttentionTokens& keys, int64_t H,
                               int64_t KV, int64_t D, cudaStream_t stream) {
  check_masked_shape(queries, keys, H, KV, D);
  if (queries.n == 0 || keys.n == 0) return;
  const MaskedBwdParams p{dq_acc, dk_acc, dv_acc, dout, q, k, v, lse, delta,
                          masked_tokens(queries), masked_tokens(keys), int(H), int(KV), int(H / KV),
                          float(1.0 / std::sqrt(double(D))),
                          float(1.4426950408889634 / std::sqrt(double(D)))};
  const int variant = variant_for(D);
  SHARDLM_CHECK((dk_acc == nullptr) == (dv_acc == nullptr),
                "internal: masked attention backward with one of dk and dv");
  if (dk_acc) {
    if (variant < 0 || D == 32)
      generic_masked_dkdv_kernel<<<row_blocks(keys.n * KV), kRowWarps * 32, 0, stream>>>(p, int(D));
    else if (D == 64) launch_masked_dkdv<64, 4, 1, 64>(p, stream);
    else launch_masked_dkdv<128, 8, 1, 64>(p, stream);
    CUDA_CHECK(cudaGetLastError());
  }
  if (dq_acc) {
    if (variant < 0 || D == 32)
      generic_masked_dq_kernel<<<row_blocks(queries.n * H), kRowWarps * 32, 0, stream>>>(p, int(D));
    else if (D == 64) launch_masked_dq<64, 4, 1, 64>(p, stream);
    else launch_masked_dq<128, 8, 1, 32>(p, stream);
    CUDA_CHECK(cudaGetLastError());
  }
}

void attention_set_kernel(AttentionKernel kernel) { g_kernel = kernel; }

const char* attention_kernel_name(int64_t D) {
  static thread_local std::string name;
  const int variant = variant_for(D);
  if (variant < 0) {
    name = "generic (warp per row, fp32 dot products)";
  } else {
    name = std::string("fwd ") + (D == 128 ? kFwdNames128 : kFwdNames)[variant] + " | " +
           (D == 128 ? kBwdNames128 : kBwdNames)[variant];
  }
  return name.c_str();
}

}  // namespace shardlm::cuda
