// rl_terms.hpp — the RL loss's per-token scalars: given a loss token's logp,
// entropy and inputs, its loss, d loss / d logp, d loss / d H and its
// statistics. One definition for the CPU kernel (cpu/rl_loss.cpp) and the GPU
// one (cuda/rl_loss.cu), so the two differ only in how logp and H are summed.
// The formulas and their sources: src/cpu/rl_loss.hpp.
//
// Owns: shardlm::cpu::RlRowTerms, rl_row_terms. Knows only shardlm/loss.hpp.
#pragma once

#include <cmath>

#include "shardlm/loss.hpp"

#if defined(__CUDACC__)
#define SHARDLM_RL_HD __host__ __device__
#else
#define SHARDLM_RL_HD
#endif

namespace shardlm::cpu {

struct RlRowTerms {
  double loss = 0;         // w * (policy term + kl + entropy bonus) + ce, unscaled
  double dloss_dlogp = 0;  // its derivative in logp (the gradient is taken through logp and H only)
  double dloss_dentropy = 0;
  bool masked_high = false, masked_low = false;  // LossStats' meanings, per objective
  bool is_capped = false, is_masked = false;
  double is_ratio = 0;     // rho bounded to [e^-20, e^20] for the log; 0 without importance sampling
  double mismatch_kl = 0;  // k3 of logp - lp_inf
  double ref_kl = 0;       // the KL estimator against the reference (p.ref_kl_coef > 0), unweighted
};

// KL(pi || pi_ref)'s per-token estimator at a sampled token and its derivative
// in logp, with x = lp_ref - logp (Schulman 2020, "Approximating KL
// divergence"): k1 = -x (d/dlogp 1), k2 = x^2 / 2 (d/dlogp -x),
// k3 = e^x - x - 1 (d/dlogp 1 - e^x). k3 is unbiased and never negative; k1
// is unbiased; k2 is biased, low-variance.
struct RefKlTerm {
  double value = 0, dvalue_dlogp = 0;
};
SHARDLM_RL_HD inline RefKlTerm ref_kl_term(RefKlEstimator e, double logp, double lp_ref) {
  const double x = lp_ref - logp;
  switch (e) {
    case RefKlEstimator::K1: return {-x, 1.0};
    case RefKlEstimator::K2: return {0.5 * x * x, -x};
    case RefKlEstimator::K3: break;
  }
  return {expm1(x) - x, -expm1(x)};  // e^x - x - 1 and 1 - e^x without cancellation near x = 0
}

// One loss token: logp = log_softmax(z)[y] and H = entropy of softmax(z) (the
// trainer's, z = logits / tau), weight w > 0, advantage A, the inference and
// sampling logprobs, the sample's sums and the reference's logprob (read only
// where p needs them).
SHARDLM_RL_HD inline RlRowTerms rl_row_terms(const RlLossParams& p, double logp, double entropy, double w, double A,
                                             double lp_inf, double lp_sampling, double sequence_log_ratio,
                                             double sequence_log_is, double lp_ref = 0.0) {
  RlRowTerms t;
  const double log_r_inf = logp - lp_inf;  // against the sampler's full distribution: the kl term, the statistics
  t.mismatch_kl = expm1(log_r_inf) - log_r_inf;  // r - log r - 1 without cancellation

  // Importance sampling: rho = pi_train / pi_sampling, a constant in the
  // gradient. The policy ratio below is then taken against the trainer's own
  // logprob (stop-gradient: 1 in value, d r / d logp = 1), so that the gap
  // between trainer and sampler is weighted once, by rho.
  const bool is = p.is_level != IsLevel::None;
  double is_weight = 1.0, log_r = log_r_inf;
  if (is) {
    const double log_rho = p.is_level == IsLevel::Token ? logp - lp_sampling : sequence_log_is;
    t.is_masked = p.is_mask > 0 && fabs(log_rho) > log(p.is_mask);
    const double rho = exp(log_rho);  // may overflow to inf: min() caps it
    t.is_capped = !t.is_masked && rho > p.is_cap;
    is_weight = t.is_capped ? p.is_cap : rho;
    t.is_ratio = exp(fmin(fmax(log_rho, -20.0), 20.0));
    log_r = 0.0;
  }
  const double ratio = exp(log_r);

  double pg = 0, dpg_dlogp = 0;  // the policy term and its derivative in logp
  switch (p.objective) {
    case RlObjective::Masked: {
      const double dp = exp(logp) - exp(lp_inf);  // p_train - p_inference
      t.masked_high = A > 0 && dp > p.mask_high;
      t.masked_low = A <= 0 && dp < -p.mask_low;
      // A branch, not a 0/1 factor: a masked token may have ratio = inf.
      pg = (t.masked_high || t.masked_low) ? 0.0 : -A * ratio;
      dpg_dlogp = pg;  // d r / d logp = r
      break;
    }
    case RlObjective::Clipped:
    case RlObjective::Gspo: {
      // -min(s A, clip(s) A): the clipped term is the smaller exactly when the
      // clip is active against the update; a constant in s there. Clipped: s =
      // r; GSPO: s = the sample's geometric-mean ratio, whose derivative in this
      // token's logp is taken as s (GSPO-token, s_t = sg[s] pi_t / sg[pi_t]).
      const double s = p.objective == RlObjective::Clipped ? ratio : is ? 1.0 : exp(sequence_log_ratio);
      t.masked_high = A > 0 && s > 1.0 + p.clip_high;
      t.masked_low = A < 0 && s < 1.0 - p.clip_low;
      const double clipped = t.masked_high ? 1.0 + p.clip_high : t.masked_low ? 1.0 - p.clip_low : s;
      pg = -A * clipped;
      dpg_dlogp = (t.masked_high || t.masked_low) ? 0.0 : -A * s;
      break;
    }
    case RlObjective::Cispo: {
      // -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp: every token keeps a
      // gradient; the weight is truncated, the token never dropped.
      t.masked_high = ratio > 1.0 + p.clip_high;
      t.masked_low = ratio < 1.0 - p.clip_low;
      const double weight = t.masked_high ? 1.0 + p.clip_high : t.masked_low ? 1.0 - p.clip_low : ratio;
      pg = -weight * A * logp;
      dpg_dlogp = -weight * A;
      break;
    }
  }
  if (t.is_masked) {  // rejected: no term of the loss, no gradient (it still counts in the divisor)
    t.masked_high = t.masked_low = false;
    return t;
  }
  pg *= is_weight;
  dpg_dlogp *= is_weight;
  t.loss = w * (pg + p.kl_coef * log_r_inf * log_r_inf - p.entropy_coef * entropy) - p.ce_coef * w * logp;
  t.dloss_dlogp = w * (dpg_dlogp + 2.0 * p.kl_coef * log_r_inf) - p.ce_coef * w;
  if (p.ref_kl_coef != 0.0) {  // a branch: with the term off the sums above stay the same bits
    const RefKlTerm kl = ref_kl_term(p.ref_kl_estimator, logp, lp_ref);
    t.ref_kl = kl.value;
    t.loss += w * p.ref_kl_coef * kl.value;
    t.dloss_dlogp += w * p.ref_kl_coef * kl.dvalue_dlogp;
  }
  t.dloss_dentropy = -p.entropy_coef * w;
  return t;
}

}  // namespace shardlm::cpu

#undef SHARDLM_RL_HD
