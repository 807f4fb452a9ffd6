// test_runtime.cpp — rank discovery, local ranks and the MPMD role split.
// Runs under mpirun -np 1/2/4 and as an MPMD job (2 trainers : 1 receiver).
#include <doctest/doctest.h>

#include <mpi.h>

#include <algorithm>
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
