// sampling.cu — temperature / top-k / top-p sampling on the GPU (see sampling.hpp).
//
// A row's tokens are ordered by a 64-bit rank: the logit's bits in an
// order-preserving unsigned form above, the complement of the id below, so the
// larger rank is the larger logit, or the lower id among equal logits: the
// Sampler's order, a strict one. A round takes the next `want` ranks below a
// cut: a most-significant-digit radix select (8 bits a pass, per-warp
// histograms) narrows the range until everything from the top of the range
// down to the bin holding the want-th rank fits the round's buffer; those are
// gathered, sorted (bitonic, in shared memory) and cut to `want`.
#include "cuda/check.hpp"
#include "cuda/sampling.hpp"
#include "kernel_common.cuh"

#include <cmath>

namespace shardlm::cuda {

namespace {

using namespace dev;  // block_reduce, SumOp, kFullMask

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kRound = kSampleRound;
constexpr int kMaxRounds = 160;  // rounds of a whole row: V <= kMaxRounds * kRound

__device__ __forceinline__ uint32_t logit_key(float x) {
  if (x == 0.f) x = 0.f;  // -0 and +0 are one logit, as on the host
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_logit(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ uint64_t rank_of(float x, int64_t v) {
  return (uint64_t(logit_key(x)) << 32) | uint64_t(0xffffffffu - uint32_t(v));
}
__device__ __forceinline__ int32_t rank_id(uint64_t r) { return int32_t(0xffffffffu - uint32_t(r)); }
__device__ __forceinline__ float rank_logit(uint64_t r) { return key_logit(uint32_t(r >> 32)); }

struct U64Max {
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};

struct Shared {
  uint32_t hist[kWarps][256];     // per-warp digit counts of a radix pass
  uint32_t bins[256];             // their sums
  uint64_t rank[kRound];          // a round's ranks, most probable first once sorted
  double weight[kRound];          // their exp((logit - max) / T)
  uint64_t round_cut[kMaxRounds];   // round r takes the ranks below this
  double round_end[kMaxRounds];     // the running sum after round r
  int32_t round_count[kMaxRounds];  // tokens in round r
  uint64_t red_u[kWarps];
  double red_d[kWarps];
  double scan_d[kWarps];
  int rounds_built, loaded;       // rounds in the table; the one rank[] holds (-1: none)
  uint32_t gathered;
  uint64_t lo, hi;                // the radix pass's range [lo, hi) of ranks
  uint32_t above;                 // ranks in [hi, cut): taken for sure
  int digit, fits;                // a pass's verdict
};

// Fills s.rank[0 .. count) with the `want` largest ranks below `cut` (fewer when
// fewer remain), most probable first; returns count. want in [1, kRound].
__device__ int extract_round(Shared& s, const float* x, int64_t V, uint64_t cut, int want) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s.lo = 0, s.hi = cut, s.above = 0;  // hi = cut: [lo, hi) is below the cut
  __syncthreads();
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = tid; i < kWarps * 256; i += kThreads) (&s.hist[0][0])[i] = 0;
    __syncthreads();
    const uint64_t lo = s.lo, hi = s.hi;
    for (int64_t base = 0; base < V; base += kThreads) {
      const int64_t v = base + tid;
      uint64_t r = 0;
      bool in = false;
      if (v < V) r = rank_of(x[v], v), in = r >= lo && r < hi;
      const unsigned active = __ballot_sync(kFullMask, in);
      if (in) {
        const unsigned d = unsigned(r >> shift) & 255u;
        const unsigned peers = __match_any_sync(active, d);
        if (lane == __ffs(peers) - 1) atomicAdd(&s.hist[warp][d], uint32_t(__popc(peers)));  // the warp's own row
      }
    }
    __syncthreads();
    if (tid < 256) {
      uint32_t c = 0;
      for (int w = 0; w < kWarps; ++w) c += s.hist[w][tid];
      s.bins[tid] = c;
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255 - 8l down to 248 - 8l: the lanes in rank order.
      uint32_t mine = 0;
      for (int j = 0; j < 8; ++j) mine += s.bins[255 - 8 * lane - j];
      uint32_t incl = mine;
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t up = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += up;
      }
      const uint32_t before = s.above + incl - mine;
      const bool crosses = before < uint32_t(want) && before + mine >= uint32_t(want);
      const unsigned who = __ballot_sync(kFullMask, crosses);
      if (who == 0) {
        if (lane == 0) s.digit = -1;  // fewer than want remain: take the whole range
      } else if (lane == __ffs(who) - 1) {
        uint32_t acc = before;
        int d = 255 - 8 * lane;
        while (acc + s.bins[d] < uint32_t(want)) acc += s.bins[d--];
        // Everything from the top of the range through bin d fits the buffer: gather it.
        // Otherwise narrow the range to bin d.
        const uint64_t bin_lo = s.lo + (uint64_t(d) << shift);
        s.fits = acc + s.bins[d] <= uint32_t(kRound);
        if (s.fits) {
          s.lo = bin_lo;
        } else {
          // Ranks in [hi, cut) stay counted in `above`: bin d's top never passes the cut.
          const uint64_t last = bin_lo + ((uint64_t(1) << shift) - 1);  // bin d's largest rank (no overflow)
          s.above = acc;
          if (last < s.hi - 1) s.hi = last + 1;
          s.lo = bin_lo;
        }
        s.digit = d;
      }
    }
    __syncthreads();
    if (s.digit < 0 || s.fits) break;
  }
  // Gather [lo, cut): at most kRound ranks (the last pass's bins hold one rank each).
  if (tid == 0) s.gathered = 0;
  __syncthreads();
  const uint64_t lo = s.lo;
  for (int64_t v = tid; v < V; v += kThreads) {
    const uint64_t r = rank_of(x[v], v);
    if (r >= lo && r < cut) s.rank[atomicAdd(&s.gathered, 1u)] = r;
  }
  __syncthreads();
  const int count = int(s.gathered);
  int size = 2;
  while (size < count) size <<= 1;
  for (int i = count + tid; i < size; i += kThreads) s.rank[i] = 0;  // below every real rank
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < size; i += kThreads) {
        const int p = i ^ j;
        if (p > i) {
          const uint64_t a = s.rank[i], b = s.rank[p];
          if (((i & k) == 0) ? a < b : a > b) s.rank[i] = b, s.rank[p] = a;
        }
      }
      __syncthreads();
    }
  }
  return count < want ? count : want;
}


// Round r of the kept order into s.rank / s.weight: built when it is the next
// one (its running sum recorded), reloaded when another round sits there.
// Returns its token count (0: the order has no more tokens within `limit`).
__device__ int load_round(Shared& s, const float* x, int64_t V, int r, int64_t limit, float m, double T) {
  __syncthreads();
  if (s.loaded == r) return s.round_count[r];
  const bool fresh = r == s.rounds_built;
  int want;
  if (fresh) {
    int64_t taken = 0;
    for (int q = 0; q < r; ++q) taken += s.round_count[q];
    const int64_t left = limit - taken;
    if (left <= 0 || r >= kMaxRounds) return 0;
    want = left < kRound ? int(left) : kRound;
  } else {
    want = s.round_count[r];
  }
  const uint64_t cut = r == 0 ? ~uint64_t(0) : s.round_cut[r];
  const int n = extract_round(s, x, V, cut, want);
  for (int i = threadIdx.x; i < n; i += kThreads)
    s.weight[i] = exp((double(rank_logit(s.rank[i])) - double(m)) / T);
  __syncthreads();
  if (threadIdx.x == 0) {
    s.loaded = n > 0 ? r : -1;  // an empty extraction still overwrote the buffer
    if (fresh && n > 0) {
      double sum = r == 0 ? 0.0 : s.round_end[r - 1];
      for (int i = 0; i < n; ++i) sum += s.weight[i];  // in order, as the host sums
      s.round_end[r] = sum;
      s.round_count[r] = n;
      if (r + 1 < kMaxRounds) s.round_cut[r + 1] = s.rank[n - 1];
      s.rounds_built = r + 1;
    }
  }
  __syncthreads();
  return n;
}

struct IntMin {
  __device__ __forceinline__ int operator()(int a, int b) const { return a < b ? a : b; }
};

// Inclusive prefix sum over the block in thread order (fixed order: a
// shuffle scan in each warp, then the warp totals); `total` gets the block's sum.
__device__ double block_scan(double v, Shared& s, double& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += up;
  }
  __syncthreads();
  if (lane == 31) s.scan_d[warp] = v;
  __syncthreads();
  double before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = total;
    total += s.scan_d[w];
  }
  return before + v;
}

// No truncation: the host draws in id order; so does this, over the whole row.
__device__ void sample_in_id_order(Shared& s, const float* x, int64_t V, float m, double T, double u, int32_t* token,
                                   float* logprob) {
  const int tid = threadIdx.x;
  double part = 0;
  for (int64_t v = tid; v < V; v += kThreads) part += exp((double(x[v]) - double(m)) / T);
  const double mass = block_reduce<kThreads>(part, SumOp{}, s.red_d);
  const double target = u * mass;
  double running = 0;
  int64_t chosen = V - 1;  // rounding can leave the target past the last partial sum
  for (int64_t base = 0; base < V; base += kThreads) {
    const int64_t v = base + tid;
    const double w = v < V ? exp((double(x[v]) - double(m)) / T) : 0.0;
    double chunk = 0;
    const double incl = block_scan(w, s, chunk);
    const int first = block_reduce<kThreads>((v < V && target < running + incl) ? tid : kThreads, IntMin{},
                                             reinterpret_cast<int*>(s.red_u));
    if (first < kThreads) {
      chosen = base + first;
      break;
    }
    running += chunk;
  }
  if (tid == 0) {
    *token = int32_t(chosen);
    *logprob = float(log(exp((double(x[chosen]) - double(m)) / T) / mass));
  }
}

__global__ void __launch_bounds__(kThreads, 1)
sample_kernel(int32_t* __restrict__ tokens, float* __restrict__ logprobs, const float* __restrict__ logits,
              const double* __restrict__ uniforms, int64_t V, double T, int64_t top_k, double top_p) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;

  // The largest rank: the argmax (the lower id on ties) and the max logit.
  uint64_t best = 0;
  for (int64_t v = tid; v < V; v += kThreads) {
    const uint64_t r = rank_of(x[v], v);
    best = r > best ? r : best;
  }
  best = block_reduce<kThreads>(best, U64Max{}, s.red_u);
  if (T == 0) {
    if (tid == 0) tokens[row] = rank_id(best), logprobs[row] = 0.f;
    return;
  }
  const float m = rank_logit(best);
  const double u = uniforms[row];
  const bool by_k = top_k > 0 && top_k < V;
  if (!by_k && !(top_p < 1)) {
    sample_in_id_order(s, x, V, m, T, u, tokens + row, logprobs + row);
    return;
  }
  const int64_t limit = by_k ? top_k : V;
  if (tid == 0) s.rounds_built = 0, s.loaded = -1;

  // The mass top-p is a fraction of: the top-k set's, summed in order as the
  // host does; without top-k the whole row's (a tree sum; the host sums in order).
  double mass = 0;
  if (by_k) {
    for (int r = 0; load_round(s, x, V, r, limit, m, T) > 0; ++r) {
    }
    mass = s.round_end[s.rounds_built - 1];
  } else {
    double part = 0;
    for (int64_t v = tid; v < V; v += kThreads) part += exp((double(x[v]) - double(m)) / T);
    mass = block_reduce<kThreads>(part, SumOp{}, s.red_d);
  }

  // The kept set: the order up to (kept_round, kept_index) and its mass.
  __shared__ int kept_round, kept_index, pick_round, pick_index;
  __shared__ double kept_mass;
  if (tid == 0) {
    kept_round = s.rounds_built - 1;
    kept_index = by_k ? s.round_count[kept_round] - 1 : -1;
    kept_mass = mass;
  }
  __syncthreads();
  if (top_p < 1) {
    const double want = top_p * mass;
    if (tid == 0) kept_index = -1;
    for (int r = 0;; ++r) {
      const int n = load_round(s, x, V, r, limit, m, T);
      if (n == 0) break;  // the sums in order never reached `want` (rounding): everything is kept
      if (tid == 0) {
        double sum = r == 0 ? 0.0 : s.round_end[r - 1];
        kept_round = r, kept_index = n - 1, kept_mass = s.round_end[r];
        for (int i = 0; i < n; ++i) {
          sum += s.weight[i];
          if (sum >= want) {
            kept_index = i, kept_mass = sum;
            break;
          }
        }
      }
      __syncthreads();
      if (kept_mass >= want) break;
    }
  }

  // The draw: the first kept token whose running sum passes u * kept_mass.
  const double target = u * kept_mass;
  if (tid == 0) pick_round = kept_round, pick_index = kept_index;
  __syncthreads();
  int r = 0;
  while (r < kept_round && s.round_end[r] <= target) ++r;
  load_round(s, x, V, r, limit, m, T);
  if (tid == 0) {
    const int last = r == kept_round ? kept_index : s.round_count[r] - 1;
    double sum = r == 0 ? 0.0 : s.round_end[r - 1];
    for (int i = 0; i <= last; ++i) {
      sum += s.weight[i];
      if (target < sum) {
        pick_round = r, pick_index = i;
        break;
      }
    }
  }
  __syncthreads();
  load_round(s, x, V, pick_round, limit, m, T);
  if (tid == 0) {
    tokens[row] = rank_id(s.rank[pick_index]);
    logprobs[row] = float(log(s.weight[pick_index] / kept_mass));
  }
}

}  // namespace

void sample_rows(int32_t* tokens, float* sampling_logprobs, const float* logits, const double* uniforms, int64_t n,
                 int64_t V, double temperature, int64_t top_k, double top_p, cudaStream_t stream) {
  if (n == 0) return;
  SHARDLM_CHECK(n <= INT32_MAX && V >= 1 && V <= int64_t(kMaxRounds) * kRound,
                "sample_rows: %lld rows of %lld logits (at most %lld a row)", (long long)n, (long long)V,
                (long long)kMaxRounds * kRound);
  SHARDLM_CHECK(std::isfinite(temperature) && temperature >= 0 && top_k >= 0 && top_p > 0 && top_p <= 1,
                "sample_rows: temperature %g, top_k %lld, top_p %g", temperature, (long long)top_k, top_p);
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Shared))));
    return true;
  }();
  (void)configured;
  sample_kernel<<<unsigned(n), kThreads, sizeof(Shared), stream>>>(tokens, sampling_logprobs, logits, uniforms, V,
                                                                   temperature, top_k, top_p);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
