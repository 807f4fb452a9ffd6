// test_router_replay.cpp — router replay (loss.router_replay) end to end in one
// process: a tiny qwen3_moe sampler (the CPU decoder) records the experts its
// router chose for every token it feeds, and the trainer's forward (the
// Engine, the function the RL loss computes logprobs with) replays them. The
// trainer's weights are the sampler's with a small relative perturbation (a
// bf16 sampler, or weights a step behind): its own top-k then picks other
// experts for some tokens and its logprobs jump there. The mismatch KL (the
// RL loss's mismatch_kl: k3 of trainer - sampler logprob, over the drawn
// tokens) with the recorded routes must be below the one without, and with
// identical weights the replayed logprobs are the sampler's.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/rollouts.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/model.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/error.hpp"
#include "train/engine.hpp"
#include "train/shard.hpp"
#include "train/step_source.hpp"
#include "../test_util.hpp"

using namespace shardlm;

namespace {

ModelConfig tiny_experts() { return shardlm_test::tiny_experts(8); }

// The trainer's side: its own weights, one sequence per forward, logprobs of
// every target at temperature 1 (what the RL loss compares with the sampler's).
struct Trainer {
  std::unique_ptr<Comm> comm = make_self_comm();
  ShardedModel model;
  std::unique_ptr<Engine> engine;
  Trainer(const ModelConfig& c, const ShardedModel& sampler, double relative_noise) : model(c, 0, 1) {
    std::mt19937_64 rng(17);
    std::normal_distribution<double> gauss(0.0, 1.0);
    for (size_t u = 0; u < model.param.size(); ++u)
      for (int64_t i = 0; i < model.param[u].size(); ++i) {
        const float w = sampler.param[u][i];
        model.param[u][i] = relative_noise > 0 ? float(w * (1.0 + relative_noise * gauss(rng))) : w;
      }
    EngineOptions options;
    options.max_tokens = c.max_position_embeddings;
    engine = std::make_unique<Engine>(model, *comm, options);
  }
  // Logprob of seq[t + 1] at input t, for t < len - 1; routes: (len, route_width) or empty.
  std::vector<float> logprobs(const std::vector<int32_t>& seq, const std::vector<int32_t>& routes) {
    const int64_t N = int64_t(seq.size()) - 1;
    const size_t n = seq.size() - 1;
    std::vector<int32_t> positions(n), seq_ids(n, 0), targets(seq.begin() + 1, seq.end());
    for (int64_t t = 0; t < N; ++t) positions[size_t(t)] = int32_t(t);
    std::vector<float> temperatures(n, 1.0f), out(n);
    TokenBatch b;
    b.N = N;
    b.tokens = seq.data();
    b.targets = targets.data();
    b.positions = positions.data();
    b.seq_ids = seq_ids.data();
    b.temperatures = temperatures.data();
    b.routes = routes.empty() ? nullptr : routes.data();  // row t: the route of input t
    engine->forward_token_logprobs(b, out.data());
    return out;
  }
};

struct Measured {
  double kl_plain = 0, kl_replay = 0;   // mean k3 over the drawn tokens
  double max_plain = 0, max_replay = 0; // largest |trainer - sampler logprob|
  int64_t tokens = 0, moved = 0;        // drawn tokens; those whose logprob replay changed
};

double k3(double d) { return std::expm1(d) - d; }

Measured measure(const ModelConfig& c, const InferenceModel& sampler, const std::vector<Completion>& done,
                 const std::vector<std::vector<int32_t>>& prompts, double relative_noise) {
  Trainer trainer(c, *sampler.weights, relative_noise);
  Measured m;
  for (const Completion& comp : done) {
    std::vector<int32_t> seq = prompts[size_t(comp.prompt)];
    const size_t P = seq.size();
    seq.insert(seq.end(), comp.tokens.begin(), comp.tokens.end());
    REQUIRE(comp.routes.size() == seq.size() * size_t(c.route_width()));
    const std::vector<float> plain = trainer.logprobs(seq, {});
    const std::vector<float> replay = trainer.logprobs(seq, comp.routes);
    for (size_t i = 0; i < comp.tokens.size(); ++i) {
      const double lp = comp.model_logprobs[i], a = plain[P - 1 + i], r = replay[P - 1 + i];
      m.kl_plain += k3(a - lp);
      m.kl_replay += k3(r - lp);
      m.max_plain = std::max(m.max_plain, std::abs(a - lp));
      m.max_replay = std::max(m.max_replay, std::abs(r - lp));
      m.moved += std::abs(a - r) > 1e-6;
      ++m.tokens;
    }
  }
  m.kl_plain /= double(m.tokens);
  m.kl_replay /= double(m.tokens);
  return m;
}

}  // namespace

TEST_SUITE("router replay") {

// Routes come from rollout files: an expert outside the model, or one twice in
// a token's K, is refused before any backend indexes with it, naming the token
// and the layer; a row of -1 (nothing recorded) routes by the router.
TEST_CASE("router replay refuses routes of another model: an expert out of range or repeated, naming token and layer") {
  const ModelConfig c = tiny_experts();
  ShardedModel weights(c, 0, 1);
  weights.init_seeded(5, 0.3);
  Trainer trainer(c, weights, 0.0);
  const std::vector<int32_t> seq = {1, 2, 3, 4};
  const int64_t R = c.route_width();  // 2 layers of experts, K = 2
  std::vector<int32_t> routes(seq.size() * size_t(R), -1);
  routes[1 * size_t(R) + 2] = 3, routes[1 * size_t(R) + 3] = 8;  // token 1, second layer: expert 8 of 8
  std::string message;
  try {
    trainer.logprobs(seq, routes);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("router replay: token 1 of the micro-batch, layer of experts 1, was routed to experts [3, 8] by "
                     "the sampler: each of the K = 2 must be distinct and in [0, 8)") != std::string::npos);
  routes[1 * size_t(R) + 3] = 3;  // the same expert twice
  message.clear();
  try {
    trainer.logprobs(seq, routes);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("was routed to experts [3, 3]") != std::string::npos);
  routes[1 * size_t(R) + 3] = 5;  // distinct and in range: replayed
  const std::vector<float> ok = trainer.logprobs(seq, routes);
  for (float lp : ok) CHECK(std::isfinite(lp));
}

TEST_CASE("the sampler records every fed token's experts (a group shares its prompt's); replayed, the trainer's "
          "logprobs are the sampler's with its weights, and the mismatch KL falls with perturbed weights") {
  const ModelConfig c = tiny_experts();
  const int64_t R = c.route_width();
  REQUIRE(R == 4);
  InferenceModel sampler;
  sampler.weights = std::make_unique<ShardedModel>(c, 0, 1);
  sampler.weights->init_seeded(5, 0.3);

  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 4; ++p) {
    std::vector<int32_t> ids;
    for (int t = 0; t < 5 + p; ++t) ids.push_back(int32_t((p * 13 + t * 7 + 3) % c.vocab_size));
    prompts.push_back(ids);
  }
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < 2; ++s) requests.push_back({int64_t(p), s, prompts[p]});  // a group of 2: one prefill
  GenerateOptions o;
  o.sampling.temperature = 1.0;
  o.sampling.seed = 9;
  o.max_new_tokens = 24;
  CpuDecoder decoder(sampler, plan_limits(c, requests, 3, o.max_new_tokens, "test"));
  decoder.record_routes();
  const std::vector<Completion> done = generate(decoder, requests, o);
  REQUIRE(done.size() == requests.size());

  for (const Completion& comp : done) {
    const size_t P = prompts[size_t(comp.prompt)].size(), T = P + comp.tokens.size();
    REQUIRE(comp.routes.size() == T * size_t(R));
    for (size_t t = 0; t + 1 < T; ++t)  // every fed position: K distinct experts per layer
      for (int64_t at = 0; at < R; at += 2) {
        const int32_t a = comp.routes[t * size_t(R) + size_t(at)], b = comp.routes[t * size_t(R) + size_t(at) + 1];
        CHECK((a >= 0 && a < c.num_experts && b >= 0 && b < c.num_experts && a != b));
      }
    for (int64_t k = 0; k < R; ++k) CHECK(comp.routes[(T - 1) * size_t(R) + size_t(k)] == -1);  // never fed
  }
  // The two samples of a prompt: the same prompt routes (one prefill), then their own.
  for (size_t i = 0; i + 1 < done.size(); i += 2) {
    const size_t P = prompts[size_t(done[i].prompt)].size();
    CHECK(std::equal(done[i].routes.begin(), done[i].routes.begin() + ptrdiff_t(P * size_t(R)),
                     done[i + 1].routes.begin()));
  }

  // The sampler's own weights: replayed, the trainer's logprobs are the sampler's.
  const Measured same = measure(c, sampler, done, prompts, 0.0);
  MESSAGE("identical weights: " << same.tokens << " drawn tokens, max |trainer - sampler logprob| with replay "
                                << same.max_replay << ", without " << same.max_plain);
  CHECK(same.max_replay < 1e-4);

  // Perturbed weights (relative 1e-2 on every weight: bf16 rounding is 4e-3, a step of training more).
  const Measured noisy = measure(c, sampler, done, prompts, 1e-2);
  MESSAGE("perturbed weights: mismatch KL without replay " << noisy.kl_plain << ", with replay " << noisy.kl_replay
          << " (max |dlogp| " << noisy.max_plain << " -> " << noisy.max_replay << "); replay changed "
          << noisy.moved << " of " << noisy.tokens << " logprobs");
  CHECK(noisy.moved > 0);  // the trainer's own top-k differs from the sampler's somewhere
  CHECK(noisy.kl_replay < noisy.kl_plain);
  CHECK(noisy.max_replay < noisy.max_plain);
}

TEST_CASE("recorded routes are those a prefill of the whole sequence computes, through decode steps, extends of "
          "observations between turns, and sequences that give way and are prefilled again") {
  const ModelConfig c = tiny_experts();
  const int64_t R = c.route_width();
  InferenceModel sampler;
  sampler.weights = std::make_unique<ShardedModel>(c, 0, 1);
  sampler.weights->init_seeded(8, 0.3);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < 4; ++p) {
    std::vector<int32_t> ids;
    for (int t = 0; t < 4 + 2 * p; ++t) ids.push_back(int32_t((p * 11 + t * 5 + 1) % c.vocab_size));
    prompts.push_back(ids);
  }
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < 2; ++s) requests.push_back({int64_t(p), s, prompts[p]});
  GenerateOptions o;
  o.sampling.temperature = 1.0;
  o.sampling.seed = 4;
  o.max_new_tokens = 20;
  for (int32_t id = 0; id < 8; ++id) o.stop_ids.push_back(id * 8);  // one token in 8 ends a turn
  o.next_turn = [](const GenerateRequest&, const Completion& done) -> std::optional<std::vector<int32_t>> {
    if (done.turns > 1) return std::nullopt;
    return std::vector<int32_t>{20, 21, 22};
  };
  DecoderLimits limits = plan_limits(c, requests, 4, o.max_new_tokens, "test");
  limits.block_size = 4;
  limits.blocks = 12;  // about two sequences at their longest: the latest admitted give way
  CpuDecoder decoder(sampler, limits);
  decoder.record_routes();
  GenerateStats stats;
  const std::vector<Completion> done = generate(decoder, requests, o, &stats);
  MESSAGE(stats.extends << " extends, " << stats.preemptions << " sequences gave way, " << stats.decode_steps
                        << " decode steps");
  CHECK(stats.extends > 0);
  CHECK(stats.preemptions > 0);

  int64_t rows = 0;
  for (const Completion& comp : done) {
    std::vector<int32_t> fed = prompts[size_t(comp.prompt)];
    fed.insert(fed.end(), comp.tokens.begin(), comp.tokens.end() - 1);  // every token but the last went in
    const std::vector<GenerateRequest> whole{{comp.prompt, comp.sample, fed}};
    GenerateOptions one = o;
    one.max_new_tokens = 1;
    one.next_turn = nullptr;
    CpuDecoder fresh(sampler, plan_limits(c, whole, 1, 1, "test"));
    fresh.record_routes();
    const Completion want = generate(fresh, whole, one)[0];
    REQUIRE(comp.routes.size() == (fed.size() + 1) * size_t(R));
    CHECK(std::equal(want.routes.begin(), want.routes.begin() + ptrdiff_t(fed.size()) * R, comp.routes.begin()));
    rows += int64_t(fed.size());
  }
  MESSAGE(rows << " fed positions compared");
}

TEST_CASE("the trainers' rollout source: with replay a file's routes reach the micro-batch at the input token; a "
          "file without routes, or of another width, is refused naming it; without replay its routes are unused") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("shardlm-replay-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const DeckResult deck = parse_deck_text(R"(
[run]
name = "replay"
dir = "runs/replay"
max_steps = 4
[model]
arch = "qwen3_moe"
qk_norm = true
vocab_size = 16
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 2
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 16
[data]
seq_len = 8
micro_batch = 2
rollout_timeout_s = 5
[loss]
type = "rl"
router_replay = true
)", "replay.toml", {"data.rollout_dir=" + dir.string()}, 1);
  for (const auto& e : deck.errors) MESSAGE(e);
  REQUIRE(deck.ok());
  const int64_t R = deck.config.model.arch.route_width();
  REQUIRE(R == 4);
  // One sample of 5 tokens: token t's route {t, t + 1, t + 2, t + 3} % 4 (t = 4, the last: -1).
  RolloutFile f;
  f.tokens = {1, 2, 3, 4, 5};
  f.offsets = {0, 5};
  f.loss_mask = {0, 0, 1, 1, 1};
  f.advantages = {1.0f};
  f.inference_logprobs = {0, 0, -0.5f, -0.5f, -0.5f};
  f.temperature = {1.0f};
  f.route_width = R;
  for (int32_t t = 0; t < 5; ++t)
    for (int32_t k = 0; k < R; ++k) f.routes.push_back(t == 4 ? -1 : (t + k) % 4);
  auto comm = make_self_comm();
  const auto source = [&](int64_t width) { return make_rollout_source(deck.config, 16, *comm, nullptr, width); };

  f.step = f.policy_step = 0;
  write_rollouts(dir.string(), f);
  auto replaying = source(R);
  replaying->begin(0);
  const TokenBatch b = replaying->micro_batch(0, 0, 0);
  REQUIRE(b.routes);
  for (int64_t at = 0; at < 4; ++at)  // input token t = at of the sample: its own route
    for (int64_t k = 0; k < R; ++k) CHECK(b.routes[at * R + k] == (at + k) % 4);
  for (int64_t at = 4; at < b.N; ++at) CHECK(b.routes[at * R] == -1);  // padding

  auto plain = source(0);
  plain->begin(0);
  CHECK(plain->micro_batch(0, 0, 0).routes == nullptr);

  RolloutFile without = f;
  without.step = without.policy_step = 1;
  without.routes.clear();
  without.route_width = 0;
  write_rollouts(dir.string(), without);
  std::string message;
  try {
    source(R)->begin(1);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("rollout file '" + rollout_path(dir.string(), 1) + "' has no dataset 'routes', which "
                     "loss.router_replay = true replays") != std::string::npos);
  message.clear();
  try {
    source(6)->begin(0);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("'routes' has rows of 4 experts, but this model routes each token to 6") != std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // TEST_SUITE
