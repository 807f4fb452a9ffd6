// test_comm.cpp — the MPI Comm's typed collectives (src/comm/mpi.cpp) under
// mpirun -np 1/2/3/4: bf16 all-gathers and broadcasts move bits exactly, and the
// bf16 reduce-scatter (a custom MPI_Op: fp32 sums, one rounding per combination)
// really sums; select_comm refuses NCCL on the CPU backend.
#include <doctest/doctest.h>

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/error.hpp"
#include "model/hf.hpp"
#include "shardlm/runtime.hpp"

using namespace shardlm;

TEST_SUITE("comm") {

TEST_CASE("MPI Comm: bf16 all-gather and broadcast move bits; the bf16 reduce-scatter sums") {
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  const int P = comm->size(), r = comm->rank();
  const int64_t n = 1001;
  auto value = [](int rank, int64_t i) { return f32_to_bf16_rne(float(rank) + 0.25f * float(i % 97) - 3.0f); };

  std::vector<uint16_t> shard(n), full(n * P, 0xffff);
  for (int64_t i = 0; i < n; ++i) shard[i] = value(r, i);
  comm->all_gather(shard.data(), full.data(), n, DType::BF16).wait();
  int64_t wrong = 0;
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < n; ++i) wrong += full[p * n + i] != value(p, i);
  CHECK(wrong == 0);

  // Small integers: every partial sum is exact in bf16, so the result is the sum
  // whatever order MPI combines in; a max, a copy or a byte-wise op would differ.
  std::vector<uint16_t> contrib(n * P), reduced(n, 0xffff);
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < n; ++i) contrib[p * n + i] = f32_to_bf16_rne(float((r + 2 * p + i) % 7));
  comm->reduce_scatter(contrib.data(), reduced.data(), n, DType::BF16).wait();
  wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int q = 0; q < P; ++q) sum += float((q + 2 * r + i) % 7);
    wrong += reduced[i] != f32_to_bf16_rne(sum);
  }
  CHECK(wrong == 0);

  // A sum that bf16 must round: 1 + 2^-8 from two ranks is a tie between 1 and
  // 1 + 2^-7; the op rounds once, to even (1.0), as the device does.
  if (P == 2) {
    std::vector<uint16_t> a(2, f32_to_bf16_rne(r == 0 ? 1.0f : 0.00390625f)), out(1);
    comm->reduce_scatter(a.data(), out.data(), 1, DType::BF16).wait();
    CHECK(bf16_to_f32(out[0]) == 1.0f);
  }

  const int root = P - 1;
  std::vector<float> payload(n);
  for (int64_t i = 0; i < n; ++i) payload[i] = r == root ? 0.5f * float(i) : -1.0f;
  comm->broadcast(payload.data(), n, DType::F32, root).wait();
  wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += payload[i] != 0.5f * float(i);
  CHECK(wrong == 0);
}

TEST_CASE("select_comm: the CPU backend uses MPI and refuses comm.backend = nccl") {
  Runtime rt;
  rt.backend = "cpu";
  rt.role_comm = MPI_COMM_WORLD;
  CHECK(select_comm(rt, "auto") == "mpi");
  CHECK(select_comm(rt, "mpi") == "mpi");
  CHECK_THROWS_WITH_AS(select_comm(rt, "nccl"), doctest::Contains("comm.backend = \"nccl\" but this run is on the CPU"),
                       Error);
}

}  // TEST_SUITE
