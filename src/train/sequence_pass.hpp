// sequence_pass.hpp — the RL loss's sums over whole samples, known before the
// step's backward: GSPO's sequence ratio and sequence-level importance weights
// need every loss token of a sample, which micro-batches, ranks and
// context-parallel shares split between them.
//
// Owns: SampleSums (per-sample sums of per-token log-ratios, and their
// expansion back to per-token arrays: plain functions of the arrays, tested
// against a numpy reference in tests/unit/test_rl_objectives.cpp) and
// SequencePass, chosen once at start-up: for a loss that needs the sums
// (RlLossParams::needs_sequence_terms), a forward-only pass over the step's
// micro-batches (each position's logprob, summed per sample, one all-reduce
// over the trainer ranks) before the training micro-batches, which then carry
// their tokens' sample sums; for any other loss, nothing. Knows the Engine, the
// StepSource and the trainer ranks' Comm; not the backend's kernels, files or
// the deck.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/loss.hpp"
#include "train/engine.hpp"
#include "train/step_source.hpp"

namespace shardlm {

// Sums over each sample's loss tokens (target >= 0, weight > 0), samples
// indexed as in the step's file (TokenBatch::sample_ids).
class SampleSums {
 public:
  // Zeroes the sums of `samples` samples (keeps the memory of earlier steps).
  void reset(int64_t samples);
  // Adds micro-batch b's loss tokens: logprobs (b.N) are the trainer's logp of
  // each target; logp - lp_inf and logp - lp_sampling are summed per sample.
  template <class T>
  void add(const TokenBatch& b, const T* logprobs);
  // The sums as one array (3 x samples doubles) for an all-reduce.
  double* data() { return sums_.data(); }
  int64_t size() const { return int64_t(sums_.size()); }
  // Per token of b (0 where b has no loss token): its sample's mean of
  // logp - lp_inf over the sample's loss tokens (GSPO's log s_i), and its sum of
  // logp - lp_sampling (the log of the sequence-level importance ratio).
  void expand(const TokenBatch& b, double* sequence_log_ratio, double* sequence_log_is) const;

 private:
  int64_t samples_ = 0;
  std::vector<double> sums_;  // [0, S): sum log r; [S, 2S): sum log rho; [2S, 3S): loss tokens
};

class SequencePass {
 public:
  virtual ~SequencePass() = default;
  // After TrainingState::begin_step, before an update's first training
  // micro-batch: the pass over the micro-batches of the step's part `part`
  // (collective over the trainer ranks), at the weights the update trains:
  // every update of a step runs it again. Returns the seconds it took.
  virtual double run(StepSource& source, int64_t step, int64_t part, const UpdatePlan& plan) = 0;
  // A micro-batch of the step with its sample sums filled in; the arrays are
  // valid until the next call.
  virtual TokenBatch attach(const TokenBatch& micro) = 0;
};

// The pass for `params`'s loss; `rl` false or a loss without sample sums: one
// that does nothing. max_tokens: the most tokens of a micro-batch (this rank's).
std::unique_ptr<SequencePass> make_sequence_pass(bool rl, const RlLossParams& params, Engine& engine, Comm& comm,
                                                 int64_t max_tokens);
// The host memory the pass for `options` allocates (Mem::Workspace; the memory
// plan's row): a micro-batch's logprobs and its two arrays of sample sums.
// The sums themselves, 3 doubles a sample of the step's file, come on top.
int64_t sequence_pass_bytes(const EngineOptions& options);

}  // namespace shardlm
