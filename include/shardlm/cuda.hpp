// cuda.hpp — what host code may ask of the CUDA side without seeing CUDA types.
//
// Owns: the device queries, the device communicators, and plain device buffers
// and copies for host code that moves bytes but computes nothing (the RL weight
// broadcast and its receiver). In a CPU-only build these report "no CUDA"
// (src/no_cuda.cpp); the CUDA build implements them in src/cuda/device.cu and
// src/cuda/comm_cuda.cu. Knows nothing about the deck or the model.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "shardlm/comm.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/offload_device.hpp"

namespace shardlm {

bool cuda_built();
int cuda_device_count();                 // 0 when none is usable (or CPU-only build)
void cuda_set_device(int device);
std::string cuda_device_name(int device);
int64_t cuda_device_memory_bytes(int device);  // total memory of `device`; 0 without CUDA
int cuda_current_device();                     // the device this thread is bound to; 0 without CUDA

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

// Device memory on the current device, counted in device_memory() under `category`
// like the backend's. Throws Error when the device is out of memory.
void* cuda_malloc(Mem category, int64_t bytes);
void cuda_free(Mem category, void* ptr, int64_t bytes);
// dst <- src (`bytes`; host or device on either side), queued on `stream` (a
// cudaStream_t; nullptr: the legacy default stream) after the work already
// there. cuda_synchronize(stream) waits for it (a copy to the host is only
// readable after that).
void cuda_copy_async(void* dst, const void* src, int64_t bytes, void* stream);
// The fp32 residual stream's first rows (model.residual_dtype = "fp32"): out
// (n, C) fp32 <- the elements of each token's embedding row that lie in this
// rank's shard [shard_begin, shard_begin + shard_numel) of the flat table
// (row-major, C a row), 0 elsewhere and for a token < 0. ids, shard and out in
// device memory; queued on `stream`. owned_rows (train/engine.hpp) is its host
// twin; summed over the ranks the rows are the masters' exactly.
void cuda_owned_rows(float* out, const int32_t* ids, int64_t n, const float* shard, int64_t shard_begin,
                     int64_t shard_numel, int64_t C, void* stream);
void cuda_synchronize(void* stream);
// The weight broadcast's checksum (bf16_checksum, broadcast/broadcast.hpp) of n bf16
// values in device memory at flat indices [begin, begin + n), computed on
// `stream` and waited for: bit-equal to the host's for the same bits.
// sum_scratch: kChecksumScratchBytes of device memory the caller owns (planned
// with its buffers: nothing is allocated per call).
inline constexpr int64_t kChecksumScratchBytes = 256;
uint64_t cuda_bf16_checksum(const void* values, int64_t begin, int64_t n, void* sum_scratch, void* stream);
// Page-locks host memory the caller owns (cudaHostRegister), so copies to and
// from it run at the link's speed; false when it cannot (the memory stays
// pageable: copies stay correct, only slower). Undone by cuda_unpin_host.
bool cuda_pin_host(void* p, int64_t bytes);
void cuda_unpin_host(void* p);

// The offload pipeline's copies and sums of squares beside `compute_stream` (a
// cudaStream_t) on the current device, for a model of `units` units.
std::unique_ptr<OffloadDevice> make_cuda_offload_device(void* compute_stream, int units);
}  // namespace shardlm
