// run/plan.cpp — the run's memory plan and its check against the machine (plan.hpp).
#include "run/plan.hpp"

#include <algorithm>

#include "checkpoint/async.hpp"
#include "comm/broadcast.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/memory.hpp"
#include "train/engine.hpp"
#include "train/eval.hpp"
#include "train/optim.hpp"
#include "train/train.hpp"

namespace shardlm {

MemoryPlan run_memory_plan(const Config& config, const ModelLayout& layout, const Backend& backend) {
  MemoryPlan plan = plan_memory(layout.config, layout.world, engine_options_for(config),
                                optimizer_states(config.optim), backend);
  plan.host_workspace += output_workspace_bytes(config, layout) + optimizer_workspace_bytes(config.optim, layout);
  const NsWorkspaceBytes gpu_ns = optimizer_gpu_workspace_bytes(config.optim, layout, config.device.backend == "cuda");
  plan.workspace += gpu_ns.device;
  plan.host_workspace += gpu_ns.pinned_host;
  plan.workspace += broadcast_device_bytes(config, layout);  // one gathered bf16 unit while broadcasting (GPU)
  plan.checkpoint_snapshot = checkpoint_snapshot_bytes(config, layout);  // ckpt.async on host state
  plan.checkpoint_snapshot_flexible = plan.checkpoint_snapshot - checkpoint_snapshot_floor(config, layout);
  if (saves_async(config) && config.device.backend == "cuda" && !config.model.optim_cpu_offload)
    plan.checkpoint_device_snapshot = checkpoint_state_bytes(config, layout);  // where the GPU has room
  return plan;
}

int64_t data_reader_bytes(const Config& config, int64_t vocab_size, std::string* note) {
  int64_t bytes = 0;
  try {
    if (config.loss.type == "sft") {
      bytes += TokenDataset(data_spec_for(config, vocab_size)).memory().total();
    }
    if (!config.eval.path.empty()) bytes += EvalSet(config, vocab_size).data().memory().total();
  } catch (const Error& e) {
    if (note) *note = fmt("data reader: not planned: %s\n", e.what());
  }
  return bytes;
}

void refuse_plan_over_machine(const Runtime& rt, const Config& config) {
  const ModelLayout layout(model_config_for(config), rt.num_trainers);
  const bool cuda = rt.backend == "cuda";
  const MemoryPlan plan = run_memory_plan(config, layout, cuda ? *make_cuda_backend() : *make_cpu_backend());
  int64_t gpu_bytes = 0;
  int ranks_per_gpu = 1;
  if (cuda) {
    gpu_bytes = cuda_device_memory_bytes(rt.device);
    if (config.device.memory_limit_gib > 0)
      gpu_bytes = std::min<int64_t>(gpu_bytes, static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
    const int ndev = std::max(cuda_device_count(), 1);
    ranks_per_gpu = (rt.local_size + ndev - 1) / ndev;
  }
  const std::string e = plan_fit_error(plan, rt.local_size, machine_host_memory(), ranks_per_gpu, gpu_bytes);
  SHARDLM_CHECK(e.empty(), "%s: %s", config.deck_path.c_str(), e.c_str());
}

}  // namespace shardlm
