// rl_loss.cu — the RL policy loss kernel and its launcher; see
// src/cuda/rl_loss.hpp for the contract, src/cpu/rl_loss.hpp for
// the formula (cpu::rl_loss_forward_backward is the reference) and docs/kernels.md
// for precision, determinism and bytes moved.
#include "cuda/rl_loss.hpp"
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

struct RlKernelParams {
  double mask_high, mask_low, kl_coef, ce_coef;
  float grad_scale;
  bool clipped;                // the clipped surrogate instead of the masked objective
  double clip_low, clip_high;
};

// One row per cluster of csize CTAs; CTA `rank` keeps columns [rank * chunk, ...)
// of the row in shared memory, so the logits are read from HBM once and written
// once. The row max (fp32) and the two sums sum_c e_c and sum_c e_c d_c (double,
// d_c = (x_c - max) / tau, e_c = exp(d_c) in fp32) are combined across
// the cluster through distributed shared memory in rank order; then thread 0 of
// every CTA forms the same row scalars from the same bits (logp, ratio, mask,
// d loss / d logp) and every CTA writes its gradient slice from shared memory.
template <int VEC>
__global__ void __launch_bounds__(kRlThreads, 2)
rl_loss_kernel(bf16* __restrict__ logits, double* __restrict__ row_stats,
               const int32_t* __restrict__ targets, const float* __restrict__ weights,
               const float* __restrict__ advantages, const float* __restrict__ inference_logprobs,
               const float* __restrict__ temperatures, RlKernelParams p, int64_t n, int64_t V,
               int64_t chunk) {
  using Vec = Pack<bf16, VEC>;
  extern __shared__ __align__(16) unsigned char rl_smem[];
  Vec* slice = reinterpret_cast<Vec*>(rl_smem);  // (chunk / VEC) this CTA's columns
  __shared__ float warp_max[kRlThreads / 32];
  __shared__ double warp_sum[kRlThreads / 32];
  __shared__ float cta_max;                 // read by the other CTAs of the cluster
  __shared__ double cta_sum, cta_sum_ed;    // likewise
  __shared__ float grad_exp_scale, grad_target_add;

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
  const float tau = loss_row ? temperatures[row] : 1.0f;
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
      out[6 * n] = loss_row ? double(advantages[row]) : 0.0;
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
    const float d_target = (x_target - row_max) / tau;  // the CPU's float, bit for bit
    // logp rounded to float before log r is formed, as the CPU (T = float) does.
    const double logp = double(float(double(d_target) - log_sum));
    const double A = advantages[row];
    const double lp_inf = inference_logprobs[row];
    const double log_r = logp - lp_inf;
    const double ratio = exp(log_r);
    const double dp = exp(logp) - exp(lp_inf);  // p_train - p_inference
    bool masked_high, masked_low;
    double pg, dpg_dlogp;  // the policy term and its derivative in logp (d r / d logp = r)
    if (p.clipped) {
      // -min(r A, clip(r) A), the CPU's branches: the clipped term is the smaller
      // exactly when the clip is active against the update; constant there.
      masked_high = A > 0 && ratio > 1.0 + p.clip_high;
      masked_low = A < 0 && ratio < 1.0 - p.clip_low;
      const double clipped_ratio = masked_high ? 1.0 + p.clip_high : masked_low ? 1.0 - p.clip_low : ratio;
      pg = -A * clipped_ratio;
      dpg_dlogp = (masked_high || masked_low) ? 0.0 : -A * ratio;
    } else {
      masked_high = A > 0 && dp > p.mask_high;
      masked_low = A <= 0 && dp < -p.mask_low;
      // A branch, not a 0/1 factor: a masked token may have ratio = inf.
      pg = (masked_high || masked_low) ? 0.0 : -A * ratio;
      dpg_dlogp = pg;
    }
    const double wd = double(w);
    const double dloss_dlogp = wd * (dpg_dlogp + 2.0 * p.kl_coef * log_r) - p.ce_coef * wd;
    const double coef = double(p.grad_scale) * dloss_dlogp / double(tau);
    grad_exp_scale = float(-coef / row_sum);
    grad_target_add = float(coef);
    if (rank == 0) {
      out[0 * n] = wd * (pg + p.kl_coef * log_r * log_r) - p.ce_coef * wd * logp;
      out[1 * n] = 1.0;
      out[2 * n] = masked_high ? 1.0 : 0.0;
      out[3 * n] = masked_low ? 1.0 : 0.0;
      out[4 * n] = log_sum - row_sum_ed / row_sum;  // H = log_sum - sum(e d) / sum
      out[5 * n] = expm1(log_r) - log_r;            // k3 = r - log r - 1 without cancellation
      out[6 * n] = A;
    }
  }
  __syncthreads();

  // Pass 3: dlogits = coef * (onehot - softmax) = e * (-coef / sum) (+ coef at y).
  const float exp_scale = grad_exp_scale, target_add = grad_target_add;
  for (int i = tid; i < nvec; i += kRlThreads) {
    const Vec v = slice[i];
    Vec g;
    const int64_t col0 = c0 + int64_t(i) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float d = __fmul_rn(__expf((f32(v.v[j]) - row_max) * inv_tau), exp_scale);
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

}  // namespace

size_t rl_loss_row_stats_bytes(int64_t n) {
  return size_t(kRlStatsFields) * size_t(std::max<int64_t>(n, 0)) * sizeof(double);
}

void rl_loss_forward_backward(bf16* logits, double* row_stats, double* stats, const int32_t* targets,
                              const float* weights, const float* advantages,
                              const float* inference_logprobs, const float* temperatures,
                              const cpu::RlLossParams& params, float grad_scale, int64_t n,
                              int64_t V, bool accumulate, cudaStream_t stream) {
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
  const RlKernelParams p{params.mask_high, params.mask_low, params.kl_coef, params.ce_coef, grad_scale,
                         params.clipped,   params.clip_low, params.clip_high};
  if (vec) {
    CUDA_CHECK(cudaFuncSetAttribute(rl_loss_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, rl_loss_kernel<8>, logits, row_stats, targets, weights, advantages,
                                  inference_logprobs, temperatures, p, n, V, split.chunk));
  } else {
    CUDA_CHECK(cudaFuncSetAttribute(rl_loss_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, rl_loss_kernel<1>, logits, row_stats, targets, weights, advantages,
                                  inference_logprobs, temperatures, p, n, V, split.chunk));
  }
  CUDA_CHECK(cudaGetLastError());
  rl_stats_sum_kernel<<<kRlStatsFields, kRlSumThreads, 0, stream>>>(stats, row_stats, n, accumulate);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
