// attention_kernels.cuh — the bodies of shardlm's flash attention kernels, forward
// and backward, causal and GQA, shared by the one-rank passes (attention.cu:
// DocumentMask, StoreOutput, StoreGrads) and context parallelism's block passes
// (ring_attention.cu: RingMask, MergeOutput, AddGrads); each of the two files
// instantiates them with its own policies and tilings. Private to those two files.
// Everything is in an anonymous namespace: each file compiles its own instantiations
// (the kernels are not linked across files), and its host stubs stay its own.
//
// One kernel body per pass, each a template over a parameter block that carries a
// mask policy and an output policy (all deterministic, none uses atomics):
//   fwd_kernel         FlashAttention-2 forward: a block owns BM queries of one head,
//                      walks the key tiles its mask lets it see, online softmax in fp32
//                      registers, O accumulated by mma.sync.
//   dkdv_kernel        a block owns BNK keys of one kv head; it sums over the group's
//                      query heads (in order) and their query tiles (in order).
//   dq_kernel          a block owns BM queries of one head; walks key tiles like
//                      forward (recomputes P and dP: 7 matrix products instead of 5,
//                      the price of no atomics).
//   generic_*_kernel   the same three passes, one warp per row, fp32 dot products: any
//                      D <= 256, slow.
// Beside them: delta_kernel (delta = rowsum(dout * out) (N, H) fp32), the launchers
// (launch_fwd, launch_dkdv, launch_dq) and the shape checks both files make.
//
// Policies are compile-time: each instantiation has the inner loops of a
// hand-written kernel for its case. What a mask policy must give is listed under
// "mask policies" below; an output policy gives hold / put_row / finish_row
// (forward) or put_q / put_kv (backward: a pair of columns from the mma kernels,
// one from the generic kernels, at element offset `off`).
//
// Tensor-core tiles: mma.sync.m16n8k16 bf16 -> fp32. Operands come from shared
// memory through ldmatrix (rows padded by 16 bytes so the 8 row addresses of an
// 8x8 matrix hit distinct banks); P and dS go from the fp32 accumulators straight
// into A fragments (the accumulator layout of two n8 tiles is the A layout of one
// k16 slice). Tiles are loaded with cp.async, two stages deep. A warp owns MT
// tiles of 16 rows (MT = 2 halves the B-fragment reads from shared memory per mma).
// Templates: <parameters, D, warps per block, MT, tile length>.
//
// Fragment layouts used below (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8,  col): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <utility>

#include "cuda/check.hpp"
#include "cuda/kernel_common.cuh"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

// The tensor-core tiling attention_set_kernel chose for head dim D (attention.cu):
// 0 the tuned default, 1..4 the alternatives, -1 when the generic kernels run.
int attention_variant(int64_t D);

namespace {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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
using dev::warp_sum;  // kernel_common.cuh's butterfly

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

// The two-stage pipeline's step: start loading the next stage (`load`, when there is
// one) and wait for the current one.
template <class Load>
__device__ __forceinline__ void next_stage(bool has_next, Load&& load) {
  if (has_next) {
    load();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
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
// acc[mt] (n8 tiles 2np and 2np+1) += a[mt] * b, for each of a warp's MT row tiles:
// each B fragment feeds MT row tiles.
template <int MT, int NT>
__device__ __forceinline__ void mma_rows(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], int np,
                                         const uint32_t (&b)[4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
    mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
  }
}
// Every element of a (nested) float array = 0.
template <int N>
__device__ __forceinline__ void zero(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = 0.f;
}
template <int N, class T, int M>
__device__ __forceinline__ void zero(T (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) zero(x[i]);
}

// f(mt, hh) for each row a thread holds: rows g and g + 8 (hh) of each of its
// warp's MT row tiles, in order.
template <int MT, class F>
__device__ __forceinline__ void for_each_row(F&& f) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) f(mt, hh);
}

// acc[x] += A_x B_x for each of NP products, over KS k16 slices: per slice, the
// A fragments first (a_frag(af, x, mt, ks) fills af for row tile mt of product x),
// then for each n16 pair np the B fragments (b_frag(bf, x, ks, np)), each feeding
// the warp's MT row tiles.
template <int KS, int NP, int MT, int NT, class AFrag, class BFrag>
__device__ __forceinline__ void mma_products(float (&acc)[NP][MT][NT][4], AFrag&& a_frag, BFrag&& b_frag) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t af[NP][MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int x = 0; x < NP; ++x) a_frag(af[x][mt], x, mt, ks);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np)
#pragma unroll
      for (int x = 0; x < NP; ++x) {
        uint32_t bf[4];
        b_frag(bf, x, ks, np);
        mma_rows(acc[x], af[x], np, bf);
      }
  }
}
// acc[x] += A_x B_x^T, k < D: A_x the warp's MT row tiles (rows row0 + 16 mt) of the
// shared tile a_x, B_x(k, n) = b_x[n][k] (K in Q K^T). NP = 1 or 2 products (a0, b0
// and a1, b1).
template <int D, int NP, int MT, int NT>
__device__ __forceinline__ void mma_smem_nk(float (&acc)[NP][MT][NT][4], int row0, const bf16* a0, const bf16* b0,
                                            const bf16* a1 = nullptr, const bf16* b1 = nullptr) {
  mma_products<D / 16>(
      acc, [&](uint32_t(&af)[4], int x, int mt, int kk) { load_a<D>(af, x ? a1 : a0, row0 + mt * 16, kk * 16); },
      [&](uint32_t(&bf)[4], int x, int kk, int np) { load_b_nk<D>(bf, x ? b1 : b0, np * 16, kk * 16); });
}
// acc[x] (MT row tiles x D columns) += P_x B_x: P_x the warp's fp32 accumulators
// (MT x KT n8 tiles) rounded to bf16 A fragments (as FlashAttention rounds P and
// dS), B_x(k, n) = b_x[k][n] (V in P V).
template <int D, int NP, int MT, int KT>
__device__ __forceinline__ void mma_acc_kn(float (&acc)[NP][MT][D / 8][4], const float (&pm)[NP][MT][KT][4],
                                           const bf16* b0, const bf16* b1 = nullptr) {
  mma_products<KT / 2>(
      acc, [&](uint32_t(&af)[4], int x, int mt, int kc) { acc_to_a(af, pm[x][mt][2 * kc], pm[x][mt][2 * kc + 1]); },
      [&](uint32_t(&bf)[4], int x, int kc, int dp) { load_b_kn<D>(bf, x ? b1 : b0, kc * 16, dp * 16); });
}
// One product on a single accumulator.
template <int MT, int NT>
using Acc1 = float[1][MT][NT][4];
template <int D, int MT, int NT>
__device__ __forceinline__ void mma_smem_nk(float (&acc)[MT][NT][4], int row0, const bf16* a, const bf16* b) {
  mma_smem_nk<D>(reinterpret_cast<Acc1<MT, NT>&>(acc), row0, a, b);
}
template <int D, int MT, int KT>
__device__ __forceinline__ void mma_acc_kn(float (&acc)[MT][D / 8][4], const float (&pm)[MT][KT][4], const bf16* b) {
  mma_acc_kn<D>(reinterpret_cast<Acc1<MT, D / 8>&>(acc), reinterpret_cast<const Acc1<MT, KT>&>(pm), b);
}

// ---------------------------------------------------------------- mask policies
//
// What a mask policy gives the kernels:
//   Query, Key          what the visibility test needs of a query or a key token;
//   query(i)            that of query token i; query_or_none(i) and key_or_none(j)
//                       the same where i or j may be padding past the end of its array
//                       (padding sees, or is seen by, nothing);
//   allowed(q, k)       key k is visible to query q (dkdv, per element);
//   if_sees(q, j, x, hidden)  x if key token j, anywhere in a key tile, is visible
//                       to query q, else hidden (fwd and dq, per element);
//   key_tiles(i0, bm, bn)  the key tiles a block of queries walks (fwd, dq): tile t
//                       starts at key first_key + t * bn, t < count; first() and
//                       from(t) give the first tile at or after t that may hold a
//                       visible key; needs_mask(kt): some key of the tile starting at
//                       kt is hidden from some query of the block;
//   query_tiles(j0, bnk, bmq, group)  the same for the (head, query tile) items a block
//                       of keys walks (dkdv): item i's tile starts at query
//                       first_query + (i % per_head) * bmq, i < items; full(start,
//                       staged): every query of the tile sees every key of the block;
//   Cursor              a walk's position: the tile (or item) and its pipeline stage;
//   stage_query(), staged_query()  the kQueryInts int32 arrays per query that dkdv
//                       stages in shared memory beside each Q tile;
//   for_each_key(q, f), for_each_query(j, f)  the generic kernels' walk, in order;
//   kMayBeEmpty         a block may have no tile to walk at all.
// The expressions are written as the kernels' inner loops want them: small structs
// by value, a member read before a short circuit rather than in it, a per-element
// test that returns the value (a bool returned across a short circuit with loads
// comes back as a byte and costs branches), so each instantiation compiles to the
// inner loops of a hand-written kernel (ptxas counts in docs/kernels-attention.md).

// ---------------------------------------------------------------- output policies

// The generic kernels' rows: a lane owns dims lane, lane + 32, ... (D <= 256).
constexpr int kMaxDimPerLane = 8;
using LaneDims = float[kMaxDimPerLane];
// f(c, d) for each of the lane's dims d = lane + 32 c below D.
template <class F>
__device__ __forceinline__ void for_lane_dims(int lane, int D, F&& f) {
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    if (d < D) f(c, d);
  }
}

// ---------------------------------------------------------------- parameters

template <class MaskPolicy, class OutputPolicy>
struct FwdParams {
  using Mask = MaskPolicy;
  using Output = OutputPolicy;
  Output out;
  const bf16* q;  // (Nq, H, D)
  const bf16* k;  // (Nk, KV, D)
  const bf16* v;  // (Nk, KV, D)
  Mask mask;
  int H, KV, group;
  float scale_log2;  // log2(e) / sqrt(D)
};

template <class MaskPolicy, class GradsPolicy>
struct BwdParams {
  using Mask = MaskPolicy;
  GradsPolicy grads;   // dq (Nq, H, D); dk, dv (Nk, KV, D)
  const bf16* dout;    // (Nq, H, D)
  const bf16* q;       // (Nq, H, D)
  const bf16* k;       // (Nk, KV, D)
  const bf16* v;       // (Nk, KV, D)
  const float* lse;    // (Nq, H)
  const float* delta;  // (Nq, H)
  Mask mask;
  int H, KV, group;
  float scale;       // 1 / sqrt(D)
  float scale_log2;  // log2(e) / sqrt(D)
};

// ---------------------------------------------------------------- the mma kernels

// A block of BM queries of one head walking key tiles of BN (fwd, dq): where it
// is, and the K/V pipeline. (Scalars only: the row arrays stay in the kernels,
// which keeps them in registers.)
template <class Params, int D, int MT, int BM, int BN, int NTHREADS>
struct QueryBlock {
  using Mask = typename Params::Mask;
  int h, i0, kvh, n_queries, n_keys;
  decltype(std::declval<const Mask&>().key_tiles(0, 0, 0)) tiles;
  int warp, g, t;
  int64_t q_stride, kv_stride;

  // Blocks of later queries see more keys: they are launched first.
  __device__ __forceinline__ explicit QueryBlock(const Params& p)
      : h(blockIdx.x),
        i0((gridDim.y - 1 - blockIdx.y) * BM),
        kvh(h / p.group),
        n_queries(p.mask.num_queries()),
        n_keys(p.mask.num_keys()),
        tiles(p.mask.key_tiles(i0, BM, BN)) {
    const int lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  }
  // Warp w owns rows w*16*MT + mt*16 + {g, g+8} of the block (mt < MT); the query
  // index of the thread's row (mt, hh), >= n_queries for padding.
  __device__ __forceinline__ int row(int mt, int hh) const { return i0 + warp * 16 * MT + mt * 16 + g + 8 * hh; }

  // The key tiles the mask lets the block see, K and V two stages deep in sK and sV
  // (each 2 x (BN, D+8)): body(k_tile, v_tile, kt, needs_mask) for each, kt its
  // first key, needs_mask() whether some of its keys are hidden from some of the
  // block's queries (forward asks after its product, dq before its two: where each
  // keeps its registers lowest). The caller's own tile loads (Q, dO) are committed
  // with the first K/V tile.
  template <class Body>
  __device__ __forceinline__ void walk(const Params& p, bf16* sK, bf16* sV, Body&& body) const {
    constexpr int kSR = smem_row<D>();
    const bf16* k_head = p.k + int64_t(kvh) * D;
    const bf16* v_head = p.v + int64_t(kvh) * D;
    const int kv_begin = tiles.first_key, ntiles = tiles.count;  // tile t starts at key kv_begin + t * BN
    auto load_kv = [&](int tile, int s) {
      load_tile<BN, D, NTHREADS>(sK + s * BN * kSR, k_head, kv_stride, kv_begin + tile * BN, n_keys);
      load_tile<BN, D, NTHREADS>(sV + s * BN * kSR, v_head, kv_stride, kv_begin + tile * BN, n_keys);
    };
    auto at = tiles.first();
    if (!Mask::kMayBeEmpty || at.tile < ntiles) load_kv(at.tile, 0);
    cp_async_commit();
    while (at.tile < ntiles) {
      const int st = at.stage(), next = tiles.from(at.tile + 1);
      next_stage(next < ntiles, [&] { load_kv(next, st ^ 1); });
      const int kt = kv_begin + at.tile * BN;
      body(sK + st * BN * kSR, sV + st * BN * kSR, kt, [&] { return tiles.needs_mask(kt); });
      __syncthreads();  // this stage is refilled next iteration
      at.advance(next);
    }
    if constexpr (Mask::kMayBeEmpty) cp_async_wait<0>();  // the caller's tiles, when no key tile was visible
  }
};

template <int D, int NWARPS, int MT, int BN>
struct FwdTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBM = NWARPS * 16 * MT;  // queries per block
  static constexpr size_t kSmemBytes = size_t(kBM + 4 * BN) * smem_row<D>() * sizeof(bf16);
};

// MT = 2 halves the shared-memory reads per mma (each K/V fragment feeds two row
// tiles).
template <class Params, int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) fwd_kernel(const Params p) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sK = sQ + kBM * kSR;                      // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)
  const QueryBlock<Params, D, MT, kBM, BN, Tile::kThreads> blk(p);
  const int warp = blk.warp, t = blk.t;
  int row[MT][2];
  typename Params::Mask::Query query[MT][2];
  for_each_row<MT>([&](int mt, int hh) {
    row[mt][hh] = blk.row(mt, hh);
    query[mt][hh] = p.mask.query_or_none(row[mt][hh]);
  });

  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
  zero(o);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  load_tile<kBM, D, Tile::kThreads>(sQ, p.q + int64_t(blk.h) * D, blk.q_stride, blk.i0, blk.n_queries);
  blk.walk(p, sK, sV, [&](const bf16* k_tile, const bf16* v_tile, int kt, auto&& needs_mask) {
    // S = Q K^T (fp32).
    float s[MT][BN / 8][4];
    zero(s);
    mma_smem_nk<D>(s, warp * 16 * MT, sQ, k_tile);
    // Mask (only tiles with a hidden key need it: one uniform branch around the
    // whole pass), then the online softmax in the log2 domain: m is the running max
    // of the scaled scores, p = exp2(s * scale_log2 - m) in one FFMA. A row with no
    // visible key yet keeps m = -inf and subtracts 0 instead, so exp2 gives 0, never
    // NaN.
    if (needs_mask()) {
      for_each_row<MT>([&](int mt, int hh) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float& x = s[mt][nt][2 * hh + e2];
            x = p.mask.if_sees(query[mt][hh], kt + nt * 8 + 2 * t + e2, x, -INFINITY);
          }
      });
    }
    for_each_row<MT>([&](int mt, int hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) mx = fmaxf(mx, s[mt][nt][2 * hh + e2]);
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
    });

    // O += P V, P rounded to bf16 (as FlashAttention does).
    mma_acc_kn<D>(o, s, v_tile);
  });

  typename Params::Output::Held held[MT][2];
  p.out.hold(held, row, blk.n_queries, blk.h, p.H);
  for_each_row<MT>([&](int mt, int hh) {
    const float l_row = quad_sum(l[mt][hh]);
    const int r = row[mt][hh];
    if (r < blk.n_queries) p.out.put_row(o[mt], hh, m[mt][hh], l_row, held[mt][hh], r, blk.h, p.H, t);
  });
}

template <int D, int NWARPS, int MT, int BMQ, int QUERY_INTS>
struct DkdvTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBNK = NWARPS * 16 * MT;  // keys per block
  // K, V tiles; two stages of (Q, dO tiles, lse, delta, the mask's ints per query).
  static constexpr size_t kStageBytes =
      size_t(2 * BMQ) * smem_row<D>() * sizeof(bf16) + (2 + QUERY_INTS) * BMQ * sizeof(float);
  static constexpr size_t kSmemBytes =
      size_t(2 * kBNK) * smem_row<D>() * sizeof(bf16) + 2 * kStageBytes;
  static_assert(kStageBytes % 16 == 0, "cp.async needs 16-byte aligned stages");
};

// Warp w owns keys w*16*MT + mt*16 + {g, g+8} of the block (mt < MT) and computes
// the transposed products S^T = K Q^T and dP^T = V dO^T, so dV += P^T dO and
// dK += dS^T Q land in its own accumulators: no reduction between warps. MT = 2
// halves the shared-memory reads per mma (each Q/dO fragment feeds two key tiles).
template <class Params, int D, int NWARPS, int MT, int BMQ>
__global__ void __launch_bounds__(NWARPS * 32) dkdv_kernel(const Params p) {
  using Mask = typename Params::Mask;
  using Tile = DkdvTile<D, NWARPS, MT, BMQ, Mask::kQueryInts>;
  constexpr int kBNK = Tile::kBNK, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // (BNK, D+8)
  bf16* sV = sK + kBNK * kSR;                     // (BNK, D+8)
  unsigned char* stage_base = reinterpret_cast<unsigned char*>(sV + kBNK * kSR);
  auto sQ = [&](int s) { return reinterpret_cast<bf16*>(stage_base + s * Tile::kStageBytes); };
  auto sdO = [&](int s) { return sQ(s) + BMQ * kSR; };
  auto sLse = [&](int s) { return reinterpret_cast<float*>(sdO(s) + BMQ * kSR); };
  auto sDelta = [&](int s) { return sLse(s) + BMQ; };
  auto sQueryInts = [&](int s) { return reinterpret_cast<int32_t*>(sDelta(s) + BMQ); };

  const int kvh = blockIdx.x;
  const int j0 = blockIdx.y * kBNK;  // first blocks own the most queries: launched first
  const int Nq = p.mask.num_queries(), Nk = p.mask.num_keys();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t q_stride = int64_t(p.H) * D, kv_stride = int64_t(p.KV) * D;
  // Items are (head of the group, query tile), heads outer; item i's tile starts at
  // query q_first + (i % nq) * BMQ.
  const auto tiles = p.mask.query_tiles(j0, kBNK, BMQ, p.group);
  const int nq = tiles.per_head, q_first = tiles.first_query;

  auto load_item = [&](int item, int s) {
    const int h = kvh * p.group + item / nq;
    const int i_start = q_first + (item % nq) * BMQ;
    load_tile<BMQ, D, kT>(sQ(s), p.q + int64_t(h) * D, q_stride, i_start, Nq);
    load_tile<BMQ, D, kT>(sdO(s), p.dout + int64_t(h) * D, q_stride, i_start, Nq);
    for (int c = threadIdx.x; c < BMQ; c += kT) {
      const int i = i_start + c;
      const bool valid = i < Nq;
      const int64_t ih = valid ? int64_t(i) * p.H + h : 0;
      cp_async4(smem_addr(sLse(s) + c), p.lse + ih, valid);
      cp_async4(smem_addr(sDelta(s) + c), p.delta + ih, valid);
      p.mask.stage_query(sQueryInts(s), c, i, valid, BMQ);
    }
  };

  auto at = tiles.first();
  load_tile<kBNK, D, kT>(sK, p.k + int64_t(kvh) * D, kv_stride, j0, Nk);
  load_tile<kBNK, D, kT>(sV, p.v + int64_t(kvh) * D, kv_stride, j0, Nk);
  if (!Mask::kMayBeEmpty || at.tile < tiles.items) load_item(at.tile, 0);
  cp_async_commit();

  float dvk[2][MT][D / 8][4];  // dV, dK
  int key[MT][2];
  typename Mask::Key key_of[MT][2];
  zero(dvk);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    key[mt][0] = j0 + warp * 16 * MT + mt * 16 + g;
    key[mt][1] = key[mt][0] + 8;
    key_of[mt][0] = p.mask.key_or_none(key[mt][0]);
    key_of[mt][1] = p.mask.key_or_none(key[mt][1]);
  }

  while (at.tile < tiles.items) {
    const int st = at.stage(), next = tiles.from(at.tile + 1);
    next_stage(next < tiles.items, [&] { load_item(next, st ^ 1); });
    const bf16* q_tile = sQ(st);
    const bf16* do_tile = sdO(st);
    const float* lse_t = sLse(st);
    const float* delta_t = sDelta(st);
    const int32_t* ints_t = sQueryInts(st);
    const int i_start = q_first + (at.tile % nq) * BMQ;

    // S^T = K Q^T and dP^T = V dO^T: (16 keys) x (BMQ queries) per key tile.
    float sdpT[2][MT][BMQ / 8][4];  // S^T, dP^T
    zero(sdpT);
    mma_smem_nk<D>(sdpT, warp * 16 * MT, sK, q_tile, sV, do_tile);

    // P^T = exp(S^T * scale - lse), dS^T = P^T (dP^T - delta), in place.
    auto& sT = sdpT[0];
    auto& dpT = sdpT[1];
    const bool full = tiles.full(i_start, ints_t);
#pragma unroll
    for (int nt = 0; nt < BMQ / 8; ++nt)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int qc = nt * 8 + 2 * t + e2;
        const float lse2 = lse_t[qc] * kLog2e, delta_q = delta_t[qc];
        const int i = i_start + qc;
        const typename Mask::Query query = p.mask.staged_query(ints_t, qc, i, BMQ);
        for_each_row<MT>([&](int mt, int hh) {
          const int e = 2 * hh + e2;
          const float pr = ex2(fmaf(sT[mt][nt][e], p.scale_log2, -lse2));
          const bool visible = full || (i < Nq && Mask::allowed(query, key_of[mt][hh]));
          const float pv = visible ? pr : 0.f;
          sT[mt][nt][e] = pv;
          dpT[mt][nt][e] = pv * (dpT[mt][nt][e] - delta_q);
        });
      }

    // dV += P^T dO, dK += dS^T Q (bf16 operands, fp32 accumulators).
    mma_acc_kn<D>(dvk, sdpT, do_tile, q_tile);
    __syncthreads();  // this stage is refilled next iteration
    at.advance(next);
  }
  if constexpr (Mask::kMayBeEmpty) cp_async_wait<0>();  // the K/V tiles, when no query tile was visible

  for_each_row<MT>([&](int mt, int hh) {
    const int j = key[mt][hh];
    if (j >= Nk) return;
    const int64_t off = (int64_t(j) * p.KV + kvh) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      p.grads.put_kv(off + dt * 8 + 2 * t, dvk[1][mt][dt][2 * hh] * p.scale, dvk[1][mt][dt][2 * hh + 1] * p.scale,
                     dvk[0][mt][dt][2 * hh], dvk[0][mt][dt][2 * hh + 1]);
  });
}

template <int D, int NWARPS, int MT, int BN>
struct DqTile {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBM = NWARPS * 16 * MT;
  // Q, dO tiles; two stages of K, V tiles.
  static constexpr size_t kSmemBytes = size_t(2 * kBM + 4 * BN) * smem_row<D>() * sizeof(bf16);
};

// Query rows and key tiles as in forward.
template <class Params, int D, int NWARPS, int MT, int BN>
__global__ void __launch_bounds__(NWARPS * 32) dq_kernel(const Params p) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  constexpr int kBM = Tile::kBM, kSR = smem_row<D>(), kT = Tile::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // (BM, D+8)
  bf16* sdO = sQ + kBM * kSR;                     // (BM, D+8)
  bf16* sK = sdO + kBM * kSR;                     // 2 stages x (BN, D+8)
  bf16* sV = sK + 2 * BN * kSR;                   // 2 stages x (BN, D+8)
  const QueryBlock<Params, D, MT, kBM, BN, kT> blk(p);
  const int warp = blk.warp, t = blk.t;

  int row[MT][2];
  typename Params::Mask::Query query[MT][2];
  float lse2[MT][2], delta[MT][2];
  for_each_row<MT>([&](int mt, int hh) {
    const int r = blk.row(mt, hh);
    const bool valid = r < blk.n_queries;
    row[mt][hh] = r;
    query[mt][hh] = p.mask.query_or_none(r);
    lse2[mt][hh] = valid ? p.lse[int64_t(r) * p.H + blk.h] * kLog2e : 0.f;
    delta[mt][hh] = valid ? p.delta[int64_t(r) * p.H + blk.h] : 0.f;
  });
  load_tile<kBM, D, kT>(sQ, p.q + int64_t(blk.h) * D, blk.q_stride, blk.i0, blk.n_queries);
  load_tile<kBM, D, kT>(sdO, p.dout + int64_t(blk.h) * D, blk.q_stride, blk.i0, blk.n_queries);

  float dq[MT][D / 8][4];
  zero(dq);
  blk.walk(p, sK, sV, [&](const bf16* k_tile, const bf16* v_tile, int kt, auto&& needs_mask) {
    // S = Q K^T, dP = dO V^T.
    const bool need_mask = needs_mask();
    float sdp[2][MT][BN / 8][4];  // S, dP
    zero(sdp);
    mma_smem_nk<D>(sdp, warp * 16 * MT, sQ, k_tile, sdO, v_tile);

    // dS = P (dP - delta), into dP.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          float pr = ex2(fmaf(sdp[0][mt][nt][e], p.scale_log2, -lse2[mt][hh]));
          if (need_mask) pr = p.mask.if_sees(query[mt][hh], kt + nt * 8 + 2 * t + (e & 1), pr, 0.f);
          sdp[1][mt][nt][e] = pr * (sdp[1][mt][nt][e] - delta[mt][hh]);
        }

    // dQ += dS K.
    mma_acc_kn<D>(dq, sdp[1], k_tile);
  });

  for_each_row<MT>([&](int mt, int hh) {
    if (row[mt][hh] >= blk.n_queries) return;
    const int64_t off = (int64_t(row[mt][hh]) * p.H + blk.h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      p.grads.put_q(off + dt * 8 + 2 * t, dq[mt][dt][2 * hh] * p.scale, dq[mt][dt][2 * hh + 1] * p.scale);
  });
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

// One warp per (token, head); lane owns dims lane, lane + 32, ... (D <= 256).

// x = the lane's dims of `row`, 0 past D.
__device__ __forceinline__ void lane_load(LaneDims& x, const bf16* row, int lane, int D) {
#pragma unroll
  for (int c = 0; c < kMaxDimPerLane; ++c) {
    const int d = lane + 32 * c;
    x[c] = d < D ? __bfloat162float(row[d]) : 0.f;
  }
}
// The lane's shares of x . a and y . b (warp_sum them).
__device__ __forceinline__ void lane_dots(float& xa, const LaneDims& x, const bf16* a, float& yb,
                                          const LaneDims& y, const bf16* b, int lane, int D) {
  for_lane_dims(lane, D, [&](int c, int d) {
    xa += x[c] * __bfloat162float(a[d]);
    yb += y[c] * __bfloat162float(b[d]);
  });
}
// acc += w * row over the lane's dims.
__device__ __forceinline__ void lane_axpy(LaneDims& acc, float w, const bf16* row, int lane, int D) {
  for_lane_dims(lane, D, [&](int c, int d) { acc[c] += w * __bfloat162float(row[d]); });
}

// Two passes like the CPU reference: logsumexp, then out = sum_j exp(s_j - lse) v_j.
template <class Params>
__global__ void __launch_bounds__(kRowWarps * 32) generic_fwd_kernel(const Params p, int D, float scale) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.mask.num_queries()) * p.H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / p.H), h = int(r % p.H), kvh = h / p.group;
  const auto query = p.mask.query(i);
  LaneDims qr;
  lane_load(qr, p.q + r * D, lane, D);
  auto score = [&](int j) {
    const bf16* kj = p.k + (int64_t(j) * p.KV + kvh) * D;
    float acc = 0.f;
    for_lane_dims(lane, D, [&](int c, int d) { acc += qr[c] * __bfloat162float(kj[d]); });
    return warp_sum(acc) * scale;
  };
  float m = -INFINITY, l = 0.f;
  p.mask.for_each_key(query, [&](int j) {
    const float s = score(j);
    if (s > m) {
      l *= expf(m - s);
      m = s;
    }
    l += expf(s - m);
  });
  p.out.finish_row(r, m, l, lane, D, [&](float lse_r, LaneDims& acc) {
    p.mask.for_each_key(query, [&](int j) {
      lane_axpy(acc, expf(score(j) - lse_r), p.v + (int64_t(j) * p.KV + kvh) * D, lane, D);
    });
  });
}

// dq: one warp per (token, head) over its keys.
template <class Params>
__global__ void __launch_bounds__(kRowWarps * 32) generic_dq_kernel(const Params p, int D) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.mask.num_queries()) * p.H) return;
  const int lane = threadIdx.x & 31;
  const int i = int(r / p.H), h = int(r % p.H), kvh = h / p.group;
  const auto query = p.mask.query(i);
  LaneDims qr, dor;
  float acc[kMaxDimPerLane] = {};
  lane_load(qr, p.q + r * D, lane, D);
  lane_load(dor, p.dout + r * D, lane, D);
  const float lse_r = p.lse[r], delta_r = p.delta[r];
  p.mask.for_each_key(query, [&](int j) {
    const bf16* kj = p.k + (int64_t(j) * p.KV + kvh) * D;
    const bf16* vj = p.v + (int64_t(j) * p.KV + kvh) * D;
    float s = 0.f, dpv = 0.f;
    lane_dots(s, qr, kj, dpv, dor, vj, lane, D);
    const float pr = expf(warp_sum(s) * p.scale - lse_r);
    const float ds = pr * (warp_sum(dpv) - delta_r);
    lane_axpy(acc, ds, kj, lane, D);
  });
  for_lane_dims(lane, D, [&](int c, int d) { p.grads.put_q(r * D + d, acc[c] * p.scale); });
}

// dk, dv: one warp per (key token, kv head) over the queries that see it, and the
// group's heads for each query.
template <class Params>
__global__ void __launch_bounds__(kRowWarps * 32) generic_dkdv_kernel(const Params p, int D) {
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  if (r >= int64_t(p.mask.num_keys()) * p.KV) return;
  const int lane = threadIdx.x & 31;
  const int j = int(r / p.KV), kvh = int(r % p.KV);
  LaneDims kr, vr;
  float dka[kMaxDimPerLane] = {}, dva[kMaxDimPerLane] = {};
  lane_load(kr, p.k + r * D, lane, D);
  lane_load(vr, p.v + r * D, lane, D);
  p.mask.for_each_query(j, [&](int i) {
    for (int h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
      const int64_t ih = int64_t(i) * p.H + h;
      const bf16* qi = p.q + ih * D;
      const bf16* doi = p.dout + ih * D;
      float s = 0.f, dpv = 0.f;
      lane_dots(s, kr, qi, dpv, vr, doi, lane, D);
      const float pr = expf(warp_sum(s) * p.scale - p.lse[ih]);
      const float ds = pr * (warp_sum(dpv) - p.delta[ih]);
      lane_axpy(dva, pr, doi, lane, D);
      lane_axpy(dka, ds, qi, lane, D);
    }
  });
  for_lane_dims(lane, D, [&](int c, int d) { p.grads.put_kv(r * D + d, dka[c] * p.scale, dva[c]); });
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

// kKernel on a grid of (blocks_x, ceil(rows / rows_per_block)) blocks; the first
// launch of each kernel raises its dynamic shared-memory limit.
template <auto kKernel, class Params>
void launch_tiles(const Params& p, int blocks_x, int rows, int rows_per_block, int threads, size_t smem_bytes,
                  cudaStream_t stream) {
  static const bool configured = (set_smem(kKernel, smem_bytes), true);
  (void)configured;
  kKernel<<<dim3(blocks_x, (rows + rows_per_block - 1) / rows_per_block), threads, smem_bytes, stream>>>(p);
}
template <int D, int NWARPS, int MT, int BN, class Params>
void launch_fwd(const Params& p, cudaStream_t stream) {
  using Tile = FwdTile<D, NWARPS, MT, BN>;
  launch_tiles<fwd_kernel<Params, D, NWARPS, MT, BN>>(p, p.H, p.mask.num_queries(), Tile::kBM, Tile::kThreads,
                                                      Tile::kSmemBytes, stream);
}
template <int D, int NWARPS, int MT, int BMQ, class Params>
void launch_dkdv(const Params& p, cudaStream_t stream) {
  using Tile = DkdvTile<D, NWARPS, MT, BMQ, Params::Mask::kQueryInts>;
  launch_tiles<dkdv_kernel<Params, D, NWARPS, MT, BMQ>>(p, p.KV, p.mask.num_keys(), Tile::kBNK, Tile::kThreads,
                                                        Tile::kSmemBytes, stream);
}
template <int D, int NWARPS, int MT, int BN, class Params>
void launch_dq(const Params& p, cudaStream_t stream) {
  using Tile = DqTile<D, NWARPS, MT, BN>;
  launch_tiles<dq_kernel<Params, D, NWARPS, MT, BN>>(p, p.H, p.mask.num_queries(), Tile::kBM, Tile::kThreads,
                                                     Tile::kSmemBytes, stream);
}

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

float scale_of(int64_t D) { return float(1.0 / std::sqrt(double(D))); }
float scale_log2_of(int64_t D) { return float(1.4426950408889634 / std::sqrt(double(D))); }

}  // namespace

}  // namespace shardlm::cuda
