// rollout.hpp — `shardlm generate DECK`, the inference ranks of an RL job
// (mpirun -np T shardlm train DECK : -np G shardlm generate DECK).
//
// Owns: the orchestration of one inference rank: the trainers' weights taken
// from the broadcast (WeightReceiver, into an InferenceModel), which prompts
// each step samples and which rank samples them, sampling (generate()),
// rewards and group advantages (reward.hpp) on generator rank 0, the rollout
// file of each step for the trainers (data/rollouts.hpp's write_rollouts,
// with the policy step the samples came from), staying at most
// data.max_async steps ahead of the trainers' weights, and its own metrics
// (<run.dir>/rollouts.jsonl and one line per step). Knows MPI through the
// runtime's communicators; knows nothing of the training state.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/prompts.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "shardlm/config.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {

// The prompt file's prompts sampled at rollout step `step`: prompts_per_step
// of them, in a seeded order that visits every prompt once per pass over the
// file (a new order each pass). A function of (seed, step, sizes) alone.
std::vector<int64_t> prompts_for_step(uint64_t seed, int64_t step, int64_t prompts_per_step, int64_t file_prompts);

// Round `round` of a step under rollout.dynamic_sampling: round 0 is
// prompts_for_step's; each later round draws prompts_per_step prompts from a
// stream of its own per (step, round). The draw keys of a round's prompts are
// round_key_base + item: round 0's are step x prompts_per_step + item (as
// without dynamic sampling), later rounds' are negative and unique per (step,
// round) for round < kMaxDynamicRounds (rollout.dynamic_max_rounds' bound).
constexpr int64_t kMaxDynamicRounds = 1000;
std::vector<int64_t> round_prompts(uint64_t seed, int64_t step, int64_t round, int64_t prompts_per_step,
                                   int64_t file_prompts);
int64_t round_key_base(int64_t step, int64_t round, int64_t prompts_per_step);

class TokenDecoder;

// What a reward sees as the completion's text: decoded when there is a
// tokenizer, else its ids in decimal separated by spaces; a final stop id is
// not part of it (the rollouts' rewards and the evaluation's, infer/eval.hpp).
std::string completion_text(const Completion& c, const TokenDecoder* tokenizer);

// A prompt file against the deck: the answers rollout.reward needs, each
// prompt with its token budget within data.seq_len + 1, stop ids within the
// vocabulary. Throws Error naming the file, its key and the prompt.
struct PromptUse {
  const char* key;          // the deck key that names the file: "rollout.prompts", "eval.prompts"
  const char* budget_key;   // the key of max_new_tokens
  int64_t max_new_tokens;
  const char* judge;        // after the reward's name: "" or ", which judges the evaluation,"
};
void check_prompt_file(const Config& config, const PromptSet& prompts, const ModelConfig& mc, const PromptUse& use);
// rollout.prompts: check_prompt_file with rollout.max_new_tokens.
void check_prompts(const Config& config, const PromptSet& prompts, const ModelConfig& mc);

// The decoder's limits on one of `generators` inference ranks: the file's
// longest prompt + rollout.max_new_tokens positions (checked against the
// model), min(rollout.batch, the rank's share of prompts_per_step x n) slots.
DecoderLimits rollout_decoder_limits(const Config& config, const ModelConfig& mc, const PromptSet& prompts,
                                     int generators);

// Runs the role to the trainers' end; returns their exit code (0, or 75 after
// a stop signal). Throws Error for bad input (the prompt file, a prompt too
// long for data.seq_len, a failing reward program), naming it.
int run_inference_role(const Config& config, Runtime& rt);

}  // namespace shardlm
