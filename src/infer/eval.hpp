// eval.hpp — accuracy on held-out prompts during an RL job (the deck's
// eval.prompts), measured by the inference ranks on the weights they hold.
//
// Owns: the eval prompt file's checks against the deck, the decoder limits it
// adds to the rollouts', which weights are due (the starting weights, the
// first weights at or past each multiple of eval.interval, the last ones at
// the trainers' end with eval.at_end), the prompts' split over the inference
// ranks (rank g: prompts g, g + G, ...), greedy and sampled completions
// through generate() (which answers the trainers' queries each decode step,
// so their waits see this rank busy), scoring with the rollouts' RewardSet on
// inference rank 0, and the metrics: <run.dir>/eval.jsonl and one line each.
// Must not know: the broadcast, the training state, rollout files.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/prompts.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "shardlm/config.hpp"

namespace shardlm {

class EnvProgram;
class Episodes;
class RewardSet;
class TokenDecoder;

// The seed of the sampled (pass@k) completions: splitmix64 of run.seed ^
// 0x6576616c ("eval"), a stream apart from the rollouts' (which draw with
// run.seed itself), the same at every evaluation. Sample s of eval prompt p,
// token t is drawn with DrawKey (p, s, t) under it, as `shardlm generate
// --seed <this> --n <eval.samples>` draws.
uint64_t eval_seed(uint64_t run_seed);

// eval.prompts read (its errors name the key) and checked against the deck as
// the rollouts' prompts are: answers for a reward that compares with one,
// each prompt with eval.max_new_tokens within data.seq_len + 1, stop ids
// within the vocabulary. An empty set when eval.prompts is not set.
PromptSet read_eval_prompts(const Config& config, const ModelConfig& mc);
void check_eval_prompts(const Config& config, const PromptSet& prompts, const ModelConfig& mc);

// The decoder limits an inference rank (one of `generators`) needs for its
// rollouts, `rollout`, and for this evaluation together: the most slots and
// positions of the two (the evaluation's slots: min(eval.batch, its share of
// the prompts x max(1, eval.samples)); its positions: the file's longest
// prompt, then eval.max_new_tokens). `rollout` itself when there is no eval.
DecoderLimits with_eval_limits(const Config& config, const ModelConfig& mc, const PromptSet& prompts,
                               int generators, DecoderLimits rollout);

// Whether the weights of `policy_step` are due, the weights of `last` (-1:
// none) evaluated last: the first weights held, then the first at or past each
// multiple of `interval` (0: none). With the broadcast's interval dividing
// eval.interval these are exactly the multiples; otherwise (or when the
// filesystem broadcast skips a step) the first weights past one.
bool eval_due(int64_t last, int64_t policy_step, int64_t interval);

// The numbers of one evaluation, from the rewards of P prompts' greedy
// completions (P) and sampled ones (P x k, prompt by prompt). A completion is
// correct when its reward > correct_above.
struct EvalScores {
  int64_t prompts = 0, samples = 0;  // P, k
  int64_t correct = 0;               // prompts whose greedy completion is correct
  double accuracy = 0;               // correct / P
  double reward_mean = 0;            // of the greedy completions
  double pass_at_k = 0;              // prompts with a correct sample among their k / P (k > 0)
  double pass_at_1 = 0;              // correct samples / (P k): pass@1 estimated from k samples (k > 0)
};
EvalScores eval_scores(const std::vector<double>& greedy, const std::vector<double>& sampled, int64_t k,
                       double correct_above);

// One line of what the inference ranks evaluate, when and where the rows go
// (their start-up line and `shardlm check`'s); "" without eval.prompts.
std::string eval_plan_line(const Config& config, const PromptSet& prompts);

// The evaluation of one inference rank. Every call is collective over the
// inference ranks (all hold the same weights); with no eval.prompts they do nothing.
class Evaluator {
 public:
  // reward, tokenizer: inference rank 0's (the rollouts'); others pass nullptr.
  // eos_ids: the model's, stop ids beside the prompt file's. env: this rank's
  // environment program (RL with env.program; nullptr without): each prompt
  // is then an episode of several turns, as the rollouts' are.
  Evaluator(const Config& config, const PromptSet& prompts, Decoder& decoder, const std::vector<int32_t>& eos_ids,
            MPI_Comm comm, RewardSet* reward, const TokenDecoder* tokenizer, EnvProgram* env = nullptr);
  ~Evaluator();
  bool enabled() const { return !prompts_.path.empty(); }
  // Rank 0: <run.dir>/eval.jsonl, its rows of policy steps >= first_step dropped (an earlier launch's).
  void open_jsonl(const std::filesystem::path& run_dir, int64_t first_step);
  // The weights of `policy_step` are held: evaluated if due (the first held,
  // or the first at or past a multiple of eval.interval not yet evaluated).
  void if_due(int64_t policy_step);
  bool due(int64_t policy_step) const {
    return enabled() && policy_step >= 0 && eval_due(last_step_, policy_step, config_.eval.interval);
  }
  // The trainers ended with `exit_code`: the last weights, unless evaluated
  // already, when eval.at_end and the run ended normally (0).
  void at_end(int64_t policy_step, int exit_code);
  int64_t evaluations() const { return evaluations_; }
  // Rank 0: the numbers of the evaluations since the last call, the latest's
  // (eval_policy_step, eval_accuracy, ...; empty when none ran), for the next
  // rollout file's metrics: the trainers log them beside the training reward.
  std::vector<std::pair<std::string, double>> take_metrics();

 private:
  void evaluate(int64_t policy_step);
  std::vector<Completion> sample(const GenerateOptions& options, int64_t k);  // gathered on rank 0
  std::vector<double> score(const std::vector<Completion>& completions, int64_t policy_step);  // rank 0

  const Config& config_;
  const PromptSet& prompts_;
  Decoder& decoder_;
  MPI_Comm comm_;
  int rank_ = 0, world_ = 1;
  RewardSet* reward_;
  const TokenDecoder* tokenizer_;
  GenerateOptions greedy_, sampled_;
  std::unique_ptr<Episodes> episodes_;  // with an environment
  int64_t last_step_ = -1;  // the policy step evaluated last (-1: none)
  int64_t evaluations_ = 0;
  std::vector<std::pair<std::string, double>> metrics_;  // the latest evaluation's, until taken
  std::ofstream jsonl_;
};

}  // namespace shardlm
