// test_fp8.cpp — the FP8 emulation (src/cpu/fp8.hpp) on values worked out by
// hand from the formats' definitions, and model.fp8's linear (cpu/fp8_linear.hpp)
// against an fp64 product of the same quantised operands. tests/gpu/test_fp8.cu checks the same
// functions against cuda_fp8.h's conversions (2M floats, bit for bit).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/fp8.hpp"
#include "cpu/fp8_linear.hpp"
#include "cpu/layers.hpp"

using shardlm::cpu::Fp8Format;
using namespace shardlm::cpu;

TEST_CASE("fp8: e4m3 and e5m2 values, rounding to nearest even, saturation") {
  // e4m3: 3 mantissa bits; between 1 and 2 the spacing is 1/8.
  CHECK(fp8_round(1.0f, Fp8Format::E4M3) == 1.0f);
  CHECK(fp8_round(1.0625f, Fp8Format::E4M3) == 1.0f);     // halfway 1 / 1.125: to the even mantissa (1.000)
  CHECK(fp8_round(1.1875f, Fp8Format::E4M3) == 1.25f);    // halfway 1.125 / 1.25: to 1.25 (mantissa 010)
  CHECK(fp8_round(1.07f, Fp8Format::E4M3) == 1.125f);
  CHECK(fp8_round(0.1f, Fp8Format::E4M3) == 0.1015625f);  // 2^-4 * 1.625
  CHECK(fp8_round(-3.3f, Fp8Format::E4M3) == -3.25f);
  CHECK(fp8_round(448.0f, Fp8Format::E4M3) == 448.0f);
  CHECK(fp8_round(470.0f, Fp8Format::E4M3) == 448.0f);    // would round to 480, which e4m3 lacks: saturates
  CHECK(fp8_round(1e9f, Fp8Format::E4M3) == 448.0f);
  CHECK(fp8_round(-INFINITY, Fp8Format::E4M3) == -448.0f);
  CHECK(fp8_round(std::ldexp(1.0f, -9), Fp8Format::E4M3) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(fp8_round(std::ldexp(1.0f, -10), Fp8Format::E4M3) == 0.0f);                 // half of it: ties to even (0)
  CHECK(fp8_round(std::ldexp(1.5f, -10), Fp8Format::E4M3) == std::ldexp(1.0f, -9));
  CHECK(std::signbit(fp8_round(-1e-20f, Fp8Format::E4M3)));
  CHECK(std::isnan(fp8_round(NAN, Fp8Format::E4M3)));
  // e5m2: 2 mantissa bits, largest 57344, smallest subnormal 2^-16.
  CHECK(fp8_round(0.1f, Fp8Format::E5M2) == 0.09375f);
  CHECK(fp8_round(1.125f, Fp8Format::E5M2) == 1.0f);      // halfway 1 / 1.25: even (1.00)
  CHECK(fp8_round(1.375f, Fp8Format::E5M2) == 1.5f);      // halfway 1.25 / 1.5: even (1.10)
  CHECK(fp8_round(60000.0f, Fp8Format::E5M2) == 57344.0f);
  CHECK(fp8_round(std::ldexp(1.0f, -16), Fp8Format::E5M2) == std::ldexp(1.0f, -16));
}

TEST_CASE("fp8: codes and values round-trip; the codes of known values") {
  CHECK(fp8_bits(1.0f, Fp8Format::E4M3) == 0x38);   // 0 0111 000
  CHECK(fp8_bits(448.0f, Fp8Format::E4M3) == 0x7E); // 0 1111 110 (1111 111 is NaN)
  CHECK(fp8_bits(-2.0f, Fp8Format::E4M3) == 0xC0);
  CHECK(fp8_bits(std::ldexp(1.0f, -9), Fp8Format::E4M3) == 0x01);
  CHECK(fp8_bits(1.0f, Fp8Format::E5M2) == 0x3C);   // 0 01111 00
  CHECK(fp8_bits(57344.0f, Fp8Format::E5M2) == 0x7B);
  CHECK(fp8_bits(NAN, Fp8Format::E4M3) == 0x7F);
  CHECK(std::isnan(fp8_value(0x7F, Fp8Format::E4M3)));
  CHECK(std::isinf(fp8_value(0x7C, Fp8Format::E5M2)));
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    int round_trips = 0, finite = 0;
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_value(static_cast<uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      ++finite;
      round_trips += fp8_bits(v, f) == c;
    }
    CHECK(round_trips == finite);
    CHECK(finite == (f == Fp8Format::E4M3 ? 254 : 248));  // e4m3: 2 NaN codes; e5m2: 2 inf + 6 NaN
  }
}

TEST_CASE("fp8: scales put the largest magnitude on the format's largest value") {
  CHECK(fp8_scale(2.0f, Fp8Format::E4M3) == 224.0f);
  CHECK(fp8_scale(0.0f, Fp8Format::E4M3) == 1.0f);
  CHECK(fp8_scale(INFINITY, Fp8Format::E5M2) == 1.0f);
  const std::vector<float> x = {0.5f, -3.0f, 1.0f, 0.001f, 6.0f, -0.25f};  // rows of 3: amax 3 and 6
  std::vector<uint8_t> codes(6);
  std::vector<float> scales(2);
  quantize_fp8_rows(x.data(), 2, 3, Fp8Format::E4M3, codes.data(), scales.data());
  CHECK(scales[0] == 448.0f / 3.0f);
  CHECK(scales[1] == 448.0f / 6.0f);
  CHECK(fp8_value(codes[1], Fp8Format::E4M3) == -448.0f);  // each row's amax lands on 448
  CHECK(fp8_value(codes[4], Fp8Format::E4M3) == 448.0f);
  CHECK(fp8_value(codes[0], Fp8Format::E4M3) == fp8_round(0.5f * scales[0], Fp8Format::E4M3));
  // The reference GEMM of the dequantised codes: (row 0) . (row 1) of x, to FP8 precision.
  const float inv[2] = {1.0f / scales[0], 1.0f / scales[1]};
  float c = 0.0f;
  matmul_fp8_reference(codes.data(), Fp8Format::E4M3, inv, true, codes.data() + 3, Fp8Format::E4M3, inv + 1, true, 1,
                       1, 3, &c);
  double want = 0.0;
  for (int k = 0; k < 3; ++k)
    want += double(fp8_round(x[size_t(k)] * scales[0], Fp8Format::E4M3)) / scales[0] *
            (double(fp8_round(x[size_t(3 + k)] * scales[1], Fp8Format::E4M3)) / scales[1]);
  CHECK(c == doctest::Approx(want).epsilon(1e-6));
  CHECK(c == doctest::Approx(0.5 * 0.001 - 3.0 * 6.0 - 1.0 * 0.25).epsilon(0.01));  // within FP8 precision
}

// ---------------------------------------------------------------- model.fp8's linear (cpu/fp8_linear.hpp)

namespace {

// Deterministic values of magnitudes spread over several binades (so rounding,
// subnormals after scaling and the per-row scales all matter).
std::vector<float> spread_values(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = seed;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    const float u = float(s >> 8) / float(1u << 24);         // [0, 1)
    x = (u - 0.5f) * std::ldexp(1.0f, int(s % 7) - 3);        // |x| up to 8, down to ~1e-8
  }
  return v;
}

std::vector<float> transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  return t;
}

// A (M, K) B (N, K)^T as an FP8 GEMM reads it, in double (matmul_fp8_reference),
// each operand quantised by quantize_fp8 / quantize_fp8_rows: the independent path.
std::vector<float> fp8_product(const std::vector<float>& A, Fp8Format fa, const std::vector<float>& B, Fp8Format fb,
                               int64_t M, int64_t N, int64_t K, bool rowwise) {
  std::vector<uint8_t> qa(size_t(M * K)), qb(size_t(N * K));
  std::vector<float> sa(size_t(rowwise ? M : 1)), sb(size_t(rowwise ? N : 1));
  if (rowwise) {
    quantize_fp8_rows(A.data(), M, K, fa, qa.data(), sa.data());
    quantize_fp8_rows(B.data(), N, K, fb, qb.data(), sb.data());
  } else {
    float amax_a = 0, amax_b = 0;
    for (float v : A) amax_a = std::max(amax_a, std::fabs(v));
    for (float v : B) amax_b = std::max(amax_b, std::fabs(v));
    sa[0] = fp8_scale(amax_a, fa), sb[0] = fp8_scale(amax_b, fb);
    quantize_fp8(A.data(), M * K, sa[0], fa, qa.data());
    quantize_fp8(B.data(), N * K, sb[0], fb, qb.data());
  }
  for (auto& s : sa) s = 1.0f / s;
  for (auto& s : sb) s = 1.0f / s;
  std::vector<float> C(size_t(M * N));
  matmul_fp8_reference(qa.data(), fa, sa.data(), rowwise, qb.data(), fb, sb.data(), rowwise, M, N, K, C.data());
  return C;
}

// max |got - want| relative to max |want|.
double max_rel_error(const float* got, const std::vector<float>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return err / scale;
}

}  // namespace

TEST_CASE("fp8 linear: forward and both backward GEMMs equal the fp64 product of the same quantised operands") {
  const int64_t N = 32, IC = 48, OC = 16;
  shardlm::ModelConfig c;
  c.hidden_size = IC, c.intermediate_size = OC, c.num_heads = 1, c.num_kv_heads = 1, c.head_dim = OC;
  const std::vector<float> x = spread_values(N * IC, 1), w = spread_values(OC * IC, 2), dy = spread_values(N * OC, 3);
  const std::vector<float> bias = spread_values(OC, 4);
  for (shardlm::Fp8Mode mode : {shardlm::Fp8Mode::Tensorwise, shardlm::Fp8Mode::Rowwise}) {
    const std::string name = shardlm::fp8_mode_name(mode);
    CAPTURE(name);
    const bool rowwise = mode == shardlm::Fp8Mode::Rowwise;
    Fp8Linear linear(mode);
    std::vector<shardlm::cpu::BufferRow> rows;
    linear.add_rows(c, N, rows);
    allocate_rows(rows);

    std::vector<float> y(size_t(N * OC)), dx(size_t(N * IC)), dw(size_t(OC * IC), 1.0f), db(size_t(OC), 0.5f);
    linear.forward(y.data(), x.data(), w.data(), bias.data(), N, IC, OC);
    std::vector<float> want_y = fp8_product(x, Fp8Format::E4M3, w, Fp8Format::E4M3, N, OC, IC, rowwise);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t o = 0; o < OC; ++o) want_y[size_t(t * OC + o)] += bias[size_t(o)];
    CHECK(max_rel_error(y.data(), want_y) < 1e-6);  // fp32 accumulation of exact products against fp64

    linear.backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), N, IC, OC);
    // dx = dy W: B = W^T (IC, OC), quantised along OC (its rows: W's columns).
    const std::vector<float> want_dx =
        fp8_product(dy, kFp8GradFormat, transposed(w, OC, IC), Fp8Format::E4M3, N, IC, OC, rowwise);
    CHECK(max_rel_error(dx.data(), want_dx) < 1e-6);
    // dW += dy^T x: A = dy^T (OC, N), B = x^T (IC, N), both quantised along the tokens.
    std::vector<float> want_dw =
        fp8_product(transposed(dy, N, OC), kFp8GradFormat, transposed(x, N, IC), Fp8Format::E4M3, OC, IC, N, rowwise);
    for (auto& v : want_dw) v += 1.0f;
    CHECK(max_rel_error(dw.data(), want_dw) < 1e-6);
    // The bias gradient is dy's fp32 column sums, unquantised.
    for (int64_t o = 0; o < OC; ++o) {
      double sum = 0.5;
      for (int64_t t = 0; t < N; ++t) sum += dy[size_t(t * OC + o)];
      CHECK(db[size_t(o)] == doctest::Approx(sum).epsilon(1e-6));
    }

    // And the quantisation shows: the fp32 product is FP8-precision away (e4m3: 2^-4 relative per operand).
    std::vector<float> exact_y(size_t(N * OC));
    for (int64_t t = 0; t < N; ++t)
      for (int64_t o = 0; o < OC; ++o) {
        double s = bias[size_t(o)];
        for (int64_t k = 0; k < IC; ++k) s += double(x[size_t(t * IC + k)]) * w[size_t(o * IC + k)];
        exact_y[size_t(t * OC + o)] = float(s);
      }
    const double fp8_error = max_rel_error(y.data(), exact_y);
    MESSAGE(name << ": forward vs fp32, max relative error " << fp8_error);
    CHECK(fp8_error > 1e-4);
    CHECK(fp8_error < 0.1);
  }
}

TEST_CASE("fp8 linear: rowwise scales follow each row, so one large row does not flush the others") {
  // Row 0 is 1e5 times row 1: a tensor scale leaves row 1 in e4m3's subnormals, a row scale keeps it whole.
  const int64_t N = 2, IC = 16, OC = 16;
  shardlm::ModelConfig c;
  c.hidden_size = IC, c.intermediate_size = OC, c.num_heads = 1, c.num_kv_heads = 1, c.head_dim = OC;
  std::vector<float> x = spread_values(N * IC, 5), w = spread_values(OC * IC, 6);
  for (int64_t k = 0; k < IC; ++k) x[size_t(k)] *= 1e5f;
  std::vector<float> exact(static_cast<size_t>(OC));  // row 1 of x W^T
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t k = 0; k < IC; ++k) exact[size_t(o)] += x[size_t(IC + k)] * w[size_t(o * IC + k)];
  double err[2];
  for (int m = 0; m < 2; ++m) {
    Fp8Linear linear(m == 0 ? shardlm::Fp8Mode::Tensorwise : shardlm::Fp8Mode::Rowwise);
    std::vector<shardlm::cpu::BufferRow> rows;
    linear.add_rows(c, N, rows);
    allocate_rows(rows);
    std::vector<float> y(size_t(N * OC));
    linear.forward(y.data(), x.data(), w.data(), nullptr, N, IC, OC);
    err[m] = max_rel_error(y.data() + OC, exact);
  }
  MESSAGE("row 1's relative error: tensorwise " << err[0] << ", rowwise " << err[1]);
  CHECK(err[0] > 5 * err[1]);
  CHECK(err[1] < 0.05);
}
