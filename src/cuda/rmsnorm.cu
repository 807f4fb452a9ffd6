// rmsnorm.cu — RMSNorm forward (alone and fused with the residual add) and backward,
// its weight gradient reduced in a fixed order; the contract is in ops.hpp, precision
// and bytes moved in docs/kernels.md.
#include "cuda/ops.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

// Sum over the G consecutive threads of a group (G a power of two, uniform over the
// block). Every thread of the group gets the same bits: the xor butterfly adds the
// same two values on both sides, and across warps every thread adds the warp sums
// in warp order. Contains __syncthreads() when G > 32: call from all threads.
__device__ __forceinline__ float group_sum(float v, int G, float* red) {
  for (int o = min(G, 32) >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  if (G <= 32) return v;
  const int warp = threadIdx.x >> 5;
  const int warps_per_group = G >> 5;
  const int first = (warp / warps_per_group) * warps_per_group;
  __syncthreads();  // red may still be read from the previous call
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float t = red[first];
  for (int w = 1; w < warps_per_group; ++w) t += red[first + w];
  return t;
}

// ---------------------------------------------------------------- RMSNorm

// A row is handled by a group of G threads (a power of two, up to the block), each
// owning K vectors of VEC columns: column (k * G + lane) * VEC + j.
constexpr int kNormThreads = 256;
// Row chunks of the dweight reduction. 1024 (more blocks in flight) measured slower
// at the 1B shape: 41.8 against 34.4 us a call, its partials' extra traffic included.
constexpr int kNormMaxPartials = 256;

struct NormGeom {
  int vec, G, K, kmax;  // kmax: the kernel instantiation's register arrays (K <= kmax)
  int rows_per_iter() const { return kNormThreads / G; }
};

// The smallest group that keeps K at 2 vectors per thread (8 bf16 each), so a
// 256-thread block holds 256 * 2 * 8 columns in registers; wider rows take K up to 4.
// K = 2 keeps the backward at ~100 registers (K = 4 needs ~180: one block per SM).
NormGeom norm_geom(int64_t C, bool vec_ok, const char* op) {
  NormGeom g{};
  g.vec = vec_ok ? 8 : 1;
  const int prefer = vec_ok ? 2 : 4, limit = 4;
  const int64_t nvec = div_up(C, g.vec);
  g.G = 1;
  while (g.G < kNormThreads && int64_t(g.G) * prefer < nvec) g.G *= 2;
  g.K = int(div_up(nvec, g.G));
  SHARDLM_CHECK(g.K <= limit, "%s: C = %lld is too large (at most %d, or %d when C is not a "
                "multiple of 8)", op, static_cast<long long>(C), kNormThreads * 4 * 8,
                kNormThreads * 4);
  g.kmax = vec_ok ? (g.K <= 2 ? 2 : 4) : 4;
  return g;
}

bool norm_vec_ok(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned(p, 16)) return false;
  return true;
}

// VEC elements of the residual stream (bf16 or fp32, model.residual_dtype) in
// registers, read and written as floats. bf16 keeps its packed form (the
// registers the default path always used); fp32 moves as float4s.
template <class T, int VEC> struct StreamVec;
template <int VEC> struct StreamVec<bf16, VEC> {
  Pack<bf16, VEC> p;
  __device__ __forceinline__ static StreamVec load(const bf16* q) {
    StreamVec x;
    x.p = Pack<bf16, VEC>::load(q);
    return x;
  }
  __device__ __forceinline__ void store(bf16* q) const { p.store(q); }
  __device__ __forceinline__ float get(int j) const { return f32(p.v[j]); }
  __device__ __forceinline__ void set(int j, float x) { p.v[j] = to_bf16(x); }
  __device__ __forceinline__ void clear() { p.raw = {}; }
};
template <int VEC> struct StreamVec<float, VEC> {
  static_assert(VEC == 1 || VEC % 4 == 0, "fp32 stream vectors are float4s");
  float v[VEC];
  __device__ __forceinline__ static StreamVec load(const float* q) {
    StreamVec x;
    if constexpr (VEC == 1) {
      x.v[0] = q[0];
    } else {
#pragma unroll
      for (int i = 0; i < VEC / 4; ++i) {
        const float4 f = reinterpret_cast<const float4*>(q)[i];
        x.v[4 * i] = f.x, x.v[4 * i + 1] = f.y, x.v[4 * i + 2] = f.z, x.v[4 * i + 3] = f.w;
      }
    }
    return x;
  }
  __device__ __forceinline__ void store(float* q) const {
    if constexpr (VEC == 1) {
      q[0] = v[0];
    } else {
#pragma unroll
      for (int i = 0; i < VEC / 4; ++i)
        reinterpret_cast<float4*>(q)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
  }
  __device__ __forceinline__ float get(int j) const { return v[j]; }
  __device__ __forceinline__ void set(int j, float x) { v[j] = x; }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = 0.0f;
  }
};

// VEC weights from column c as floats: fp32 (wf, model.norm_dtype = "fp32") or
// bf16 (wb, the gathered unit's copy); one of the two is nullptr.
template <int VEC>
__device__ __forceinline__ void load_norm_weight(float (&w)[VEC], const bf16* __restrict__ wb,
                                                 const float* __restrict__ wf, int c) {
  if (wf) {
    const StreamVec<float, VEC> x = StreamVec<float, VEC>::load(wf + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = x.get(j);
  } else {
    const Pack<bf16, VEC> x = Pack<bf16, VEC>::load(wb + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = f32(x.v[j]);
  }
}

// TX: the residual stream's element type. kResidual: residual_out = a + b (b, a
// projection's bf16 output), rounded to TX, and the norm of what was stored.
template <int VEC, int KMAX, bool kResidual, class TX>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_forward_kernel(TX* residual_out, bf16* normed, float* __restrict__ rstd,
                       const TX* a, const bf16* b, const bf16* __restrict__ wb, const float* __restrict__ wf,
                       int64_t rows, int C, float eps, int G, int K, float* amax) {
  using P = Pack<bf16, VEC>;
  using X = StreamVec<TX, VEC>;
  __shared__ float red[kNormThreads / 32];
  const int group = threadIdx.x / G, lane = threadIdx.x % G;
  const int64_t row = int64_t(blockIdx.x) * (kNormThreads / G) + group;
  const bool active = row < rows;
  X xs[KMAX];
  // The weights are loaded with the row, before the reduction: their memory latency
  // overlaps the row's instead of following the barrier (a decode step's 64 rows
  // are all latency). The arithmetic and its order are unchanged.
  float w[KMAX][VEC];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    if (!active || k >= K || c >= C) continue;
    load_norm_weight(w[k], wb, wf, c);
    const int64_t off = row * C + c;
    xs[k] = X::load(a + off);
    if constexpr (kResidual) {
      const P pb = P::load(b + off);
#pragma unroll
      for (int j = 0; j < VEC; ++j) xs[k].set(j, xs[k].get(j) + f32(pb.v[j]));
      xs[k].store(residual_out + off);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = xs[k].get(j);
      ss += x * x;
    }
  }
  ss = group_sum(ss, G, red);
  const float s = 1.0f / sqrtf(ss / float(C) + eps);  // as HF: rsqrt(variance + eps)
  float m = 0.0f;  // the largest |normed| this thread wrote: model.fp8's amax, when asked
  if (active) {
    if (lane == 0) rstd[row] = s;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      if (k >= K || c >= C) continue;
      P y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        y.v[j] = to_bf16(w[k][j] * (xs[k].get(j) * s));
        m = fmaxf(m, fabsf(f32(y.v[j])));
      }
      y.store(normed + row * C + c);
    }
  }
  block_amax_into<kNormThreads>(amax, m, red);
}

// dx = s * (w * dy) - x * (sum(w * dy * x) / C) * s^3 (+ dresidual), one group per
// row; the dweight terms dy * x * s are summed per thread over the block's rows in
// row order, then over the block's groups in group order, into partial[block].
// TX: the residual stream's element type (inp, dresidual, dinp); an fp32 stream
// also writes dinp rounded to bf16 into dinp_bf16 when it is not nullptr (the
// next projection's backward reads bf16).
template <int VEC, int KMAX, bool kResidual, class TX>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_backward_kernel(TX* dinp, bf16* dinp_bf16, float* __restrict__ partial, const bf16* __restrict__ dout,
                        const TX* __restrict__ inp, const bf16* __restrict__ wb, const float* __restrict__ wf,
                        const float* __restrict__ rstd, const TX* dresidual, int64_t rows,
                        int C, int G, int K, int64_t rows_per_block, float* amax) {
  using P = Pack<bf16, VEC>;
  using X = StreamVec<TX, VEC>;
  extern __shared__ float group_acc[];  // (rows_per_iter, C)
  __shared__ float red[kNormThreads / 32];
  const int rows_per_iter = kNormThreads / G;
  const int group = threadIdx.x / G, lane = threadIdx.x % G;

  float w[KMAX][VEC], acc[KMAX][VEC];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[k][j] = 0.0f, acc[k][j] = 0.0f;
    if (k < K && c < C) load_norm_weight(w[k], wb, wf, c);
  }

  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = min(rows, r0 + rows_per_block);
  // The next row's x, dy (and dresidual) are loaded before this row's reduction, so
  // two rows' loads are in flight across its barriers (one left the kernel at half
  // the bandwidth). The arithmetic and its order are unchanged.
  X x[KMAX], dr[KMAX];
  P dy[KMAX];
  auto load_row = [&](int64_t row, X* xs, P* dys, X* drs) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      xs[k].clear();
      dys[k].raw = {};
      drs[k].clear();
      if (row >= r1 || k >= K || c >= C) continue;
      xs[k] = X::load(inp + row * C + c);
      dys[k] = P::load(dout + row * C + c);
      if constexpr (kResidual) drs[k] = X::load(dresidual + row * C + c);
    }
  };
  load_row(r0 + group, x, dy, dr);
  float m = 0.0f;  // the largest |gradient| the next projection reads (bf16): model.fp8's amax
  for (int64_t base = r0; base < r1; base += rows_per_iter) {
    const int64_t row = base + group;
    const bool active = row < r1;
    X xn[KMAX], drn[KMAX];
    P dyn[KMAX];
    load_row(row + rows_per_iter, xn, dyn, drn);
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      if (!active || k >= K || c >= C) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) dot += (w[k][j] * f32(dy[k].v[j])) * x[k].get(j);
    }
    const float s = active ? rstd[row] : 0.0f;
    dot = group_sum(dot, G, red);
    const float coef = (dot / float(C)) * s * s * s;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int c = (k * G + lane) * VEC;
      if (!active || k >= K || c >= C) continue;
      const int64_t off = row * C + c;
      X dx;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xf = x[k].get(j), dyf = f32(dy[k].v[j]);
        float g = s * (w[k][j] * dyf) - xf * coef;
        if constexpr (kResidual) g += dr[k].get(j);
        dx.set(j, g);
        acc[k][j] += dyf * (xf * s);
      }
      dx.store(dinp + off);
      if constexpr (sizeof(TX) == 4) {
        if (dinp_bf16) {
          P copy;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            copy.v[j] = to_bf16(dx.get(j));
            m = fmaxf(m, fabsf(f32(copy.v[j])));
          }
          copy.store(dinp_bf16 + off);
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) m = fmaxf(m, fabsf(dx.get(j)));  // dx holds bf16 values
      }
    }
#pragma unroll
    for (int k = 0; k < KMAX; ++k) x[k] = xn[k], dy[k] = dyn[k], dr[k] = drn[k];
  }

#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * G + lane) * VEC;
    if (k >= K || c >= C) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) group_acc[group * C + c + j] = acc[k][j];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += kNormThreads) {
    float t = group_acc[c];
    for (int g = 1; g < rows_per_iter; ++g) t += group_acc[g * C + c];
    partial[int64_t(blockIdx.x) * C + c] = t;
  }
  block_amax_into<kNormThreads>(amax, m, red);
}

// One block a row, 8 columns a thread (KMAX x 2048 columns at most): every load
// (the S parts, the residual, the norm weights) is issued before any arithmetic,
// so a row costs one memory latency; then the block reduces the squares.
constexpr int kSplitThreads = 256;
template <int S, int KMAX>
__global__ void __launch_bounds__(kSplitThreads)
splitk_residual_rmsnorm_kernel(bf16* __restrict__ out, bf16* __restrict__ normed, float* __restrict__ rstd,
                               const bf16* __restrict__ a, const float* __restrict__ parts, int64_t part_stride,
                               const bf16* __restrict__ wb, const float* __restrict__ wf, int C, float eps) {
  using P = Pack<bf16, 8>;
  using F = StreamVec<float, 8>;
  __shared__ float red[kSplitThreads / 32];
  const int64_t row = blockIdx.x;
  float x[KMAX][8], w[KMAX][8];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * kSplitThreads + int(threadIdx.x)) * 8;
    if (c >= C) continue;
    const int64_t off = row * C + c;
    F p[S];
#pragma unroll
    for (int s = 0; s < S; ++s) p[s] = F::load(parts + s * part_stride + off);
    const P av = P::load(a + off);
    if (normed) load_norm_weight(w[k], wb, wf, c);
    P xo;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float acc = p[0].get(j);
#pragma unroll
      for (int s = 1; s < S; ++s) acc += p[s].get(j);
      xo.v[j] = to_bf16(acc + f32(av.v[j]));  // as a GEMM epilogue adds its C
      x[k][j] = f32(xo.v[j]);
      ss += x[k][j] * x[k][j];
    }
    xo.store(out + off);
  }
  if (normed == nullptr) return;  // uniform over the block
  ss = block_reduce<kSplitThreads>(ss, SumOp{}, red);
  const float r = 1.0f / sqrtf(ss / float(C) + eps);  // as rmsnorm_forward_kernel
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int c = (k * kSplitThreads + int(threadIdx.x)) * 8;
    if (c >= C) continue;
    P y;
#pragma unroll
    for (int j = 0; j < 8; ++j) y.v[j] = to_bf16(w[k][j] * (x[k][j] * r));
    y.store(normed + row * C + c);
  }
}

int64_t norm_rows_per_block(int64_t rows, const NormGeom& g) {
  const int64_t rpi = g.rows_per_iter();
  return rpi * std::max<int64_t>(1, div_up(rows, rpi * kNormMaxPartials));
}

template <bool kResidual, class TX>
void launch_rmsnorm_forward(TX* residual_out, bf16* normed, float* rstd, const TX* a,
                            const bf16* b, NormWeight weight, int64_t rows, int64_t C,
                            double eps, cudaStream_t stream, const char* op, float* amax) {
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  zero_amax(amax, stream);
  if (rows == 0 || C == 0) return;
  const bool vec = norm_vec_ok(C, {residual_out, normed, a, b, weight.ptr()});
  const NormGeom g = norm_geom(C, vec, op);
  const unsigned blocks = grid_for(rows, g.rows_per_iter());
  const float eps_f = static_cast<float>(eps);
#define SHARDLM_RMS_FWD(VEC, KMAX)                                                           \
  rmsnorm_forward_kernel<VEC, KMAX, kResidual, TX><<<blocks, kNormThreads, 0, stream>>>(      \
      residual_out, normed, rstd, a, b, weight.b, weight.f, rows, int(C), eps_f, g.G, g.K, amax)
  if (g.vec == 1) SHARDLM_RMS_FWD(1, 4);  // unaligned or C % 8 != 0: scalar loads
  else if (g.kmax == 2) SHARDLM_RMS_FWD(8, 2);
  else SHARDLM_RMS_FWD(8, 4);
#undef SHARDLM_RMS_FWD
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

// ================================================================ launchers

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, NormWeight weight,
                     int64_t rows, int64_t C, double eps, cudaStream_t stream, float* amax) {
  launch_rmsnorm_forward<false, bf16>(nullptr, out, rstd, inp, nullptr, weight, rows, C, eps, stream,
                                      "rmsnorm_forward", amax);
}

void rmsnorm_forward(bf16* out, float* rstd, const float* inp, NormWeight weight,
                     int64_t rows, int64_t C, double eps, cudaStream_t stream, float* amax) {
  launch_rmsnorm_forward<false, float>(nullptr, out, rstd, inp, nullptr, weight, rows, C, eps, stream,
                                       "rmsnorm_forward (fp32 input)", amax);
}

void residual_rmsnorm_forward(bf16* residual_out, bf16* normed, float* rstd, const bf16* a,
                              const bf16* b, NormWeight weight, int64_t rows, int64_t C,
                              double eps, cudaStream_t stream, float* amax) {
  launch_rmsnorm_forward<true, bf16>(residual_out, normed, rstd, a, b, weight, rows, C, eps, stream,
                                     "residual_rmsnorm_forward", amax);
}

void residual_rmsnorm_forward(float* residual_out, bf16* normed, float* rstd, const float* a,
                              const bf16* b, NormWeight weight, int64_t rows, int64_t C,
                              double eps, cudaStream_t stream, float* amax) {
  launch_rmsnorm_forward<true, float>(residual_out, normed, rstd, a, b, weight, rows, C, eps, stream,
                                      "residual_rmsnorm_forward (fp32 stream)", amax);
}

bool splitk_residual_rmsnorm_takes(int64_t C) { return C % 8 == 0 && C <= 4 * 8 * kSplitThreads; }

void splitk_residual_rmsnorm_forward(bf16* out, bf16* normed, float* rstd, const bf16* a, const float* parts,
                                     int64_t part_stride, NormWeight weight, int64_t rows, int64_t C, double eps,
                                     cudaStream_t stream) {
  const char* op = "splitk_residual_rmsnorm_forward";
  constexpr int S = kSplitkParts;
  check_size(rows, INT_MAX, "rows", op);
  SHARDLM_CHECK(splitk_residual_rmsnorm_takes(C) && part_stride >= rows * C && part_stride % 4 == 0 &&
                    norm_vec_ok(C, {out, normed, a, parts, weight.ptr()}) && aligned(parts, 16),
                "%s: %d parts %lld apart for (%lld, %lld), or a pointer not 16-byte aligned", op, S,
                (long long)part_stride, (long long)rows, (long long)C);
  if (rows == 0) return;
  const int K = int(div_up(C, 8 * kSplitThreads));
#define SHARDLM_SPLIT(KK)                                                               \
  splitk_residual_rmsnorm_kernel<S, KK><<<unsigned(rows), kSplitThreads, 0, stream>>>( \
      out, normed, rstd, a, parts, part_stride, weight.b, weight.f, int(C), float(eps))
  if (K == 1) SHARDLM_SPLIT(1);
  else if (K == 2) SHARDLM_SPLIT(2);
  else SHARDLM_SPLIT(4);
#undef SHARDLM_SPLIT
  CUDA_CHECK(cudaGetLastError());
}

size_t rmsnorm_backward_scratch_bytes(int64_t rows, int64_t C) {
  const char* op = "rmsnorm_backward";
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  if (rows == 0 || C == 0) return 0;
  // Either path may be taken (it depends on pointer alignment): the larger need.
  size_t bytes = 0;
  for (bool vec : {true, false}) {
    if (vec && C % 8 != 0) continue;
    if (!vec && C > kNormThreads * 4) continue;
    const NormGeom g = norm_geom(C, vec, op);
    const int64_t P = div_up(rows, norm_rows_per_block(rows, g));
    bytes = std::max(bytes, size_t(P * C) * sizeof(float));
  }
  return bytes;
}

namespace {

template <class TX>
void launch_rmsnorm_backward(TX* dinp, bf16* dinp_bf16, float* dweight, const bf16* dout, const TX* inp,
                             NormWeight weight, const float* rstd, const TX* dresidual, int64_t rows, int64_t C,
                             void* scratch, size_t scratch_bytes, cudaStream_t stream, const char* op, float* amax) {
  check_size(rows, INT64_MAX / 8, "rows", op);
  check_size(C, INT_MAX, "C", op);
  SHARDLM_CHECK(amax == nullptr || sizeof(TX) == 2 || dinp_bf16 != nullptr,
                "%s: an amax of the fp32 gradient asked for without its bf16 copy", op);
  zero_amax(amax, stream);
  if (rows == 0 || C == 0) return;
  const bool vec = norm_vec_ok(C, {dinp, dinp_bf16, dout, inp, weight.ptr(), dresidual});
  const NormGeom g = norm_geom(C, vec, op);
  const int64_t rows_per_block = norm_rows_per_block(rows, g);
  const int64_t P = div_up(rows, rows_per_block);
  const size_t need = size_t(P * C) * sizeof(float);
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= need,
                "%s: scratch of %zu bytes is smaller than the %zu needed", op, scratch_bytes, need);
  auto* partial = static_cast<float*>(scratch);
  const size_t smem = size_t(g.rows_per_iter()) * C * sizeof(float);
  const unsigned blocks = unsigned(P);
#define SHARDLM_RMS_BWD(VEC, KMAX, RES)                                                      \
  rmsnorm_backward_kernel<VEC, KMAX, RES, TX><<<blocks, kNormThreads, smem, stream>>>(       \
      dinp, dinp_bf16, partial, dout, inp, weight.b, weight.f, rstd, dresidual, rows, int(C), g.G, g.K, rows_per_block, \
      amax)
  const bool res = dresidual != nullptr;
  if (g.vec == 1) {  // unaligned or C % 8 != 0: scalar loads
    if (res) SHARDLM_RMS_BWD(1, 4, true);
    else SHARDLM_RMS_BWD(1, 4, false);
  } else if (g.kmax == 2) {
    if (res) SHARDLM_RMS_BWD(8, 2, true);
    else SHARDLM_RMS_BWD(8, 2, false);
  } else {
    if (res) SHARDLM_RMS_BWD(8, 4, true);
    else SHARDLM_RMS_BWD(8, 4, false);
  }
#undef SHARDLM_RMS_BWD
  CUDA_CHECK(cudaGetLastError());
  launch_column_finish(dweight, partial, P, int(C), stream);
}

}  // namespace

void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp,
                      NormWeight weight, const float* rstd, const bf16* dresidual,
                      int64_t rows, int64_t C, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream, float* amax) {
  launch_rmsnorm_backward<bf16>(dinp, nullptr, dweight, dout, inp, weight, rstd, dresidual, rows, C, scratch,
                                scratch_bytes, stream, "rmsnorm_backward", amax);
}

void rmsnorm_backward(float* dinp, bf16* dinp_bf16, float* dweight, const bf16* dout, const float* inp,
                      NormWeight weight, const float* rstd, const float* dresidual, int64_t rows, int64_t C,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream, float* amax) {
  launch_rmsnorm_backward<float>(dinp, dinp_bf16, dweight, dout, inp, weight, rstd, dresidual, rows, C, scratch,
                                 scratch_bytes, stream, "rmsnorm_backward (fp32 stream)", amax);
}

}  // namespace shardlm::cuda
