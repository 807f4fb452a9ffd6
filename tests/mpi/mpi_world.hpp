// mpi_world.hpp — this process's rank and the rank count of MPI_COMM_WORLD, for
// the MPI suites (tests/mpi) that split work or compare results by rank, and a
// scratch directory every rank shares.
#pragma once

#include <doctest/doctest.h>
#include <mpi.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

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

// A fresh directory every rank sees (rank 0 makes it); removed by the destructor.
struct SharedDir {
  std::filesystem::path path;
  SharedDir() {
    std::string made;
    if (world_rank() == 0) {
      char templ[] = "/tmp/shardlm-test-XXXXXX";
      REQUIRE(mkdtemp(templ) != nullptr);
      made = templ;
    }
    int n = static_cast<int>(made.size());
    MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
    made.resize(size_t(n));
    MPI_Bcast(made.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
    path = made;
  }
  ~SharedDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(path);
  }
  std::filesystem::path ckpt() const { return path / "checkpoints"; }
};

}  // namespace shardlm_test
