// test_fp8.cpp — the FP8 emulation (src/cpu/fp8.hpp) on values worked out by
// hand from the formats' definitions. tests/gpu/test_fp8.cu checks the same
// functions against cuda_fp8.h's conversions (2M floats, bit for bit).
#include <cmath>
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>

#include "cpu/fp8.hpp"

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
