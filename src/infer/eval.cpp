// eval.cpp — accuracy on held-out prompts during an RL job; see eval.hpp.
//
// One evaluation, top to bottom (every inference rank, then rank 0):
//   greedy    temperature 0 through generate(), this rank's prompts
//   sampled   eval.samples per prompt at the rollouts' temperature / top-k / top-p, eval_seed
//   gather    both to inference rank 0
//   score     the rollouts' RewardSet; correct = reward > eval.correct_above   (rank 0)
//   log       a row of <run.dir>/eval.jsonl and one line                       (rank 0)
#include "infer/eval.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "base/run_dir.hpp"
#include "data/order.hpp"
#include "infer/command.hpp"
#include "infer/episodes.hpp"
#include "infer/reward.hpp"
#include "infer/rollout.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"  // MPI_CHECK

namespace fs = std::filesystem;

namespace shardlm {

uint64_t eval_seed(uint64_t run_seed) { return data::mix64(run_seed ^ 0x6576616cull); }

PromptSet read_eval_prompts(const Config& config, const ModelConfig& mc) {
  if (config.eval.prompts.empty()) return {};
  PromptSet prompts;
  try {
    prompts = read_prompts(config.eval.prompts, mc.vocab_size);
  } catch (const Error& e) {
    throw Error(std::string("eval.prompts: ") + e.what());
  }
  check_eval_prompts(config, prompts, mc);
  return prompts;
}

void check_eval_prompts(const Config& config, const PromptSet& prompts, const ModelConfig& mc) {
  check_prompt_file(config, prompts, mc,
                    {"eval.prompts", "eval.max_new_tokens", config.eval.max_new_tokens, ", which judges the evaluation,"});
}

namespace {

// This rank's share of the eval prompts: g, g + G, ...
int64_t share_of(int64_t prompts, int rank, int generators) {
  return prompts > rank ? (prompts - rank + generators - 1) / generators : 0;
}

}  // namespace

DecoderLimits with_eval_limits(const Config& config, const ModelConfig& mc, const PromptSet& prompts,
                               int generators, DecoderLimits rollout) {
  if (prompts.path.empty()) return rollout;
  const EvalSection& ev = config.eval;
  std::vector<GenerateRequest> every;
  for (int64_t p = 0; p < prompts.size(); ++p) every.push_back({p, 0, prompts.prompt(p)});
  const DecoderLimits eval = plan_limits(mc, every, ev.batch, ev.max_new_tokens, prompts.path + " (eval.prompts)");
  const int64_t mine = share_of(prompts.size(), 0, generators);  // rank 0 holds the most
  const int64_t slots = std::max<int64_t>(1, std::min(ev.batch, mine * std::max<int64_t>(1, ev.samples)));
  rollout.slots = std::max(rollout.slots, slots);
  rollout.max_len = std::max(rollout.max_len, eval.max_len);
  return rollout;
}

bool eval_due(int64_t last, int64_t policy_step, int64_t interval) {
  if (last < 0) return true;
  return interval > 0 && policy_step > last && policy_step / interval > last / interval;
}

EvalScores eval_scores(const std::vector<double>& greedy, const std::vector<double>& sampled, int64_t k,
                       double correct_above) {
  EvalScores s;
  s.prompts = int64_t(greedy.size());
  s.samples = k;
  SHARDLM_CHECK(int64_t(sampled.size()) == s.prompts * k, "internal: %zu sampled rewards for %lld prompts x %lld",
                sampled.size(), (long long)s.prompts, (long long)k);
  const double P = double(std::max<int64_t>(s.prompts, 1));
  for (double r : greedy) s.correct += r > correct_above, s.reward_mean += r;
  s.accuracy = double(s.correct) / P;
  s.reward_mean /= P;
  if (k == 0) return s;
  int64_t any = 0, right = 0;
  for (int64_t p = 0; p < s.prompts; ++p) {
    int64_t c = 0;
    for (int64_t i = 0; i < k; ++i) c += sampled[size_t(p * k + i)] > correct_above;
    any += c > 0;
    right += c;
  }
  s.pass_at_k = double(any) / P;
  s.pass_at_1 = double(right) / (P * double(k));
  return s;
}

std::string eval_plan_line(const Config& config, const PromptSet& prompts) {
  if (prompts.path.empty()) return "";
  const EvalSection& ev = config.eval;
  const std::string when = ev.interval > 0 ? fmt("every %lld policy steps", (long long)ev.interval) : "";
  return fmt("eval: %lld prompts of %s (%s answers), greedy%s, at most %lld new tokens, on the starting weights%s%s; "
             "correct = reward > %g; rows in %s/eval.jsonl\n",
             (long long)prompts.size(), prompts.path.c_str(), prompts.answers.empty() ? "without" : "with",
             ev.samples > 0 ? fmt(" and pass@%lld (sampled, seed %llu)", (long long)ev.samples,
                                  (unsigned long long)eval_seed(uint64_t(config.run.seed))).c_str() : "",
             (long long)ev.max_new_tokens, when.empty() ? "" : (", then " + when).c_str(),
             ev.at_end ? " and the last ones" : "", ev.correct_above, config.run.dir.c_str());
}

Evaluator::Evaluator(const Config& config, const PromptSet& prompts, Decoder& decoder,
                     const std::vector<int32_t>& eos_ids, MPI_Comm comm, RewardSet* reward,
                     const TokenDecoder* tokenizer, EnvProgram* env)
    : config_(config), prompts_(prompts), decoder_(decoder), comm_(comm), reward_(reward), tokenizer_(tokenizer) {
  MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MPI_CHECK(MPI_Comm_size(comm, &world_));
  if (!enabled()) return;
  if (rank_ == 0) std::printf("%s", eval_plan_line(config, prompts).c_str()), std::fflush(stdout);
  const EvalSection& ev = config.eval;
  const RolloutSection& ro = config.rollout;
  greedy_.sampling = {0.0, 0, 1.0, eval_seed(uint64_t(config.run.seed))};
  greedy_.max_new_tokens = ev.max_new_tokens;
  greedy_.stop_ids = prompts.stop_ids;
  for (int32_t id : eos_ids)
    if (std::find(greedy_.stop_ids.begin(), greedy_.stop_ids.end(), id) == greedy_.stop_ids.end())
      greedy_.stop_ids.push_back(id);
  const int64_t mine = share_of(prompts.size(), rank_, world_);
  greedy_.slots = std::max<int64_t>(1, std::min(ev.batch, mine));
  sampled_ = greedy_;
  sampled_.sampling = {ro.temperature, ro.top_k, ro.top_p, eval_seed(uint64_t(config.run.seed))};
  sampled_.slots = std::max<int64_t>(1, std::min(ev.batch, mine * std::max<int64_t>(1, ev.samples)));
  if (env) {
    episodes_ = std::make_unique<Episodes>(*env, prompts, tokenizer, ro.max_turns, /*eval=*/true);
    for (GenerateOptions* o : {&greedy_, &sampled_})
      o->next_turn = [this](const GenerateRequest&, const Completion& c) { return episodes_->next_turn(c); };
  }
}

Evaluator::~Evaluator() = default;

void Evaluator::open_jsonl(const fs::path& run_dir, int64_t first_step) {
  if (!enabled() || rank_ != 0) return;
  const fs::path path = run_dir / "eval.jsonl";
  keep_jsonl_rows_before(path, first_step);
  jsonl_.open(path, std::ios::app);
  SHARDLM_CHECK(jsonl_.good(), "cannot append to %s", path.c_str());
}

void Evaluator::if_due(int64_t policy_step) {
  if (due(policy_step)) evaluate(policy_step);
}

void Evaluator::at_end(int64_t policy_step, int exit_code) {
  if (enabled() && config_.eval.at_end && exit_code == 0 && policy_step >= 0 && policy_step != last_step_)
    evaluate(policy_step);
}

std::vector<Completion> Evaluator::sample(const GenerateOptions& options, int64_t k) {
  std::vector<GenerateRequest> requests;
  for (int64_t p = rank_; p < prompts_.size(); p += world_)
    for (int64_t s = 0; s < k; ++s) requests.push_back({p, s, prompts_.prompt(p)});
  std::vector<Completion> mine = generate(decoder_, requests, options);
  if (episodes_) episodes_->finish(mine);
  return gather_completions(std::move(mine), comm_);
}

std::vector<double> Evaluator::score(const std::vector<Completion>& completions, int64_t policy_step) {
  std::vector<RewardItem> items;
  for (const Completion& c : completions) {
    RewardItem r;
    r.prompt = c.prompt;
    r.sample = c.sample;
    if (!prompts_.answers.empty()) r.answer = prompts_.answers[size_t(c.prompt)];
    r.text = completion_text(c, tokenizer_);
    const auto ids = prompts_.prompt(c.prompt);
    r.prompt_ids.assign(ids.begin(), ids.end());
    r.completion_ids = c.tokens;
    r.finish = finish_name(c.finish);
    r.env_reward = c.env_reward;
    items.push_back(std::move(r));
  }
  try {
    return reward_->score(items, policy_step).total;
  } catch (const Error& e) {
    throw Error(fmt("evaluating the weights of policy step %lld on eval.prompts '%s': %s", (long long)policy_step,
                    prompts_.path.c_str(), e.what()));
  }
}

void Evaluator::evaluate(int64_t policy_step) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t k = config_.eval.samples;
  const std::vector<Completion> greedy = sample(greedy_, 1);
  const std::vector<Completion> sampled = k > 0 ? sample(sampled_, k) : std::vector<Completion>();
  last_step_ = policy_step;
  ++evaluations_;
  if (rank_ != 0) return;
  const std::vector<double> greedy_rewards = score(greedy, policy_step);
  const std::vector<double> sampled_rewards = k > 0 ? score(sampled, policy_step) : std::vector<double>();
  const EvalScores s = eval_scores(greedy_rewards, sampled_rewards, k, config_.eval.correct_above);
  int64_t tokens = 0;
  for (const Completion& c : greedy) tokens += int64_t(c.tokens.size());
  const double length_mean = double(tokens) / double(std::max<int64_t>(s.prompts, 1));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const std::string sampled_text =
      k > 0 ? fmt(" | pass@%lld %.4f, pass@1 %.4f (sampled)", (long long)k, s.pass_at_k, s.pass_at_1) : "";
  std::printf("eval policy step %lld | accuracy %.4f (greedy, %lld of %lld prompts) | reward %.4f%s | mean length "
              "%.2f | %.2f s\n", (long long)policy_step, s.accuracy, (long long)s.correct, (long long)s.prompts,
              s.reward_mean, sampled_text.c_str(), length_mean, seconds);
  std::fflush(stdout);
  metrics_ = {{"eval_policy_step", double(policy_step)}, {"eval_accuracy", s.accuracy},
              {"eval_reward_mean", s.reward_mean}, {"eval_response_length_mean", length_mean}};
  if (k > 0) metrics_.insert(metrics_.end(), {{"eval_pass_at_k", s.pass_at_k}, {"eval_pass_at_1", s.pass_at_1}});
  // Episodes: their turns, ends and the environment's numbers, of the greedy ones.
  const std::vector<std::pair<std::string, double>> episodes =
      episodes_ ? episode_metrics(greedy, "eval_") : std::vector<std::pair<std::string, double>>();
  metrics_.insert(metrics_.end(), episodes.begin(), episodes.end());
  if (!jsonl_) return;
  std::string row = fmt("{\"step\": %lld, \"eval_policy_step\": %lld, \"eval_prompts\": %lld, \"eval_samples\": %lld, "
                        "\"eval_correct\": %lld, \"eval_accuracy\": %.9g, \"eval_reward_mean\": %.9g",
                        (long long)policy_step, (long long)policy_step, (long long)s.prompts, (long long)k,
                        (long long)s.correct, s.accuracy, s.reward_mean);
  if (k > 0) row += fmt(", \"eval_pass_at_k\": %.9g, \"eval_pass_at_1\": %.9g", s.pass_at_k, s.pass_at_1);
  for (const auto& [name, value] : episodes) row += fmt(", \"%s\": %.9g", name.c_str(), value);
  row += fmt(", \"eval_response_length_mean\": %.9g, \"eval_seconds\": %.6g}\n", length_mean, seconds);
  jsonl_ << row;
  jsonl_.flush();
}

std::vector<std::pair<std::string, double>> Evaluator::take_metrics() { return std::exchange(metrics_, {}); }

}  // namespace shardlm
