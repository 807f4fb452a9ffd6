// cuda.hpp — what host code may ask of the CUDA side without seeing CUDA types.
//
// Owns: the device queries and the NCCL bootstrap. In a CPU-only build these
// report "no CUDA" (src/cuda_stub.cpp); the CUDA build implements them in
// src/cuda/device.cu. Knows nothing about the deck or the model.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

namespace shardlm {

bool cuda_built();
int cuda_device_count();                 // 0 when none is usable (or CPU-only build)
void cuda_set_device(int device);
std::string cuda_device_name(int device);

// An NCCL communicator over the ranks of `comm`; the unique id is made by rank 0
// and sent with MPI_Bcast (no other rendezvous). Opaque to host code.
struct NcclComm;
struct NcclCommDeleter { void operator()(NcclComm*) const; };
using NcclCommPtr = std::unique_ptr<NcclComm, NcclCommDeleter>;
NcclCommPtr nccl_comm_create(MPI_Comm comm);
int nccl_comm_size(const NcclComm& comm);

}  // namespace shardlm
