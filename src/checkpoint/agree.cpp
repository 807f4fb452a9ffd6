// agree.cpp — collective phases agreed by all ranks (checkpoint/agree.hpp).
#include "checkpoint/agree.hpp"

#include <cstdint>

#include "shardlm/comm.hpp"

namespace shardlm::ckpt {

void rethrow_agreed(MPI_Comm comm, const Outcome& mine) {
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int candidate = mine.kind == FaultKind::None ? size : rank, first = size;
  allreduce(comm, &candidate, &first, 1, MPI_INT, MPI_MIN);
  if (first == size) return;
  int kind = static_cast<int>(mine.kind);
  int64_t length = static_cast<int64_t>(mine.message.size());
  bcast(comm, &kind, 1, MPI_INT, first);
  bcast(comm, &length, 1, MPI_INT64_T, first);
  std::string message = mine.message;
  message.resize(static_cast<size_t>(length));
  bcast(comm, message.data(), static_cast<int>(length), MPI_CHAR, first);
  switch (static_cast<FaultKind>(kind)) {
    case FaultKind::Damaged: throw CheckpointDamaged(message);
    case FaultKind::Mismatch: throw CheckpointMismatch(message);
    default: throw Error(message);
  }
}

void allreduce(MPI_Comm comm, const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op) {
  MPI_Request request;
  MPI_CHECK(MPI_Iallreduce(send, recv, count, type, op, comm, &request));
  wait_collective(comm, &request, "checkpoint all-reduce");
}

void bcast(MPI_Comm comm, void* buf, int count, MPI_Datatype type, int root) {
  MPI_Request request;
  MPI_CHECK(MPI_Ibcast(buf, count, type, root, comm, &request));
  wait_collective(comm, &request, "checkpoint broadcast");
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
  bcast(comm, &length, 1, MPI_INT64_T, root);
  value.resize(static_cast<size_t>(length));
  bcast(comm, value.data(), static_cast<int>(length), MPI_CHAR, root);
  return value;
}

void throw_damaged(const std::filesystem::path& file, const std::string& why) {
  throw CheckpointDamaged(fmt("checkpoint %s is damaged or unreadable: %s", file.c_str(), why.c_str()));
}

}  // namespace shardlm::ckpt
