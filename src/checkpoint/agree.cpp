// checkpoint_agree.cpp — collective phases agreed by all ranks (checkpoint_agree.hpp).
#include "checkpoint/agree.hpp"

#include <cstdint>

namespace shardlm::ckpt {

void rethrow_agreed(MPI_Comm comm, const Outcome& mine) {
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int candidate = mine.kind == FaultKind::None ? size : rank, first = size;
  MPI_CHECK(MPI_Allreduce(&candidate, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == size) return;
  int kind = static_cast<int>(mine.kind);
  int64_t length = static_cast<int64_t>(mine.message.size());
  MPI_CHECK(MPI_Bcast(&kind, 1, MPI_INT, first, comm));
  MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT64_T, first, comm));
  std::string message = mine.message;
  message.resize(static_cast<size_t>(length));
  MPI_CHECK(MPI_Bcast(message.data(), static_cast<int>(length), MPI_CHAR, first, comm));
  switch (static_cast<FaultKind>(kind)) {
    case FaultKind::Damaged: throw CheckpointDamaged(message);
    case FaultKind::Mismatch: throw CheckpointMismatch(message);
    default: throw Error(message);
  }
}

int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &r));
  return r;
}
int comm_size(MPI_Comm comm) {
  int s = 1;
  MPI_CHECK(MPI_Comm_size(comm, &s));
  return s;
}

std::string bcast_string(MPI_Comm comm, std::string value, int root) {
  int64_t length = static_cast<int64_t>(value.size());
  MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT64_T, root, comm));
  value.resize(static_cast<size_t>(length));
  MPI_CHECK(MPI_Bcast(value.data(), static_cast<int>(length), MPI_CHAR, root, comm));
  return value;
}

void throw_damaged(const std::filesystem::path& file, const std::string& why) {
  throw CheckpointDamaged(fmt("checkpoint %s is damaged or unreadable: %s", file.c_str(), why.c_str()));
}

}  // namespace shardlm::ckpt
