// elementwise.cu — the ops that touch each element (or each rotated pair) once: RoPE,
// SwiGLU, and the fp32 cast / accumulate / scale helpers; the contract is in ops.hpp,
// precision and bytes moved in docs/kernels.md.
#include "cuda/ops.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <climits>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

// ---------------------------------------------------------------- RoPE

constexpr int kRopeHeadsPerThread = 4;  // cos/sin computed once, applied to 4 heads
// Below this many threads at 4 heads a thread (a decode step's 64 rows: 1,280
// threads, 5 blocks) a thread takes one head: 4x the threads on the SMs, the
// same cos/sin and the same bits; the training passes keep 4.
constexpr int64_t kRopeSmallPass = 32768;

// rope_store_kv: the heads from k_first on are k; each also goes (rotated) to
// k_cache, and the v head after the rotated heads at the same index to v_cache,
// at physical cache row rows[t] (block * block_size + offset; the caches
// (blocks, heads - k_first, block_size, D): kv_cache_at). Unused by
// rope_forward/backward.
struct RopeCacheStore {
  bf16* k_cache = nullptr;
  bf16* v_cache = nullptr;
  const int32_t* rows = nullptr;
  int k_first = 0;
  int64_t block_size = 0;
};

template <int VEC, bool STORE = false, int HPT = kRopeHeadsPerThread>
__global__ void __launch_bounds__(kThreads)
rope_kernel(bf16* __restrict__ x, const int32_t* __restrict__ positions,
            const float* __restrict__ inv_freq, int64_t N, int heads, int D,
            int64_t row_stride, float sign, RopeCacheStore store = {}) {
  using P = Pack<bf16, VEC>;
  const int half = D / 2, nvec = half / VEC;
  const int hgroups = int(div_up(heads, HPT));
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * hgroups * nvec) return;
  const int iv = int(idx % nvec);
  const int64_t rest = idx / nvec;
  const int hg = int(rest % hgroups);
  const int64_t t = rest / hgroups;
  const int i = iv * VEC;

  // HF: freqs = inv_freq (fp32) * position (fp32); cos, sin in fp32.
  const float pos = float(positions[t]);
  float cs[VEC], sn[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sincosf(pos * inv_freq[i + j], &sn[j], &cs[j]);
    sn[j] *= sign;
  }
  const int h0 = hg * HPT;
  P lo[HPT], hi[HPT];
#pragma unroll
  for (int q = 0; q < HPT; ++q) {
    if (h0 + q >= heads) break;
    const bf16* xh = x + t * row_stride + int64_t(h0 + q) * D;
    lo[q] = P::load(xh + i);
    hi[q] = P::load(xh + i + half);
  }
#pragma unroll
  for (int q = 0; q < HPT; ++q) {
    if (h0 + q >= heads) break;
    P out_lo, out_hi;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x1 = f32(lo[q].v[j]), x2 = f32(hi[q].v[j]);
      rope_pair(x1, x2, cs[j], sn[j], out_lo.v[j], out_hi.v[j]);
    }
    bf16* xh = x + t * row_stride + int64_t(h0 + q) * D;
    out_lo.store(xh + i);
    out_hi.store(xh + i + half);
    if constexpr (STORE) {
      const int kh = h0 + q - store.k_first;
      if (kh >= 0) {
        const int64_t row = kv_cache_at(store.rows[t], kh, heads - store.k_first, store.block_size, D);
        out_lo.store(store.k_cache + row + i);
        out_hi.store(store.k_cache + row + i + half);
        const bf16* vh = x + t * row_stride + int64_t(heads + kh) * D;  // v lies after the q and k heads
        P::load(vh + i).store(store.v_cache + row + i);
        P::load(vh + i + half).store(store.v_cache + row + i + half);
      }
    }
  }
}

void launch_rope(bf16* x, const int32_t* positions, const float* inv_freq, int64_t N,
                 int64_t heads, int64_t D, int64_t row_stride, float sign,
                 cudaStream_t stream, const char* op) {
  check_size(N, INT_MAX, "N", op);
  check_size(heads, 4096, "heads", op);
  SHARDLM_CHECK(D > 0 && D % 2 == 0 && D <= 4096, "%s: head dim must be even and positive, got %lld",
                op, static_cast<long long>(D));
  if (row_stride == 0) row_stride = heads * D;
  SHARDLM_CHECK(row_stride >= heads * D, "%s: row_stride %lld < heads * D = %lld", op,
                static_cast<long long>(row_stride), static_cast<long long>(heads * D));
  if (N == 0 || heads == 0) return;
  const int64_t half = D / 2;
  const bool vec = half % 8 == 0 && row_stride % 8 == 0 && aligned(x, 16);
  const int64_t hgroups = div_up(heads, kRopeHeadsPerThread);
  const bool small = N * hgroups * (vec ? half / 8 : half) < kRopeSmallPass;
  if (vec && small) {
    rope_kernel<8, false, 1><<<grid_for(N * heads * (half / 8), kThreads), kThreads, 0, stream>>>(
        x, positions, inv_freq, N, int(heads), int(D), row_stride, sign);
  } else if (vec) {
    rope_kernel<8><<<grid_for(N * hgroups * (half / 8), kThreads), kThreads, 0, stream>>>(
        x, positions, inv_freq, N, int(heads), int(D), row_stride, sign);
  } else {
    rope_kernel<1><<<grid_for(N * hgroups * half, kThreads), kThreads, 0, stream>>>(
        x, positions, inv_freq, N, int(heads), int(D), row_stride, sign);
  }
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- SwiGLU

template <int VEC>
__global__ void __launch_bounds__(kThreads)
swiglu_forward_kernel(bf16* __restrict__ h, int64_t ld_h, const bf16* __restrict__ gate,
                      int64_t ld_gate, const bf16* __restrict__ up, int64_t ld_up,
                      int64_t rows, int I, float* amax) {
  using P = Pack<bf16, VEC>;
  __shared__ float red[kThreads / 32];
  const int nvec = I / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  float m = 0.0f;  // max |h| written (model.fp8's amax, when asked)
  if (idx < rows * nvec) {
    const int64_t r = idx / nvec;
    const int c = int(idx % nvec) * VEC;
    const P g = P::load(gate + r * ld_gate + c), u = P::load(up + r * ld_up + c);
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = f32(g.v[j]);
      out.v[j] = to_bf16(gf / (1.0f + __expf(-gf)) * f32(u.v[j]));  // silu as torch
      m = fmaxf(m, fabsf(f32(out.v[j])));
    }
    out.store(h + r * ld_h + c);
  }
  block_amax_into<kThreads>(amax, m, red);
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
swiglu_backward_kernel(bf16* dgate, int64_t ld_dgate, bf16* dup, int64_t ld_dup,
                       const bf16* __restrict__ dh, int64_t ld_dh, const bf16* gate,
                       int64_t ld_gate, const bf16* up, int64_t ld_up, int64_t rows, int I,
                       float* amax_dgate, float* amax_dup) {
  using P = Pack<bf16, VEC>;
  __shared__ float red[kThreads / 32];
  const int nvec = I / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  float mg = 0.0f, mu = 0.0f;  // max |dgate|, |dup| written (model.fp8's amaxes, when asked)
  if (idx < rows * nvec) {
    const int64_t r = idx / nvec;
    const int c = int(idx % nvec) * VEC;
    const P g = P::load(gate + r * ld_gate + c), u = P::load(up + r * ld_up + c);
    const P d = P::load(dh + r * ld_dh + c);
    P dg, du;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float gf = f32(g.v[j]), uf = f32(u.v[j]), df = f32(d.v[j]);
      const float sig = 1.0f / (1.0f + __expf(-gf));
      // d silu / dg = sig * (1 + g * (1 - sig))
      dg.v[j] = to_bf16(df * uf * sig * (1.0f + gf * (1.0f - sig)));
      du.v[j] = to_bf16(df * (gf * sig));
      mg = fmaxf(mg, fabsf(f32(dg.v[j])));
      mu = fmaxf(mu, fabsf(f32(du.v[j])));
    }
    dg.store(dgate + r * ld_dgate + c);
    du.store(dup + r * ld_dup + c);
  }
  block_amax_into<kThreads>(amax_dgate, mg, red);
  block_amax_into<kThreads>(amax_dup, mu, red);
}

// ---------------------------------------------------------------- helpers

template <int VEC>
__global__ void __launch_bounds__(kThreads)
cast_f32_to_bf16_kernel(bf16* __restrict__ out, const float* __restrict__ in, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      const auto x = Pack<float, VEC>::load(in + e0);
      Pack<bf16, VEC> y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] = to_bf16(x.v[j]);
      y.store(out + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) out[e] = to_bf16(in[e]);
    }
  }
}

// out = a + f32(b) (a == nullptr: out = f32(b)); out may alias a.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
add_bf16_to_f32_kernel(float* out, const float* a, const bf16* __restrict__ b, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      Pack<float, VEC> y;
      if (a) y = Pack<float, VEC>::load(a + e0);
      else y.raw = {};
      const auto x = Pack<bf16, VEC>::load(b + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] += f32(x.v[j]);
      y.store(out + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) out[e] = (a ? a[e] : 0.0f) + f32(b[e]);
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
accumulate_f32_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      auto a = Pack<float, VEC>::load(y + e0);
      const auto b = Pack<float, VEC>::load(x + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] += b.v[j];
      a.store(y + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) y[e] += x[e];
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
scale_f32_kernel(float* __restrict__ x, float alpha, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * VEC;
  for (int64_t e0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e0 < n;
       e0 += stride) {
    if (e0 + VEC <= n) {
      auto a = Pack<float, VEC>::load(x + e0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a.v[j] *= alpha;
      a.store(x + e0);
    } else {
      for (int64_t e = e0; e < n; ++e) x[e] *= alpha;
    }
  }
}

}  // namespace

// ================================================================ launchers

void rope_forward(bf16* x, const int32_t* positions, const float* inv_freq, int64_t N,
                  int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream) {
  launch_rope(x, positions, inv_freq, N, heads, D, row_stride, 1.0f, stream, "rope_forward");
}

void rope_backward(bf16* dx, const int32_t* positions, const float* inv_freq, int64_t N,
                   int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream) {
  launch_rope(dx, positions, inv_freq, N, heads, D, row_stride, -1.0f, stream, "rope_backward");
}

void rope_store_kv(bf16* qkv, const int32_t* positions, const float* inv_freq, int64_t N, int64_t H, int64_t KV,
                   int64_t D, int64_t row_stride, bf16* k_cache, bf16* v_cache, const int32_t* rows,
                   int64_t block_size, cudaStream_t stream) {
  const char* op = "rope_store_kv";
  const int64_t heads = H + KV;
  check_size(N, INT_MAX, "N", op);
  check_size(heads, 4096, "heads", op);
  SHARDLM_CHECK(D > 0 && D % 2 == 0 && D <= 4096 && KV > 0 && row_stride >= (H + 2 * KV) * D,
                "%s: %lld q and %lld kv heads of %lld in rows of %lld", op, (long long)H, (long long)KV, (long long)D,
                (long long)row_stride);
  SHARDLM_CHECK(block_size >= 1, "%s: KV cache blocks of %lld positions", op, (long long)block_size);
  if (N == 0) return;
  const int64_t half = D / 2;
  const bool vec = half % 8 == 0 && row_stride % 8 == 0 && aligned(qkv, 16) && aligned(k_cache, 16) &&
                   aligned(v_cache, 16);
  const int64_t hgroups = div_up(heads, kRopeHeadsPerThread);
  const RopeCacheStore store{k_cache, v_cache, rows, int(H), block_size};
  const bool small = N * hgroups * (vec ? half / 8 : half) < kRopeSmallPass;
  if (vec && small) {
    rope_kernel<8, true, 1><<<grid_for(N * heads * (half / 8), kThreads), kThreads, 0, stream>>>(
        qkv, positions, inv_freq, N, int(heads), int(D), row_stride, 1.0f, store);
  } else if (vec) {
    rope_kernel<8, true><<<grid_for(N * hgroups * (half / 8), kThreads), kThreads, 0, stream>>>(
        qkv, positions, inv_freq, N, int(heads), int(D), row_stride, 1.0f, store);
  } else {
    rope_kernel<1, true><<<grid_for(N * hgroups * half, kThreads), kThreads, 0, stream>>>(
        qkv, positions, inv_freq, N, int(heads), int(D), row_stride, 1.0f, store);
  }
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_forward(bf16* h, int64_t ld_h, const bf16* gate, int64_t ld_gate, const bf16* up,
                    int64_t ld_up, int64_t rows, int64_t I, cudaStream_t stream, float* amax) {
  const char* op = "swiglu_forward";
  check_size(rows, INT_MAX, "rows", op);
  check_size(I, INT_MAX, "I", op);
  SHARDLM_CHECK(ld_h >= I && ld_gate >= I && ld_up >= I, "%s: a row stride is smaller than I", op);
  zero_amax(amax, stream);
  if (rows == 0 || I == 0) return;
  const bool vec = I % 8 == 0 && ld_h % 8 == 0 && ld_gate % 8 == 0 && ld_up % 8 == 0 &&
                   aligned(h, 16) && aligned(gate, 16) && aligned(up, 16);
  if (vec)
    swiglu_forward_kernel<8><<<grid_for(rows * (I / 8), kThreads), kThreads, 0, stream>>>(
        h, ld_h, gate, ld_gate, up, ld_up, rows, int(I), amax);
  else
    swiglu_forward_kernel<1><<<grid_for(rows * I, kThreads), kThreads, 0, stream>>>(
        h, ld_h, gate, ld_gate, up, ld_up, rows, int(I), amax);
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward(bf16* dgate, int64_t ld_dgate, bf16* dup, int64_t ld_dup, const bf16* dh,
                     int64_t ld_dh, const bf16* gate, int64_t ld_gate, const bf16* up,
                     int64_t ld_up, int64_t rows, int64_t I, cudaStream_t stream, float* amax_dgate,
                     float* amax_dup) {
  const char* op = "swiglu_backward";
  check_size(rows, INT_MAX, "rows", op);
  check_size(I, INT_MAX, "I", op);
  SHARDLM_CHECK(ld_dgate >= I && ld_dup >= I && ld_dh >= I && ld_gate >= I && ld_up >= I,
                "%s: a row stride is smaller than I", op);
  zero_amax(amax_dgate, stream);
  zero_amax(amax_dup, stream);
  if (rows == 0 || I == 0) return;
  const bool vec = I % 8 == 0 && ld_dgate % 8 == 0 && ld_dup % 8 == 0 && ld_dh % 8 == 0 &&
                   ld_gate % 8 == 0 && ld_up % 8 == 0 && aligned(dgate, 16) &&
                   aligned(dup, 16) && aligned(dh, 16) && aligned(gate, 16) && aligned(up, 16);
  if (vec)
    swiglu_backward_kernel<8><<<grid_for(rows * (I / 8), kThreads), kThreads, 0, stream>>>(
        dgate, ld_dgate, dup, ld_dup, dh, ld_dh, gate, ld_gate, up, ld_up, rows, int(I), amax_dgate, amax_dup);
  else
    swiglu_backward_kernel<1><<<grid_for(rows * I, kThreads), kThreads, 0, stream>>>(
        dgate, ld_dgate, dup, ld_dup, dh, ld_dh, gate, ld_gate, up, ld_up, rows, int(I), amax_dgate, amax_dup);
  CUDA_CHECK(cudaGetLastError());
}

void cast_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "cast_f32_to_bf16");
  if (n == 0) return;
  if (aligned(out, 8) && aligned(in, 16))
    cast_f32_to_bf16_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(out, in, n);
  else
    cast_f32_to_bf16_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(out, in, n);
  CUDA_CHECK(cudaGetLastError());
}

void add_bf16_to_f32(float* out, const float* a, const bf16* b, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "add_bf16_to_f32");
  if (n == 0) return;
  if (aligned(out, 16) && aligned(a, 16) && aligned(b, 8))
    add_bf16_to_f32_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(out, a, b, n);
  else
    add_bf16_to_f32_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(out, a, b, n);
  CUDA_CHECK(cudaGetLastError());
}

void accumulate_f32(float* y, const float* x, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "accumulate_f32");
  if (n == 0) return;
  if (aligned(y, 16) && aligned(x, 16))
    accumulate_f32_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(y, x, n);
  else
    accumulate_f32_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(y, x, n);
  CUDA_CHECK(cudaGetLastError());
}

void scale_f32(float* x, float alpha, int64_t n, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "scale_f32");
  if (n == 0) return;
  if (aligned(x, 16))
    scale_f32_kernel<4><<<grid_capped(div_up(n, 4), kThreads), kThreads, 0, stream>>>(x, alpha, n);
  else
    scale_f32_kernel<1><<<grid_capped(n, kThreads), kThreads, 0, stream>>>(x, alpha, n);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
