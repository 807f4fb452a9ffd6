// rl_loss.cpp — RL policy loss on lm-head logits; see src/cpu/rl_loss.hpp
// for the formula and the contract.
#include "cpu/rl_loss.hpp"

#include <algorithm>
#include <cmath>

#include "cpu/rl_terms.hpp"
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
  T max;           // max_c x_c
  double sum;      // sum_c exp((x_c - max) / tau)
  double log_sum;  // log(sum)
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
  return {T(double(d_target) - log_sum), m, sum, log_sum, log_sum - sum_e_d / sum};
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
RlChunkStats rl_loss_forward_backward(T* logits, const int32_t* targets, const T* weights, const RlTokenInputs& in,
                                      const RlLossParams& p, T grad_scale, int64_t n, int64_t V) {
  check_targets(targets, n, V, "rl_loss");
  for (int64_t r = 0; r < n; ++r)
    if (targets[r] >= 0 && (weights ? weights[r] : T(1)) > T(0))
      check_temperature(in.temperatures[r], r, "rl_loss");
  const bool gspo_sums = p.objective == RlObjective::Gspo && p.is_level == IsLevel::None;
  SHARDLM_CHECK(n == 0 || ((!gspo_sums || in.sequence_log_ratio) && (p.is_level != IsLevel::Sequence || in.sequence_log_is)),
                "internal: rl_loss without the sample sums its objective or importance weights need");
  SHARDLM_CHECK(n == 0 || p.ref_kl_coef == 0.0 || in.ref_logprobs,
                "internal: rl_loss with loss.ref_kl_coef > 0 but no reference logprobs");
  const bool entropy_grad = p.entropy_coef != 0.0;

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
      const T tau = T(in.temperatures[r]);
      // Without the entropy's gradient x becomes exp((x - m) / tau) here; with it
      // the logits stay, as the gradient needs each log p_c too.
      const RowSoftmax<T> sm = row_softmax(x, entropy_grad ? nullptr : x, y, tau, V);
      const double lp_inf = in.inference_logprobs[r];
      const RlRowTerms k = rl_row_terms(p, double(sm.logp), sm.entropy, double(w), double(in.advantages[r]), lp_inf,
                                        in.sampling_logprobs ? double(in.sampling_logprobs[r]) : lp_inf,
                                        gspo_sums ? in.sequence_log_ratio[r] : 0.0,
                                        p.is_level == IsLevel::Sequence ? in.sequence_log_is[r] : 0.0,
                                        p.ref_kl_coef != 0.0 ? double(in.ref_logprobs[r]) : 0.0);
      st.loss += k.loss;
      // d logp / d x = (onehot - softmax) / tau; d H / d x = -softmax (log softmax + H) / tau.
      const double coef = double(grad_scale) * k.dloss_dlogp / double(tau);
      if (!entropy_grad) {
        const T scale_exp = T(-coef / sm.sum);
        for (int64_t c = 0; c < V; ++c) x[c] *= scale_exp;
      } else {
        const double entropy_coef = double(grad_scale) * k.dloss_dentropy / double(tau);
        const double shift = sm.entropy - sm.log_sum;  // log p_c + H = d_c + shift
        for (int64_t c = 0; c < V; ++c) {
          const T d = (x[c] - sm.max) / tau;
          const double prob = double(std::exp(d)) / sm.sum;
          x[c] = T(-prob * (coef + entropy_coef * (double(d) + shift)));
        }
      }
      x[y] += T(coef);

      st.loss_tokens += 1;
      st.masked_high += k.masked_high;
      st.masked_low += k.masked_low;
      st.entropy_sum += sm.entropy;
      st.mismatch_kl_sum += k.mismatch_kl;
      st.advantage_sum += double(in.advantages[r]);
      st.is_ratio_sum += k.is_ratio;
      st.is_capped += k.is_capped;
      st.is_masked += k.is_masked;
      st.ref_kl_sum += k.ref_kl;
    }
    partial[blk] = st;
  }
  RlChunkStats total;
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) total += partial[blk];
  return total;
}

template <class T, class Out>
void token_logprobs(Out* logprobs, const T* logits, const int32_t* targets, const float* temperatures, int64_t n,
                    int64_t V) {
  check_targets(targets, n, V, "token_logprobs");
  for (int64_t r = 0; r < n; ++r)
    if (targets[r] >= 0) check_temperature(temperatures[r], r, "token_logprobs");
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t r = 0; r < n; ++r) {
    if (targets[r] < 0) {
      logprobs[r] = Out(0);
      continue;
    }
    logprobs[r] = Out(row_softmax(logits + r * V, static_cast<T*>(nullptr), targets[r], T(temperatures[r]), V).logp);
  }
}

#define SHARDLM_RL_LOSS_INSTANTIATE(T)                                                                    \
  template RlChunkStats rl_loss_forward_backward<T>(T*, const int32_t*, const T*, const RlTokenInputs&,   \
                                                    const RlLossParams&, T, int64_t, int64_t);            \
  template void token_logprobs<T, float>(float*, const T*, const int32_t*, const float*, int64_t, int64_t);

SHARDLM_RL_LOSS_INSTANTIATE(float)
SHARDLM_RL_LOSS_INSTANTIATE(double)
template void token_logprobs<double, double>(double*, const double*, const int32_t*, const float*, int64_t, int64_t);

#undef SHARDLM_RL_LOSS_INSTANTIATE

}  // namespace shardlm::cpu
