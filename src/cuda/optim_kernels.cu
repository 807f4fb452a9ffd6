// optim_kernels.cu — AdamW and SGD on flat fp32 shards and the clipping factor, the
// CPU optimizer's arithmetic to the last bit; the contract is in optim_kernels.hpp,
// precision and bytes moved in docs/kernels.md.
#include "cuda/optim_kernels.hpp"
#include "cuda/check.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <climits>
#include <cmath>
#include <initializer_list>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

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

}  // namespace

// ================================================================ launchers

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

}  // namespace shardlm::cuda
