// device.cu — device queries, and plain device buffers and copies for host code.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/check.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {
namespace {

// CUDA_CHECK's failure, reported by fatal() (the message, then MPI_Abort) where a
// throw could not be: runtime_init calls cuda_set_device and cuda_device_name
// before main() has its handler, and destructors call cuda_free.
template <class F>
void or_fatal(F&& checked_calls) {
  try {
    checked_calls();
  } catch (const Error& e) {
    fatal(e.what());
  }
}

}  // namespace

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

void cuda_set_device(int device) {
  or_fatal([&] { CUDA_CHECK(cudaSetDevice(device)); });
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  or_fatal([&] { CUDA_CHECK(cudaGetDeviceProperties(&prop, device)); });
  return prop.name;
}

int cuda_current_device() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int64_t cuda_device_memory_bytes(int device) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return static_cast<int64_t>(prop.totalGlobalMem);
}

void* cuda_malloc(Mem category, int64_t bytes) {
  void* p = nullptr;
  device_mem_admit(category, bytes);
  const cudaError_t e = cudaMalloc(&p, size_t(std::max<int64_t>(bytes, 256)));
  SHARDLM_CHECK(e == cudaSuccess, "out of GPU memory allocating %.1f MiB for %s: %s", double(bytes) / 1048576.0,
                mem_name(category), cudaGetErrorString(e));
  device_mem_track(category, bytes);
  return p;
}

void cuda_free(Mem category, void* ptr, int64_t bytes) {
  if (!ptr) return;
  or_fatal([&] { CUDA_CHECK(cudaFree(ptr)); });  // waits for the device work that may still use it
  device_mem_track(category, -bytes);
}

void cuda_copy_async(void* dst, const void* src, int64_t bytes, void* stream) {
  if (bytes == 0) return;
  // cudaMemcpyDefault: unified addressing tells host from device, so one call
  // serves the broadcast's device-to-device and device-to-host copies.
  CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void cuda_synchronize(void* stream) { CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

bool cuda_pin_host(void* p, int64_t bytes) {
  if (!p || bytes <= 0) return false;
  const cudaError_t e = cudaHostRegister(p, size_t(bytes), cudaHostRegisterDefault);
  if (e != cudaSuccess) cudaGetLastError();  // clear it: the memory stays pageable
  return e == cudaSuccess;
}

void cuda_unpin_host(void* p) {
  if (p && cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}


}  // namespace shardlm
