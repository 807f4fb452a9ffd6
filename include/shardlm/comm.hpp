// comm.hpp — the collectives sharded training needs, behind one interface.
//
// Owns: Comm (all_gather, reduce_scatter, all_reduce, broadcast, barrier; the two
// big ones asynchronous; all_to_all_v for Muon's owner exchange) and its MPI
// implementation for host buffers. The NCCL
// implementation (src/cuda/) takes device buffers only. Knows nothing about the
// model: it moves counted floats between ranks.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

namespace shardlm {

// A collective in flight; wait() completes it (a no-op when already done).
class CommRequest {
 public:
  CommRequest() = default;
  explicit CommRequest(MPI_Request r) : request_(r) {}
  void wait();
  bool pending() const { return request_ != MPI_REQUEST_NULL; }

 private:
  MPI_Request request_ = MPI_REQUEST_NULL;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // full(size * count) <- every rank's shard(count), in rank order.
  virtual CommRequest all_gather(const float* shard, float* full, int64_t count) = 0;
  // shard(count) <- sum over ranks of full[rank * count, (rank + 1) * count).
  virtual CommRequest reduce_scatter(const float* full, float* shard, int64_t count) = 0;
  virtual void all_reduce_sum(double* values, int64_t count) = 0;
  virtual void all_reduce_sum(int64_t* values, int64_t count) = 0;
  virtual void broadcast(void* bytes, int64_t count, int root) = 0;
  virtual void barrier() = 0;
  // Personalised exchange: this rank sends send[send_displs[p], + send_counts[p])
  // to every rank p and receives p's block into recv[recv_displs[p], + recv_counts[p]).
  // Each array has size() entries; this rank's send_counts[p] must equal rank p's
  // recv_counts[this rank]. Blocking. It only moves data, so it is exact. Muon uses
  // it to gather each matrix to its owner and to return the update's slices.
  virtual void all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs,
                            float* recv, const int64_t* recv_counts, const int64_t* recv_displs) = 0;
};

// MPI over an existing communicator (not owned). Reductions use MPI's fixed
// algorithm for a given size, so results are reproducible run to run.
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm);
// One rank, no MPI at all (single-process tools and unit tests).
std::unique_ptr<Comm> make_self_comm();

}  // namespace shardlm
