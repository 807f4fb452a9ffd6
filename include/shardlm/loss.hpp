// loss.hpp — what a backend's loss takes and what it adds up to: the RL policy
// loss's parameters and per-token inputs, and the sums of one micro-batch (SFT
// fills loss and loss_tokens), shared by the CPU and CUDA kernels, the backends
// and the step.
// Knows nothing else.
#pragma once

#include <array>
#include <cstdint>

namespace shardlm {

// loss.objective: the policy term (src/cpu/rl_loss.hpp has the formulas).
enum class RlObjective : uint8_t { Masked, Clipped, Gspo, Cispo };
// loss.is_level: importance sampling against the train/inference mismatch.
enum class IsLevel : uint8_t { None, Token, Sequence };
// loss.ref_kl_estimator: the per-token estimator of KL(pi || pi_ref), with
// x = lp_ref - logp (Schulman 2020, "Approximating KL divergence"):
// k1 = -x, k2 = x^2 / 2, k3 = e^x - x - 1.
enum class RefKlEstimator : uint8_t { K1, K2, K3 };

struct RlLossParams {
  double mask_high = 0.2;  // mask A > 0 tokens whose probability rose by more than this
  double mask_low = 0.2;   // mask A <= 0 tokens whose probability fell by more than this
  double kl_coef = 1e-3;   // weight of (log r)^2 on every loss token
  double ce_coef = 0.0;    // weight of an extra -logp (SFT) term, for mixed SFT + RL
  RlObjective objective = RlObjective::Masked;
  double clip_low = 0.2;   // clipped, gspo: the ratio's clip [1 - clip_low, 1 + clip_high];
  double clip_high = 0.28; //   cispo: the weight's truncation to the same range
  IsLevel is_level = IsLevel::None;
  double is_cap = 2.0;        // the importance weight is min(rho, is_cap)
  double is_mask = 0.0;       // > 0: rho outside [1 / is_mask, is_mask] carries no loss
  double entropy_coef = 0.0;  // weight of -H(softmax(logits / tau)) on every loss token
  double ref_kl_coef = 0.0;   // weight of the KL estimator against the frozen reference's logprob; 0: off
  RefKlEstimator ref_kl_estimator = RefKlEstimator::K3;

  // Whether the loss needs sums over whole samples before its backward (GSPO's
  // sequence ratio, sequence-level importance weights): the step's forward-only
  // pass (train/sequence_pass.hpp) computes them. GSPO's ratio is taken against
  // the trainer's own logprobs under importance sampling, where it is 1.
  bool needs_sequence_terms() const {
    return (objective == RlObjective::Gspo && is_level == IsLevel::None) || is_level == IsLevel::Sequence;
  }
};

// The per-token inputs of the RL loss on a chunk of n rows, expanded from
// per-sample values by the caller; read on loss tokens only. Host pointers for
// the CPU kernel, device pointers for the CUDA one.
struct RlTokenInputs {
  const float* advantages = nullptr;          // (n) A
  const float* inference_logprobs = nullptr;  // (n) logprob under the sampler's full distribution at tau
  const float* sampling_logprobs = nullptr;   // (n) logprob under the distribution sampled from (top-k /
                                              //   top-p applied); nullptr: inference_logprobs
  const float* temperatures = nullptr;        // (n) tau
  // Sums over the token's whole sample (RlLossParams::needs_sequence_terms, else nullptr):
  const double* sequence_log_ratio = nullptr; // (n) gspo: mean over the sample's loss tokens of logp - lp_inf
  const double* sequence_log_is = nullptr;    // (n) is_level = sequence: sum over them of logp - lp_sampling
  // RlLossParams::ref_kl_coef > 0: the frozen reference weights' logprob of the
  // target at tau (train/reference_pass.hpp); else nullptr.
  const float* ref_logprobs = nullptr;        // (n)

  // The same inputs from row `offset` on (a chunk of a micro-batch).
  RlTokenInputs at(int64_t offset) const {
    auto shift = [offset](auto* p) { return p ? p + offset : p; };
    return {shift(advantages),   shift(inference_logprobs), shift(sampling_logprobs),
            shift(temperatures), shift(sequence_log_ratio), shift(sequence_log_is), shift(ref_logprobs)};
  }
};

// Sums over a chunk's loss tokens, so chunks, micro-batches and ranks combine by
// addition (to_array / from_array for one MPI all-reduce of doubles; the counts
// stay exact below 2^53). Means for the log: divide by loss_tokens.
struct LossStats {
  double loss = 0;             // sum of loss_t (weighted), before grad_scale
  int64_t loss_tokens = 0;     // tokens with target >= 0 and weight > 0
  int64_t masked_high = 0;     // A > 0 tokens masked for dp > mask_high (clipped, gspo: A > 0 tokens
                               //   whose ratio > 1 + clip_high, the clip active; cispo: weight truncated above)
  int64_t masked_low = 0;      // A <= 0 tokens masked for dp < -mask_low (clipped, gspo: A < 0 tokens
                               //   whose ratio < 1 - clip_low, the clip active; cispo: weight raised below)
  double entropy_sum = 0;      // sum of H(softmax(logits / tau)), unweighted
  double mismatch_kl_sum = 0;  // sum of k3 = r - log r - 1, unweighted
  double advantage_sum = 0;    // sum of A_t, unweighted
  double is_ratio_sum = 0;     // is_level != none: sum of rho (each bounded to [e^-20, e^20])
  int64_t is_capped = 0;       // tokens whose rho > is_cap (weight truncated)
  int64_t is_masked = 0;       // tokens whose rho is outside [1 / is_mask, is_mask] (no loss)
  double ref_kl_sum = 0;       // ref_kl_coef > 0: sum of the KL estimator against the reference, unweighted
  // Experts (model.router_aux_loss): each micro-batch's load-balancing loss, summed, and the micro-batches.
  double router_aux_sum = 0;
  int64_t router_aux_batches = 0;

  static constexpr int kFields = 13;
  LossStats& operator+=(const LossStats& o) {
    loss += o.loss;
    loss_tokens += o.loss_tokens;
    masked_high += o.masked_high;
    masked_low += o.masked_low;
    entropy_sum += o.entropy_sum;
    mismatch_kl_sum += o.mismatch_kl_sum;
    advantage_sum += o.advantage_sum;
    is_ratio_sum += o.is_ratio_sum;
    is_capped += o.is_capped;
    is_masked += o.is_masked;
    ref_kl_sum += o.ref_kl_sum;
    router_aux_sum += o.router_aux_sum;
    router_aux_batches += o.router_aux_batches;
    return *this;
  }
  std::array<double, kFields> to_array() const {
    return {loss,          double(loss_tokens), double(masked_high), double(masked_low), entropy_sum,
            mismatch_kl_sum, advantage_sum,     is_ratio_sum,        double(is_capped),  double(is_masked),
            ref_kl_sum,      router_aux_sum,    double(router_aux_batches)};
  }
  static LossStats from_array(const std::array<double, kFields>& a) {
    return {a[0], int64_t(a[1]), int64_t(a[2]), int64_t(a[3]), a[4], a[5], a[6], a[7], int64_t(a[8]), int64_t(a[9]),
            a[10], a[11], int64_t(a[12])};
  }
};

}  // namespace shardlm
