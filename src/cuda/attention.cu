// attention.cu — shardlm's flash attention over one packed micro-batch, forward and
// backward, causal and GQA (attention_forward / attention_backward). Contract:
// src/cuda/attention.hpp. Reference: shardlm::cpu::attention_*. The kernel bodies are
// attention_kernels.cuh's; this file instantiates them with the one-rank policies:
//   DocumentMask   queries and keys the same tokens: key j is visible to query i iff
//                  j <= i and j >= doc_start[i]. Key tiles run contiguously from the
//                  block's first document start to its last query.
//   StoreOutput, StoreGrads   bf16 outputs, overwritten.
// Beside them: doc_start_kernel (one block scans seq_id: doc_start[i] = first token of
// i's run). kFwdTilings and kBwdTilings list the tilings per variant and D (measured
// numbers in docs/kernels-attention.md). The ring's block passes, the same kernels
// under other policies, are cuda/ring_attention.cu.
#include "cuda/attention.hpp"

#include <climits>
#include <cstdint>
#include <string>

#include "cuda/attention_kernels.cuh"
#include "cuda/check.hpp"

namespace shardlm::cuda {

namespace {

AttentionKernel g_kernel = AttentionKernel::kAuto;

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

// One packed micro-batch: token i sees j iff j <= i and j lies in i's document.
struct DocumentMask {
  const int32_t* doc_start;  // (n) the first token of each token's document
  int n;

  static constexpr bool kMayBeEmpty = false;  // every query sees itself
  static constexpr int kQueryInts = 1;        // doc_start

  struct Query {
    int pos, doc_start;
  };
  struct Key {
    int pos;
  };
  __host__ __device__ int num_queries() const { return n; }
  __host__ __device__ int num_keys() const { return n; }
  __device__ __forceinline__ Query query(int i) const { return {i, doc_start[i]}; }
  __device__ __forceinline__ Query query_or_none(int i) const { return {i, i < n ? doc_start[i] : INT_MAX}; }
  __device__ __forceinline__ Key key_or_none(int j) const { return {j}; }
  __device__ __forceinline__ static bool allowed(Query q, Key k) { return k.pos <= q.pos && k.pos >= q.doc_start; }
  __device__ __forceinline__ float if_sees(Query q, int j, float x, float hidden) const {
    return (j > q.pos || j < q.doc_start) ? hidden : x;
  }

  // A walk over tiles (or items) 0, 1, 2, ...: stage() is the pipeline stage.
  struct Cursor {
    int tile;
    __device__ __forceinline__ int stage() const { return tile & 1; }
    __device__ __forceinline__ void advance(int next) { tile = next; }
  };

  // Queries [i0, i0 + bm) read the keys [doc_start[i0], last query] in tiles of bn
  // (not bn-aligned). Only tiles that cross the diagonal or a document start need
  // the mask.
  struct KeyTiles {
    int first_key, count, i0, ds_last, bn;
    __device__ __forceinline__ Cursor first() const { return {0}; }
    __device__ __forceinline__ int from(int tile) const { return tile; }
    __device__ __forceinline__ bool needs_mask(int kt) const { return (kt + bn - 1 > i0) || (kt < ds_last); }
  };
  __device__ __forceinline__ KeyTiles key_tiles(int i0, int bm, int bn) const {
    const int i_last = min(i0 + bm, n) - 1;
    const int begin = doc_start[i0];
    return {begin, (i_last - begin) / bn + 1, i0, doc_start[i_last], bn};
  }

  // Keys [j0, j0 + bnk) are seen by queries [j0, q_end), q_end the end of the last
  // key's document; every head of the group walks the same query tiles. A tile
  // needs the mask unless every query is at or after every key, is a real token,
  // and its document started at or before the block's first key.
  struct QueryTiles {
    int first_query, j_last, per_head, items, bmq, n;
    __device__ __forceinline__ Cursor first() const { return {0}; }
    __device__ __forceinline__ int from(int item) const { return item; }
    __device__ __forceinline__ bool full(int i_start, const int32_t* staged) const {
      return i_start >= j_last && i_start + bmq <= n && staged[bmq - 1] <= first_query;
    }
  };
  __device__ __forceinline__ QueryTiles query_tiles(int j0, int bnk, int bmq, int group) const {
    const int j_last = min(j0 + bnk, n) - 1;
    const int q_end = find_doc_end(doc_start, j_last, n);
    const int per_head = (q_end - j0 + bmq - 1) / bmq;
    return {j0, j_last, per_head, group * per_head, bmq, n};
  }
  __device__ __forceinline__ void stage_query(int32_t* ints, int c, int i, bool valid, int /*bmq*/) const {
    cp_async4(smem_addr(ints + c), doc_start + (valid ? i : 0), valid);
  }
  __device__ __forceinline__ Query staged_query(const int32_t* ints, int c, int i, int /*bmq*/) const {
    return {i, ints[c]};
  }

  template <class F>
  __device__ __forceinline__ void for_each_key(const Query& q, F&& f) const {
    for (int j = q.doc_start; j <= q.pos; ++j) f(j);
  }
  template <class F>
  __device__ __forceinline__ void for_each_query(int j, F&& f) const {
    for (int i = j; i < n && doc_start[i] <= j; ++i) f(i);
  }
};

// The one-rank forward: out (N, H, D) bf16 and lse (N, H) fp32, overwritten.
struct StoreOutput {
  bf16* out;
  float* lse;

  // The mma forward's row r (head h) from the thread's columns o (2 of every 8) of
  // its row tile, the row's max m (log2 domain) and sum l_row.
  struct Held {};  // nothing to merge with
  template <int MT>
  __device__ __forceinline__ void hold(Held (&)[MT][2], const int (&)[MT][2], int, int, int) const {}
  template <int D8>
  __device__ __forceinline__ void put_row(const float (&o)[D8][4], int hh, float m, float l_row, Held, int r,
                                          int h, int H, int t) const {
    const float inv = 1.f / l_row;
    bf16* out_row = out + (int64_t(r) * H + h) * (D8 * 8);
#pragma unroll
    for (int dt = 0; dt < D8; ++dt)
      *reinterpret_cast<uint32_t*>(out_row + dt * 8 + 2 * t) =
          pack_bf16(o[dt][2 * hh] * inv, o[dt][2 * hh + 1] * inv);
    if (t == 0) lse[int64_t(r) * H + h] = (m + log2f(l_row)) * kLn2;
  }

  // The generic forward's row r, from the running max m and sum l of its first
  // pass: second_pass(lse, acc) adds sum_j exp(s_j - lse) v_j into the lane's dims.
  template <class SecondPass>
  __device__ __forceinline__ void finish_row(int64_t r, float m, float l, int lane, int D,
                                             SecondPass&& second_pass) const {
    const float lse_r = m + logf(l);
    float acc[kMaxDimPerLane] = {};
    second_pass(lse_r, acc);
    for_lane_dims(lane, D, [&](int c, int d) { out[r * D + d] = __float2bfloat16(acc[c]); });
    if (lane == 0) lse[r] = lse_r;
  }
};

// The one-rank backward: dq (N, H, D), dk and dv (N, KV, D) bf16, overwritten.
struct StoreGrads {
  bf16* dq;
  bf16* dk;
  bf16* dv;

  __device__ __forceinline__ void put_q(int64_t off, float x, float y) const {
    *reinterpret_cast<uint32_t*>(dq + off) = pack_bf16(x, y);
  }
  __device__ __forceinline__ void put_kv(int64_t off, float dk_x, float dk_y, float dv_x, float dv_y) const {
    *reinterpret_cast<uint32_t*>(dk + off) = pack_bf16(dk_x, dk_y);
    *reinterpret_cast<uint32_t*>(dv + off) = pack_bf16(dv_x, dv_y);
  }
  __device__ __forceinline__ void put_q(int64_t off, float x) const { dq[off] = __float2bfloat16(x); }
  __device__ __forceinline__ void put_kv(int64_t off, float dk_x, float dv_x) const {
    dk[off] = __float2bfloat16(dk_x);
    dv[off] = __float2bfloat16(dv_x);
  }
};

// ---------------------------------------------------------------- the one-rank tilings

using LocalFwdParams = FwdParams<DocumentMask, StoreOutput>;
using LocalBwdParams = BwdParams<DocumentMask, StoreGrads>;

// The one-rank tilings, per variant: the launches for D 32, 64 and 128 (D 32 takes
// D 64's shapes) and their names for D <= 64 and D 128.
template <class Launch>
struct Tiling {
  Launch d32, d64, d128;
  const char* name;
  const char* name128;
  Launch for_dim(int64_t D) const { return D == 32 ? d32 : D == 64 ? d64 : d128; }
};

// Forward <D, warps, row tiles per warp, key tile>. Variant 0 (the default) is the
// fastest measured on an H100 (2026-11-29, N = 4096, one document): D 64 237 TFLOP/s
// (spilling 92 bytes then, it still beat the spill-free 4w x2 BN64 at 216), D 128
// 247 TFLOP/s. docs/kernels-attention.md has the table for every variant.
using FwdLaunch = void (*)(const LocalFwdParams&, cudaStream_t);
const Tiling<FwdLaunch> kFwdTilings[5] = {
    {launch_fwd<32, 4, 2, 128>, launch_fwd<64, 4, 2, 128>, launch_fwd<128, 4, 2, 32>,
     "4w x2 BM128 BN128", "4w x2 BM128 BN32"},
    {launch_fwd<32, 4, 2, 64>, launch_fwd<64, 4, 2, 64>, launch_fwd<128, 4, 1, 64>,
     "4w x2 BM128 BN64", "4w BM64 BN64"},
    {launch_fwd<32, 4, 1, 64>, launch_fwd<64, 4, 1, 64>, launch_fwd<128, 8, 1, 64>,
     "4w BM64 BN64", "8w BM128 BN64"},
    {launch_fwd<32, 4, 2, 32>, launch_fwd<64, 4, 2, 32>, launch_fwd<128, 8, 1, 32>,
     "4w x2 BM128 BN32", "8w BM128 BN32"},
    {launch_fwd<32, 4, 1, 128>, launch_fwd<64, 4, 1, 128>, launch_fwd<128, 4, 1, 32>,
     "4w BM64 BN128", "4w BM64 BN32"},
};

// Backward: dkdv <D, warps, key tiles per warp, query tile>, then dq <D, warps, row
// tiles per warp, key tile>. Variant 0 is the fastest pair measured (2026-11-29,
// H100): D 64 164 TFLOP/s, D 128 173 TFLOP/s. Variant 1 for D 64 pairs that dkdv
// with the dq tiling ncu measured 23% faster than the 8-warp one (dq 4w x2 BN32);
// the pair itself is not yet timed.
using BwdLaunch = void (*)(const LocalBwdParams&, cudaStream_t);
template <int D, int DKDV_WARPS, int DKDV_MT, int BMQ, int DQ_WARPS, int DQ_MT, int BN>
void launch_bwd(const LocalBwdParams& p, cudaStream_t stream) {
  launch_dkdv<D, DKDV_WARPS, DKDV_MT, BMQ>(p, stream);
  launch_dq<D, DQ_WARPS, DQ_MT, BN>(p, stream);
}
const Tiling<BwdLaunch> kBwdTilings[5] = {
    {launch_bwd<32, 4, 1, 64, 4, 1, 64>, launch_bwd<64, 4, 1, 64, 4, 1, 64>, launch_bwd<128, 8, 1, 64, 8, 1, 32>,
     "dkdv 4w BNK64 BMQ64, dq 4w BM64 BN64", "dkdv 8w BNK128 BMQ64, dq 8w BM128 BN32"},
    {launch_bwd<32, 4, 1, 64, 4, 2, 32>, launch_bwd<64, 4, 1, 64, 4, 2, 32>, launch_bwd<128, 4, 1, 32, 4, 1, 64>,
     "dkdv 4w BNK64 BMQ64, dq 4w x2 BM128 BN32", "dkdv 4w BNK64 BMQ32, dq 4w BM64 BN64"},
    {launch_bwd<32, 8, 1, 64, 8, 1, 64>, launch_bwd<64, 8, 1, 64, 8, 1, 64>, launch_bwd<128, 8, 1, 32, 8, 1, 64>,
     "dkdv 8w BNK128 BMQ64, dq 8w BM128 BN64", "dkdv 8w BNK128 BMQ32, dq 8w BM128 BN64"},
    {launch_bwd<32, 4, 2, 32, 4, 2, 32>, launch_bwd<64, 4, 2, 32, 4, 2, 32>, launch_bwd<128, 4, 1, 16, 4, 2, 32>,
     "dkdv 4w x2 BNK128 BMQ32, dq 4w x2 BM128 BN32", "dkdv 4w BNK64 BMQ16, dq 4w x2 BM128 BN32"},
    {launch_bwd<32, 2, 2, 32, 2, 2, 32>, launch_bwd<64, 2, 2, 32, 2, 2, 32>, launch_bwd<128, 2, 1, 32, 4, 2, 16>,
     "dkdv 2w x2 BNK64 BMQ32, dq 2w x2 BM64 BN32", "dkdv 2w BNK32 BMQ32, dq 4w x2 BM128 BN16"},
};

}  // namespace

// The tensor-core tiling for (D, kernel choice), -1 when the generic fallback
// runs. Variant 0 is the tuned default; 1..4 are the alternatives the test checks
// and times (tests/gpu/test_attention.cu), kept so a new GPU can be re-tuned.
int attention_variant(int64_t D) {
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
  const LocalFwdParams p{{out, lse}, q, k, v, {doc_start_scratch, int(N)}, int(H), int(KV),
                         int(H / KV), scale_log2_of(D)};
  const int variant = attention_variant(D);
  if (variant < 0) {
    generic_fwd_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(p, int(D), scale_of(D));
  } else {
    kFwdTilings[variant].for_dim(D)(p, stream);
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
  const LocalBwdParams p{{dq, dk, dv}, dout, q, k, v, lse, delta_scratch, {doc_start_scratch, int(N)},
                         int(H), int(KV), int(H / KV), scale_of(D), scale_log2_of(D)};
  const int variant = attention_variant(D);
  if (variant < 0) {
    generic_dq_kernel<<<row_blocks(N * H), kRowWarps * 32, 0, stream>>>(p, int(D));
    CUDA_CHECK(cudaGetLastError());
    generic_dkdv_kernel<<<row_blocks(N * KV), kRowWarps * 32, 0, stream>>>(p, int(D));
  } else {
    kBwdTilings[variant].for_dim(D)(p, stream);
  }
  CUDA_CHECK(cudaGetLastError());
}

void attention_set_kernel(AttentionKernel kernel) { g_kernel = kernel; }

const char* attention_kernel_name(int64_t D) {
  static thread_local std::string name;
  const int variant = attention_variant(D);
  if (variant < 0) {
    name = "generic (warp per row, fp32 dot products)";
  } else {
    const auto& fwd = kFwdTilings[variant];
    const auto& bwd = kBwdTilings[variant];
    name = std::string("fwd ") + (D == 128 ? fwd.name128 : fwd.name) + " | " + (D == 128 ? bwd.name128 : bwd.name);
  }
  return name.c_str();
}

}  // namespace shardlm::cuda
