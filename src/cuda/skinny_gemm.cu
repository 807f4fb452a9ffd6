// skinny_gemm.cu — out = A Wᵀ for a decode step's ≤ 64 rows (see skinny_gemm.hpp).
#include "cuda/check.hpp"
#include "cuda/skinny_gemm.hpp"

#include <algorithm>

namespace shardlm::cuda {

namespace {

constexpr int kBM = 64;       // rows of a tile: every row of the step
constexpr int kBN = 64;       // columns (weight rows) of a tile
constexpr int kBK = 64;       // K a pipeline stage holds: 8 chunks of 16 bytes a row
constexpr int kStages = 3;    // 3 × (8 + 8) KiB = 48 KiB of shared memory
constexpr int kThreads = 128; // 4 warps, each 16 of the tile's columns for all 64 rows
constexpr int kMinStepsPerSplit = 2;
constexpr int kMaxSplits = 16;

constexpr int kTileElems = kBM * kBK;  // = kBN * kBK: one operand's stage

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from src into shared memory at dst; src_bytes = 0 writes zeros (and reads nothing).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16 × 16, row) · b (16 × 8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of 16-byte chunk c (0..7) of row r in a 64-wide stage: the chunk
// index XOR the row's low 3 bits, so that ldmatrix's 8 rows at one chunk hit 8
// different bank groups.
__device__ __forceinline__ int swizzled(int r, int c) { return r * kBK + ((c ^ (r & 7)) << 3); }

// One pipeline stage: K columns k0 .. k0 + 63 of A's 64 rows and of W's rows
// n0 .. n0 + 63, 512 chunks each, 4 + 4 a thread; outside M, N or K: zeros.
__device__ __forceinline__ void load_stage(bf16* a, bf16* w, const bf16* A, int64_t lda, const bf16* W, int M,
                                           int N, int K, int n0, int k0, int tid) {
#pragma unroll
  for (int j = 0; j < (kBM * kBK / 8) / kThreads; ++j) {
    const int i = tid + j * kThreads, r = i >> 3, c = i & 7, k = k0 + c * 8;
    const bool in_a = r < M && k < K;
    cp_async16(smem_addr(a + swizzled(r, c)), in_a ? A + int64_t(r) * lda + k : A, in_a ? 16 : 0);
    const bool in_w = n0 + r < N && k < K;
    cp_async16(smem_addr(w + swizzled(r, c)), in_w ? W + int64_t(n0 + r) * K + k : W, in_w ? 16 : 0);
  }
}

// y (fp32 sum) + bias + residual, rounded once, at (m, n).
__device__ __forceinline__ bf16 bf16_out(float y, const bf16* bias, const bf16* residual, int64_t at, int n) {
  if (bias) y += __bfloat162float(bias[n]);
  if (residual) y += __bfloat162float(residual[at]);
  return __float2bfloat16(y);
}

// Partials (splits > 1): part[split][m][n] fp32. One split: the epilogue here.
// `residual` may be `out` (each element read, then written, by one thread).
template <bool F32_OUT>
__global__ void __launch_bounds__(kThreads)
skinny_kernel(void* out, float* __restrict__ part, const bf16* __restrict__ A, int64_t lda,
              const bf16* __restrict__ W, const bf16* __restrict__ bias, const bf16* residual, int M, int N, int K,
              int splits) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* const sA = reinterpret_cast<bf16*>(smem_raw);
  bf16* const sW = sA + kStages * kTileElems;

  const int n0 = blockIdx.x * kBN, split = blockIdx.y;
  const int k_steps = (K + kBK - 1) / kBK;
  // Split s takes steps [s * k_steps / splits, (s + 1) * k_steps / splits).
  const int kt0 = int(int64_t(split) * k_steps / splits), kt1 = int(int64_t(split + 1) * k_steps / splits);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  float acc[4][2][4] = {};  // [m16 tile][n8 tile][fragment]
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (kt0 + s < kt1)
      load_stage(sA + s * kTileElems, sW + s * kTileElems, A, lda, W, M, N, K, n0, (kt0 + s) * kBK, tid);
    cp_async_commit();
  }
  for (int kt = kt0; kt < kt1; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free to refill
    const int next = kt + kStages - 1;
    if (next < kt1) {
      const int stage = (next - kt0) % kStages;
      load_stage(sA + stage * kTileElems, sW + stage * kTileElems, A, lda, W, M, N, K, n0, next * kBK, tid);
    }
    cp_async_commit();

    const bf16* const a = sA + ((kt - kt0) % kStages) * kTileElems;
    const bf16* const w = sW + ((kt - kt0) % kStages) * kTileElems;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      // B: the warp's 16 weight rows × 16 of K: matrices (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi).
      uint32_t b[4];
      {
        const int r = warp * 16 + (lane & 7) + ((lane >> 4) << 3), c = kk * 2 + ((lane >> 3) & 1);
        ldmatrix_x4(b, smem_addr(w + swizzled(r, c)));
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        // A: rows mt*16 .. +15 × 16 of K: (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi).
        uint32_t af[4];
        const int r = mt * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
        ldmatrix_x4(af, smem_addr(a + swizzled(r, c)));
        mma_bf16(acc[mt][0], af, b[0], b[1]);
        mma_bf16(acc[mt][1], af, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

  // Fragment elements 2h and 2h + 1 of acc[mt][nt]: row mt*16 + lane/4 + 8h,
  // columns nt*8 + 2*(lane%4) and the next, stored as a pair where both exist
  // and N is even (the pair then 8- or 4-byte aligned).
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = mt * 16 + (lane >> 2) + 8 * h;
        const int n = n0 + warp * 16 + nt * 8 + 2 * (lane & 3);
        if (m >= M || n >= N) continue;
        const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
        const bool pair = n + 1 < N && (N & 1) == 0;
        const int64_t at = int64_t(m) * N + n;
        if (splits > 1) {
          float* p = part + int64_t(split) * M * N + at;
          if (pair) *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
          else p[0] = v0;
        } else if constexpr (F32_OUT) {
          float* p = static_cast<float*>(out) + at;
          if (pair) *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
          else p[0] = v0;
        } else {
          bf16* p = static_cast<bf16*>(out) + at;
          const bf16 y0 = bf16_out(v0, bias, residual, at, n);
          if (pair) {
            const bf16 y1 = bf16_out(v1, bias, residual, at + 1, n + 1);
            *reinterpret_cast<__nv_bfloat162*>(p) = __nv_bfloat162(y0, y1);
          } else {
            p[0] = y0;
          }
        }
        // An odd N's last column of a pair is stored alone.
        if (!pair && n + 1 < N) {
          if (splits > 1) part[int64_t(split) * M * N + at + 1] = v1;
          else if constexpr (F32_OUT) static_cast<float*>(out)[at + 1] = v1;
          else static_cast<bf16*>(out)[at + 1] = bf16_out(v1, bias, residual, at + 1, n + 1);
        }
      }
}

// out[m, n] = the splits' partials added in split order (+ bias + residual).
template <bool F32_OUT>
__global__ void skinny_reduce_kernel(void* out, const float* __restrict__ part,
                                     const bf16* __restrict__ bias, const bf16* residual, int M, int N,
                                     int splits) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, MN = int64_t(M) * N;
  if (i >= MN) return;
  float y = part[i];
  for (int s = 1; s < splits; ++s) y += part[int64_t(s) * MN + i];
  if constexpr (F32_OUT) static_cast<float*>(out)[i] = y;
  else static_cast<bf16*>(out)[i] = bf16_out(y, bias, residual, i, int(i % N));
}

constexpr size_t kSmemBytes = size_t(2) * kStages * kTileElems * sizeof(bf16);
static_assert(kSmemBytes <= 48 * 1024, "within the dynamic shared memory a kernel gets without opting in");

template <bool F32_OUT>
void launch(void* out, float* part, const bf16* A, int64_t lda, const bf16* W, const bf16* bias,
            const bf16* residual, int M, int N, int K, int splits, cudaStream_t stream) {
  const dim3 grid(unsigned((N + kBN - 1) / kBN), unsigned(splits));
  skinny_kernel<F32_OUT><<<grid, kThreads, kSmemBytes, stream>>>(out, part, A, lda, W, bias, residual, M, N, K, splits);
  CUDA_CHECK(cudaGetLastError());
  if (splits > 1) {
    const int64_t MN = int64_t(M) * N;
    skinny_reduce_kernel<F32_OUT><<<unsigned((MN + 255) / 256), 256, 0, stream>>>(out, part, bias, residual, M, N,
                                                                                splits);
    CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

bool skinny_supported(int64_t M, int64_t N, int64_t K, int64_t lda, const void* A, const void* W) {
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return M >= 1 && M <= kSkinnyMaxRows && N >= 1 && N <= INT32_MAX && K >= 8 && K % 8 == 0 && K <= INT32_MAX &&
         lda >= K && lda % 8 == 0 && aligned16(A) && aligned16(W);
}

int skinny_splits(int64_t M, int64_t N, int64_t K, int sms) {
  // About two CTAs an SM, each with at least kMinStepsPerSplit steps of K, and
  // partials within kSkinnyPartialBytes.
  const int64_t tiles = (N + kBN - 1) / kBN, k_steps = (K + kBK - 1) / kBK;
  const int64_t want = (2 * int64_t(std::max(sms, 1)) + tiles - 1) / tiles;
  const int64_t by_bytes = int64_t(kSkinnyPartialBytes / (size_t(std::max<int64_t>(M, 1)) * size_t(N) * sizeof(float)));
  const int64_t most = std::max<int64_t>(1, std::min({int64_t(kMaxSplits), k_steps / kMinStepsPerSplit, by_bytes}));
  return int(std::clamp<int64_t>(want, 1, most));
}

size_t skinny_workspace_bytes(int64_t M, int64_t N, int64_t K, int sms) {
  const int splits = skinny_splits(M, N, K, sms);
  return splits > 1 ? size_t(splits) * size_t(M) * size_t(N) * sizeof(float) : 0;
}

void skinny_linear_forward(void* out, GemmOut out_type, const bf16* A, int64_t lda, const bf16* W,
                           const bf16* bias, const bf16* residual, int64_t M, int64_t N, int64_t K,
                           float* workspace, size_t workspace_bytes, int sms, cudaStream_t stream) {
  SHARDLM_CHECK(skinny_supported(M, N, K, lda, A, W),
                "internal: skinny_linear_forward of (%lld x %lld) x (%lld x %lld)^T, lda %lld: not a supported shape",
                (long long)M, (long long)K, (long long)N, (long long)K, (long long)lda);
  SHARDLM_CHECK(out_type == GemmOut::BF16 || (!bias && !residual),
                "internal: skinny_linear_forward adds a bias or residual only to a bf16 output");
  const int splits = skinny_splits(M, N, K, sms);
  const size_t need = skinny_workspace_bytes(M, N, K, sms);
  SHARDLM_CHECK(need <= workspace_bytes, "internal: skinny_linear_forward needs %zu bytes of partials, has %zu",
                need, workspace_bytes);
  if (out_type == GemmOut::F32)
    launch<true>(out, workspace, A, lda, W, nullptr, nullptr, int(M), int(N), int(K), splits, stream);
  else
    launch<false>(out, workspace, A, lda, W, bias, residual, int(M), int(N), int(K), splits, stream);
}

}  // namespace shardlm::cuda
