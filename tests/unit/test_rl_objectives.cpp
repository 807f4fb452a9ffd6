// test_rl_objectives.cpp — every RL objective (masked, clipped, GSPO, CISPO),
// aggregation (token, sequence, constant), importance-sampling level (none,
// token, sequence, with caps and masks), the entropy bonus, the KL term
// against frozen reference weights (k1, k2, k3), several updates per step
// (the samples in 2 or 3 parts, each normalised over its own) and the
// advantages (mean_std, mean, RLOO, batch std) against numpy references
// written from the papers' formulas (tests/scripts/rl_objectives_reference.py
// cites them and checks its own gradients by central differences).
//
// Each case goes the trainer's way on the CPU, in double: a rollout batch of
// ragged samples (prompts, tokens without loss, a sample without any), the
// split into the step's parts (rollout_part), and per part the per-sequence
// weights (normalize_per_sequence), packing into micro-batches of padded rows
// (pack_rollouts), the loss's divisor (rl_loss_divisor), the sample sums over
// every micro-batch from the token logprobs (SampleSums, as the forward-only
// pass makes them), then the loss kernel per micro-batch. Each part's loss and
// d loss / d logits must equal the reference to 1e-6 relative.
//
// The suite is skipped in a plain test_unit run: tests/scripts/
// test_rl_objectives.sh makes the cases and runs it (SHARDLM_RL_REFERENCE=FILE
// test_unit -ts=rl_objectives --no-skip).
#include <doctest/doctest.h>

#include "fd_util.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/rl_loss.hpp"
#include "data/rollouts.hpp"
#include "infer/reward.hpp"
#include "train/sequence_pass.hpp"
#include "train/train.hpp"
#include "train/step_source.hpp"

namespace {

using namespace shardlm;
using shardlm_test::sz;

// Reads the reference file word by word, with checks that name what was expected.
struct Words {
  std::ifstream in;
  explicit Words(const std::string& path) : in(path) { REQUIRE_MESSAGE(in.good(), "cannot read " << path); }
  std::string word() {
    std::string w;
    in >> w;
    return w;
  }
  void expect(const std::string& key) {
    const std::string w = word();
    REQUIRE_MESSAGE(w == key, "reference file: expected '" << key << "', read '" << w << "'");
  }
  template <class T>
  T value() {
    T v{};
    in >> v;
    REQUIRE_MESSAGE(!in.fail(), "reference file: a number expected");
    return v;
  }
  template <class T>
  std::vector<T> values(const std::string& key, size_t n) {
    expect(key);
    std::vector<T> v(n);
    for (auto& x : v) x = value<T>();
    return v;
  }
};

struct Sample {
  int64_t T = 0;
  float tau = 1, A = 0;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
  std::vector<float> loss_weight, lp_inf, lp_sampling, lp_ref;
  std::vector<double> logits, grad;  // (T - 1, V): position j predicts token j + 1
};

struct LossCase {
  std::string name, objective, normalize, is_level;
  int64_t V = 0;
  bool has_sampling = false;
  int64_t parts = 1;
  RlLossParams params;
  double normalize_constant = 0;
  std::vector<Sample> samples;
  struct Part {
    double loss = 0, scale = 0, divisor = 0;
  };
  std::vector<Part> expected;  // per part
  LossStats stats;
};

LossCase read_case(Words& f) {
  LossCase c;
  c.name = f.word();
  f.expect("objective"), c.objective = f.word();
  f.expect("normalize"), c.normalize = f.word();
  f.expect("is_level"), c.is_level = f.word();
  f.expect("V"), c.V = f.value<int64_t>();
  f.expect("has_sampling"), c.has_sampling = f.value<int>() != 0;
  f.expect("parts"), c.parts = f.value<int64_t>();
  f.expect("ref_kl");
  const std::string estimator = f.word();
  const double ref_kl_coef = f.value<double>();
  const auto p = f.values<double>("params", 10);
  LossSection section;
  section.objective = c.objective;
  section.normalize = c.normalize;
  section.is_level = c.is_level;
  section.mask_high = p[0], section.mask_low = p[1], section.kl_coef = p[2], section.ce_coef = p[3];
  section.clip_low = p[4], section.clip_high = p[5], section.is_cap = p[6], section.is_mask = p[7];
  section.entropy_coef = p[8], section.normalize_constant = p[9];
  section.ref_kl_coef = ref_kl_coef;
  if (estimator != "none") section.ref_kl_estimator = estimator;
  c.params = rl_loss_params(section);
  c.normalize_constant = p[9];
  f.expect("samples");
  c.samples.resize(f.value<size_t>());
  for (Sample& s : c.samples) {
    f.expect("sample");
    s.T = f.value<int64_t>(), s.tau = f.value<float>(), s.A = f.value<float>();
    const size_t T = sz(s.T), pairs = sz((s.T - 1) * c.V);
    s.tokens = f.values<int32_t>("tokens", T);
    const auto mask = f.values<int>("loss_mask", T);
    s.loss_mask.assign(mask.begin(), mask.end());
    s.loss_weight = f.values<float>("loss_weight", T);
    s.lp_inf = f.values<float>("lp_inf", T);
    s.lp_sampling = f.values<float>("lp_sampling", T);
    s.lp_ref = f.values<float>("lp_ref", T);
    s.logits = f.values<double>("logits", pairs);
    s.grad = f.values<double>("grad", pairs);
  }
  c.expected.resize(size_t(c.parts));
  for (LossCase::Part& part : c.expected) {
    f.expect("expect");
    part.loss = f.value<double>(), part.scale = f.value<double>(), part.divisor = f.value<double>();
  }
  f.expect("stats");
  c.stats.loss_tokens = f.value<int64_t>(), c.stats.masked_high = f.value<int64_t>();
  c.stats.masked_low = f.value<int64_t>(), c.stats.is_capped = f.value<int64_t>();
  c.stats.is_masked = f.value<int64_t>();
  c.stats.entropy_sum = f.value<double>(), c.stats.mismatch_kl_sum = f.value<double>();
  c.stats.is_ratio_sum = f.value<double>();
  c.stats.ref_kl_sum = f.value<double>();
  f.expect("end");
  return c;
}

// The samples as the reader hands them to the trainer (docs/rollouts.md).
RolloutBatch rollout_batch(const LossCase& c) {
  RolloutBatch b;
  b.path = c.name;
  b.offsets = {0};
  for (const Sample& s : c.samples) {
    for (int64_t t = 0; t < s.T; ++t) {
      b.tokens.push_back(s.tokens[sz(t)]);
      b.loss_mask.push_back(s.loss_mask[sz(t)]);
      b.loss_weight.push_back(s.loss_weight[sz(t)]);
      b.inference_logprobs.push_back(s.lp_inf[sz(t)]);
      b.advantages.push_back(s.A);
      if (t > 0) b.loss_tokens += s.loss_mask[sz(t)] && s.loss_weight[sz(t)] > 0.0f;
    }
    b.offsets.push_back(int64_t(b.tokens.size()));
    b.temperature.push_back(s.tau);
  }
  return b;
}

struct Errors {
  double loss = 0, grad = 0;
};

// The trainer's path for one case, part by part; returns the worst relative errors.
Errors run_case(const LossCase& c) {
  CAPTURE(c.name);
  const RolloutBatch file = rollout_batch(c);
  LossSection loss;
  loss.normalize = c.normalize;
  loss.normalize_constant = c.normalize_constant;
  int64_t longest = 0;
  for (const Sample& s : c.samples) longest = std::max(longest, s.T - 1);
  LossStats got;
  Errors err;
  double biggest_grad = 0;  // over every part
  int64_t first_sample = 0;  // the part's first sample in the file
  for (int64_t k = 0; k < c.parts; ++k) {
    CAPTURE(k);
    RolloutBatch part = c.parts == 1 ? file : rollout_part(file, k, c.parts);
    const int64_t samples_with_loss = c.normalize == "sequence" ? normalize_per_sequence(part) : 0;
    const double divisor = rl_loss_divisor(loss, samples_with_loss, part.loss_tokens);
    CHECK(divisor == c.expected[sz(k)].divisor);
    // Rows one position longer than the longest sample, one row a micro-batch:
    // three or more samples take two rows or more, some padded.
    const RankRollouts packed = pack_rollouts(part, longest + 1, 1, 0, 1);
    if (c.parts == 1) REQUIRE(packed.micro_batches.size() >= 2);

    struct Micro {
      TokenBatch batch;
      std::vector<double> logits, logprobs;
      std::vector<float> sampling, ref;
    };
    std::vector<Micro> micro(packed.micro_batches.size());
    const int64_t V = c.V;
    for (size_t m = 0; m < micro.size(); ++m) {
      const RlMicroBatch& mb = packed.micro_batches[m];
      Micro& u = micro[m];
      u.batch = token_batch(mb.batch);
      u.batch.advantages = mb.advantages.data();
      u.batch.inference_logprobs = mb.inference_logprobs.data();
      u.batch.temperatures = mb.temperatures.data();
      u.batch.sample_ids = mb.sample_ids.data();
      const int64_t N = u.batch.N;
      u.logits.assign(sz(N * V), 0.0);
      u.sampling.assign(sz(N), 0.0f);
      u.ref.assign(sz(N), 0.0f);
      for (int64_t t = 0; t < N; ++t) {
        const int32_t s = mb.sample_ids[sz(t)];
        if (s < 0) continue;
        const Sample& smp = c.samples[sz(first_sample + s)];
        const int64_t j = mb.batch.positions[sz(t)];
        std::copy_n(smp.logits.begin() + j * V, V, u.logits.begin() + t * V);
        u.sampling[sz(t)] = smp.lp_sampling[sz(j + 1)];
        u.ref[sz(t)] = smp.lp_ref[sz(j + 1)];
      }
      if (c.has_sampling) u.batch.sampling_logprobs = u.sampling.data();
      if (c.params.ref_kl_coef > 0) u.batch.ref_logprobs = u.ref.data();
      u.logprobs.assign(sz(N), 0.0);
      cpu::token_logprobs<double, double>(u.logprobs.data(), u.logits.data(), u.batch.targets, u.batch.temperatures,
                                          N, V);
    }
    // The part's sample sums over every micro-batch, as the forward-only pass adds them.
    SampleSums sums;
    sums.reset(part.samples());
    for (const Micro& u : micro) sums.add(u.batch, u.logprobs.data());

    LossStats part_stats;
    double grad_diff = 0, grad_max = 0;
    const double scale = divisor > 0 ? 1.0 / divisor : 0.0;
    for (size_t m = 0; m < micro.size(); ++m) {
      Micro& u = micro[m];
      const RlMicroBatch& mb = packed.micro_batches[m];
      const int64_t N = u.batch.N;
      std::vector<double> log_ratio(sz(N)), log_is(sz(N));
      sums.expand(u.batch, log_ratio.data(), log_is.data());
      u.batch.sequence_log_ratio = log_ratio.data();
      u.batch.sequence_log_is = log_is.data();
      const std::vector<double> weights(u.batch.weights, u.batch.weights + N);
      std::vector<double> g = u.logits;
      part_stats += cpu::rl_loss_forward_backward<double>(g.data(), u.batch.targets, weights.data(),
                                                          u.batch.rl_inputs(), c.params, scale, N, V);
      for (int64_t t = 0; t < N; ++t) {
        const int32_t s = mb.sample_ids[sz(t)];
        const int64_t j = mb.batch.positions[sz(t)];
        for (int64_t v = 0; v < V; ++v) {
          const double want = s < 0 ? 0.0 : c.samples[sz(first_sample + s)].grad[sz(j * V + v)];
          grad_diff = std::max(grad_diff, std::abs(g[sz(t * V + v)] - want));
          grad_max = std::max(grad_max, std::abs(want));
        }
      }
    }
    biggest_grad = std::max(biggest_grad, grad_max);
    // A part without loss has no gradient to compare.
    if (grad_max > 0) err.grad = std::max(err.grad, grad_diff / grad_max);
    else CHECK(grad_diff == 0.0);
    // The loss against the scale of its terms (sum |loss_t| / divisor), so a
    // part whose terms cancel is not judged by a near-zero total.
    const LossCase::Part& want = c.expected[sz(k)];
    const double part_loss = part_stats.loss / (divisor > 0 ? divisor : 1.0);
    if (want.scale > 0) err.loss = std::max(err.loss, std::abs(part_loss - want.loss) / want.scale);
    else CHECK(part_loss == 0.0);
    got += part_stats;
    first_sample += part.samples();
  }
  CHECK(first_sample == int64_t(c.samples.size()));  // the parts cover every sample once
  CHECK(got.loss_tokens == c.stats.loss_tokens);
  CHECK(got.masked_high == c.stats.masked_high);
  CHECK(got.masked_low == c.stats.masked_low);
  CHECK(got.is_capped == c.stats.is_capped);
  CHECK(got.is_masked == c.stats.is_masked);
  CHECK(got.entropy_sum == doctest::Approx(c.stats.entropy_sum).epsilon(1e-9));
  CHECK(got.mismatch_kl_sum == doctest::Approx(c.stats.mismatch_kl_sum).epsilon(1e-9));
  CHECK(got.is_ratio_sum == doctest::Approx(c.stats.is_ratio_sum).epsilon(1e-9));
  CHECK(got.ref_kl_sum == doctest::Approx(c.stats.ref_kl_sum).epsilon(1e-9));
  if (c.params.ref_kl_coef > 0) CHECK(std::abs(got.ref_kl_sum) > 1e-3);  // the term was there to compare
  CHECK(err.loss < 1e-6);
  CHECK(err.grad < 1e-6);
  CHECK(biggest_grad > 1e-4);  // the comparison compares something
  return err;
}

}  // namespace

TEST_SUITE("rl_objectives" * doctest::skip()) {

TEST_CASE("every objective, aggregation, importance-sampling level and advantage against the numpy reference") {
  const char* path = std::getenv("SHARDLM_RL_REFERENCE");
  REQUIRE_MESSAGE(path, "SHARDLM_RL_REFERENCE names the file of tests/scripts/rl_objectives_reference.py");
  Words f(path);
  int cases = 0, advantage_cases = 0;
  double worst_loss = 0, worst_grad = 0, worst_adv = 0;
  LossStats seen;  // the branches the cases took, over all of them
  int parted = 0, with_ref_kl = 0;
  for (std::string key = f.word(); !key.empty(); key = f.word()) {
    if (key == "case") {
      const LossCase c = read_case(f);
      const Errors e = run_case(c);
      std::printf("rl_objectives %-44s loss rel err %.1e  grad rel err %.1e  (clip/mask %lld/%lld, IS capped %lld "
                  "masked %lld of %lld tokens)\n",
                  c.name.c_str(), e.loss, e.grad, (long long)c.stats.masked_high, (long long)c.stats.masked_low,
                  (long long)c.stats.is_capped, (long long)c.stats.is_masked, (long long)c.stats.loss_tokens);
      worst_loss = std::max(worst_loss, e.loss);
      worst_grad = std::max(worst_grad, e.grad);
      seen += c.stats;
      parted += c.parts > 1;
      with_ref_kl += c.params.ref_kl_coef > 0;
      ++cases;
    } else {
      REQUIRE_MESSAGE(key == "advantage", "reference file: unexpected '" << key << "'");
      const std::string kind = f.word();
      const int64_t n = f.value<int64_t>();
      const size_t count = f.value<size_t>();
      const auto rewards = f.values<double>("rewards", count);
      const auto expected = f.values<double>("expected", count);
      const std::vector<float> got = group_advantages(rewards, n, kind);
      double diff = 0, scale = 0;
      for (size_t i = 0; i < count; ++i) {
        diff = std::max(diff, std::abs(double(got[i]) - expected[i]));
        scale = std::max(scale, std::abs(expected[i]));
      }
      CAPTURE(kind);
      CHECK(diff / scale < 1e-6);
      std::printf("rl_objectives advantage %-10s rel err %.1e\n", kind.c_str(), diff / scale);
      worst_adv = std::max(worst_adv, diff / scale);
      ++advantage_cases;
    }
  }
  std::printf("rl_objectives: %d loss cases, worst loss rel err %.1e, worst grad rel err %.1e; %d advantage kinds, "
              "worst rel err %.1e\n",
              cases, worst_loss, worst_grad, advantage_cases, worst_adv);
  CHECK(cases == 48);
  CHECK(advantage_cases == 4);
  CHECK(seen.masked_high > 0);
  CHECK(seen.masked_low > 0);
  CHECK(seen.is_capped > 0);
  CHECK(seen.is_masked > 0);
  CHECK(parted == 12);
  CHECK(with_ref_kl == 12);
}

}  // TEST_SUITE
