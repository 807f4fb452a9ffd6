// no_cuda.cpp — what a build without nvcc links in place of every .cu file
// (src/*/*.cu: the CUDA backend and kernels, the device training state, the GPU
// decoder): no devices, and each factory fails with a sentence saying this
// shardlm was built without CUDA. The Makefile makes the choice, here and only
// here; it stands above every folder so that it may name their interfaces.
#include "shardlm/backend.hpp"
#include "shardlm/cuda.hpp"
#include "cuda/newton_schulz.hpp"
#include "infer/decoder_cuda.hpp"
#include "train/state.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void cuda_set_device(int) { SHARDLM_FAIL("this shardlm was built without CUDA"); }
std::string cuda_device_name(int) { return "none"; }
int64_t cuda_device_memory_bytes(int) { return 0; }
int cuda_current_device() { return 0; }
std::unique_ptr<Comm> make_device_comm(Comm&, const std::string&, void*, int64_t, double) {
  SHARDLM_FAIL("this shardlm was built without CUDA (no device communicator)");
}
std::unique_ptr<Backend> make_cuda_backend() { SHARDLM_FAIL("this shardlm was built without CUDA"); }
void* cuda_malloc(Mem, int64_t) { SHARDLM_FAIL("this shardlm was built without CUDA (no device memory)"); }
void cuda_free(Mem, void*, int64_t) {}
void cuda_copy_async(void*, const void*, int64_t, void*) { SHARDLM_FAIL("this shardlm was built without CUDA"); }
void cuda_synchronize(void*) {}
void cuda_owned_rows(float*, const int32_t*, int64_t, const float*, int64_t, int64_t, int64_t, void*) {
  SHARDLM_FAIL("this shardlm was built without CUDA");
}
uint64_t cuda_bf16_checksum(const void*, int64_t, int64_t, void*, void*) {
  SHARDLM_FAIL("this shardlm was built without CUDA");
}
bool cuda_pin_host(void*, int64_t) { return false; }
void cuda_unpin_host(void*) {}
NsWorkspaceBytes cuda_newton_schulz_bytes(const NsCapacity&) { return {}; }
std::unique_ptr<Orthogonalizer> make_cuda_orthogonalizer(const NsCapacity&) {
  SHARDLM_FAIL("this shardlm was built without CUDA (no GPU Newton–Schulz for Muon)");
}

std::unique_ptr<OffloadDevice> make_cuda_offload_device(void*, int) {
  SHARDLM_FAIL("this shardlm was built without CUDA (model.optim_cpu_offload's pipeline needs a GPU)");
}
std::unique_ptr<TrainingState> make_cuda_device_state(ShardedModel&, Optimizer&, const OptimSection&, Backend&) {
  SHARDLM_FAIL("this shardlm was built without CUDA (device-resident training state needs a GPU backend)");
}
std::unique_ptr<DeviceUnits> make_cuda_device_units(ShardedModel&, Optimizer&, const OptimSection&, Backend&, int,
                                                    std::vector<float*>) {
  SHARDLM_FAIL("this shardlm was built without CUDA (device-resident training state needs a GPU backend)");
}

DecoderPlan plan_cuda_decoder(const ModelConfig&, const DecoderLimits&) {
  SHARDLM_FAIL("this shardlm was built without CUDA (no plan for the GPU decoder)");
}

std::unique_ptr<Decoder> make_cuda_decoder(const InferenceModel&, const DecoderLimits&) {
  SHARDLM_FAIL("this shardlm was built without CUDA (generate on the GPU needs a CUDA build; use device.backend = "
               "\"cpu\" or --device cpu)");
}

}  // namespace shardlm
