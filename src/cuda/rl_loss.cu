// rl_loss.cu — the RL policy loss kernel and its launcher; see
// src/cuda/rl_loss.hpp for the contract, src/cpu/rl_loss.hpp for
// the formula (cpu::rl_loss_forward_backward is the reference) and docs/kernels.md
// for precision, determinism and bytes moved.
#include "cuda/rl_loss.hpp"
#include "cpu/rl_terms.hpp"
#include "kernel_common.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cmath>

namespace shardlm::cuda {

namespace {

namespace cg = cooperative_groups;
using namespace dev;  // Pack, f32, to_bf16, block_reduce, SumOp (kernel_common.cuh)

constexpr int kRlThreads = 512;          // per CTA of the loss kernel
constexpr int kRlLoadBatch = 4;          // 16-byte loads in flight per thread while filling smem
constexpr int kRlSumThreads = 256;       // per block of the chunk-sum kernel

// One row per cluster of csize CTAs; CTA `rank` keeps columns [rank * chunk, ...)
// of the row in shared memory, so the logits are read from HBM once and written
// once. The row max (fp32) and the two sums sum_c e_c and sum_c e_c d_c (double,
// d_c = (x_c - max) / tau, e_c = exp(d_c) in fp32) are combined across
// the cluster through distributed shared memory in rank order; then thread 0 of
// every CTA forms the same row scalars from the same bits (logp, entropy, then
// cpu::rl_row_terms: ratio, mask or clip, importance weight, d loss / d logp and
// d loss / d H) and every CTA writes its gradient slice from shared memory.
template <int VEC>
__global__ void __launch_bounds__(kRlThreads, 2)
rl_loss_kernel(bf16* __restrict__ logits, double* __restrict__ row_stats,
               const int32_t* __restrict__ targets, const float* __restrict__ weights, RlTokenInputs in,
               RlLossParams p, float grad_scale, int64_t n, int64_t V, int64_t chunk) {
  using Vec = Pack<bf16, VEC>;
  extern __shared__ __align__(16) unsigned char rl_smem[];
  Vec* slice = reinterpret_cast<Vec*>(rl_smem);  // (chunk / VEC) this CTA's columns
  __shared__ float warp_max[kRlThreads / 32];
  __shared__ double warp_sum[kRlThreads / 32];
  __shared__ float cta_max;                 // read by the other CTAs of the cluster
  __shared__ double cta_sum, cta_sum_ed;    // likewise
  __shared__ float grad_exp_scale, grad_target_add, grad_entropy_scale, grad_entropy_shift;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int csize = int(cluster.num_blocks());
  const int64_t row = blockIdx.x / csize;
  bf16* x = logits + row * V;
  const int64_t c0 = min(V, rank * chunk), c1 = min(V, c0 + chunk);
  const int nvec = int((c1 - c0) / VEC);
  const int tid = threadIdx.x;
  double* out = row_stats + row;  // field f of this row at out[f * n]

  const int32_t y = targets[row];
  const float w = weights ? weights[row] : 1.0f;
  const bool loss_row = y >= 0 && w > 0.0f;
  const float tau = loss_row ? in.temperatures[row] : 1.0f;
  const bool valid = loss_row && y < V && isfinite(tau) && tau > 0.0f;
  if (!valid) {  // the same for the whole cluster: no CTA reaches a cluster barrier
    Vec zero;
    zero.raw = {};
    for (int i = tid; i < nvec; i += kRlThreads) zero.store(x + c0 + int64_t(i) * VEC);
    if (rank == 0 && tid == 0) {
      const double nan = __longlong_as_double(0x7ff8000000000000ll);
      // A loss row with a bad target or temperature: NaN loss, entropy and KL.
      out[0 * n] = loss_row ? nan : 0.0;
      out[1 * n] = loss_row ? 1.0 : 0.0;
      out[2 * n] = 0.0;
      out[3 * n] = 0.0;
      out[4 * n] = loss_row ? nan : 0.0;
      out[5 * n] = loss_row ? nan : 0.0;
      out[6 * n] = loss_row ? double(in.advantages[row]) : 0.0;
      out[7 * n] = 0.0;
      out[8 * n] = 0.0;
      out[9 * n] = 0.0;
      out[10 * n] = loss_row && in.ref_logprobs ? nan : 0.0;
    }
    return;
  }
  // Read before the first cluster barrier: no CTA writes the row before the second.
  const float x_target = tid == 0 ? f32(x[y]) : 0.0f;

  // Pass 1: HBM -> shared memory, and the row max.
  const float row_max =
      slice_to_smem_row_max<VEC, kRlThreads, kRlLoadBatch>(x + c0, nvec, slice, warp_max, &cta_max, cluster);

  // Pass 2: sum of e and of e * d (the entropy): each vector's VEC terms in fp32,
  // the vectors' partials in double (one conversion per vector, not per element:
  // the fp64 conversions would otherwise bound the kernel). d uses 1 / tau: a
  // multiply instead of an IEEE division per element (exact when tau = 1; else
  // within an ulp of the CPU's (x - max) / tau). e = __expf(d), as the
  // cross-entropy: its error, 2 + 1.16 |d| ulp, is ~2 ulp on the terms near the
  // max that make up the sum, and far below bf16 resolution in the gradient;
  // the accurate expf costs 12% more time here.
  const float inv_tau = 1.0f / tau;
  double s = 0.0, s_ed = 0.0;
  for (int i = tid; i < nvec; i += kRlThreads) {
    const Vec v = slice[i];
    float vs = 0.0f, vs_ed = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = (f32(v.v[j]) - row_max) * inv_tau;
      const float e = __expf(d);
      vs += e;
      vs_ed = fmaf(e, d, vs_ed);
    }
    s += double(vs);
    s_ed += double(vs_ed);
  }
  s = block_reduce<kRlThreads>(s, SumOp{}, warp_sum);
  s_ed = block_reduce<kRlThreads>(s_ed, SumOp{}, warp_sum);
  if (tid == 0) {
    cta_sum = s;
    cta_sum_ed = s_ed;
  }
  cluster.sync();

  if (tid == 0) {  // the row's scalars, the same bits in every CTA of the cluster
    double row_sum = 0.0, row_sum_ed = 0.0;
    for (int r = 0; r < csize; ++r) {
      row_sum += *cluster.map_shared_rank(&cta_sum, r);
      row_sum_ed += *cluster.map_shared_rank(&cta_sum_ed, r);
    }
    const double log_sum = log(row_sum);
    const double entropy = log_sum - row_sum_ed / row_sum;  // H = log_sum - sum(e d) / sum
    const float d_target = (x_target - row_max) / tau;  // the CPU's float, bit for bit
    // logp rounded to float before log r is formed, as the CPU (T = float) does.
    const double logp = double(float(double(d_target) - log_sum));
    const double lp_inf = in.inference_logprobs[row];
    const bool gspo_sums = p.objective == RlObjective::Gspo && p.is_level == IsLevel::None;
    const cpu::RlRowTerms k = cpu::rl_row_terms(
        p, logp, entropy, double(w), double(in.advantages[row]), lp_inf,
        in.sampling_logprobs ? double(in.sampling_logprobs[row]) : lp_inf, gspo_sums ? in.sequence_log_ratio[row] : 0.0,
        p.is_level == IsLevel::Sequence ? in.sequence_log_is[row] : 0.0,
        p.ref_kl_coef != 0.0 && in.ref_logprobs ? double(in.ref_logprobs[row]) : 0.0);
    const double coef = double(grad_scale) * k.dloss_dlogp / double(tau);
    const double entropy_coef = double(grad_scale) * k.dloss_dentropy / double(tau);
    grad_exp_scale = float(-coef / row_sum);
    grad_target_add = float(coef);
    grad_entropy_scale = float(-entropy_coef / row_sum);
    grad_entropy_shift = float(entropy - log_sum);  // log p_c + H = d_c + shift
    if (rank == 0) {
      out[0 * n] = k.loss;
      out[1 * n] = 1.0;
      out[2 * n] = k.masked_high ? 1.0 : 0.0;
      out[3 * n] = k.masked_low ? 1.0 : 0.0;
      out[4 * n] = entropy;
      out[5 * n] = k.mismatch_kl;
      out[6 * n] = double(in.advantages[row]);
      out[7 * n] = k.is_ratio;
      out[8 * n] = k.is_capped ? 1.0 : 0.0;
      out[9 * n] = k.is_masked ? 1.0 : 0.0;
      out[10 * n] = k.ref_kl;
    }
  }
  __syncthreads();

  // Pass 3: dlogits = coef * (onehot - softmax) = e * (-coef / sum) (+ coef at y);
  // with the entropy bonus also - entropy_coef * softmax * (log softmax + H)
  // = e * (-entropy_coef / sum) * (d + H - log_sum).
  const float exp_scale = grad_exp_scale, target_add = grad_target_add;
  const float entropy_scale = grad_entropy_scale, entropy_shift = grad_entropy_shift;
  const bool entropy_grad = p.entropy_coef != 0.0;  // the same in every thread: no divergence
  for (int i = tid; i < nvec; i += kRlThreads) {
    const Vec v = slice[i];
    Vec g;
    const int64_t col0 = c0 + int64_t(i) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float dc = (f32(v.v[j]) - row_max) * inv_tau;
      float d = entropy_grad ? __fmul_rn(__expf(dc), fmaf(entropy_scale, dc + entropy_shift, exp_scale))
                             : __fmul_rn(__expf(dc), exp_scale);
      if (col0 + j == y) d = __fadd_rn(d, target_add);
      g.v[j] = to_bf16(d);
    }
    g.store(x + col0);
  }
  cluster.sync();  // no CTA may exit while another still reads its cta_max / cta_sum
}

// stats[f] (+)= sum over the chunk's rows of row_stats[f * n + row]: one block per
// field, each thread a fixed strided subset in row order, then the fixed block tree.
__global__ void __launch_bounds__(kRlSumThreads)
rl_stats_sum_kernel(double* __restrict__ stats, const double* __restrict__ row_stats, int64_t n,
                    bool accumulate) {
  __shared__ double warp_sum[kRlSumThreads / 32];
  const double* field = row_stats + int64_t(blockIdx.x) * n;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kRlSumThreads) s += field[i];
  s = block_reduce<kRlSumThreads>(s, SumOp{}, warp_sum);
  if (threadIdx.x == 0) stats[blockIdx.x] = accumulate ? stats[blockIdx.x] + s : s;
}

// rl_token_logprobs: one block per row, reading the row twice (the max, then
// the sum of exp((x - max) / tau) in double per thread, the fixed block tree).
constexpr int kLogprobThreads = 256;

__global__ void __launch_bounds__(kLogprobThreads)
rl_token_logprobs_kernel(float* __restrict__ out, const bf16* __restrict__ logits, const int32_t* __restrict__ targets,
                         const float* __restrict__ temperatures, int64_t V) {
  __shared__ float warp_max[kLogprobThreads / 32];
  __shared__ double warp_sum[kLogprobThreads / 32];
  const int64_t row = blockIdx.x;
  const int32_t y = targets[row];
  if (y < 0) {
    if (threadIdx.x == 0) out[row] = 0.0f;
    return;
  }
  const float tau = temperatures[row];
  if (y >= V || !(isfinite(tau) && tau > 0.0f)) {  // the CPU throws; the loader validates both
    if (threadIdx.x == 0) out[row] = __int_as_float(0x7fc00000);
    return;
  }
  const bf16* x = logits + row * V;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < V; c += kLogprobThreads) m = fmaxf(m, f32(x[c]));
  m = block_reduce<kLogprobThreads>(m, MaxOp{}, warp_max);
  const float inv_tau = 1.0f / tau;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < V; c += kLogprobThreads) s += double(__expf((f32(x[c]) - m) * inv_tau));
  s = block_reduce<kLogprobThreads>(s, SumOp{}, warp_sum);
  if (threadIdx.x == 0) out[row] = float(double((f32(x[y]) - m) / tau) - log(s));
}

}  // namespace

void rl_token_logprobs(float* out, const bf16* logits, const int32_t* targets, const float* temperatures, int64_t n,
                       int64_t V, cudaStream_t stream) {
  SHARDLM_CHECK(n >= 0 && n <= INT_MAX && V > 0, "rl_token_logprobs: %lld rows of %lld logits", (long long)n,
                (long long)V);
  if (n == 0) return;
  rl_token_logprobs_kernel<<<unsigned(n), kLogprobThreads, 0, stream>>>(out, logits, targets, temperatures, V);
  CUDA_CHECK(cudaGetLastError());
}

size_t rl_loss_row_stats_bytes(int64_t n) {
  return size_t(kRlStatsFields) * size_t(std::max<int64_t>(n, 0)) * sizeof(double);
}

void rl_loss_forward_backward(bf16* logits, double* row_stats, double* stats, const int32_t* targets,
                              const float* weights, const RlTokenInputs& inputs, const cpu::RlLossParams& params,
                              float grad_scale, int64_t n, int64_t V, bool accumulate, cudaStream_t stream) {
  const char* op = "rl_loss_forward_backward";
  SHARDLM_CHECK(n >= 0 && n <= INT_MAX / kRowClusterMax, "%s: n = %lld is outside [0, %d]", op,
                static_cast<long long>(n), INT_MAX / kRowClusterMax);
  SHARDLM_CHECK(V > 0 && V <= INT_MAX, "%s: V = %lld is outside [1, %d]", op, static_cast<long long>(V),
                INT_MAX);
  if (n == 0) {  // no rows: the sums are zero
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(stats, 0, sizeof(double) * kRlStatsFields, stream));
    return;
  }
  const bool vec = V % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  // The cross-entropy's split (cross_entropy.cu), so the same V gives the same slices.
  const RowClusterSplit split = row_cluster_split(V, vec ? 8 : 1, op);
  const RowClusterLaunch launch(split, n, kRlThreads, stream);
  const bool gspo_sums = params.objective == RlObjective::Gspo && params.is_level == IsLevel::None;
  SHARDLM_CHECK((!gspo_sums || inputs.sequence_log_ratio) &&
                    (params.is_level != IsLevel::Sequence || inputs.sequence_log_is),
                "internal: %s without the sample sums its objective or importance weights need", op);
  if (vec) {
    CUDA_CHECK(cudaFuncSetAttribute(rl_loss_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, rl_loss_kernel<8>, logits, row_stats, targets, weights, inputs, params,
                                  grad_scale, n, V, split.chunk));
  } else {
    CUDA_CHECK(cudaFuncSetAttribute(rl_loss_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, rl_loss_kernel<1>, logits, row_stats, targets, weights, inputs, params,
                                  grad_scale, n, V, split.chunk));
  }
  CUDA_CHECK(cudaGetLastError());
  rl_stats_sum_kernel<<<kRlStatsFields, kRlSumThreads, 0, stream>>>(stats, row_stats, n, accumulate);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
