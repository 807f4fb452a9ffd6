// comm.hpp — the collectives sharded training needs, behind one interface.
//
// Owns: Comm (all_gather, reduce_scatter, all_reduce, broadcast, barrier; the two
// big ones asynchronous and typed (fp32 or bf16); all_to_all_v for Muon's owner
// exchange; ring_exchange and split for context parallelism's ring) and its MPI implementation for host buffers. The device
// implementations (src/cuda/comm_cuda.cu: NCCL, and MPI staged through pinned host
// memory for several ranks on one GPU) take device buffers for the two big ones,
// and host buffers for the small host-side collectives. Knows nothing about the
// model: it moves counted elements between ranks.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

#include "shardlm/dtype.hpp"

namespace shardlm {

// Element type of the unit loop's collectives: fp32 (CPU parameters, gradients)
// or bf16 (GPU parameters; gradients with model.reduce_dtype = "bf16").

class Comm;
class CollectiveWatch;

// A collective in flight; wait() completes it (a no-op when already done). For
// MPI it waits on the host (watched: see set_collective_timeout); for a device
// Comm it orders the compute stream after the collective (no host synchronisation).
class CommRequest {
 public:
  CommRequest() = default;
  explicit CommRequest(MPI_Request r, CollectiveWatch* watch = nullptr, const char* what = "", int64_t seq = 0)
      : request_(r), watch_(watch), what_(what), seq_(seq) {}
  // A send and a receive completed together (ring_exchange), under one watch.
  CommRequest(MPI_Request send, MPI_Request recv, CollectiveWatch* watch, const char* what, int64_t seq)
      : request_(send), request2_(recv), watch_(watch), what_(what), seq_(seq) {}
  CommRequest(Comm* owner, int64_t ticket) : owner_(owner), ticket_(ticket) {}
  void wait();
  bool pending() const { return request_ != MPI_REQUEST_NULL || request2_ != MPI_REQUEST_NULL || owner_ != nullptr; }

 private:
  MPI_Request request_ = MPI_REQUEST_NULL;
  MPI_Request request2_ = MPI_REQUEST_NULL;
  CollectiveWatch* watch_ = nullptr;  // the MPI Comm's watchdog, and what it waits for
  const char* what_ = "";
  int64_t seq_ = 0;
  Comm* owner_ = nullptr;  // device Comm that completes ticket_
  int64_t ticket_ = -1;
};

// comm.timeout_s for the MPI Comm's host collectives (0, the default: wait as
// long as MPI does). A collective not complete after this long asks the other
// ranks of its communicator which collective they wait in, then aborts the job
// with one line naming the collective and the ranks that did not arrive (a
// stopped, dead or stuck rank); NCCL has its own watchdog (cuda.hpp).
void set_collective_timeout(double seconds);
// Waits for a collective started on `comm` outside a Comm (the checkpoint's
// agreements: MPI_Iallreduce and the like) under the same watch as the Comm's
// collectives on that communicator. `what` names it in the message.
void wait_collective(MPI_Comm comm, MPI_Request* request, const char* what);
// The two sides of an RL job (the trainers, the inference ranks) meet on one
// link communicator: trainer rank 0 and the inference ranks, the weight
// broadcast's. Waiting for the other side is watched by that side's progress
// and bounded by data.rollout_timeout_s, never ended because one collective
// outlasted comm.timeout_s:
//   - a rank waiting on the link answers its own side's queries as busy (its
//     side waits on for it), and asks the other side where it is after
//     comm.timeout_s; that side answers at its progress points (decode steps,
//     the reward program's wait, micro-batches, its own collectives), and one
//     that gives no answer for another comm.timeout_s is stopped, dead or stuck:
//     the job ends naming it and its side;
//   - a rank waiting in a collective of its own side answers the link's queries
//     as busy;
//   - the whole wait on the link ends the job past `bound_s` seconds.
void mark_link_communicator(MPI_Comm link);
// Waits for `request`, an operation with the other side started on `link`
// (marked as the link); `what` names it and must be the same on both sides.
// watch_peers = false: the other side is not asked where it is, only bound_s
// ends the wait (the trainers' setup, minutes at 8B, answers nobody).
void wait_for_other_side(MPI_Comm link, MPI_Request* request, const char* what, double bound_s,
                         bool watch_peers = true);
// For a rank of the link waiting for the other side outside any collective
// (trainer rank 0 polling for rollout files), called as it polls, `waited_s`
// into the wait: every comm.timeout_s it asks the other side where it is, and
// ends the job naming the ranks that give no answer within comm.timeout_s.
// Does nothing on a rank that is not on a link.
void watch_other_side(const char* what, double waited_s);
// Where a peer that answered a timed-out collective's query is, relative to
// collective `what` #seq on this rank: in it, in the next ones (it finished
// this one: a collective can complete on one rank first, e.g. a broadcast's
// root), not yet at it, in a different collective of the same number (the
// ranks called different things: a bug), or busy outside any collective
// (their_seq < 0). The collective watch's message is built from these.
enum class PeerPlace { Waiting, Ahead, Behind, Mismatch, Busy };
PeerPlace where_is_peer(const char* what, int64_t seq, const char* their_what, int64_t their_seq);
// Answers the queries other ranks sent this one while it is busy outside any
// collective, in `busy_in` (an Activity that is making progress: watchdog.hpp).
// The asker keeps waiting for a busy rank instead of ending the job. Main thread only.
void answer_collective_queries(const char* busy_in);

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True when all_gather and reduce_scatter take device buffers (the device Comms).
  virtual bool device_buffers() const { return false; }
  // full(size * count) <- every rank's shard(count), in rank order.
  virtual CommRequest all_gather(const void* shard, void* full, int64_t count, DType type) = 0;
  // shard(count) <- sum over ranks of full[rank * count, (rank + 1) * count).
  // bf16 sums are formed in fp32 and rounded once per hop (MPI) or as NCCL does.
  virtual CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType type) = 0;
  CommRequest all_gather(const float* shard, float* full, int64_t count) {
    return all_gather(shard, full, count, DType::F32);
  }
  CommRequest reduce_scatter(const float* full, float* shard, int64_t count) {
    return reduce_scatter(full, shard, count, DType::F32);
  }
  // buf (count of `type`) from `root` to every rank, in place; device Comms take
  // device buffers (the RL weight broadcast on GPUs). Asynchronous like the two above.
  virtual CommRequest broadcast(void* buf, int64_t count, DType type, int root) = 0;
  // Device Comms: make the compute stream wait for collective `ticket` (CommRequest::wait).
  virtual void complete(int64_t ticket) { (void)ticket; }
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

  // The personalised exchange on device buffers (the device Comms; expert
  // parallelism's rows on the GPU), in bytes: this rank sends
  // send[send_displs[p], + send_bytes[p]) to rank p and receives p's block into
  // recv[recv_displs[p], + recv_bytes[p]); the counts on the host, size()
  // entries each, matching across ranks as all_to_all_v's. Ordered on the
  // compute stream after the kernels queued before it, and the kernels queued
  // after it see the received bytes (NCCL: one group of sends and receives on the
  // comm stream; staged MPI: through pinned host memory, the host waiting).
  // `send` and `recv` must not overlap; recv's span up to the farthest block's
  // end may be written whole (the staged copy back), so its blocks should tile it.
  virtual void all_to_all_v_device(const void* send, const int64_t* send_bytes, const int64_t* send_displs,
                                   void* recv, const int64_t* recv_bytes, const int64_t* recv_displs);
  // Context parallelism's ring: send `bytes` bytes of `send` to rank + 1 and
  // receive as many from rank - 1 into `recv` (ranks modulo size()), started
  // now and completed by wait(), so the caller computes on one block while the
  // next one travels. Every rank of the communicator calls it, in the same
  // order (it is numbered and watched as a collective: a rank that never sends
  // ends the job naming it). Host buffers for the MPI Comm, device buffers for
  // the device Comms (NCCL send/recv on their stream; staged MPI through pinned
  // host memory, one exchange in flight); `send` and `recv` must not overlap.
  virtual CommRequest ring_exchange(const void* send, void* recv, int64_t bytes);
  // The ranks with the same `color`, ordered by `key`: a new communicator
  // (collective over this one). Context parallelism's groups.
  virtual std::unique_ptr<Comm> split(int color, int key);
};

// MPI over an existing communicator (not owned). Reductions use MPI's fixed
// algorithm for a given size, so results are reproducible run to run.
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm);
// One rank, no MPI at all (single-process tools and unit tests).
std::unique_ptr<Comm> make_self_comm();

}  // namespace shardlm
