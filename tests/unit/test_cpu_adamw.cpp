// test_cpu_adamw.cpp — the host AdamW: scalar, AVX2 and AVX-512 paths give the same
// bits (every vector tail, weight decay on and off, with and without the bf16 copy),
// the same bits at any thread count, a float64 evaluation of the formula, and the
// bf16 copy's rounding (ties, overflow, NaN, Inf) against an independent reference.
#include <doctest/doctest.h>

#include "fd_util.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/adamw.hpp"
#include "model/hf.hpp"

namespace {

namespace cpu = shardlm::cpu;
using cpu::CpuIsa;
using shardlm_test::randn, shardlm_test::sz;

// Four arrays of one shard and its bf16 copy: p, g, m, v (n) fp32; bf16 (n) bits.
struct State {
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> bf16;
};

// Moments as after a few steps: m ~ N(0, 0.01^2), v = (N(0, 0.01^2))^2 >= 0; a few
// exact zeros in g and v so denom = eps and 0 * x terms are covered too.
State random_state(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  State s{randn<float>(sz(n), rng), randn<float>(sz(n), rng, 0.3), randn<float>(sz(n), rng, 0.01),
          randn<float>(sz(n), rng, 0.01), std::vector<uint16_t>(sz(n), 0xdead)};
  for (float& x : s.v) x *= x;
  for (int64_t i = 0; i < n; i += 97) s.g[sz(i)] = 0.0f, s.v[sz(i)] = 0.0f;
  return s;
}

bool same_bits(const State& a, const State& b) {
  const auto eq = [](const auto& x, const auto& y) {
    // Empty vectors may hold null data(), which memcmp must not be given (even for 0 bytes).
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  return eq(a.p, b.p) && eq(a.m, b.m) && eq(a.v, b.v) && eq(a.bf16, b.bf16);
}

// Step 3 of lr 1e-3, betas (0.9, 0.999): bias corrections far from 1.
const cpu::AdamWConsts kConsts = cpu::adamw_consts(1e-3, 0.9, 0.999, 1e-8, 3);
constexpr float kGradScale = 0.37f;  // a clipping factor

void step(CpuIsa isa, State& s, float wd, bool bf16, int threads = 0) {
  cpu::adamw_step_isa(isa, s.p.data(), bf16 ? s.bf16.data() : nullptr, s.g.data(), s.m.data(), s.v.data(),
                      static_cast<int64_t>(s.p.size()), kGradScale, wd, kConsts, threads);
}

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512})
    if (cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

// Round to nearest even from the definition, not by bit tricks: of the two bf16
// values around x (truncation, and one bf16 ulp further from zero, 2^128 standing
// in for the value past the largest finite), the nearer; at a tie the even one.
// NaN keeps its sign and top payload bits with the quiet bit set; +-inf stays.
uint16_t reference_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  if (std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  const uint16_t toward_zero = static_cast<uint16_t>(u >> 16), away = static_cast<uint16_t>(toward_zero + 1);
  const auto value = [](uint16_t b) -> double {
    if ((b & 0x7fffu) == 0x7f80u) return std::copysign(std::ldexp(1.0, 128), (b & 0x8000u) ? -1.0 : 1.0);
    return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
  };
  const double d_zero = std::abs(double(x) - value(toward_zero)), d_away = std::abs(double(x) - value(away));
  if (d_zero != d_away) return d_zero < d_away ? toward_zero : away;
  return (toward_zero & 1u) ? away : toward_zero;
}

}  // namespace

TEST_SUITE("cpu_adamw") {

TEST_CASE("scalar, AVX2 and AVX-512 give the same bits for every vector tail, weight decay on and off") {
  const std::vector<CpuIsa> isas = supported_isas();
  MESSAGE("ISAs compared on this CPU: " << isas.size() << " (best: " << std::string(cpu::isa_name(cpu::best_isa())) << ")");
  // Tails of 0..15 after the 16- and 8-wide bodies, a block boundary (65536), and
  // a length spanning 16 blocks with a 3-element last block remainder.
  for (int64_t n : {0, 1, 7, 8, 15, 16, 17, 31, 65537, 1000003})
    for (float wd : {0.0f, 0.1f})
      for (bool bf16 : {false, true}) {
        CAPTURE(n);
        CAPTURE(wd);
        CAPTURE(bf16);
        const State before = random_state(n, 1000 + static_cast<uint64_t>(n));
        State scalar = before;
        step(CpuIsa::scalar, scalar, wd, bf16);
        // The update moved p: all but the rare element whose step is under half
        // an ulp of p (about 1 in 15000 of this data).
        int64_t unchanged = 0;
        for (int64_t i = 0; i < n; ++i) unchanged += scalar.p[sz(i)] == before.p[sz(i)];
        CHECK(unchanged <= n / 1000);
        if (bf16) {
          int64_t mismatches = 0;
          for (int64_t i = 0; i < n; ++i) mismatches += scalar.bf16[sz(i)] != shardlm::f32_to_bf16_rne(scalar.p[sz(i)]);
          CHECK(mismatches == 0);
        }
        for (CpuIsa isa : isas) {
          const std::string isa_label = cpu::isa_name(isa);
          CAPTURE(isa_label);
          State vec = before;
          step(isa, vec, wd, bf16);
          CHECK(same_bits(vec, scalar));
        }
      }
}

TEST_CASE("n = 0 touches nothing") {
  for (CpuIsa isa : supported_isas()) {
    State s = random_state(1, 7);
    const State before = s;
    cpu::adamw_step_isa(isa, s.p.data(), s.bf16.data(), s.g.data(), s.m.data(), s.v.data(), 0, kGradScale, 0.1f,
                        kConsts);
    CHECK(same_bits(s, before));
  }
}

TEST_CASE("the update is the same bits at 1, 2 and 4 threads and at OpenMP's default") {
  const int64_t n = 1000003;  // 16 blocks: every thread count splits them differently
  const State before = random_state(n, 42);
  State one = before;
  step(cpu::adamw_cpu_isa(), one, 0.1f, true, 1);
  CHECK(!same_bits(one, before));
  for (int threads : {2, 4, 0}) {
    CAPTURE(threads);
    State s = before;
    step(cpu::adamw_cpu_isa(), s, 0.1f, true, threads);
    CHECK(same_bits(s, one));
  }
  // adamw_step is adamw_step_isa on the ISA adamw_isa() names.
  State dflt = before;
  cpu::adamw_step(dflt.p.data(), dflt.bf16.data(), dflt.g.data(), dflt.m.data(), dflt.v.data(), n, kGradScale, 0.1f,
                  kConsts, 3);
  CHECK(same_bits(dflt, one));
}

TEST_CASE("one update matches a float64 evaluation of the formula within 1e-6 of its terms") {
  // The reference takes the float constants as given (rounding beta2 = 0.999 to
  // float moves 1 - beta2 by 1.3e-5 relative: that is the formula's, not the
  // kernel's) and does every operation in double. Errors are relative to the sum
  // of the magnitudes of each result's terms, so cancellation (b1*m against
  // (1-b1)*g) does not inflate them; float rounding of the handful of operations
  // is a few 1e-8.
  const double tol = 1e-6;
  const int64_t n = 100003;
  for (float wd : {0.0f, 0.1f})
    for (CpuIsa isa : supported_isas()) {
      CAPTURE(wd);
      const std::string isa_label = cpu::isa_name(isa);
      CAPTURE(isa_label);
      const State before = random_state(n, 5);
      State s = before;
      step(isa, s, wd, false);
      const double b1 = kConsts.b1, b2 = kConsts.b2, lr = kConsts.lr, step_size = kConsts.step_size;
      const double ibc2 = kConsts.inv_bc2_sqrt, eps = kConsts.eps;
      double err_m = 0, err_v = 0, err_p = 0;
      for (int64_t i = 0; i < n; ++i) {
        const size_t e = sz(i);
        const double gi = double(before.g[e]) * double(kGradScale);
        const double m = b1 * before.m[e] + (1.0 - b1) * gi;
        const double v = b2 * before.v[e] + (1.0 - b2) * gi * gi;
        const double decay = lr * double(wd) * before.p[e];
        const double update = step_size * m / (std::sqrt(v) * ibc2 + eps);
        const double p = before.p[e] - decay - update;
        err_m = std::max(err_m, std::abs(s.m[e] - m) /
                                    std::max(std::abs(b1 * before.m[e]) + std::abs((1.0 - b1) * gi), 1e-300));
        err_v = std::max(err_v, std::abs(s.v[e] - v) / std::max(v, 1e-300));
        err_p = std::max(err_p, std::abs(s.p[e] - p) /
                                    (std::abs(double(before.p[e])) + std::abs(decay) + std::abs(update)));
      }
      CHECK(err_m < tol);
      CHECK(err_v < tol);
      CHECK(err_p < tol);
    }
}

TEST_CASE("bf16 conversion: round to nearest even, overflow to inf, NaN quiet with its sign, every ISA") {
  // Literal cases (value bits -> bf16 bits).
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f800000u, 0x3f80u},  // 1.0 exactly
      {0x3f808000u, 0x3f80u},  // tie, even lsb: down
      {0x3f818000u, 0x3f82u},  // tie, odd lsb: up
      {0x3f807fffu, 0x3f80u},  // just below the tie
      {0x3f808001u, 0x3f81u},  // just above the tie
      {0xbf818000u, 0xbf82u},  // negative tie, odd lsb: away from zero
      {0x3fffffffu, 0x4000u},  // carry into the exponent
      {0x7f7f7fffu, 0x7f7fu},  // largest finite bf16, below its half ulp
      {0x7f7f8000u, 0x7f80u},  // tie at the top, odd lsb: inf
      {0x7f7fffffu, 0x7f80u},  // FLT_MAX: inf
      {0xff7fffffu, 0xff80u},  // -FLT_MAX: -inf
      {0x7f800000u, 0x7f80u},  // inf
      {0xff800000u, 0xff80u},  // -inf
      {0x7fc00000u, 0x7fc0u},  // quiet NaN
      {0x7f800001u, 0x7fc0u},  // signalling NaN, payload only in the low half: quiet, not inf
      {0xff800001u, 0xffc0u},  // negative signalling NaN keeps its sign
      {0x7fa00000u, 0x7fe0u},  // signalling NaN with a high payload bit: kept, quieted
      {0xffffffffu, 0xffffu},  // all-ones NaN: no wrap-around
      {0x00008000u, 0x0000u},  // subnormal tie, even: to +0
      {0x00018000u, 0x0002u},  // subnormal tie, odd: up
      {0x80000000u, 0x8000u},  // -0
  };
  // Every sign/exponent/top-mantissa pattern with the interesting low halves.
  std::vector<float> in;
  for (const auto& [bits, expected] : cases) in.push_back(std::bit_cast<float>(bits));
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      in.push_back(std::bit_cast<float>((hi << 16) | lo));
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> reference(in.size());
  for (size_t i = 0; i < in.size(); ++i) reference[i] = reference_bf16(in[i]);
  for (size_t c = 0; c < cases.size(); ++c) {
    CAPTURE(c);
    CHECK(reference[c] == cases[c].second);
  }
  // The project's scalar converter (hf.cpp) agrees with the definition too.
  int64_t hf_mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) hf_mismatches += shardlm::f32_to_bf16_rne(in[i]) != reference[i];
  CHECK(hf_mismatches == 0);
  for (CpuIsa isa : supported_isas()) {
    const std::string isa_label = cpu::isa_name(isa);
    CAPTURE(isa_label);
    // Offsets 0..15 put each value in every lane and in the scalar tail.
    for (int64_t offset : {0, 1, 5, 9, 15}) {
      std::vector<uint16_t> out(in.size(), 0xdead);
      cpu::cast_f32_to_bf16(isa, out.data() + offset, in.data() + offset, n - offset);
      int64_t mismatches = 0;
      for (int64_t i = offset; i < n; ++i) mismatches += out[sz(i)] != reference[sz(i)];
      CHECK(mismatches == 0);
      for (int64_t i = 0; i < offset; ++i) CHECK(out[sz(i)] == 0xdead);
    }
  }
}

TEST_CASE("the update's bf16 copy rounds ties to even and keeps NaNs quiet, in vector bodies and tails") {
  // lr = 0 makes the update the identity on finite p (p - 0*p - 0*m/denom), so
  // the copy must be exactly the bf16 of the crafted inputs; a NaN p stays NaN.
  const cpu::AdamWConsts identity = cpu::adamw_consts(0.0, 0.9, 0.999, 1e-8, 1);
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f808000u, 0x3f80u}, {0x3f818000u, 0x3f82u}, {0xbf818000u, 0xbf82u}, {0x3f808001u, 0x3f81u},
      {0x7f7fffffu, 0x7f80u}, {0x7fc00000u, 0x7fc0u}, {0x7f800001u, 0x7fc0u}, {0xff800001u, 0xffc0u},
      {0x00018000u, 0x0002u},
  };
  const int64_t n = 37;  // two 16-lane bodies (four 8-lane) and a 5-element tail
  for (CpuIsa isa : supported_isas()) {
    const std::string isa_label = cpu::isa_name(isa);
    CAPTURE(isa_label);
    State s = random_state(n, 9);
    for (int64_t i = 0; i < n; ++i) s.p[sz(i)] = std::bit_cast<float>(cases[sz(i) % cases.size()].first);
    cpu::adamw_step_isa(isa, s.p.data(), s.bf16.data(), s.g.data(), s.m.data(), s.v.data(), n, kGradScale, 0.1f,
                        identity);
    for (int64_t i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(s.bf16[sz(i)] == cases[sz(i) % cases.size()].second);
    }
  }
  // With a real update, the copy of every element is the bf16 of its new p.
  const int64_t big = 1000003;
  for (CpuIsa isa : supported_isas()) {
    const std::string isa_label = cpu::isa_name(isa);
    CAPTURE(isa_label);
    State s = random_state(big, 11);
    step(isa, s, 0.1f, true);
    int64_t mismatches = 0, ties = 0;
    for (int64_t i = 0; i < big; ++i) {
      mismatches += s.bf16[sz(i)] != reference_bf16(s.p[sz(i)]);
      ties += (std::bit_cast<uint32_t>(s.p[sz(i)]) & 0xffffu) == 0x8000u;
    }
    CHECK(mismatches == 0);
    CHECK(ties > 0);  // random data does land on ties (about n / 65536 of them)
  }
}

TEST_CASE("SHARDLM_CPU_ISA: a supported name is honoured, anything else falls back to the best ISA") {
  CHECK(cpu::resolve_isa("scalar") == CpuIsa::scalar);
  CHECK(cpu::resolve_isa("avx2") == (cpu::isa_supported(CpuIsa::avx2) ? CpuIsa::avx2 : cpu::best_isa()));
  CHECK(cpu::resolve_isa("avx512") == (cpu::isa_supported(CpuIsa::avx512) ? CpuIsa::avx512 : cpu::best_isa()));
  CHECK(cpu::resolve_isa(nullptr) == cpu::best_isa());
  CHECK(cpu::resolve_isa("") == cpu::best_isa());
  CHECK(cpu::resolve_isa("AVX2") == cpu::best_isa());  // names are lower case
  CHECK(cpu::resolve_isa("sse9") == cpu::best_isa());
  // The best is the widest this CPU has.
  CHECK(cpu::best_isa() == (cpu::isa_supported(CpuIsa::avx512)  ? CpuIsa::avx512
                            : cpu::isa_supported(CpuIsa::avx2) ? CpuIsa::avx2
                                                               : CpuIsa::scalar));
  CHECK(std::string(cpu::adamw_isa()) == cpu::isa_name(cpu::resolve_isa(std::getenv("SHARDLM_CPU_ISA"))));
  MESSAGE("adamw_isa() = " << std::string(cpu::adamw_isa()));
}

}  // TEST_SUITE
