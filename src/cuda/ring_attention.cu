// ring_attention.cu — context parallelism's attention on one K/V block of the ring
// (attention_masked_*, cuda/ring_attention.hpp): attention_kernels.cuh's kernels
// instantiated with the ring's policies:
//   RingMask       queries and keys are separate token arrays (this rank's queries,
//                  another rank's K/V block), visible iff key index <= query index and
//                  the seq_ids match; tiles are BN-aligned and those that per-16-token
//                  bounds show fully masked are skipped.
//   MergeOutput    forward merged by log-sum-exp into fp32 accumulators.
//   AddGrads       gradients added to fp32 accumulators.
// Beside them: tile_bounds_kernel (the per-16-token bounds) and ring_tiling (the
// tiling per D). Reference: shardlm::cpu::attention_* over the whole micro-batch
// (tests/gpu/test_ring_attention.cu). The walk of the C steps over the group's Comm,
// which calls these once per block, is cuda/ring_walk.cu; this file needs no Comm, so
// the kernel test links it without MPI.
#include "cuda/ring_attention.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/attention_kernels.cuh"
#include "cuda/check.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

namespace {

// ---------------------------------------------------------------- the ring's tile bounds

struct RingTokens {
  const int32_t* index;  // (n)
  const int32_t* seq;    // (n)
  const int4* bounds;    // (ceil(n / 16)): min index, max index, min seq, max seq
  int n;
};

RingTokens ring_tokens(const AttentionTokens& t) {
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
__device__ __forceinline__ int4 span_bounds(const RingTokens& t, int first, int count) {
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

// The ring's block: queries and keys are separate token arrays, each token carrying
// its index in the micro-batch and its seq_id; key k is visible to query q iff
// k.index <= q.index and k.seq == q.seq (attention.hpp). Tiles are aligned to their
// length; one that the bounds of its 16-token runs show to be wholly hidden from a
// block is never loaded.
struct RingMask {
  RingTokens queries, keys;

  static constexpr bool kMayBeEmpty = true;
  static constexpr int kQueryInts = 2;  // index, seq

  struct Query {
    int index, seq;
  };
  struct Key {
    int index, seq;
  };
  __host__ __device__ int num_queries() const { return queries.n; }
  __host__ __device__ int num_keys() const { return keys.n; }
  __device__ __forceinline__ Query query(int i) const { return {queries.index[i], queries.seq[i]}; }
  // A padding query sees no key: key indices are >= 0.
  __device__ __forceinline__ Query query_or_none(int i) const {
    return {i < queries.n ? queries.index[i] : -1, i < queries.n ? queries.seq[i] : 0};
  }
  // A padding key is visible to no query: query indices are < INT_MAX.
  __device__ __forceinline__ Key key_or_none(int j) const {
    return {j < keys.n ? keys.index[j] : INT_MAX, j < keys.n ? keys.seq[j] : 0};
  }
  __device__ __forceinline__ static bool allowed(Query q, Key k) { return k.index <= q.index && k.seq == q.seq; }
  __device__ __forceinline__ float if_sees(Query q, int j, float x, float hidden) const {
    if (j >= keys.n || keys.index[j] > q.index || keys.seq[j] != q.seq) return hidden;
    return x;
  }

  // A walk over the tiles (or items) not skipped: stage() is the pipeline stage.
  struct Cursor {
    int tile, st;
    __device__ __forceinline__ int stage() const { return st; }
    __device__ __forceinline__ void advance(int next) { tile = next, st ^= 1; }
  };

  struct KeyTiles {
    const RingMask& mask;
    int4 qb;  // the block's queries' bounds
    int first_key, count, i0, bm, bn;
    __device__ __forceinline__ Cursor first() const { return {from(0), 0}; }
    __device__ __forceinline__ int from(int tile) const {
      while (tile < count && spans_apart(qb, span_bounds(mask.keys, tile * bn, bn))) ++tile;
      return tile;
    }
    __device__ __forceinline__ bool needs_mask(int kt) const {
      return !(i0 + bm <= mask.queries.n && kt + bn <= mask.keys.n &&
               spans_full(qb, span_bounds(mask.keys, kt, bn)));
    }
  };
  __device__ __forceinline__ KeyTiles key_tiles(int i0, int bm, int bn) const {
    return {*this, span_bounds(queries, i0, bm), 0, (keys.n + bn - 1) / bn, i0, bm, bn};
  }

  struct QueryTiles {
    const RingMask& mask;
    int4 kb;  // the block's keys' bounds
    int first_query, j0, bnk, per_head, items, bmq;
    __device__ __forceinline__ Cursor first() const { return {from(0), 0}; }
    __device__ __forceinline__ int from(int item) const {
      while (item < items && spans_apart(span_bounds(mask.queries, (item % per_head) * bmq, bmq), kb)) ++item;
      return item;
    }
    __device__ __forceinline__ bool full(int i_start, const int32_t* /*staged*/) const {
      return i_start + bmq <= mask.queries.n && j0 + bnk <= mask.keys.n &&
             spans_full(span_bounds(mask.queries, i_start, bmq), kb);
    }
  };
  __device__ __forceinline__ QueryTiles query_tiles(int j0, int bnk, int bmq, int group) const {
    const int per_head = (queries.n + bmq - 1) / bmq;
    return {*this, span_bounds(keys, j0, bnk), 0, j0, bnk, per_head, group * per_head, bmq};
  }
  __device__ __forceinline__ void stage_query(int32_t* ints, int c, int i, bool valid, int bmq) const {
    cp_async4(smem_addr(ints + c), queries.index + (valid ? i : 0), valid);
    cp_async4(smem_addr(ints + bmq + c), queries.seq + (valid ? i : 0), valid);
  }
  __device__ __forceinline__ Query staged_query(const int32_t* ints, int c, int /*i*/, int bmq) const {
    return {ints[c], ints[bmq + c]};
  }

  // Runs of 16 keys whose bounds rule out the query are skipped whole.
  template <class F>
  __device__ __forceinline__ void for_each_key(const Query& q, F&& f) const {
    const int runs = (keys.n + 15) / 16;
    for (int run = 0; run < runs; ++run) {
      const int4 b = keys.bounds[run];
      if (!(b.x <= q.index && b.z <= q.seq && q.seq <= b.w)) continue;
      for (int j = run * 16; j < min(run * 16 + 16, keys.n); ++j)
        if (keys.index[j] <= q.index && keys.seq[j] == q.seq) f(j);
    }
  }
  template <class F>
  __device__ __forceinline__ void for_each_query(int j, F&& f) const {
    const int kj_index = keys.index[j], kj_seq = keys.seq[j];
    const int runs = (queries.n + 15) / 16;
    for (int run = 0; run < runs; ++run) {
      const int4 b = queries.bounds[run];
      if (b.y < kj_index || kj_seq < b.z || kj_seq > b.w) continue;
      for (int i = run * 16; i < min(run * 16 + 16, queries.n); ++i) {
        const int qi_index = queries.index[i], qi_seq = queries.seq[i];
        if (keys.index[j] <= qi_index && keys.seq[j] == qi_seq) f(i);
      }
    }
  }
};

// The ring's backward block, added to dq (Nq, H, D), dk and dv (Nk, KV, D) fp32
// accumulators.
struct AddGrads {
  float* dq;
  float* dk;
  float* dv;

  __device__ __forceinline__ void put_q(int64_t off, float x, float y) const {
    float2* slot = reinterpret_cast<float2*>(dq + off);
    float2 a = *slot;
    a.x += x, a.y += y;
    *slot = a;
  }
  __device__ __forceinline__ void put_kv(int64_t off, float dk_x, float dk_y, float dv_x, float dv_y) const {
    float2* dk_slot = reinterpret_cast<float2*>(dk + off);
    float2* dv_slot = reinterpret_cast<float2*>(dv + off);
    float2 a = *dk_slot, b = *dv_slot;
    a.x += dk_x, a.y += dk_y;
    b.x += dv_x, b.y += dv_y;
    *dk_slot = a, *dv_slot = b;
  }
  __device__ __forceinline__ void put_q(int64_t off, float x) const { dq[off] += x; }
  __device__ __forceinline__ void put_kv(int64_t off, float dk_x, float dv_x) const {
    dk[off] += dk_x;
    dv[off] += dv_x;
  }
};

// The ring's forward block, merged into out_acc (Nq, H, D) and lse_acc (Nq, H) fp32
// by log-sum-exp (first: overwritten; a row that sees none of the block's keys
// gets out 0, lse -inf then, and is left alone otherwise).
struct MergeOutput {
  float* out_acc;
  float* lse_acc;
  bool first;

  // log(e^held + e^block) without overflow; keep = e^(held - merged).
  __device__ __forceinline__ static float merged_lse(float held, float lse_block, float& keep) {
    const float hi = fmaxf(held, lse_block), lo = fminf(held, lse_block);
    const float lse_new = hi + log1pf(expf(lo - hi));
    keep = expf(held - lse_new);
    return lse_new;
  }

  // The four threads of a quad read a row's lse before any of them writes it
  // (hence hold() for every row, then __syncwarp, then put_row()).
  using Held = float;  // the row's lse before this block
  template <int MT>
  __device__ __forceinline__ void hold(float (&held)[MT][2], const int (&row)[MT][2], int n, int h, int H) const {
    for_each_row<MT>([&](int mt, int hh) {
      const int r = row[mt][hh];
      held[mt][hh] = (first || r >= n) ? -INFINITY : lse_acc[int64_t(r) * H + h];
    });
    __syncwarp();
  }
  template <int D8>
  __device__ __forceinline__ void put_row(const float (&o)[D8][4], int hh, float m, float l_row, float held, int r,
                                          int h, int H, int t) const {
    float* acc = out_acc + (int64_t(r) * H + h) * (D8 * 8);
    float* lse_slot = lse_acc + int64_t(r) * H + h;
    if (l_row == 0.f) {  // nothing of this block is visible to the row
      if (first) {
#pragma unroll
        for (int dt = 0; dt < D8; ++dt) *reinterpret_cast<float2*>(acc + dt * 8 + 2 * t) = make_float2(0.f, 0.f);
        if (t == 0) *lse_slot = -INFINITY;
      }
      return;
    }
    const float lse_block = (m + log2f(l_row)) * kLn2;
    float lse_new = lse_block, keep = 0.f;
    if (held != -INFINITY) lse_new = merged_lse(held, lse_block, keep);
    const float take = expf(lse_block - lse_new) / l_row;
#pragma unroll
    for (int dt = 0; dt < D8; ++dt) {
      float2* slot = reinterpret_cast<float2*>(acc + dt * 8 + 2 * t);
      float2 x = make_float2(0.f, 0.f);
      if (held != -INFINITY) x = *slot;
      x.x = x.x * keep + o[dt][2 * hh] * take;
      x.y = x.y * keep + o[dt][2 * hh + 1] * take;
      *slot = x;
    }
    if (t == 0) *lse_slot = lse_new;
  }

  // Generic forward: the second pass normalises by the merged lse, so the held
  // output only needs scaling by `keep`.
  template <class SecondPass>
  __device__ __forceinline__ void finish_row(int64_t r, float m, float l, int lane, int D,
                                             SecondPass&& second_pass) const {
    float* acc_row = out_acc + r * D;
    const float held = first ? -INFINITY : lse_acc[r];
    __syncwarp();
    if (l == 0.f) {
      if (first) {
        for (int d = lane; d < D; d += 32) acc_row[d] = 0.f;
        if (lane == 0) lse_acc[r] = -INFINITY;
      }
      return;
    }
    const float lse_block = m + logf(l);
    float lse_new = lse_block, keep = 0.f;
    if (held != -INFINITY) lse_new = merged_lse(held, lse_block, keep);
    float acc[kMaxDimPerLane] = {};
    second_pass(lse_new, acc);
    for_lane_dims(lane, D, [&](int c, int d) {
      acc_row[d] = (held != -INFINITY ? acc_row[d] * keep : 0.f) + acc[c];
    });
    if (lane == 0) lse_acc[r] = lse_new;
  }
};

// ---------------------------------------------------------------- the ring's tiling

using RingFwdParams = FwdParams<RingMask, MergeOutput>;
using RingBwdParams = BwdParams<RingMask, AddGrads>;

// The ring's block kernels, one tiling per D: the one-rank defaults' shapes where
// they do not spill (fwd D 64 takes BN 64, the spill-free one of
// docs/kernels-attention.md). nullptr (D 32, the generic fallback forced, or a D
// without tensor-core kernels): the generic kernels.
struct RingTiling {
  void (*fwd)(const RingFwdParams&, cudaStream_t);
  void (*dkdv)(const RingBwdParams&, cudaStream_t);
  void (*dq)(const RingBwdParams&, cudaStream_t);
};
const RingTiling kRingTiling64 = {launch_fwd<64, 4, 2, 64>, launch_dkdv<64, 4, 1, 64>, launch_dq<64, 4, 1, 64>};
const RingTiling kRingTiling128 = {launch_fwd<128, 4, 2, 32>, launch_dkdv<128, 8, 1, 64>, launch_dq<128, 8, 1, 32>};
const RingTiling* ring_tiling(int64_t D) {
  if (attention_variant(D) < 0 || D == 32) return nullptr;
  return D == 64 ? &kRingTiling64 : &kRingTiling128;
}

void check_masked_shape(const AttentionTokens& queries, const AttentionTokens& keys, int64_t H,
                        int64_t KV, int64_t D) {
  check_shape(std::max<int64_t>(1, queries.n), H, KV, D);
  check_shape(std::max<int64_t>(1, keys.n), H, KV, D);
  SHARDLM_CHECK(queries.index && queries.seq && queries.bounds && keys.index && keys.seq && keys.bounds,
                "internal: masked attention without token indices, seq_ids or tile bounds");
}

}  // namespace

// ---- the ring's block entry points (attention.hpp): the same kernels, with RingMask
// and the accumulating outputs (ring_tiling).

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
  const RingFwdParams p{{out_acc, lse_acc, first}, q, k, v, {ring_tokens(queries), ring_tokens(keys)},
                        int(H), int(KV), int(H / KV), scale_log2_of(D)};
  if (const RingTiling* tiling = ring_tiling(D)) tiling->fwd(p, stream);
  else generic_fwd_kernel<<<row_blocks(queries.n * H), kRowWarps * 32, 0, stream>>>(p, int(D), scale_of(D));
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
  const RingBwdParams p{{dq_acc, dk_acc, dv_acc}, dout, q, k, v, lse, delta,
                        {ring_tokens(queries), ring_tokens(keys)}, int(H), int(KV), int(H / KV),
                        scale_of(D), scale_log2_of(D)};
  SHARDLM_CHECK((dk_acc == nullptr) == (dv_acc == nullptr),
                "internal: masked attention backward with one of dk and dv");
  const RingTiling* tiling = ring_tiling(D);
  if (dk_acc) {
    if (tiling) tiling->dkdv(p, stream);
    else generic_dkdv_kernel<<<row_blocks(keys.n * KV), kRowWarps * 32, 0, stream>>>(p, int(D));
    CUDA_CHECK(cudaGetLastError());
  }
  if (dq_acc) {
    if (tiling) tiling->dq(p, stream);
    else generic_dq_kernel<<<row_blocks(queries.n * H), kRowWarps * 32, 0, stream>>>(p, int(D));
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace shardlm::cuda
