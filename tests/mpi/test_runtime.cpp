// test_runtime.cpp — rank discovery, local ranks and the MPMD role split.
// Runs under mpirun -np 1/2/4 and as an MPMD job (2 trainers : 1 receiver).
#include <doctest/doctest.h>

#include <mpi.h>

#include <algorithm>
#include <string>
#include <vector>

#include "shardlm/runtime.hpp"

using namespace shardlm;

TEST_SUITE("runtime") {

TEST_CASE("ranks and sizes agree with MPI_COMM_WORLD") {
  Runtime rt = runtime_init(nullptr, nullptr);
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(rt.world_rank == rank);
  CHECK(rt.world_size == size);
  // Every world rank appears exactly once.
  std::vector<int> all(size);
  MPI_Allgather(&rt.world_rank, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::sort(all.begin(), all.end());
  for (int i = 0; i < size; ++i) CHECK(all[i] == i);
  MPI_Comm_free(&rt.role_comm);
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
}

TEST_CASE("local ranks: one node here, so local rank = rank, and they are 0..local_size-1") {
  Runtime rt = runtime_init(nullptr, nullptr);
  CHECK(rt.local_size == rt.world_size);  // the test job runs on one host
  CHECK(rt.local_rank == rt.world_rank);
  std::vector<int> locals(rt.world_size);
  MPI_Allgather(&rt.local_rank, 1, MPI_INT, locals.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::sort(locals.begin(), locals.end());
  for (int i = 0; i < rt.world_size; ++i) CHECK(locals[i] == i);
  MPI_Comm_free(&rt.role_comm);
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
}

TEST_CASE("one node: every rank counts 1 node, and the placement line names this host with ranks and local ranks") {
  Runtime rt = runtime_init(nullptr, nullptr);
  CHECK(rt.num_nodes == 1);
  CHECK(std::string(world_rank_host(rt.world_size - 1)) == rt.hostname);
  CHECK(std::string(world_rank_host(rt.world_size)) == "?");
  std::string ranks, locals;
  for (int r = 0; r < rt.world_size; ++r) {
    ranks += (r ? "," : "") + std::to_string(r);
    locals += (r ? "," : "") + std::to_string(r);
  }
  const std::string expected = std::to_string(rt.world_size) + (rt.world_size == 1 ? " rank" : " ranks") +
                               " on 1 node | " + rt.hostname + ": ranks " + ranks + " local " + locals;
  CHECK(placement_summary(rt) == expected);
  MPI_Comm_free(&rt.role_comm);
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
}

TEST_CASE("a receiving subcommand makes a receiver; the trainers come first") {
  // Under srun every task has MPI_APPNUM 0: the subcommand decides. Here the last
  // world rank asks to receive (at one rank: nobody trains, which main refuses).
  const int world = [] { int s = 0; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }();
  const int me = [] { int r = 0; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }();
  int* appnum = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
  const bool launcher_receives = flag && appnum && *appnum != 0;
  int any_launched_receiver = launcher_receives;  // the same on every rank: runtime_init is collective
  MPI_Allreduce(MPI_IN_PLACE, &any_launched_receiver, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  Runtime rt = runtime_init(nullptr, nullptr, me == world - 1 ? Role::Receive : Role::Train);
  CHECK((rt.role == Role::Receive) == (me == world - 1 || launcher_receives));
  CHECK(rt.trainers_first);
  CHECK(rt.num_receivers >= 1);
  MPI_Comm_free(&rt.role_comm);
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
  if (world > 1 && !any_launched_receiver) {  // world rank 0 receiving: the order is wrong
    Runtime bad = runtime_init(nullptr, nullptr, me == 0 ? Role::Receive : Role::Train);
    CHECK(!bad.trainers_first);
    MPI_Comm_free(&bad.role_comm);
    if (bad.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&bad.broadcast_comm);
  }
}

TEST_CASE("roles follow MPI_APPNUM; trainer and broadcast communicators are right") {
  Runtime rt = runtime_init(nullptr, nullptr);
  int* appnum = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
  const int expected_app = (flag && appnum) ? *appnum : 0;
  CHECK(rt.appnum == expected_app);
  CHECK((rt.role == Role::Train) == (expected_app == 0));

  // Count each role independently of the runtime and compare.
  int is_trainer = expected_app == 0, trainers = 0;
  MPI_Allreduce(&is_trainer, &trainers, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(rt.num_trainers == trainers);
  CHECK(rt.num_receivers == rt.world_size - trainers);
  CHECK(rt.size == (rt.role == Role::Train ? trainers : rt.world_size - trainers));

  // Trainer ranks are ordered like world ranks, so trainer 0 is world rank 0.
  if (rt.role == Role::Train) {
    int world_rank_of_trainer0 = rt.world_rank;
    MPI_Bcast(&world_rank_of_trainer0, 1, MPI_INT, 0, rt.role_comm);
    CHECK(world_rank_of_trainer0 == 0);
  }
  // Broadcast communicator: trainer 0 (as its rank 0) plus every receiver.
  const bool should_join = rt.num_receivers > 0 && (rt.role == Role::Receive || rt.rank == 0);
  CHECK((rt.broadcast_comm != MPI_COMM_NULL) == should_join);
  if (rt.broadcast_comm != MPI_COMM_NULL) {
    int bsize = 0, brank = -1;
    MPI_Comm_size(rt.broadcast_comm, &bsize);
    MPI_Comm_rank(rt.broadcast_comm, &brank);
    CHECK(bsize == 1 + rt.num_receivers);
    CHECK((brank == 0) == (rt.role == Role::Train));
    int from_root = rt.role == Role::Train ? 4242 : 0;
    MPI_Bcast(&from_root, 1, MPI_INT, 0, rt.broadcast_comm);
    CHECK(from_root == 4242);
    MPI_Comm_free(&rt.broadcast_comm);
  }
  MPI_Comm_free(&rt.role_comm);
}

TEST_CASE("the CPU backend is chosen when no GPU is visible or cpu is asked for") {
  Runtime rt = runtime_init(nullptr, nullptr);
  select_device(rt, "cpu");
  CHECK(rt.backend == "cpu");
  CHECK(rt.device == -1);
  MPI_Comm_free(&rt.role_comm);
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
}

}  // TEST_SUITE
