// agree.hpp — every collective phase of a save, load or export ends
// agreed by all ranks.
//
// Owns: agreed(comm, phase): the phase runs on every rank and is followed by
// one all-reduce; if any rank failed, every rank throws the lowest failing
// rank's error with its type (Error, CheckpointDamaged, CheckpointMismatch), so
// no rank walks into the next collective alone. Plus the small MPI helpers the
// checkpoint files share. Knows MPI and the checkpoint's error types; knows
// nothing about HDF5, files or the training state.
#pragma once

#include <mpi.h>

#include <exception>
#include <filesystem>
#include <string>

#include "checkpoint/checkpoint.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"  // MPI_CHECK

namespace shardlm::ckpt {

enum class FaultKind : int { None = 0, Error = 1, Damaged = 2, Mismatch = 3 };

struct Outcome {
  FaultKind kind = FaultKind::None;
  std::string message;
};

// Collective: returns when no rank failed; else throws the first failing rank's error on every rank.
void rethrow_agreed(MPI_Comm comm, const Outcome& mine);

template <class F>
void agreed(MPI_Comm comm, F&& phase) {
  Outcome mine;
  try {
    phase();
  } catch (const CheckpointMismatch& e) {
    mine = {FaultKind::Mismatch, e.what()};
  } catch (const CheckpointDamaged& e) {
    mine = {FaultKind::Damaged, e.what()};
  } catch (const std::exception& e) {
    mine = {FaultKind::Error, e.what()};
  }
  rethrow_agreed(comm, mine);
}

// MPI_Allreduce / MPI_Bcast under the communicator's collective watch
// (comm.timeout_s: a rank that never arrives ends the job, named).
void allreduce(MPI_Comm comm, const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op);
void bcast(MPI_Comm comm, void* buf, int count, MPI_Datatype type, int root);

int comm_rank(MPI_Comm comm);
int comm_size(MPI_Comm comm);
// `value` of rank `root` on every rank.
std::string bcast_string(MPI_Comm comm, std::string value, int root = 0);

[[noreturn]] void throw_damaged(const std::filesystem::path& file, const std::string& why);

}  // namespace shardlm::ckpt
