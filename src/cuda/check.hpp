// check.hpp — CUDA_CHECK, the one check of CUDA runtime calls in shardlm: a call
// that fails throws shardlm::Error naming the call, the file and line, and the
// runtime's reason ("CUDA error: cudaMemcpyAsync(...) failed at src/cuda/device.cu:12:
// an illegal memory access was encountered"); main()'s handler reports it once and
// aborts the job. After every kernel launch: CUDA_CHECK(cudaGetLastError()).
// Where a throw cannot be reported (a destructor, code that runs before main() has
// its handler) the caller catches it and calls fatal() instead, and says so there
// (device.cu).
// Must not know: anything but the CUDA runtime's status codes.
#pragma once

#include <cuda_runtime.h>

#include "shardlm/error.hpp"

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    const cudaError_t cuda_status_ = (call);                                               \
    if (cuda_status_ != cudaSuccess)                                                       \
      throw ::shardlm::Error(::shardlm::fmt("CUDA error: %s failed at %s:%d: %s", #call,   \
                                            __FILE__, __LINE__,                            \
                                            cudaGetErrorString(cuda_status_)));            \
  } while (0)
