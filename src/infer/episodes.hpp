// episodes.hpp — episodes of several turns: what an inference rank tells its
// environment program (infer/env.hpp) after each turn of a generate() call,
// and each finished episode's outcome (docs/rl.md "Environments").
//
// Owns: the turn's message from a completion (the ids drawn since the last
// observation, their text, the prompt's answer and metadata), the end signals
// (rollout.max_turns reached; max_new_tokens reached, told after generate()
// returns), each completion's env_reward, env_metrics and episode_end, and
// the episode metrics of a set of completions. Used by the rollouts and by the
// evaluation (eval.prompts), which share one EnvProgram. Must not know: the
// decoder, MPI, files.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/prompts.hpp"
#include "infer/env.hpp"
#include "infer/generate.hpp"

namespace shardlm {

class TokenDecoder;

class Episodes {
 public:
  // eval: the evaluation's episodes (a request's prompt field is its index in
  // `prompts`); else the rollouts' (a draw key, mapped by begin()).
  Episodes(EnvProgram& env, const PromptSet& prompts, const TokenDecoder* tokenizer, int64_t max_turns, bool eval);

  // The rollouts' request of draw key `key` is prompt `prompt` of the file.
  void begin(int64_t key, int64_t prompt) { key_prompt_[key] = prompt; }
  // GenerateOptions::next_turn: the environment's observation after turn
  // c.turns, or nullopt when it ended the episode.
  std::optional<std::vector<int32_t>> next_turn(const Completion& c);
  // After generate(): each completion's outcome (an episode that ended on the
  // policy's side, by max_new_tokens, is told so first); the draw keys forgotten.
  void finish(std::vector<Completion>& done);

 private:
  EnvTurn turn_of(const Completion& c, const char* end) const;

  EnvProgram& env_;
  const PromptSet& prompts_;
  const TokenDecoder* tokenizer_;
  int64_t max_turns_;
  bool eval_;
  std::map<int64_t, int64_t> key_prompt_;                       // the rollouts' draw keys in flight
  std::map<std::pair<int64_t, int64_t>, EpisodeEnd> told_end_;  // episodes told they ran out of turns
};

// The episodes' numbers, `prefix` before each name: turns_mean,
// observation_tokens_mean, episode_end_{env,max_turns,length} (fractions), and
// env_<name> per name the environment's metrics gave (their mean over the
// episodes; 0 where an episode's had none).
std::vector<std::pair<std::string, double>> episode_metrics(const std::vector<Completion>& completions,
                                                            const std::string& prefix);

}  // namespace shardlm
