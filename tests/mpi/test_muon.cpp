// test_muon.cpp — Muon sharded over ranks: all_to_all_v, and world-size invariance
// of training (losses, parameters and the momentum state) against one rank.
//
// Like test_sharded.cpp, each training case runs the tiny deck twice inside one
// job: on a communicator of rank 0 alone (the -np 1 reference) and on every rank.
// The checkpoint case saves Muon's state at N ranks and resumes it on one.
#include <doctest/doctest.h>

#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "train/muon.hpp"
#include "train/train.hpp"

using namespace shardlm;

namespace {

// The tiny deck with optim.name = "muon" set on the parsed Config (the deck key
// is refused until config.cpp lifts "not implemented yet").
Config tiny_muon_deck(int world) {
  DeckResult r = parse_deck("inputs/tiny-sft.toml",
                            {"data.micro_batch=1", "data.global_batch=12", "run.max_steps=30"}, world);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  Config c = r.config;
  c.optim.name = "muon";
  c.optim.lr = 0.01;
  c.optim.weight_decay = 0.01;
  c.optim.adamw_lr = 3e-3;
  return c;
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> momentum;  // per unit, gathered (padded_numel)
  int64_t floats_sent_per_step = 0;
};

// Until train.cpp hands the Comm to the Optimizer, build the session with AdamW
// and put a Muon optimizer over the same shards and Comm.
std::unique_ptr<TrainSession> muon_session(const Config& muon, Comm& comm) {
  Config adamw = muon;
  adamw.optim.name = "adamw";
  auto session = std::make_unique<TrainSession>(adamw, comm);
  session->config = muon;
  session->optimizer = Optimizer(muon.optim, session->model, comm);
  REQUIRE(session->optimizer.muon() != nullptr);
  return session;
}

Run train_on(MPI_Comm mpi, const Config& muon, int steps) {
  Run run;
  if (mpi != MPI_COMM_NULL) {
    auto comm = make_mpi_comm(mpi);
    const auto owned = muon_session(muon, *comm);
    TrainSession& session = *owned;
    run.floats_sent_per_step = session.optimizer.muon()->plan().floats_sent_per_step;
    for (int s = 0; s < steps; ++s) run.losses.push_back(session.step(s).loss);
    run.params = gather_all_params(session.model, *comm);
    for (size_t u = 0; u < session.model.layout.units.size(); ++u) {
      std::vector<float> full(size_t(session.model.layout.units[u].padded_numel));
      comm->all_gather(session.optimizer.state(0)[u].data(), full.data(), session.model.layout.units[u].shard_numel)
          .wait();
      full.resize(size_t(session.model.layout.units[u].numel));  // padding differs by world size
      run.momentum.push_back(std::move(full));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return run;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

// Steps [from, to) of `session`, their losses.
std::vector<double> train(TrainSession& session, int from, int to) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) losses.push_back(session.step(s).loss);
  return losses;
}

// A run directory every rank agrees on (rank 0's pid), removed at the end.
struct SharedRunDir {
  std::filesystem::path path;
  SharedRunDir() {
    int pid = int(getpid());
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    static int serial = 0;
    path = std::filesystem::temp_directory_path() /
           ("shardlm-muon-" + std::to_string(pid) + "-" + std::to_string(serial++));
  }
  ~SharedRunDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::filesystem::remove_all(path);
  }
};

}  // namespace

TEST_SUITE("muon") {

TEST_CASE("all_to_all_v delivers every block to its rank and place") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  // Rank r sends (r + p) % 3 values to rank p (some blocks empty), each value naming (r, p, i).
  auto count = [](int from, int to) { return int64_t((from + to) % 3); };
  std::vector<int64_t> sc(world), sd(world), rc(world), rd(world);
  int64_t so = 0, ro = 0;
  for (int p = 0; p < world; ++p) {
    sd[p] = so;
    so += sc[p] = count(rank, p);
    rd[p] = ro + 1;  // leave a gap: displacements must be honoured
    ro += (rc[p] = count(p, rank)) + 1;
  }
  std::vector<float> send(static_cast<size_t>(so)), recv(static_cast<size_t>(ro) + 1, -1.0f);
  for (int p = 0; p < world; ++p)
    for (int64_t i = 0; i < sc[p]; ++i) send[size_t(sd[p] + i)] = float(100 * rank + 10 * p + i);
  comm->all_to_all_v(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data());
  int wrong = 0;
  for (int p = 0; p < world; ++p) {
    for (int64_t i = 0; i < rc[p]; ++i) wrong += recv[size_t(rd[p] + i)] != float(100 * p + 10 * rank + i);
    wrong += recv[size_t(rd[p] - 1)] != -1.0f;  // the gap is untouched
  }
  CHECK(wrong == 0);
}

TEST_CASE("Muon: np N matches np 1 on the tiny deck (losses, parameters, momentum), and the loss falls") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  const Run one = train_on(solo, tiny_muon_deck(1), 30);
  const Run all = train_on(MPI_COMM_WORLD, tiny_muon_deck(world), 30);
  if (solo != MPI_COMM_NULL) MPI_Comm_free(&solo);

  int64_t sent = all.floats_sent_per_step, most_sent = sent;
  MPI_Allreduce(MPI_IN_PLACE, &most_sent, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (rank != 0) return;

  REQUIRE(one.losses.size() == 30);
  REQUIRE(all.losses.size() == 30);
  double worst = 0;
  for (int s = 0; s < 30; ++s) worst = std::max(worst, rel(all.losses[s], one.losses[s]));
  MESSAGE("muon, world " << world << ": losses " << one.losses.front() << " -> " << one.losses.back()
                         << ", worst relative loss difference to np 1 " << worst);
  CHECK(worst < 1e-5);
  CHECK(one.losses.back() < one.losses.front() - 1.0);  // it learns

  double max_abs = 0, max_mom = 0;
  REQUIRE(one.params.size() == all.params.size());
  for (size_t i = 0; i < one.params.size(); ++i)
    for (size_t j = 0; j < one.params[i].size(); ++j)
      max_abs = std::max(max_abs, (double)std::fabs(one.params[i][j] - all.params[i][j]));
  // The state is laid out like the shards: gathered, it is the same at any world
  // size (what lets a checkpoint resume Muon at another world size).
  REQUIRE(one.momentum.size() == all.momentum.size());
  for (size_t u = 0; u < one.momentum.size(); ++u) {
    REQUIRE(one.momentum[u].size() == all.momentum[u].size());
    for (size_t j = 0; j < one.momentum[u].size(); ++j)
      max_mom = std::max(max_mom, (double)std::fabs(one.momentum[u][j] - all.momentum[u][j]));
  }
  MESSAGE("muon, world " << world << ": max |param difference| " << max_abs << ", max |momentum difference| "
                         << max_mom << "; Muon exchange " << most_sent << " floats sent per rank per step (most)");
  CHECK(max_abs < 1e-4);
  CHECK(max_mom < 1e-4);
  CHECK(one.floats_sent_per_step == 0);
  if (world > 1) CHECK(most_sent > 0);
}

TEST_CASE("Muon: saved at np N, resumed on one rank: the same trajectory; same world size: bit for bit") {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm solo;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 0 ? 0 : MPI_UNDEFINED, 0, &solo);
  SharedRunDir straight_dir, saved_dir;
  std::vector<double> straight, resumed_solo, resumed_other;
  if (solo != MPI_COMM_NULL) {  // 20 steps straight on one rank; and 10, save, resume, 10
    auto comm = make_mpi_comm(solo);
    Config c = tiny_muon_deck(1);
    c.run.dir = straight_dir.path.string();
    straight = train(*muon_session(c, *comm), 0, 20);
    {
      auto first = muon_session(c, *comm);
      train(*first, 0, 10);
      REQUIRE(save_checkpoint(*first, solo, 10, 0).ok);
    }
    auto again = muon_session(c, *comm);
    load_checkpoint(*again, solo, checkpoint_path(checkpoint_dir(c), 10));
    CHECK(again->optimizer.steps_taken() == 10);
    resumed_solo = train(*again, 10, 20);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  {  // 10 steps on every rank, save
    auto comm = make_mpi_comm(MPI_COMM_WORLD);
    Config c = tiny_muon_deck(world);
    c.run.dir = saved_dir.path.string();
    auto session = muon_session(c, *comm);
    train(*session, 0, 10);
    REQUIRE(save_checkpoint(*session, MPI_COMM_WORLD, 10, 0).ok);
  }
  if (solo != MPI_COMM_NULL) {  // resume on one rank
    auto comm = make_mpi_comm(solo);
    Config c = tiny_muon_deck(1);
    c.run.dir = saved_dir.path.string();
    auto session = muon_session(c, *comm);
    const CheckpointInfo info = load_checkpoint(*session, solo, checkpoint_path(checkpoint_dir(c), 10));
    CHECK(info.world_size_at_save == world);
    CHECK(info.optimizer == "muon");
    resumed_other = train(*session, 10, 20);
    MPI_Comm_free(&solo);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank != 0) return;
  REQUIRE(straight.size() == 20);
  REQUIRE(resumed_solo.size() == 10);
  REQUIRE(resumed_other.size() == 10);
  int identical = 0;
  double worst = 0;
  for (int i = 0; i < 10; ++i) {
    identical += resumed_solo[i] == straight[10 + i];
    worst = std::max(worst, rel(resumed_other[i], straight[10 + i]));
  }
  MESSAGE("muon checkpoint: saved and resumed on 1 rank, " << identical << "/10 losses bit-identical; saved on "
                                                           << world << ", resumed on 1: worst relative difference "
                                                           << worst);
  CHECK(identical == 10);
  CHECK(worst < 1e-5);
}

}  // TEST_SUITE
