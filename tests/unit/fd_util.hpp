// fd_util.hpp — what the double-precision kernel tests share: tolerances,
// seeded normal inputs, and the error relative to the reference's scale.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace shardlm_test {

using Vec = std::vector<double>;

constexpr double kFdEps = 1e-6;     // central-difference step
constexpr double kFdTol = 1e-6;     // max |analytic - numeric| / max |numeric|
constexpr double kExactTol = 1e-12; // forward vs naive, both in double

// int64 sizes to indices; a function, so `Vec x(sz(n))` is not a vexing parse.
constexpr size_t sz(int64_t n) { return static_cast<size_t>(n); }

template <class T = double>
std::vector<T> randn(size_t n, std::mt19937_64& rng, double sigma = 1.0) {
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<T> x(n);
  for (auto& e : x) e = T(dist(rng));
  return x;
}

inline double max_abs(const Vec& a) {
  double m = 0;
  for (double e : a) m = std::max(m, std::abs(e));
  return m;
}

// max |a - b| / max |b|: the error relative to the gradient's scale, so tiny
// components do not blow the ratio up.
inline double rel_err(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t e = 0; e < a.size(); ++e) d = std::max(d, std::abs(a[e] - b[e]));
  return d / std::max(max_abs(b), 1e-300);
}

}  // namespace shardlm_test
