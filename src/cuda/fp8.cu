// fp8.cu — FP8 amaxes, scales, quantisation and the cuBLASLt FP8 GEMM. See
// src/cuda/fp8.hpp.
#include "cuda/fp8.hpp"

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "cuda/check.hpp"

namespace shardlm::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __nv_fp8_interpretation_t interpretation(Fp8Format f) {
  return f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2;
}

// Non-negative floats order like their bit patterns as ints: atomicMax on those.
__device__ void atomic_max_nonnegative(float* address, float value) {
  atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
}

// The block's max of v (every thread gets it). NaN is ignored (fmaxf).
__device__ float block_max(float v) {
  __shared__ float partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__global__ void amax_kernel(const bf16* __restrict__ x, int64_t n, float* __restrict__ amax) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  m = block_max(m);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, m);
}

// max(m, |p[0]|, ..., |p[7]|): one 16-byte load (p 16-byte aligned).
__device__ __forceinline__ float abs_max8(const bf16* p, float m) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) m = fmaxf(m, fmaxf(fabsf(__low2float(h[j])), fabsf(__high2float(h[j]))));
  return m;
}

// The same maximum, 8 elements a load (n a multiple of 8, x 16-byte aligned).
__global__ void amax_vec_kernel(const bf16* __restrict__ x, int64_t n, float* __restrict__ amax) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n / 8; i += int64_t(gridDim.x) * kThreads) {
    m = abs_max8(x + 8 * i, m);
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, m);
}

// The same maximum over x (rows, cols) with rows ld elements apart (cols a
// multiple of 8, x and ld 16-byte aligned): rows over gridDim.y as quantize_vec_kernel.
__global__ void amax_vec2d_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                  float* __restrict__ amax) {
  float m = 0.0f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t g = blockIdx.x * int64_t(kThreads) + threadIdx.x; g < cols / 8; g += int64_t(gridDim.x) * kThreads) {
      m = abs_max8(x + r * ld + 8 * g, m);
    }
  m = block_max(m);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, m);
}

// Any shape and stride, one element a thread.
__global__ void amax2d_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                              float* __restrict__ amax) {
  float m = 0.0f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * int64_t(kThreads) + threadIdx.x; c < cols; c += int64_t(gridDim.x) * kThreads)
      m = fmaxf(m, fabsf(__bfloat162float(x[r * ld + c])));
  m = block_max(m);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, m);
}

__global__ void amax_rows_kernel(const bf16* __restrict__ x, int64_t cols, int64_t ld, float* __restrict__ amax) {
  const bf16* row = x + blockIdx.x * ld;
  float m = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, fabsf(__bfloat162float(row[c])));
  m = block_max(m);
  if (threadIdx.x == 0) amax[blockIdx.x] = m;
}

// Blocks of 32 columns x kColRows rows; each thread one column over its rows.
constexpr int kColRows = 256;
__global__ void amax_cols_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                 float* __restrict__ amax) {
  __shared__ float partial[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * int64_t(kColRows);
  const int64_t r1 = min(rows, r0 + kColRows);
  float m = 0.0f;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) m = fmaxf(m, fabsf(__bfloat162float(x[r * ld + c])));
  partial[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int y = 1; y < 8; ++y) m = fmaxf(m, partial[y][threadIdx.x]);
    atomic_max_nonnegative(amax + c, m);
  }
}

// cpu::fp8_scale, the same fp32 operations.
__device__ float scale_from_amax(float a, float top) {
  return (isfinite(a) && a > 0.0f) ? __fdiv_rn(top, fmaxf(a, 1e-12f)) : 1.0f;
}

__global__ void scales_kernel(const float* __restrict__ amax, int64_t n, float top, float* __restrict__ scale,
                              float* __restrict__ inv_scale) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i >= n) return;
  const float s = scale_from_amax(amax[i], top);
  scale[i] = s;
  inv_scale[i] = __fdiv_rn(1.0f, s);
}

// Where a quantise kernel's scales come from: the scale array, or (one tensor
// scale, `amax` set) computed from the amax in the kernel itself, as
// scales_kernel would, the grid's first thread writing it and its inverse to
// scale_out / inv_out for the GEMM (fp8_scales and fp8_quantize in one launch).
struct ScaleSource {
  const float* scale;
  const float* amax;  // nullptr: scale holds the scales
  float top;
  float* scale_out;
  float* inv_out;
};

struct Scales {
  const float* scale;
  float tensor;
  __device__ float at(Fp8Scaling scaling, int64_t r, int64_t c) const {
    return scaling == Fp8Scaling::Tensor ? tensor : scaling == Fp8Scaling::Rows ? scale[r] : scale[c];
  }
};

__device__ Scales scales_of(const ScaleSource& src, Fp8Scaling scaling) {
  if (src.amax == nullptr) return {src.scale, scaling == Fp8Scaling::Tensor ? src.scale[0] : 0.0f};
  const float s = scale_from_amax(src.amax[0], src.top);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    src.scale_out[0] = s, src.inv_out[0] = __fdiv_rn(1.0f, s);
  return {nullptr, s};
}

__global__ void quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                const ScaleSource src, Fp8Scaling scaling, Fp8Format f, uint8_t* __restrict__ codes) {
  const int64_t n = rows * cols;
  const __nv_fp8_interpretation_t kind = interpretation(f);
  const Scales scale = scales_of(src, scaling);
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / cols, c = i % cols;
    const float s = scale.at(scaling, r, c);
    codes[i] = __nv_cvt_float_to_fp8(__fmul_rn(__bfloat162float(x[r * ld + c]), s), __NV_SATFINITE, kind);
  }
}

// The same codes, 8 a thread (16 bytes of x in, 8 bytes of codes out; cols a
// multiple of 8, 16-byte aligned x, 8-byte aligned codes): rows over gridDim.y,
// 8-column groups over the threads, so no index is divided (the scalar kernel's
// 64-bit division per element made a memory-bound pass compute-bound).
__global__ void quantize_vec_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                    const ScaleSource src, Fp8Scaling scaling, Fp8Format f,
                                    uint8_t* __restrict__ codes) {
  const __nv_fp8_interpretation_t kind = interpretation(f);
  const Scales sc = scales_of(src, scaling);
  const float* scale = sc.scale;
  const int64_t groups = cols / 8;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float row_scale = scaling == Fp8Scaling::Tensor ? sc.tensor : scaling == Fp8Scaling::Rows ? scale[r] : 0.0f;
    for (int64_t g = blockIdx.x * int64_t(kThreads) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * kThreads) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + r * ld + 8 * g);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
      uint2 out = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = j % 2 == 0 ? __low2float(h[j / 2]) : __high2float(h[j / 2]);
        const float s = scaling == Fp8Scaling::Cols ? scale[8 * g + j] : row_scale;
        const uint32_t code = __nv_cvt_float_to_fp8(__fmul_rn(v, s), __NV_SATFINITE, kind);
        (j < 4 ? out.x : out.y) |= code << (8 * (j % 4));  // little-endian: element j at byte j
      }
      *reinterpret_cast<uint2*>(codes + r * cols + 8 * g) = out;
    }
  }
}

// The same transposed codes for rows and cols multiples of 64 (16-byte aligned x,
// 8-byte aligned codes): 64 x 64 tiles, 16 bytes of x a thread in, 8 bytes of
// codes a thread out (the 32 x 32 kernel moves 2 and 1).
constexpr int kTile = 64, kTilePad = 68;  // a padded row keeps a column's 8 bytes on 8 banks
__global__ void __launch_bounds__(kThreads)
quantize_transpose_vec_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                              const ScaleSource src, Fp8Scaling scaling, Fp8Format f, uint8_t* __restrict__ codes,
                              uint8_t* __restrict__ plain) {
  __shared__ __align__(16) uint8_t tile[kTile][kTilePad];
  const __nv_fp8_interpretation_t kind = interpretation(f);
  const Scales sc = scales_of(src, scaling);
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int seg = threadIdx.x % 8, line = threadIdx.x / 8;  // 8 threads a 64-element line, 32 lines a pass
  for (int y = line; y < kTile; y += kThreads / 8) {
    const int64_t r = r0 + y, c = c0 + 8 * seg;
    const uint4 raw = *reinterpret_cast<const uint4*>(x + r * ld + c);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    uint2 out = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = j % 2 == 0 ? __low2float(h[j / 2]) : __high2float(h[j / 2]);
      const float s = sc.at(scaling, r, c + j);
      const uint8_t code = __nv_cvt_float_to_fp8(__fmul_rn(v, s), __NV_SATFINITE, kind);
      tile[y][8 * seg + j] = code;
      (j < 4 ? out.x : out.y) |= uint32_t(code) << (8 * (j % 4));
    }
    if (plain) *reinterpret_cast<uint2*>(plain + r * cols + c) = out;  // the same codes, (rows, cols)
  }
  __syncthreads();
  for (int y = line; y < kTile; y += kThreads / 8) {  // codes row c0 + y: tile column y, rows 8 seg .. 8 seg + 7
    uint2 out = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) (j < 4 ? out.x : out.y) |= uint32_t(tile[8 * seg + j][y]) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(codes + (c0 + y) * rows + r0 + 8 * seg) = out;
  }
}

// 32 x 32 tiles through shared memory: reads along x's rows, writes along codes' rows.
__global__ void quantize_transpose_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                          const ScaleSource src, Fp8Scaling scaling, Fp8Format f,
                                          uint8_t* __restrict__ codes) {
  __shared__ uint8_t tile[32][33];
  const __nv_fp8_interpretation_t kind = interpretation(f);
  const Scales scale = scales_of(src, scaling);
  const int64_t r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int64_t r = r0 + y, c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      const float v = __fmul_rn(__bfloat162float(x[r * ld + c]), scale.at(scaling, r, c));
      tile[y][threadIdx.x] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind);
    }
  }
  __syncthreads();
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int64_t c = c0 + y, r = r0 + threadIdx.x;  // codes (cols, rows)
    if (r < rows && c < cols) codes[c * rows + r] = tile[threadIdx.x][y];
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 16)));
}

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

cudaDataType_t data_type(Fp8Format f) { return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

}  // namespace

void fp8_amax(const bf16* x, int64_t n, float* amax, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return;
  if (n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0)
    amax_vec_kernel<<<grid_for(n / 8), kThreads, 0, stream>>>(x, n, amax);
  else
    amax_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, amax);
  CUDA_CHECK(cudaGetLastError());
}

void fp8_amax(const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* amax, cudaStream_t stream) {
  if (ld == cols || rows <= 1) return fp8_amax(x, rows * cols, amax, stream);
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (cols == 0) return;
  const bool vec = cols % 8 == 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t per_row = vec ? cols / 8 : cols;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((per_row + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 8192)));
  if (vec)
    amax_vec2d_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, ld, amax);
  else
    amax2d_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, ld, amax);
  CUDA_CHECK(cudaGetLastError());
}

void fp8_amax_rows(const bf16* x, int64_t rows, int64_t cols, float* amax, cudaStream_t stream, int64_t ld) {
  if (rows == 0) return;
  amax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, ld ? ld : cols, amax);
  CUDA_CHECK(cudaGetLastError());
}

void fp8_amax_cols(const bf16* x, int64_t rows, int64_t cols, float* amax, cudaStream_t stream, int64_t ld) {
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float) * size_t(cols), stream));
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + kColRows - 1) / kColRows));
  amax_cols_kernel<<<grid, dim3(32, 8), 0, stream>>>(x, rows, cols, ld ? ld : cols, amax);
  CUDA_CHECK(cudaGetLastError());
}

void fp8_scales(const float* amax, int64_t n, Fp8Format f, float* scale, float* inv_scale, cudaStream_t stream) {
  if (n == 0) return;
  scales_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      amax, n, cpu::fp8_max(f), scale, inv_scale);
  CUDA_CHECK(cudaGetLastError());
}

namespace {

// Whether the 64 x 64 transpose kernel takes x (and can write the plain codes beside).
bool transpose_vec_ok(const bf16* x, int64_t rows, int64_t cols, int64_t ld, const uint8_t* codes,
                      const uint8_t* plain) {
  const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && ld % 8 == 0;  // every row 16-byte aligned
  return rows % kTile == 0 && cols % kTile == 0 && x16 && reinterpret_cast<uintptr_t>(codes) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(plain) % 8 == 0 && rows / kTile <= 65535;
}

void launch_quantize(const bf16* x, int64_t rows, int64_t cols, const ScaleSource& scale, Fp8Scaling scaling,
                     Fp8Format f, uint8_t* codes, bool transpose, cudaStream_t stream, int64_t ld,
                     uint8_t* plain = nullptr) {
  if (ld == 0) ld = cols;
  const bool x16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && ld % 8 == 0;  // every row 16-byte aligned
  if (transpose && transpose_vec_ok(x, rows, cols, ld, codes, plain)) {
    const dim3 grid(static_cast<unsigned>(cols / kTile), static_cast<unsigned>(rows / kTile));
    quantize_transpose_vec_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, ld, scale, scaling, f, codes, plain);
  } else if (transpose) {
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
    quantize_transpose_kernel<<<grid, dim3(32, 8), 0, stream>>>(x, rows, cols, ld, scale, scaling, f, codes);
  } else if (cols % 8 == 0 && x16 && reinterpret_cast<uintptr_t>(codes) % 8 == 0) {
    const int64_t groups = cols / 8;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((groups + kThreads - 1) / kThreads, 64)),
                    static_cast<unsigned>(std::min<int64_t>(rows, 8192)));
    quantize_vec_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, ld, scale, scaling, f, codes);
  } else {
    quantize_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(x, rows, cols, ld, scale, scaling, f, codes);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void fp8_quantize(const bf16* x, int64_t rows, int64_t cols, const float* scale, Fp8Scaling scaling, Fp8Format f,
                  uint8_t* codes, bool transpose, cudaStream_t stream, int64_t ld) {
  if (rows == 0 || cols == 0) return;
  launch_quantize(x, rows, cols, {scale, nullptr, 0.0f, nullptr, nullptr}, scaling, f, codes, transpose, stream, ld);
}

void fp8_quantize_tensor(const bf16* x, int64_t rows, int64_t cols, const float* amax, Fp8Format f, float* scale,
                         float* inv_scale, uint8_t* codes, bool transpose, cudaStream_t stream, int64_t ld) {
  if (rows == 0 || cols == 0) return fp8_scales(amax, 1, f, scale, inv_scale, stream);
  launch_quantize(x, rows, cols, {nullptr, amax, cpu::fp8_max(f), scale, inv_scale}, Fp8Scaling::Tensor, f, codes,
                  transpose, stream, ld);
}

void fp8_quantize_tensor_both(const bf16* x, int64_t rows, int64_t cols, const float* amax, Fp8Format f,
                              float* scale, float* inv_scale, uint8_t* plain, uint8_t* transposed,
                              cudaStream_t stream, int64_t ld) {
  if (rows == 0 || cols == 0) return fp8_scales(amax, 1, f, scale, inv_scale, stream);
  if (ld == 0) ld = cols;
  const ScaleSource src{nullptr, amax, cpu::fp8_max(f), scale, inv_scale};
  if (transpose_vec_ok(x, rows, cols, ld, transposed, plain))
    return launch_quantize(x, rows, cols, src, Fp8Scaling::Tensor, f, transposed, true, stream, ld, plain);
  launch_quantize(x, rows, cols, src, Fp8Scaling::Tensor, f, plain, false, stream, ld);  // two passes
  launch_quantize(x, rows, cols, src, Fp8Scaling::Tensor, f, transposed, true, stream, ld);
}

Fp8Gemm::Fp8Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace ? workspace_bytes : 0) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
}

Fp8Gemm::~Fp8Gemm() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (handle_) cublasLtDestroy(handle_);
}

// Column-major, as Gemm::plan: the row-major C (M, N) is the library's D (N x M)
// = op(our B) op(our A). Our B (N, K) row-major is the column-major (K x N),
// transposed by the op: the "TN" form cuBLASLt's FP8 kernels require.
Fp8Gemm::Plan& Fp8Gemm::plan(const Key& key, const float* a_inv, const float* b_inv, const bf16* bias) {
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;
  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(p.op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_desc(p.op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_desc(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(key.fast_accum ? 1 : 0));
  if (key.rowwise) {
    set_desc(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set_desc(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
  }
  set_desc(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_inv));
  set_desc(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_inv));
  if (key.bias) {  // per row of the library's D (N): one value per output feature, as Gemm's
    set_desc(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(CUDA_R_16BF));
    set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, data_type(key.fb), key.K, key.N, key.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, data_type(key.fa), key.K, key.M, key.lda));
  const cudaDataType_t ctype = key.out == GemmOut::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, ctype, key.N, key.M, key.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const uint64_t workspace = workspace_bytes_;
  cublasStatus_t st1 = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace, sizeof(workspace));
  // Library A is our B, library B our A (see above); C and D are the same buffer.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, std::min(key.align_c, key.align_c_in)},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c}};
  for (const auto& [attr, bytes] : alignments)
    if (st1 == CUBLAS_STATUS_SUCCESS) st1 = cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes));
  const cublasStatus_t st2 =
      st1 == CUBLAS_STATUS_SUCCESS
          ? cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found)
          : st1;
  cublasLtMatmulPreferenceDestroy(pref);
  SHARDLM_CHECK(st2 == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS,
                "cuBLASLt has no FP8 algorithm for C(%lld, %lld) = A B^T, K = %lld, %s x %s, %s scales, %s output "
                "%s(%s): FP8 GEMMs need a Hopper or newer GPU and sizes that are multiples of 16",
                static_cast<long long>(key.M), static_cast<long long>(key.N), static_cast<long long>(key.K),
                key.fa == Fp8Format::E4M3 ? "e4m3" : "e5m2", key.fb == Fp8Format::E4M3 ? "e4m3" : "e5m2",
                key.rowwise ? "row" : "tensor", key.out == GemmOut::BF16 ? "bf16" : "fp32",
                key.bias ? "with bias " : "", cublasLtGetStatusString(st2));
  p.algo = result.algo;
  // SHARDLM_FP8_GEMM_LOG=1: each plan's algorithm on stderr, once (on an H200 every
  // training GEMM at 1B/4096 is algorithm 66 without split-K: docs/benchmarks.md).
  if (const char* log = std::getenv("SHARDLM_FP8_GEMM_LOG"); log && std::string(log) == "1") {
    // One config attribute (uint32_t, or uint16_t as the cluster shape's is).
    const auto config = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
      uint32_t v32 = 0;
      uint16_t v16 = 0;
      size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&p.algo, attr, &v32, sizeof(v32), &written) == CUBLAS_STATUS_SUCCESS)
        return static_cast<long long>(v32);
      if (cublasLtMatmulAlgoConfigGetAttribute(&p.algo, attr, &v16, sizeof(v16), &written) == CUBLAS_STATUS_SUCCESS)
        return static_cast<long long>(v16);
      return -1LL;
    };
    std::fprintf(stderr,
                 "shardlm: fp8 gemm M %lld N %lld K %lld: algo %lld tile %lld stages %lld cluster %lld splitk %lld "
                 "reduction %lld swizzle %lld custom %lld, workspace %zu bytes\n",
                 static_cast<long long>(key.M), static_cast<long long>(key.N), static_cast<long long>(key.K),
                 config(CUBLASLT_ALGO_CONFIG_ID), config(CUBLASLT_ALGO_CONFIG_TILE_ID),
                 config(CUBLASLT_ALGO_CONFIG_STAGES_ID), config(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                 config(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), config(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                 config(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), config(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                 result.workspaceSize);
  }
  return plans_.emplace(key, p).first->second;
}

void Fp8Gemm::matmul(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format fa, int64_t lda, const float* a_inv,
                     const uint8_t* B, Fp8Format fb, int64_t ldb, const float* b_inv, bool rowwise, void* C,
                     int64_t ldc, GemmOut out, float alpha, float beta, bool fast_accum, const bf16* bias,
                     const void* C_in) {
  SHARDLM_CHECK(M > 0 && N > 0 && K > 0 && lda >= K && ldb >= K && ldc >= N,
                "fp8 gemm: bad sizes M %lld N %lld K %lld lda %lld ldb %lld ldc %lld", static_cast<long long>(M),
                static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(lda),
                static_cast<long long>(ldb), static_cast<long long>(ldc));
  SHARDLM_CHECK(!(fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2), "fp8 gemm: e5m2 x e5m2 is not supported");
  SHARDLM_CHECK(bias == nullptr || out == GemmOut::BF16, "fp8 gemm: the bias epilogue is only used with a bf16 output");
  if (C_in == nullptr || beta == 0.0f) C_in = C;
  const Key key{M, N, K, lda, ldb, ldc, fa, fb, rowwise, fast_accum, bias != nullptr, out,
                alignment_of(A), alignment_of(B), alignment_of(C), alignment_of(C_in), alignment_of(bias)};
  Plan& p = plan(key, a_inv, b_inv, bias);
  if (bias) set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
  set_desc(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_inv));
  set_desc(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_inv));
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, B, p.a, A, p.b, &beta, C_in, p.c, C, p.c, &p.algo, workspace_,
                              workspace_bytes_, stream_));
}

}  // namespace shardlm::cuda
