// cuda_stub.cpp — the CUDA entry points of a CPU-only build: no devices.
#include "shardlm/backend.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void cuda_set_device(int) { SHARDLM_FAIL("this shardlm was built without CUDA"); }
std::string cuda_device_name(int) { return "none"; }
struct NcclComm {};
void NcclCommDeleter::operator()(NcclComm* c) const { delete c; }
NcclCommPtr nccl_comm_create(MPI_Comm) { SHARDLM_FAIL("this shardlm was built without CUDA (no NCCL)"); }
int nccl_comm_size(const NcclComm&) { return 0; }
std::unique_ptr<Backend> make_cuda_backend() { SHARDLM_FAIL("this shardlm was built without CUDA"); }

}  // namespace shardlm
