// mpi_world.hpp — this process's rank and the rank count of MPI_COMM_WORLD, for
// the MPI suites (tests/mpi) that split work or compare results by rank.
#pragma once

#include <mpi.h>

namespace shardlm_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace shardlm_test
