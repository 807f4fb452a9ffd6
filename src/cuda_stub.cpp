// cuda_stub.cpp — the CUDA entry points of a CPU-only build: no devices.
#include "shardlm/backend.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void cuda_set_device(int) { SHARDLM_FAIL("this shardlm was built without CUDA"); }
std::string cuda_device_name(int) { return "none"; }
std::unique_ptr<Comm> make_device_comm(Comm&, const std::string&, void*, int64_t, double) {
  SHARDLM_FAIL("this shardlm was built without CUDA (no device communicator)");
}
std::unique_ptr<Backend> make_cuda_backend() { SHARDLM_FAIL("this shardlm was built without CUDA"); }

}  // namespace shardlm
