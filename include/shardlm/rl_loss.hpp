// rl_loss.hpp — the RL policy loss on a chunk of lm-head logits, fused forward +
// backward in place (the RL counterpart of cpu::cross_entropy_forward_backward),
// and the per-chunk statistics that are logged.
//
// Owns: shardlm::cpu::{RlLossParams, RlChunkStats, rl_loss_forward_backward,
// token_logprobs}, templated on T (float for the CPU backend, double for
// finite-difference tests). The CPU reference the CUDA kernel is checked against.
// Must not know: MPI, files, the model, rollouts (the caller expands per-sample
// values to per-token arrays), devices.
//
// Per token t with target y_t >= 0 and weight w_t > 0 (a "loss token"):
//   z          = logits_t / tau_t                         (tau_t: the sample's temperature)
//   logp       = log_softmax(z)[y_t]                      computed in double, rounded to T
//   log r      = logp - lp_inf_t,  r = exp(log r)          (lp_inf_t: inference logprob)
//   dp         = exp(logp) - exp(lp_inf_t)                (in double)
//   masked     = (A_t > 0 and dp > mask_high) or (A_t <= 0 and dp < -mask_low)
//   loss_t     = w_t * (-A_t * r * [not masked] + kl_coef * (log r)^2) - ce_coef * w_t * logp
//   dlogits_t  = grad_scale * dloss_t/dlogp * (onehot(y_t) - softmax(z)) / tau_t
// The mask is a constant in the derivative (no gradient through the indicator).
// Other rows add nothing and get a zero gradient.
//
// logp is rounded to T before log r is formed, so with T = float and inference
// logprobs produced by token_logprobs<float> on the same logits, log r is exactly
// 0 (then with A = 0 and ce_coef = 0 every gradient element is exactly 0).
#pragma once

#include <array>
#include <cstdint>

namespace shardlm::cpu {

// [loss] knobs of loss.type = "rl"; defaults as in docs/config.md.
struct RlLossParams {
  double mask_high = 0.2;  // mask A > 0 tokens whose probability rose by more than this
  double mask_low = 0.2;   // mask A <= 0 tokens whose probability fell by more than this
  double kl_coef = 1e-3;   // weight of (log r)^2 on every loss token
  double ce_coef = 0.0;    // weight of an extra -logp (SFT) term, for mixed SFT + RL
};

// Sums over a chunk's loss tokens, so chunks, micro-batches and ranks combine by
// addition (to_array / from_array for one MPI all-reduce of doubles; the counts
// stay exact below 2^53). Means for the log: divide by loss_tokens.
struct RlChunkStats {
  double loss = 0;             // sum of loss_t (weighted), before grad_scale
  int64_t loss_tokens = 0;     // tokens with target >= 0 and weight > 0
  int64_t masked_high = 0;     // A > 0 tokens masked for dp > mask_high
  int64_t masked_low = 0;      // A <= 0 tokens masked for dp < -mask_low
  double entropy_sum = 0;      // sum of H(softmax(logits / tau)), unweighted
  double mismatch_kl_sum = 0;  // sum of k3 = r - log r - 1, unweighted
  double advantage_sum = 0;    // sum of A_t, unweighted

  static constexpr int kFields = 7;
  RlChunkStats& operator+=(const RlChunkStats& o) {
    loss += o.loss;
    loss_tokens += o.loss_tokens;
    masked_high += o.masked_high;
    masked_low += o.masked_low;
    entropy_sum += o.entropy_sum;
    mismatch_kl_sum += o.mismatch_kl_sum;
    advantage_sum += o.advantage_sum;
    return *this;
  }
  std::array<double, kFields> to_array() const {
    return {loss, double(loss_tokens), double(masked_high), double(masked_low), entropy_sum,
            mismatch_kl_sum, advantage_sum};
  }
  static RlChunkStats from_array(const std::array<double, kFields>& a) {
    return {a[0], int64_t(a[1]), int64_t(a[2]), int64_t(a[3]), a[4], a[5], a[6]};
  }
};

// Fused forward + backward on a chunk of logits (n, V), in place: returns the
// chunk's sums and overwrites logits with dloss/dlogits * grad_scale
// (grad_scale = 1 / the step's global loss-token count).
//   logits (n, V); targets (n) in [-inf, V), < 0 = no target;
//   weights (n) or nullptr (= 1): loss weight, <= 0 = no loss;
//   advantages, inference_logprobs, temperatures (n): per token, already
//   expanded from per-sample values by the caller; read only on loss tokens.
// Throws shardlm::Error for a target >= V or a loss token whose temperature is
// not positive and finite. Deterministic: the same bits at any thread count.
template <class T>
RlChunkStats rl_loss_forward_backward(T* logits, const int32_t* targets, const T* weights,
                                      const float* advantages, const float* inference_logprobs,
                                      const float* temperatures, const RlLossParams& p,
                                      T grad_scale, int64_t n, int64_t V);

// logprobs[t] = float(logp) for every row with a target (the exact logp the loss
// kernel forms, rounded to float; for T = float identical bits); rows with
// target < 0 get 0. Used to make on-policy inference logprobs in tests and by a
// reference consumer. logits (n, V) are not modified.
template <class T>
void token_logprobs(float* logprobs, const T* logits, const int32_t* targets,
                    const float* temperatures, int64_t n, int64_t V);

}  // namespace shardlm::cpu
