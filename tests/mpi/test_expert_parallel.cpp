// test_expert_parallel.cpp — expert parallelism (model.expert_parallel) on the
// CPU backend: the rows' exchange (to the experts' ranks and back, exactly),
// whole training runs with the experts split over every rank of the job
// against one rank holding them all, and checkpoints and exports across the two.
//
// At -np 1 there is nothing to split: the cases that need two ranks say so and
// return.
#include <doctest/doctest.h>

#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "cpu/expert_parallel.hpp"
#include "cpu/moe.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "train/engine.hpp"
#include "train/train.hpp"
#include "../test_util.hpp"
#include "mpi_world.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

using shardlm_test::SharedDir;
using shardlm_test::world_rank;
using shardlm_test::world_size;

// ---------------------------------------------------------------- the exchange

// Rank q's routing of its tokens in the exchange test: N = 5 + 3 q tokens, K
// of E experts each, from logits that are a function of (q, token, expert), so
// every rank can rebuild every other rank's.
struct RankRouting {
  int64_t N;
  std::vector<float> probs, weight;
  std::vector<int32_t> expert, slot, row;
  std::vector<int64_t> offsets;
  cpu::MoeRouting<float> r;
  RankRouting(int q, int64_t E, int64_t K)
      : N(5 + 3 * int64_t(q)), probs(size_t(N * E)), weight(size_t(N * K)), expert(size_t(N * K)),
        slot(size_t(N * K)), row(size_t(N * K)), offsets(size_t(E + 1)) {
    std::vector<float> logits(size_t(N * E));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) logits[size_t(n * E + e)] = float(std::sin(1.3 * n + 0.77 * e + 2.1 * q));
    r = {probs.data(), expert.data(), weight.data(), offsets.data(), slot.data(), row.data()};
    cpu::moe_route(r, logits.data(), N, E, K, true);
  }
};

// A token's input, exact in fp32: (rank, token, channel) as one integer.
float token_value(int q, int64_t n, int64_t c) { return float(q * 65536 + n * 64 + c); }

// ---------------------------------------------------------------- training runs


std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A small model of experts on the tiny deck: 12 experts (they split over 1, 2,
// 3 and 4 ranks), 2 a token, the load-balancing loss on; global_batch 12 rows
// splits over the same ranks with micro_batch 1.
std::vector<std::string> experts_sets(const std::string& arch) {
  std::vector<std::string> sets = {"data.micro_batch=1", "data.global_batch=12", "run.max_steps=30",
                                   "model.arch=" + arch, "model.tie_word_embeddings=false", "model.num_experts=12",
                                   "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
                                   "model.router_aux_loss=true", "model.router_aux_loss_coef=0.01"};
  if (arch == "qwen3_moe") sets.insert(sets.end(), {"model.qk_norm=true", "model.norm_topk_prob=true"});
  else sets.insert(sets.end(), {"model.attention_bias=true", "model.shared_expert_intermediate_size=48"});
  return sets;
}

Config deck(std::vector<std::string> sets, int world, int64_t expert_parallel, const fs::path& run_dir = {}) {
  sets.push_back("model.expert_parallel=" + std::to_string(expert_parallel));
  if (!run_dir.empty()) sets.push_back("run.dir=" + run_dir.string());
  DeckResult r = parse_deck("inputs/tiny-sft.toml", sets, world);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> params;  // by name: the layouts order them differently
};

// Trains steps [0, steps) on `mpi` (a rank outside it passes MPI_COMM_NULL and waits).
Run train_on(MPI_Comm mpi, const Config& config, int steps) {
  Run run;
  if (mpi != MPI_COMM_NULL) {
    auto comm = make_mpi_comm(mpi);
    TrainSession session(config, *comm);
    for (int s = 0; s < steps; ++s) run.losses.push_back(session.step(s).loss);
    const std::vector<std::vector<float>> values = gather_all_params(session.model, *comm);
    const auto located = session.model.layout.all_params();
    for (size_t i = 0; i < located.size(); ++i) run.params[located[i].param->name] = values[i];
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return run;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

// Every rank of the job against rank 0 alone holding every expert, 30 steps;
// `split_sets` for the split run only (levers that must not change the numbers).
void check_world_invariance(const std::string& arch, const std::vector<std::string>& split_sets) {
  const int W = world_size();
  if (W < 2) {
    MESSAGE("one rank: no experts to split over ranks");
    return;
  }
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  const Run one = train_on(solo, deck(experts_sets(arch), 1, 1), 30);
  std::vector<std::string> sets = experts_sets(arch);
  sets.insert(sets.end(), split_sets.begin(), split_sets.end());
  const Run all = train_on(MPI_COMM_WORLD, deck(sets, W, W), 30);
  if (solo != MPI_COMM_NULL) MPI_Comm_free(&solo);
  if (world_rank() != 0) return;
  REQUIRE(one.losses.size() == 30);
  REQUIRE(all.losses.size() == 30);
  double worst = 0;
  for (int s = 0; s < 30; ++s) worst = std::max(worst, rel(all.losses[size_t(s)], one.losses[size_t(s)]));
  MESSAGE(arch << ", experts over " << W << " ranks: worst relative loss difference to one rank " << worst
               << "; loss " << one.losses.front() << " -> " << one.losses.back());
  CHECK(worst < 1e-6);
  CHECK(one.losses.back() < one.losses.front() - 1.0);  // and it learns
  REQUIRE(one.params.size() == all.params.size());
  double max_abs = 0;
  for (const auto& [name, values] : one.params) {
    REQUIRE(all.params.count(name) == 1);
    const std::vector<float>& other = all.params.at(name);
    REQUIRE(other.size() == values.size());
    for (size_t j = 0; j < values.size(); ++j) max_abs = std::max(max_abs, double(std::fabs(values[j] - other[j])));
  }
  MESSAGE(arch << ", experts over " << W << " ranks: max |param difference| after 30 steps " << max_abs);
  CHECK(max_abs < 1e-4);
}

// ---------------------------------------------------------------- one micro-batch

ModelConfig replay_model() {
  ModelConfig c = shardlm_test::tiny_experts(12);  // 12 experts: over 1, 2, 3 or 4 ranks
  c.router_aux_loss = true;
  return c;
}

// Rank q's micro-batch: two sequences of 12 tokens, and the experts a sampler
// chose for each (route_width() a token: two distinct at each layer of
// experts), but for every fifth token (nothing recorded: its own top-k).
struct ReplayBatch {
  static constexpr int64_t N = 24;
  std::vector<int32_t> tokens, targets, positions, seq_ids, routes;
  std::vector<float> weights, temperatures;
  TokenBatch batch(bool replay) const {
    TokenBatch b;
    b.N = N;
    b.tokens = tokens.data(), b.targets = targets.data(), b.weights = weights.data();
    b.positions = positions.data(), b.seq_ids = seq_ids.data(), b.temperatures = temperatures.data();
    b.routes = replay ? routes.data() : nullptr;
    b.router_aux_scale = 0.01;
    return b;
  }
  ReplayBatch(int q, const ModelConfig& c)
      : tokens(N), targets(N), positions(N), seq_ids(N), weights(N, 1.0f), temperatures(N, 1.0f) {
    const int64_t W = c.route_width(), K = c.num_experts_per_tok, E = c.num_experts;
    routes.assign(size_t(N * W), -1);
    for (int64_t n = 0; n < N; ++n) {
      tokens[size_t(n)] = int32_t((7 * n + 13 * q + 3) % c.vocab_size);
      targets[size_t(n)] = int32_t((5 * n + 11 * q + 1) % c.vocab_size);
      positions[size_t(n)] = int32_t(n % 12), seq_ids[size_t(n)] = int32_t(n / 12);
      if (n % 5 == 4) continue;
      for (int64_t at = 0; at < W; at += K) {
        const int32_t first = int32_t((5 * n + 3 * at + q) % E);
        routes[size_t(n * W + at)] = first;
        routes[size_t(n * W + at + 1)] = int32_t((first + 1 + n % (E - 1)) % E);
      }
    }
  }
};

struct BatchNumbers {
  double loss = 0, router_aux = 0, loss_plain = 0;  // with the routes replayed; without
  std::vector<float> logprobs;                       // (N) replayed
};

// Forward, loss and backward of rank q's micro-batch, then its replayed logprobs, on `engine`.
BatchNumbers run_batch(Engine& engine, const ReplayBatch& rb) {
  BatchNumbers out;
  const LossStats replayed = engine.forward_backward(rb.batch(true), 1.0f);
  out.loss = replayed.loss, out.router_aux = replayed.router_aux_sum;
  out.loss_plain = engine.forward_backward(rb.batch(false), 1.0f).loss;
  out.logprobs.resize(size_t(ReplayBatch::N));
  engine.forward_token_logprobs(rb.batch(true), out.logprobs.data());
  return out;
}

}  // namespace

TEST_SUITE("expert_parallel") {

TEST_CASE("the exchange: each routed row reaches its expert's rank in (rank, expert, token) order, and the owners' "
          "results come back to their rows exactly") {
  const int P = world_size(), me = world_rank();
  const int64_t Ep = 2, E = Ep * P, K = 2, C = 8;
  auto group = make_mpi_comm(MPI_COMM_WORLD);
  const RankRouting mine(me, E, K);
  const int64_t N = mine.N, R = N * K;
  std::vector<float> x(size_t(N * C));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) x[size_t(n * C + c)] = token_value(me, n, c);
  std::vector<float> local(size_t(R * C));
  cpu::moe_gather_rows(local.data(), x.data(), mine.r, N, C, K);

  // Every rank's rows per expert, as the layer all-gathers them.
  std::vector<int32_t> own_rows(static_cast<size_t>(E)), rows_per_expert(static_cast<size_t>(P * E));
  for (int64_t e = 0; e < E; ++e) own_rows[size_t(e)] = int32_t(mine.offsets[e + 1] - mine.offsets[e]);
  group->all_gather(own_rows.data(), rows_per_expert.data(), E, DType::F32).wait();
  cpu::ExpertExchange plan;
  cpu::plan_expert_exchange(plan, rows_per_expert.data(), me, P, E, C);

  // What each owner must hold: rank q's tokens that chose each of its experts, in token order.
  int64_t expected_rows = 0;
  std::vector<float> expected;
  std::vector<int64_t> expected_groups = {0};
  for (int q = 0; q < P; ++q) {
    const RankRouting theirs(q, E, K);
    for (int64_t j = 0; j < Ep; ++j) {
      const int64_t e = me * Ep + j;
      for (int64_t n = 0; n < theirs.N; ++n)
        for (int64_t k = 0; k < K; ++k)
          if (theirs.expert[size_t(n * K + k)] == e) {
            for (int64_t c = 0; c < C; ++c) expected.push_back(token_value(q, n, c));
            ++expected_rows;
          }
      expected_groups.push_back(expected_rows);
    }
  }
  CHECK(plan.rows_received == expected_rows);
  CHECK(plan.groups == expected_groups);
  std::vector<float> owned(size_t(std::max<int64_t>(1, plan.rows_received) * C), -1.0f);
  cpu::rows_to_owners(*group, plan, local.data(), owned.data());
  owned.resize(size_t(plan.rows_received * C));
  CHECK(owned == expected);

  // The owner scales each row by its expert's number + 1; each row must come back scaled by its own.
  std::vector<float> results(owned.size());
  for (int64_t g = 0; g < P * Ep; ++g)
    for (int64_t row = plan.groups[size_t(g)]; row < plan.groups[size_t(g + 1)]; ++row)
      for (int64_t c = 0; c < C; ++c)
        results[size_t(row * C + c)] = owned[size_t(row * C + c)] * float(me * Ep + g % Ep + 1);
  std::vector<float> back(size_t(R * C), -1.0f);
  cpu::rows_from_owners(*group, plan, results.data(), back.data());
  int64_t wrong = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t row = mine.offsets[e]; row < mine.offsets[e + 1]; ++row)
      for (int64_t c = 0; c < C; ++c) wrong += back[size_t(row * C + c)] != local[size_t(row * C + c)] * float(e + 1);
  CHECK(wrong == 0);
  CHECK(R > 0);
}

TEST_CASE("router replay and the load-balancing loss: each rank's micro-batch gives one rank's numbers with the "
          "experts split over every rank") {
  const int W = world_size(), me = world_rank();
  const ModelConfig c = replay_model();
  EngineOptions options;
  options.max_tokens = ReplayBatch::N;
  options.expert_parallel = W;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  ShardedModel split(c, me, W, true, W);
  split.init_seeded(99, 0.2);
  Engine engine(split, *comm, options);
  if (W > 1) engine.backend().set_expert_parallel(*comm);
  const BatchNumbers mine = run_batch(engine, ReplayBatch(me, c));
  // Rank 0 alone, every expert, each rank's micro-batch in turn.
  std::vector<double> sums = {mine.loss, mine.router_aux, mine.loss_plain}, all_sums(size_t(3 * W));
  std::vector<float> all_logprobs(size_t(W * ReplayBatch::N));
  MPI_Gather(sums.data(), 3, MPI_DOUBLE, all_sums.data(), 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(mine.logprobs.data(), int(ReplayBatch::N), MPI_FLOAT, all_logprobs.data(), int(ReplayBatch::N),
             MPI_FLOAT, 0, MPI_COMM_WORLD);
  if (me != 0) return;
  auto self = make_self_comm();
  ShardedModel whole(c, 0, 1);
  whole.init_seeded(99, 0.2);
  EngineOptions one = options;
  one.expert_parallel = 1;
  Engine reference(whole, *self, one);
  double worst_loss = 0, worst_aux = 0, worst_logprob = 0, replay_moved = 0;
  for (int q = 0; q < W; ++q) {
    const BatchNumbers ref = run_batch(reference, ReplayBatch(q, c));
    worst_loss = std::max(worst_loss, rel(all_sums[size_t(3 * q)], ref.loss));
    worst_aux = std::max(worst_aux, rel(all_sums[size_t(3 * q + 1)], ref.router_aux));
    worst_loss = std::max(worst_loss, rel(all_sums[size_t(3 * q + 2)], ref.loss_plain));
    for (int64_t n = 0; n < ReplayBatch::N; ++n)
      worst_logprob = std::max(worst_logprob, double(std::fabs(all_logprobs[size_t(q * ReplayBatch::N + n)] -
                                                               ref.logprobs[size_t(n)])));
    replay_moved = std::max(replay_moved, rel(ref.loss, ref.loss_plain));
    CHECK(ref.router_aux > 0);
  }
  MESSAGE("experts over " << W << " ranks: worst relative difference to one rank of the loss " << worst_loss
                          << ", the load-balancing loss " << worst_aux << "; max |logprob difference| "
                          << worst_logprob << "; replay moves the loss by " << replay_moved);
  CHECK(worst_loss < 1e-6);
  CHECK(worst_aux < 1e-12);  // the routing is the same bits: the router is the same GEMM on the same rows
  CHECK(worst_logprob < 1e-5);
  CHECK(replay_moved > 1e-4);  // the routes were taken
}

TEST_CASE("qwen3_moe, 12 experts over every rank (every unit kept gathered): the losses of one rank holding them "
          "all, over 30 steps") {
  check_world_invariance("qwen3_moe", {"model.reshard_after_forward=false"});
}

TEST_CASE("qwen2_moe with its shared expert, 12 experts over every rank (activation checkpointing: the exchange "
          "recomputed in backward): one rank's losses over 30 steps") {
  check_world_invariance("qwen2_moe", {"model.activation_checkpointing=full"});
}

TEST_CASE("the layout: each rank holds a 1/P share of the experts, and the memory plan gathers none of them") {
  const int W = std::max(2, world_size());
  const Config ep = deck(experts_sets("qwen3_moe"), W, W), plain = deck(experts_sets("qwen3_moe"), W, 1);
  const ModelConfig arch = model_config_for(ep);
  const ModelLayout split(arch, W, W), whole(arch, W, 1);
  // An experts unit per layer after the head: 3 x 32 x 64 floats an expert, 12 / W experts a rank.
  REQUIRE(split.units.size() == whole.units.size() + size_t(arch.num_layers));
  for (int l = 0; l < int(arch.num_layers); ++l) {
    const Unit& x = split.units[size_t(split.experts_unit[size_t(l)])];
    CHECK(x.kind == UnitKind::Experts);
    CHECK(x.shard_numel == 12 / W * 3 * 32 * 64);
    CHECK(x.shard_numel * W == x.numel);
    // Rank r's shard starts at expert r * 12 / W's gate_proj.
    for (int r = 0; r < W; ++r)
      CHECK(x.param("experts." + std::to_string(r * 12 / W) + ".gate_proj.weight").offset == r * x.shard_numel);
    CHECK(split.layer(l).find_param("experts.0.gate_proj.weight") == nullptr);
    CHECK(expert_stride(x) == 3 * 32 * 64);
    CHECK(expert_stride(whole.layer(l)) == 32 * 64);
  }
  CHECK(split.parameter_count() == whole.parameter_count());
  // Not gathered: the gather and gradient slots hold the largest other unit, not a layer with its experts.
  auto backend = make_cpu_backend();
  const MemoryPlan with = plan_memory(arch, W, engine_options_for(ep), 2, *backend);
  const MemoryPlan without = plan_memory(arch, W, engine_options_for(plain), 2, *backend);
  MESSAGE("gathered units and gradient slots at " << W << " ranks: " << with.gathered << " B with the experts split, "
                                                  << without.gathered << " B without");
  CHECK(with.gathered < without.gathered / 2);
}

TEST_CASE("checkpoints cross model.expert_parallel both ways; an export with the experts split is the same file") {
  const int W = world_size();
  if (W < 2) {
    MESSAGE("one rank: no experts to split over ranks");
    return;
  }
  const std::vector<std::string> sets = experts_sets("qwen3_moe");
  SharedDir solo_dir, split_dir, export_solo, export_split;
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  // One rank, every expert: 10 steps, save, export, 10 more (the reference).
  std::vector<double> reference;
  if (solo != MPI_COMM_NULL) {
    auto comm = make_mpi_comm(solo);
    TrainSession s(deck(sets, 1, 1, solo_dir.path), *comm);
    for (int step = 0; step < 10; ++step) s.step(step);
    REQUIRE(save_checkpoint(s, solo, 10, 0).ok);
    export_hf(s.model, *comm, export_solo.path, "F32");
    for (int step = 10; step < 20; ++step) reference.push_back(s.step(step).loss);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // Every rank, experts split: resume from it, export (the same bytes), 10 steps (the same losses).
  std::vector<double> resumed_split;
  {
    auto comm = make_mpi_comm(MPI_COMM_WORLD);
    TrainSession s(deck(sets, W, W, solo_dir.path), *comm);
    REQUIRE(resume(s, MPI_COMM_WORLD).step == 10);
    export_hf(s.model, *comm, export_split.path, "F32");
    for (int step = 10; step < 20; ++step) resumed_split.push_back(s.step(step).loss);
  }
  // Every rank, experts split: 10 steps and save; one rank holding every expert resumes from it.
  {
    auto comm = make_mpi_comm(MPI_COMM_WORLD);
    TrainSession s(deck(sets, W, W, split_dir.path), *comm);
    for (int step = 0; step < 10; ++step) s.step(step);
    REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 10, 0).ok);
  }
  std::vector<double> resumed_solo;
  if (solo != MPI_COMM_NULL) {
    auto comm = make_mpi_comm(solo);
    TrainSession s(deck(sets, 1, 1, split_dir.path), *comm);
    const ResumePoint p = resume(s, solo);
    REQUIRE(p.step == 10);
    CHECK(read_checkpoint_info(p.path).world_size_at_save == W);
    for (int step = 10; step < 20; ++step) resumed_solo.push_back(s.step(step).loss);
    MPI_Comm_free(&solo);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() != 0) return;
  REQUIRE(reference.size() == 10);
  REQUIRE(resumed_split.size() == 10);
  REQUIRE(resumed_solo.size() == 10);
  double worst_split = 0, worst_solo = 0;
  for (size_t i = 0; i < 10; ++i) {
    worst_split = std::max(worst_split, rel(resumed_split[i], reference[i]));
    worst_solo = std::max(worst_solo, rel(resumed_solo[i], reference[i]));
  }
  MESSAGE("saved on 1 rank, resumed with the experts over " << W << ": worst relative loss difference " << worst_split
                                                            << "; saved split, resumed on 1: " << worst_solo);
  CHECK(worst_split < 1e-6);
  CHECK(worst_solo < 1e-6);
  for (const char* file : {"model.safetensors", "config.json"}) {
    const std::string a = read_bytes(export_solo.path / file), b = read_bytes(export_split.path / file);
    CAPTURE(file);
    CHECK(a.size() > 0);
    CHECK(a == b);
  }
}

}  // TEST_SUITE
