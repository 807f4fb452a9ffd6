// cuda.hpp — what host code may ask of the CUDA side without seeing CUDA types.
//
// Owns: the device queries and the device communicators. In a CPU-only build these
// report "no CUDA" (src/cuda_stub.cpp); the CUDA build implements them in
// src/cuda/device.cu. Knows nothing about the deck or the model.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "shardlm/comm.hpp"

namespace shardlm {

bool cuda_built();
int cuda_device_count();                 // 0 when none is usable (or CPU-only build)
void cuda_set_device(int device);
std::string cuda_device_name(int device);

// The unit loop's Comm for a GPU backend over the ranks of `host`: all_gather and
// reduce_scatter take device buffers; the small collectives go through `host`.
//   kind "nccl": NCCL on its own stream, ordered against `compute_stream` (a
//     cudaStream_t) with events; the unique id is made by rank 0 and sent with
//     host.broadcast (MPI: no other rendezvous). A watchdog turns an NCCL error,
//     or a collective older than timeout_s, into a clear abort.
//   kind "mpi": MPI through two pinned host buffers of staging_bytes each, for
//     several ranks sharing one GPU (NCCL refuses two ranks on one device).
std::unique_ptr<Comm> make_device_comm(Comm& host, const std::string& kind, void* compute_stream,
                                       int64_t staging_bytes, double timeout_s);

}  // namespace shardlm
