// reduce.cu — the deterministic reductions over many rows: the ordered column pass that
// finishes every column reduction (RMSNorm's dweight, the bias gradient), the bias
// gradient itself, and the sum of squares of the gradient norm; the contracts are in
// ops.hpp and ops_common.cuh, precision and bytes moved in docs/kernels.md.
#include "cuda/ops.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <algorithm>
#include <climits>

namespace shardlm::cuda {

namespace {

using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

// dst[c] += sum over p of partial[p][c], p in order: the second pass of every
// deterministic column reduction. partial (P, C). Block (32, kFinishSlices): each
// thread sums the rows p = y, y + kFinishSlices, ... then slice sums in slice order.
constexpr int kFinishSlices = 16;
__global__ void __launch_bounds__(32 * kFinishSlices)
column_finish_kernel(float* __restrict__ dst, const float* __restrict__ partial, int64_t P,
                     int C) {
  __shared__ float slice_sum[kFinishSlices][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float t = 0.0f;
  if (c < C)
    for (int64_t p = threadIdx.y; p < P; p += kFinishSlices) t += partial[p * C + c];
  slice_sum[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float s = slice_sum[0][threadIdx.x];
  for (int y = 1; y < kFinishSlices; ++y) s += slice_sum[y][threadIdx.x];
  dst[c] += s;
}

// A fixed grid (kSumSquaresBlocks x kThreads) whatever the GPU: thread i sums the
// vectors i, i + stride, ... in double; blocks reduce in a fixed tree.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
sum_squares_partial_kernel(double* __restrict__ partial, const float* __restrict__ x,
                           int64_t n) {
  __shared__ double red[kThreads / 32];
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t nvec = n / VEC;
  double s = 0.0;
  for (int64_t i = tid; i < nvec; i += stride) {
    const auto p = Pack<float, VEC>::load(x + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += double(p.v[j]) * double(p.v[j]);
  }
  if (nvec * VEC + tid < n) {
    const double t = x[nvec * VEC + tid];
    s += t * t;
  }
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kSumSquaresBlocks)
sum_partials_kernel(double* __restrict__ out, const double* __restrict__ partial,
                    int64_t P, bool accumulate) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) s += partial[i];
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

constexpr int kColumnSlices = 8;       // block (32, kColumnSlices)
constexpr int kColumnMaxPartials = 64; // row chunks of bias_grad

// partial[chunk][c] = sum of x[r][c] over the chunk's rows: thread (x, y) sums rows
// y, y + kColumnSlices, ... of its VEC columns, then the slices in order.
template <int VEC>
__global__ void __launch_bounds__(32 * kColumnSlices)
column_sum_partial_kernel(float* __restrict__ partial, const bf16* __restrict__ x, int64_t N,
                          int C, int64_t rows_per_chunk) {
  __shared__ float slice_sum[kColumnSlices][32 * VEC + 1];
  const int c = (blockIdx.x * 32 + threadIdx.x) * VEC;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float acc[VEC] = {};
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColumnSlices) {
      const auto p = Pack<bf16, VEC>::load(x + r * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += f32(p.v[j]);
    }
#pragma unroll
  for (int j = 0; j < VEC; ++j) slice_sum[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float s = slice_sum[0][threadIdx.x * VEC + j];
    for (int y = 1; y < kColumnSlices; ++y) s += slice_sum[y][threadIdx.x * VEC + j];
    partial[int64_t(blockIdx.y) * C + c + j] = s;
  }
}

int64_t bias_rows_per_chunk(int64_t N) {
  return kColumnSlices * std::max<int64_t>(1, div_up(N, int64_t(kColumnSlices) * kColumnMaxPartials));
}

}  // namespace

// ================================================================ launchers

namespace dev {

void zero_amax(float* amax, cudaStream_t stream) {
  if (amax) CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
}

void launch_column_finish(float* dst, const float* partial, int64_t P, int C,
                          cudaStream_t stream) {
  column_finish_kernel<<<grid_for(C, 32), dim3(32, kFinishSlices), 0, stream>>>(dst, partial,
                                                                                 P, C);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace dev

size_t sum_squares_scratch_bytes() { return kSumSquaresBlocks * sizeof(double); }

void sum_squares(double* out, const float* x, int64_t n, bool accumulate, void* scratch,
                 size_t scratch_bytes, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "sum_squares");
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= sum_squares_scratch_bytes(),
                "sum_squares: scratch of %zu bytes is smaller than the %zu needed", scratch_bytes,
                sum_squares_scratch_bytes());
  auto* partial = static_cast<double*>(scratch);
  if (aligned(x, 16))
    sum_squares_partial_kernel<4><<<kSumSquaresBlocks, kThreads, 0, stream>>>(partial, x, n);
  else
    sum_squares_partial_kernel<1><<<kSumSquaresBlocks, kThreads, 0, stream>>>(partial, x, n);
  CUDA_CHECK(cudaGetLastError());
  sum_partials_kernel<<<1, kSumSquaresBlocks, 0, stream>>>(out, partial, kSumSquaresBlocks,
                                                          accumulate);
  CUDA_CHECK(cudaGetLastError());
}

size_t bias_grad_scratch_bytes(int64_t N, int64_t OC) {
  check_size(N, INT_MAX, "N", "bias_grad");
  check_size(OC, INT_MAX, "OC", "bias_grad");
  if (N == 0) return 0;
  return size_t(div_up(N, bias_rows_per_chunk(N)) * OC) * sizeof(float);
}

void bias_grad(float* dbias, const bf16* dout, int64_t N, int64_t OC, void* scratch,
               size_t scratch_bytes, cudaStream_t stream) {
  const char* op = "bias_grad";
  check_size(N, INT_MAX, "N", op);
  check_size(OC, INT_MAX, "OC", op);
  if (N == 0 || OC == 0) return;
  const int64_t rows_per_chunk = bias_rows_per_chunk(N);
  const int64_t P = div_up(N, rows_per_chunk);
  const size_t need = size_t(P * OC) * sizeof(float);
  SHARDLM_CHECK(scratch != nullptr && scratch_bytes >= need,
                "%s: scratch of %zu bytes is smaller than the %zu needed", op, scratch_bytes, need);
  auto* partial = static_cast<float*>(scratch);
  const dim3 block(32, kColumnSlices);
  if (OC % 8 == 0 && aligned(dout, 16))
    column_sum_partial_kernel<8><<<dim3(grid_for(OC / 8, 32), unsigned(P)), block, 0, stream>>>(
        partial, dout, N, int(OC), rows_per_chunk);
  else
    column_sum_partial_kernel<1><<<dim3(grid_for(OC, 32), unsigned(P)), block, 0, stream>>>(
        partial, dout, N, int(OC), rows_per_chunk);
  CUDA_CHECK(cudaGetLastError());
  launch_column_finish(dbias, partial, P, int(OC), stream);
}

}  // namespace shardlm::cuda
