// test_sharded.cpp — world-size invariance, memory scaling and activation
// checkpointing of sharded training, on the CPU backend through MPI.
//
// Each case trains the tiny deck twice inside one job: on a communicator of
// rank 0 alone (the -np 1 reference) and on every rank of the job, and compares.
#include <doctest/doctest.h>

#include <mpi.h>

#include <cmath>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/memory.hpp"
#include "train/train.hpp"

using namespace shardlm;

namespace {

Config tiny_deck(std::vector<std::string> sets, int world) {
  DeckResult r = parse_deck("inputs/tiny-sft.toml", sets, world);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  int64_t shard_and_optim_bytes = 0;  // measured from the allocator's counters
  int64_t activation_peak_bytes = 0;
  int64_t total_peak_bytes = 0;
  MemoryPlan plan;
};

// Trains `steps` steps on `comm` (a rank outside it passes MPI_COMM_NULL and waits).
Run train_on(MPI_Comm mpi, const Config& config, int steps) {
  Run run;
  if (mpi != MPI_COMM_NULL) {
    auto comm = make_mpi_comm(mpi);
    const MemCounters before = host_memory();
    reset_host_peaks();
    TrainSession session(config, *comm);
    const MemCounters built = host_memory();
    for (Mem m : {Mem::ParamShard, Mem::GradShard, Mem::OptimState})
      run.shard_and_optim_bytes += built.current[int(m)] - before.current[int(m)];
    for (int s = 0; s < steps; ++s) run.losses.push_back(session.step(s).loss);
    const MemCounters after = host_memory();
    run.activation_peak_bytes = after.peak[int(Mem::Activations)] - before.current[int(Mem::Activations)];
    run.total_peak_bytes = after.total_peak - before.total_current;
    run.plan = plan_memory(session.model.layout.config, comm->size(), engine_options_for(config),
                           session.optimizer.states(), session.engine.backend());
    if (session.data) run.plan.data_reader = session.data->memory().total();  // the token reader (Mem::Data)
    run.params = gather_all_params(session.model, *comm);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return run;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

}  // namespace

TEST_SUITE("sharded") {

TEST_CASE("np N matches np 1: losses every step and parameters after 30 steps") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  // global_batch must split over both 1 and `world` ranks: 12 rows = 1 x 12 = 2 x 6 = 3 x 4 = 4 x 3.
  const std::vector<std::string> sets = {"data.micro_batch=1", "data.global_batch=12", "run.max_steps=30"};
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  const Run one = train_on(solo, tiny_deck(sets, 1), 30);
  const Run all = train_on(MPI_COMM_WORLD, tiny_deck(sets, world), 30);
  if (solo != MPI_COMM_NULL) MPI_Comm_free(&solo);
  if (rank != 0) return;

  REQUIRE(one.losses.size() == 30);
  REQUIRE(all.losses.size() == 30);
  double worst = 0;
  for (int s = 0; s < 30; ++s) worst = std::max(worst, rel(all.losses[s], one.losses[s]));
  MESSAGE("world " << world << ": worst relative loss difference " << worst);
  CHECK(worst < 1e-5);
  CHECK(one.losses.back() < one.losses.front() - 1.0);  // and it learns

  double max_abs = 0;
  REQUIRE(one.params.size() == all.params.size());
  for (size_t i = 0; i < one.params.size(); ++i)
    for (size_t j = 0; j < one.params[i].size(); ++j)
      max_abs = std::max(max_abs, (double)std::fabs(one.params[i][j] - all.params[i][j]));
  MESSAGE("world " << world << ": max |param difference| after 30 steps " << max_abs);
  CHECK(max_abs < 1e-4);

  // Shards + optimizer state per rank fall as 1/N (padding allows a little more).
  const double ratio = double(all.shard_and_optim_bytes) / double(one.shard_and_optim_bytes);
  MESSAGE("world " << world << ": shard+optimizer bytes ratio " << ratio);
  CHECK(ratio <= 1.0 / world * 1.05 + 1e-9);
  CHECK(ratio >= 1.0 / world * 0.95);
}

TEST_CASE("a model of experts (qwen3_moe, the load-balancing loss on): np N matches np 1 over 30 steps") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<std::string> sets = {
      "data.micro_batch=1", "data.global_batch=12", "run.max_steps=30", "model.arch=qwen3_moe", "model.qk_norm=true",
      "model.tie_word_embeddings=false", "model.num_experts=4", "model.num_experts_per_tok=2",
      "model.moe_intermediate_size=48", "model.norm_topk_prob=true", "model.router_aux_loss=true",
      "model.router_aux_loss_coef=0.01"};
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  const Run one = train_on(solo, tiny_deck(sets, 1), 30);
  const Run all = train_on(MPI_COMM_WORLD, tiny_deck(sets, world), 30);
  if (solo != MPI_COMM_NULL) MPI_Comm_free(&solo);
  if (rank != 0) return;

  REQUIRE(one.losses.size() == 30);
  REQUIRE(all.losses.size() == 30);
  double worst = 0;
  for (int s = 0; s < 30; ++s) worst = std::max(worst, rel(all.losses[s], one.losses[s]));
  MESSAGE("experts, world " << world << ": worst relative loss difference " << worst << "; loss "
                            << one.losses.front() << " -> " << one.losses.back());
  CHECK(worst < 1e-6);
  CHECK(one.losses.back() < one.losses.front() - 1.0);
  double max_abs = 0;
  REQUIRE(one.params.size() == all.params.size());
  for (size_t i = 0; i < one.params.size(); ++i)
    for (size_t j = 0; j < one.params[i].size(); ++j)
      max_abs = std::max(max_abs, (double)std::fabs(one.params[i][j] - all.params[i][j]));
  MESSAGE("experts, world " << world << ": max |param difference| after 30 steps " << max_abs);
  CHECK(max_abs < 1e-4);
}

TEST_CASE("model.fp8: np N matches np 1 in both modes; the losses follow fp32's; none is untouched") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int steps = 8;
  const std::vector<std::string> base = {"data.micro_batch=1", "data.global_batch=12", "run.max_steps=8"};
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  std::vector<std::string> none_sets = base;
  none_sets.push_back("model.fp8=none");
  const Run none = train_on(solo, tiny_deck(none_sets, 1), steps);
  const Run plain = train_on(solo, tiny_deck(base, 1), steps);
  for (const char* mode : {"tensorwise", "rowwise"}) {
    std::vector<std::string> sets = base;
    sets.push_back(std::string("model.fp8=") + mode);
    const Run one = train_on(solo, tiny_deck(sets, 1), steps);
    const Run all = train_on(MPI_COMM_WORLD, tiny_deck(sets, world), steps);
    if (rank != 0) continue;
    const std::string name = mode;
    CAPTURE(name);
    REQUIRE(one.losses.size() == size_t(steps));
    REQUIRE(all.losses.size() == size_t(steps));
    // World-size invariance: the scales come from gathered weights and whole micro-batches, so
    // step 0 (the same weights) agrees to the loss all-reduce's order. After it the masters differ
    // by the gradient sums' order (1e-10 here, as without FP8), and a value that moves by an ulp
    // across an e4m3 rounding boundary moves by 2^-4 of itself: measured 4e-5 at -np 3 and 4.
    double worst = 0, from_fp32 = 0;
    for (int s = 0; s < steps; ++s) {
      worst = std::max(worst, rel(all.losses[size_t(s)], one.losses[size_t(s)]));
      from_fp32 = std::max(from_fp32, rel(one.losses[size_t(s)], plain.losses[size_t(s)]));
    }
    MESSAGE(name << ", world " << world << ": worst relative loss difference to np 1 " << worst
                 << "; to fp32 " << from_fp32);
    CHECK(rel(all.losses[0], one.losses[0]) < 1e-12);
    CHECK(worst < 2e-4);
    // FP8 changes the numbers (e4m3's 3 mantissa bits), but by little: the loss follows fp32's.
    CHECK(rel(one.losses[0], plain.losses[0]) > 1e-7);
    CHECK(from_fp32 < 2e-2);
    CHECK(one.losses.back() < one.losses.front() - 0.5);  // and it learns
  }
  if (solo != MPI_COMM_NULL) MPI_Comm_free(&solo);
  if (rank != 0) return;
  // "none" (given) is the default: the same bits.
  for (int s = 0; s < steps; ++s) CHECK(none.losses[size_t(s)] == plain.losses[size_t(s)]);
}

TEST_CASE("the memory plan is within 10% of the measured peak") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  for (const char* deck : {"inputs/tiny-sft.toml", "inputs/small-sft.toml"}) {
    DeckResult r = parse_deck(deck, {"data.global_batch=" + std::to_string(4 * world), "data.micro_batch=2"}, world);
    REQUIRE(r.ok());
    const Run run = train_on(MPI_COMM_WORLD, r.config, 2);
    const double err = rel(double(run.total_peak_bytes), double(run.plan.total()));
    MESSAGE(std::string(deck) << " world " << world << ": measured peak " << run.total_peak_bytes << " B, plan "
                 << run.plan.total() << " B");
    CHECK(err < 0.10);
  }
}

TEST_CASE("activation checkpointing: same losses, less activation memory") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<std::string> base = {"data.micro_batch=1", "data.global_batch=" + std::to_string(2 * world)};
  auto with_ckpt = base;
  with_ckpt.push_back("model.activation_checkpointing=full");
  const Run off = train_on(MPI_COMM_WORLD, tiny_deck(base, world), 5);
  const Run on = train_on(MPI_COMM_WORLD, tiny_deck(with_ckpt, world), 5);
  for (int s = 0; s < 5; ++s) CHECK(rel(on.losses[s], off.losses[s]) < 1e-6);
  MESSAGE("activation bytes: off " << off.activation_peak_bytes << ", full " << on.activation_peak_bytes);
  CHECK(on.activation_peak_bytes < off.activation_peak_bytes);
}

TEST_CASE("selective checkpointing: the losses of full, attention not recomputed, memory between none and full") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<std::string> base = {"data.micro_batch=1", "data.global_batch=" + std::to_string(2 * world)};
  auto full = base, selective = base;
  full.push_back("model.activation_checkpointing=full");
  selective.push_back("model.activation_checkpointing=selective");
  const Run none_run = train_on(MPI_COMM_WORLD, tiny_deck(base, world), 4);
  const Run full_run = train_on(MPI_COMM_WORLD, tiny_deck(full, world), 4);
  const Run sel_run = train_on(MPI_COMM_WORLD, tiny_deck(selective, world), 4);
  // The kept attention is the one the recompute would produce: same bits.
  for (int s = 0; s < 4; ++s) CHECK(sel_run.losses[s] == full_run.losses[s]);
  MESSAGE("activation bytes: none " << none_run.activation_peak_bytes << ", full " << full_run.activation_peak_bytes
                                    << ", selective " << sel_run.activation_peak_bytes);
  CHECK(sel_run.activation_peak_bytes > full_run.activation_peak_bytes);
  CHECK(sel_run.activation_peak_bytes < none_run.activation_peak_bytes);

  // model.selective_layers = 1 of the tiny deck's 2: layer 0 keeps its attention,
  // layer 1 recomputes it. Same bits again, and the memory of one kept layer:
  // half of what keeping both adds over full (4·N·H·(D + 1) bytes per layer).
  auto one = selective;
  one.push_back("model.selective_layers=1");
  const Run one_run = train_on(MPI_COMM_WORLD, tiny_deck(one, world), 4);
  for (int s = 0; s < 4; ++s) CHECK(one_run.losses[s] == full_run.losses[s]);
  MESSAGE("activation bytes: selective_layers = 1: " << one_run.activation_peak_bytes);
  CHECK(2 * (one_run.activation_peak_bytes - full_run.activation_peak_bytes) ==
        sel_run.activation_peak_bytes - full_run.activation_peak_bytes);
  CHECK(one_run.activation_peak_bytes > full_run.activation_peak_bytes);
}

TEST_CASE("reshard_after_forward = false gives the same losses") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const std::vector<std::string> base = {"data.micro_batch=1", "data.global_batch=" + std::to_string(2 * world)};
  auto keep = base;
  keep.push_back("model.reshard_after_forward=false");
  const Run a = train_on(MPI_COMM_WORLD, tiny_deck(base, world), 4);
  const Run b = train_on(MPI_COMM_WORLD, tiny_deck(keep, world), 4);
  for (int s = 0; s < 4; ++s) CHECK(a.losses[s] == b.losses[s]);  // same arithmetic, bit for bit
}


TEST_CASE("the eval loss is the same at every world size, an uneven last round included") {
  int world = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // eval.rows = 36: 18 micro-batches of 2 rows, which 4 ranks cannot share evenly (some run an empty one).
  const Config config = tiny_deck({"data.global_batch=" + std::to_string(4 * world), "data.shuffle=false",
                                   "eval.path=inputs/data/tiny.h5", "eval.rows=36"},
                                  world);
  auto all = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession session(config, *all);
  StepStats here;
  session.evaluate(here);
  double reference = 0;
  int64_t reference_tokens = 0;
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &self);
  if (self != MPI_COMM_NULL) {
    auto one = make_mpi_comm(self);
    TrainSession alone(tiny_deck({"data.global_batch=4", "data.shuffle=false", "eval.path=inputs/data/tiny.h5",
                                  "eval.rows=36"},
                                 1),
                       *one);
    StepStats s;
    alone.evaluate(s);
    reference = s.eval_loss, reference_tokens = s.eval_loss_tokens;
    MPI_Comm_free(&self);
  }
  MPI_Bcast(&reference, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Bcast(&reference_tokens, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  MESSAGE("world " << world << ": eval loss " << here.eval_loss << ", one rank " << reference);
  CHECK(here.eval_loss_tokens == reference_tokens);
  CHECK(here.eval_loss == doctest::Approx(reference).epsilon(1e-6));
  CHECK(here.eval_loss > 5.0);  // about log(258) at the seeded init
}

}  // TEST_SUITE
