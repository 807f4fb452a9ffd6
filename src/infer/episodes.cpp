// episodes.cpp — episodes against an environment program; see episodes.hpp.
#include "infer/episodes.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "infer/rollout.hpp"  // completion_text
#include "shardlm/error.hpp"

namespace shardlm {

Episodes::Episodes(EnvProgram& env, const PromptSet& prompts, const TokenDecoder* tokenizer, int64_t max_turns,
                   bool eval)
    : env_(env), prompts_(prompts), tokenizer_(tokenizer), max_turns_(max_turns), eval_(eval) {}

EnvTurn Episodes::turn_of(const Completion& c, const char* end) const {
  EnvTurn t;
  t.key = c.prompt, t.sample = c.sample, t.eval = eval_, t.turn = c.turns, t.end = end;
  t.prompt = eval_ ? c.prompt : key_prompt_.at(c.prompt);
  if (!prompts_.answers.empty()) t.answer = prompts_.answers[size_t(t.prompt)];
  if (!prompts_.metadata.empty()) t.metadata = prompts_.metadata[size_t(t.prompt)];
  size_t from = 0;  // the turn: the ids drawn since the last observation
  for (size_t i = c.observed.size(); i > 0; --i)
    if (c.observed[i - 1]) {
      from = i;
      break;
    }
  t.ids.assign(c.tokens.begin() + std::ptrdiff_t(from), c.tokens.end());
  Completion turn_only;
  turn_only.tokens = t.ids;
  t.text = completion_text(turn_only, tokenizer_);
  return t;
}

std::optional<std::vector<int32_t>> Episodes::next_turn(const Completion& c) {
  const bool last = c.turns >= max_turns_;
  std::optional<std::vector<int32_t>> observation = env_.turn(turn_of(c, last ? "max_turns" : nullptr));
  if (!observation && last) told_end_[{c.prompt, c.sample}] = EpisodeEnd::MaxTurns;
  return observation;
}

void Episodes::finish(std::vector<Completion>& done) {
  for (Completion& c : done) {
    c.episode_end = EpisodeEnd::Env;
    if (const auto it = told_end_.find({c.prompt, c.sample}); it != told_end_.end()) {
      c.episode_end = it->second;
      told_end_.erase(it);
    }
    std::optional<EnvOutcome> outcome = env_.outcome_of(eval_, c.prompt, c.sample);
    if (!outcome) {  // the policy ran out of tokens: the environment is told, and must answer with a reward
      env_.turn(turn_of(c, "length"));
      outcome = env_.outcome_of(eval_, c.prompt, c.sample);
      c.episode_end = EpisodeEnd::Length;
    }
    c.env_reward = outcome->reward;
    c.env_metrics = std::move(outcome->metrics);
  }
  for (const Completion& c : done) key_prompt_.erase(c.prompt);  // each key's samples are all here
}

std::vector<std::pair<std::string, double>> episode_metrics(const std::vector<Completion>& completions,
                                                            const std::string& prefix) {
  const double S = double(std::max<size_t>(completions.size(), 1));
  double turns = 0, observed = 0, ended[3] = {0, 0, 0};
  std::map<std::string, double> sums;  // the environment's metrics, by name
  for (const Completion& c : completions) {
    turns += double(c.turns);
    for (uint8_t o : c.observed) observed += o;
    ended[size_t(c.episode_end)] += 1;
    if (c.env_metrics.empty()) continue;
    const nlohmann::json numbers = nlohmann::json::parse(c.env_metrics);
    for (const auto& [name, value] : numbers.items()) sums[name] += value.get<double>();
  }
  std::vector<std::pair<std::string, double>> m = {
      {prefix + "turns_mean", turns / S},
      {prefix + "observation_tokens_mean", observed / S},
      {prefix + "episode_end_env", ended[size_t(EpisodeEnd::Env)] / S},
      {prefix + "episode_end_max_turns", ended[size_t(EpisodeEnd::MaxTurns)] / S},
      {prefix + "episode_end_length", ended[size_t(EpisodeEnd::Length)] / S}};
  for (const auto& [name, sum] : sums) m.push_back({prefix + "env_" + name, sum / S});
  return m;
}

}  // namespace shardlm
