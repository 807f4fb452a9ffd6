// fp8.cpp — FP8 quantisation emulated in fp32. See src/cpu/fp8.hpp.
#include "cpu/fp8.hpp"

#include <algorithm>
#include <cmath>

namespace shardlm::cpu {

namespace {

struct Layout {
  int mantissa;   // mantissa bits
  int bias;       // exponent bias
  int min_exp;    // exponent of the smallest normal value, 1 - bias
};

Layout layout_of(Fp8Format f) { return f == Fp8Format::E4M3 ? Layout{3, 7, -6} : Layout{2, 15, -14}; }

}  // namespace

float fp8_round(float x, Fp8Format f) {
  if (std::isnan(x)) return x;
  const Layout l = layout_of(f);
  const float top = fp8_max(f);
  const float a = std::fabs(x);
  if (a >= top) return std::copysign(top, x);  // saturate (infinities too)
  if (a == 0.0f) return x;                     // keeps the sign of zero
  int e = 0;
  std::frexp(a, &e);                           // a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
  const int exponent = std::max(e - 1, l.min_exp);
  const float spacing = std::ldexp(1.0f, exponent - l.mantissa);
  // a / spacing is exact (a power of two); nearbyint rounds half to even.
  const float r = std::nearbyint(a / spacing) * spacing;
  return std::copysign(std::min(r, top), x);
}

uint8_t fp8_bits(float x, Fp8Format f) {
  const Layout l = layout_of(f);
  const float r = fp8_round(x, f);
  if (std::isnan(r)) return 0x7F;  // NaN: 0.1111.111 (e4m3), 0.11111.11 (e5m2)
  const uint8_t sign = std::signbit(r) ? 0x80 : 0x00;
  const float a = std::fabs(r);
  if (a == 0.0f) return sign;
  int e = 0;
  std::frexp(a, &e);
  const int exponent = e - 1;
  if (exponent < l.min_exp)  // subnormal: exponent field 0, a = mantissa 2^(min_exp - mantissa bits)
    return static_cast<uint8_t>(sign | static_cast<int>(std::ldexp(a, l.mantissa - l.min_exp)));
  const int mantissa = static_cast<int>(std::ldexp(a, l.mantissa - exponent)) - (1 << l.mantissa);
  return static_cast<uint8_t>(sign | ((exponent + l.bias) << l.mantissa) | mantissa);
}

float fp8_value(uint8_t bits, Fp8Format f) {
  const Layout l = layout_of(f);
  const int exp_bits = 7 - l.mantissa;
  const int ef = (bits >> l.mantissa) & ((1 << exp_bits) - 1);
  const int mf = bits & ((1 << l.mantissa) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (f == Fp8Format::E4M3 && ef == 15 && mf == 7) return std::nanf("");
  if (f == Fp8Format::E5M2 && ef == 31) return mf == 0 ? sign * INFINITY : std::nanf("");
  if (ef == 0) return sign * std::ldexp(static_cast<float>(mf), l.min_exp - l.mantissa);
  return sign * std::ldexp(static_cast<float>((1 << l.mantissa) | mf), ef - l.bias - l.mantissa);
}

float fp8_scale(float amax, Fp8Format f) {
  if (!std::isfinite(amax) || amax <= 0.0f) return 1.0f;  // all zero; non-finite steps are skipped anyway
  return fp8_max(f) / std::max(amax, 1e-12f);
}

void quantize_fp8(const float* x, int64_t n, float scale, Fp8Format f, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = fp8_bits(x[i] * scale, f);
}

void quantize_fp8_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, uint8_t* codes, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
    scales[r] = fp8_scale(amax, f);
    quantize_fp8(row, cols, scales[r], f, codes + r * cols);
  }
}

void quantize_fp8_values(const float* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, float* values,
                         float* inv_scales) {
  const int64_t scales = scaling == Fp8Scaling::Tensor ? 1 : scaling == Fp8Scaling::Rows ? rows : cols;
  const auto at = [scaling](int64_t r, int64_t c) {
    return scaling == Fp8Scaling::Tensor ? 0 : scaling == Fp8Scaling::Rows ? r : c;
  };
  // inv_scales holds the amaxes, then the scales, then their inverses: no scratch.
  std::fill(inv_scales, inv_scales + scales, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) inv_scales[at(r, c)] = std::max(inv_scales[at(r, c)], std::fabs(x[r * cols + c]));
  for (int64_t i = 0; i < scales; ++i) inv_scales[i] = fp8_scale(inv_scales[i], f);
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) values[r * cols + c] = fp8_round(x[r * cols + c] * inv_scales[at(r, c)], f);
  for (int64_t i = 0; i < scales; ++i) inv_scales[i] = 1.0f / inv_scales[i];
}

void matmul_fp8_reference(const uint8_t* A, Fp8Format fa, const float* a_inv, bool a_rows, const uint8_t* B,
                          Fp8Format fb, const float* b_inv, bool b_rows, int64_t M, int64_t N, int64_t K, float* C) {
  float va[256], vb[256];
  for (int c = 0; c < 256; ++c) {
    va[c] = fp8_value(static_cast<uint8_t>(c), fa);
    vb[c] = fp8_value(static_cast<uint8_t>(c), fb);
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0.0;
      const uint8_t* a = A + i * K;
      const uint8_t* b = B + j * K;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(va[a[k]]) * static_cast<double>(vb[b[k]]);
      C[i * N + j] = static_cast<float>(sum * a_inv[a_rows ? i : 0] * b_inv[b_rows ? j : 0]);
    }
}

}  // namespace shardlm::cpu
