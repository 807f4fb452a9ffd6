// rl_loss.cpp — RL policy loss on lm-head logits; see src/cpu/rl_loss.hpp
// for the formula and the contract.
#include "cpu/rl_loss.hpp"

#include <algorithm>
#include <cmath>

#include "shardlm/error.hpp"

namespace shardlm::cpu {

namespace {

// Fixed number of partial sums, as in cross_entropy_forward_backward: the rows'
// split into blocks does not depend on the thread count and the partials are
// added in block order, so the sums are the same bits at any thread count.
constexpr int64_t kReduceBlocks = 256;

template <class T>
struct RowSoftmax {
  T logp;          // log_softmax(x / tau)[target], rounded to T
  double sum;      // sum_c exp((x_c - max) / tau)
  double entropy;  // -sum_c p_c log p_c
};

// The one place logp is computed, shared by the loss and token_logprobs so that
// both give the same bits. exp_out (V) or nullptr receives the unnormalised
// softmax exp((x - max) / tau); it may alias x.
template <class T>
RowSoftmax<T> row_softmax(const T* x, T* exp_out, int32_t target, T tau, int64_t V) {
  T m = x[0];
  for (int64_t c = 1; c < V; ++c) m = std::max(m, x[c]);
  const T d_target = (x[target] - m) / tau;  // z_target - max z (tau > 0)
  double sum = 0, sum_e_d = 0;
  for (int64_t c = 0; c < V; ++c) {
    const T d = (x[c] - m) / tau;
    const T e = std::exp(d);
    sum += double(e);
    sum_e_d += double(e) * double(d);
    if (exp_out) exp_out[c] = e;
  }
  const double log_sum = std::log(sum);
  // H = -sum p (d - log_sum) = log_sum - sum(e d) / sum
  return {T(double(d_target) - log_sum), sum, log_sum - sum_e_d / sum};
}

void check_targets(const int32_t* targets, int64_t n, int64_t V, const char* what) {
  for (int64_t r = 0; r < n; ++r)
    SHARDLM_CHECK(targets[r] < V, "%s: target %d at row %lld is outside the vocabulary [0, %lld)",
                  what, targets[r], static_cast<long long>(r), static_cast<long long>(V));
}

void check_temperature(float tau, int64_t row, const char* what) {
  SHARDLM_CHECK(std::isfinite(tau) && tau > 0.0f,
                "%s: temperature %g at row %lld must be positive and finite", what, double(tau),
                static_cast<long long>(row));
}

}  // namespace

template <class T>
RlChunkStats rl_loss_forward_backward(T* logits, const int32_t* targets, const T* weights,
                                      const float* advantages, const float* inference_logprobs,
                                      const float* temperatures, const RlLossParams& p,
                                      T grad_scale, int64_t n, int64_t V) {
  check_targets(targets, n, V, "rl_loss");
  for (int64_t r = 0; r < n; ++r)
    if (targets[r] >= 0 && (weights ? weights[r] : T(1)) > T(0))
      check_temperature(temperatures[r], r, "rl_loss");

  RlChunkStats partial[kReduceBlocks] = {};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) {
    const int64_t r0 = n * blk / kReduceBlocks, r1 = n * (blk + 1) / kReduceBlocks;
    RlChunkStats st;
    for (int64_t r = r0; r < r1; ++r) {
      T* x = logits + r * V;  // (V) logits in, dlogits out
      const T w = weights ? weights[r] : T(1);
      const int32_t y = targets[r];
      if (y < 0 || !(w > T(0))) {
        std::fill(x, x + V, T(0));
        continue;
      }
      const T tau = T(temperatures[r]);
      const RowSoftmax<T> sm = row_softmax(x, x, y, tau, V);  // x becomes exp((x - m) / tau)

      const double A = advantages[r];
      const double lp_inf = inference_logprobs[r];
      const double logp = double(sm.logp);
      const double log_r = logp - lp_inf;
      const double ratio = std::exp(log_r);
      const double dp = std::exp(logp) - std::exp(lp_inf);  // p_train - p_inference
      bool masked_high, masked_low;
      double pg, dpg_dlogp;  // the policy term and its derivative in logp (d r / d logp = r)
      if (p.clipped) {
        // min(r A, clip(r) A): the clipped term is the smaller exactly when the
        // clip is active in the direction that limits the update; it is a
        // constant in r there, so no gradient.
        masked_high = A > 0 && ratio > 1.0 + p.clip_high;
        masked_low = A < 0 && ratio < 1.0 - p.clip_low;
        const double clipped_ratio = masked_high ? 1.0 + p.clip_high : masked_low ? 1.0 - p.clip_low : ratio;
        pg = -A * clipped_ratio;
        dpg_dlogp = (masked_high || masked_low) ? 0.0 : -A * ratio;
      } else {
        masked_high = A > 0 && dp > p.mask_high;
        masked_low = A <= 0 && dp < -p.mask_low;
        // A branch, not a 0/1 factor: a masked token may have ratio = inf.
        pg = (masked_high || masked_low) ? 0.0 : -A * ratio;
        dpg_dlogp = pg;
      }
      const double wd = double(w);

      st.loss += wd * (pg + p.kl_coef * log_r * log_r) - p.ce_coef * wd * logp;
      // d loss / d logp (d r / d logp = r), then d logp / d x = (onehot - softmax) / tau.
      const double dloss_dlogp = wd * (dpg_dlogp + 2.0 * p.kl_coef * log_r) - p.ce_coef * wd;
      const double coef = double(grad_scale) * dloss_dlogp / double(tau);
      const T scale_exp = T(-coef / sm.sum);
      for (int64_t c = 0; c < V; ++c) x[c] *= scale_exp;
      x[y] += T(coef);

      st.loss_tokens += 1;
      st.masked_high += masked_high;
      st.masked_low += masked_low;
      st.entropy_sum += sm.entropy;
      st.mismatch_kl_sum += std::expm1(log_r) - log_r;  // r - log r - 1 without cancellation
      st.advantage_sum += A;
    }
    partial[blk] = st;
  }
  RlChunkStats total;
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) total += partial[blk];
  return total;
}

template <class T>
void token_logprobs(float* logprobs, const T* logits, const int32_t* targets,
                    const float* temperatures, int64_t n, int64_t V) {
  check_targets(targets, n, V, "token_logprobs");
  for (int64_t r = 0; r < n; ++r)
    if (targets[r] >= 0) check_temperature(temperatures[r], r, "token_logprobs");
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t r = 0; r < n; ++r) {
    if (targets[r] < 0) {
      logprobs[r] = 0.0f;
      continue;
    }
    logprobs[r] = float(row_softmax(logits + r * V, static_cast<T*>(nullptr), targets[r],
                                    T(temperatures[r]), V).logp);
  }
}

#define SHARDLM_RL_LOSS_INSTANTIATE(T)                                                          \
  template RlChunkStats rl_loss_forward_backward<T>(T*, const int32_t*, const T*, const float*, \
                                                    const float*, const float*,                 \
                                                    const RlLossParams&, T, int64_t, int64_t);  \
  template void token_logprobs<T>(float*, const T*, const int32_t*, const float*, int64_t, int64_t);

SHARDLM_RL_LOSS_INSTANTIATE(float)
SHARDLM_RL_LOSS_INSTANTIATE(double)

#undef SHARDLM_RL_LOSS_INSTANTIATE

}  // namespace shardlm::cpu
