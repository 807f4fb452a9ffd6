// sequence_pass.cpp — the RL loss's sums over whole samples; see
// src/train/sequence_pass.hpp.
#include "train/sequence_pass.hpp"

#include <algorithm>
#include <chrono>

#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {

void SampleSums::reset(int64_t samples) {
  SHARDLM_CHECK(samples >= 0, "internal: %lld samples", (long long)samples);
  samples_ = samples;
  sums_.assign(size_t(3 * samples), 0.0);
}

template <class T>
void SampleSums::add(const TokenBatch& b, const T* logprobs) {
  SHARDLM_CHECK(b.N == 0 || (b.sample_ids && b.targets && b.weights && b.inference_logprobs),
                "internal: sample sums of a micro-batch without sample ids, targets, weights or logprobs");
  double* log_ratio = sums_.data();
  double* log_is = log_ratio + samples_;
  double* tokens = log_is + samples_;
  for (int64_t t = 0; t < b.N; ++t) {
    if (b.targets[t] < 0 || !(b.weights[t] > 0.0f)) continue;
    const int32_t s = b.sample_ids[t];
    SHARDLM_CHECK(s >= 0 && s < samples_, "internal: sample id %d of a loss token outside [0, %lld)", s,
                  (long long)samples_);
    const double logp = double(logprobs[t]);
    const double lp_sampling = b.sampling_logprobs ? b.sampling_logprobs[t] : b.inference_logprobs[t];
    log_ratio[s] += logp - double(b.inference_logprobs[t]);
    log_is[s] += logp - lp_sampling;
    tokens[s] += 1.0;
  }
}

void SampleSums::expand(const TokenBatch& b, double* sequence_log_ratio, double* sequence_log_is) const {
  const double* log_ratio = sums_.data();
  const double* log_is = log_ratio + samples_;
  const double* tokens = log_is + samples_;
  for (int64_t t = 0; t < b.N; ++t) {
    const bool loss_token = b.targets[t] >= 0 && b.weights[t] > 0.0f;
    const int32_t s = loss_token ? b.sample_ids[t] : -1;
    // A loss token's sample has at least that token: tokens[s] >= 1.
    sequence_log_ratio[t] = s >= 0 ? log_ratio[s] / tokens[s] : 0.0;
    sequence_log_is[t] = s >= 0 ? log_is[s] : 0.0;
  }
}

template void SampleSums::add<float>(const TokenBatch&, const float*);
template void SampleSums::add<double>(const TokenBatch&, const double*);

namespace {

using Clock = std::chrono::steady_clock;

// A loss whose terms are all per token: nothing to do.
class NoSequencePass final : public SequencePass {
 public:
  double run(StepSource&, int64_t, int64_t, const UpdatePlan&) override { return 0.0; }
  TokenBatch attach(const TokenBatch& micro) override { return micro; }
};

class ForwardSequencePass final : public SequencePass {
 public:
  ForwardSequencePass(Engine& engine, Comm& comm, int64_t max_tokens)
      : engine_(engine), comm_(comm), logprobs_(Mem::Workspace, max_tokens), log_ratio_(Mem::Workspace, max_tokens),
        log_is_(Mem::Workspace, max_tokens) {}

  // The same micro-batches the step trains on, forward only, at the weights it
  // trains: each sample's sums are those of the logprobs the loss then forms
  // (up to the backend's rounding), as the stop-gradient quantities of GSPO and
  // sequence-level importance sampling are. Each loss token is on exactly one
  // rank (whole samples per data-parallel group, disjoint shares within a
  // context-parallel group), so one sum over all ranks completes every sample.
  double run(StepSource& source, int64_t step, int64_t part, const UpdatePlan& plan) override {
    const auto t0 = Clock::now();
    sums_.reset(plan.samples);
    for (int64_t a = 0; a < plan.micro_batches; ++a) {
      const TokenBatch micro = source.micro_batch(step, part, a);
      SHARDLM_CHECK(micro.N <= logprobs_.size(), "internal: a micro-batch of %lld tokens, planned %lld",
                    (long long)micro.N, (long long)logprobs_.size());
      engine_.forward_token_logprobs(micro, logprobs_.data());
      sums_.add(micro, logprobs_.data());
    }
    comm_.all_reduce_sum(sums_.data(), sums_.size());
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  TokenBatch attach(const TokenBatch& micro) override {
    TokenBatch b = micro;
    sums_.expand(b, log_ratio_.data(), log_is_.data());
    b.sequence_log_ratio = log_ratio_.data();
    b.sequence_log_is = log_is_.data();
    return b;
  }

 private:
  Engine& engine_;
  Comm& comm_;
  SampleSums sums_;
  Buffer<float> logprobs_;              // (max_tokens) one micro-batch's
  Buffer<double> log_ratio_, log_is_;   // (max_tokens) the micro-batch being trained
};

}  // namespace

int64_t sequence_pass_bytes(const EngineOptions& o) {
  if (!o.rl || !o.rl_params.needs_sequence_terms()) return 0;
  return o.max_tokens * int64_t(sizeof(float) + 2 * sizeof(double));
}

std::unique_ptr<SequencePass> make_sequence_pass(bool rl, const RlLossParams& params, Engine& engine, Comm& comm,
                                                 int64_t max_tokens) {
  if (!rl || !params.needs_sequence_terms()) return std::make_unique<NoSequencePass>();
  return std::make_unique<ForwardSequencePass>(engine, comm, max_tokens);
}

}  // namespace shardlm
