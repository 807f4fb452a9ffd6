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
//   log r      = logp - lp_inf_t,  r = exp(log r)          (lp_inf_t: inference logprob)
//   dp         = exp(logp) - exp(lp_inf_t)                (in double)
//   masked     = (A_t > 0 and dp > mask_high) or (A_t <= 0 and dp < -mask_low)
//   loss_t     = w_t * (-A_t * r * [not masked] + kl_coef * (log r)^2) - ce_coef * w_t * logp
//   dlogits_t  = grad_scale * dloss_t/dlogp * (onehot(y_t) - softmax(z)) / tau_t
// With p.clipped the policy term is the PPO/GRPO clipped surrogate instead:
//   pg_t       = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
//   d pg/d logp = -A r where r A is the smaller (or equal) term, else 0 (the clip
//                is active: A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low,
//                counted in masked_high / masked_low); no mask_high / mask_low then.
// The mask is a constant in the derivative (no gradient through the indicator).
// Other rows add nothing and get a zero gradient.
//
// logp is rounded to T before log r is formed, so with T = float and inference
// logprobs produced by token_logprobs<float> on the same logits, log r is exactly
// 0 (then with A = 0 and ce_coef = 0 every gradient element is exactly 0).
#pragma once

#include <cstdint>

#include "shardlm/loss.hpp"

namespace shardlm::cpu {

// [loss] knobs of loss.type = "rl"; defaults as in docs/config.md.
// The parameters and the statistics are the backends' shared ones (shardlm/loss.hpp).
using RlLossParams = shardlm::RlLossParams;
using RlChunkStats = shardlm::LossStats;

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
