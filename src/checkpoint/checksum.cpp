// checksum.cpp — the checkpoint's per-dataset checksum (checkpoint/checksum.hpp).
#include "checkpoint/checksum.hpp"

#include <cstring>

namespace shardlm {
namespace {
// splitmix64's finaliser over (index, value bits): for a fixed index it is a
// bijection of the bits, so changing any one element always changes the sum.
inline uint64_t mix(uint64_t index, uint64_t bits) {
  uint64_t x = bits ^ (index * 0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return x;
}
}  // namespace

uint64_t checksum_f32(const float* values, int64_t first_index, int64_t count) {
  uint64_t sum = 0;  // unsigned: wraps mod 2^64, so any split and order give the same sum
#pragma omp parallel for reduction(+ : sum) schedule(static) if (count > (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    sum += mix(static_cast<uint64_t>(first_index + i), bits);
  }
  return sum;
}

uint64_t checksum_i64(const int64_t* values, int64_t first_index, int64_t count) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < count; ++i) sum += mix(static_cast<uint64_t>(first_index + i), static_cast<uint64_t>(values[i]));
  return sum;
}

uint64_t checksum_text(const std::string& text) {
  uint64_t sum = 0;
  for (size_t i = 0; i < text.size(); ++i)
    sum += mix(static_cast<uint64_t>(i), static_cast<uint64_t>(static_cast<unsigned char>(text[i])));
  return sum;
}

}  // namespace shardlm
