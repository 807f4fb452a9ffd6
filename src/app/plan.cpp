// app/plan.cpp — the run's memory plan and its check against the machine (plan.hpp).
#include "app/plan.hpp"

#include <algorithm>

#include "checkpoint/async.hpp"
#include "broadcast/broadcast.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/memory.hpp"
#include "train/engine.hpp"
#include "train/state.hpp"
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

namespace {

// The ranks of this node that share one GPU.
int ranks_per_gpu(const Runtime& rt) {
  const int ndev = std::max(cuda_device_count(), 1);
  return (rt.local_size + ndev - 1) / ndev;
}

// The GPU's memory, or device.memory_limit_gib when lower.
int64_t gpu_memory_bytes(const Runtime& rt, const Config& config) {
  int64_t gpu_bytes = cuda_device_memory_bytes(rt.device);
  if (config.device.memory_limit_gib > 0)
    gpu_bytes = std::min<int64_t>(gpu_bytes, static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
  return gpu_bytes;
}

}  // namespace

int64_t offload_gpu_units(const Config& config, const ModelLayout& layout, const Backend& backend, int64_t gpu_bytes) {
  if (state_placement_for(config) != StatePlacement::Offload) return 0;
  const double cap_gib = config.model.optim_gpu_state_gib;
  const int64_t cap = cap_gib < 0 ? INT64_MAX : static_cast<int64_t>(cap_gib * 1073741824.0);
  int64_t budget = cap_gib < 0 ? 0 : cap;
  if (gpu_bytes > 0) {
    Config offloaded = config;
    offloaded.model.optim_gpu_units = 0;
    const int64_t rest = run_memory_plan(offloaded, layout, backend).device_total();
    // What the plan does not count: the CUDA context, cuBLAS/cuDNN/NCCL
    // workspaces, the allocator's fragmentation.
    const int64_t margin = (int64_t(4) << 30) + gpu_bytes / 32;
    budget = std::min(cap, std::max<int64_t>(0, gpu_bytes - rest - margin));
  }
  return offload_device_units_within(layout, optimizer_states(config.optim), budget);
}

int64_t gpu_bytes_per_rank(const Runtime& rt, const Config& config) {
  if (rt.backend != "cuda") return 0;
  return gpu_memory_bytes(rt, config) / ranks_per_gpu(rt);
}

std::string resolve_offload_split(const Runtime& rt, Config& config) {
  if (state_placement_for(config) != StatePlacement::Offload) return "";
  const ModelLayout layout(model_config_for(config), rt.num_trainers);
  const int64_t gpu_bytes = gpu_bytes_per_rank(rt, config);
  config.model.optim_gpu_units = offload_gpu_units(config, layout, *make_cuda_backend(), gpu_bytes);
  return offload_split_line(config, layout, gpu_bytes);
}

std::string offload_split_line(const Config& config, const ModelLayout& layout, int64_t gpu_bytes) {
  if (state_placement_for(config) != StatePlacement::Offload) return "";
  const int units = static_cast<int>(layout.units.size());
  const int on_gpu = static_cast<int>(config.model.optim_gpu_units);
  const int states = optimizer_states(config.optim);
  const double gib = 1073741824.0;
  std::string how = config.model.optim_gpu_state_gib < 0
                        ? (gpu_bytes > 0 ? fmt("what the plan leaves of %.2f GiB per rank", double(gpu_bytes) / gib)
                                         : std::string("no GPU here to size it against: decided at start-up"))
                        : fmt("model.optim_gpu_state_gib = %g", config.model.optim_gpu_state_gib);
  auto name = [&](int u) { return layout.units[size_t(u)].name.c_str(); };
  std::string split = on_gpu == 0 ? std::string("none on the GPU")
                                  : fmt("units 0..%d (%s..%s) on the GPU, %.3f MiB", on_gpu - 1, name(0),
                                        name(on_gpu - 1),
                                        double(offload_device_unit_bytes(layout, states, on_gpu)) / 1048576.0);
  split += on_gpu == units ? std::string(", none offloaded")
                           : fmt(", units %d..%d (%s..%s) offloaded to the CPU optimizer", on_gpu, units - 1,
                                 name(on_gpu), name(units - 1));
  return fmt("offload split: optimizer state of %d of %d units on the GPU (%s): %s\n", on_gpu, units, how.c_str(),
             split.c_str());
}

void refuse_plan_over_machine(const Runtime& rt, const Config& config) {
  const ModelLayout layout(model_config_for(config), rt.num_trainers, config.model.expert_parallel);
  const bool cuda = rt.backend == "cuda";
  const MemoryPlan plan = run_memory_plan(config, layout, cuda ? *make_cuda_backend() : *make_cpu_backend());
  const int64_t gpu_bytes = cuda ? gpu_memory_bytes(rt, config) : 0;
  const std::string e =
      plan_fit_error(plan, rt.local_size, machine_host_memory(), cuda ? ranks_per_gpu(rt) : 1, gpu_bytes);
  SHARDLM_CHECK(e.empty(), "%s: %s", config.deck_path.c_str(), e.c_str());
}

}  // namespace shardlm
