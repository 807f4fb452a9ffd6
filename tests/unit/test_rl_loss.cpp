// test_rl_loss.cpp — the RL policy loss kernel: a float64 reference written from
// the formula, masking at and around both thresholds, finite differences on the
// fused function, the exact-zero gradient on-policy with zero advantages,
// thread-count determinism and bad inputs.
#include <doctest/doctest.h>

#include "fd_util.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "shardlm/error.hpp"
#include "cpu/rl_loss.hpp"

namespace {

namespace cpu = shardlm::cpu;
using cpu::RlChunkStats;
using cpu::RlLossParams;
using shardlm_test::Vec;
using shardlm_test::kExactTol, shardlm_test::kFdEps, shardlm_test::kFdTol;
using shardlm_test::max_abs, shardlm_test::randn, shardlm_test::rel_err, shardlm_test::sz;
using FVec = std::vector<float>;

// One chunk's inputs; logits in double, converted for the float kernel.
struct Chunk {
  int64_t n = 0, V = 0;
  Vec logits;                     // (n, V)
  std::vector<int32_t> targets;   // (n)
  Vec weights;                    // (n)
  FVec advantages, logprobs_inf;  // (n)
  FVec temperatures;              // (n)
};

// The formula of cpu/rl_loss.hpp, straight from its definition, in double.
// force_kept: -1 = decide masking by the rule; 0 / 1 = every loss token masked /
// kept (for tokens exactly at a threshold, where the reference's own logp, a few
// ulps from the kernel's, could fall on the other side).
struct Reference {
  double loss = 0;
  Vec grad;  // (n, V), already times grad_scale
  RlChunkStats stats;
};

Reference reference(const Chunk& c, const RlLossParams& p, double grad_scale, int force_kept = -1) {
  Reference ref;
  ref.grad.assign(sz(c.n * c.V), 0.0);
  for (int64_t t = 0; t < c.n; ++t) {
    const int32_t y = c.targets[sz(t)];
    const double w = c.weights[sz(t)];
    if (y < 0 || w <= 0) continue;
    const double tau = c.temperatures[sz(t)];
    Vec z(sz(c.V));
    for (int64_t v = 0; v < c.V; ++v) z[sz(v)] = c.logits[sz(t * c.V + v)] / tau;
    const double zmax = *std::max_element(z.begin(), z.end());
    double Z = 0;
    for (double zv : z) Z += std::exp(zv - zmax);
    Vec prob(sz(c.V));
    for (int64_t v = 0; v < c.V; ++v) prob[sz(v)] = std::exp(z[sz(v)] - zmax) / Z;
    const double logp = z[sz(y)] - zmax - std::log(Z);
    const double lp_inf = c.logprobs_inf[sz(t)];
    const double A = c.advantages[sz(t)];
    const double log_r = logp - lp_inf;
    const double r = std::exp(log_r);
    const double dp = std::exp(logp) - std::exp(lp_inf);
    const bool high = A > 0 && dp > p.mask_high;
    const bool low = A <= 0 && dp < -p.mask_low;
    const bool kept = force_kept < 0 ? !(high || low) : force_kept == 1;
    ref.loss += w * ((kept ? -A * r : 0.0) + p.kl_coef * log_r * log_r) + p.ce_coef * w * (-logp);
    const double dloss_dlogp = w * ((kept ? -A * r : 0.0) + 2 * p.kl_coef * log_r) - p.ce_coef * w;
    for (int64_t v = 0; v < c.V; ++v)
      ref.grad[sz(t * c.V + v)] = grad_scale * dloss_dlogp * ((v == y ? 1.0 : 0.0) - prob[sz(v)]) / tau;
    double entropy = 0;
    for (double pv : prob) entropy -= pv > 0 ? pv * std::log(pv) : 0.0;
    ref.stats.loss_tokens += 1;
    ref.stats.masked_high += high;
    ref.stats.masked_low += low;
    ref.stats.entropy_sum += entropy;
    ref.stats.mismatch_kl_sum += r - log_r - 1;
    ref.stats.advantage_sum += A;
  }
  ref.stats.loss = ref.loss;
  return ref;
}

template <class T>
RlChunkStats run_kernel(const Chunk& c, const RlLossParams& p, double grad_scale, std::vector<T>& dlogits) {
  dlogits.assign(c.logits.begin(), c.logits.end());
  const std::vector<T> w(c.weights.begin(), c.weights.end());
  const shardlm::RlTokenInputs in{.advantages = c.advantages.data(), .inference_logprobs = c.logprobs_inf.data(),
                                  .temperatures = c.temperatures.data()};
  return cpu::rl_loss_forward_backward<T>(dlogits.data(), c.targets.data(), w.data(), in, p, T(grad_scale), c.n, c.V);
}

// The kernel's own logp for every row (float, as an inference server would send).
FVec kernel_logprobs(const Chunk& c) {
  FVec lp(sz(c.n));
  const FVec logits(c.logits.begin(), c.logits.end());
  cpu::token_logprobs<float>(lp.data(), logits.data(), c.targets.data(), c.temperatures.data(), c.n, c.V);
  return lp;
}

// Random chunk: mixed temperatures, ignored rows (target -1, weight 0), varied
// weights, advantages of both signs and exact zeros, inference probabilities
// that differ from the train ones by up to +-0.4 so that both masks trigger.
Chunk random_chunk(std::mt19937_64& rng, int64_t n, int64_t V) {
  Chunk c;
  c.n = n;
  c.V = V;
  c.logits = randn(sz(n * V), rng, 2.0);
  std::uniform_int_distribution<int32_t> tok(0, int32_t(V - 1));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const float temps[] = {1.0f, 0.7f, 1.3f, 2.0f, 0.5f};
  for (int64_t t = 0; t < n; ++t) {
    c.targets.push_back(t % 11 == 5 ? -1 : tok(rng));
    c.weights.push_back(t % 13 == 7 ? 0.0 : 0.5 + unit(rng));
    c.temperatures.push_back(temps[t % 5]);
    c.advantages.push_back(t % 6 == 0 ? 0.0f : float(2 * unit(rng) - 1));
  }
  // Train probabilities from the reference, then an inference probability near them.
  Chunk probe = c;
  probe.logprobs_inf.assign(sz(n), 0.0f);
  const FVec lp = kernel_logprobs(probe);
  for (int64_t t = 0; t < n; ++t) {
    const double pt = std::exp(double(lp[sz(t)]));
    const double pi = std::clamp(pt + 0.8 * (unit(rng) - 0.5), 0.005, 0.995);
    c.logprobs_inf.push_back(float(std::log(pi)));
  }
  return c;
}

void check_stats(const RlChunkStats& got, const RlChunkStats& want, double tol) {
  CHECK(got.loss_tokens == want.loss_tokens);
  CHECK(got.masked_high == want.masked_high);
  CHECK(got.masked_low == want.masked_low);
  CHECK(std::abs(got.loss - want.loss) <= tol * std::max(1.0, std::abs(want.loss)));
  CHECK(std::abs(got.entropy_sum - want.entropy_sum) <= tol * std::max(1.0, want.entropy_sum));
  CHECK(std::abs(got.mismatch_kl_sum - want.mismatch_kl_sum) <= tol * std::max(1.0, want.mismatch_kl_sum));
  CHECK(std::abs(got.advantage_sum - want.advantage_sum) <= tol * std::max(1.0, std::abs(want.advantage_sum)));
}

template <class F>
void with_threads(int threads, F&& fn) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  fn();
  omp_set_num_threads(before);
}

// A one-row chunk whose target has train probability set by its logit, for the
// threshold cases: V = 5, target 2.
Chunk one_row(double target_logit, float advantage, float tau) {
  Chunk c;
  c.n = 1;
  c.V = 5;
  c.logits = {0.3, -0.2, target_logit, 0.1, -0.5};
  c.targets = {2};
  c.weights = {1.0};
  c.advantages = {advantage};
  c.temperatures = {tau};
  c.logprobs_inf = {0.0f};
  return c;
}

// dp exactly as the kernel forms it for T = float.
double kernel_dp(float logp, float lp_inf) { return std::exp(double(logp)) - std::exp(double(lp_inf)); }

}  // namespace

TEST_SUITE("rl_loss") {

TEST_CASE("loss, gradients and statistics match a float64 reference (temperatures, masks, CE term)") {
  std::mt19937_64 rng(21);
  const Chunk c = random_chunk(rng, 60, 9);
  const double grad_scale = 1.0 / 37;
  for (const RlLossParams& p : {RlLossParams{}, RlLossParams{.mask_high = 0.1, .mask_low = 0.3,
                                                            .kl_coef = 0.05, .ce_coef = 0.4}}) {
    CAPTURE(p.ce_coef);
    const Reference ref = reference(c, p, grad_scale);
    // The inputs exercise what they claim to: both masks, ignored rows, zero advantages.
    REQUIRE(ref.stats.masked_high > 0);
    REQUIRE(ref.stats.masked_low > 0);
    REQUIRE(ref.stats.loss_tokens < c.n);
    REQUIRE(ref.stats.loss_tokens > ref.stats.masked_high + ref.stats.masked_low);

    Vec dlogits;
    const RlChunkStats got = run_kernel<double>(c, p, grad_scale, dlogits);
    check_stats(got, ref.stats, kExactTol);
    CHECK(rel_err(dlogits, ref.grad) < kExactTol);
    for (int64_t t = 0; t < c.n; ++t)
      if (c.targets[sz(t)] < 0 || c.weights[sz(t)] == 0)
        for (int64_t v = 0; v < c.V; ++v) CHECK(dlogits[sz(t * c.V + v)] == 0.0);

    // The float kernel (the CPU backend's) agrees to float precision.
    std::vector<float> dlogits_f;
    const RlChunkStats got_f = run_kernel<float>(c, p, grad_scale, dlogits_f);
    check_stats(got_f, ref.stats, 2e-5);
    CHECK(rel_err(Vec(dlogits_f.begin(), dlogits_f.end()), ref.grad) < 2e-5);
  }
}

TEST_CASE("masking at and around the thresholds, on both sides") {
  const RlLossParams defaults;
  // Target 2 with logit 1.5 at tau 0.8 has train probability ~0.63, so inference
  // probabilities 0.2 and 0.3 above and below it exist; logit -1 at tau 1: ~0.09.
  struct Case {
    const char* name;
    double target_logit;
    float tau, advantage;
    double delta;      // p_inf = p_train - delta (delta > 0: probability rose by delta)
    bool masked_high, masked_low;
  };
  const Case cases[] = {
      {"A>0, rose 0.2+1e-4: masked high", 1.5, 0.8f, 1.0f, 0.2 + 1e-4, true, false},
      {"A>0, rose 0.2-1e-4: kept", 1.5, 0.8f, 1.0f, 0.2 - 1e-4, false, false},
      {"A<0, fell 0.2+1e-4: masked low", 1.5, 0.8f, -1.0f, -(0.2 + 1e-4), false, true},
      {"A<0, fell 0.2-1e-4: kept", 1.5, 0.8f, -1.0f, -(0.2 - 1e-4), false, false},
      {"A=0 is the low side: fell 0.2+1e-4: masked low", 1.5, 0.8f, 0.0f, -(0.2 + 1e-4), false, true},
      {"A=0, rose 0.3: kept (high mask needs A>0)", 1.5, 0.8f, 0.0f, 0.3, false, false},
      {"A>0, fell 0.3: kept (moved against A)", 1.5, 0.8f, 1.0f, -0.3, false, false},
      {"A<0, rose 0.3: kept (moved against A)", 1.5, 0.8f, -1.0f, 0.3, false, false},
      {"A>0 from p ~0.09, rose 0.05: kept", -1.0, 1.0f, 0.5f, 0.05, false, false},
      {"A<0 from p ~0.09, fell 0.08: kept", -1.0, 1.0f, -0.5f, -0.08, false, false},
  };
  for (const Case& k : cases) {
    CAPTURE(k.name);
    Chunk c = one_row(k.target_logit, k.advantage, k.tau);
    const float logp = kernel_logprobs(c)[0];
    const double p_inf = std::exp(double(logp)) - k.delta;
    REQUIRE(p_inf > 0);
    REQUIRE(p_inf < 1);
    c.logprobs_inf = {float(std::log(p_inf))};
    const Reference ref = reference(c, defaults, 1.0);
    REQUIRE(ref.stats.masked_high == k.masked_high);  // the case is built as named
    REQUIRE(ref.stats.masked_low == k.masked_low);
    std::vector<float> g;
    const RlChunkStats got = run_kernel<float>(c, defaults, 1.0, g);
    CHECK(got.masked_high == int64_t(k.masked_high));
    CHECK(got.masked_low == int64_t(k.masked_low));
    CHECK(rel_err(Vec(g.begin(), g.end()), ref.grad) < 1e-5);
  }
}

TEST_CASE("masking exactly at the threshold keeps the token; one ulp inside it masks") {
  const RlLossParams defaults;
  for (const float A : {1.0f, -1.0f, 0.0f}) {
    CAPTURE(A);
    Chunk c = one_row(1.5, A, 0.8f);
    const float logp = kernel_logprobs(c)[0];
    const double shift = A > 0 ? -0.25 : 0.25;  // rise for A > 0, fall otherwise
    c.logprobs_inf = {float(std::log(std::exp(double(logp)) + shift))};
    const double dp = kernel_dp(logp, c.logprobs_inf[0]);
    RlLossParams at = defaults, inside = defaults;
    if (A > 0) {
      REQUIRE(dp > 0);
      at.mask_high = dp;  // dp > mask_high is false
      inside.mask_high = std::nextafter(dp, 0.0);
    } else {
      REQUIRE(dp < 0);
      at.mask_low = -dp;  // dp < -mask_low is false
      inside.mask_low = std::nextafter(-dp, 0.0);
    }
    std::vector<float> g_at, g_inside;
    const RlChunkStats s_at = run_kernel<float>(c, at, 1.0, g_at);
    const RlChunkStats s_inside = run_kernel<float>(c, inside, 1.0, g_inside);
    CHECK(s_at.masked_high + s_at.masked_low == 0);
    CHECK(s_inside.masked_high == int64_t(A > 0));
    CHECK(s_inside.masked_low == int64_t(A <= 0));
    // Kept: the policy-gradient term is in the gradient; masked: only KL remains.
    CHECK(rel_err(Vec(g_at.begin(), g_at.end()), reference(c, at, 1.0, /*force_kept=*/1).grad) < 1e-5);
    CHECK(rel_err(Vec(g_inside.begin(), g_inside.end()), reference(c, inside, 1.0, 0).grad) < 1e-5);
    if (A != 0.0f) CHECK(std::abs(g_at[2] - g_inside[2]) > 0.1f * std::abs(g_at[2]));
  }
}

TEST_CASE("a masked token keeps the KL gradient, and the pg term's ratio may be inf") {
  // p_inf = e^-800: r = e^(logp + 800) overflows double; A > 0 masks the token,
  // so the loss and gradient stay finite (KL only).
  Chunk c = one_row(1.5, 2.0f, 0.8f);
  c.logprobs_inf = {-800.0f};
  const RlLossParams p;
  std::vector<double> g;
  const RlChunkStats s = run_kernel<double>(c, p, 1.0, g);
  CHECK(s.masked_high == 1);
  CHECK(std::isfinite(s.loss));
  const double logp = double(kernel_logprobs(c)[0]);
  CHECK(s.loss == doctest::Approx(p.kl_coef * (logp + 800) * (logp + 800)).epsilon(1e-6));
  for (double e : g) CHECK(std::isfinite(e));
}

TEST_CASE("finite differences in double on the fused function") {
  std::mt19937_64 rng(22);
  Chunk c = random_chunk(rng, 24, 7);
  const RlLossParams p{.mask_high = 0.2, .mask_low = 0.2, .kl_coef = 0.05, .ce_coef = 0.3};
  const double grad_scale = 0.37;
  // The mask is piecewise constant; no seeded token sits within an FD step of a
  // boundary (else this check would fail at that token, not pass wrongly).
  const Reference ref = reference(c, p, grad_scale);
  REQUIRE(ref.stats.masked_high + ref.stats.masked_low > 0);
  auto loss = [&] {
    Vec work;
    return run_kernel<double>(c, p, grad_scale, work).loss;
  };
  Vec dlogits;
  run_kernel<double>(c, p, grad_scale, dlogits);
  Vec numeric(c.logits.size());
  for (size_t e = 0; e < c.logits.size(); ++e) {
    const double x0 = c.logits[e];
    c.logits[e] = x0 + kFdEps;
    const double lp = loss();
    c.logits[e] = x0 - kFdEps;
    const double lm = loss();
    c.logits[e] = x0;
    numeric[e] = grad_scale * (lp - lm) / (2 * kFdEps);
  }
  CHECK(rel_err(dlogits, numeric) < kFdTol);
  CHECK(max_abs(numeric) > 1e-3);  // the check compares something
}

TEST_CASE("on-policy with all advantages 0: the gradient is exactly zero") {
  std::mt19937_64 rng(23);
  Chunk c = random_chunk(rng, 64, 33);
  std::fill(c.advantages.begin(), c.advantages.end(), 0.0f);
  c.logprobs_inf = kernel_logprobs(c);  // inference = train, bit for bit
  const RlLossParams p{};               // kl_coef 1e-3, ce_coef 0
  std::vector<float> g;
  const RlChunkStats s = run_kernel<float>(c, p, 1.0 / 50, g);
  int64_t nonzero = 0;
  for (float e : g) nonzero += e != 0.0f;
  CHECK(nonzero == 0);
  CHECK(s.loss == 0.0);
  CHECK(s.mismatch_kl_sum == 0.0);
  CHECK(s.masked_high + s.masked_low == 0);
  CHECK(s.loss_tokens == reference(c, p, 1.0).stats.loss_tokens);
  CHECK(s.entropy_sum > 0.0);

  // The same inputs with a CE term, or with logprobs one ulp off, do have a gradient.
  std::vector<float> g_ce, g_off;
  run_kernel<float>(c, RlLossParams{.ce_coef = 0.1}, 1.0 / 50, g_ce);
  CHECK(std::any_of(g_ce.begin(), g_ce.end(), [](float e) { return e != 0.0f; }));
  Chunk off = c;
  for (float& lp : off.logprobs_inf) lp = std::nextafter(lp, -1e30f);
  run_kernel<float>(off, p, 1.0 / 50, g_off);
  CHECK(std::any_of(g_off.begin(), g_off.end(), [](float e) { return e != 0.0f; }));
}

TEST_CASE("token_logprobs: the reference log-softmax at temperature; rows without a target get 0") {
  std::mt19937_64 rng(24);
  const Chunk c = random_chunk(rng, 30, 11);
  const FVec lp = kernel_logprobs(c);
  for (int64_t t = 0; t < c.n; ++t) {
    if (c.targets[sz(t)] < 0) {
      CHECK(lp[sz(t)] == 0.0f);
      continue;
    }
    const double tau = c.temperatures[sz(t)];
    double zmax = -INFINITY, Z = 0;
    for (int64_t v = 0; v < c.V; ++v) zmax = std::max(zmax, c.logits[sz(t * c.V + v)] / tau);
    for (int64_t v = 0; v < c.V; ++v) Z += std::exp(c.logits[sz(t * c.V + v)] / tau - zmax);
    const double want = c.logits[sz(t * c.V + c.targets[sz(t)])] / tau - zmax - std::log(Z);
    CHECK(lp[sz(t)] == doctest::Approx(want).epsilon(1e-6));
    CHECK(lp[sz(t)] <= 0.0f);
  }
}

TEST_CASE("statistics add up over chunks; to_array/from_array round-trip") {
  std::mt19937_64 rng(25);
  const Chunk c = random_chunk(rng, 40, 9);
  const RlLossParams p{};
  Vec whole;
  const RlChunkStats all = run_kernel<double>(c, p, 1.0, whole);
  // The same rows in two chunks of 17 and 23.
  RlChunkStats sum;
  for (const auto& [t0, n] : {std::pair<int64_t, int64_t>{0, 17}, {17, 23}}) {
    Chunk part = c;
    part.n = n;
    part.logits.assign(c.logits.begin() + t0 * c.V, c.logits.begin() + (t0 + n) * c.V);
    auto slice = [&](const auto& v) { return std::decay_t<decltype(v)>(v.begin() + t0, v.begin() + t0 + n); };
    part.targets = slice(c.targets);
    part.weights = slice(c.weights);
    part.advantages = slice(c.advantages);
    part.logprobs_inf = slice(c.logprobs_inf);
    part.temperatures = slice(c.temperatures);
    Vec g;
    sum += run_kernel<double>(part, p, 1.0, g);
  }
  check_stats(sum, all, 1e-12);
  const RlChunkStats back = RlChunkStats::from_array(all.to_array());
  CHECK(back.loss == all.loss);
  CHECK(back.loss_tokens == all.loss_tokens);
  CHECK(back.masked_high == all.masked_high);
  CHECK(back.masked_low == all.masked_low);
  CHECK(back.entropy_sum == all.entropy_sum);
  CHECK(back.mismatch_kl_sum == all.mismatch_kl_sum);
  CHECK(back.advantage_sum == all.advantage_sum);
}

TEST_CASE("float results are bit-identical for 1 and 4 threads") {
  std::mt19937_64 rng(26);
  const Chunk c = random_chunk(rng, 700, 301);
  const RlLossParams p{.kl_coef = 0.01, .ce_coef = 0.2};
  std::vector<float> g1, g4;
  RlChunkStats s1, s4;
  with_threads(1, [&] { s1 = run_kernel<float>(c, p, 1.0 / 700, g1); });
  with_threads(4, [&] { s4 = run_kernel<float>(c, p, 1.0 / 700, g4); });
  CHECK(std::memcmp(g1.data(), g4.data(), g1.size() * sizeof(float)) == 0);
  CHECK(s1.loss == s4.loss);
  CHECK(s1.entropy_sum == s4.entropy_sum);
  CHECK(s1.mismatch_kl_sum == s4.mismatch_kl_sum);
  CHECK(s1.advantage_sum == s4.advantage_sum);
}

TEST_CASE("bad inputs: target outside the vocabulary, non-positive temperature on a loss token") {
  Chunk c = one_row(0.5, 1.0f, 1.0f);
  std::vector<double> g;
  c.targets = {5};
  CHECK_THROWS_WITH_AS(run_kernel<double>(c, RlLossParams{}, 1.0, g),
                       "rl_loss: target 5 at row 0 is outside the vocabulary [0, 5)", shardlm::Error);
  c.targets = {2};
  c.temperatures = {0.0f};
  CHECK_THROWS_WITH_AS(run_kernel<double>(c, RlLossParams{}, 1.0, g),
                       "rl_loss: temperature 0 at row 0 must be positive and finite", shardlm::Error);
  // ... but a row without loss may carry any temperature (padding).
  c.weights = {0.0};
  const RlChunkStats s = run_kernel<double>(c, RlLossParams{}, 1.0, g);
  CHECK(s.loss_tokens == 0);
  for (double e : g) CHECK(e == 0.0);
}

}  // TEST_SUITE

// The clipped surrogate (loss.objective = "clipped") on a chunk worked out by
// hand: V = 2, logits (0, 0) at temperature 1, so p = (0.5, 0.5) and the target
// 0 has logp = log 0.5. clip_low = clip_high = 0.2, no KL, no CE, grad_scale 1.
//   row 0: p_inf 0.4, r = 1.25, A = +1: r > 1.2, clipped: loss -1.2, no gradient
//   row 1: p_inf 0.4, r = 1.25, A = -1: min(-1.25, -1.2) = -1.25: loss 1.25,
//          dloss/dlogp = -A r = 1.25, dlogits = 1.25 (1 - 0.5, 0 - 0.5)
//   row 2: p_inf 0.8, r = 0.625, A = -1: r < 0.8, clipped: loss 0.8, no gradient
//   row 3: p_inf 0.8, r = 0.625, A = +1: min(0.625, 0.8) = 0.625: loss -0.625,
//          dlogits = -0.625 (0.5, -0.5)
// Sum 0.225; the clip is active on rows 0 (high) and 2 (low).
TEST_CASE("clipped surrogate: a hand-computed chunk, both clip sides, gradient zero where clipped") {
  Chunk c;
  c.n = 4;
  c.V = 2;
  c.logits = Vec(8, 0.0);
  c.targets = {0, 0, 0, 0};
  c.weights = {1, 1, 1, 1};
  c.advantages = {1.0f, -1.0f, -1.0f, 1.0f};
  c.temperatures = {1, 1, 1, 1};
  c.logprobs_inf = {std::log(0.4f), std::log(0.4f), std::log(0.8f), std::log(0.8f)};
  RlLossParams p;
  p.objective = shardlm::RlObjective::Clipped;
  p.clip_low = 0.2;
  p.clip_high = 0.2;
  p.kl_coef = 0;
  p.mask_high = p.mask_low = 0;  // the masked objective's knobs: no effect on the clipped one
  std::vector<double> g;
  const RlChunkStats s = run_kernel<double>(c, p, 1.0, g);
  CHECK(s.loss_tokens == 4);
  CHECK(s.masked_high == 1);  // clip active above: row 0
  CHECK(s.masked_low == 1);   // clip active below: row 2
  // the inference logprobs are float: r differs from 1.25 / 0.625 in the 8th digit
  CHECK(s.loss == doctest::Approx(-1.2 + 1.25 + 0.8 - 0.625).epsilon(1e-6));
  const double expected[8] = {0, 0, 0.625, -0.625, 0, 0, -0.3125, 0.3125};
  for (int i = 0; i < 8; ++i) CHECK(g[sz(i)] == doctest::Approx(expected[i]).epsilon(1e-6));
  // The same chunk in float, with weights and a grad scale: scaled alike.
  std::vector<float> gf;
  c.weights = {2, 2, 2, 2};
  const RlChunkStats sf = run_kernel<float>(c, p, 0.5, gf);
  CHECK(sf.loss == doctest::Approx(2 * 0.225).epsilon(1e-5));
  for (int i = 0; i < 8; ++i) CHECK(gf[sz(i)] == doctest::Approx(expected[i]).epsilon(1e-5));
}

TEST_CASE("clipped surrogate: finite differences in double away from the clip boundaries") {
  std::mt19937_64 rng(31);
  Chunk c = random_chunk(rng, 24, 7);
  RlLossParams p;
  p.objective = shardlm::RlObjective::Clipped;
  p.clip_low = 0.2;
  p.clip_high = 0.28;
  p.kl_coef = 0.05;
  p.ce_coef = 0.1;
  const double grad_scale = 0.37;
  std::vector<double> dlogits;
  const RlChunkStats s = run_kernel<double>(c, p, grad_scale, dlogits);
  REQUIRE(s.masked_high + s.masked_low > 0);                    // some tokens clipped ...
  REQUIRE(s.masked_high + s.masked_low < s.loss_tokens);       // ... and some not
  auto loss = [&] {
    Vec work;
    return run_kernel<double>(c, p, grad_scale, work).loss;
  };
  Vec numeric(c.logits.size());
  for (size_t e = 0; e < c.logits.size(); ++e) {
    const double x0 = c.logits[e];
    c.logits[e] = x0 + kFdEps;
    const double lp = loss();
    c.logits[e] = x0 - kFdEps;
    const double lm = loss();
    c.logits[e] = x0;
    numeric[e] = grad_scale * (lp - lm) / (2 * kFdEps);
  }
  CHECK(rel_err(dlogits, numeric) < kFdTol);
  CHECK(max_abs(numeric) > 1e-3);
}
