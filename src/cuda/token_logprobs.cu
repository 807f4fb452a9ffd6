// token_logprobs.cu — a sampled token's log-probability on the GPU (see token_logprobs.hpp).
#include "cuda/check.hpp"
#include "cuda/token_logprobs.hpp"
#include "kernel_common.cuh"

#include <cmath>

namespace shardlm::cuda {

namespace {

using namespace dev;  // block_reduce, SumOp, MaxOp

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads)
token_logprobs_kernel(float* __restrict__ out, const float* __restrict__ logits, const int32_t* __restrict__ tokens,
                      float temperature, int64_t V) {
  __shared__ float red_f[kThreads / 32];
  __shared__ double red_d[kThreads / 32];
  const float* x = logits + int64_t(blockIdx.x) * V;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) m = fmaxf(m, x[v]);
  m = block_reduce<kThreads>(m, MaxOp{}, red_f);
  // As cpu::row_softmax: d = (x - max) / T in fp32, exp in fp32, summed in double.
  double sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) sum += double(expf((x[v] - m) / temperature));
  sum = block_reduce<kThreads>(sum, SumOp{}, red_d);
  if (threadIdx.x == 0) {
    const int32_t t = tokens[blockIdx.x];
    out[blockIdx.x] = (t >= 0 && t < V) ? float(double((x[t] - m) / temperature) - log(sum)) : NAN;
  }
}

}  // namespace

void token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature, int64_t n, int64_t V,
                    cudaStream_t stream) {
  if (n == 0) return;
  SHARDLM_CHECK(n <= INT32_MAX && V >= 1, "token_logprobs: %lld rows of %lld logits", (long long)n, (long long)V);
  SHARDLM_CHECK(std::isfinite(temperature) && temperature > 0, "token_logprobs: temperature %g must be positive",
                double(temperature));
  token_logprobs_kernel<<<unsigned(n), kThreads, 0, stream>>>(out, logits, tokens, temperature, V);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace shardlm::cuda
