// cross_entropy.cu — the fused cross-entropy forward + backward over a chunk of logits
// (one row per thread block cluster) and the ordered sum of its per-row losses; the
// contract is in ops.hpp, precision and bytes moved in docs/kernels.md.
#include "cuda/ops.hpp"
#include "cuda/ops_common.cuh"
#include "kernel_common.cuh"

#include <cooperative_groups.h>

#include <climits>
#include <cmath>

namespace shardlm::cuda {

namespace {

namespace cg = cooperative_groups;
using namespace dev;  // Pack, f32, block_reduce (kernel_common.cuh); kThreads, grid_for (ops_common.cuh)

// ---------------------------------------------------------------- cross-entropy

constexpr int kCeThreads = 512;
constexpr int kCeBatch = 4;  // 16-byte loads in flight per thread while filling smem

// One row per cluster of csize CTAs; CTA `rank` holds columns [rank * chunk, ...) of
// the row in shared memory, so the logits are read from HBM once and written once.
// max and sum-of-exp are combined across the cluster through distributed shared
// memory in rank order (deterministic); every CTA then writes its own gradient slice.
template <int VEC>
__global__ void __launch_bounds__(kCeThreads, 2)
cross_entropy_kernel(bf16* __restrict__ logits, float* __restrict__ loss,
                     const int32_t* __restrict__ targets, const float* __restrict__ weights,
                     float grad_scale, int64_t V, int64_t chunk) {
  using P = Pack<bf16, VEC>;
  extern __shared__ __align__(16) unsigned char ce_smem[];
  P* sx = reinterpret_cast<P*>(ce_smem);
  __shared__ float red[kCeThreads / 32];
  __shared__ float cta_max, cta_sum;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int csize = int(cluster.num_blocks());
  const int64_t row = blockIdx.x / csize;
  bf16* x = logits + row * V;
  const int64_t c0 = min(V, rank * chunk), c1 = min(V, c0 + chunk);
  const int nvec = int((c1 - c0) / VEC);
  const int tid = threadIdx.x;

  const int32_t target = targets[row];
  const float w = weights ? weights[row] : 1.0f;
  if (target < 0 || target >= V || w == 0.0f) {  // the same for the whole cluster
    P zero;
    zero.raw = {};
    for (int i = tid; i < nvec; i += kCeThreads) zero.store(x + c0 + int64_t(i) * VEC);
    if (rank == 0 && tid == 0) loss[row] = target >= V ? __int_as_float(0x7fc00000) : 0.0f;
    return;
  }
  // Read before the first cluster barrier: no CTA writes the row before it.
  const float x_target = (rank == 0 && tid == 0) ? f32(x[target]) : 0.0f;

  const float row_max =
      slice_to_smem_row_max<VEC, kCeThreads, kCeBatch>(x + c0, nvec, sx, red, &cta_max, cluster);

  float s = 0.0f;
  for (int i = tid; i < nvec; i += kCeThreads) {
    const P p = sx[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += __expf(f32(p.v[j]) - row_max);
  }
  s = block_reduce<kCeThreads>(s, SumOp{}, red);
  if (tid == 0) cta_sum = s;
  cluster.sync();
  float row_sum = 0.0f;
  for (int r = 0; r < csize; ++r) row_sum += *cluster.map_shared_rank(&cta_sum, r);

  const float coef = w * grad_scale / row_sum;
  const float w_scale = w * grad_scale;
  for (int i = tid; i < nvec; i += kCeThreads) {
    const P p = sx[i];
    P g;
    const int64_t col0 = c0 + int64_t(i) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float d = __expf(f32(p.v[j]) - row_max) * coef;
      if (col0 + j == target) d -= w_scale;
      g.v[j] = to_bf16(d);
    }
    g.store(x + col0);
  }
  if (rank == 0 && tid == 0) loss[row] = w * ((row_max + logf(row_sum)) - x_target);
  cluster.sync();  // no CTA may exit while another still reads its cta_max / cta_sum
}

__global__ void __launch_bounds__(1024)
sum_rows_kernel(double* __restrict__ out, const float* __restrict__ x, int64_t n,
                bool accumulate) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += double(x[i]);
  s = block_reduce(s, SumOp{}, red);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

}  // namespace

// ================================================================ launchers

void cross_entropy_forward_backward(bf16* logits, float* loss, const int32_t* targets,
                                    const float* weights, float grad_scale, int64_t n,
                                    int64_t V, cudaStream_t stream) {
  const char* op = "cross_entropy_forward_backward";
  check_size(n, INT_MAX / kRowClusterMax, "n", op);
  check_size(V, INT_MAX, "V", op);
  if (n == 0) return;
  SHARDLM_CHECK(V > 0, "%s: V must be positive", op);
  const bool vec = V % 8 == 0 && aligned(logits, 16);
  const RowClusterSplit split = row_cluster_split(V, vec ? 8 : 1, op);
  const RowClusterLaunch launch(split, n, kCeThreads, stream);
  if (vec) {
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel<8>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, cross_entropy_kernel<8>, logits, loss, targets, weights,
                                  grad_scale, V, split.chunk));
  } else {
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel<1>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(split.smem)));
    CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, cross_entropy_kernel<1>, logits, loss, targets, weights,
                                  grad_scale, V, split.chunk));
  }
  CUDA_CHECK(cudaGetLastError());
}

void sum_rows(double* out, const float* x, int64_t n, bool accumulate, cudaStream_t stream) {
  check_size(n, INT64_MAX / 8, "n", "sum_rows");
  sum_rows_kernel<<<1, 1024, 0, stream>>>(out, x, n, accumulate);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
