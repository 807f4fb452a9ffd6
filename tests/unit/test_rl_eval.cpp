// test_rl_eval.cpp — the RL job's accuracy evaluation (infer/eval.hpp) without
// MPI: its numbers from rewards worked out by hand, which weights are due, the
// eval prompt file's checks, the decoder limits it adds, its seed, and
// generate()'s slot cap that keeps the rollouts' batch when the decoder holds more.
// The evaluation in a job against tools/score_generate.py: tests/scripts/test_rl_eval.sh.
#include <doctest/doctest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "infer/decoder.hpp"
#include "infer/eval.hpp"
#include "infer/generate.hpp"
#include "infer/model.hpp"
#include "infer/sampler.hpp"
#include "shardlm/config.hpp"
#include "shardlm/error.hpp"

using namespace shardlm;

namespace {

// An RL deck with inference ranks and an evaluation: data.seq_len 8, rollout.max_new_tokens 2.
Config eval_deck(std::vector<std::string> sets = {}) {
  const char* deck = R"(
[run]
dir = "runs/eval"
seed = 11
[model]
vocab_size = 16
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 4
max_position_embeddings = 32
[data]
rollout_dir = "runs/eval/rollouts"
seq_len = 8
micro_batch = 4
[loss]
type = "rl"
[rollout]
prompts = "train.h5"
max_new_tokens = 2
batch = 16
[eval]
prompts = "held.h5"
)";
  const DeckResult r = parse_deck_text(deck, "deck.toml", sets, 1);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

ModelConfig model16() {
  ModelConfig mc;
  mc.vocab_size = 16;
  mc.max_position_embeddings = 32;
  return mc;
}

// Prompts of the given lengths (ids 1, 2, ...), with answers unless told otherwise.
PromptSet prompt_set(const std::vector<int>& lengths, bool answers = true) {
  PromptSet p;
  p.path = "held.h5";
  p.offsets.push_back(0);
  for (int len : lengths) {
    for (int t = 0; t < len; ++t) p.tokens.push_back(1 + t);
    p.offsets.push_back(int64_t(p.tokens.size()));
    if (answers) p.answers.push_back("3");
  }
  p.stop_ids = {12};
  return p;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_SUITE("rl_eval") {

TEST_CASE("the scores by hand: greedy accuracy and reward, pass@k and pass@1 of k samples, the threshold") {
  // 4 prompts; greedy rewards 1, 0, 1, 0.2; 2 samples each: none, one, none, both right.
  const std::vector<double> greedy = {1, 0, 1, 0.2}, sampled = {0, 0, 1, 0, 0, 0, 1, 1};
  const EvalScores s = eval_scores(greedy, sampled, 2, 0.0);
  CHECK(s.prompts == 4);
  CHECK(s.samples == 2);
  CHECK(s.correct == 3);  // 0.2 > 0
  CHECK(s.accuracy == 0.75);
  CHECK(s.reward_mean == doctest::Approx(0.55).epsilon(1e-15));
  CHECK(s.pass_at_k == 0.5);     // prompts 1 and 3
  CHECK(s.pass_at_1 == 0.375);   // 3 of 8 samples
  const EvalScores strict = eval_scores(greedy, sampled, 2, 0.5);
  CHECK(strict.correct == 2);
  CHECK(strict.accuracy == 0.5);
  CHECK(strict.pass_at_k == 0.5);
  const EvalScores greedy_only = eval_scores(greedy, {}, 0, 0.0);
  CHECK(greedy_only.correct == 3);
  CHECK(greedy_only.pass_at_k == 0);
  CHECK(error_of([&] { eval_scores(greedy, {1, 0}, 2, 0.0); }) == "internal: 2 sampled rewards for 4 prompts x 2");
}

TEST_CASE("which weights are due: the first held, then the first at or past each multiple of eval.interval") {
  CHECK(eval_due(-1, 0, 2));
  CHECK(eval_due(-1, 7, 0));  // the starting weights, whatever they are
  CHECK_FALSE(eval_due(0, 0, 2));
  CHECK_FALSE(eval_due(0, 1, 2));
  CHECK(eval_due(0, 2, 2));
  CHECK(eval_due(2, 4, 2));
  CHECK_FALSE(eval_due(4, 5, 2));
  CHECK_FALSE(eval_due(0, 9, 0));  // eval.interval = 0: the start (and eval.at_end) only
  // A broadcast every 3 steps, eval.interval 2: 0, then 3 (past 2), 6 (past 4), 9 (past 8) ...
  std::vector<int64_t> evaluated;
  int64_t last = -1;
  for (int64_t step = 0; step <= 12; step += 3)
    if (eval_due(last, step, 2)) evaluated.push_back(step), last = step;
  CHECK(evaluated == std::vector<int64_t>{0, 3, 6, 9, 12});
  // Resumed at step 5 with eval.interval 4: 5, then 8, 12.
  evaluated.clear();
  last = -1;
  for (int64_t step = 5; step <= 13; ++step)
    if (eval_due(last, step, 4)) evaluated.push_back(step), last = step;
  CHECK(evaluated == std::vector<int64_t>{5, 8, 12});
}

TEST_CASE("the eval prompt file against the deck: answers, prompt + eval.max_new_tokens within data.seq_len, stop ids") {
  const ModelConfig mc = model16();
  CHECK(error_of([&] { check_eval_prompts(eval_deck(), prompt_set({5, 7}), mc); }) == "(no error)");  // 7 + 2 <= 9
  CHECK(error_of([&] { check_eval_prompts(eval_deck(), prompt_set({5, 7}, false), mc); }) ==
        "prompt file 'held.h5' (eval.prompts) has no 'answer' dataset, and rollout.reward's \"exact\", which judges "
        "the evaluation, compares with a reference answer per prompt (tools/make_prompts.py stores each line's "
        "\"answer\")");
  // A regex without {answer} needs none.
  CHECK(error_of([&] {
          check_eval_prompts(eval_deck({"rollout.reward=\"regex\"", "rollout.reward_regex=\"^3\""}),
                             prompt_set({5}, false), mc);
        }) == "(no error)");
  CHECK(error_of([&] { check_eval_prompts(eval_deck({"eval.max_new_tokens=3"}), prompt_set({5, 7}), mc); }) ==
        "prompt file 'held.h5' (eval.prompts): prompt 1 has 7 tokens; with eval.max_new_tokens = 3 a sample can "
        "have 10 tokens, more than data.seq_len + 1 = 9 (lower eval.max_new_tokens or raise data.seq_len)");
  PromptSet far_stop = prompt_set({5});
  far_stop.stop_ids = {16};
  CHECK(error_of([&] { check_eval_prompts(eval_deck(), far_stop, mc); }) ==
        "prompt file 'held.h5' (eval.prompts): stop token id 16 is outside the model's vocabulary [0, 16)");
  CHECK(error_of([&] { read_eval_prompts(eval_deck({"eval.prompts=\"/nonexistent/held.h5\""}), mc); }) ==
        "eval.prompts: prompt file '/nonexistent/held.h5' does not exist");
  CHECK(read_eval_prompts(eval_deck({"eval.prompts=\"\""}), mc).path.empty());  // no evaluation, nothing read
}

TEST_CASE("the decoder's limits: the rollouts' and the evaluation's, whichever is more") {
  const ModelConfig mc = model16();
  const PromptSet held = prompt_set({3, 7, 4, 5, 6});  // 5 prompts, the longest 7
  // eval.batch = rollout.batch = 16; greedy only: rank 0 of 2 holds 3 prompts -> 3 slots; 7 + 2 - 1 positions.
  DecoderLimits l = with_eval_limits(eval_deck(), mc, held, 2, {8, 5});
  CHECK(l.slots == 8);
  CHECK(l.max_len == 8);
  // 4 samples: 3 x 4 = 12 slots, more than the rollouts' 8.
  l = with_eval_limits(eval_deck({"eval.samples=4"}), mc, held, 2, {8, 5});
  CHECK(l.slots == 12);
  // eval.batch caps them; the rollouts' longer positions stay.
  l = with_eval_limits(eval_deck({"eval.samples=4", "eval.batch=10"}), mc, held, 2, {8, 20});
  CHECK(l.slots == 10);
  CHECK(l.max_len == 20);
  l = with_eval_limits(eval_deck(), mc, PromptSet{}, 2, {8, 5});  // no evaluation
  CHECK(l.slots == 8);
  CHECK(l.max_len == 5);
}

TEST_CASE("the evaluation's seed is a stream apart from the rollouts', fixed per run.seed") {
  CHECK(eval_seed(11) == eval_seed(11));
  CHECK(eval_seed(11) != 11);
  CHECK(eval_seed(11) != eval_seed(12));
  int same = 0;
  for (int64_t p = 0; p < 64; ++p) same += uniform_draw(eval_seed(11), {p, 0, 0}) == uniform_draw(11, {p, 0, 0});
  CHECK(same == 0);
}

TEST_CASE("generate()'s slot cap: a decoder planned for 8 slots decodes 2 at a time, the completions unchanged") {
  const InferenceModel m = InferenceModel::from_hf(std::filesystem::path("tests/fixtures") / "llama-gqa-tied");
  const int64_t V = m.config().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 5; ++p) prompts.push_back({int32_t(1 + p), int32_t((7 * p + 3) % V), int32_t((5 * p + 2) % V)});
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < 2; ++s) requests.push_back({int64_t(p), s, prompts[p]});
  GenerateOptions o;
  o.sampling = {.temperature = 1.0, .top_k = 0, .top_p = 1.0, .seed = 7};
  o.max_new_tokens = 6;
  CpuDecoder wide(m, plan_limits(m.config(), requests, 8, o.max_new_tokens, "test"));
  CpuDecoder narrow(m, plan_limits(m.config(), requests, 2, o.max_new_tokens, "test"));
  const std::vector<Completion> all_slots = generate(wide, requests, o);
  GenerateOptions capped = o;
  capped.slots = 2;
  const std::vector<Completion> two = generate(wide, requests, capped);
  const std::vector<Completion> two_planned = generate(narrow, requests, o);
  REQUIRE(two.size() == requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    CHECK(two[i].tokens == all_slots[i].tokens);
    CHECK(two[i].tokens == two_planned[i].tokens);
    CHECK(two[i].model_logprobs == two_planned[i].model_logprobs);
  }
  // Capped, it takes 2 slots: a slot order must name 2 of them, not the decoder's 8.
  capped.slot_order = {0, 1, 2, 3, 4, 5, 6, 7};
  CHECK(error_of([&] { generate(wide, requests, capped); }) == "internal: a slot order of 8 for 2 slots");
  capped.slot_order = {1, 0};
  CHECK(generate(wide, requests, capped)[9].tokens == all_slots[9].tokens);
}

}  // TEST_SUITE
