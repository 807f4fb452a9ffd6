// test_cuda_rl_loss.cu — the CUDA RL policy loss (cuda/rl_loss.hpp) against the CPU
// reference cpu::rl_loss_forward_backward<float> (cpu/rl_loss.hpp) on the same
// bf16-rounded logits, on fresh random inputs: tiny and odd sizes (scalar path),
// V = 128256 (a 4-CTA cluster) and V = 151936 (8 CTAs); both mask thresholds,
// temperatures != 1, weights, rows without loss, mixed SFT (ce_coef), the on-policy
// zero-advantage case, the clipped surrogate (both clip sides, with kl and SFT terms),
// GSPO (its sequence ratio given per token, the paper's clip and a wider one), CISPO
// (with and without a lower bound), truncated importance sampling per token and per
// sequence (caps and masks, sampling logprobs), the entropy bonus, the forward-only
// token logprobs (rl_token_logprobs against cpu::token_logprobs), bad rows, chunk
// accumulation, and determinism (two runs, bitwise equal). One line per check: name, error, threshold, PASS/FAIL; the last
// line "N passed, M failed"; non-zero exit status on any failure. Thresholds and
// their reasons: tests/gpu/README.md.
//
// Usage: test_cuda_rl_loss [--seed N] [--no-timing] [--quick]
//   --quick: only the cases of up to 2M logits (for compute-sanitizer runs)
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/rl_loss.hpp"
#include "cpu/rl_loss.hpp"

namespace {

namespace cpu = shardlm::cpu;
namespace gpu = shardlm::cuda;
using bf16 = __nv_bfloat16;
using shardlm::fmt;
constexpr int kFields = gpu::kRlStatsFields;
enum Field { kLoss, kTokens, kMaskedHigh, kMaskedLow, kEntropy, kKl, kAdvantage, kIsRatio, kIsCapped, kIsMasked, kRefKl };
const char* const kFieldNames[kFields] = {"loss",        "loss_tokens", "masked_high", "masked_low",
                                          "entropy",     "mismatch_kl", "advantage",   "is_ratio",
                                          "is_capped",   "is_masked",   "ref_kl"};
// Fields that count rows: exact on the GPU.
bool count_field(int f) { return f == kTokens || f == kMaskedHigh || f == kMaskedLow || f == kIsCapped || f == kIsMasked; }

// ---------------------------------------------------------------- thresholds

// dlogits: one bf16 rounding of each element (<= 2^-9 relative, ~1.5e-3 as an RMS
// ratio); an indexing or formula error is O(1).
constexpr double kTolGrad = 1e-2;
// Per-row and summed loss / entropy / mismatch KL, as an error per loss token:
// ||gpu - ref|| / max(||ref||, sqrt(loss tokens)) for the per-row values and
// |gpu - ref| / max(sum |ref|, loss tokens) for the sums (a token's loss is O(|A|),
// so the floor keeps a near-zero reference from turning a 1e-7 into a 1e+287).
// The GPU's sum of exponentials differs from the CPU's by the exp rounding and the
// summation order (~2e-7 relative), so logp differs by at most a float ulp or two
// (~1e-6 at |logp| ~ 12) and a token's loss by |d loss / d logp| times that:
// expected 1e-9 to 1e-6. One token wrong by O(1) in a 64-row chunk is 1.5e-2.
constexpr double kTolStat = 1e-4;
// advantage sums: the same floats summed in double in another order.
constexpr double kTolAdvantage = 1e-12;
// Sums of one chunk split in two (accumulate) vs one call: the same per-row values
// added in another order.
constexpr double kTolSplit = 1e-12;
// |logp_gpu - logp_cpu| <= kLogpAbs + kLogpRel * |logp| (a few float ulps of logp):
// the bound on log r in the on-policy case.
constexpr double kLogpAbs = 1e-6, kLogpRel = 5e-7;

// ---------------------------------------------------------------- report

struct Report {
  int passed = 0, failed = 0;
  // The result comes last on the line (tests/run.sh counts lines ending in PASS/FAIL).
  void line(const std::string& name, double err, double threshold, bool ok, const std::string& note = "") {
    std::printf("%-72s %10.3e %9.1e  %s%s\n", name.c_str(), err, threshold, note.empty() ? "" : (note + "  ").c_str(),
                ok ? "PASS" : "FAIL");
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  void check(const std::string& name, double err, double threshold, const std::string& note = "") {
    line(name, err, threshold, std::isfinite(err) && err <= threshold, note);
  }
  void check_true(const std::string& name, bool ok, const std::string& why = "") {
    line(name, ok ? 0.0 : 1.0, 0.0, ok, ok ? "" : why);
  }
} report;

bool quick = false;  // --quick: skip the large cases

// ---------------------------------------------------------------- random inputs

// A counter-based generator: element i of draw k is a hash of (seed, k, i), so the
// big arrays fill in parallel and a seed reproduces a run at any thread count.
uint64_t mix64(uint64_t z) {
  z ^= z >> 33;
  z *= 0xff51afd7ed558ccdull;
  z ^= z >> 33;
  z *= 0xc4ceb9fe1a85ec53ull;
  return z ^ (z >> 33);
}
struct Random {
  uint64_t seed;
  uint64_t draws = 0;
  uint64_t stream() { return mix64(seed + 0x9e3779b97f4a7c15ull * ++draws); }
  static double open01(uint64_t h) { return (double(h >> 11) + 0.5) / 9007199254740992.0; }

  std::vector<float> gaussian(int64_t n, double sigma) {
    const uint64_t s = stream();
    std::vector<float> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double a = open01(mix64(s ^ (2 * uint64_t(i)))), b = open01(mix64(s ^ (2 * uint64_t(i) + 1)));
      v[size_t(i)] = float(sigma * std::sqrt(-2.0 * std::log(a)) * std::cos(6.283185307179586 * b));
    }
    return v;
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * open01(stream()); }
  int64_t below(int64_t hi) { return int64_t(stream() % uint64_t(hi)); }
};

float round_to_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// ---------------------------------------------------------------- device buffers

template <class T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T))); }
  ~Device() { cudaFree(ptr); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  void upload(const std::vector<T>& h) {
    if (h.size() != n) throw shardlm::Error(fmt("upload: %zu elements into %zu", h.size(), n));
    CUDA_CHECK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { CUDA_CHECK(cudaMemset(ptr, 0xff, n * sizeof(T))); }  // NaN in bf16, fp32, fp64
};

// ---------------------------------------------------------------- one case

struct Case {
  std::string tag;
  int64_t n, V;
  cpu::RlLossParams params;
  bool on_policy_zero_advantage = false;  // A = 0, lp_inf = the CPU's own logp, ce_coef = 0
  double sequence_spread = 0.3;  // the per-token sample sums' spread (gspo: log s_i; is sequence: log rho_i)
  bool both_sides = true;        // the inputs must clip or mask on both sides (not CISPO without a lower
                                 // bound, not under importance sampling, where the ratio is 1)
};

struct Inputs {
  std::vector<bf16> logits;      // (n, V) what the GPU reads
  std::vector<float> logits_f;   // (n, V) the same values, for the CPU reference
  std::vector<int32_t> targets;
  std::vector<float> weights, advantages, lp_inf, lp_sampling, temperatures;
  std::vector<double> sequence_log_ratio, sequence_log_is;  // (n) a sample's sums as the step's pass gives them
  // The RL inputs at these host arrays, as the case's parameters read them.
  shardlm::RlTokenInputs host(const cpu::RlLossParams& p) const {
    const bool is = p.is_level != shardlm::IsLevel::None;
    return {advantages.data(), lp_inf.data(), is ? lp_sampling.data() : nullptr, temperatures.data(),
            sequence_log_ratio.data(), sequence_log_is.data()};
  }
};

// Rows cycle through 8 kinds so that every branch of the loss is taken: on-policy,
// probability fell (masked_low when A <= 0), probability rose (masked_high when
// A > 0) on rows whose target is made likely, small mismatches, A = 0; plus rows
// without a target, with weight 0 and with a negative weight.
Inputs make_inputs(Random& rng, const Case& c) {
  const int64_t n = c.n, V = c.V;
  Inputs in;
  in.logits_f = rng.gaussian(n * V, 2.0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n * V; ++i) in.logits_f[size_t(i)] = round_to_bf16(in.logits_f[size_t(i)]);
  in.targets.resize(static_cast<size_t>(n));
  in.weights.resize(static_cast<size_t>(n));
  in.advantages.resize(static_cast<size_t>(n));
  in.lp_inf.resize(static_cast<size_t>(n));
  in.temperatures.resize(static_cast<size_t>(n));
  const float taus[4] = {1.0f, 0.7f, 1.3f, 0.45f};
  for (int64_t r = 0; r < n; ++r) {
    in.targets[size_t(r)] = int32_t(rng.below(V));
    in.weights[size_t(r)] = float(rng.uniform(0.5, 1.5));
    in.temperatures[size_t(r)] = c.on_policy_zero_advantage ? 0.8f : taus[r % 4];
    const int kind = int(r % 8);
    double A = rng.gaussian(1, 1.0)[0];
    if (kind == 1 || kind == 4) A = -std::fabs(A);
    if (kind == 2 || kind == 3) A = std::fabs(A) + 0.1;
    if (kind == 7 || (kind == 4 && r % 16 == 4)) A = 0.0;
    if (c.on_policy_zero_advantage) A = 0.0;
    in.advantages[size_t(r)] = float(A);
    // kinds 3, 4, 5, 7: make the target likely (p ~ 0.8, 0.8, 0.5, 0.95 before bf16 rounding).
    const double p_want = kind == 3 || kind == 4 ? 0.8 : kind == 5 ? 0.5 : kind == 7 ? 0.95 : 0.0;
    if (p_want > 0.0) {
      float* x = &in.logits_f[size_t(r * V)];
      const int32_t y = in.targets[size_t(r)];
      const double tau = in.temperatures[size_t(r)];
      double m = -INFINITY, s = 0.0;
      for (int64_t col = 0; col < V; ++col) if (col != y) m = std::max(m, double(x[col]));
      for (int64_t col = 0; col < V; ++col) if (col != y) s += std::exp((double(x[col]) - m) / tau);
      x[y] = round_to_bf16(float(m + tau * std::log(p_want / (1.0 - p_want) * s)));
    }
  }
  if (n >= 12) {
    in.targets[9] = -1;        // no target
    in.weights[10] = 0.0f;     // zero weight
    in.weights[11] = -0.5f;    // negative weight: no loss either
    in.temperatures[9] = 0.0f;  // never read: only loss rows read their temperature
  }

  // The CPU's own logp: on-policy rows take it bit for bit.
  std::vector<float> logp(static_cast<size_t>(n));
  cpu::token_logprobs<float>(logp.data(), in.logits_f.data(), in.targets.data(), in.temperatures.data(), n, V);
  for (int64_t r = 0; r < n; ++r) {
    const int kind = int(r % 8);
    const double p = std::exp(double(logp[size_t(r)]));
    double p_inf = p;  // kinds 0, 7: on-policy
    if (kind == 1 || kind == 2) p_inf = p + 0.35;                    // p fell by 0.35 > mask_low
    if (kind == 3 || kind == 4) p_inf = p > 0.45 ? p - 0.35 : p;     // p rose by 0.35 > mask_high
    if (kind == 5 || kind == 6) p_inf = p * (1.0 + 0.1 * rng.uniform(-1.0, 1.0));  // |dp| <= 0.1 p
    if (kind == 0 || kind == 7 || c.on_policy_zero_advantage) in.lp_inf[size_t(r)] = logp[size_t(r)];
    else in.lp_inf[size_t(r)] = float(std::log(std::min(p_inf, 0.999)));
  }
  // Sampling logprobs (top-k / top-p raise the sampled token's probability) and
  // the sample sums, both free inputs of the kernel here.
  in.lp_sampling.resize(static_cast<size_t>(n));
  in.sequence_log_ratio.resize(static_cast<size_t>(n));
  in.sequence_log_is.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    in.lp_sampling[size_t(r)] = std::min(0.0f, in.lp_inf[size_t(r)] + float(std::fabs(rng.gaussian(1, 0.5)[0])));
    in.sequence_log_ratio[size_t(r)] = c.sequence_spread * rng.gaussian(1, 1.0)[0];
    in.sequence_log_is[size_t(r)] = 5 * c.sequence_spread * rng.gaussian(1, 1.0)[0];
  }
  in.logits.resize(static_cast<size_t>(n * V));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n * V; ++i) in.logits[size_t(i)] = __float2bfloat16_rn(in.logits_f[size_t(i)]);
  return in;
}

struct GpuResult {
  std::vector<bf16> dlogits;       // (n, V)
  std::vector<double> row_stats;   // (kFields, n)
  std::vector<double> stats;       // (kFields)
};

// One case's inputs in device memory.
struct DeviceInputs {
  Device<bf16> logits;
  Device<int32_t> targets;
  Device<float> weights, adv, lp, lp_sampling, temps;
  Device<double> sequence_log_ratio, sequence_log_is;
  DeviceInputs(const Inputs& in, int64_t n, int64_t V)
      : logits(size_t(n * V)), targets(size_t(n)), weights(size_t(n)), adv(size_t(n)), lp(size_t(n)),
        lp_sampling(size_t(n)), temps(size_t(n)), sequence_log_ratio(size_t(n)), sequence_log_is(size_t(n)) {
    logits.upload(in.logits);
    targets.upload(in.targets);
    weights.upload(in.weights);
    adv.upload(in.advantages);
    lp.upload(in.lp_inf);
    lp_sampling.upload(in.lp_sampling);
    temps.upload(in.temperatures);
    sequence_log_ratio.upload(in.sequence_log_ratio);
    sequence_log_is.upload(in.sequence_log_is);
  }
  // The device pointers, as Inputs::host gives the host ones.
  shardlm::RlTokenInputs device(const cpu::RlLossParams& p) const {
    const bool is = p.is_level != shardlm::IsLevel::None;
    return {adv.ptr, lp.ptr, is ? lp_sampling.ptr : nullptr, temps.ptr, sequence_log_ratio.ptr, sequence_log_is.ptr};
  }
};

GpuResult run_gpu(const Inputs& in, const Case& c, float grad_scale) {
  const int64_t n = c.n, V = c.V;
  DeviceInputs dev(in, n, V);
  Device<double> row_stats(gpu::rl_loss_row_stats_bytes(n) / sizeof(double)), stats(kFields);
  row_stats.poison();
  stats.poison();
  gpu::rl_loss_forward_backward(dev.logits.ptr, row_stats.ptr, stats.ptr, dev.targets.ptr, dev.weights.ptr,
                                dev.device(c.params), c.params, grad_scale, n, V, /*accumulate=*/false, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return {dev.logits.download(), row_stats.download(), stats.download()};
}

template <class T>
int64_t bitwise_differences(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -1;
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return d;
}

// ||g - r|| / max(||r||, sqrt(floor)): relative, or per unit when r is near 0.
double rel_l2(const std::vector<double>& g, const std::vector<double>& r, double floor) {
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return std::sqrt(num / std::max({den, floor, 1e-300}));
}

void test_case(Random& rng, const Case& c) {
  const int64_t n = c.n, V = c.V;
  if (quick && n * V > (int64_t(2) << 20)) return;
  const std::string name = fmt("rl_loss %s (n=%lld V=%lld)", c.tag.c_str(), (long long)n, (long long)V);
  const Inputs in = make_inputs(rng, c);
  const float grad_scale = 1.0f / 777.0f;

  const GpuResult a = run_gpu(in, c, grad_scale), b = run_gpu(in, c, grad_scale);

  // CPU reference: all rows at once (gradient, sums) and row by row (per-row stats).
  std::vector<float> ref_grad = in.logits_f;
  const cpu::RlChunkStats ref = cpu::rl_loss_forward_backward<float>(
      ref_grad.data(), in.targets.data(), in.weights.data(), in.host(c.params), c.params, grad_scale, n, V);
  std::vector<double> ref_rows(static_cast<size_t>(kFields * n));
  {
    std::vector<float> row(static_cast<size_t>(V));
    for (int64_t r = 0; r < n; ++r) {
      std::copy(in.logits_f.begin() + r * V, in.logits_f.begin() + (r + 1) * V, row.begin());
      const auto s = cpu::rl_loss_forward_backward<float>(row.data(), &in.targets[size_t(r)], &in.weights[size_t(r)],
                                                          in.host(c.params).at(r), c.params, grad_scale, 1, V)
                           .to_array();
      for (int f = 0; f < kFields; ++f) ref_rows[size_t(f * n + r)] = s[size_t(f)];
    }
  }
  const auto ref_sums = ref.to_array();

  // Every element written (the row stats were poisoned with NaN; logits hold no NaN).
  int64_t nonfinite = 0;
#pragma omp parallel for reduction(+ : nonfinite)
  for (int64_t i = 0; i < n * V; ++i) nonfinite += !std::isfinite(__bfloat162float(a.dlogits[size_t(i)]));
  for (double v : a.row_stats) nonfinite += !std::isfinite(v);
  for (double v : a.stats) nonfinite += !std::isfinite(v);
  report.check_true(name + " every output written, finite", nonfinite == 0, fmt("%lld non-finite", (long long)nonfinite));

  // Gradient: ||gpu - ref|| / ||ref|| over all rows; rows without loss exactly 0.
  double num = 0, den = 0, max_abs = 0;
  int64_t nonzero_off_rows = 0;
  for (int64_t r = 0; r < n; ++r) {
    const bool loss_row = in.targets[size_t(r)] >= 0 && in.weights[size_t(r)] > 0.0f;
    for (int64_t col = 0; col < V; ++col) {
      const double g = __bfloat162float(a.dlogits[size_t(r * V + col)]), ref_g = ref_grad[size_t(r * V + col)];
      if (!loss_row) nonzero_off_rows += g != 0.0;
      num += (g - ref_g) * (g - ref_g);
      den += ref_g * ref_g;
      max_abs = std::max(max_abs, std::fabs(g));
    }
  }
  const int64_t off_rows = n - ref.loss_tokens;
  if (off_rows > 0)
    report.check_true(fmt("%s dlogits of %lld rows without loss exactly 0", name.c_str(), (long long)off_rows),
                      nonzero_off_rows == 0, fmt("%lld non-zero", (long long)nonzero_off_rows));

  if (c.on_policy_zero_advantage) {
    // CPU: log r = 0 exactly, so every gradient element is 0. GPU: |log r| is the
    // logp difference, bounded by a few float ulps; the gradient is the kl term
    // grad_scale * w * 2 kl_coef * log r * (onehot - softmax) / tau.
    report.check_true(name + " CPU reference gradient exactly 0 (log r = 0)", den == 0.0);
    double bound = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (in.targets[size_t(r)] < 0 || !(in.weights[size_t(r)] > 0.0f)) continue;
      const double dlogp = kLogpAbs + kLogpRel * std::fabs(double(in.lp_inf[size_t(r)]));
      bound = std::max(bound, double(grad_scale) * in.weights[size_t(r)] * 2.0 * c.params.kl_coef * dlogp /
                                  in.temperatures[size_t(r)]);
    }
    bound *= 1.01;  // the bf16 rounding of the stored gradient
    report.check(name + " on-policy A=0: max |dlogits| under the kl bound", max_abs, bound);
    double kl_max = 0;
    for (int64_t r = 0; r < n; ++r) kl_max = std::max(kl_max, std::fabs(a.row_stats[size_t(kKl * n + r)]));
    const double kl_bound = 0.6 * std::pow(kLogpAbs + kLogpRel * 30.0, 2);  // k3 ~ (log r)^2 / 2
    report.check(name + " on-policy A=0: per-row mismatch KL ~ 0", kl_max, kl_bound);
  } else {
    report.check(name + " dlogits ||gpu-ref||/||ref||", den > 0 ? std::sqrt(num / den) : INFINITY, kTolGrad);
  }

  // Per-row statistics.
  for (int f : {kLoss, kEntropy, kKl, kIsRatio}) {
    if (c.on_policy_zero_advantage && f == kKl) continue;  // checked above: the reference is 0
    std::vector<double> g(a.row_stats.begin() + f * n, a.row_stats.begin() + (f + 1) * n);
    std::vector<double> r(ref_rows.begin() + f * n, ref_rows.begin() + (f + 1) * n);
    if (c.on_policy_zero_advantage && f == kLoss) {  // reference 0: absolute, as kl_coef * w * (log r)^2
      double worst = 0;
      for (double v : g) worst = std::max(worst, std::fabs(v));
      report.check(name + " on-policy A=0: per-row loss ~ 0", worst,
                   c.params.kl_coef * 1.5 * std::pow(kLogpAbs + kLogpRel * 30.0, 2));
      continue;
    }
    report.check(fmt("%s per-row %s per-token error", name.c_str(), kFieldNames[f]),
                 rel_l2(g, r, double(ref.loss_tokens)), kTolStat);
  }
  {
    int64_t flag_diff = 0;
    for (int f : {kTokens, kMaskedHigh, kMaskedLow, kAdvantage, kIsCapped, kIsMasked})
      for (int64_t r = 0; r < n; ++r) flag_diff += a.row_stats[size_t(f * n + r)] != ref_rows[size_t(f * n + r)];
    report.check_true(name + " per-row token / mask flags and advantages equal", flag_diff == 0,
                      fmt("%lld differ", (long long)flag_diff));
  }

  // Sums: counts exact; the rest per loss token (advantages: relative to sum |A|).
  for (int f = 0; f < kFields; ++f) {
    const std::string what = fmt("%s sum %s", name.c_str(), kFieldNames[f]);
    if (count_field(f)) {
      report.check_true(fmt("%s = %.0f (cpu %.0f)", what.c_str(), a.stats[size_t(f)], ref_sums[size_t(f)]),
                        a.stats[size_t(f)] == ref_sums[size_t(f)]);
      continue;
    }
    double magnitude = 0;
    for (int64_t r = 0; r < n; ++r) magnitude += std::fabs(ref_rows[size_t(f * n + r)]);
    const double scale = f == kAdvantage ? magnitude : std::max(magnitude, double(ref.loss_tokens));
    const double err = std::fabs(a.stats[size_t(f)] - ref_sums[size_t(f)]) / std::max(scale, 1e-300);
    if (c.on_policy_zero_advantage && (f == kLoss || f == kKl)) {
      report.check(what + " ~ 0 (on-policy)", std::fabs(a.stats[size_t(f)]),
                   double(n) * 1.5 * std::pow(kLogpAbs + kLogpRel * 30.0, 2));
      continue;
    }
    report.check(what + (f == kAdvantage ? " |gpu-ref|/sum|ref|" : " per-token error"), err,
                 f == kAdvantage ? kTolAdvantage : kTolStat);
  }
  // The inputs really exercise both masks (else the checks above prove little).
  if (!c.on_policy_zero_advantage && n >= 16 && c.both_sides)
    report.check_true(fmt("%s inputs mask both ways (high %.0f, low %.0f)", name.c_str(), ref_sums[kMaskedHigh],
                          ref_sums[kMaskedLow]),
                      ref_sums[kMaskedHigh] > 0 && ref_sums[kMaskedLow] > 0);
  if (c.params.is_level != shardlm::IsLevel::None && n >= 16)
    report.check_true(fmt("%s inputs cap and mask importance weights (capped %.0f, masked %.0f)", name.c_str(),
                          ref_sums[kIsCapped], ref_sums[kIsMasked]),
                      ref_sums[kIsCapped] > 0 && (c.params.is_mask == 0 || ref_sums[kIsMasked] > 0));

  // Determinism: a second run gives the same bits everywhere.
  const int64_t d = bitwise_differences(a.dlogits, b.dlogits) + bitwise_differences(a.row_stats, b.row_stats) +
                    bitwise_differences(a.stats, b.stats);
  report.check_true(name + " deterministic (two runs bitwise equal)", d == 0, fmt("%lld elements differ", (long long)d));
}

// A chunk in two calls (the second accumulating) gives the same gradient bits and
// the sums of one call up to summation order; accumulate adds to what is there.
void test_accumulate(Random& rng) {
  if (quick) return;
  const Case c{"split", 48, 128256, cpu::RlLossParams{}};
  const int64_t n = c.n, V = c.V, k = 20;
  const Inputs in = make_inputs(rng, c);
  const float grad_scale = 1.0f / 512.0f;
  const GpuResult whole = run_gpu(in, c, grad_scale);

  DeviceInputs dev(in, n, V);
  Device<double> row_stats(static_cast<size_t>(kFields * n)), stats(kFields);
  stats.poison();
  gpu::rl_loss_forward_backward(dev.logits.ptr, row_stats.ptr, stats.ptr, dev.targets.ptr, dev.weights.ptr,
                                dev.device(c.params), c.params, grad_scale, k, V, false, nullptr);
  gpu::rl_loss_forward_backward(dev.logits.ptr + k * V, row_stats.ptr, stats.ptr, dev.targets.ptr + k,
                                dev.weights.ptr + k, dev.device(c.params).at(k), c.params, grad_scale, n - k, V, true,
                                nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto split_grad = dev.logits.download();
  const auto split_stats = stats.download();
  const int64_t d = bitwise_differences(split_grad, whole.dlogits);
  report.check_true("rl_loss split (n=20+28 V=128256) dlogits bitwise equal to one call", d == 0,
                    fmt("%lld differ", (long long)d));
  double worst = 0;
  for (int f = 0; f < kFields; ++f) {
    double magnitude = 0;
    for (int64_t r = 0; r < n; ++r) magnitude += std::fabs(whole.row_stats[size_t(f * n + r)]);
    worst = std::max(worst, std::fabs(split_stats[size_t(f)] - whole.stats[size_t(f)]) / std::max(magnitude, 1.0));
  }
  report.check("rl_loss split (n=20+28 V=128256) accumulated sums vs one call", worst, kTolSplit);

  // n = 0: overwrite zeroes the sums, accumulate leaves them.
  stats.upload(std::vector<double>(kFields, 3.0));
  gpu::rl_loss_forward_backward(dev.logits.ptr, row_stats.ptr, stats.ptr, dev.targets.ptr, dev.weights.ptr,
                                dev.device(c.params), c.params, grad_scale, 0, V, true, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto kept = stats.download();
  gpu::rl_loss_forward_backward(dev.logits.ptr, row_stats.ptr, stats.ptr, dev.targets.ptr, dev.weights.ptr,
                                dev.device(c.params), c.params, grad_scale, 0, V, false, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto zeroed = stats.download();
  bool ok = true;
  for (int f = 0; f < kFields; ++f) ok &= kept[size_t(f)] == 3.0 && zeroed[size_t(f)] == 0.0;
  report.check_true("rl_loss n=0: accumulate keeps the sums, overwrite zeroes them", ok);
}

// Rows the CPU refuses (target >= V, temperature 0 or NaN): zero gradient, NaN
// loss, so the step's NaN check reports them; the good rows are unaffected.
void test_bad_rows(Random& rng) {
  Case c{"bad rows", 16, 1000, cpu::RlLossParams{}};
  Inputs in = make_inputs(rng, c);
  in.targets[5] = int32_t(c.V);
  in.temperatures[6] = 0.0f;
  in.temperatures[7] = NAN;
  const float grad_scale = 0.01f;
  const GpuResult g = run_gpu(in, c, grad_scale);
  bool zero = true, nan_loss = true;
  for (int64_t r : {5, 6, 7}) {
    for (int64_t col = 0; col < c.V; ++col) zero &= __bfloat162float(g.dlogits[size_t(r * c.V + col)]) == 0.0f;
    nan_loss &= std::isnan(g.row_stats[size_t(kLoss * c.n + r)]) && g.row_stats[size_t(kTokens * c.n + r)] == 1.0;
  }
  report.check_true("rl_loss bad rows (target >= V, tau = 0, tau = NaN): zero dlogits", zero);
  report.check_true("rl_loss bad rows: NaN row loss, counted as loss tokens, NaN sum", nan_loss && std::isnan(g.stats[kLoss]));
  // Row 0 (a good row) matches the CPU.
  std::vector<float> row(in.logits_f.begin(), in.logits_f.begin() + c.V);
  cpu::rl_loss_forward_backward<float>(row.data(), &in.targets[0], &in.weights[0], in.host(c.params), c.params,
                                       grad_scale, 1, c.V);
  double num = 0, den = 0;
  for (int64_t col = 0; col < c.V; ++col) {
    const double d = __bfloat162float(g.dlogits[size_t(col)]) - double(row[size_t(col)]);
    num += d * d;
    den += double(row[size_t(col)]) * row[size_t(col)];
  }
  report.check("rl_loss bad rows: a good row of the same chunk ||gpu-ref||/||ref||", std::sqrt(num / den), kTolGrad);
}

// The forward-only pass's logprobs (rl_token_logprobs) against the CPU's
// token_logprobs on the same bf16-rounded logits: a few float ulps of logp; 0
// on rows without a target, NaN on a row with a bad temperature.
void test_token_logprobs(Random& rng) {
  for (const int64_t V : {int64_t(1001), int64_t(151936)}) {
    const Case c{"token logprobs", 40, V, cpu::RlLossParams{}};
    Inputs in = make_inputs(rng, c);
    in.targets[3] = -1;
    in.temperatures[5] = 0.0f;
    in.weights[5] = 0.0f;  // a row without loss: the CPU reference does not check it either way
    std::vector<float> want(size_t(c.n));
    std::vector<float> temps = in.temperatures;
    temps[5] = 1.0f;  // the CPU refuses a bad temperature on a row with a target
    cpu::token_logprobs<float>(want.data(), in.logits_f.data(), in.targets.data(), temps.data(), c.n, V);
    DeviceInputs dev(in, c.n, V);
    Device<float> out(size_t(c.n));
    out.poison();
    gpu::rl_token_logprobs(out.ptr, dev.logits.ptr, dev.targets.ptr, dev.temps.ptr, c.n, V, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = out.download();
    double worst = 0;
    bool others = got[3] == 0.0f && std::isnan(got[5]);
    for (int64_t r = 0; r < c.n; ++r) {
      if (r == 3 || r == 5) continue;
      const double bound = kLogpAbs + kLogpRel * std::fabs(double(want[size_t(r)]));
      worst = std::max(worst, std::fabs(double(got[size_t(r)]) - double(want[size_t(r)])) / bound);
    }
    report.check(fmt("rl_token_logprobs (n=40 V=%lld) |gpu-cpu| / (a few float ulps of logp)", (long long)V), worst,
                 1.0);
    report.check_true(fmt("rl_token_logprobs (V=%lld) row without a target 0, bad temperature NaN", (long long)V),
                      others);
  }
}

// The kernel at the Llama-3 shape: 4096 rows of 128256 (1.05 GB of bf16 logits read
// and written: 2.1 GB moved at least).
void run_timing() {
  const int64_t n = 4096, V = 128256;
  Device<bf16> logits(static_cast<size_t>(n * V));
  Device<int32_t> targets(static_cast<size_t>(n));
  Device<float> weights(static_cast<size_t>(n)), adv(static_cast<size_t>(n)), lp(static_cast<size_t>(n)), temps(static_cast<size_t>(n));
  Device<double> row_stats(static_cast<size_t>(kFields * n)), stats(kFields);
  CUDA_CHECK(cudaMemset(logits.ptr, 0, n * V * sizeof(bf16)));
  targets.upload(std::vector<int32_t>(size_t(n), 7));
  weights.upload(std::vector<float>(size_t(n), 1.0f));
  adv.upload(std::vector<float>(size_t(n), 0.5f));
  lp.upload(std::vector<float>(size_t(n), -11.0f));
  temps.upload(std::vector<float>(size_t(n), 1.0f));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < 13; ++i) {
    CUDA_CHECK(cudaEventRecord(start));
    gpu::rl_loss_forward_backward(logits.ptr, row_stats.ptr, stats.ptr, targets.ptr, weights.ptr,
                                  shardlm::RlTokenInputs{.advantages = adv.ptr, .inference_logprobs = lp.ptr,
                                                         .temperatures = temps.ptr},
                                  cpu::RlLossParams{}, 1e-3f, n, V, false, nullptr);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    if (i >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf("timing: rl_loss n=%lld V=%lld: %.3f ms median of %zu, %.0f GB/s (2 x %.2f GB of bf16 logits)\n",
              (long long)n, (long long)V, median, ms.size(), 2.0 * n * V * 2 / (median * 1e6), n * V * 2 / 1e9);
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  bool timing = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (std::strcmp(argv[i], "--no-timing") == 0) timing = false;
    else if (std::strcmp(argv[i], "--quick") == 0) quick = true, timing = false;
    else {
      std::fprintf(stderr, "usage: %s [--seed N] [--no-timing] [--quick]\n", argv[0]);
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("test_cuda_rl_loss: %s, compute %d.%d; seed %llu (rerun with --seed %llu); %d CPU threads\n", prop.name,
                prop.major, prop.minor, (unsigned long long)seed, (unsigned long long)seed, omp_get_max_threads());
    if (prop.major < 9) {
      std::printf("FAIL: needs a Hopper GPU (compute capability 9.0: thread block clusters)\n");
      return 1;
    }
    Random rng{seed};
    cpu::RlLossParams defaults;
    cpu::RlLossParams mixed{0.2, 0.2, 0.05, 0.1};  // a larger kl term and an SFT term
    cpu::RlLossParams tight{0.1, 0.3, 1e-3, 0.0};  // asymmetric thresholds
    cpu::RlLossParams clipped;                      // the clipped surrogate, clip 0.2 / 0.28
    clipped.objective = shardlm::RlObjective::Clipped;
    cpu::RlLossParams clipped_mixed{0.2, 0.2, 0.05, 0.1, shardlm::RlObjective::Clipped, 0.1, 0.5};  // asymmetric clip, kl, SFT
    using shardlm::IsLevel, shardlm::RlObjective;
    const cpu::RlLossParams gspo{.objective = RlObjective::Gspo, .clip_low = 0.2, .clip_high = 0.28};
    const cpu::RlLossParams gspo_paper{.kl_coef = 0.0, .objective = RlObjective::Gspo, .clip_low = 3e-4,
                                       .clip_high = 4e-4};
    const cpu::RlLossParams cispo{.objective = RlObjective::Cispo, .clip_low = 0.3, .clip_high = 0.28};
    const cpu::RlLossParams cispo_no_low{.ce_coef = 0.1, .objective = RlObjective::Cispo, .clip_low = 1.0,
                                         .clip_high = 0.28};
    const cpu::RlLossParams is_token{.objective = RlObjective::Clipped, .is_level = IsLevel::Token, .is_cap = 1.2,
                                     .is_mask = 4.0};
    const cpu::RlLossParams is_sequence{.objective = RlObjective::Gspo, .clip_low = 3e-4, .clip_high = 4e-4,
                                        .is_level = IsLevel::Sequence, .is_cap = 2.0, .is_mask = 4.0};
    const cpu::RlLossParams entropy{.kl_coef = 0.01, .entropy_coef = 0.05};
    const cpu::RlLossParams everything{.kl_coef = 0.02, .ce_coef = 0.05, .objective = RlObjective::Cispo,
                                       .clip_low = 0.3, .clip_high = 0.28, .is_level = IsLevel::Token,
                                       .is_cap = 1.2, .is_mask = 4.0, .entropy_coef = 0.05};
    const auto t0 = std::chrono::steady_clock::now();
    test_case(rng, {"tiny", 13, 67, defaults});        // scalar path (V odd), one CTA
    test_case(rng, {"odd", 17, 1001, mixed});          // scalar path
    test_case(rng, {"small", 40, 1000, tight});        // vector path, one CTA
    test_case(rng, {"llama3", 64, 128256, defaults});  // 4-CTA cluster
    test_case(rng, {"llama3 mixed", 24, 128256, mixed});
    test_case(rng, {"qwen", 24, 151936, defaults});    // 8-CTA cluster
    test_case(rng, {"one row", 1, 128256, mixed});
    test_case(rng, {"qwen two rows", 2, 151936, tight});
    test_case(rng, {"on-policy A=0", 32, 128256, cpu::RlLossParams{0.2, 0.2, 1e-3, 0.0}, true});
    test_case(rng, {"clipped tiny", 13, 67, clipped});  // scalar path
    test_case(rng, {"clipped llama3", 64, 128256, clipped});
    test_case(rng, {"clipped qwen mixed", 24, 151936, clipped_mixed});
    test_case(rng, {"gspo tiny", 13, 67, gspo});
    test_case(rng, {"gspo llama3", 64, 128256, gspo});
    test_case(rng, {"gspo paper clip qwen", 24, 151936, gspo_paper, false, 4e-4});
    test_case(rng, {"cispo llama3", 64, 128256, cispo});
    test_case(rng, {"cispo no lower bound odd", 17, 1001, cispo_no_low, false, 0.3, false});
    // Under importance sampling the objectives' ratio is 1: their clips never act.
    test_case(rng, {"is token clipped llama3", 64, 128256, is_token, false, 0.3, false});
    test_case(rng, {"is sequence gspo qwen", 24, 151936, is_sequence, false, 0.3, false});
    test_case(rng, {"entropy bonus llama3", 64, 128256, entropy});
    test_case(rng, {"entropy cispo is-token odd", 17, 1001, everything, false, 0.3, false});
    test_case(rng, {"entropy cispo is-token qwen", 24, 151936, everything, false, 0.3, false});
    test_token_logprobs(rng);
    test_accumulate(rng);
    test_bad_rows(rng);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("checks: %d passed, %d failed (%.1f s)\n", report.passed, report.failed, secs);
    if (timing) run_timing();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    report.failed++;
  }
  std::printf("%d passed, %d failed\n", report.passed, report.failed);
  return report.failed == 0 ? 0 : 1;
}
