// test_rollout_role.cpp — the pieces of the RL job's inference role that need
// no MPI: answer extraction, the built-in verifiers, the reward program (its
// answers, its failure, its hang), several components weighted (RewardSet),
// group advantages worked by hand, the prompts of each step, rollout files
// written and read back (their rewards and metrics included), and the deck's
// [rollout] and max_async checks. The role itself: tests/scripts/test_rl_learns.sh.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "data/rollouts.hpp"
#include "infer/reward.hpp"
#include "infer/rollout.hpp"
#include "shardlm/config.hpp"
#include "shardlm/error.hpp"

using namespace shardlm;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

RewardItem item(const std::string& text, const std::string& answer) {
  RewardItem r;
  r.text = text;
  r.answer = answer;
  return r;
}

RolloutSection program(const std::string& command, double timeout_s = 10) {
  RolloutSection r;
  r.reward = {"program"};
  r.reward_program = command;
  r.reward_timeout_s = timeout_s;
  return r;
}

// The deck's only component, as make_reward builds it.
std::unique_ptr<Reward> built(const RolloutSection& r) { return make_reward(r.reward.at(0), r); }

}  // namespace

TEST_SUITE("rollout_role") {

TEST_CASE("answer extraction: \\boxed{}, ####, the last word; numbers with commas") {
  CHECK(extract_answer("so it is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}");
  CHECK(extract_answer("work\n#### 17 ") == "17");
  CHECK(extract_answer("  a b  7 \n") == "7");
  CHECK(extract_answer("") == "");
  double v = 0;
  CHECK(extract_number("total: 1,234.5 apples, or -3e2?", &v));
  CHECK(v == -300.0);
  CHECK(extract_number("1,234.5", &v));
  CHECK(v == 1234.5);
  CHECK_FALSE(extract_number("no digits", &v));
}

TEST_CASE("built-in verifiers: exact, numeric, regex with {answer}") {
  RolloutSection r;
  r.reward = {"exact"};
  CHECK(built(r)->score({item("it is 42", "42"), item("it is 42.0", "42"), item("42 no", "42")}, 0) ==
        std::vector<double>{1, 0, 0});
  r.reward = {"numeric"};
  CHECK(built(r)->score({item("it is 42", "42"), item("it is 42.0", "42"), item("41", "42")}, 0) ==
        std::vector<double>{1, 1, 0});
  r.reward = {"regex"};
  r.reward_regex = "^answer: {answer}$";
  CHECK(built(r)->score({item("answer: 1+1", "1+1"), item("answer: 11", "1+1")}, 0) ==
        std::vector<double>{1, 0});  // {answer} is literal text, '+' escaped
  r.reward_regex = "[0-9]";
  CHECK(built(r)->score({item("x7", ""), item("xy", "")}, 0) == std::vector<double>{1, 0});
}

TEST_CASE("reward program: JSONL in, one reward per line out, in order") {
  const std::string py =
      "/usr/bin/python3 -c \"import sys, json\n"
      "for line in sys.stdin:\n"
      "    c = json.loads(line)\n"
      "    print(0.5 * len(c['completion_ids']) + (1 if c['completion'] == c['answer'] else 0))\"";
  RewardItem a = item("7", "7"), b = item("8", "7");
  a.completion_ids = {55, 257};
  b.completion_ids = {56};
  CHECK(built(program(py))->score({a, b}, 3) == std::vector<double>{2.0, 0.5});
}

TEST_CASE("reward program: a failing, hanging or miscounting program is an error naming it and the step") {
  const std::vector<RewardItem> two = {item("1", "1"), item("2", "1")};
  const std::string failed = error_of([&] { built(program("cat >/dev/null; exit 3"))->score(two, 5); });
  CHECK(failed.find("reward program 'cat >/dev/null; exit 3' (rollout.reward_program, rollout step 5) exited with "
                    "status 3") != std::string::npos);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string hung = error_of([&] { built(program("sleep 30", 0.5))->score(two, 6); });
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 5.0);
  CHECK(hung.find("reward program 'sleep 30' (rollout.reward_program, rollout step 6) gave no complete answer within "
                  "rollout.reward_timeout_s = 0.5 s") != std::string::npos);
  const std::string short_answer = error_of([&] { built(program("cat >/dev/null; echo 1"))->score(two, 7); });
  CHECK(short_answer.find("answered 1 rewards for 2 completions") != std::string::npos);
  const std::string text = error_of([&] { built(program("cat >/dev/null; echo 1; echo yes"))->score(two, 7); });
  CHECK(text.find("line 2 of its output is 'yes', not a finite number") != std::string::npos);
  const std::string missing = error_of([&] { built(program("/no/such/reward"))->score(two, 8); });
  CHECK(missing.find("could not run it (exit 127") != std::string::npos);
}

TEST_CASE("several components: the reward is their weighted sum, each component's scores kept") {
  RolloutSection r;
  r.reward = {"exact", "regex"};
  r.reward_weights = {1.0, 0.25};
  r.reward_regex = "^the answer is";
  RewardSet set(r);
  REQUIRE(set.size() == 2);
  CHECK(set.kind(0) == "exact");
  CHECK(set.kind(1) == "regex");
  CHECK(set.name() == "1*exact + 0.25*regex /^the answer is/");
  // exact: 1 0 1 0; regex: 1 1 0 0
  const RewardSet::Scores s = set.score({item("the answer is 7", "7"), item("the answer is 8", "7"),
                                         item("so 7", "7"), item("8", "7")}, 0);
  CHECK(s.component[0] == std::vector<double>{1, 0, 1, 0});
  CHECK(s.component[1] == std::vector<double>{1, 1, 0, 0});
  CHECK(s.total == std::vector<double>{1.25, 0.25, 1.0, 0.0});
  // One component without weights: exactly that component, named as before.
  RolloutSection one;
  one.reward = {"numeric"};
  RewardSet single(one);
  CHECK(single.name() == "numeric");
  CHECK(single.score({item("it is 42.0", "42"), item("41", "42")}, 0).total == std::vector<double>{1, 0});
  // A negative weight penalises: a format rule against a trailing "!".
  RolloutSection penalty;
  penalty.reward = {"exact", "regex"};
  penalty.reward_weights = {2.0, -0.5};
  penalty.reward_regex = "!$";
  CHECK(RewardSet(penalty).score({item("7!", "7!"), item("7", "7"), item("6!", "7")}, 0).total ==
        std::vector<double>{1.5, 2.0, -0.5});
}

TEST_CASE("group advantages by hand: mean and std per prompt, the mean only, leave-one-out, the batch std") {
  const std::vector<double> rewards = {1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 3};
  const std::vector<float> a = group_advantages(rewards, 4, "mean_std");
  // group 0: mean 0.5, population std 0.5; group 1: all equal -> 0; group 2: mean 0.75, std sqrt(27/16)
  const double s0 = 0.5 / (0.5 + 1e-6), s2 = 1.0 / (std::sqrt(27.0 / 16.0) + 1e-6);
  const std::vector<double> expected = {s0, -s0, -s0, s0, 0, 0, 0, 0, -0.75 * s2, -0.75 * s2, -0.75 * s2, 2.25 * s2};
  for (size_t i = 0; i < expected.size(); ++i) CHECK(a[i] == doctest::Approx(expected[i]).epsilon(1e-6));
  const std::vector<float> m = group_advantages(rewards, 4, "mean");
  CHECK(m[0] == doctest::Approx(0.5));
  CHECK(m[1] == doctest::Approx(-0.5));
  CHECK(m[4] == 0.0f);
  CHECK(m[11] == doctest::Approx(2.25));
  // Leave-one-out (RLOO): group 0's first sample, 1 - mean(0, 0, 1) = 2/3; group 2's last, 3 - 0 = 3.
  const std::vector<float> l = group_advantages(rewards, 4, "rloo");
  CHECK(l[0] == doctest::Approx(2.0 / 3.0));
  CHECK(l[1] == doctest::Approx(-2.0 / 3.0));
  CHECK(l[4] == 0.0f);
  CHECK(l[11] == doctest::Approx(3.0));
  // batch_std: each group's mean, then the population std of all 12 rewards.
  double mean = 0, var = 0;
  for (double r : rewards) mean += r / 12;
  for (double r : rewards) var += (r - mean) * (r - mean) / 12;
  const std::vector<float> b = group_advantages(rewards, 4, "batch_std");
  CHECK(b[0] == doctest::Approx(0.5 / (std::sqrt(var) + 1e-6)).epsilon(1e-6));
  CHECK(b[11] == doctest::Approx(2.25 / (std::sqrt(var) + 1e-6)).epsilon(1e-6));
  CHECK_THROWS_WITH_AS(group_advantages(rewards, 4, "median"),
                       "rollout.advantage = \"median\" is not one of \"mean_std\", \"mean\", \"rloo\", \"batch_std\"",
                       Error);
}

TEST_CASE("prompts of each step: every prompt once per pass over the file, seeded") {
  std::vector<int64_t> drawn;
  for (int64_t step = 0; step < 5; ++step)
    for (int64_t p : prompts_for_step(7, step, 4, 10)) drawn.push_back(p);
  REQUIRE(drawn.size() == 20);
  CHECK(std::set<int64_t>(drawn.begin(), drawn.begin() + 10).size() == 10);  // pass 0
  CHECK(std::set<int64_t>(drawn.begin() + 10, drawn.end()).size() == 10);    // pass 1
  CHECK(std::vector<int64_t>(drawn.begin(), drawn.begin() + 10) != std::vector<int64_t>(drawn.begin() + 10, drawn.end()));
  CHECK(prompts_for_step(7, 3, 4, 10) == prompts_for_step(7, 3, 4, 10));
  CHECK(prompts_for_step(7, 0, 10, 10) != prompts_for_step(8, 0, 10, 10));
}

TEST_CASE("a rollout file written by the inference role reads back as the trainer reads it") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-rollout-role-" + std::to_string(getpid()));
  RolloutFile f;
  f.step = 4;
  f.policy_step = 3;
  f.tokens = {1, 2, 3, 9, 257, 1, 2, 8};
  f.offsets = {0, 5, 8};
  f.loss_mask = {0, 0, 0, 1, 1, 0, 0, 1};
  f.advantages = {1.0f, -1.0f};
  f.inference_logprobs = {0, 0, 0, -0.5f, -0.25f, 0, 0, -2.0f};
  f.temperature = {0.7f, 0.7f};
  f.rewards = {1.25, 0.0};
  f.metrics = {{"reward_mean", 0.625}, {"reward_exact", 0.5}, {"sampling_tokens_per_s", 1234.5}};
  write_rollouts(dir.string(), f);
  CHECK_FALSE(std::filesystem::exists(rollout_path(dir.string(), 4) + ".tmp"));
  const RolloutBatch b = read_rollouts(rollout_path(dir.string(), 4), 258);
  CHECK(b.step == 4);
  CHECK(b.policy_step == 3);
  CHECK(b.tokens == f.tokens);
  CHECK(b.loss_tokens == 3);
  CHECK(b.advantages_per_sample);
  CHECK(b.advantages[4] == 1.0f);
  CHECK(b.advantages[7] == -1.0f);
  CHECK(b.temperature[1] == 0.7f);
  // The metrics group reads back by name, in name order.
  REQUIRE(b.metrics.size() == 3);
  CHECK(b.metrics[0] == std::pair<std::string, double>{"reward_exact", 0.5});
  CHECK(b.metrics[1] == std::pair<std::string, double>{"reward_mean", 0.625});
  CHECK(b.metrics[2] == std::pair<std::string, double>{"sampling_tokens_per_s", 1234.5});
  RolloutBatch per_sequence = b;
  CHECK(normalize_per_sequence(per_sequence) == 2);
  CHECK(per_sequence.loss_weight[3] == 0.5f);  // sample 0: two loss tokens
  CHECK(per_sequence.loss_weight[7] == 1.0f);  // sample 1: one
  std::filesystem::remove_all(dir);
}

TEST_CASE("deck: data.max_async against broadcast.interval; [rollout] reward keys") {
  const std::string base = "[run]\n[model]\nvocab_size = 32\nhidden_size = 16\nintermediate_size = 32\nnum_layers = 1\n"
                           "num_heads = 2\nnum_kv_heads = 1\nmax_position_embeddings = 64\n[data]\nseq_len = 16\n"
                           "rollout_dir = \"r\"\n[loss]\ntype = \"rl\"\n";
  auto errors = [&](const std::string& extra) {
    std::string all;
    for (const auto& e : parse_deck_text(base + extra, "rl.toml", {}, 1).errors) all += e + "\n";
    return all;
  };
  CHECK(errors("[broadcast]\nbackend = \"nccl\"\ninterval = 5\n").find(
            "data.max_async = 0 is smaller than broadcast.interval - 1 = 4") != std::string::npos);
  CHECK(errors("[broadcast]\nbackend = \"nccl\"\ninterval = 1\n").empty());
  CHECK(errors("[rollout]\nreward = \"program\"\n").find("rollout.reward = \"program\" needs rollout.reward_program") !=
        std::string::npos);
  CHECK(errors("[rollout]\nreward = \"regex\"\nreward_regex = \"a(\"\n").find(
            "rollout.reward_regex = \"a(\" is not a regular expression") != std::string::npos);
  // Several components: weights one per component, each component once, known names.
  CHECK(errors("[rollout]\nreward = [\"exact\", \"regex\"]\nreward_regex = \"x\"\nreward_weights = [1, 0.5]\n").empty());
  CHECK(errors("[rollout]\nreward = [\"exact\", \"numeric\"]\nreward_weights = [1]\n").find(
            "rollout.reward_weights has 1 entry but rollout.reward names 2 components") != std::string::npos);
  CHECK(errors("[rollout]\nreward = [\"exact\", \"exact\"]\n").find("rollout.reward names \"exact\" twice") !=
        std::string::npos);
  CHECK(errors("[rollout]\nreward = [\"exact\", \"fuzzy\"]\n").find(
            "rollout.reward = an array: entry 1 (\"fuzzy\") is not accepted") != std::string::npos);
  CHECK(errors("[rollout]\nreward = \"fuzzy\"\n").find("is not accepted: it must be one of") != std::string::npos);
  CHECK(errors("[rollout]\nreward = [\"exact\", \"program\"]\n").find(
            "rollout.reward = \"program\" needs rollout.reward_program") != std::string::npos);
  CHECK(errors("[rollout]\nreward = [\"exact\", \"numeric\"]\nreward_weights = [0, 0]\n").find(
            "rollout.reward_weights are all 0") != std::string::npos);
  CHECK(errors("[rollout]\ntemperature = 0\n").find("rollout.temperature = 0 is out of range") != std::string::npos);
  CHECK(errors("[rollout]\nadvantage = \"median\"\n").find("rollout.advantage") != std::string::npos);
}

}  // TEST_SUITE
