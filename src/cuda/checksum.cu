// checksum.cu — the weight broadcast's checksum of bf16 values in device
// memory (cuda_bf16_checksum, shardlm/cuda.hpp): the host's bf16_checksum
// (broadcast/broadcast.cpp) computed where the bytes lie, from the same per-element
// term (shardlm/checksum_term.hpp), bit for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "shardlm/checksum_term.hpp"
#include "cuda/check.hpp"
#include "cuda/ops_common.cuh"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {
namespace {

// sum += the checksum terms of values [0, n) at flat indices begin + i: 8
// values a thread per step (one 16-byte load) over the vectors, then the
// tail; each warp's sum added once. Sums mod 2^64 are the same in any order.
__global__ void bf16_checksum_kernel(unsigned long long* sum, const uint16_t* __restrict__ values, int64_t begin,
                                     int64_t n, bool vec) {
  uint64_t s = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = vec ? n / 8 : 0;
  for (int64_t v = first; v < vectors; v += stride) {
    const uint4 w = reinterpret_cast<const uint4*>(values)[v];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j) {
      const uint64_t at = uint64_t(begin + 8 * v + 2 * j);
      s += bf16_checksum_term(at, uint16_t(words[j] & 0xffffu)) + bf16_checksum_term(at + 1, uint16_t(words[j] >> 16));
    }
  }
  for (int64_t i = 8 * vectors + first; i < n; i += stride) s += bf16_checksum_term(uint64_t(begin + i), values[i]);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0 && s != 0) atomicAdd(sum, static_cast<unsigned long long>(s));
}

}  // namespace
}  // namespace shardlm::cuda

namespace shardlm {

uint64_t cuda_bf16_checksum(const void* values, int64_t begin, int64_t n, void* sum_scratch, void* stream) {
  using cuda::dev::aligned;
  using cuda::dev::div_up;
  using cuda::dev::kThreads;
  if (n <= 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  SHARDLM_CHECK(sum_scratch != nullptr && aligned(sum_scratch, 8), "internal: the checksum's scratch at %p",
                sum_scratch);
  auto* sum = static_cast<unsigned long long*>(sum_scratch);
  CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof(*sum), s));
  const bool vec = aligned(values, 16);
  const int64_t work = vec ? n / 8 + 8 : n;
  const unsigned blocks = unsigned(std::min<int64_t>(div_up(work, kThreads), 4096));
  cuda::bf16_checksum_kernel<<<blocks, kThreads, 0, s>>>(sum, static_cast<const uint16_t*>(values), begin, n, vec);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long host = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host, sum, sizeof(host), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return static_cast<uint64_t>(host);
}

}  // namespace shardlm
