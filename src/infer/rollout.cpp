// rollout.cpp — the inference role of an RL job; see rollout.hpp.
//
// One rollout step, top to bottom:
//   weights   take broadcasts until the policy is at least step - data.max_async
//   prompts   prompts_for_step; generator rank g samples items g, g + G, ...
//   sample    generate() with continuous batching, n samples per prompt
//   gather    every completion to generator rank 0
//   score     rewards, group advantages                      (rank 0)
//   publish   <data.rollout_dir>/step_<N>.h5, a metrics line (rank 0)
#include "infer/rollout.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/run_dir.hpp"
#include "broadcast/broadcast.hpp"
#include "data/prompts.hpp"
#include "data/rollouts.hpp"
#include "data/tokenizer.hpp"
#include "infer/command.hpp"
#include "infer/env.hpp"
#include "infer/episodes.hpp"
#include "infer/eval.hpp"
#include "infer/generate.hpp"
#include "infer/model.hpp"
#include "infer/reward.hpp"
#include "train/train.hpp"  // model_config_for

namespace fs = std::filesystem;

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string completion_text(const Completion& c, const TokenDecoder* tokenizer) {
  std::vector<int32_t> ids(c.tokens.begin(), c.tokens.end());
  if (c.finish == Finish::Stop && !ids.empty()) ids.pop_back();
  if (tokenizer) {
    std::vector<int32_t> known;  // a model's vocabulary may be padded past its tokenizer's
    for (int32_t id : ids)
      if (id < tokenizer->vocab_size()) known.push_back(id);
    return tokenizer->text(known, /*skip_special=*/false);
  }
  std::string text;
  for (int32_t id : ids) text += (text.empty() ? "" : " ") + std::to_string(id);
  return text;
}

namespace {

// What a rollout step measured, as the rollout file's group 'metrics' carries
// it (the trainers log it with the step that trains on the file, prefixed
// "rollout_"; docs/metrics.md) and <run.dir>/rollouts.jsonl repeats it.
std::vector<std::pair<std::string, double>> rollout_metrics(const RewardSet::Scores& scores, const RewardSet& reward,
                                                            const std::vector<Completion>& completions,
                                                            double sample_s, double score_s, double wait_s) {
  const std::vector<double>& r = scores.total;
  const double S = double(std::max<size_t>(r.size(), 1));
  double mean = 0, positive = 0;
  for (double v : r) mean += v, positive += v > 0;
  mean /= S;
  double var = 0;
  for (double v : r) var += (v - mean) * (v - mean);
  int64_t generated = 0, longest = 0, stopped = 0;
  for (const Completion& c : completions) {
    generated += int64_t(c.tokens.size());
    longest = std::max<int64_t>(longest, int64_t(c.tokens.size()));
    stopped += c.finish == Finish::Stop;
  }
  std::vector<std::pair<std::string, double>> m = {
      {"reward_mean", mean},
      {"reward_std", std::sqrt(var / S)},
      {"reward_positive", positive / S},
  };
  for (size_t c = 0; c < reward.size(); ++c) {  // each component's own mean, unweighted
    double sum = 0;
    for (double v : scores.component[c]) sum += v;
    m.push_back({"reward_" + reward.kind(c), sum / S});
  }
  m.insert(m.end(), {{"response_length_mean", double(generated) / S},
                     {"response_length_max", double(longest)},
                     {"stopped_fraction", double(stopped) / S},
                     {"generated_tokens", double(generated)},
                     {"sampling_s", sample_s},
                     {"sampling_tokens_per_s", sample_s > 0 ? double(generated) / sample_s : 0.0},
                     {"reward_s", score_s},
                     {"weights_wait_s", wait_s}});
  return m;
}

// Generator rank 0: rewards, advantages, the rollout file and the metrics of one step.
struct Publisher {
  const Config& config;
  const PromptSet& prompts;
  const TokenDecoder* tokenizer;
  RewardSet& reward;
  uint64_t job_id;  // stamped on every rollout file: the trainers of this job take only these
  std::ofstream jsonl;  // <run.dir>/rollouts.jsonl, opened at the first step (open_jsonl)

  // Rows of steps before first_step are kept; those at or past it are an
  // earlier launch's timeline that this one rewrites (a resume, or a new run in
  // the same run.dir from step 0), as metrics.jsonl drops them.
  void open_jsonl(const fs::path& path, int64_t first_step) {
    keep_jsonl_rows_before(path, first_step);
    jsonl.open(path, std::ios::app);
  }

  // What rank 0 keeps of a step's rounds (one round unless rollout.dynamic_sampling).
  struct Kept {
    std::vector<Completion> completions;  // groups of n, in the order kept
    std::vector<int64_t> prompts;         // each completion's prompt (file index)
    std::vector<double> rewards;          // each completion's reward
    RewardSet::Scores scores;             // every sample of every round, for the metrics
    std::vector<Completion> sampled;      // every round's completions (the metrics' lengths)
    int64_t rounds = 0, dropped_groups = 0;
    double score_s = 0, overlong_penalty = 0;
    double env_s = 0;                     // rank 0's time in its environment program
  } kept;

  void begin_step() { kept = Kept{}; }
  void add_env_seconds(double s) { kept.env_s += s; }

  // DAPO's soft overlong penalty (arXiv:2503.14476, eq. 13): 0 up to the last
  // `window` tokens of the budget, then falling linearly to -1 at its end.
  double overlong_penalty(int64_t length) const {
    const int64_t budget = config.rollout.max_new_tokens;
    const int64_t window = config.rollout.overlong_window > 0 ? config.rollout.overlong_window
                                                              : std::max<int64_t>(1, budget / 5);
    return length <= budget - window ? 0.0 : double(budget - window - length) / double(window);
  }

  // One round's completions of `items` (draw keys key_base + item), gathered:
  // scored, and their groups kept (with dynamic sampling only those whose
  // rewards differ, up to prompts_per_step). Returns whether the step needs
  // another round.
  bool add_round(int64_t step, const std::vector<int64_t>& items, int64_t key_base,
                 std::vector<Completion> completions) {
    const RolloutSection& ro = config.rollout;
    std::vector<RewardItem> scored;
    for (const Completion& c : completions) {
      RewardItem r;
      r.prompt = items[size_t(c.prompt - key_base)];
      r.sample = c.sample;
      if (!prompts.answers.empty()) r.answer = prompts.answers[size_t(r.prompt)];
      r.text = completion_text(c, tokenizer);
      const auto ids = prompts.prompt(r.prompt);
      r.prompt_ids.assign(ids.begin(), ids.end());
      r.completion_ids = c.tokens;
      r.finish = finish_name(c.finish);
      r.env_reward = c.env_reward;
      scored.push_back(std::move(r));
    }
    const auto t_score = Clock::now();
    RewardSet::Scores scores = reward.score(scored, step);
    if (ro.truncated == "penalty")
      for (size_t i = 0; i < completions.size(); ++i) {
        const double penalty = overlong_penalty(int64_t(completions[i].tokens.size()));
        scores.total[i] += penalty;
        kept.overlong_penalty += penalty;
      }
    kept.score_s += seconds_since(t_score);
    ++kept.rounds;
    // Completions come sorted by prompt, then sample: group g is [g n, (g + 1) n).
    const size_t n = size_t(ro.n);
    for (size_t g = 0; g * n < completions.size(); ++g) {
      const auto first = scores.total.begin() + std::ptrdiff_t(g * n);
      const bool informative = std::any_of(first, first + std::ptrdiff_t(n), [&](double r) { return r != *first; });
      const bool room = !ro.dynamic_sampling || int64_t(kept.prompts.size() / n) < ro.prompts_per_step;
      if (ro.dynamic_sampling && (!informative || !room)) {
        kept.dropped_groups += !informative;
        continue;
      }
      for (size_t i = g * n; i < (g + 1) * n; ++i) {
        kept.completions.push_back(completions[i]);
        kept.prompts.push_back(scored[i].prompt);
        kept.rewards.push_back(scores.total[i]);
      }
    }
    kept.scores.total.insert(kept.scores.total.end(), scores.total.begin(), scores.total.end());
    kept.scores.component.resize(scores.component.size());
    for (size_t c = 0; c < scores.component.size(); ++c)
      kept.scores.component[c].insert(kept.scores.component[c].end(), scores.component[c].begin(),
                                      scores.component[c].end());
    for (Completion& c : completions) kept.sampled.push_back(std::move(c));
    return ro.dynamic_sampling && int64_t(kept.prompts.size() / n) < ro.prompts_per_step &&
           kept.rounds < ro.dynamic_max_rounds;
  }

  // The step's rollout file from what was kept, its metrics and log lines.
  // policy_step: the weights held when the step began (the file names its oldest sample's); in_flight: weights
  // taken while it was sampled; step_s: its wall time, waits included.
  // evaluated: the latest evaluation's numbers (Evaluator::take_metrics), carried with the step's.
  // started_ahead: rank 0's samples of the step begun while the step before was sampled (continuous rollouts).
  void publish(int64_t step, int64_t policy_step, double sample_s, double wait_s, int64_t in_flight, double step_s,
               std::vector<std::pair<std::string, double>> evaluated, double started_ahead) {
    const RolloutSection& ro = config.rollout;
    SHARDLM_CHECK(!kept.completions.empty(),
                  "rollout step %lld: no group of samples with differing rewards in %lld rounds of %lld prompts "
                  "(rollout.dynamic_sampling drops groups whose rewards are all equal): every group scored the "
                  "same, so the step has nothing to train; the task is too easy or too hard for the policy, or "
                  "rollout.dynamic_max_rounds too low", (long long)step, (long long)kept.rounds,
                  (long long)ro.prompts_per_step);
    const std::vector<Completion>& completions = kept.completions;
    const std::vector<double>& rewards = kept.rewards;
    const std::vector<float> advantages = group_advantages(rewards, ro.n, ro.advantage);
    // The file's policy step is its oldest sample's first token's; how old each
    // sample's oldest token is when this step trains on it, counted.
    std::vector<double> staleness(size_t(std::max<int64_t>(config.data.max_async, 0) + 1), 0.0);
    int64_t oldest = INT64_MAX;
    for (const Completion& c : completions)
      if (c.policy_first >= 0) oldest = std::min(oldest, c.policy_first);
    if (oldest != INT64_MAX) policy_step = oldest;
    for (const Completion& c : completions) {
      const int64_t age = step - (c.policy_first >= 0 ? c.policy_first : policy_step);
      staleness[size_t(std::clamp<int64_t>(age, 0, int64_t(staleness.size()) - 1))] += 1;
    }

    RolloutFile f;
    f.step = step;
    f.policy_step = policy_step;
    f.job_id = job_id;
    f.offsets.push_back(0);
    int64_t generated = 0, stopped = 0;
    for (size_t i = 0; i < completions.size(); ++i) {
      const Completion& c = completions[i];
      const auto prompt = prompts.prompt(kept.prompts[i]);
      // rollout.truncated = "mask": a completion cut at max_new_tokens carries no loss.
      const uint8_t trains = ro.truncated == "mask" && c.finish == Finish::Length ? 0 : 1;
      f.tokens.insert(f.tokens.end(), prompt.begin(), prompt.end());
      f.tokens.insert(f.tokens.end(), c.tokens.begin(), c.tokens.end());
      f.loss_mask.insert(f.loss_mask.end(), prompt.size(), 0);
      f.loss_mask.insert(f.loss_mask.end(), c.tokens.size(), trains);
      // An environment's observations are context, not the policy's: no loss on them.
      for (size_t t = 0; t < c.observed.size(); ++t)
        if (c.observed[t]) f.loss_mask[f.loss_mask.size() - c.tokens.size() + t] = 0;
      // Two logprobs per token (docs/rollouts.md): under the temperature-scaled
      // full softmax, what the trainer's ratio compares with (it divides its
      // logits by the same temperature), and under the distribution the token
      // was drawn from (top-k, top-p truncated), for importance weights.
      f.inference_logprobs.insert(f.inference_logprobs.end(), prompt.size(), 0.0f);
      f.inference_logprobs.insert(f.inference_logprobs.end(), c.tempered_logprobs.begin(), c.tempered_logprobs.end());
      f.sampling_logprobs.insert(f.sampling_logprobs.end(), prompt.size(), 0.0f);
      f.sampling_logprobs.insert(f.sampling_logprobs.end(), c.sampling_logprobs.begin(), c.sampling_logprobs.end());
      if (config.loss.router_replay) {  // prompt and completion, recorded as they were fed
        const size_t positions = prompt.size() + c.tokens.size();
        const int64_t width = int64_t(c.routes.size() / positions);
        SHARDLM_CHECK(width > 0 && c.routes.size() == positions * size_t(width) && (i == 0 || width == f.route_width),
                      "internal: prompt %lld sample %lld has %zu route entries for %zu tokens", (long long)c.prompt,
                      (long long)c.sample, c.routes.size(), positions);
        f.routes.insert(f.routes.end(), c.routes.begin(), c.routes.end());
        f.route_width = width;
      }
      f.offsets.push_back(int64_t(f.tokens.size()));
      f.advantages.push_back(advantages[i]);
      f.temperature.push_back(float(ro.temperature));
      generated += int64_t(c.tokens.size());
      stopped += c.finish == Finish::Stop;
    }
    std::vector<std::pair<std::string, double>> metrics =
        rollout_metrics(kept.scores, reward, kept.sampled, sample_s, kept.score_s, wait_s);
    if (ro.dynamic_sampling)
      metrics.insert(metrics.end(), {{"dynamic_rounds", double(kept.rounds)},
                                     {"dynamic_dropped_groups", double(kept.dropped_groups)},
                                     {"dynamic_groups", double(completions.size() / size_t(ro.n))}});
    for (size_t k = 0; k < staleness.size(); ++k)
      metrics.push_back({"staleness_" + std::to_string(k), staleness[k] / double(completions.size())});
    metrics.push_back({"in_flight_updates", double(in_flight)});
    if (!config.env.program.empty()) {  // episodes of several turns
      const auto episodes = episode_metrics(kept.sampled, "");
      metrics.insert(metrics.end(), episodes.begin(), episodes.end());
      metrics.push_back({"env_s", kept.env_s});  // rank 0's wait for its environment while the step was sampled
    }
    if (ro.in_flight_updates)
      metrics.push_back({"started_ahead_fraction", started_ahead / double(std::max<size_t>(kept.sampled.size(), 1))});
    metrics.push_back({"sampler_wait_fraction", step_s > 0 ? wait_s / step_s : 0.0});
    metrics.insert(metrics.end(), evaluated.begin(), evaluated.end());
    if (ro.truncated == "penalty")
      metrics.push_back({"overlong_penalty_mean", kept.overlong_penalty / double(std::max<size_t>(kept.sampled.size(), 1))});
    f.rewards = rewards;
    f.metrics = metrics;
    write_rollouts(config.data.rollout_dir, f);

    const auto metric = [&](const std::string& name) {
      for (const auto& [key, v] : metrics)
        if (key == name) return v;
      return 0.0;
    };
    const double S = double(std::max<size_t>(rewards.size(), 1));
    std::printf("rollout %6lld | policy step %lld | reward %.4f (%s), > 0 on %.3f | %zu samples, mean length %.2f, "
                "%.3f stopped | %.0f tok/s sampling | waited %.2f s for weights\n",
                (long long)step, (long long)policy_step, metric("reward_mean"), reward.name().c_str(),
                metric("reward_positive"), rewards.size(), double(generated) / S, double(stopped) / S,
                metric("sampling_tokens_per_s"), wait_s);
    std::fflush(stdout);
    if (jsonl) {
      std::string kinds;
      for (size_t c = 0; c < reward.size(); ++c) kinds += (c ? "+" : "") + reward.kind(c);
      std::string row = fmt("{\"step\": %lld, \"policy_step\": %lld, \"reward\": \"%s\", \"samples\": %zu",
                            (long long)step, (long long)policy_step, kinds.c_str(), rewards.size());
      for (const auto& [key, v] : metrics) row += fmt(", \"%s\": %.6g", key.c_str(), v);
      jsonl << row << "}\n";
      jsonl.flush();
    }
  }
};

}  // namespace

void check_prompt_file(const Config& config, const PromptSet& prompts, const ModelConfig& mc, const PromptUse& use) {
  const RolloutSection& ro = config.rollout;
  const char* file = prompts.path.c_str();
  for (const std::string& kind : ro.reward) {
    const bool needs_answers =
        kind == "exact" || kind == "numeric" || (kind == "regex" && ro.reward_regex.find("{answer}") != std::string::npos);
    SHARDLM_CHECK(!needs_answers || !prompts.answers.empty(),
                  "prompt file '%s' (%s) has no 'answer' dataset, and rollout.reward's \"%s\"%s compares with a "
                  "reference answer per prompt (tools/make_prompts.py stores each line's \"answer\")",
                  file, use.key, kind.c_str(), use.judge);
  }
  for (int64_t p = 0; p < prompts.size(); ++p) {
    const int64_t len = int64_t(prompts.prompt(p).size());
    // A sample of k tokens fills k - 1 positions of a trainer's row: what the
    // policy is evaluated on is what it could be trained on.
    SHARDLM_CHECK(len + use.max_new_tokens <= config.data.seq_len + 1,
                  "prompt file '%s' (%s): prompt %lld has %lld tokens; with %s = %lld a sample can have %lld tokens, "
                  "more than data.seq_len + 1 = %lld (lower %s or raise data.seq_len)", file, use.key, (long long)p,
                  (long long)len, use.budget_key, (long long)use.max_new_tokens, (long long)(len + use.max_new_tokens),
                  (long long)(config.data.seq_len + 1), use.budget_key);
  }
  for (int32_t id : prompts.stop_ids)
    SHARDLM_CHECK(id < mc.vocab_size, "prompt file '%s' (%s): stop token id %d is outside the model's vocabulary [0, %lld)",
                  file, use.key, id, (long long)mc.vocab_size);
}

void check_prompts(const Config& config, const PromptSet& prompts, const ModelConfig& mc) {
  check_prompt_file(config, prompts, mc, {"rollout.prompts", "rollout.max_new_tokens", config.rollout.max_new_tokens, ""});
}

std::vector<int64_t> prompts_for_step(uint64_t seed, int64_t step, int64_t per_step, int64_t file_prompts) {
  std::vector<int64_t> out;
  std::vector<int64_t> order;
  int64_t pass = -1;
  for (int64_t i = 0; i < per_step; ++i) {
    const int64_t k = step * per_step + i;  // the k-th prompt drawn in the run
    if (k / file_prompts != pass) {         // a new pass over the file: its own shuffled order
      pass = k / file_prompts;
      order.resize(size_t(file_prompts));
      for (int64_t j = 0; j < file_prompts; ++j) order[size_t(j)] = j;
      uint64_t state = splitmix64(seed ^ splitmix64(uint64_t(pass) + 0x5eed));
      for (int64_t j = file_prompts - 1; j > 0; --j) {  // Fisher–Yates
        state = splitmix64(state);
        std::swap(order[size_t(j)], order[size_t(state % uint64_t(j + 1))]);
      }
    }
    out.push_back(order[size_t(k % file_prompts)]);
  }
  return out;
}

std::vector<int64_t> round_prompts(uint64_t seed, int64_t step, int64_t round, int64_t per_step, int64_t file_prompts) {
  if (round == 0) return prompts_for_step(seed, step, per_step, file_prompts);
  // A stream of its own per (step, round): a shuffled pass over the file as round 0's are.
  const uint64_t stream = splitmix64(seed ^ splitmix64(uint64_t(step) * 0x9E3779B97F4A7C15ull + uint64_t(round)));
  return prompts_for_step(stream, 0, per_step, file_prompts);
}

int64_t round_key_base(int64_t step, int64_t round, int64_t per_step) {
  // Round 0: step x per_step + item, as without dynamic sampling; later rounds
  // below zero, never meeting any step's round 0.
  return round == 0 ? step * per_step : -1 - ((step * kMaxDynamicRounds + round) * per_step + per_step - 1);
}

DecoderLimits rollout_decoder_limits(const Config& config, const ModelConfig& mc, const PromptSet& prompts,
                                     int generators) {
  const RolloutSection& ro = config.rollout;
  // The KV cache is planned once, for the longest prompt of the file.
  std::vector<GenerateRequest> every;
  for (int64_t p = 0; p < prompts.size(); ++p) every.push_back({p, 0, prompts.prompt(p)});
  DecoderLimits limits = plan_limits(mc, every, ro.batch, ro.max_new_tokens, prompts.path, ro.kv_cache_tokens);
  limits.memory_fraction = ro.kv_cache_memory;
  const int64_t my_items = (ro.prompts_per_step + generators - 1) / generators;
  limits.slots = std::max<int64_t>(1, std::min(ro.batch, my_items * ro.n));
  return limits;
}

int run_inference_role(const Config& config, Runtime& rt) {
  const RolloutSection& ro = config.rollout;
  const ModelConfig mc = model_config_for(config);
  const MPI_Comm comm = rt.role_comm;  // the generator ranks
  const int rank = rt.rank, world = rt.size;

  // Bad input first, before the trainers' first broadcast: the same on every generator.
  const PromptSet prompts = read_prompts(ro.prompts, mc.vocab_size);
  check_prompts(config, prompts, mc);
  const PromptSet eval_prompts = read_eval_prompts(config, mc);  // none without eval.prompts
  InferenceModel model = InferenceModel::for_broadcast(mc, config.model.hf);
  GenerateOptions options;
  options.sampling = {ro.temperature, ro.top_k, ro.top_p, uint64_t(config.run.seed)};
  options.max_new_tokens = ro.max_new_tokens;
  options.stop_ids = prompts.stop_ids;
  for (int32_t id : model.eos_ids)
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), id) == options.stop_ids.end())
      options.stop_ids.push_back(id);
  options.slots = rollout_decoder_limits(config, mc, prompts, world).slots;  // the decoder may hold more, to evaluate
  const DecoderLimits limits =
      with_eval_limits(config, mc, eval_prompts, world, rollout_decoder_limits(config, mc, prompts, world));
  // The backend runtime_init resolved (device.backend, "auto" -> cuda when a GPU is there).
  const std::unique_ptr<Decoder> decoder_owner = make_decoder(model, limits, rt.backend);
  Decoder& decoder = *decoder_owner;
  if (config.loss.router_replay) decoder.record_routes();  // the trainers replay them (docs/rollouts.md)

  // The text rewards see, on rank 0; with an environment every rank tells it its turns' text.
  std::unique_ptr<TokenDecoder> tokenizer;
  std::error_code ec;
  if ((rank == 0 || !config.env.program.empty()) && !model.tokenizer_dir.empty() &&
      fs::exists(model.tokenizer_dir / "tokenizer.json", ec))
    tokenizer = std::make_unique<TokenDecoder>(TokenDecoder::load(model.tokenizer_dir.string()));
  std::unique_ptr<RewardSet> reward;
  std::unique_ptr<Publisher> publisher;
  if (rank == 0) {
    reward = std::make_unique<RewardSet>(ro);
    fs::create_directories(config.run.dir, ec);
    publisher = std::make_unique<Publisher>(Publisher{config, prompts, tokenizer.get(), *reward, rt.job_id, {}, {}});
    std::printf("generate: %d inference rank%s | %lld prompts from %s, %lld per step x %lld samples | reward %s, "
                "advantages %s | temperature %g, top-k %lld, top-p %g | max %lld new tokens, %lld slots, cache %.1f "
                "MiB, %s | %s | rollouts to %s, at most data.max_async = %lld steps behind the trainers' weights\n",
                world, world == 1 ? "" : "s", (long long)prompts.size(), prompts.path.c_str(),
                (long long)ro.prompts_per_step, (long long)ro.n, reward->name().c_str(), ro.advantage.c_str(),
                ro.temperature, (long long)ro.top_k, ro.top_p, (long long)ro.max_new_tokens, (long long)limits.slots,
                decoder.cache_bytes() / 1048576.0, decoder.describe().c_str(), tokenizer ? ("text from " + tokenizer->where()).c_str()
                                                              : "no tokenizer.json: rewards see token ids",
                config.data.rollout_dir.c_str(), (long long)config.data.max_async);
    std::fflush(stdout);
  }

  // Episodes of several turns: this rank's environment program (env.program)
  // answers each turn with an observation or the episode's reward; the
  // rollouts and the evaluation each keep their episodes.
  std::unique_ptr<EnvProgram> env;
  std::unique_ptr<Episodes> episodes;
  if (!config.env.program.empty()) {
    env = std::make_unique<EnvProgram>(config.env.program, config.env.timeout_s);
    episodes = std::make_unique<Episodes>(*env, prompts, tokenizer.get(), ro.max_turns, /*eval=*/false);
  }
  // Accuracy on eval.prompts, on the weights held when due: before they are replaced, after a rollout step.
  Evaluator evaluator(config, eval_prompts, decoder, model.eos_ids, comm, reward.get(), tokenizer.get(), env.get());
  // The rollouts' sequences, across steps: with in-flight updates the next
  // step's samples take the slots the current step's tail leaves free
  // (continuous rollouts), once the weights held are recent enough for it.
  // An evaluation needs the decoder to itself: the steps started ahead are
  // finished first (drain) and kept for their turn.
  std::unique_ptr<GenerateStream> stream;  // made once options.policy is set, below
  struct Ahead {
    int64_t first = 0, count = 0;      // the step's requests in the stream
    int64_t started = 0;               // of them, begun when the step before had all its samples
    std::vector<Completion> finished;  // when a drain finished them
    bool done = false;
  };
  std::map<int64_t, Ahead> ahead;  // steps whose samples started before their turn
  const bool look_ahead = ro.in_flight_updates && config.data.max_async > 0 && !ro.dynamic_sampling;
  const auto finish_episodes = [&](std::vector<Completion>& done) {
    if (episodes) episodes->finish(done);
  };
  const auto drain = [&] {
    for (auto& [s, a] : ahead) {
      if (a.done) continue;
      a.finished = stream->run(a.first, a.count);
      finish_episodes(a.finished);
      a.done = true;
      a.started = a.count;
    }
  };
  WeightReceiver receiver(config, rt, model.weights->layout);
  // Weights that arrive in host memory: the host copy first, then the decoder's
  // own (the GPU's bf16 weights, refreshed parameter by parameter). Weights that
  // arrive in this rank's GPU memory (the trainers broadcast from theirs) go
  // straight into the GPU decoder's, device to device, and the host copy is
  // left as it is: nothing reads it once the decoder is made.
  const auto to_host = [&](const ParamInfo& p, const uint16_t* values) {
    model.load_bf16(p, values);
    decoder.load_bf16(p, values);
  };
  WeightReceiver::DeviceSink to_device;  // SHARDLM_RECEIVE_TO_HOST=1: through the host (tests/gpu/test_rl_gpu.sh)
  const char* to_host_only = std::getenv("SHARDLM_RECEIVE_TO_HOST");
  if (decoder.loads_from_device() && !(to_host_only && std::string(to_host_only) == "1"))
    to_device = [&](const ParamInfo& p, const void* values) { decoder.load_bf16_device(p, values); };
  // In order when several ranks read the filesystem, so that they all hold the same step.
  const bool newest_only = world == 1;
  const auto evaluate_if_due = [&] {
    if (!evaluator.due(receiver.step())) return;
    drain();
    evaluator.if_due(receiver.step());
  };
  const auto next = [&] {
    evaluate_if_due();
    return receiver.next(/*wait=*/true, newest_only, to_host, to_device);
  };
  const auto ended = [&] {
    if (rank == 0)
      std::printf("generate: the trainers ended (exit %d) after %lld broadcast%s\n", receiver.exit_code(),
                  (long long)receiver.received(), receiver.received() == 1 ? "" : "s"), std::fflush(stdout);
    return receiver.exit_code();
  };
  // Every prefill and decode step first takes the weights that arrived since
  // the last (rollout.in_flight_updates, one inference rank) and records the
  // version it runs with (Completion::policy_first / policy_last).
  SHARDLM_CHECK(!ro.in_flight_updates || world == 1,
                "rollout.in_flight_updates = true with %d inference ranks: weights are taken between decode steps on "
                "one inference rank only (each rank would take them at a step of its own while the others wait in the "
                "broadcast); run one inference rank or set it false", world);
  int64_t in_flight = 0;
  // tests: SHARDLM_FAULT=sample_slow@R makes each of inference rank R's rollout forwards wait first
  const char* slow_text = std::getenv("SHARDLM_SAMPLE_SLOW_MS");
  const int64_t slow_ms = fault_armed("sample_slow") ? (slow_text ? std::atoll(slow_text) : 100) : 0;
  options.policy = [&] {
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    if (ro.in_flight_updates)
      while (receiver.next(/*wait=*/false, newest_only, to_host, to_device) == WeightReceiver::Got::Weights) ++in_flight;
    return receiver.step();
  };
  if (episodes)
    options.next_turn = [&](const GenerateRequest&, const Completion& c) { return episodes->next_turn(c); };
  stream = std::make_unique<GenerateStream>(decoder, options);
  // This rank's requests of a round's items (prompt file indices) and key base:
  // items g, g + G, ... of them, n samples each.
  const auto round_requests = [&](const std::vector<int64_t>& items, int64_t base) {
    std::vector<GenerateRequest> requests;
    for (int64_t i = rank; i < int64_t(items.size()); i += world) {
      if (episodes) episodes->begin(base + i, items[size_t(i)]);
      for (int64_t s = 0; s < ro.n; ++s) requests.push_back({base + i, s, prompts.prompt(items[size_t(i)])});
    }
    return requests;
  };
  // While step `step` is sampled and slots are free: start step + 1 when its
  // samples may be drawn with the weights held (at most data.max_async steps
  // behind it) and it is one the trainers will take.
  const auto start_next = [&](int64_t step) -> std::function<void()> {
    if (!look_ahead) return {};
    return [&, step] {
      const int64_t next_step = step + 1;
      if (next_step >= config.run.max_steps || ahead.count(next_step) || receiver.done() ||
          receiver.step() < next_step - config.data.max_async)
        return;
      const std::vector<GenerateRequest> requests =
          round_requests(round_prompts(uint64_t(config.run.seed), next_step, 0, ro.prompts_per_step, prompts.size()),
                         round_key_base(next_step, 0, ro.prompts_per_step));
      ahead[next_step] = Ahead{stream->add(requests), int64_t(requests.size()), 0, {}, false};
    };
  };
  // The trainers broadcast their starting weights once (WeightBroadcaster::start).
  if (next() == WeightReceiver::Got::Done) return ended();
  if (rank == 0) publisher->open_jsonl(fs::path(config.run.dir) / "rollouts.jsonl", receiver.step());
  evaluator.open_jsonl(config.run.dir, receiver.step());
  // The starting weights are evaluated before any sampling: later, a drain
  // with in-flight updates may already have taken the next ones.
  evaluate_if_due();

  for (int64_t step = receiver.step(); step < config.run.max_steps; ++step) {
    // tests: SHARDLM_FAULT=generate_crash@R kills inference rank R (world rank) before rollout step 4
    if (step == 4 && fault_armed("generate_crash")) std::raise(SIGSEGV);
    const auto t_wait = Clock::now();
    while (receiver.step() < step - config.data.max_async)
      if (next() == WeightReceiver::Got::Done) return ended();
    const double wait_s = seconds_since(t_wait);
    if (receiver.done()) break;  // the trainers ended while the last step was sampled
    const int64_t step_policy = receiver.step();
    in_flight = 0;

    // Round 0 draws the step's prompts; with rollout.dynamic_sampling, rank 0
    // may ask for further rounds of as many prompts, each from its own stream.
    if (rank == 0) publisher->begin_step();
    double sample_s = 0;
    double started_ahead = 0;  // of this rank's samples of the step, those begun during the last step
    const double env_before = env ? env->seconds() : 0.0;
    for (int64_t round = 0;; ++round) {
      const std::vector<int64_t> items = round_prompts(uint64_t(config.run.seed), step, round, ro.prompts_per_step,
                                                       prompts.size());
      const int64_t base = round_key_base(step, round, ro.prompts_per_step);  // draw keys: unique per (step, round, item)
      const auto t_sample = Clock::now();
      std::vector<Completion> mine;
      if (auto a = ahead.find(step); a != ahead.end()) {
        started_ahead = double(a->second.started);
        if (a->second.done) {
          mine = std::move(a->second.finished);
        } else {
          mine = stream->run(a->second.first, a->second.count, start_next(step));
          finish_episodes(mine);
        }
        ahead.erase(a);
      } else {
        const std::vector<GenerateRequest> requests = round_requests(items, base);
        mine = stream->run(stream->add(requests), int64_t(requests.size()), start_next(step));
        finish_episodes(mine);
      }
      sample_s += seconds_since(t_sample);
      if (auto a = ahead.find(step + 1); a != ahead.end() && !a->second.done)
        a->second.started = stream->started(a->second.first, a->second.count);
      std::vector<Completion> all = gather_completions(std::move(mine), comm);
      int64_t more = rank == 0 && publisher->add_round(step, items, base, std::move(all)) ? 1 : 0;
      if (!ro.dynamic_sampling) break;
      MPI_Request request;  // every inference rank samples the next round, or none does
      MPI_CHECK(MPI_Ibcast(&more, 1, MPI_INT64_T, 0, comm, &request));
      wait_collective(comm, &request, "dynamic sampling round");
      if (!more) break;
    }
    if (rank == 0 && env) publisher->add_env_seconds(env->seconds() - env_before);
    if (rank == 0)
      publisher->publish(step, step_policy, sample_s, wait_s, in_flight, seconds_since(t_wait), evaluator.take_metrics(),
                         started_ahead);
    evaluate_if_due();  // while the trainers train on this step
  }
  // Samples started for a step the trainers will not take are dropped; the
  // decoder is the evaluation's from here.
  stream.reset();
  ahead.clear();
  // The rest of the broadcasts, to the trainers' end (and its exit code).
  while (next() == WeightReceiver::Got::Weights) {
  }
  evaluator.at_end(receiver.step(), receiver.exit_code());
  return ended();
}

}  // namespace shardlm
