// rl_loss.hpp — the RL policy loss on a chunk of lm-head logits, fused forward +
// backward in place (the RL counterpart of cpu::cross_entropy_forward_backward),
// and the per-chunk statistics that are logged.
//
// Owns: shardlm::cpu::{rl_loss_forward_backward, token_logprobs}, templated on T (float for the CPU backend, double for
// finite-difference tests). The CPU reference the CUDA kernel is checked against.
// Must not know: MPI, files, the model, rollouts (the caller expands per-sample
// values to per-token arrays), devices.
//
// Per token t with target y_t >= 0 and weight w_t > 0 (a "loss token"):
//   z          = logits_t / tau_t                         (tau_t: the sample's temperature)
//   logp       = log_softmax(z)[y_t]                      computed in double, rounded to T
//   H          = entropy of softmax(z)                    (double)
//   log r      = logp - lp_inf_t,  r = exp(log r)          (lp_inf_t: inference logprob)
//   loss_t     = w_t * (pg_t + kl_coef * (log r)^2 - entropy_coef * H + ref_kl_coef * k_t) - ce_coef * w_t * logp
//   dlogits_t  = grad_scale * (d loss_t/d logp * (onehot(y_t) - softmax(z))
//                              - d loss_t/d H * softmax(z) * (log softmax(z) + H)) / tau_t
// The policy term pg_t by objective (p.objective); "constant" means no gradient
// flows through it (sg, stop-gradient):
//   Masked     -A r, 0 where the probability moved past the mask in A's direction:
//              masked = (A > 0 and dp > mask_high) or (A <= 0 and dp < -mask_low),
//              dp = exp(logp) - exp(lp_inf) (counted in masked_high / masked_low).
//   Clipped    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) (PPO / GRPO); no
//              gradient where the clip is active (A > 0 and r > 1 + clip_high, or
//              A < 0 and r < 1 - clip_low, counted in masked_high / masked_low).
//   Gspo       the same clip on s_i = exp(mean over sample i's loss tokens of log r)
//              (GSPO, Zheng et al. 2025, arXiv:2507.18071), per token as GSPO-token:
//              s_{i,t} = sg[s_i] pi_t / sg[pi_t], so d pg_t / d logp_t = -A s_i where
//              unclipped; with normalize = "sequence" exactly GSPO's objective.
//              in.sequence_log_ratio carries the sample's mean log r.
//   Cispo      -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp (CISPO, MiniMax-M1,
//              arXiv:2506.13585): every token keeps its gradient -A clip(r); tokens
//              whose weight was truncated count in masked_high / masked_low.
// Importance sampling against the train/inference mismatch (p.is_level != None;
// truncated IS after Yao et al. 2025, "Your efficient RL framework secretly
// brings you off-policy RL training"):
//   rho        = exp(logp - lp_sampling_t) per token, or exp(sum over the sample's
//              loss tokens of logp - lp_sampling) (in.sequence_log_is) per sample;
//              lp_sampling: the logprob of the distribution sampled from (top-k /
//              top-p applied), inference_logprobs when absent. A constant.
//   masked     is_mask > 0 and rho outside [1 / is_mask, is_mask]: the token carries
//              no loss at all (no term, zero gradient), counted in is_masked.
//   pg_t       *= min(rho, is_cap) (counted in is_capped where rho > is_cap), and the
//              objectives' r is taken against the trainer's own logprob instead of
//              lp_inf: r = pi / sg[pi] = 1 in value, d r / d logp = 1 (GSPO's s = 1),
//              so the trainer/sampler gap is weighted once, by rho.
// The kl term and the mismatch KL statistic always use log r against lp_inf.
// The reference KL (p.ref_kl_coef > 0): k_t estimates KL(pi || pi_ref) at the
// sampled token from x = lp_ref_t - logp (in.ref_logprobs: the frozen starting
// weights' logprob; Schulman 2020, "Approximating KL divergence"): k1 = -x,
// k2 = x^2 / 2, k3 = e^x - x - 1, the gradient through logp (ref_kl_term in
// cpu/rl_terms.hpp); counted unweighted in ref_kl_sum.
// Masks and clips are constants in the derivative (no gradient through an
// indicator). Other rows add nothing and get a zero gradient. The per-token
// scalars are rl_row_terms (cpu/rl_terms.hpp), shared with the CUDA kernel.
//
// logp is rounded to T before log r is formed, so with T = float and inference
// logprobs produced by token_logprobs<float> on the same logits, log r is exactly
// 0 (then with A = 0, ce_coef = 0 and entropy_coef = 0 every gradient element is
// exactly 0).
#pragma once

#include <cstdint>

#include "shardlm/loss.hpp"

namespace shardlm::cpu {

// [loss] knobs of loss.type = "rl"; defaults as in docs/config.md.
// The parameters and the statistics are the backends' shared ones (shardlm/loss.hpp).
using RlLossParams = shardlm::RlLossParams;
using RlChunkStats = shardlm::LossStats;

using RlTokenInputs = shardlm::RlTokenInputs;

// Throws shardlm::Error for a target >= V, a loss token whose temperature is not
// positive and finite, or (internal) sample sums missing where p needs them.
// Deterministic: the same bits at any thread count.
template <class T>
RlChunkStats rl_loss_forward_backward(T* logits, const int32_t* targets, const T* weights, const RlTokenInputs& in,
                                      const RlLossParams& p, T grad_scale, int64_t n, int64_t V);

// logprobs[t] = logp for every row with a target (the exact logp the loss kernel
// forms, as Out: for T = Out identical bits); rows with target < 0 get 0. The
// inference side's logprobs on the CPU, on-policy logprobs in tests, and the
// step's forward-only pass (train/sequence_pass.hpp). logits (n, V) are not
// modified. Out = float (T = float or double) or double (T = double).
template <class T, class Out>
void token_logprobs(Out* logprobs, const T* logits, const int32_t* targets, const float* temperatures, int64_t n,
                    int64_t V);

}  // namespace shardlm::cpu
