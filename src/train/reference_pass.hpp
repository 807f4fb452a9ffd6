// reference_pass.hpp — the RL loss's KL term against the run's starting
// weights (loss.ref_kl_coef > 0): a frozen copy of them, and their logprobs of
// each step's targets.
//
// Owns: ReferencePass, chosen once at start-up: for a loss with the term, the
// frozen reference (this rank's shard of every unit in fp32 host memory,
// copied from the model before the first update and before a checkpoint is
// loaded: model.hf or the seeded init, which every launch builds again, so a
// resumed run has the same reference as the uninterrupted one; a GPU backend
// also keeps it in bf16 device memory, as its own parameters are) and, per step, a forward-only pass of
// the engine on those weights over every micro-batch of the step, whose
// logprobs every update's micro-batches then carry (TokenBatch::ref_logprobs);
// for any other loss, nothing. Knows the Engine, the StepSource and the model's
// shards; not the kernels, the files or the deck.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/loss.hpp"
#include "shardlm/memory.hpp"
#include "train/engine.hpp"
#include "train/shard.hpp"
#include "train/step_source.hpp"

namespace shardlm {

class ReferencePass {
 public:
  virtual ~ReferencePass() = default;
  // After StepSource::begin, before the step's first update: the reference's
  // logprobs of every part's micro-batches (collective over the trainer
  // ranks). The reference never changes, so one pass serves every update of
  // the step. Returns the seconds it took.
  virtual double run(StepSource& source, int64_t step, const StepPlan& plan) = 0;
  // Micro-batch `index` of part `part` with the reference's logprobs filled
  // in; valid until the next run().
  virtual TokenBatch attach(int64_t part, int64_t index, const TokenBatch& micro) const = 0;
};

// The pass for `params`'s loss: with rl and params.ref_kl_coef > 0 the frozen
// copy of `model`'s current shards (call before any update or checkpoint
// load); else one that does nothing.
std::unique_ptr<ReferencePass> make_reference_pass(bool rl, const RlLossParams& params, Engine& engine,
                                                   const ShardedModel& model);
// The host memory the frozen reference takes on this rank (the memory plan's
// row): every unit's shard in fp32; 0 without the term. The logprobs it keeps,
// 4 bytes a token of the rank's share of a step, come on top.
int64_t reference_weights_bytes(const EngineOptions& options, const ModelLayout& layout);
// On a GPU backend, the device memory of its bf16 copy (the plan's "reference
// copies"); 0 on the CPU or without the term.
int64_t reference_copies_bytes(const EngineOptions& options, const ModelLayout& layout, const Backend& backend);

}  // namespace shardlm
