// device.cu — device queries.
#include <cuda_runtime.h>

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


}  // namespace shardlm
