// checked_math.hpp — int64 size arithmetic that says when it overflows.
//
// Owns: checked_product / checked_sum for sizes that come from decks,
// config.json and file headers, where a typo (2^62) must become an error
// naming the value instead of a wrapped product. Knows nothing about what the
// sizes mean: callers name them in their messages.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace shardlm {

// The product of non-negative factors, or nullopt when a factor is negative or
// the product leaves int64.
inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(product, f, &product)) return std::nullopt;
  return product;
}

// The sum of non-negative terms, or nullopt when a term is negative or the sum leaves int64.
inline std::optional<int64_t> checked_sum(std::initializer_list<int64_t> terms) {
  int64_t sum = 0;
  for (int64_t t : terms)
    if (t < 0 || __builtin_add_overflow(sum, t, &sum)) return std::nullopt;
  return sum;
}

}  // namespace shardlm
