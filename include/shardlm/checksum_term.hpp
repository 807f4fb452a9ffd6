// checksum_term.hpp — the weight broadcast's per-element hash, one definition
// for the host (broadcast/broadcast.cpp's bf16_checksum) and the GPU
// (cuda_bf16_checksum, cuda/checksum.cu): splitmix64's finaliser of the element's
// flat index and bits. Its sum mod 2^64 over a tensor is the checksum, the same
// for any split over threads, ranks or blocks.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SHARDLM_HOST_DEVICE __host__ __device__
#else
#define SHARDLM_HOST_DEVICE
#endif

namespace shardlm {

inline SHARDLM_HOST_DEVICE uint64_t bf16_checksum_term(uint64_t index, uint16_t bits) {
  uint64_t x = (index << 16) ^ bits;
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace shardlm
