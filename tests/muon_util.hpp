// muon_util.hpp — what the Muon tests share (tests/unit/test_muon.cpp on the host,
// tests/gpu/test_muon_gpu.cpp against the GPU): float64 matrices, singular values
// through a cyclic Jacobi eigen-solver on the smaller Gram matrix, matrices with a
// chosen spectrum, and what the quintic does to one singular value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace shardlm_test {

using Mat = std::vector<double>;  // row-major

inline Mat matmul(const Mat& A, const Mat& B, int64_t m, int64_t k, int64_t n) {  // (m, k) (k, n)
  Mat C(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) C[i * n + j] += A[i * k + p] * B[p * n + j];
  return C;
}

inline Mat transpose(const Mat& A, int64_t m, int64_t n) {
  Mat T(A.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) T[j * m + i] = A[i * n + j];
  return T;
}

// Eigenvalues of a symmetric (n, n) matrix by cyclic Jacobi rotations, ascending.
inline std::vector<double> jacobi_eigenvalues(Mat A, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, total = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) (i == j ? total : off) += A[i * n + j] * A[i * n + j];
    if (off <= 1e-30 * (total + off)) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = A[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (A[q * n + q] - A[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // A <- A P
          const double akp = A[k * n + p], akq = A[k * n + q];
          A[k * n + p] = c * akp - s * akq;
          A[k * n + q] = s * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // A <- P^T A
          const double apk = A[p * n + k], aqk = A[q * n + k];
          A[p * n + k] = c * apk - s * aqk;
          A[q * n + k] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ev[i] = A[i * n + i];
  std::sort(ev.begin(), ev.end());
  return ev;
}

// Singular values of X (rows, cols), ascending: sqrt of the eigenvalues of the smaller Gram matrix.
inline std::vector<double> singular_values(const std::vector<float>& Xf, int64_t rows, int64_t cols) {
  const Mat X(Xf.begin(), Xf.end());
  const bool tall = rows > cols;
  const Mat gram = tall ? matmul(transpose(X, rows, cols), X, cols, rows, cols)
                        : matmul(X, transpose(X, rows, cols), rows, cols, rows);
  std::vector<double> sv = jacobi_eigenvalues(gram, std::min(rows, cols));
  for (double& s : sv) s = std::sqrt(std::max(s, 0.0));
  return sv;
}

// Orthonormal columns (n, k) by Gram–Schmidt (twice) on Gaussian columns.
inline Mat orthonormal_columns(int64_t n, int64_t k, std::mt19937_64& rng) {
  std::normal_distribution<double> gauss;
  Mat Q(static_cast<size_t>(n * k));
  for (double& x : Q) x = gauss(rng);
  for (int64_t j = 0; j < k; ++j)
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < j; ++i) {
        double dot = 0;
        for (int64_t r = 0; r < n; ++r) dot += Q[r * k + i] * Q[r * k + j];
        for (int64_t r = 0; r < n; ++r) Q[r * k + j] -= dot * Q[r * k + i];
      }
      double norm = 0;
      for (int64_t r = 0; r < n; ++r) norm += Q[r * k + j] * Q[r * k + j];
      for (int64_t r = 0; r < n; ++r) Q[r * k + j] /= std::sqrt(norm);
    }
  return Q;
}

// G = U diag(s) V^T (rows, cols) in fp32, U and V with orthonormal columns.
inline std::vector<float> with_spectrum(const std::vector<double>& s, int64_t rows, int64_t cols,
                                        std::mt19937_64& rng) {
  const int64_t k = static_cast<int64_t>(s.size());
  const Mat U = orthonormal_columns(rows, k, rng), V = orthonormal_columns(cols, k, rng);
  std::vector<float> G(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double x = 0;
      for (int64_t i = 0; i < k; ++i) x += U[r * k + i] * s[i] * V[c * k + i];
      G[r * cols + c] = static_cast<float>(x);
    }
  return G;
}

inline double ns_scalar(double x, int steps) {  // what the iteration does to one singular value
  for (int s = 0; s < steps; ++s) x = 3.4445 * x - 4.7750 * x * x * x + 2.0315 * x * x * x * x * x;
  return x;
}

inline std::vector<float> gaussian_floats(size_t n, std::mt19937_64& rng, float std = 1.0f) {
  std::normal_distribution<float> gauss(0.0f, std);
  std::vector<float> v(n);
  for (float& x : v) x = gauss(rng);
  return v;
}

inline double rel_diff(const std::vector<double>& a, const std::vector<double>& ref) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - ref[i]) * (a[i] - ref[i]);
    r += ref[i] * ref[i];
  }
  return std::sqrt(d / std::max(r, 1e-300));
}

}  // namespace shardlm_test
