// device.cu — device queries and the NCCL bootstrap over MPI.
#include <cuda_runtime.h>
#include <nccl.h>

#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    cudaError_t cuda_status_ = (call);                                                         \
    if (cuda_status_ != cudaSuccess)                                                           \
      ::shardlm::fatal(::shardlm::fmt("%s failed at %s:%d: %s", #call, __FILE__, __LINE__,     \
                                      cudaGetErrorString(cuda_status_)));                      \
  } while (0)

#define NCCL_CHECK(call)                                                                       \
  do {                                                                                         \
    ncclResult_t nccl_status_ = (call);                                                        \
    if (nccl_status_ != ncclSuccess)                                                           \
      ::shardlm::fatal(::shardlm::fmt("%s failed at %s:%d: %s", #call, __FILE__, __LINE__,     \
                                      ncclGetErrorString(nccl_status_)));                      \
  } while (0)

namespace shardlm {

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  // No driver or no device is not an error here: the CPU backend is chosen.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void cuda_set_device(int device) { CUDA_CHECK(cudaSetDevice(device)); }

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

struct NcclComm {
  ncclComm_t comm = nullptr;
  int size = 0;
};

void NcclCommDeleter::operator()(NcclComm* c) const {
  if (c && c->comm) ncclCommDestroy(c->comm);
  delete c;
}

NcclCommPtr nccl_comm_create(MPI_Comm comm) {
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  ncclUniqueId id;
  if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm));
  NcclCommPtr out(new NcclComm);
  out->size = size;
  NCCL_CHECK(ncclCommInitRank(&out->comm, size, id, rank));
  return out;
}

int nccl_comm_size(const NcclComm& comm) { return comm.size; }

}  // namespace shardlm
