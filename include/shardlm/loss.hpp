// loss.hpp — what a backend's loss takes and what it adds up to: the RL policy
// loss's parameters and the sums of one micro-batch (SFT fills loss and
// loss_tokens), shared by the CPU and CUDA kernels, the backends and the step.
// Knows nothing else.
#pragma once

#include <array>
#include <cstdint>

namespace shardlm {

struct RlLossParams {
  double mask_high = 0.2;  // mask A > 0 tokens whose probability rose by more than this
  double mask_low = 0.2;   // mask A <= 0 tokens whose probability fell by more than this
  double kl_coef = 1e-3;   // weight of (log r)^2 on every loss token
  double ce_coef = 0.0;    // weight of an extra -logp (SFT) term, for mixed SFT + RL
  // The policy term: false = masked (-A r on tokens not masked by mask_high /
  // mask_low), true = clipped: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A).
  bool clipped = false;
  double clip_low = 0.2;
  double clip_high = 0.28;
};

// Sums over a chunk's loss tokens, so chunks, micro-batches and ranks combine by
// addition (to_array / from_array for one MPI all-reduce of doubles; the counts
// stay exact below 2^53). Means for the log: divide by loss_tokens.
struct LossStats {
  double loss = 0;             // sum of loss_t (weighted), before grad_scale
  int64_t loss_tokens = 0;     // tokens with target >= 0 and weight > 0
  int64_t masked_high = 0;     // A > 0 tokens masked for dp > mask_high (clipped objective:
                               //   A > 0 tokens whose r > 1 + clip_high, the clip active)
  int64_t masked_low = 0;      // A <= 0 tokens masked for dp < -mask_low (clipped objective:
                               //   A < 0 tokens whose r < 1 - clip_low, the clip active)
  double entropy_sum = 0;      // sum of H(softmax(logits / tau)), unweighted
  double mismatch_kl_sum = 0;  // sum of k3 = r - log r - 1, unweighted
  double advantage_sum = 0;    // sum of A_t, unweighted

  static constexpr int kFields = 7;
  LossStats& operator+=(const LossStats& o) {
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
  static LossStats from_array(const std::array<double, kFields>& a) {
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

}  // namespace shardlm
