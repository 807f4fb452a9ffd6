// reward.hpp — scoring completions for RL: the built-in verifiers (exact match
// of an extracted final answer, numeric equality, a regex) and an external
// reward program; group-normalised advantages.
//
// Owns: RewardItem (what a reward sees of one completion), the verifiers and
// their answer extraction, running a reward program (completions as JSONL on
// its stdin, one reward per line on its stdout, bounded by a timeout), and
// group_advantages, and RewardSet: the deck's weighted sum of components with
// each component's scores kept for the metrics. Chosen once from the deck's
// [rollout] section (make_reward, RewardSet). Must not know: the model, MPI, files other than the program's
// pipes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/config.hpp"

namespace shardlm {

struct RewardItem {
  int64_t prompt = 0;                  // index in the prompt file
  int64_t sample = 0;                  // 0 .. n-1
  std::string answer;                  // the prompt's reference answer ("" when the file has none)
  std::string text;                    // the completion: decoded text, or its ids in decimal separated by
                                       //   spaces when there is no tokenizer; a final stop id left out
  std::vector<int32_t> prompt_ids, completion_ids;  // completion_ids with the stop id, as sampled
  const char* finish = "length";       // "stop" | "length"
  double env_reward = 0;               // the environment's (env.program), for the "env" component
};

class Reward {
 public:
  virtual ~Reward() = default;
  // One reward per item, in order. `step` names the rollout step in errors.
  // Throws Error naming the program when it fails, hangs past the timeout or
  // answers with other than one number per completion.
  virtual std::vector<double> score(const std::vector<RewardItem>& items, int64_t step) = 0;
  virtual std::string name() const = 0;  // "exact", "numeric", "regex /x/", "program 'cmd'"
};

// One component: kind = "exact" | "numeric" | "regex" | "program" (its
// settings from rollout.reward_regex / reward_program / reward_timeout_s).
std::unique_ptr<Reward> make_reward(const std::string& kind, const RolloutSection& rollout);

// rollout.reward's components with rollout.reward_weights (1 each when not
// given): a completion's reward is the weighted sum of its components' scores.
// A one-component deck with no weights scores exactly as that component.
class RewardSet {
 public:
  explicit RewardSet(const RolloutSection& rollout);
  struct Scores {
    std::vector<double> total;                   // (S) the weighted sum: what the advantages see
    std::vector<std::vector<double>> component;  // (C, S) each component's own score, unweighted
  };
  Scores score(const std::vector<RewardItem>& items, int64_t step);
  size_t size() const { return components_.size(); }
  const std::string& kind(size_t c) const { return kinds_[c]; }  // "exact", ...: the metrics' key
  double weight(size_t c) const { return weights_[c]; }
  // "exact", or "1*exact + 0.2*regex /<\/answer>$/" for a weighted sum.
  std::string name() const;

 private:
  std::vector<std::string> kinds_;
  std::vector<double> weights_;
  std::vector<std::unique_ptr<Reward>> components_;
};

// The final answer of a completion: the last \boxed{...}, else what follows the
// last "####", else the last whitespace-separated word; trimmed.
std::string extract_answer(const std::string& text);
// The last number in the text (commas between digits ignored), if any.
bool extract_number(const std::string& text, double* value);

// Advantages of rewards in P groups of n consecutive samples (the prompts'),
// by rollout.advantage (population stds; a group whose rewards are all equal
// gets 0 under each):
//   "mean_std"   A = (r - mean(group)) / (std(group) + 1e-6)   (GRPO)
//   "mean"       A = r - mean(group)                            (Dr. GRPO)
//   "rloo"       A = r - mean of the group's other n - 1 rewards (RLOO's
//                leave-one-out baseline; = n / (n - 1) (r - mean(group)))
//   "batch_std"  A = (r - mean(group)) / (std of all the step's rewards + 1e-6)
// Throws for another kind, or rewards that are not whole groups.
std::vector<float> group_advantages(const std::vector<double>& rewards, int64_t n, const std::string& kind);

// `/bin/sh -c command` in a process group of its own (so the stop signals
// sent to the rank's group are the job's, not the program's), the signals a
// rank ignores or handles back at their defaults, none blocked; its stdin and
// stdout are pipes whose other ends come back in *in_fd (write to it) and
// *out_fd (read from it), its stderr is ours. Throws Error naming `where` when
// it cannot start. Shared by the reward program and the environment program.
pid_t spawn_shell(const std::string& command, const std::string& where, int* in_fd, int* out_fd);

}  // namespace shardlm
